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
guards, a process group, threads it leaves blocked) dies with the child. The same machinery starts the
ranks of :mod:`pytest_llmload.runners.ranks` (``run_children``). Where coverage is measuring (pytest-cov), each
child measures too and leaves its data for the run's combine (:mod:`pytest_llmload.runners.child_coverage`).

A process that has initialised CUDA is never forked: its child would inherit a CUDA context it cannot use
(and hang or fail on its first CUDA call). There the child starts from a forkserver, a clean process that
never touches CUDA, and ``fn``, its arguments and its result go by pickle. Keep CUDA work inside the
isolated calls and the test process stays forkable.

This module imports nothing heavy: the pytest plugin imports it on every run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback

from pytest_llmload.runners import child_coverage, warm_server

_STACK_WAIT_S = 2.0
_JOIN_S = 2.0
_LOG_TAIL_LINES = 40
_OUTPUT_LIMIT = 1 << 20  # bytes of a child's stdout/stderr replayed into the caller's streams
_PICKLED_EXCEPTION_LIMIT = 1 << 20
# Room, inside an outer deadline (pytest-timeout's alarm), for taking the child's stacks and reaping it.
DEADLINE_MARGIN_S = _STACK_WAIT_S + 1.0
DEFAULT_TIMEOUT_S = 120.0


class ChildOutcome:
    """What became of one child: ``status`` is ``ok``, ``raised``, ``died`` or ``hung``."""

    def __init__(self, index: int, label: str):
        self.index, self.label = index, label
        self.pid = None
        self.status = "pending"
        self.value = None
        self.error = ""  # "Type: message" of what the child raised
        self.traceback = ""  # the child's traceback, as Python prints it
        self.exception = None  # the child's exception, unpickled here, where it could be
        self.rendered = None  # the child's own rendering of the failure (a pytest test's report)
        self.exitcode = None
        self.stacks = ""
        self.output = ""  # the tail of stdout and stderr, for failure messages
        self.stdout = ""
        self.stderr = ""
        self.finished_at = None

    def describe(self) -> str:
        if self.status == "raised":
            return f"{self.label} raised {self.error}"
        if self.status == "died":
            return f"{self.label} died: {describe_exitcode(self.exitcode)}"
        if self.status == "hung":
            return f"{self.label} was still running at the deadline"
        return f"{self.label}: {self.status}"

    def __repr__(self) -> str:
        return f"<ChildOutcome {self.label} pid={self.pid} {self.status}>"


def child_outcomes(exc: BaseException):
    """The :class:`ChildOutcome` list behind ``exc`` when children ran it (an isolated call's
    :class:`IsolationFailed`, the ranks' ``DistributedRunFailed``); ``None`` for an exception of this process."""
    return getattr(exc, "outcomes", None) or ([exc.outcome] if hasattr(exc, "outcome") else None)


def describe_exitcode(code) -> str:
    """``killed by SIGKILL (exit code -9)`` / ``exit code 3``, as multiprocessing reports a process's end."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name} (exit code {code})"
    return f"exit code {code}, before it returned a result"


class IsolationFailed(AssertionError):
    """The isolated call hung or died. ``outcome`` is its :class:`ChildOutcome`."""

    def __init__(self, message: str, outcome: ChildOutcome):
        super().__init__(message)
        self.outcome = outcome


class ChildError(Exception):
    """Stands for an exception raised in the child that could not be brought back (it does not pickle)."""


class ChildTraceback(Exception):
    """The traceback of the child, as the cause of the exception re-raised here: a failure report, and the
    known-failure catalog, see the child's frames."""


# ---------------------------------------------------------------------------------------------------------
# Start methods
# ---------------------------------------------------------------------------------------------------------


def cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def start_method(requested=None, *, clean_server: bool = False) -> str:
    """``fork`` (fast: the imports are done) unless this process has initialised CUDA, then ``forkserver``.

    A forked child of a process that has initialised CUDA inherits a CUDA context it cannot use, so there
    the child starts from a forkserver that never touches CUDA. ``clean_server`` asks for the forkserver
    anyway (GPU ranks: each rank initialises its own device). ``requested`` forces one, but never ``fork``
    from a CUDA process.
    """
    if requested is not None:
        if requested not in ("fork", "forkserver", "spawn"):
            raise ValueError(f"start_method={requested!r}; expected 'fork', 'forkserver' or 'spawn'.")
        if requested == "fork" and cuda_initialised():
            raise RuntimeError(
                "start_method='fork' refused: this process has initialised CUDA, and a forked child cannot use "
                "it. Use 'forkserver' (the default for GPU ranks)."
            )
        return requested
    return "forkserver" if clean_server or cuda_initialised() else "fork"


