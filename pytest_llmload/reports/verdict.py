"""A check's row, built in one place (:func:`row_of`): the judged fields from where the check ran
(:mod:`pytest_llmload.checks.judgement`: this process's judgement, or the one an isolated child sent back with its
answer, taken as it is), what the catalog adds (an error that is another known failure's own, :func:`of_exception`)
and what the run carries (the loader, the runner a prediction is for, the notes, the timings, what the HTML report
shows). The parent of a child judges only what the child could not say itself: that it hung or died.

Imports nothing heavy: the progress writer and the main job's parent use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from pytest_llmload.reports.row import Row, row_name

if TYPE_CHECKING:
    from pytest_llmload.checks.judgement import Verdict


def of_exception(exc: BaseException, failure: Any, check: Any = None) -> Optional["Verdict"]:
    """The verdict of a check guarding ``failure`` (a :class:`~.base.KnownFailure`) that raised ``exc``
    (:func:`~pytest_llmload.checks.judgement.judge`), with the catalog's word on an error that is another known
    failure's own; ``None`` for an outcome that is not a failure (a skip)."""
    from pytest_llmload.checks.judgement import judge

    verdict = judge(exc, failure, check)
    if verdict is None:
        return None
    same = _same_bug(verdict.kind, verdict.cause, verdict.sentence, failure)
    return verdict if same is None else verdict._replace(sentence=verdict.sentence + same[0], fix=verdict.fix or same[1])


def row_of(check: Any, *, runner: Any = None, raised: Optional[BaseException] = None, skipped: Optional[str] = None,
           xfail: Optional[tuple[bool, str]] = None, failed: Optional[str] = None, failed_in: str = "call",
           loader: Optional[str] = None, notes: tuple[str, ...] = (), assumptions: tuple[str, ...] = (),
           prediction: Optional[dict] = None, not_run: bool = False, seconds: Optional[float] = None,
           artefacts: Optional[dict] = None) -> Row:
    """The row of ``check`` (a :class:`~pytest_llmload.checks.base.Check`), built here once from what happened
    (:func:`~pytest_llmload.checks.judgement.judged`: it returned, ``raised``, ``skipped``, ``xfail``, or ``failed``
    with no exception of its own, ``failed_in``). What an isolated child raised comes with the row's judged fields
    the child sent (:func:`~pytest_llmload.runners.isolation.judged_by_child`), what its ranks raised with the rows
    they judged (the most telling taken, :mod:`~pytest_llmload.checks.judgement`): taken as they are, never judged
    again here (a skip of the child's that this run fails, ``--llmload-strict``, is this run's failure). The rest is what the check's run carries: ``runner``, the runner profile a prediction's row is for;
    the loader that ran; the notes it made wherever it ran, the assumptions among them; a prediction's record;
    ``not_run``: an ``error`` that did not wait (the loader under test hung in an earlier check); how long it took;
    ``artefacts``, what the HTML report shows of it.

    >>> row_of(check, skipped="not exercised: the loader loaded the model whole on cpu").verdict
    'not exercised'
    """
    from pytest_llmload.checks.judgement import judged
    from pytest_llmload.runners.isolation import judged_by_child

    fields = judged_by_child(raised) if raised is not None and skipped is None and xfail is None else None
    if fields is None or fields["verdict"] not in ("failed", "error", "predicted"):  # (a skip this run fails: strict)
        fields = judged(check, raised=raised, skipped=skipped, xfail=xfail, failed=failed, failed_in=failed_in)
    same = _same_bug(fields["verdict"], fields["cause"], fields["sentence"], check.failure)
    if same is not None:
        fields = {**fields, "sentence": fields["sentence"] + same[0], "fix": fields["fix"] or same[1]}
    return Row(**{**fields, "check": row_name(check, runner), "guards": check.failure.id}, notes=tuple(notes),
               loader=loader, guards_origin=failure_origin(check.failure),
               not_run=not_run and fields["verdict"] == "error", prediction=prediction, assumptions=tuple(assumptions),
               seconds=seconds, artefacts=artefacts)


def failure_origin(failure) -> str:
    """Where a known failure comes from, as the main job's table tags what a check guards against: ``002`` for its
    write-up in shared/seeds, ``field`` for upstream issue trackers, ``extension`` for a repo's own
    (:mod:`pytest_llmload.plugin.check_registry`)."""
    from pytest_llmload.failures import BY_ID

    if BY_ID.get(failure.id) is not failure:
        return "extension"
    return failure.write_up.split("/")[-1][:3] if failure.write_up.startswith("seeds/") else "field"


def _same_bug(kind: str, cause: Optional[str], sentence: str, failure: Any) -> Optional[tuple[str, str]]:
    """An error row whose text is another known failure's own error (a ``model.to()`` after an offloaded load breaks
    every check that offloads): it stays an error, where this check's mechanism was not observed, and says which
    failure it is and which check judges it, so that one bug reads as one bug. ``(the line to add, its fix)``, or
    ``None`` where the text is no other failure's."""
    from pytest_llmload.failures import REGISTRY, match

    if kind != "error" or cause not in ("loader", "model"):
        return None
    others = [known for known in match(sentence) if known.id != getattr(failure, "id", None)]
    if not others:
        return None
    known = others[0]
    checks = sorted({check.name for check in REGISTRY if check.failure.id == known.id and not check.needs_gpus})
    return (f"\nthe same bug as {', '.join(checks) or known.id}: {known.id} ({known.title}); fix: {known.fix}",
            known.fix)
