"""pytest-llmload's pytest plugin (entry point ``pytest11: llmload``): what pytest imports on every run.

Most runs of a repo that installs the plugin never use it, so at start-up this module imports only the plugin's
vocabulary (:mod:`pytest_llmload.config.vocabulary`: every option, ini key and marker, declared here) and its fixtures
(:mod:`pytest_llmload.plugin.fixtures`). The sub-plugins that do the work (:data:`SUB_PLUGINS`) are each registered
once, as a light gate (:class:`_Gate`), and each is switched on by one stash flag, set where the run's need becomes
known; the gate imports and registers its module the first time it finds the flag set:

- :data:`in_use_key`, the sub-plugins every use of the plugin needs: set when the run configures the plugin (one of
  its options, ini keys or ``$PYTEST_LLMLOAD_LOADER`` set: a bad value is then a usage error at once), runs under
  ``pytest -n`` (the controller sums up what its workers report) or under torchrun/srun/mpirun, or, after
  collection, when a collected test uses an llmload fixture or marker, or the test modules imported the plugin's
  checks (``parametrize_with_loader_checks``);
- :data:`xdist_controller_key` (``pytest -n``'s controller), :data:`launched_key` (torchrun/srun/mpirun): one
  sub-plugin each.

A failing test is matched against the known failures in every run (the catalog is imported on the first failure).
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from typing import TYPE_CHECKING

import pytest

from pytest_llmload.config import vocabulary
from pytest_llmload.plugin.fixtures import (  # noqa: F401  (pytest discovers fixtures on the plugin module)
    configuration_of,
    distributed_env,
    gpu_model,
    llmload_check_options,
    llmload_checkpoint,
    llmload_checkpoint_factory,
    llmload_device,
    llmload_load,
    llmload_loader,
    llmload_offline,
    llmload_tokenizer,
    lora_model,
)
from pytest_llmload.config.stash_keys import checks_key, configuration_key, prediction_key

if TYPE_CHECKING:
    from pytest_llmload.reports.row import Row

# The flags that switch the sub-plugins on: what this run needs, each set where that becomes known.
in_use_key = pytest.StashKey[bool]()  # the run uses the plugin (configures it, xdist's controller, a launcher, a test)
xdist_controller_key = pytest.StashKey[bool]()  # pytest -n's controller (pytest_cmdline_main)
launched_key = pytest.StashKey[bool]()  # under torchrun/srun/mpirun (pytest_cmdline_main)

XDIST_GPUS = "pytest_llmload.plugin.xdist_gpus"  # under pytest -n: each xdist worker its own GPUs
LAUNCHER = "pytest_llmload.plugin.launched_run"  # under torchrun/srun/mpirun: distributed_env tests on every rank

# What marks a test as an llmload test: every llmload fixture requests llmload_offline, except these two.
_FIXTURE_ROOTS = ("llmload_offline", "llmload_device", "llmload_check_options")
_MARKERS = frozenset({"needs_gpus", "gpu", vocabulary.DEEPSPEED_MARKER, vocabulary.ISOLATED_MARKER,
                      vocabulary.MEMORY_LIMIT_MARKER})

# The sub-plugins, by module name (their hooks only: every option, ini key and marker is declared in
# config.vocabulary), and the one flag that switches each on.
SUB_PLUGINS = {
    "pytest_llmload.plugin.isolated_marker": in_use_key,  # llmload_isolated: the test body in a forked child
    "pytest_llmload.reports.sections": in_use_key,  # phase tables, device-map summaries, the session summary
    "pytest_llmload.plugin.memory_limit": in_use_key,  # limit_torch_memory
    "pytest_llmload.plugin.loader_hang": in_use_key,  # after the loader hangs once, the rest fail at once
    "pytest_llmload.plugin.phase_state": in_use_key,  # markers enforced; offline mode, DeepSpeed only where needed
    "pytest_llmload.reports.html_report": in_use_key,  # --llmload-html, pytest-html extras: device maps, memory
    XDIST_GPUS: xdist_controller_key,
    LAUNCHER: launched_key,
}
# The two a run needs before it configures (xdist asks xdist_gpus for `-n auto`'s count in its own
# pytest_cmdline_main; a launcher's rank meets the others at configure, first): their gates are registered in
# pytest_cmdline_main, the others' in pytest_configure, after the flags a configuration sets.
_BEFORE_CONFIGURE = (XDIST_GPUS, LAUNCHER)

header_shown_key = pytest.StashKey[bool]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_llmload.plugin import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    from pytest_llmload.config import settings

    settings.register(parser)


class _Gate:
    """A sub-plugin as the run registers it, once: a light stand-in that imports and registers the module (the one
    place any sub-plugin is registered) the first time it finds the module's flag set: when the gate is
    registered, or after collection. A module registered after configure has its ``pytest_configure`` called at
    once (pytest replays the historic hook)."""

    def __init__(self, module: str) -> None:
        self.module = module

    def open(self, config: pytest.Config) -> None:
        if config.stash.get(SUB_PLUGINS[self.module], False) and not config.pluginmanager.has_plugin(self.module):
            from importlib import import_module

            config.pluginmanager.register(import_module(self.module), self.module)

    @pytest.hookimpl(trylast=True)  # after this plugin's own, which sets the flag when a collected test uses it
    def pytest_collection_modifyitems(self, config: pytest.Config) -> None:
        self.open(config)


def _register_gates(config: pytest.Config, modules) -> None:
    for module in modules:
        gate = _Gate(module)
        config.pluginmanager.register(gate, f"{module} (gate)")
        gate.open(config)


def _under_xdist_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput") and bool(getattr(config.option, "numprocesses", None)
                                                       or getattr(config.option, "tx", None))


def _configured(config: pytest.Config) -> bool:
    """Any of the plugin's settings (an option, an ini key, ``$PYTEST_LLMLOAD_LOADER``) given in this run."""
    from pytest_llmload.config import settings

    return settings.any_given(config)


