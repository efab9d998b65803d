"""A check's row, built in one place (:func:`row_of`) from what happened, and what a check's exception means: the
row's verdict and the known failure it names.

A known failure is named only when the check observed its mechanism: the check's own judgement (an
``AssertionError`` it raised, in this process, in an isolated child or on a rank), or a deadline passed inside the
loader call where a hang is the failure's mechanism (:attr:`KnownFailure.hang_is_mechanism`). Everything else is an
``error`` with no failure: the loader raised, or broke the contract; the loader hung or ended its process; or the
check's own code crashed, which is a bug in pytest-llmload, reported as such (a repo's own check: a bug in that check,
named by its file and line). Nothing here reads the report's text
(which prints the check's own docstring and source): only the exception and what the child or rank said.

Imports nothing heavy: the progress writer and the main job's parent use it.
"""

from __future__ import annotations

import traceback
from typing import Any, NamedTuple, Optional

from pytest_llmload.reports.row import Row, row_name
from pytest_llmload.config.distribution import bug_report_address
from pytest_llmload.system import tracebacks


class Verdict(NamedTuple):
    kind: str  # "failed" (the check saw its failure), "predicted" (a runner profile would), or "error"
    failure: Optional[str]  # the known failure's id (or "OOM" for a prediction), only with "failed" or "predicted"
    cause: str  # mechanism | loader | contract | model | hang | died | check
    sentence: str  # the row's one line
    fix: Optional[str] = None  # the code to write instead: a loader fault's (loader.faults), or the failure's own


def of_exception(exc: BaseException, failure: Any, check: Any = None) -> Optional[Verdict]:
    """The verdict of a check guarding ``failure`` (a :class:`~.base.KnownFailure`) that raised ``exc``; ``None``
    for an outcome that is not a failure (a skip). ``check`` (the :class:`~pytest_llmload.checks.base.Check` that
    raised it): a crash in a repo's own check names that check's frame, not this project's."""
    if _is_skip(exc):
        return None
    judged = _judge(exc, failure, check)
    if judged is not None and judged.kind == "error" and judged.cause in ("loader", "model"):
        return _same_bug(judged, failure)
    return judged


def row_of(check: Any, *, runner: Any = None, raised: Optional[BaseException] = None, skipped: Optional[str] = None,
           xfail: Optional[tuple[bool, str]] = None, failed: Optional[str] = None, failed_in: str = "call",
           loader: Optional[str] = None, notes: tuple[str, ...] = (),
           assumptions: tuple[str, ...] = (), prediction: Optional[dict] = None, not_run: bool = False) -> Row:
    """The row of ``check`` (a :class:`~pytest_llmload.checks.base.Check`), built here once from what happened: it
    returned (nothing given: ``passed``); it ``raised`` (judged here, :func:`of_exception`, also what its isolated
    child or its ranks raised); it ``skipped`` (the skip reason: its kind from its words); ``xfail`` (whether it
    failed, pytest's reason); or it ``failed`` with no exception of its own to judge (a setup that failed,
    ``failed_in``; a failure ``--llmload-strict`` made of a skip or an assumption). How an isolated child or the ranks
    ended is judged with what they raised: the parent judges only what a child cannot say (hung, died). The rest is
    what the check's run carries: ``runner``, the runner profile a prediction's row is for; the loader that ran; the
    notes it made wherever it ran, the assumptions among them; a prediction's record; ``not_run``: an ``error`` that
    did not wait (the loader under test hung in an earlier check).

    >>> row_of(check, skipped="not exercised: the loader loaded the model whole on cpu").verdict
    'not exercised'
    """
    from pytest_llmload.checks.base import DECLARED_NOT_APPLICABLE, NOT_EXERCISED

    judged = of_exception(raised, check.failure, check) if raised is not None else None
    cause = None
    if xfail is not None:
        verdict, sentence = ("xpassed" if xfail[0] else "xfailed"), xfail[1]
    elif skipped is not None:
        verdict = "not exercised" if skipped.startswith(NOT_EXERCISED) else \
            "not applicable" if skipped.startswith(DECLARED_NOT_APPLICABLE) else "skipped"
        sentence = skipped
    elif judged is not None:
        verdict, sentence, cause = judged.kind, judged.sentence, judged.cause
    elif failed is not None:  # a setup or teardown that failed is an error, as pytest says
        verdict, sentence = ("failed", failed) if failed_in == "call" else ("error", failed)
        cause = failed_in if verdict == "error" else None
    else:
        verdict, sentence = "passed", ""
    failure = judged.failure if judged is not None and verdict in ("failed", "predicted") else None
    known = check.failure if failure == check.failure.id else None
    return Row(check=row_name(check, runner), verdict=verdict, guards=check.failure.id, failure=failure, cause=cause,
               sentence=sentence, notes=tuple(notes), loader=loader,
               fix=getattr(known, "fix", None) or getattr(judged, "fix", None),  # (a loader fault's: loader.faults)
               guards_origin=failure_origin(check.failure), not_run=not_run and verdict == "error",
               prediction=prediction, assumptions=tuple(assumptions))


