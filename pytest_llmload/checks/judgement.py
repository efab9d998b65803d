"""What a check's outcome means, judged where the check ran (this process, or the isolated child or the rank that ran
it and sends the judgement back as plain data with its answer): the row's verdict, the known failure it names, what an
error is, its whole reason and its fix (:func:`judged`).

A known failure is named only when the check observed its mechanism: the check's own judgement (an
``AssertionError`` it raised, here or on a rank), or a deadline passed inside the loader call where a hang is the
failure's mechanism (:attr:`~.base.KnownFailure.hang_is_mechanism`). Everything else is an ``error`` with no
failure: the loader raised, or broke the contract; the loader hung or ended its process; or the check's own code
crashed, which is a bug in pytest-llmload, reported as such (a repo's own check: a bug in that check, named by its file
and line). Nothing here reads the report's text (which prints the check's own docstring and source): only the
exception and what the children said. What the catalog adds (the same bug as another failure's) and what the run
carries (the loader, the runner, the timings) are added where the row is written
(:func:`pytest_llmload.reports.verdict.row_of`).

Imports nothing heavy.
"""

from __future__ import annotations

import traceback
from typing import Any, NamedTuple, Optional

from pytest_llmload.config.distribution import bug_report_address
from pytest_llmload.system import tracebacks

# A check that cannot judge (the loader did not put the model in the state its scenario needs) skips with a
# reason that starts so; `--llmload-strict` (ini `llmload_strict`, the main job's --fail-not-exercised) counts it as a failure.
NOT_EXERCISED = "not exercised: "

# A check the repo declared not to apply to it (``llmload_not_applicable``) skips with a reason that starts so.
DECLARED_NOT_APPLICABLE = "declared not applicable: "

# The fields of a row that a check's outcome decides (the rest is what the run carries).
JUDGED_FIELDS = ("check", "verdict", "guards", "failure", "cause", "sentence", "fix")


class Verdict(NamedTuple):
    kind: str  # "failed" (the check saw its failure), "predicted" (a runner profile would), or "error"
    failure: Optional[str]  # the known failure's id (or "OOM" for a prediction), only with "failed" or "predicted"
    cause: str  # mechanism | loader | contract | model | hang | died | check
    sentence: str  # the row's one line
    fix: Optional[str] = None  # the code to write instead: a loader fault's (loader.faults), or the failure's own


def judged(check: Any, *, raised: Optional[BaseException] = None, skipped: Optional[str] = None,
           xfail: Optional[tuple[bool, str]] = None, failed: Optional[str] = None, failed_in: str = "call") -> dict:
    """The judged fields of ``check``'s row (:data:`JUDGED_FIELDS`, plain data: an isolated child or a rank sends them
    back as they are), from what happened: it returned (nothing given: ``passed``); it ``raised`` (judged here; its
    ranks': how they ended, else the rows they judged themselves); it ``skipped`` (the skip reason: its kind from its words); ``xfail``
    (whether it failed, pytest's reason); or it ``failed`` with no exception of its own to judge (a setup that failed,
    ``failed_in``; a failure ``--llmload-strict`` made of a skip or an assumption).

    >>> judged(check, skipped="not exercised: the loader loaded the model whole on cpu")["verdict"]
    'not exercised'
    """
    verdict = judge(raised, check.failure, check) if raised is not None else None
    cause = None
    if xfail is not None:
        kind, sentence = ("xpassed" if xfail[0] else "xfailed"), xfail[1]
    elif skipped is not None:
        kind = "not exercised" if skipped.startswith(NOT_EXERCISED) else \
            "not applicable" if skipped.startswith(DECLARED_NOT_APPLICABLE) else "skipped"
        sentence = skipped
    elif verdict is not None:
        kind, sentence, cause = verdict.kind, verdict.sentence, verdict.cause
    elif failed is not None:  # a setup or teardown that failed is an error, as pytest says
        kind, sentence = ("failed", failed) if failed_in == "call" else ("error", failed)
        cause = failed_in if kind == "error" else None
    else:
        kind, sentence = "passed", ""
    failure = verdict.failure if verdict is not None and kind in ("failed", "predicted") else None
    known = check.failure if failure == check.failure.id else None
    return {"check": check.name, "verdict": kind, "guards": check.failure.id, "failure": failure, "cause": cause,
            "sentence": sentence,
            "fix": getattr(known, "fix", None) or getattr(verdict, "fix", None)}  # (a loader fault's: loader.faults)


