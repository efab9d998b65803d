"""Collection: whether a run uses the plugin (a collected test uses an llmload fixture or marker, or its module
imports the package), what its collected tests require (the stack installed, the GPUs ``llmload_require_gpus``
asks for, a check's deadline no longer than the run's ``--timeout``), the configured loader and training-args hook
imported before any test runs (offline, under ``llmload_import_timeout``, with a progress line while it runs long),
the header line, and the predictions' suite module collected only where a run names a runner."""

from __future__ import annotations

import types

import pytest

from pytest_llmload.config import vocabulary
from pytest_llmload.config.stash_keys import configuration_key, prediction_key
from pytest_llmload.plugin.check_row import check_of
from pytest_llmload.plugin.gates import in_use_key, under_xdist_controller

# What marks a test as an llmload test: every llmload fixture requests llmload_offline, except these two.
_FIXTURE_ROOTS = ("llmload_offline", "llmload_device", "llmload_check_options")
_MARKERS = frozenset({"needs_gpus", "gpu", vocabulary.DEEPSPEED_MARKER, vocabulary.ISOLATED_MARKER,
                      vocabulary.MEMORY_LIMIT_MARKER})

header_shown_key = pytest.StashKey[bool]()


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The header line where the run configures the plugin (any of its settings given: an option, an ini key,
    ``$PYTEST_LLMLOAD_LOADER``); a run that only uses it gets the line after collection
    (:func:`pytest_collection_finish`), and a run that never uses it, none."""
    from pytest_llmload.config import settings

    if not settings.any_given(config):
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
        if check_of(item) is not None and marker is not None and marker.args and marker.args[0] > asked:
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
    if under_xdist_controller(session.config):
        _check_imports(session.config, _IMPORTED_FOR)


# The fixture that imports each configured spec, and the configuration's field that names the spec.
_IMPORTED_FOR = {"llmload_loader": "loader", "llmload_check_options": "training_args_hook"}


def _check_imports(config: pytest.Config, used_fixtures) -> None:
    configuration = config.stash.get(configuration_key, None)
    for fixture, field in _IMPORTED_FOR.items():
        choice = getattr(configuration, field, None)
        if fixture in used_fixtures and choice is not None and not choice.is_reference:
            from pytest_llmload.loader import seam
            from pytest_llmload.plugin.guarded_import import importing

            module = choice.spec.partition(":")[0]
            whose = "loader" if field == "loader" else "training-args hook"
            try:  # (imported once: the fixtures and the checks take the same function)
                with importing(config, module, f"the {whose}'s module {module!r}", choice.source,
                               f"put it in the {whose} function"):
                    getattr(configuration, f"{'hook' if field == 'training_args_hook' else field}_function")
            except seam.LoaderSpecError as exc:
                raise pytest.UsageError(str(exc)) from None


def pytest_ignore_collect(collection_path, config: pytest.Config):
    """The predictions' suite module exists for runs that name a runner; elsewhere it is not collected at all."""
    if collection_path.name == "test_predictions.py" and collection_path.parent.name == "suite" and \
            prediction_key not in config.stash:
        return True
    return None