# ---------------------------------------------------------------------------------------------------------
# Running children (the core shared with the distributed runner)
# ---------------------------------------------------------------------------------------------------------


class ChildSpec:
    """One child: ``fn(*args, **kwargs)`` after ``prepare()``; ``render(exc)`` turns an exception raised by
    ``fn`` into report text in the child (optional); ``merge_output`` sends stderr to stdout's file."""

    def __init__(self, label, fn, args=(), kwargs=None, *, prepare=None, render=None, merge_output=False):
        self.label, self.fn, self.args, self.kwargs = label, fn, tuple(args), dict(kwargs or {})
        self.prepare, self.render, self.merge_output = prepare, render, merge_output


def run_children(specs, timeout: float, *, method: str = "fork", tmp_root=None, prefix: str = "llmload-child-",
                 accelerator=None, gpus_hidden=False, on_failure=None, start_together=False):
    """Start one child per :class:`ChildSpec`, collect them until all answered, died, or ``timeout`` passed,
    take the stacks of those still running, kill them, and return one :class:`ChildOutcome` per child.

    ``on_failure(outcomes)`` may shorten the wait once a child failed (return a new deadline, or None): ranks
    blocked in a collective with a dead peer would otherwise wait out the whole deadline. ``start_together``: no
    child runs ``prepare`` before every child is started (ranks: none connects to a rendezvous while this process
    is still forking). No child and no temporary directory outlives the call, also when it is interrupted (Ctrl-C).
    """
    import multiprocessing as mp

    ctx = mp.get_context(method)
    if method == "forkserver":
        # The stack imported once by the server (which never initialises CUDA), not by every child of every run;
        # ``accelerator``: DeepSpeed's, for the children (GPU ranks: cuda); ``gpus_hidden``: children that see none.
        warm_server.ensure(accelerator=accelerator, gpus_hidden=gpus_hidden)
    workdir = tempfile.mkdtemp(prefix=prefix, dir=None if tmp_root is None else os.fspath(tmp_root))
    coverage = child_coverage.parent_settings()  # None unless coverage is measuring here
    outcomes = [ChildOutcome(i, spec.label) for i, spec in enumerate(specs)]
    procs, conns = [], []
    go = ctx.Event() if start_together else None
    try:
        for index, spec in enumerate(specs):
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main, name=f"llmload-{spec.label.replace(' ', '')}",
                args=(index, spec, sender, workdir, os.getpid() if method == "fork" else None,
                      logging.getLogger().level, coverage, go),
                # Not daemonic: a daemonic process may not start children, and an isolated test may start ranks,
                # a rank DataLoader workers. The children are reaped here, whatever happens (finally, below).
                daemon=False,
            )
            with forking_quietly():
                proc.start()
            sender.close()
            procs.append(proc)
            conns.append(receiver)
            outcomes[index].pid = proc.pid
        if go is not None:
            go.set()
        pending = _collect(procs, conns, outcomes, time.monotonic() + timeout, on_failure)
        if pending:
            _dump_stacks(procs, outcomes, pending, workdir)
        # Ended before reading: what a child logs or prints after its answer (a rank's teardown) is kept too.
        _reap(procs, outcomes)
        _replay_log_records(workdir, outcomes)
        for outcome, spec in zip(outcomes, specs):
            out = _read(_output_path(workdir, outcome.index, "out"), _OUTPUT_LIMIT)
            err = "" if spec.merge_output else _read(_output_path(workdir, outcome.index, "err"), _OUTPUT_LIMIT)
            outcome.stdout, outcome.stderr = out, err
            outcome.output = "\n".join(_trim_stacks(out + err).splitlines()[-_LOG_TAIL_LINES:])
        return outcomes
    finally:
        _reap(procs, outcomes)
        for conn in conns:
            conn.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _output_path(workdir: str, index: int, kind: str) -> str:
    return os.path.join(workdir, f"child{index}.{kind}")