def failure_origin(failure) -> str:
    """Where a known failure comes from, as the main job's table tags what a check guards against: ``002`` for its
    write-up in shared/seeds, ``field`` for upstream issue trackers, ``extension`` for a repo's own
    (:mod:`pytest_llmload.plugin.check_registry`)."""
    from pytest_llmload.failures import BY_ID

    if BY_ID.get(failure.id) is not failure:
        return "extension"
    return failure.write_up.split("/")[-1][:3] if failure.write_up.startswith("seeds/") else "field"


def _judge(exc: BaseException, failure: Any, check: Any = None) -> Optional[Verdict]:
    from pytest_llmload.loader.faults import fix_in
    from pytest_llmload.loader.seam import LoaderContractError, LoaderError, LoaderModelError
    from pytest_llmload.runners.isolation import child_outcomes

    outcomes = child_outcomes(exc)
    if outcomes is not None:  # an isolated child or the ranks: judge what they raised, then how they ended
        return _of_children(exc, outcomes, failure, check)
    if type(exc).__name__ == "ChildError":  # raised in a child, did not pickle: its type is the message's head
        kind = str(exc).partition(":")[0]
        cause = {"ContractGap": "contract", "LoaderContractError": "contract", "LoaderError": "loader",
                 "LoaderModelError": "model", "LoaderFailedOnRank": "model"}.get(kind)
        if cause is not None:
            return Verdict("error", None, cause, _whole(exc).partition(": ")[2], fix_in(str(exc)))
    if isinstance(exc, LoaderContractError):
        return Verdict("error", None, "contract", _whole(exc))
    if isinstance(exc, LoaderError):
        return Verdict("error", None, "loader", _whole(exc), getattr(exc, "fix", None))
    if isinstance(exc, LoaderModelError):
        return Verdict("error", None, "model", _whole(exc), getattr(exc, "fix", None) or fix_in(str(exc)))
    if tracebacks.is_passed_deadline(exc):
        in_loader = tracebacks.in_loader_call(tracebacks.exception_text(exc))
        return _hang(failure, in_loader, _first_line(exc))
    if type(exc).__name__ == "PredictedFailure":  # a prediction for a runner this machine is not: never observed
        return Verdict("predicted", getattr(exc, "failure", None), "prediction", _head(exc))
    if type(exc) is AssertionError or type(exc).__name__ == "FailureObserved":
        return Verdict("failed", failure.id, "mechanism", _head(exc), getattr(failure, "fix", None))
    return _check_broke(exc, check=check)


def _same_bug(judged: Verdict, failure: Any) -> Verdict:
    """An error row whose text is another known failure's own error (a ``model.to()`` after an offloaded load breaks
    every check that offloads): it stays an error here, where this check's mechanism was not observed, and says
    which failure it is and which check judges it, so that one bug reads as one bug."""
    from pytest_llmload.failures import REGISTRY, match

    others = [known for known in match(judged.sentence) if known.id != getattr(failure, "id", None)]
    if not others:
        return judged
    known = others[0]
    checks = sorted({check.name for check in REGISTRY if check.failure.id == known.id and not check.needs_gpus})
    return judged._replace(sentence=f"{judged.sentence}\nthe same bug as {', '.join(checks) or known.id}: "
                                    f"{known.id} ({known.title}); fix: {known.fix}", fix=judged.fix or known.fix)


class ChildrenEnd(NamedTuple):
    """How the children that ran a check ended (an isolated check's child, the ranks), read in one place: the row's
    verdict and the fail-fast after a hang (:mod:`pytest_llmload.plugin.loader_hang`) both go by it."""

    how: str  # "raised": one raised (what it raised is judged); "hung": one was still running at its deadline and
    # none raised; "died": one ended without an answer, and none raised or hung
    in_loader: bool = False  # (hung) a hung child's stacks are inside the loader call
    after_a_death: bool = False  # (hung) another child died: the hung ones may only have been waiting on it

    @property
    def loader_hung(self) -> bool:
        """The loader itself hung: a child still in the loader call at its deadline, and none raised or died first
        (the others then wait on it, which is no hang of the loader's)."""
        return self.how == "hung" and self.in_loader and not self.after_a_death


def children_end(outcomes: list) -> ChildrenEnd:
    """How the children with these outcomes (:class:`~pytest_llmload.runners.children.ChildOutcome`) ended."""
    statuses = [o.status for o in outcomes]
    if "raised" in statuses:
        return ChildrenEnd("raised")
    hung = [o for o in outcomes if o.status == "hung"]
    if hung:
        return ChildrenEnd("hung", any(tracebacks.in_loader_call(o.stacks or "") for o in hung), "died" in statuses)
    return ChildrenEnd("died")


