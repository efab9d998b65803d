"""The probes the checks use, public so that tests and downstream checks can use them too.

- :func:`deadline`: fail a block that runs too long, naming the frame it is stuck in, with every thread's stack
- :func:`thread_stacks`: the stack of every thread of this process
- :func:`spy_classmethod`: record who calls a classmethod (``GenerationConfig.from_pretrained``, say)
- :func:`record_writes`: every file this process creates, writes, renames or removes meanwhile, and by whom
- :func:`system_tempdir`: point the system temp dir somewhere else meanwhile
- :func:`record_network`: refuse, and record, every non-loopback connection or lookup meanwhile (the one
  definition of "local" is :mod:`pytest_llmload.system.offline`'s)

Nothing here imports torch or the Hugging Face stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

from pytest_llmload.instruments.recorder import note_deadline
from pytest_llmload.system import tracebacks


# --- deadlines and stacks --------------------------------------------------------------------------------


class _DeadlinePassed(BaseException):
    """Raised by the alarm; a BaseException so that a loader's ``except Exception`` cannot swallow it."""


class DeadlineExceeded(AssertionError):
    """A block of :func:`deadline` ran past its deadline (the verdict decides whether that is a failure's
    mechanism or a hung loader: :mod:`pytest_llmload.reports.verdict`). Its texts and the readers of them are
    :mod:`pytest_llmload.system.tracebacks`' (which knows it by name: ``DEADLINE_EXCEEDED``)."""


def thread_stacks(main_frame=None) -> str:
    """The stack of every thread of this process, named, innermost call last (``main_frame`` replaces
    the main thread's current frame, e.g. the frame a signal interrupted)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    if main_frame is not None:
        frames[threading.main_thread().ident] = main_frame
    out = []
    for ident, frame in frames.items():
        if frame is sys._getframe():
            continue
        out.append(f"~~~ thread {names.get(ident, '<unknown>')} (id {ident}) ~~~")
        out.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
    return "\n".join(out)


def _where(frame) -> str:
    """Where a block is stuck: the innermost frame that is not threading/queue/futures plumbing."""
    stuck = tracebacks.culprit(frame, tracebacks.WAITING_PLUMBING)
    return "<unknown frame>" if stuck is None else tracebacks.where(stuck)


# The watchdog acts this long after the alarm was due: where the alarm still works, it acts first.
_WATCHDOG_SLACK_S = 0.2
# After the watchdog's interruption, how long the block's thread may take to leave the block before it is stuck in a
# call that neither a signal nor an exception between two bytecodes reaches (``on_stuck``).
UNWIND_GRACE_S = 1.0


class _Watch:
    """One deadline's state, shared by the block's thread, its alarm and its watchdog (the heartbeat's thread)."""

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds, self.what = seconds, what
        self.ident = threading.get_ident()
        self.passed = type("_DeadlinePassed", (_DeadlinePassed,), {})  # this deadline's own: an outer one's passes by
        self.lock = threading.Lock()
        self.done = False  # the block has ended, returned or raised
        self.fired = False  # the watchdog raised into the block's thread
        self.where = self.stacks = ""

    def capture(self, frame) -> None:
        self.where, self.stacks = _where(frame), thread_stacks(frame)

    def text(self) -> str:
        return (f"{tracebacks.did_not_return(self.what, self.seconds)}, blocked in {self.where}.\n"
                f"Stacks of every thread:\n{self.stacks}")

    def end(self) -> None:
        """The block's thread leaves the block: an interruption the watchdog sent and it has not met yet is dropped."""
        with self.lock:
            self.done = True
            if self.fired:
                _raise_in_thread(self.ident, None)

    def on_alarm(self, signum, frame) -> None:
        if self.done:  # (due as the block ended)
            return
        self.capture(frame)
        raise self.passed()

    def watch(self, _key) -> bool:
        """Past the deadline, on the watchdog's thread: a block the alarm did not end (the guarded code took
        ``SIGALRM``'s handler, disarmed the timer, or swallowed the exception) gets the exception between two of
        its bytecodes. True if it was sent."""
        with self.lock:
            if self.done:
                return False
            if not self.where:
                self.capture(sys._current_frames().get(self.ident))
            self.fired = True
            _raise_in_thread(self.ident, self.passed)
            return True


def _raise_in_thread(ident: int, exception_type) -> None:
    """Raise ``exception_type`` in thread ``ident`` at its next bytecode (``None``: drop one not raised yet)."""
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), None if exception_type is None else ctypes.py_object(exception_type))


