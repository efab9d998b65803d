"""Run the regression checks against any loader, in the manner of scikit-learn's ``parametrize_with_checks``.

A downstream repo gates its loader with a few lines::

    from pytest_llmload.conformance import parametrize_with_loader_checks
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

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Union

import pytest

from pytest_llmload.loading import LoaderChoice, LoaderUnderTest, as_loader_under_test, import_loader


class Check(NamedTuple):
    """A conformance check: ``function(loader, checkpoint, workdir)`` raises ``AssertionError`` on a faulty loader."""

    function: Callable[[LoaderUnderTest, Path, Path], None]
    failure: str  # the catalog id of the known failure it guards against
    needs_gpus: int = 0
    world_size: int = 1  # ranks of a process group the check starts itself
    transformers: Optional[str] = None  # PEP 440 range where the failure exists; elsewhere the check skips
    timeout: float = 120.0  # seconds; a hang fails the check with every thread's stack
    label: Optional[str] = None  # the name, where ``function`` is a partial (a GPU variant, say)
    # Run in a child forked from the test process (pytest_llmload.isolation): for checks that can hang, crash,
    # or change process-wide state (environment, patched upstream code, audit hooks, sockets).
    isolated: bool = False

    @property
    def name(self) -> str:
        return self.label or self.function.__name__

    @property
    def summary(self) -> str:
        doc = getattr(self.function, "__doc__", None) or getattr(getattr(self.function, "func", None), "__doc__", "")
        return " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""

    def __call__(self, loader: Any, checkpoint: Path, workdir: Path) -> None:
        args = (as_loader_under_test(loader), Path(checkpoint), Path(workdir))
        if not self.isolated:
            return self.function(*args)
        from pytest_llmload import isolated_marker, isolation
        from pytest_llmload.checks import preload_for_isolated_checks

        preload_for_isolated_checks(args[1])
        isolation.run_isolated(self.function, args, timeout=self.timeout, label=self.name,
                               render=isolated_marker.render_failure)

    def version_skip_reason(self) -> Optional[str]:
        """Why this check does not apply to the installed transformers, or ``None`` when it does."""
        if self.transformers is None:
            return None
        from importlib import metadata

        from packaging.specifiers import SpecifierSet

        installed = metadata.version("transformers")
        if SpecifierSet(self.transformers).contains(installed, prereleases=True):
            return None
        return f"{self.name}: transformers {installed} does not have {self.failure}; the check applies to transformers{self.transformers}"


def all_checks() -> Iterator[Check]:
    """Every shipped check, in a stable order (the registry lives in ``pytest_llmload.checks``)."""
    from pytest_llmload.checks import REGISTRY

    yield from REGISTRY


def _loader_id(loader: LoaderUnderTest) -> str:
    """``mod.function`` from ``pkg.mod:function``: short, and distinct when many modules call it ``load``."""
    module, sep, function = loader.name.rpartition(":")
    return f"{module.rpartition('.')[2]}.{function.rpartition('.')[2]}" if sep else loader.name


def _resolve(loader: Union[str, Callable, LoaderUnderTest]) -> LoaderUnderTest:
    if isinstance(loader, str):
        return as_loader_under_test(import_loader(LoaderChoice(loader, "parametrize_with_loader_checks")),
                                    name=loader, source="parametrize_with_loader_checks")
    return as_loader_under_test(loader, source="parametrize_with_loader_checks")


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


def parametrize_checks(*, expected_failed_checks: Optional[Mapping[str, str]] = None,
                       checks: Optional[Iterable[Check]] = None):
    """A ``pytest.mark.parametrize`` over ``check`` alone, for the loader that the ``llmload_loader`` fixture
    gives (``--llmload-loader``, ``$PYTEST_LLMLOAD_LOADER``, the ini key, or a conftest override)."""
    return pytest.mark.parametrize("check", check_params(expected_failed_checks=expected_failed_checks, checks=checks))


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


def describe_checks() -> list[dict[str, Any]]:
    """One record per check: name, known failure, needs, summary (for docs and the main job's table)."""
    from pytest_llmload.catalog import BY_ID

    return [
        {"check": c.name, "failure": c.failure, "title": BY_ID[c.failure].title if c.failure in BY_ID else "",
         "needs_gpus": c.needs_gpus, "world_size": c.world_size, "transformers": c.transformers or "any",
         "summary": c.summary}
        for c in all_checks()
    ]

