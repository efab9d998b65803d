"""pytest-llmload's pytest plugin (entry point ``pytest11: llmload``): the whole plugin surface in one place.

Every option, ini key and marker is declared here (each help text is defined once, beside the code that reads
it); the sub-plugins in ``SUB_PLUGINS`` add hooks only. Fixtures are in :mod:`pytest_llmload.fixtures`.

One naming rule: every option, ini key, marker and fixture starts with ``llmload`` (``--llmload-...``,
``llmload_...``), except the names the README promises as this plugin's vocabulary (the fixtures ``gpu_model``,
``lora_model``, ``distributed_env``; the markers ``needs_gpus`` and ``gpu``) and ``limit_torch_memory``, named after
pytest-memray's ``limit_memory``.

This module is imported on every pytest run of a repo that has the plugin installed, so it imports
nothing heavy: torch and the Hugging Face stack load only when a fixture asks for them.
"""

from __future__ import annotations

import os
import sys

import pytest

from pytest_llmload import hung_loader, loading, markers, per_test
from pytest_llmload.diagnostics import known_failures as known_failure_report
from pytest_llmload.diagnostics import memory_limit, report
from pytest_llmload.runners import isolated_marker, launcher, lifeline, xdist_gpus
from pytest_llmload.fixtures import (  # noqa: F401  (pytest discovers fixtures on the plugin module)
    distributed_env,
    gpu_model,
    llmload_checkpoint,
    llmload_checkpoint_factory,
    llmload_device,
    llmload_load,
    llmload_loader,
    llmload_check_options,
    llmload_offline,
    llmload_tokenizer,
    hook_choice_key,
    loader_choice_key,
    lora_model,
)

# The sub-plugins, loaded one way: their hooks only. Every option, ini key and marker is declared below.
# Registered in pytest_addoption rather than named in `pytest_plugins`: pytest would mark them for assertion
# rewriting when this module has imported them already, and warn about it on every run of every project.
SUB_PLUGINS = (
    isolated_marker,  # llmload_isolated: the test body in a forked child
    report,  # phase tables, device-map summaries, the session summary
    memory_limit,  # limit_torch_memory
    hung_loader,  # after the loader hangs once, the rest fail at once instead of waiting
    xdist_gpus,  # under pytest -n: each xdist worker its own GPUs
    per_test,  # offline mode, and DeepSpeed without its op build, only while the tests that need them run
    launcher,  # under torchrun/srun/mpirun: distributed_env tests on every rank
)


STRICT_HELP = (
    "count a check that could not judge the loader (skipped 'not exercised: ...', e.g. nothing was offloaded, "
    "the 4-bit request was ignored) as a failure. Precedence: --llmload-strict, then the ini key."
)
strict_key = pytest.StashKey[bool]()
EXPECTED_FAILURES_INI = "llmload_expected_failed_checks"