def _replay_log_records(workdir: str, outcomes) -> None:
    """Hand the children's log records to this process's loggers, in the order they were made: pytest's
    "Captured log" sections, ``caplog`` and live logging see them as if the work had run here. A child killed
    mid-record loses only that record."""
    records = []
    for outcome in outcomes:
        with contextlib.suppress(OSError), open(_output_path(workdir, outcome.index, "logs"), "rb") as f:
            while True:
                try:
                    records.append(logging.makeLogRecord(pickle.load(f)))
                except Exception:  # noqa: BLE001 - the end of the file, or a record cut short by a kill
                    break
    for record in sorted(records, key=lambda r: r.created):
        with contextlib.suppress(Exception):
            logging.getLogger(record.name).handle(record)


def _reap(procs, outcomes) -> None:
    """Let the children that answered exit, kill the rest (hung, or interrupted) with their process groups."""
    end = time.monotonic() + _JOIN_S
    for proc, outcome in zip(procs, outcomes):
        if outcome.status in ("ok", "raised"):
            proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own process group
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    for proc in procs:
        proc.join(5)


def _collect(procs, conns, outcomes, deadline: float, on_failure) -> set:
    """Receive results until every child has answered, died, or the deadline passed; returns the hung ones."""
    from multiprocessing.connection import wait

    pending = set(range(len(procs)))
    owner = {conn: i for i, conn in enumerate(conns)}
    owner.update({proc.sentinel: i for i, proc in enumerate(procs)})
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready = wait([conns[i] for i in pending] + [procs[i].sentinel for i in pending], timeout=left)
        for obj in ready:
            i = owner[obj]
            if i not in pending:
                continue
            _receive(procs[i], conns[i], outcomes[i])
            pending.discard(i)
        if pending and on_failure is not None and any(o.status in ("raised", "died") for o in outcomes):
            sooner = on_failure(outcomes)
            if sooner is not None:
                deadline = min(deadline, sooner)
    return pending


def _receive(proc, conn, outcome: ChildOutcome) -> None:
    message = None
    if conn.poll():
        with contextlib.suppress(EOFError, OSError):
            message = pickle.loads(conn.recv_bytes())
    if message is None:  # the child ended without a word: it died
        proc.join(_JOIN_S)
        outcome.status, outcome.exitcode = "died", proc.exitcode
    elif message[0] == "ok":
        outcome.status, outcome.value = "ok", message[1]
        _keep_notes(message[2])
    else:
        _, outcome.error, outcome.traceback, pickled, outcome.rendered, notes = message
        outcome.status = "raised"
        _keep_notes(notes)
        if pickled is not None:
            with contextlib.suppress(Exception):
                outcome.exception = pickle.loads(pickled)
    outcome.finished_at = time.monotonic()


def _dump_stacks(procs, outcomes, pending, workdir: str) -> None:
    paths = {i: os.path.join(workdir, f"child{i}.stacks") for i in pending}
    for i in pending:
        outcomes[i].status = "hung"
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[i].pid, signal.SIGUSR1)
    end = time.monotonic() + _STACK_WAIT_S
    while time.monotonic() < end:
        # faulthandler writes every thread in one go; a non-empty file that stopped growing is complete.
        sizes = {i: _size(path) for i, path in paths.items()}
        if all(sizes.values()):
            time.sleep(0.05)
            if sizes == {i: _size(path) for i, path in paths.items()}:
                break
        time.sleep(0.02)
    for i, path in paths.items():
        outcomes[i].stacks = _trim_stacks(_read(path)) or f"(no stacks: {outcomes[i].label} did not answer SIGUSR1)"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str, limit: int = -1) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read(limit)
    except OSError:
        return ""


def _trim_stacks(text: str) -> str:
    """Drop the frames below ``_child_main`` from faulthandler dumps: a forked child inherits its parent's
    call stack (pytest's frames), which would push the child's own frames out of the report."""
    kept, skipping = [], False
    for line in text.splitlines():
        if skipping and line.startswith('  File "'):
            continue
        skipping = False
        kept.append(line)
        if line.startswith('  File "') and line.endswith(" in _child_main"):
            skipping = True
    return "\n".join(kept).strip()


