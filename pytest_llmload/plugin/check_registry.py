"""Checks a repo adds beside the built-in ones, without forking: its own known failure (its framework's quirk), its
own :class:`~pytest_llmload.checks.base.Check` records.

Two ways in, both read here:

- the setting ``checks`` (``--llmload-checks module:attribute``, ini ``llmload_checks``, the main job's
  ``--checks``): for this run;
- the entry-point group ``pytest_llmload.checks`` of an installed package (like ``pytest11`` for plugins)::

      [project.entry-points."pytest_llmload.checks"]
      myrepo = "myrepo.llmload_checks:CHECKS"

The attribute is a ``Check``, a sequence of them, or a module with ``CHECKS``. The shipped suite, the main job and
``parametrize_with_loader_checks`` run them after the built-in checks, with the same contract layer, verdicts,
JUnit properties and ``pytest_llmload_check_result`` hook.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterable
from typing import Any

from pytest_llmload.checks.base import Check

ENTRY_POINT_GROUP = "pytest_llmload.checks"


class ExtensionError(ValueError):
    """A check spec or entry point that does not give checks; the message names it, where it came from, and the fix."""


def _as_checks(obj: Any, what: str) -> tuple[Check, ...]:
    if isinstance(obj, types.ModuleType):
        if not hasattr(obj, "CHECKS"):
            raise ExtensionError(f"{what} is a module without CHECKS; name the attribute holding the checks "
                                 "('module:CHECKS'), or define CHECKS in it.")
        obj = obj.CHECKS
    found = (obj,) if isinstance(obj, Check) else tuple(obj) if isinstance(obj, Iterable) else (obj,)
    wrong = [item for item in found if not isinstance(item, Check)]
    if wrong or not found:
        raise ExtensionError(f"{what} gives {type(wrong[0]).__name__ if wrong else 'no checks'}, not "
                             "pytest_llmload.Check records; make it a Check, a list of them, or a module with CHECKS.")
    return found


def resolve(spec: str, source: str) -> tuple[Check, ...]:
    """The checks ``spec`` (``module`` or ``module:attribute.path``) names; ``source`` says where it was given."""
    module_name, _, attribute = spec.strip().partition(":")
    what = f"check spec {spec!r} from {source}"
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # any import failure: the user's module, named with its own error
        from pytest_llmload.system.offline import NetworkAccessBlocked

        remedy = ("make importing it need no network: the checks run offline" if isinstance(exc, NetworkAccessBlocked)
                  else f"make '{module_name}' importable from the test run (installed, or on sys.path)")
        raise ExtensionError(f"{what} does not import ({type(exc).__name__}: {exc}); {remedy}.") from None
    for part in filter(None, attribute.split(".")):
        if not hasattr(obj, part):
            raise ExtensionError(f"{what}: module '{module_name}' has no attribute '{attribute}'; name an existing "
                                 "one, e.g. 'mypkg.llmload_checks:CHECKS'.")
        obj = getattr(obj, part)
    return _as_checks(obj, what)


def installed() -> tuple[Check, ...]:
    """The checks of every installed package's ``pytest_llmload.checks`` entry points, in name order."""
    from importlib import metadata

    found: list[Check] = []
    for point in sorted(metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda p: p.name):
        what = f"entry point {point.name!r} ({point.value}) of group {ENTRY_POINT_GROUP!r}"
        try:
            obj = point.load()
        except Exception as exc:  # a broken installed extension: named, so its owner can be told
            raise ExtensionError(f"{what} does not load ({type(exc).__name__}: {exc}); fix or uninstall the "
                                 "package that declares it.") from None
        found += _as_checks(obj, what)
    return tuple(found)


def every_check(specs: Iterable[str] = (), source: str = "") -> tuple[Check, ...]:
    """The built-in checks, then the installed extensions', then those ``specs`` name; one name, one check."""
    from pytest_llmload.failures import REGISTRY

    checks = list(REGISTRY)
    for check in (*installed(), *(c for spec in specs for c in resolve(spec, source))):
        clash = next((known for known in checks if known.name == check.name), None)
        if clash is check:
            continue  # named twice (an entry point and the option): run once
        if clash is not None:
            raise ExtensionError(f"check {check.name!r} ({check.function.__module__}) has the name of another check "
                                 f"({clash.function.__module__}); rename one (Check(label=...)).")
        checks.append(check)
    return tuple(checks)
