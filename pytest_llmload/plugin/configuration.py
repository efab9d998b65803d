"""The run's configuration, read once at configure: the settings registered (``pytest_addoption``), every setting
read into the one frozen :class:`~pytest_llmload.config.stash_keys.Configuration` on ``config.stash`` where the run
configures the plugin (a bad value is one usage error before any test runs), the repo's own checks, the expected
failed checks, the runner profiles and architecture a prediction is for, the progress writer the main job reads,
and the remaining sub-plugins' gates (:mod:`pytest_llmload.plugin.gates`)."""

from __future__ import annotations

import os

import pytest

from pytest_llmload.config import vocabulary
from pytest_llmload.config.stash_keys import checks_key, configuration_key, prediction_key, progress_key
from pytest_llmload.plugin.gates import BEFORE_CONFIGURE, SUB_PLUGINS, in_use_key, register_gates


def pytest_addoption(parser: pytest.Parser) -> None:
    from pytest_llmload.config import settings

    settings.register(parser)


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
    register_gates(config, (module for module in SUB_PLUGINS if module not in BEFORE_CONFIGURE))


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
        from pytest_llmload.failures import REGISTRY  # noqa: F401  (the built-in checks: before the guard, below)
        from pytest_llmload.plugin.check_registry import ExtensionError, every_check
        from pytest_llmload.plugin.guarded_import import importing

        specs, source = extra or ((), "the installed packages' entry points")
        modules = ", ".join(spec.partition(":")[0] for spec in specs) or "the installed extensions' modules"
        try:  # (the repo's modules, as the loader's: offline, under the import deadline)
            with importing(config, modules, f"the checks' modules {modules!r}" if specs else modules, source,
                           "put it in the check functions"):
                config.stash[checks_key] = every_check(specs, source)
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
    config.stash[progress_key] = writer
    config.pluginmanager.register(writer, "llmload-progress")
    return writer


def pytest_unconfigure(config: pytest.Config) -> None:
    writer = config.stash.get(progress_key, None)
    if writer is not None:
        config.pluginmanager.unregister(writer)
        writer.close()


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
