"""The bootstrap a command's processes import: a ``sitecustomize.py`` in a folder of the run put first on
``PYTHONPATH``, which every Python process the command starts (a launcher's ranks included) inherits, with no file of
the repo changed (coverage.py's way into subprocesses). It starts :mod:`.in_process`, then imports the
``sitecustomize`` it stands in front of (the repo's or the environment's), so that theirs keeps working.
"""

from __future__ import annotations

import os
from pathlib import Path

from pytest_llmload.system.tracebacks import PACKAGE_DIR

_SITECUSTOMIZE = '''\
"""pytest-llmload run's bootstrap (written for one run, removed with it)."""
import os as _os
import sys as _sys


def _llmload_bootstrap():
    here = _os.path.dirname(_os.path.abspath(__file__))
    try:
        from pytest_llmload.commands import in_process
    except ImportError:  # (an interpreter without pytest-llmload installed: the run's own copy)
        _sys.path.append({package_parent!r})
        from pytest_llmload.commands import in_process
    in_process.start()
    # The sitecustomize this one stands in front of, imported as Python would have.
    ours = _sys.modules.pop("sitecustomize", None)
    path = _sys.path[:]
    _sys.path[:] = [entry for entry in path if _os.path.abspath(entry or ".") != here]
    try:
        import sitecustomize  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "sitecustomize":
            raise
        _sys.modules["sitecustomize"] = ours
    finally:
        _sys.path[:] = path


_llmload_bootstrap()
'''


def write_bootstrap(folder: Path) -> Path:
    """``folder``/sitecustomize.py; returns ``folder`` (the entry to put first on ``PYTHONPATH``)."""
    folder.mkdir(parents=True, exist_ok=True)
    package_parent = os.path.dirname(PACKAGE_DIR.rstrip(os.sep))
    (folder / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(package_parent=package_parent))
    return folder