# ---------------------------------------------------------------------------------------------------------
# Inside a child
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def forking_quietly():
    """Around a fork (``os.fork``, a fork-context ``Process.start``) from this process.

    The heap is frozen while forking: what this process made stays out of the child's garbage collections
    (accelerate's and DeepSpeed's ``gc.collect()``, pytest's at the end of an isolated test), each of which would
    cost ~0.2 s over it and copy every page it touches. A freeze of the caller's own is left as it was."""
    import gc
    import warnings

    thaw = gc.get_freeze_count() == 0
    gc.freeze()
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns on every fork from a process with threads (torch starts one at import). The
            # hazards that are real here (OpenMP, inherited singletons) are handled in the child
            # (:func:`start_child`); a warning per child would only break runs with -W error.
            warnings.filterwarnings("ignore", message=r".*fork\(\) may lead to deadlocks",
                                    category=DeprecationWarning)
            yield
    finally:
        if thaw:
            gc.unfreeze()


def start_child(parent_pid, stdout_fd: int, stderr_fd: int, coverage_settings):
    """The start of every child of a test process, forked or from the forkserver (isolated calls and checks,
    ranks, :mod:`.warm` runs), once it leads its own process group: it dies with the parent, writes its
    stdout/stderr to ``stdout_fd``/``stderr_fd`` (fds 1 and 2, and ``sys.stdout``/``sys.stderr``), where
    faulthandler writes a crash's stacks too; it measures coverage where the parent does, and runs one OpenMP
    thread. Returns the coverage measurement, for :func:`.child_coverage.save` before ``os._exit``."""
    _die_with_parent(parent_pid)
    redirect_output(stdout_fd, stderr_fd)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a segfault leaves its stack in the child's output
    # After the redirection: coverage's own warnings and errors go to the child's output.
    cov = child_coverage.start(coverage_settings)
    torch = sys.modules.get("torch")
    if torch is not None:
        # GNU OpenMP is not fork-safe: a forked child whose parent has run a parallel region hangs in its
        # first parallel region with more than one thread. One thread per child avoids it.
        torch.set_num_threads(1)
    return cov


def _child_main(index, spec, conn, workdir, parent_pid, log_level, coverage_settings, go=None):
    # Own process group: the parent kills the child together with anything it started, and a Ctrl-C in the
    # terminal reaches only the parent, which then kills the children (no traceback per child).
    os.setpgid(0, 0)
    out = _open_output(_output_path(workdir, index, "out"))
    err = out if spec.merge_output else _open_output(_output_path(workdir, index, "err"))
    cov = start_child(parent_pid, out, err, coverage_settings)
    for fd in {out, err}:
        os.close(fd)
    _forward_log_records(_output_path(workdir, index, "logs"), spec.label, log_level)
    stacks = open(os.path.join(workdir, f"child{index}.stacks"), "w")  # noqa: SIM115 - lives as long as the child
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    succeeded = False
    notes = _collect_notes()
    _become_subreaper()  # what the code under test starts and orphans (a setsid daemon) comes back here to be ended
    try:
        if go is not None:
            go.wait()  # (the parent dying meanwhile ends this child too: start_child)
        if spec.prepare is not None:
            spec.prepare()
        value = spec.fn(*spec.args, **spec.kwargs)
        _end_what_it_left(notes)
        try:
            payload = pickle.dumps(("ok", value, notes))
        except Exception as exc:  # noqa: BLE001
            raise TypeError(
                f"{spec.label} returned a {type(value).__name__} that cannot be pickled: {exc}") from None
        succeeded = True
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent, KeyboardInterrupt too
        with contextlib.suppress(Exception):
            _end_what_it_left(notes)
        payload = _error_payload(exc, spec.render, notes)
    child_coverage.save(cov)  # os._exit skips coverage's own save; before the answer, after which the parent may kill
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    conn.send_bytes(payload)
    conn.close()
    with contextlib.suppress(Exception):
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            if succeeded:
                # Stay connected until every peer is done too: a rank that exits as soon as its own work is
                # done can close its gloo pairs while a slower peer is still in connectFullMesh ("Connection
                # closed by peer" on a run where nothing failed). A peer that failed makes this raise at once.
                dist.barrier()
            dist.destroy_process_group()
    os._exit(0)  # never run the parent's atexit handlers or pytest's teardown in a child