@contextlib.contextmanager
def deadline(seconds: float, what: str, on_stuck: Optional[Callable[[str], None]] = None) -> Iterator[None]:
    """Fail with ``AssertionError`` naming the blocked frame and every thread's stack when the block runs
    longer than ``seconds``, instead of hanging the job.

    Uses ``SIGALRM`` (main thread, POSIX) and nests under pytest-timeout's signal method: an outer timer
    due sooner is left alone, a later one is re-armed afterwards. The guarded code cannot remove it by taking
    ``SIGALRM`` for itself: a watchdog thread raises the same failure in the block's thread between two bytecodes
    where the alarm did not act, and where even that does not end the block within :data:`UNWIND_GRACE_S` (a call
    that no signal interrupts), calls ``on_stuck`` with the failure's text from the watchdog's thread: the caller
    decides (end the process). Elsewhere the block is only timed, and a block that ends late still fails.
    """
    __tracebackhide__ = True
    start = time.monotonic()
    usable = hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
    outer_remaining, outer_interval = signal.getitimer(signal.ITIMER_REAL) if usable else (0.0, 0.0)
    if not usable or (outer_remaining and outer_remaining <= seconds):
        yield
        _fail_if_late(start, seconds, what)
        return
    from pytest_llmload.instruments.heartbeat import heartbeat

    watch = _Watch(seconds, what)
    keys = (("llmload-deadline", id(watch)), ("llmload-deadline-stuck", id(watch)))

    def watchdog(key) -> None:
        if watch.watch(key) and on_stuck is not None:
            heartbeat().schedule(keys[1], UNWIND_GRACE_S, lambda _: None if watch.done else on_stuck(watch.text()))

    outer_handler = signal.signal(signal.SIGALRM, watch.on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    heartbeat().schedule(keys[0], seconds + _WATCHDOG_SLACK_S, watchdog)
    try:
        try:
            yield
        finally:
            watch.end()
    except _DeadlinePassed as exc:
        watch.end()  # (met in the block's own finally, before it ended)
        if not isinstance(exc, watch.passed):
            raise  # an outer deadline's
        note_deadline(what, time.monotonic() - start, seconds)
        raise DeadlineExceeded(watch.text()) from None
    finally:
        for key in keys:
            heartbeat().cancel(key)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, outer_handler)
        if outer_remaining:
            left = outer_remaining - (time.monotonic() - start)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-3), outer_interval)
    _fail_if_late(start, seconds, what)


def _fail_if_late(start: float, seconds: float, what: str) -> None:
    elapsed = time.monotonic() - start
    note_deadline(what, elapsed, seconds)  # the session summary lists checks that came close
    if elapsed > seconds:
        raise DeadlineExceeded(tracebacks.ran_late(what, elapsed, seconds))


# --- spies -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def spy_classmethod(cls, name: str, calls: list) -> Iterator[None]:
    """Record ``(cls name, caller module, caller location, keyword arguments)`` for each call of classmethod
    ``cls.name``."""
    original = cls.__dict__[name]

    def spy(klass, *args, **kwargs):
        caller = sys._getframe(1)
        calls.append((klass.__name__, tracebacks.module_of(caller) or "?",
                      f"{caller.f_code.co_filename}:{caller.f_lineno}", kwargs))
        return original.__func__(klass, *args, **kwargs)

    setattr(cls, name, classmethod(spy))
    try:
        yield
    finally:
        setattr(cls, name, original)


