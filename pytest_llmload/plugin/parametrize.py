"""Run the regression checks against any loader, in the manner of scikit-learn's ``parametrize_with_checks``.

A downstream repo gates its loader with a few lines::

    from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks
    from mypkg.loading import load_model_and_tokenizer

    @parametrize_with_loader_checks([load_model_and_tokenizer],
                                    expected_failed_checks={"check_x": "known gap, tracked in #12"})
    def test_loader(loader, check, llmload_checkpoint, tmp_path):
        check(loader, llmload_checkpoint, tmp_path)

Each case is ``<loader>-<check name>``, so ``-k check_train`` selects by check. Checks that need GPUs carry
the ``gpu`` and ``needs_gpus(n)`` markers (skipping with counts where there are too few); checks for a
failure that only exists on some transformers versions skip elsewhere, saying so.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Callable, Optional, Union

import pytest

from pytest_llmload.checks.base import Check
from pytest_llmload.loader.seam import LoaderChoice, LoaderUnderTest, as_loader_under_test, import_loader

SOURCE = "parametrize_with_loader_checks"  # where its loaders come from, as rows and the header say


def all_checks() -> Iterator[Check]:
    """Every shipped check in a stable order (the registry lives in ``pytest_llmload.failures``), then the checks of
    installed packages' ``pytest_llmload.checks`` entry points (:mod:`pytest_llmload.plugin.check_registry`)."""
    from pytest_llmload.plugin.check_registry import every_check

    yield from every_check()


def _loader_id(loader: LoaderUnderTest) -> str:
    """``mod.function`` from ``pkg.mod:function``: short, and distinct when many modules call it ``load``."""
    module, sep, function = loader.name.rpartition(":")
    return f"{module.rpartition('.')[2]}.{function.rpartition('.')[2]}" if sep else loader.name


def _resolve(loader: Union[str, Callable, LoaderUnderTest]) -> LoaderUnderTest:
    if isinstance(loader, str):
        return as_loader_under_test(import_loader(LoaderChoice(loader, SOURCE)), name=loader, source=SOURCE)
    return as_loader_under_test(loader, source=SOURCE)


def check_marks(check: Check, reason_if_expected_to_fail: Optional[str] = None) -> list:
    marks = [pytest.mark.timeout(check.timeout)]
    if check.needs_gpus:
        marks += [pytest.mark.gpu, pytest.mark.needs_gpus(check.needs_gpus)]
    skip = check.version_skip_reason()
    if skip is not None:
        marks.append(pytest.mark.skip(reason=skip))
    if reason_if_expected_to_fail is not None:
        marks.append(pytest.mark.xfail(reason=reason_if_expected_to_fail, strict=True))
    return marks


def parametrize_with_loader_checks(
    loaders: Iterable[Union[str, Callable, LoaderUnderTest]],
    *,
    expected_failed_checks: Union[None, Mapping[str, str], Callable[[LoaderUnderTest], Mapping[str, str]]] = None,
    checks: Optional[Iterable[Check]] = None,
):
    """A ``pytest.mark.parametrize`` over ``(loader, check)`` for every loader and every check.

    ``loaders`` are callables or ``"module:function"`` specs. ``expected_failed_checks`` maps a check name to
    the reason it is a known gap (or is a function of the loader returning such a mapping); those cases
    become strict xfails: they must fail, and a fixed gap shows up as XPASS(strict) until removed.
    """
    resolved = [_resolve(loader) for loader in loaders]
    chosen = list(all_checks() if checks is None else checks)
    params = []
    for loader in resolved:
        expected = expected_failed_checks(loader) if callable(expected_failed_checks) else (expected_failed_checks or {})
        unknown = set(expected) - {check.name for check in chosen}
        if unknown:
            raise ValueError(
                f"expected_failed_checks for loader {loader.name} names {sorted(unknown)}, which are not checks; "
                f"the checks are: {', '.join(check.name for check in chosen)}."
            )
        for check in chosen:
            params.append(pytest.param(loader, check, id=f"{_loader_id(loader)}-{check.name}",
                                       marks=check_marks(check, expected.get(check.name))))
    return pytest.mark.parametrize(("loader", "check"), params)


def check_params(*, expected_failed_checks: Optional[Mapping[str, str]] = None,
                 checks: Optional[Iterable[Check]] = None) -> list:
    """``pytest.param`` per check (id: the check's name), for a parametrize over ``check`` alone."""
    chosen = list(all_checks() if checks is None else checks)
    expected = dict(expected_failed_checks or {})
    unknown = set(expected) - {check.name for check in chosen}
    if unknown:
        raise pytest.UsageError(
            f"expected failed checks {sorted(unknown)} are not checks; the checks are: "
            f"{', '.join(check.name for check in chosen)}."
        )
    return [pytest.param(check, id=check.name, marks=check_marks(check, expected.get(check.name)))
            for check in chosen]


def parse_expected_failures(lines: Iterable[str], source: str) -> dict[str, str]:
    """``["check_name: reason", ...]`` (the ini key ``llmload_expected_failed_checks``) as a mapping."""
    expected = {}
    for line in lines:
        name, sep, reason = line.partition(":")
        if not sep or not name.strip() or not reason.strip():
            raise pytest.UsageError(
                f"{source}: {line!r} is not of the form 'check_name: reason why it is expected to fail'."
            )
        expected[name.strip()] = reason.strip()
    return expected


# A parametrize_with_loader_checks test's id ends [<loader id>-<check>] (_loader_id); the shipped suite's, [<check>].
_CHECK_ID = re.compile(r"\[(?:([^\]-]+)-)?(?:check|predict)_[^\]]+\]$")


def loaders_of(items) -> list[tuple[str, str]]:
    """``(name, source)`` of each loader the collected ``parametrize_with_loader_checks`` tests run, in collection
    order: the loaders the report header names, where the checks run their own."""
    found: dict[str, str] = {}
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        loader = params.get("loader")
        if isinstance(loader, LoaderUnderTest) and params.get("check") is not None:
            found.setdefault(loader.name, loader.source)
    return list(found.items())


def loaders_in_ids(nodeids) -> Optional[list[tuple[str, str]]]:
    """:func:`loaders_of` from test ids alone (an xdist controller collects nothing), each loader by its id
    (``module.function``); ``[]`` where the checks' tests name no loader (they run the configured one), ``None``
    where no test runs a check."""
    found = [_CHECK_ID.search(nodeid) for nodeid in nodeids]
    if not any(found):
        return None
    return [(name, SOURCE) for name in dict.fromkeys(match.group(1) for match in found if match and match.group(1))]


def describe_checks(checks: Optional[Iterable[Check]] = None) -> list[dict[str, Any]]:
    """One record per check: name, known failure, needs, summary (for docs and the main job's table)."""
    return [
        {"check": c.name, "failure": c.failure.id, "title": c.failure.title,
         "needs_gpus": c.needs_gpus, "world_size": c.world_size, "transformers": c.transformers or "any",
         "summary": c.summary}
        for c in (all_checks() if checks is None else checks)
    ]