@pytest.hookimpl(wrapper=True)  # before xdist's own (tryfirst) one, which asks xdist_gpus for `-n auto`'s count
def pytest_cmdline_main(config: pytest.Config):
    # Every launcher sets MASTER_ADDR and MASTER_PORT (launcher.detect reads the rest).
    config.stash[launched_key] = bool(os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"))
    config.stash[xdist_controller_key] = _under_xdist_controller(config)
    if config.stash[launched_key] or config.stash[xdist_controller_key]:
        config.stash[in_use_key] = True
    _register_gates(config, _BEFORE_CONFIGURE)
    return (yield)


def pytest_configure(config: pytest.Config) -> None:
    if vocabulary.PARENT_ENV in os.environ:  # started by the main job: end with it, stop cleanly on SIGTERM
        from pytest_llmload.runners import lifeline

        lifeline.tie_to_main_job()
    for line in (vocabulary.NEEDS_GPUS_HELP, vocabulary.GPU_HELP, vocabulary.DEEPSPEED_HELP, vocabulary.ISOLATED_HELP,
                 vocabulary.MEMORY_LIMIT_HELP):
        config.addinivalue_line("markers", line)
    from pytest_llmload.config import settings

    every_setting = settings.every_setting(config)  # read once, here
    if any(found is not None for found in every_setting.values()):  # else the reference loader, no hook, defaults:
        config.stash[in_use_key] = True  # nothing to check, nothing to import
        _read_configuration(config, every_setting)
    # A row in pytest's own report files (JUnit XML, pytest-reportlog's), written where they are: not by a worker.
    if not hasattr(config, "workerinput") and (getattr(config.option, "xmlpath", None)
                                               or getattr(config.option, "report_log", None)):
        from pytest_llmload.reports.pytest_report_files import RowsInReportFiles

        config.pluginmanager.register(RowsInReportFiles(config), "llmload-report-files")
    _register_gates(config, (module for module in SUB_PLUGINS if module not in _BEFORE_CONFIGURE))


def _read_configuration(config: pytest.Config, every_setting: dict) -> None:
    """Every setting read once at configure: a bad value is one usage error before any test runs; what the run's
    readers share, into its one :class:`~pytest_llmload.config.stash_keys.Configuration`."""
    from pytest_llmload.config import settings
    from pytest_llmload.plugin.fixtures import read_configuration

    writer = _progress_writer(config)  # first: a check spec that gives no checks, below, is told through it
    config.stash[configuration_key] = read_configuration(config, every_setting)
    extra = settings.given(config, "checks")
    # The repo's own checks, this run: a spec that gives none is a usage error now. A run that writes progress (the
    # main job's) reads every check here, installed packages' too: a broken one is the main job's usage error,
    # before any test runs, and its parent, which imports no check, hears of it as the progress file's event.
    if extra or writer is not None:
        from pytest_llmload.plugin.check_registry import ExtensionError, every_check

        try:
            config.stash[checks_key] = every_check(*(extra or ()))
        except ExtensionError as exc:
            if writer is not None:
                writer.write(event="usage_error", message=str(exc))
            raise pytest.UsageError(str(exc)) from None
    expected = settings.given(config, "expected_failed_checks")
    if expected:  # a usage error here, not a collection error of the suite
        from pytest_llmload.plugin.parametrize import check_params, parse_expected_failures

        source = expected[1]
        try:
            check_params(checks=config.stash.get(checks_key, None),
                         expected_failed_checks=parse_expected_failures(*expected))
        except pytest.UsageError as exc:
            raise pytest.UsageError(str(exc) if str(exc).startswith(source) else f"{source}: {exc}") from None
    _read_prediction(config)


def _progress_writer(config: pytest.Config):
    """``--llmload-progress``'s writer, registered (closed at unconfigure), or ``None`` where the run writes no
    progress (the main job asks for it; an xdist worker's reports reach the controller's)."""
    from pytest_llmload.config import settings

    path = settings.value(config, "progress")
    if not path or hasattr(config, "workerinput"):
        return None
    from pytest_llmload.reports import progress  # only the main job asks for it

    try:
        writer = progress.ProgressWriter(path)
    except OSError as exc:
        raise pytest.UsageError(f"{settings.given(config, 'progress')[1]} {path!r} cannot be opened for appending "
                                f"({type(exc).__name__}: {exc.strerror}); name a file in a directory that "
                                "exists.") from None
    config.stash[progress.progress_key] = writer
    config.pluginmanager.register(writer, "llmload-progress")
    return writer


def pytest_unconfigure(config: pytest.Config) -> None:
    progress = sys.modules.get("pytest_llmload.reports.progress")
    writer = None if progress is None else config.stash.get(progress.progress_key, None)
    if writer is not None:
        config.pluginmanager.unregister(writer)
        writer.close()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The header line where the run configures the plugin; a run that only uses it gets the line after collection
    (:func:`pytest_collection_finish`), and a run that never uses it, none."""
    if not _configured(config):
        return []
    config.stash[header_shown_key] = True
    from pytest_llmload.reports.header import header_lines  # imported when the header is printed, not at plugin load

    return header_lines(config)


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if not config.stash.get(in_use_key, False):
        return
    from pytest_llmload.plugin import markers
    from pytest_llmload.config import settings

    # After -m/-k deselection: what the run will really run.
    markers.require_gpus(config, session.items, settings.value(config, "require_gpus"))
    if not config.option.collectonly:
        _start_gpu_less_server_early(session.items)
    if not config.stash.get(header_shown_key, False):
        from pytest_llmload.plugin.parametrize import loaders_of

        # (no loader configured: the checks' own loaders where parametrize_with_loader_checks gives them)
        _write_header(config, loaders_of(session.items))


def _start_gpu_less_server_early(items) -> bool:
    """Where a GPU is visible and a collected check starts gloo ranks that simulate a runner without GPUs, their
    GPU-less server (:func:`pytest_llmload.runners.warm_server.start_early`), started now: it imports the stack while
    the other checks run. Counts the GPUs (which imports torch where a driver exists) only where such a check is."""
    from pytest_llmload.runners import warm_server

    checks = [check for check in (getattr(getattr(item, "callspec", None), "params", {}).get("check") for item in items)
              if check is not None and warm_server.starts_gpu_less_ranks(check)]
    if not checks:
        return False
    from pytest_llmload.system import gpus

    return warm_server.start_early(checks, gpus.visible_gpu_count())


def _write_header(config: pytest.Config, loaders) -> None:
    """The header line, after collection: for a run that uses the plugin without configuring it."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and config.get_verbosity() >= 0:
        from pytest_llmload.reports.header import header_lines

        config.stash[header_shown_key] = True
        for line in header_lines(config, loaders):
            reporter.write_line(line)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids) -> None:
    """Under ``pytest -n`` the controller collects nothing: the header line comes with the first worker's
    collection where its test ids name checks (all the controller can see), unless it came first."""
    if not node.config.stash.get(header_shown_key, False):
        from pytest_llmload.plugin.parametrize import loaders_in_ids

        loaders = loaders_in_ids(ids)
        if loaders is not None:
            _write_header(node.config, loaders)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.stash.get(in_use_key, False):
        if not _uses_llmload(config, items):
            return
        config.stash[in_use_key] = True  # (the gates open after this hook: trylast)
    from pytest_llmload.plugin import markers

    _require_the_stack(config, items)
    markers.mark_gpu_tests(config, items)
    _shorter_timeout_wins(config, items)
    # A configured loader (or training-args hook) is imported only if a collected test uses it, and then before
    # any test runs: a spec that does not import is one usage error, not an error repeated on every test.
    used = set().union(*(getattr(item, "fixturenames", ()) for item in items))
    _check_imports(config, used)