@dataclasses.dataclass(frozen=True)
class Write:
    event: str  # the audit event: open, os.mkdir, os.rename, ...
    path: str
    at_import: bool  # made while importing a module (torch._dynamo makes its cache dir when first imported)
    by: str = ""  # the module whose code asked for it, past the file plumbing (os.makedirs, tempfile, pathlib, ...)


# The standard library's file plumbing: a write is attributed to the code that called it (tempfile.mkdtemp called
# by transformers' modeling_utils is transformers' write; os.makedirs by torch._inductor's cache code, inductor's).
_PLUMBING = ("os", "posixpath", "genericpath", "shutil", "tempfile", "pathlib", "io", "_pyio", "codecs",
             "contextlib", "functools")


def _writer(frame) -> str:
    """The module of the innermost frame, from ``frame`` outwards, that is not file plumbing."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _PLUMBING:
            return module
        frame = frame.f_back
    return ""


_recorders: list[list[Write]] = []
_hook_installed = False
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _audit_hook(event: str, args: tuple) -> None:
    if not _recorders:
        return
    dir_fd = None
    if event == "open":
        path, mode, flags = args
        if isinstance(mode, str):
            if not any(c in mode for c in "wax+"):
                return
        elif not (isinstance(flags, int) and flags & _WRITE_FLAGS):
            return
    elif event in ("os.mkdir", "os.rmdir", "os.remove", "shutil.rmtree", "shutil.copyfile"):
        path = args[0] if event != "shutil.copyfile" else args[1]
        dir_fd = args[-1] if event in ("os.mkdir", "os.rmdir", "os.remove") else None
    elif event in ("os.rename", "os.replace", "os.link", "os.symlink"):
        path, dir_fd = args[1], args[3] if len(args) > 3 else None
    else:
        return
    if path is None or isinstance(path, int):
        return
    path = os.fsdecode(path)
    if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(path):
        # relative to an open directory (shutil.rmtree works this way): resolve it while the fd is open
        try:
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        except OSError:
            path = f"<directory fd {dir_fd}>/{path}"
    path = os.path.realpath(path)
    caller = frame = sys._getframe(1)
    at_import = False
    while frame is not None:
        if tracebacks.is_importing(frame.f_code.co_filename):
            at_import = True
            break
        frame = frame.f_back
    write = Write(event, path, at_import, _writer(caller))
    for record in _recorders:
        record.append(write)


@contextlib.contextmanager
def record_writes() -> Iterator[list[Write]]:
    """Record every file or directory this process creates, writes, renames or removes meanwhile, and which module
    asked for it (Python audit events; writes made by native code without Python's ``open`` are not seen here)."""
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit_hook)  # cannot be removed; it returns at once while nothing records
        _hook_installed = True
    record: list[Write] = []
    _recorders.append(record)
    try:
        yield record
    finally:
        _recorders.remove(record)


@contextlib.contextmanager
def system_tempdir(path: Path) -> Iterator[None]:
    """Point the system temp dir (``tempfile.tempdir`` and ``$TMPDIR``) at ``path`` meanwhile."""
    saved_tempdir, saved_env = tempfile.tempdir, os.environ.get("TMPDIR")
    tempfile.tempdir = os.environ["TMPDIR"] = str(path)
    try:
        yield
    finally:
        tempfile.tempdir = saved_tempdir
        if saved_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = saved_env


@contextlib.contextmanager
def record_network() -> Iterator[list[str]]:
    """Refuse every connection or name lookup to a non-loopback host meanwhile, and record each attempt
    (``"connect ('huggingface.co', 443) from <caller>"``), even one the code under test catches and swallows."""
    from pytest_llmload.system.offline import network_guard

    attempts: list[str] = []
    with network_guard(record=attempts):
        yield attempts


__all__ = ["Write", "deadline", "record_network", "record_writes", "spy_classmethod", "system_tempdir",
           "thread_stacks"]
