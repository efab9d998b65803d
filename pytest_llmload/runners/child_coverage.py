"""Coverage measurement in the children of :mod:`pytest_llmload.runners.isolation` (isolated calls and checks,
distributed ranks), for pytest-cov and ``coverage run``.

A child ends with ``os._exit`` (it must not run the parent's atexit handlers or pytest's teardown), so
coverage.py's own save at exit never happens there: a forked child's copy of the parent's measurement is
lost, and a forkserver child measures nothing. So, when coverage is measuring in the process that starts the
children, each child measures with that process's configuration and, before it answers, saves what it ran to a
parallel data file of its own next to the parent's (``.coverage.<host>.pid<pid>.X<random>x...``). pytest-cov
combines every such file into its report at the end of the run and deletes them, as ``coverage combine`` does.

Nothing here imports coverage: a process where coverage is not measuring pays one ``sys.modules`` lookup.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

# What the parent hands a child: coverage's serialized configuration and the parent's data file.
Settings = tuple[str, str]

# Expected in a child, and noise in the output replayed to the test: it runs part of the measured code, whose
# modules it imported before it started measuring (forked with them, or preloaded by the forkserver).
_EXPECTED_WARNINGS = ("no-data-collected", "module-not-imported", "module-not-measured", "already-imported")


def parent_settings() -> Optional[Settings]:
    """In the process starting children: the configuration and data file of the coverage measuring here, or
    ``None`` when none is (or coverage is older than 7.10, which cannot serialize its configuration)."""
    coverage = sys.modules.get("coverage")  # not imported: nothing measures
    cov = coverage.Coverage.current() if coverage is not None else None
    if cov is None or not hasattr(cov.config, "serialize"):
        return None
    # The data file as coverage resolved it when it started: the test may have changed directory since, and
    # pytest-cov combines the files next to that one.
    data = getattr(cov, "_data", None)
    data_file = data.base_filename() if data is not None else os.path.abspath(cov.config.data_file)
    return cov.config.serialize(), data_file


def start(settings: Optional[Settings]) -> Any:
    """In a child: stop the measurement it inherited (a forked child's copy of the parent's, never saved),
    start one with the parent's settings that writes a parallel data file; returns it, or ``None``."""
    if settings is None:
        return None
    try:
        from coverage import Coverage
        from coverage.control import CONFIG_DATA_PREFIX

        while (inherited := Coverage.current()) is not None:
            inherited.stop()
        config, data_file = settings
        cov = Coverage(config_file=CONFIG_DATA_PREFIX + config, data_suffix=True)
        cov.set_option("run:data_file", data_file)  # a serialized configuration ignores the constructor's
        cov.set_option("run:disable_warnings", [*cov.get_option("run:disable_warnings"), *_EXPECTED_WARNINGS])
        cov.start()
        return cov
    except Exception as exc:  # noqa: BLE001 - the child's work matters more than its coverage
        _lost(exc)
        return None


def save(cov: Any) -> None:
    """In a child, before it answers (the parent kills a child that lingers after its answer): write its data."""
    if cov is None:
        return
    try:
        cov.stop()
        cov.save()
    except Exception as exc:  # noqa: BLE001
        _lost(exc)


def _lost(exc: Exception) -> None:
    # In the child's stderr, which the parent replays into the test's captured output.
    print(f"llmload: this child's coverage is lost: {type(exc).__name__}: {exc}", file=sys.stderr)
