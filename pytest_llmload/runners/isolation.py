"""Run a function in a child process forked from this one: a deadline this process enforces, the child's
thread stacks when it is hit, its exit code or signal when it dies, and nothing left behind.

``run_isolated(fn, args, timeout=...)`` returns what ``fn`` returns in the child, or raises what it raised::

    def read_env():
        import os
        os.environ["HF_HUB_OFFLINE"] = "1"   # dies with the child
        return os.getpid()

    assert run_isolated(read_env, timeout=10) != os.getpid()

The child is forked from the calling process, which has already imported torch and the Hugging Face stack,
so an isolated call costs the work, not the imports (a fresh interpreter pays seconds for them). The
child's stdout and stderr are written to this process's streams, and its log records handed to this
process's loggers (so pytest's "Captured log" and ``caplog`` see them), when it ends. Whatever
the call changes process-wide (environment variables, patched upstream functions, audit hooks, socket
guards, a process group, threads it leaves blocked) dies with the child. Where coverage is measuring (pytest-cov),
each child measures too and leaves its data for the run's combine (:mod:`pytest_llmload.runners.child_coverage`).

A process that has initialised CUDA is never forked: its child would inherit a CUDA context it cannot use
(and hang or fail on its first CUDA call). There the child starts from a forkserver, a clean process that
never touches CUDA, and ``fn``, its arguments and its result go by pickle. Keep CUDA work inside the
isolated calls and the test process stays forkable.

This module holds one isolated call: its deadline, and how its child's end is raised here. Starting the child and
hearing back from it is :mod:`.children`'s, the one path the ranks (:mod:`.ranks`) take too. This module imports
nothing heavy: the pytest plugin imports it on every run that isolates a test.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import Optional

from pytest_llmload.runners import children
from pytest_llmload.system import tracebacks
from pytest_llmload.runners.child_output import LOG_TAIL_LINES, STACK_WAIT_S, trim_stacks
from pytest_llmload.runners.children import ChildOutcome

# Room, inside an outer deadline (pytest-timeout's alarm), for taking the child's stacks and reaping it.
DEADLINE_MARGIN_S = STACK_WAIT_S + 1.0
DEFAULT_TIMEOUT_S = 120.0


def child_outcomes(exc: BaseException):
    """The :class:`ChildOutcome` list behind ``exc`` when children ran it (an isolated call's
    :class:`IsolationFailed`, the ranks' ``DistributedRunFailed``); ``None`` for an exception of this process."""
    return getattr(exc, "outcomes", None) or ([exc.outcome] if hasattr(exc, "outcome") else None)


class IsolationFailed(AssertionError):
    """The isolated call hung or died. ``outcome`` is its :class:`ChildOutcome`."""

    def __init__(self, message: str, outcome: ChildOutcome):
        super().__init__(message)
        self.outcome = outcome


class ChildError(Exception):
    """Stands for an exception raised in the child that could not be brought back (it does not pickle): its text
    only. (A check's child judged the exception itself, before it was lost: :func:`judged_by_child`.)"""


class ChildTraceback(Exception):
    """The traceback of the child, as the cause of the exception re-raised here: a failure report, and the
    known-failure catalog, see the child's frames. ``row``: the row's judged fields, where the child judged what it
    raised (an isolated check's child)."""

    row: Optional[dict] = None


def judged_by_child(exc: Optional[BaseException]) -> Optional[dict]:
    """The row's judged fields (plain data) that the child which raised ``exc`` sent with its answer, where a child
    judged it (an isolated check's: ``run_isolated(judge=...)``); ``None`` for an exception of this process, or of a
    child that judged nothing (it hung or died: the parent says that)."""
    cause = getattr(exc, "__cause__", None)
    return cause.row if isinstance(cause, ChildTraceback) else None


# ---------------------------------------------------------------------------------------------------------
# One isolated call
# ---------------------------------------------------------------------------------------------------------


def outer_deadline_left():
    """Seconds left on this process's real-time alarm (pytest-timeout's signal method), or None."""
    import threading

    if not hasattr(signal, "getitimer") or threading.current_thread() is not threading.main_thread():
        return None
    remaining = signal.getitimer(signal.ITIMER_REAL)[0]
    return remaining or None


def check_timeout(timeout) -> None:
    """A deadline in seconds must be a positive, finite number (``nan`` compares false with everything, and
    ``inf`` overflows every clock API): ``ValueError`` naming it otherwise."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout={timeout!r}; expected a positive, finite number of seconds.")


def effective_timeout(timeout) -> float:
    """``timeout``, shortened to end :data:`DEADLINE_MARGIN_S` before an outer alarm (pytest-timeout), so that
    the child's deadline, with its stacks, comes first; ``None`` takes what the alarm leaves, else the default."""
    if timeout is not None:
        check_timeout(timeout)
    outer = outer_deadline_left()
    inner = DEFAULT_TIMEOUT_S if timeout is None and outer is None else timeout
    if outer is not None:
        room = max(outer - DEADLINE_MARGIN_S, min(outer * 0.8, 1.0))
        inner = room if inner is None else min(inner, room)
    return float(inner)


def run_isolated(fn, args=(), kwargs=None, *, timeout=None, label: str = "isolated call", start=None,
                 tmp_root=None, render=None, judge=None):
    """Run ``fn(*args, **kwargs)`` in a child process and return its result (which must pickle).

    ``timeout`` (seconds; ``None``: what pytest-timeout's alarm leaves, else 120) is enforced here; it ends
    a little before an outer pytest-timeout alarm so that the child's stacks make the report. The child's
    stdout and stderr are written to this process's ``sys.stdout``/``sys.stderr`` (under pytest: the test's
    captured output). Raises:

    - what ``fn`` raised, re-raised here, with the child's traceback as its ``__cause__``
      (:class:`ChildTraceback`, with what ``judge(exc)`` made of it in the child, :func:`judged_by_child`);
      :class:`ChildError` for an exception that does not pickle;
    - :class:`IsolationFailed` when the child is still running at the deadline (with its thread stacks) or
      dies (with its signal or exit code and the tail of its output).
    """
    timeout = effective_timeout(timeout)
    how = children.start_for(start)
    spec = children.ChildSpec(label, fn, args, kwargs, render=render, judge=judge)
    (outcome,) = children.run_children([spec], timeout, start=how, tmp_root=tmp_root, prefix="llmload-isolated-")
    _replay(outcome)
    if outcome.status == "ok":
        return outcome.value
    if outcome.status == "raised":
        raise_child_exception(outcome)
    if outcome.status == "hung":
        message = (f"{tracebacks.did_not_return(label, timeout)}; its child (pid {outcome.pid}) was "
                   f"killed.\nthread stacks of the child at the deadline (most recent call first):\n{outcome.stacks}")
    else:
        message = f"{label}: its child (pid {outcome.pid}) died: {children.describe_exitcode(outcome.exitcode)}"
    if outcome.output.strip():
        message += f"\noutput of the child (last {LOG_TAIL_LINES} lines):\n{outcome.output.rstrip()}"
    raise IsolationFailed(message, outcome)


def _replay(outcome: ChildOutcome) -> None:
    with contextlib.suppress(Exception):
        if outcome.stdout:
            sys.stdout.write(outcome.stdout)
            sys.stdout.flush()
        if outcome.stderr:
            sys.stderr.write(trim_stacks(outcome.stderr) + "\n")
            sys.stderr.flush()


def raise_child_exception(outcome: ChildOutcome):
    """Raise the child's exception here, its traceback attached as the cause."""
    __tracebackhide__ = True
    exc = outcome.exception
    if not isinstance(exc, BaseException):
        exc = ChildError(outcome.error)
    if hasattr(exc, "_use_item_location"):  # pytest.skip(): reported at the test, not at this frame
        exc._use_item_location = True
    if outcome.rendered:
        headline = outcome.error.splitlines()[0] if outcome.error else type(exc).__name__
        with contextlib.suppress(Exception):  # an exception type with __slots__ takes no attribute
            exc.llmload_child_report = f"{headline}  (raised in an isolated child, pid {outcome.pid})\n{outcome.rendered}"
    cause = ChildTraceback(f"in the isolated child (pid {outcome.pid}):\n{outcome.traceback.rstrip()}")
    cause.row = outcome.row
    raise exc from cause


def render_failure(exc: BaseException):
    """In a child without a test item (an isolated check; ``run_isolated(render=...)``): the failure in pytest's long
    style, from the frame below the child's entry point; ``None`` for a skip or an xfail."""
    import pytest

    if isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)):
        return None
    excinfo = pytest.ExceptionInfo.from_exception(exc)
    excinfo.traceback = excinfo.traceback[1:] or excinfo.traceback
    return str(excinfo.getrepr(style="long", chain=True, truncate_locals=True))