def pytest_addoption(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    for module in SUB_PLUGINS:
        if not pluginmanager.is_registered(module):
            pluginmanager.register(module, module.__name__)
    group = parser.getgroup("llmload", "pytest-llmload: Hugging Face model-loading regression checks")
    group.addoption("--llmload-loader", dest="llmload_loader", metavar="MODULE:FUNCTION", help=loading.LOADER_HELP)
    parser.addini(loading.INI_KEY, help=loading.LOADER_HELP, default=None)
    group.addoption(loading.HOOK_OPTION, dest="llmload_training_args_hook", metavar="MODULE:FUNCTION",
                    help=loading.HOOK_HELP)
    parser.addini(loading.HOOK_INI, help=loading.HOOK_HELP, default=None)
    parser.addini(loading.PURPOSES_INI, help=loading.PURPOSES_HELP, type="linelist", default=[])
    parser.addini(markers.GPU_FIXTURES_INI, help=markers.GPU_FIXTURES_HELP, type="linelist", default=[])
    parser.addini(
        EXPECTED_FAILURES_INI, type="linelist", default=[],
        help="known gaps of the configured loader, one 'check_name: reason' a line: the shipped suite "
        "(pytest --pyargs pytest_llmload.suite) runs them as strict xfails.",
    )
    group.addoption(
        "--llmload-progress", dest="llmload_progress", metavar="PATH",
        help="append one JSON line per test outcome to PATH (used by 'python -m pytest_llmload').",
    )
    group.addoption("--llmload-strict", dest="llmload_strict", action="store_true", default=None, help=STRICT_HELP)
    parser.addini("llmload_strict", type="bool", default=False, help=STRICT_HELP)
    group.addoption(report.PROGRESS_OPTION, dest="llmload_phase_progress", metavar="SECONDS",
                    help=report.PROGRESS_HELP)
    parser.addini(report.PROGRESS_INI, help=report.PROGRESS_HELP, default=None)
    parser.addini(report.NEAR_DEADLINE_INI, help=report.NEAR_DEADLINE_HELP, default=None)
    group.addoption(hung_loader.WAIT_OPTION, dest="llmload_wait_after_hang", action="store_true", default=False,
                    help=hung_loader.WAIT_HELP)
    group.addoption(xdist_gpus.OPTION, dest="llmload_gpus_per_worker", metavar="K|off", help=xdist_gpus.HELP)
    parser.addini(xdist_gpus.INI, help=xdist_gpus.HELP, default=None)


def pytest_configure(config: pytest.Config) -> None:
    lifeline.tie_to_main_job()  # under the main job: end with it, and stop cleanly on SIGTERM
    config.addinivalue_line("markers", markers.NEEDS_GPUS_HELP)
    config.addinivalue_line("markers", markers.GPU_HELP)
    config.addinivalue_line("markers", markers.DEEPSPEED_HELP)
    config.addinivalue_line("markers", isolated_marker.ISOLATED_HELP)
    config.addinivalue_line("markers", memory_limit.HELP)
    try:
        choice = loading.choose_loader(
            config.getoption("llmload_loader"), os.environ, config.getini(loading.INI_KEY)
        )
        hook = loading.choose_training_args_hook(config.getoption("llmload_training_args_hook"),
                                                 config.getini(loading.HOOK_INI))
        if config.getini(loading.PURPOSES_INI):
            loading.parse_purposes(config.getini(loading.PURPOSES_INI), f"ini '{loading.PURPOSES_INI}'")
    except loading.LoaderSpecError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[loader_choice_key] = choice
    config.stash[hook_choice_key] = hook
    if config.getini(EXPECTED_FAILURES_INI):  # checked here, a usage error, not a collection error of the suite
        from pytest_llmload.conformance import check_params, parse_expected_failures

        source = f"ini '{EXPECTED_FAILURES_INI}'"
        try:
            check_params(expected_failed_checks=parse_expected_failures(config.getini(EXPECTED_FAILURES_INI), source))
        except pytest.UsageError as exc:
            raise pytest.UsageError(str(exc) if str(exc).startswith(source) else f"{source}: {exc}") from None
    option = config.getoption("llmload_strict")
    try:
        config.stash[strict_key] = bool(option if option is not None else config.getini("llmload_strict"))
    except (ValueError, pytest.UsageError) as exc:  # pytest's own words name the value, not the key
        raise pytest.UsageError(f"ini 'llmload_strict': {exc}; use true or false.") from None
    if config.getoption("llmload_progress") and not hasattr(config, "workerinput"):
        from pytest_llmload import progress  # only the main job asks for it: plugin load stays cheap

        path = config.getoption("llmload_progress")
        try:
            writer = progress.ProgressWriter(path)
        except OSError as exc:
            raise pytest.UsageError(f"--llmload-progress {path!r} cannot be opened for appending "
                                    f"({type(exc).__name__}: {exc.strerror}); name a file in a directory that "
                                    "exists.") from None
        config.stash[progress.progress_key] = writer
        config.pluginmanager.register(writer, "llmload-progress")


def pytest_unconfigure(config: pytest.Config) -> None:
    progress = sys.modules.get("pytest_llmload.progress")
    writer = None if progress is None else config.stash.get(progress.progress_key, None)
    if writer is not None:
        config.pluginmanager.unregister(writer)
        writer.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    from pytest_llmload.header import header_lines  # imported when the header is printed, not at plugin load

    return header_lines(config.stash[loader_choice_key])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    markers.mark_gpu_tests(config, items)
    # A configured loader (or training-args hook) is imported only if a collected test uses it, and then before
    # any test runs: a spec that does not import is one usage error, not an error repeated on every test.
    used = set().union(*(getattr(item, "fixturenames", ()) for item in items))
    _check_imports(config, used)


def pytest_sessionstart(session: pytest.Session) -> None:
    # An xdist controller collects nothing; it checks the specs itself so that workers never hit a usage
    # error (which xdist reports as a crash).
    config = session.config
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        _check_imports(config, _IMPORTED_FOR)


# The fixture that imports each configured spec, and where the spec is kept.
_IMPORTED_FOR = {"llmload_loader": loader_choice_key, "llmload_check_options": hook_choice_key}


def _check_imports(config: pytest.Config, used_fixtures) -> None:
    for fixture, key in _IMPORTED_FOR.items():
        choice = config.stash.get(key, None)
        if fixture in used_fixtures and choice is not None and not choice.is_reference:
            try:
                loading.import_loader(choice)
            except loading.LoaderSpecError as exc:
                raise pytest.UsageError(str(exc)) from None


def pytest_collection_finish(session: pytest.Session) -> None:
    # DeepSpeed's import (seconds) is paid here, outside any test's deadline, and only when a collected test
    # will start DeepSpeed; its ranks, forked later, inherit it. (They never build DeepSpeed's CPU comm op: see
    # runners/ranks.py.)
    if any(markers.will_start_deepspeed(item) for item in session.items):
        from importlib.util import find_spec

        if find_spec("deepspeed") is not None:
            from pytest_llmload.runners import ranks as distributed

            try:
                distributed.preload(("deepspeed", "deepspeed.comm.torch"))
            except Exception as exc:  # DS_ACCELERATOR='tpu', say: the DeepSpeed tests error with it, not the run
                session.config.stash[per_test.deepspeed_error_key] = distributed.deepspeed_setup_error(exc)


def pytest_runtest_setup(item: pytest.Item) -> None:
    markers.enforce_needs_gpus(item)
    hung_loader.fail_if_hung_before(item)


@pytest.hookimpl(wrapper=True, trylast=True)  # innermost: the known-failure section comes before the sub-plugins' ones
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    known_failure_report.annotate(item, call, report)
    if report.skipped and item.config.stash.get(strict_key, False) and isinstance(report.longrepr, tuple):
        from pytest_llmload.failures.base import NOT_EXERCISED

        reason = report.longrepr[2].removeprefix("Skipped: ")
        if reason.startswith(NOT_EXERCISED):
            report.outcome = "failed"
            report.longrepr = f"llmload strict: a check that exercised nothing is a failure here: {reason}"
    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    for line in known_failure_report.summary_lines(config):
        terminalreporter.write_line(line)