def judged_in_child(check: Any, raised: Optional[BaseException]) -> dict:
    """In an isolated check's child, or a rank its check started (:class:`~pytest_llmload.runners.children.ChildSpec`'s
    ``judge``): the row's judged fields for what the child's function did, returned (``raised`` ``None``), raised or
    skipped."""
    import pytest

    if isinstance(raised, pytest.skip.Exception):
        return judged(check, skipped=raised.msg)
    return judged(check, raised=raised)


def judge(exc: BaseException, failure: Any, check: Any = None) -> Optional[Verdict]:
    """The verdict of a check guarding ``failure`` (a :class:`~.base.KnownFailure`) that raised ``exc``; ``None``
    for an outcome that is not a failure (a skip). ``check`` (the :class:`~.base.Check` that raised it): a crash in a
    repo's own check names that check's frame, not this project's."""
    from pytest_llmload.loader.faults import fix_in
    from pytest_llmload.loader.seam import LoaderContractError, LoaderError, LoaderModelError
    from pytest_llmload.runners.isolation import child_outcomes

    if _is_skip(exc):
        return None
    outcomes = child_outcomes(exc)
    if outcomes is not None:  # an isolated child or the ranks: how they ended, else the rows they judged
        return _of_children(exc, outcomes, failure)
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
    return check_broke(exc, check=check)


def _of_children(exc: BaseException, outcomes: list, failure: Any) -> Verdict:
    """The verdict on children that ended without a row of their own (one hung or died), else the most telling of
    the rows they judged themselves (each rank judged what it raised where it ran, with its check's judge:
    :func:`judged_in_child`)."""
    from pytest_llmload.runners.children import children_end

    ending = children_end(outcomes)
    if ending.how == "hung":
        return _hang(failure, ending.in_loader, _first_line(exc))
    if ending.how == "died":
        return Verdict("error", None, "died", _first_line(exc))
    rows = [o.row for o in outcomes if o.status == "raised" and o.row is not None]
    for cause in ("mechanism", "contract", "loader", "model", "hang", "check"):  # the most telling first
        row = next((row for row in rows if row["cause"] == cause), None)
        if row is not None:
            return Verdict(row["verdict"], row["failure"], cause, row["sentence"], row["fix"])
    return Verdict("error", None, "check", f"{_first_line(exc)} (report it: {bug_report_address()})")  # (did not come back)


def _hang(failure: Any, in_loader: bool, line: str) -> Verdict:
    if in_loader and getattr(failure, "hang_is_mechanism", False):
        return Verdict("failed", failure.id, "mechanism", line)
    where = "the loader under test hung" if in_loader else "the check did not finish in time"
    return Verdict("error", None, "hang", f"{where}: {line}")


def check_broke(exc: BaseException, check: Any = None) -> Verdict:
    """The verdict on a check whose own code raised ``exc``: a bug in this project, or in a repo's own check (named by
    its frame), or the loader's model's fault where the library's frames say so."""
    from pytest_llmload.loader.faults import MODEL_FAULTS, diagnose, said

    found = diagnose(exc)
    if found is not None and found.fault in MODEL_FAULTS:  # the loader's model, not the check's code, raised it
        return Verdict("error", None, "model", f"the loader's model raised {type(exc).__name__}: {_first_line(exc)}"
                                               f"{said(found)}", found.fix)
    text = _traceback_text(exc)
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


def _traceback_text(exc: BaseException) -> str:
    """``exc``'s frames as printed (raised in another process and re-raised here: that process's traceback text)."""
    from pytest_llmload.runners.isolation import ChildTraceback

    cause = exc.__cause__
    return str(cause) if isinstance(cause, ChildTraceback) else "".join(traceback.format_tb(exc.__traceback__))


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
