"""The known failures, one module each, named by the failure's id (``dp-dtype`` is :mod:`.dp_dtype`), and nothing else.

Each module declares what its failure is: its catalog entry (``FAILURE``, a
:class:`~pytest_llmload.checks.base.KnownFailure`: signatures, root cause, fix, where it occurs, its place in the
catalog) and its conformance checks (``CHECKS``, :class:`~pytest_llmload.checks.base.Check` records). This package
finds the modules itself (every module in it is a failure) and builds from them the catalog and the check registry;
the predictions name the failure each predicts, and the docs' tables are made from the catalog. Adding a failure:
one module here, its before-loader and its regression tests (docs/contributing.md).
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

from pytest_llmload.checks.base import Check, KnownFailure
from pytest_llmload.runners.preload import preload_for_isolated_checks  # (its home: one floor down)


def _discovered() -> tuple[ModuleType, ...]:
    """Every module of this package, in the catalog's order (``FAILURE.order``); one that is not a failure's home
    (no ``FAILURE`` and ``CHECKS``, a name that is not its id's, an order another holds) is an error here."""
    modules = [importlib.import_module(f"{__name__}.{info.name}") for info in pkgutil.iter_modules(__path__)]
    for module in modules:
        failure = getattr(module, "FAILURE", None)
        if not isinstance(failure, KnownFailure) or not isinstance(getattr(module, "CHECKS", None), tuple):
            raise ImportError(f"{module.__name__} is not a known failure's module (FAILURE, a KnownFailure, and "
                              "CHECKS, a tuple of Check records): this package holds failures only")
        if module.__name__ != f"{__name__}.{failure.slug}":
            raise ImportError(f"{module.__name__} declares the failure {failure.id!r}, whose module is "
                              f"{__name__}.{failure.slug}: name the module after the id")
    orders = sorted(module.FAILURE.order for module in modules)
    if len(set(orders)) != len(orders) or 0 in orders:
        raise ImportError(f"the known failures' FAILURE.order must be distinct and positive; they are "
                          f"{ {module.FAILURE.id: module.FAILURE.order for module in modules} }")
    return tuple(sorted(modules, key=lambda module: module.FAILURE.order))


MODULES = _discovered()
CATALOG: tuple[KnownFailure, ...] = tuple(module.FAILURE for module in MODULES)
BY_ID: dict[str, KnownFailure] = {failure.id: failure for failure in CATALOG}
# The order the main job runs them in: the CPU checks, then those that need GPUs.
REGISTRY: tuple[Check, ...] = tuple(sorted((check for module in MODULES for check in module.CHECKS),
                                           key=lambda check: check.needs_gpus > 0))


def match(text: str) -> list[KnownFailure]:
    """The known failures whose signatures appear in ``text`` (a failure's message and traceback)."""
    return [failure for failure in CATALOG if failure.matches(text)]


__all__ = ["BY_ID", "CATALOG", "Check", "KnownFailure", "MODULES", "REGISTRY", "match",
           "preload_for_isolated_checks"]