def _shorter_timeout_wins(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A check carries its own deadline (``pytest.mark.timeout``), which pytest-timeout prefers to ``--timeout``; a
    run that asks for a shorter one (``--timeout=1``, the ini key) gets it: a check never runs longer than asked."""
    try:
        asked = config.getoption("timeout", None)
        if asked is None and config.getini("timeout"):
            asked = config.getini("timeout")
        asked = float(asked) if asked not in (None, "") else None
    except (ValueError, TypeError):  # pytest-timeout's own reading of its value says what is wrong
        return
    if not asked or asked <= 0:
        return
    for item in items:
        marker = item.get_closest_marker("timeout")
        if _check_of(item) is not None and marker is not None and marker.args and marker.args[0] > asked:
            item.add_marker(pytest.mark.timeout(asked), append=False)


def _require_the_stack(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A bare install (no extras) running tests that load models: one usage error naming the extra, not an error
    row per test saying ``No module named 'torch'``."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return
    users = [item for item in items if set(_FIXTURE_ROOTS).intersection(getattr(item, "fixturenames", ()))
             or getattr(getattr(item, "callspec", None), "params", {}).get("check") is not None]
    if users:
        raise pytest.UsageError(f"{len(users)} collected test(s) load models through pytest-llmload (e.g. "
                                f"{users[0].nodeid}), but torch is not installed: {vocabulary.STACK_EXTRA_HINT}.")


def _uses_llmload(config: pytest.Config, items: list[pytest.Item]) -> bool:
    from pytest_llmload.config import settings

    roots = {*_FIXTURE_ROOTS, *settings.value(config, "gpu_fixtures")}
    if any(roots.intersection(getattr(item, "fixturenames", ()))
           or any(mark.name in _MARKERS for mark in item.iter_markers()) for item in items):
        return True
    # Tests that use the package without its fixtures or markers (its checks through
    # parametrize_with_loader_checks, its phases, call_loader): their module or a conftest imported from it.
    modules = {id(m): m for m in (getattr(item, "module", None) for item in items) if m is not None}
    conftests = (p for p in config.pluginmanager.get_plugins()
                 if isinstance(p, types.ModuleType) and p.__name__.rpartition(".")[2] == "conftest")
    return any(_imports_llmload(module) for module in (*modules.values(), *conftests))


def _imports_llmload(module: types.ModuleType) -> bool:
    for value in list(vars(module).values()):
        if isinstance(value, types.ModuleType):
            name = value.__name__
        elif isinstance(value, (types.FunctionType, type)):
            name = getattr(value, "__module__", None)
        else:
            continue
        if isinstance(name, str) and (name == "pytest_llmload" or name.startswith("pytest_llmload.")):
            return True
    return False


def pytest_sessionstart(session: pytest.Session) -> None:
    # An xdist controller collects nothing; it checks the specs itself so that workers never hit a usage
    # error (which xdist reports as a crash).
    if _under_xdist_controller(session.config):
        _check_imports(session.config, _IMPORTED_FOR)


# The fixture that imports each configured spec, and the configuration's field that names the spec.
_IMPORTED_FOR = {"llmload_loader": "loader", "llmload_check_options": "training_args_hook"}


def _check_imports(config: pytest.Config, used_fixtures) -> None:
    configuration = config.stash.get(configuration_key, None)
    for fixture, field in _IMPORTED_FOR.items():
        choice = getattr(configuration, field, None)
        if fixture in used_fixtures and choice is not None and not choice.is_reference:
            from pytest_llmload.loader import seam
            from pytest_llmload.system.offline import offline

            try:  # (imported once: the fixtures and the checks take the same function)
                with offline(), _importing_within_limits(config, choice):  # (offline, as the checks run it)
                    getattr(configuration, f"{'hook' if field == 'training_args_hook' else field}_function")
            except seam.LoaderSpecError as exc:
                raise pytest.UsageError(str(exc)) from None


@contextlib.contextmanager
def _importing_within_limits(config: pytest.Config, choice):
    """A loader module's import, which runs its module-level code: a progress line every
    ``llmload_phase_progress_seconds`` while it runs long, and a usage error with its stacks past
    ``llmload_import_timeout`` (a module that waits on a lock or a network share is not a hang of the run)."""
    import time

    from pytest_llmload.config import settings
    from pytest_llmload.instruments.heartbeat import heartbeat, stderr_line
    from pytest_llmload.instruments.probes import DeadlineExceeded, deadline

    module = choice.spec.partition(":")[0]
    every, limit = settings.value(config, "phase_progress_seconds"), settings.value(config, "import_timeout")
    started, key = time.monotonic(), ("llmload-import", module)
    if every:
        heartbeat().schedule(key, every, lambda _: stderr_line(
            f"llmload: still importing the loader's module {module!r} ({time.monotonic() - started:.0f}s)"),
            every=every)
    try:
        with deadline(limit, f"importing the loader's module {module!r} ({choice.source})"):
            yield
    except DeadlineExceeded as exc:
        raise pytest.UsageError(f"{exc}\nMake importing {module!r} quick (no work at import: put it in the loader "
                                f"function), or raise --llmload-import-timeout.") from None
    finally:
        heartbeat().cancel(key)


@pytest.hookimpl(wrapper=True, trylast=True)  # innermost: the known-failure section comes before the sub-plugins' ones
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    check = _check_of(item)
    failed = report.failed and call.excinfo is not None  # (before --llmload-strict turns a skip into a failure)
    if report.skipped and configuration_of(item.config).strict and isinstance(report.longrepr, tuple):
        from pytest_llmload.checks.base import NOT_EXERCISED

        reason = report.longrepr[2].removeprefix("Skipped: ")
        if reason.startswith(NOT_EXERCISED):
            report.outcome = "failed"
            report.longrepr = f"llmload strict: a check that exercised nothing is a failure here: {reason}"
    elif report.passed and call.when == "call" and check is not None and configuration_of(item.config).strict:
        assumed = _assumptions(item)
        if assumed:  # a verdict that rests on an assumption judged nothing the repo showed
            report.outcome = "failed"
            report.longrepr = (f"llmload strict: a verdict that rests on an assumption is not judged here: "
                               f"{'; '.join(assumed)}")
    if check is not None and (call.when == "call" or not report.passed):
        row = _row(item, check, report, call)
        if row.cause == "check":  # the check's own crash: say so first, the traceback below
            report.longrepr = f"{row.sentence}\n\n{report.longreprtext}"
        _record(item, report, row.properties())
        item.ihook.pytest_llmload_check_result(item=item, check=check, result=row.as_dict())
        if row.verdict == "predicted" and not (row.prediction or {}).get("gated", True):
            report.outcome = "passed"  # reported, not failing: the repo does not gate on this runner and model
    if failed:  # any failing test, llmload's or not; a check's section reads its row's verdict
        from pytest_llmload.reports import known_failures

        known_failures.annotate(item, call, report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Around a test that runs a check: the options the configuration gives checks, so that a repo's own
    ``parametrize_with_loader_checks`` test honours the ini keys without asking for ``llmload_check_options``."""
    if _check_of(item) is None:
        return (yield)
    from pytest_llmload.config.stash_keys import check_notes, configured, notes_key

    notes: list[str] = []
    item.stash[notes_key] = notes
    tokens = (configured.set(configuration_of(item.config)), check_notes.set(notes))
    try:
        return (yield)
    finally:
        configured.reset(tokens[0])
        check_notes.reset(tokens[1])


def _read_prediction(config: pytest.Config) -> None:
    """The runner profiles and the architecture of ``--llmload-runner``/``--llmload-model`` (or their ini keys),
    read at configure: a bad name or file is one usage error."""
    from pytest_llmload.config import settings

    runners = settings.given(config, "runner")
    if not runners or runners[0] is None:  # an empty value reads as unset, as for the other text settings
        return
    from pytest_llmload.placement import architectures, profiles

    runners, source = runners
    from pytest_llmload.placement.planner import unsupported_reason

    reason = unsupported_reason()
    if reason is not None:
        raise pytest.UsageError(f"{source} {runners!r}: {reason}.")
    given_model = settings.given(config, "model")
    model, model_source = given_model if given_model and given_model[0] else (architectures.DEFAULT, "the default")

    try:
        loaded = tuple(profiles.load_profile(name.strip(), source=source) for name in runners.split(",") if name.strip())
        # (built empty once here: a config transformers refuses is this usage error, not an error on every row)
        model_config = architectures.load_config(model, source=model_source, build=True)
        config.stash[prediction_key] = (loaded, (model, model_config))
    except (profiles.ProfileError, architectures.ArchitectureError) as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_ignore_collect(collection_path, config: pytest.Config):
    """The predictions' suite module exists for runs that name a runner; elsewhere it is not collected at all."""
    if collection_path.name == "test_predictions.py" and collection_path.parent.name == "suite" and \
            prediction_key not in config.stash:
        return True
    return None


def _check_of(item: pytest.Item):
    """The :class:`~pytest_llmload.checks.base.Check` a test runs (its ``check`` parameter), or ``None``."""
    check = getattr(getattr(item, "callspec", None), "params", {}).get("check")
    return check if hasattr(check, "failure") and hasattr(check, "function") else None


def _assumptions(item: pytest.Item) -> tuple[str, ...]:
    """The notes a check made that its verdict rests on as assumptions (:data:`~pytest_llmload.checks.base.ASSUMED`)."""
    from pytest_llmload.checks.base import ASSUMED
    from pytest_llmload.config.stash_keys import notes_key

    return tuple(note for note in item.stash.get(notes_key, None) or () if note.startswith(ASSUMED))


def _row(item: pytest.Item, check, report: pytest.TestReport, call: pytest.CallInfo) -> Row:
    """The check's row (:func:`pytest_llmload.reports.verdict.row_of`) from what this phase's report says happened,
    with what the run carries: the runner a prediction is for, the notes it made wherever it ran, the loader that
    ran (a ``parametrize_with_loader_checks`` test's own, else the configured one)."""
    from pytest_llmload.config.stash_keys import notes_key, prediction_record_key
    from pytest_llmload.fixes.reference_loader import chosen_loader
    from pytest_llmload.plugin.loader_hang import FAILED_FAST
    from pytest_llmload.reports.progress import summary_line
    from pytest_llmload.reports.verdict import row_of

    params = getattr(getattr(item, "callspec", None), "params", {})
    happened: dict = {}
    if hasattr(report, "wasxfail"):
        happened["xfail"] = (not report.skipped, report.wasxfail)
    elif report.skipped and isinstance(report.longrepr, tuple):
        happened["skipped"] = report.longrepr[2].removeprefix("Skipped: ")
    elif report.failed:  # what the check raised, judged; else (a setup, a strict failure) pytest's line
        if call.when == "call" and call.excinfo is not None:
            happened["raised"] = call.excinfo.value
        happened.update(failed=summary_line(report), failed_in=report.when)
    return row_of(check, runner=params.get("runner"), **happened,
                  loader=getattr(params.get("loader"), "name", None) or chosen_loader(item.config).spec,
                  notes=tuple(item.stash.get(notes_key, None) or ()), assumptions=_assumptions(item),
                  prediction=item.stash.get(prediction_record_key, None),
                  not_run=report.failed and
                  summary_line(report).removeprefix(f"{check.name}: ").startswith(FAILED_FAST))


def _record(item: pytest.Item, report: pytest.TestReport, pairs: list) -> None:
    """Properties of this phase's report (what the progress file reads) and of the item (what JUnit XML writes,
    from the teardown report, which copies the item's)."""
    report.user_properties.extend(pairs)
    item.user_properties.extend(pairs)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    """A PREDICTED row the repo does not gate on passed the run, and says what it is: ``P``, ``PREDICTED``."""
    if report.when != "call" or not report.passed or not config.stash.get(in_use_key, False):
        return None  # (a run that never uses the plugin imports none of its reports)
    from pytest_llmload.reports.row import VERDICT_PROPERTY

    if (VERDICT_PROPERTY, "predicted") in report.user_properties:
        return "predicted", "P", "PREDICTED (not gated)"
    return None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    known_failures = sys.modules.get("pytest_llmload.reports.known_failures")
    for line in known_failures.summary_lines(config) if known_failures else ():
        terminalreporter.write_line(line)