def _of_children(exc: BaseException, outcomes: list, failure: Any, check: Any = None) -> Verdict:
    ending = children_end(outcomes)
    if ending.how == "hung":
        return _hang(failure, ending.in_loader, _first_line(exc))
    if ending.how == "died":
        return Verdict("error", None, "died", _first_line(exc))
    verdicts = []
    for o in outcomes:
        if o.status == "raised" and isinstance(o.exception, BaseException) and not _is_skip(o.exception):
            verdict = _judge(o.exception, failure, check)  # (the same-bug line is added once, to the row's verdict)
            if verdict is not None and verdict.cause == "check":  # its frames are in the rank's traceback text
                verdict = _check_broke(o.exception, o.traceback or "", check)
            verdicts.append(verdict)
    verdicts = [v for v in verdicts if v is not None]
    for cause in ("mechanism", "contract", "loader", "model", "hang", "check"):  # the most telling first
        found = next((v for v in verdicts if v.cause == cause), None)
        if found is not None:
            return found
    return Verdict("error", None, "check", f"{_first_line(exc)} (report it: {bug_report_address()})")  # (did not come back)


def _hang(failure: Any, in_loader: bool, line: str) -> Verdict:
    if in_loader and getattr(failure, "hang_is_mechanism", False):
        return Verdict("failed", failure.id, "mechanism", line)
    where = "the loader under test hung" if in_loader else "the check did not finish in time"
    return Verdict("error", None, "hang", f"{where}: {line}")


def _check_broke(exc: BaseException, traceback_text: str = "", check: Any = None) -> Verdict:
    from pytest_llmload.loader.faults import MODEL_FAULTS, diagnose, said

    found = diagnose(exc, traceback_text)
    if found is not None and found.fault in MODEL_FAULTS:  # the loader's model, not the check's code, raised it
        return Verdict("error", None, "model", f"the loader's model raised {type(exc).__name__}: {_first_line(exc)}"
                                               f"{said(found)}", found.fix)
    text = _traceback_text(exc, traceback_text)
    repos_frame = _repos_check_frame(check, text)
    if repos_frame:  # a repo's own check (an extension): its code, not this project's, is what to fix
        return Verdict("error", None, "check",
                       f"the check {check.name} itself broke (a bug in the repo's own check, not a verdict on the "
                       f"loader): {type(exc).__name__}: {_first_line(exc)} at {repos_frame}")
    frame = tracebacks.innermost_own_frame(text)
    return Verdict("error", None, "check",
                   f"the check itself broke (a bug in pytest-llmload, not a verdict on the loader): "
                   f"{type(exc).__name__}: {_first_line(exc)}{' at ' + frame if frame else ''}; please report it "
                   f"with this traceback: {bug_report_address()}")


def _traceback_text(exc: BaseException, text: str = "") -> str:
    """``exc``'s frames as printed (raised in a child: the child's traceback text)."""
    if text:
        return text
    cause = exc.__cause__
    return str(cause) if type(cause).__name__ == "ChildTraceback" else "".join(traceback.format_tb(exc.__traceback__))


def _repos_check_frame(check: Any, text: str) -> str:
    """The innermost frame of traceback ``text`` in the file of ``check``'s function, as ``name (path:line)``, where
    that file is a repo's own (not this package's); ``''`` otherwise."""
    import inspect
    import re

    function = getattr(check, "function", None)
    function = getattr(function, "func", function)  # (a partial: a GPU variant)
    try:
        path = inspect.getsourcefile(function) if function is not None else None
    except TypeError:
        return ""
    if not path or tracebacks.is_ours(path):
        return ""
    found = re.findall(rf'File "{re.escape(path)}", line (\d+), in (\S+)', text)
    if not found:
        return f"{check.name} ({path})"
    line, name = found[-1]
    return f"{name} ({path}:{line})"


def _is_skip(exc: BaseException) -> bool:
    import pytest

    return isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception))


SUMMARY_LINES = 6


def _head(exc: BaseException) -> str:
    """A check's finding: its first line, and the lines after it where the first ends in a colon (the cause
    follows), up to :data:`SUMMARY_LINES`."""
    lines = [line.rstrip() for line in str(exc).splitlines() if line.strip()]
    if not lines or not lines[0].endswith(":"):
        return _first_line(exc)
    return "\n".join(lines[:SUMMARY_LINES])


WHOLE_LINES = 40


def _whole(exc: BaseException) -> str:
    """An error row's reason, every line of it (up to :data:`WHOLE_LINES`): the one thing to change is often after
    the first (``loader error: ImportError:`` with the module on the next line)."""
    lines = [line.rstrip() for line in str(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    cut = f"\n... ({len(lines) - WHOLE_LINES} more lines in the log)" if len(lines) > WHOLE_LINES else ""
    return "\n".join(lines[:WHOLE_LINES]).strip() + cut


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
