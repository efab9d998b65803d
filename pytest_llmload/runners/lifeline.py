"""Processes that end with the process that started them, however it ends (a signal, a crash, SIGKILL).

The main job (``python -m pytest_llmload``) runs pytest in a child; that pytest process runs checks in
isolated children, ranks and xdist workers. Each of them is tied to its parent here:

- :func:`die_with_parent`: this process gets a signal when its parent ends (Linux: ``prctl(PR_SET_PDEATHSIG)``;
  other POSIX systems: a thread that polls ``os.getppid()``);
- :func:`tie_to_main_job`: in the main job's pytest run (and its xdist workers), SIGTERM and SIGHUP stop pytest
  as Ctrl-C does, so that its finalizers kill the checks' children and remove their temp dirs; the parent's
  death sends SIGTERM; a run left behind by a killed main job also removes the main job's temp dir (which holds
  the run's own temp dirs: the main job points its ``TMPDIR`` there);
- :func:`become_subreaper` and :func:`end_descendants`: a check's child adopts what the code under test starts and
  orphans (a double-forked daemon), and ends all of it when that code has ended.

This module imports nothing heavy: the pytest plugin imports it on every run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
from typing import Optional

from pytest_llmload.config.vocabulary import PARENT_ENV, PARENT_WORKDIR_ENV

# After SIGTERM, the longest pytest may take to clean up before it is killed (a cleanup that blocks).
HARD_STOP_S = 20.0
_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, signum: int = signal.SIGKILL) -> bool:
    """Have ``signum`` sent to this process when its parent ``parent_pid`` ends.

    Returns False when the parent has already ended (the caller should exit: nobody is waiting for it).
    """
    if not _set_parent_death_signal(signum):
        threading.Thread(target=_watch_parent, args=(parent_pid, signum), name="llmload-lifeline",
                         daemon=True).start()
    return os.getppid() == parent_pid  # checked after arming: a parent that died before is caught too


def _set_parent_death_signal(signum: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch_parent(parent_pid: int, signum: int) -> None:
    import time

    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    os.kill(os.getpid(), signum)


class _Tie:
    owner: Optional[int] = None  # the pytest process tied; a child forked from it keeps the default action
    parent: Optional[int] = None
    parent_workdir: Optional[str] = None
    stopping = False


def tie_to_main_job() -> None:
    """In a pytest process started by the main job (``$PYTEST_LLMLOAD_PARENT_PID`` set): end with the parent and
    turn SIGTERM/SIGHUP into a clean interruption. Its own xdist workers tie to it in turn. No-op otherwise."""
    parent = os.environ.get(PARENT_ENV, "")
    if not parent.isdigit() or (os.getppid() != int(parent) and _alive(int(parent))):
        return  # not under the main job, or further down its tree (a check's own subprocess inherited the variable)
    _Tie.owner, _Tie.parent = os.getpid(), int(parent)
    # Only the main job's own child may remove the main job's temp dir: not a worker outliving its controller.
    _Tie.parent_workdir = os.environ.pop(PARENT_WORKDIR_ENV, None)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    if not die_with_parent(_Tie.parent, signal.SIGTERM):  # the parent died while this process started
        _remove_parent_workdir()
        os._exit(128 + signal.SIGTERM)
    os.environ[PARENT_ENV] = str(os.getpid())  # what xdist workers started from here tie to


def proc_stat(pid: int) -> Optional[list[bytes]]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state, parent pid, ...); ``None`` where it cannot
    be read (the process is gone, or there is no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie (dead, not yet reaped by its own parent) does not."""
    if os.path.isdir("/proc/self"):
        fields = proc_stat(pid)
        return fields is not None and fields[0] != b"Z"
    try:  # no /proc: ask the kernel (a zombie counts as running there)
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _interrupt(signum, frame) -> None:
    if os.getpid() != _Tie.owner:  # an isolated child or rank forked from the tied process: die as by default
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _Tie.stopping:  # a second signal must not break off the cleanup the first one started
        return
    _Tie.stopping = True
    if os.getpgrp() == os.getpid():  # the main job's child leads its group: pass it on to the xdist workers in it
        with contextlib.suppress(OSError):
            os.killpg(os.getpgrp(), signal.SIGTERM)
    if os.getppid() != _Tie.parent:  # the main job is gone: nobody else will remove its temp dir (and ours in it)
        import atexit

        atexit.register(_remove_parent_workdir)
    stop = threading.Timer(HARD_STOP_S, _hard_stop)
    stop.daemon = True
    stop.start()
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def _hard_stop() -> None:
    """pytest did not finish stopping in time (a finalizer that blocks): end it; its children die with it."""
    if os.getppid() != _Tie.parent:
        _remove_parent_workdir()
    os.kill(os.getpid(), signal.SIGKILL)


def _remove_parent_workdir() -> None:
    if _Tie.parent_workdir:
        shutil.rmtree(_Tie.parent_workdir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# What a child started: ended with it
# ---------------------------------------------------------------------------------------------------------


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``): a daemon the code
    under test double-forks (a new session) is then reparented here, not to init, and :func:`end_descendants` finds
    it. ``False`` where the system has no such call."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def orphans_adopted():
    """While the block runs, this process reaps the orphans of its descendants (``PR_SET_CHILD_SUBREAPER``, as it
    was before afterwards): what a child that died left running (a daemon in a session of its own) comes here, not
    to init, and :func:`descendants` of this process still finds it. Does nothing where the system has no such
    call."""
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
        was = ctypes.c_int(0)
        if prctl(37, ctypes.byref(was), 0, 0, 0) != 0:  # PR_GET_CHILD_SUBREAPER
            raise OSError
    except (OSError, AttributeError):
        yield
        return
    if not was.value:
        prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    try:
        yield
    finally:
        if not was.value:
            prctl(36, 0, 0, 0, 0)


def boot_clock() -> float:
    """Seconds since the machine booted: the clock of a process's start time in /proc (:func:`descendants`)."""
    import time

    return time.clock_gettime(time.CLOCK_BOOTTIME)


def descendants(root: int, since: Optional[float] = None) -> list[int]:
    """The pids below ``root`` in the process tree, read from /proc (empty where there is none), those in sessions
    of their own included; with ``since`` (:func:`boot_clock`), only those started in a later clock tick."""
    parent_of: dict[int, int] = {}
    after = None if since is None else int(since * os.sysconf("SC_CLK_TCK"))
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            fields = proc_stat(int(entry)) if entry.isdigit() else None
            if fields and len(fields) > 19 and (after is None or int(fields[19]) > after):
                parent_of[int(entry)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parent_of.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().split(b"\0")
            return " ".join(w.decode(errors="replace") for w in words if w)[:120] or "?"
    return "?"


def end_descendants(grace: float = 1.0) -> list[str]:
    """End every process below this one (SIGKILL: a daemon may ignore SIGTERM) and reap them; what was ended, as
    ``"pid (command line)"``. Called by a child when the code it ran has ended: nothing it started outlives it."""
    import time

    found = descendants(os.getpid())
    described = [f"{pid} ({_command_line(pid)})" for pid in found]
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + grace
    while found and time.monotonic() < end:  # reap: they, and orphans of theirs, are children here now
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            time.sleep(0.01)
    return described