# Where exception classes live that claim another module: pytest's outcomes (skip, xfail, fail, exit) say
# "builtins", for shorter reports, so pickle cannot find them by name.
_EXCEPTION_HOMES = ("_pytest.outcomes",)


def _pickle_exception(exc: BaseException):
    """``exc`` pickled, or ``None`` when it does not survive the trip (or is too large to send)."""
    cls = type(exc)
    for home in _EXCEPTION_HOMES:
        module = sys.modules.get(home)
        if module is not None and getattr(module, cls.__qualname__, None) is cls and cls.__module__ != home:
            exc = _ExceptionByReference(home, cls.__qualname__, exc.args, dict(vars(exc)))
            break
    with contextlib.suppress(Exception):
        pickled = pickle.dumps(exc)
        if len(pickled) <= _PICKLED_EXCEPTION_LIMIT:
            pickle.loads(pickled)  # one that pickles but does not unpickle is no use to the parent
            return pickled
    return None


class _ExceptionByReference:
    def __init__(self, module, qualname, args, state):
        self.module, self.qualname, self.args, self.state = module, qualname, args, state

    def __reduce__(self):
        return _rebuild_exception, (self.module, self.qualname, self.args, self.state)


def _rebuild_exception(module, qualname, args, state):
    import importlib

    cls = getattr(importlib.import_module(module), qualname)
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


def _error_payload(exc: BaseException, render, notes: list) -> bytes:
    pickled = _pickle_exception(exc)
    rendered = None
    if render is not None:
        with contextlib.suppress(Exception):
            rendered = render(exc)
    return pickle.dumps(("raised", f"{type(exc).__name__}: {exc}", traceback.format_exc(), pickled, rendered,
                         [str(note) for note in notes]))


def _become_subreaper() -> bool:
    """Make this child the reaper of its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``): a daemon the code
    under test double-forks (a new session) is then reparented here, not to init, and :func:`end_descendants` finds
    it. ``False`` where the system has no such call."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _descendants(root: int) -> list[int]:
    """The pids below ``root`` in the process tree, read from /proc (empty where there is none)."""
    from pytest_llmload.runners.lifeline import proc_stat

    parent_of: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            fields = proc_stat(int(entry)) if entry.isdigit() else None
            if fields and len(fields) > 1:
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
    found = _descendants(os.getpid())
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


def _end_what_it_left(notes: list) -> None:
    """End what the code under test left running, and say so in its row (before the answer goes back)."""
    left = end_descendants()
    if left:
        notes.append(f"{len(left)} process(es) the code under test started were still running when it ended, and "
                     f"were ended: {'; '.join(left[:4])}")


def _collect_notes() -> list:
    """A fresh list for what the child's check says about how it judged (``keys.check_notes``), sent back with its
    answer: the row is written in the parent (a forkserver child would not even see the parent's list)."""
    notes: list = []
    keys = sys.modules.get("pytest_llmload.config.stash_keys")  # (only a check's child has it: it is a pytest module)
    if keys is not None:
        keys.check_notes.set(notes)
    return notes


def _keep_notes(notes) -> None:
    keys = sys.modules.get("pytest_llmload.config.stash_keys")
    for note in (notes or ()) if keys is not None else ():
        keys.add_note(note)


def _die_with_parent(parent_pid) -> None:
    """SIGKILL this child when the process that started it dies (killed pytest, CI timeout), so that no child
    outlives it. ``parent_pid`` is the forking test process; ``None`` for a forkserver child, whose parent is the
    forkserver (which ends with the test process)."""
    from pytest_llmload.runners.lifeline import die_with_parent

    if not die_with_parent(os.getppid() if parent_pid is None else parent_pid, signal.SIGKILL):
        os._exit(1)  # the parent died before the tie took effect


def _open_output(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)


def redirect_output(stdout_fd: int, stderr_fd: int) -> None:
    """Send a child's stdout/stderr (fds 1 and 2, and new ``sys.stdout``/``sys.stderr`` on them) to its own files
    (an isolated child's log records go to the parent: :func:`_forward_log_records`).

    Under pytest, sys.stdout is pytest's capture object, whose file the parent is still writing: a child
    writing there would interleave with the test's own output; the parent replays the files instead.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os.dup2(stdout_fd, 1)
    os.dup2(1 if stderr_fd == stdout_fd else stderr_fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115


class _RecordForwarder(logging.Handler):
    """In a child: writes each log record, made picklable, to a file the parent replays. Written and flushed
    record by record, so a child that hangs or dies still leaves what it logged."""

    def __init__(self, path: str, label: str):
        super().__init__()
        self._file = open(path, "ab")  # noqa: SIM115 - lives as long as the child
        self._label = label

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "llmload_child", None):  # already forwarded by a handler further down the tree
            return
        try:
            fields = dict(record.__dict__)
            fields["msg"], fields["args"] = record.getMessage(), None
            if record.exc_info:
                fields["exc_text"] = record.exc_text or logging.Formatter().formatException(record.exc_info)
            fields["exc_info"] = None
            fields["llmload_child"] = record.llmload_child = self._label
            for key, value in fields.items():
                try:
                    pickle.dumps(value)
                except Exception:  # noqa: BLE001 - an `extra` value that does not pickle travels as its repr
                    fields[key] = repr(value)
            pickle.dump(fields, self._file)
            self._file.flush()
        except Exception:  # noqa: BLE001
            self.handleError(record)


def _forward_log_records(path: str, label: str, log_level: int) -> None:
    """Replace the child's log handlers (copies of the parent's, pytest's capture handlers among them, whose
    records would die with the child) by one that sends every record to the parent, which handles it as its
    own. A logger that does not propagate gets one too."""
    forwarder = _RecordForwarder(path, label)
    root = logging.getLogger()
    root.setLevel(log_level)  # a forkserver child starts with logging's defaults, not the parent's level
    loggers = [logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    for logger in [root] + loggers:
        if logger is root or (logger.handlers and not logger.propagate):
            logger.handlers = [forwarder]
        elif logger.handlers:
            logger.handlers = []


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
                 tmp_root=None, render=None):
    """Run ``fn(*args, **kwargs)`` in a child process and return its result (which must pickle).

    ``timeout`` (seconds; ``None``: what pytest-timeout's alarm leaves, else 120) is enforced here; it ends
    a little before an outer pytest-timeout alarm so that the child's stacks make the report. The child's
    stdout and stderr are written to this process's ``sys.stdout``/``sys.stderr`` (under pytest: the test's
    captured output). Raises:

    - what ``fn`` raised, re-raised here, with the child's traceback as its ``__cause__``
      (:class:`ChildTraceback`); :class:`ChildError` for an exception that does not pickle;
    - :class:`IsolationFailed` when the child is still running at the deadline (with its thread stacks) or
      dies (with its signal or exit code and the tail of its output).
    """
    timeout = effective_timeout(timeout)
    method = start_method(start)
    spec = ChildSpec(label, fn, args, kwargs, render=render)
    # From a forkserver because CUDA is initialised here: the children are a GPU process's, DeepSpeed's cuda too.
    (outcome,) = run_children([spec], timeout, method=method, tmp_root=tmp_root, prefix="llmload-isolated-",
                              accelerator="cuda" if cuda_initialised() else None)
    _replay(outcome)
    if outcome.status == "ok":
        return outcome.value
    if outcome.status == "raised":
        raise_child_exception(outcome)
    if outcome.status == "hung":
        message = (f"{label} did not return: deadline of {timeout:g} s exceeded; its child (pid {outcome.pid}) was "
                   f"killed.\nthread stacks of the child at the deadline (most recent call first):\n{outcome.stacks}")
    else:
        message = f"{label}: its child (pid {outcome.pid}) died: {describe_exitcode(outcome.exitcode)}"
    if outcome.output.strip():
        message += f"\noutput of the child (last {_LOG_TAIL_LINES} lines):\n{outcome.output.rstrip()}"
    raise IsolationFailed(message, outcome)


def _replay(outcome: ChildOutcome) -> None:
    with contextlib.suppress(Exception):
        if outcome.stdout:
            sys.stdout.write(outcome.stdout)
            sys.stdout.flush()
        if outcome.stderr:
            sys.stderr.write(_trim_stacks(outcome.stderr) + "\n")
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
    raise exc from cause
