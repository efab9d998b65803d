"""The one way a test process starts children and hears back from them: isolated calls and checks
(:mod:`.isolation`), the ranks of a process group (:mod:`.ranks`), a launched job's rank
(:mod:`pytest_llmload.plugin.launched_env`).

Each caller describes its children (:class:`ChildSpec`: a function, its arguments, what to set up first) and asks
:func:`start_for` how they start; :func:`run_children` starts them, waits until each answered, died or ran past the
deadline, takes the stacks of those still running, kills them, and returns one :class:`ChildOutcome` per child.

- **How a child starts.** Forked from this process, which has already imported torch and the Hugging Face stack, so a
  child costs its work, not the imports (a fresh interpreter pays seconds for them). A process that has initialised
  CUDA is never forked: its child would inherit a CUDA context it cannot use (and hang or fail on its first CUDA
  call). There, and for GPU ranks, the child starts from the warm forkserver (:mod:`.warm_server`), a clean process
  that never touches CUDA, and the function, its arguments and its result go by pickle.
- **What every child does first** (:func:`start_child`): it leads its own process group, dies with its parent
  (:mod:`.lifeline`), writes its stdout, stderr and log records to files the parent hands on when it ends
  (:mod:`.child_output`), measures coverage where the parent does (:mod:`.child_coverage`), and runs one OpenMP
  thread. Whatever its function changes process-wide dies with it; what that function starts is ended with it.
- **What comes back**: one :class:`~.wire.Answer`, through the child's own pipe (:mod:`.wire`): the value, or the
  exception as itself with its traceback; a check's row, judged in its child or rank (``ChildSpec.judge``); the
  notes the check made for its row; and what the test's recorder saw in the child (its models and phases, for the
  HTML report), which joins the test's own recorder here. A child that sends none died: the parent judges only that,
  and a child still running at its deadline (:func:`children_end`).

No child and no temporary directory outlives :func:`run_children`, also when it is interrupted (Ctrl-C).
This module imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import NamedTuple, Optional

from pytest_llmload.runners import child_coverage, child_output, lifeline, warm_server, wire
from pytest_llmload.system import tracebacks
from pytest_llmload.system.words import a_type

_JOIN_S = 2.0
# Set at the run's deadline (pytest_llmload.plugin.interruption): the children still running when its interruption
# reaches run_children give their stacks before they are killed, on the KeyboardInterrupt (``llmload_stacks``).
stacks_at_interruption = threading.Event()


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
        self.row = None  # a check's row, judged in its isolated child or rank (the judged fields, plain data)
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


class ChildrenEnd(NamedTuple):
    """How the children that ran a check ended (an isolated check's child, the ranks), read in one place: the row's
    verdict (:mod:`pytest_llmload.checks.judgement`) and the fail-fast after a hang
    (:mod:`pytest_llmload.plugin.loader_hang`) both go by it."""

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
    """How the children with these outcomes (:class:`ChildOutcome`) ended."""
    statuses = [o.status for o in outcomes]
    if "raised" in statuses:
        return ChildrenEnd("raised")
    hung = [o for o in outcomes if o.status == "hung"]
    if hung:
        return ChildrenEnd("hung", any(tracebacks.in_loader_call(o.stacks or "") for o in hung), "died" in statuses)
    return ChildrenEnd("died")


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


# ---------------------------------------------------------------------------------------------------------
# How children start
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


class Start(NamedTuple):
    """How children start: ``method`` (``fork``, ``forkserver``, ``spawn``) and, for the forkserver's children, the
    DeepSpeed accelerator its server imports (``None``: this process's ``DS_ACCELERATOR``) and whether it sees no
    GPU (:func:`.warm_server.ensure`)."""

    method: str = "fork"
    accelerator: Optional[str] = None
    gpus_hidden: bool = False


def start_for(requested: Optional[str] = None, *, backend: Optional[str] = None, gpus_hidden: bool = False) -> Start:
    """How the children of one call start, decided here for every caller: an isolated call (no ``backend``), or
    ranks of a ``backend`` process group (gloo, nccl; forked here, or a launched job's rank). ``requested``: a start
    method the caller asks for (:func:`start_method`).

    Fork where that is safe; the forkserver for GPU ranks and wherever this process has initialised CUDA, its
    server importing DeepSpeed with the cuda accelerator where the children use a GPU (nccl ranks, an isolated call
    from a CUDA process). ``gpus_hidden`` (gloo ranks that simulate a runner without accelerators) on a machine with
    GPUs: the forkserver, its server seeing no GPU and running DeepSpeed on the cpu. Ranks forked from here would see
    this machine's GPUs, and DeepSpeed imported here with its cuda accelerator (fixed at import): gloo ranks then put
    the model on cuda:LOCAL_RANK, and rank 1 of a 1-GPU runner has none (the main job hung on the H200).
    """
    method = start_method(requested, clean_server=backend not in (None, "gloo"))
    if backend is None:  # from a forkserver because CUDA is initialised here: the children are a GPU process's
        accelerator = "cuda" if cuda_initialised() else None
    else:
        accelerator = "cuda" if backend == "nccl" else None
    if gpus_hidden:
        from pytest_llmload.system import gpus

        if gpus.visible_gpu_count() > 0:
            return Start("forkserver", "cpu", True)
    return Start(method, accelerator, gpus_hidden)


# ---------------------------------------------------------------------------------------------------------
# Running children
# ---------------------------------------------------------------------------------------------------------


class ChildSpec:
    """One child: ``fn(*args, **kwargs)`` after ``prepare()``; ``render(exc)`` turns an exception raised by
    ``fn`` into report text in the child (optional); ``judge(exc)`` (optional) judges in the child what ``fn`` did
    (``exc``: what it raised, ``None`` where it returned) into plain data, a check's row; ``merge_output`` sends
    stderr to stdout's file."""

    def __init__(self, label, fn, args=(), kwargs=None, *, prepare=None, render=None, judge=None, merge_output=False):
        self.label, self.fn, self.args, self.kwargs = label, fn, tuple(args), dict(kwargs or {})
        self.prepare, self.render, self.judge, self.merge_output = prepare, render, judge, merge_output


def run_children(specs, timeout: float, *, start: Start = Start(), tmp_root=None, prefix: str = "llmload-child-",
                 on_failure=None, start_together=False, once_forked=None):
    """Start one child per :class:`ChildSpec` as ``start`` says (:func:`start_for`), collect them until all answered,
    died, or ``timeout`` passed, take the stacks of those still running, kill them, and return one
    :class:`ChildOutcome` per child.

    ``on_failure(outcomes)`` may shorten the wait once a child failed (return a new deadline, or None): ranks
    blocked in a collective with a dead peer would otherwise wait out the whole deadline. ``start_together``: no
    child runs ``prepare`` before every child is started (ranks: none connects to a rendezvous while this process
    is still forking). ``once_forked()``: called after every child is started and before any runs ``prepare``
    (implies ``start_together``): what must not exist while this process forks (a store's serving thread) is made
    there. No child and no temporary directory outlives the call, also when it is interrupted (Ctrl-C).
    """
    import multiprocessing as mp

    ctx = mp.get_context(start.method)
    if start.method == "forkserver":
        # The stack imported once by the server (which never initialises CUDA), not by every child of every run.
        warm_server.ensure(accelerator=start.accelerator, gpus_hidden=start.gpus_hidden)
    workdir = tempfile.mkdtemp(prefix=prefix, dir=None if tmp_root is None else os.fspath(tmp_root))
    coverage = child_coverage.parent_settings()  # None unless coverage is measuring here
    outcomes = [ChildOutcome(i, spec.label) for i, spec in enumerate(specs)]
    procs, conns = [], []
    go = ctx.Event() if start_together or once_forked is not None else None
    started = lifeline.boot_clock()
    with lifeline.orphans_adopted():  # a child that dies leaves what it started to this process, not to init
        try:
            for index, spec in enumerate(specs):
                receiver, sender = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_child_main, name=f"llmload-{spec.label.replace(' ', '')}",
                    args=(index, spec, sender, workdir, os.getpid() if start.method == "fork" else None,
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
            if once_forked is not None:
                once_forked()
            if go is not None:
                go.set()
            pending = _collect(procs, conns, outcomes, time.monotonic() + timeout, on_failure)
            if pending:
                child_output.take_stacks(procs, outcomes, pending, workdir)
            # Ended before reading: what a child logs or prints after its answer (a rank's teardown) is kept too.
            _reap(procs, outcomes)
            child_output.hand_back(workdir, outcomes, specs)
            return outcomes
        except KeyboardInterrupt as stop:
            if stacks_at_interruption.is_set() and not hasattr(stop, "llmload_stacks"):
                _stacks_on(stop, procs, outcomes, workdir)
            raise
        finally:
            _reap(procs, outcomes)
            _end_left_behind(procs, outcomes, started)
            for conn in conns:
                conn.close()
            shutil.rmtree(workdir, ignore_errors=True)


def _stacks_on(stop: KeyboardInterrupt, procs, outcomes, workdir) -> None:
    """The stacks of the children still running, on ``stop`` (the run's deadline), as at their own deadline."""
    running = {i for i, (proc, outcome) in enumerate(zip(procs, outcomes))
               if outcome.status == "pending" and proc.exitcode is None}
    if running:
        child_output.take_stacks(procs, outcomes, running, workdir)
        stop.llmload_stacks = "\n".join(f"{outcomes[i].label} (pid {outcomes[i].pid}):\n{outcomes[i].stacks}"
                                         for i in sorted(running))


def _end_left_behind(procs, outcomes, since: float) -> None:
    """Kill what the children left running below this process, started ``since`` (:func:`.lifeline.boot_clock`):
    what a child that died or was killed had started (its orphans came here, :func:`.lifeline.orphans_adopted`);
    reap those that are this process's children now. A child that answered ended what it started itself."""
    if all(outcome.status in ("ok", "raised") for outcome in outcomes):
        return
    children = {proc.pid for proc in procs}  # (joined by multiprocessing, which reaps them)
    left = [pid for pid in lifeline.descendants(os.getpid(), since) if pid not in children]
    for pid in left:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + _JOIN_S
    while left and time.monotonic() < end:
        for pid in list(left):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            except ChildProcessError:  # not a child of this process (its own parent reaps it)
                pass
            left.remove(pid)
        if left:
            time.sleep(0.01)


def _reap(procs, outcomes) -> None:
    """Let the children that answered exit, kill the rest (hung, or interrupted) with their process groups and what
    they started elsewhere: a daemon in a session of its own is in no group of theirs, and would outlive them."""
    end = time.monotonic() + _JOIN_S
    for proc, outcome in zip(procs, outcomes):
        if outcome.status in ("ok", "raised"):
            proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            started = lifeline.descendants(proc.pid)  # (read first: a killed child's orphans leave its tree)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own process group
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            for pid in started:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)  # (SIGKILL: a daemon may ignore SIGTERM)
    for proc in procs:
        proc.join(5)


def _collect(procs, conns, outcomes, deadline: float, on_failure) -> set:
    """Receive answers until every child has answered, died, or the deadline passed; returns the hung ones."""
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
    answer = None
    if conn.poll():
        with contextlib.suppress(EOFError, OSError):
            answer = wire.loads(conn.recv_bytes())  # (the child runs this process's code)
    if answer is None:  # the child ended without a word: it died
        proc.join(_JOIN_S)
        outcome.status, outcome.exitcode = "died", proc.exitcode
    else:
        outcome.status, outcome.row = answer.status, answer.row
        if answer.status == "ok":
            outcome.value = answer.value
        else:
            outcome.error, outcome.traceback, outcome.rendered = answer.error, answer.traceback, answer.rendered
            if answer.exception is not None:
                with contextlib.suppress(Exception):
                    outcome.exception = wire.loads(answer.exception)
        _keep_notes(answer.notes)
        _keep_artefacts(answer.artefacts)
    outcome.finished_at = time.monotonic()


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
    ranks, the tests' forked runs), once it leads its own process group: it dies with the parent, writes its
    stdout/stderr to ``stdout_fd``/``stderr_fd`` (fds 1 and 2, and ``sys.stdout``/``sys.stderr``), where
    faulthandler writes a crash's stacks too; it measures coverage where the parent does, and runs one OpenMP
    thread. Returns the coverage measurement, for :func:`.child_coverage.save` before ``os._exit``."""
    _die_with_parent(parent_pid)
    child_output.redirect_output(stdout_fd, stderr_fd)
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
    # (The frames below this function are the parent's: child_output trims them from the stacks by its name.)
    os.setpgid(0, 0)
    out = child_output.open_for_child(child_output.path(workdir, index, "out"))
    err = out if spec.merge_output else child_output.open_for_child(child_output.path(workdir, index, "err"))
    cov = start_child(parent_pid, out, err, coverage_settings)
    for fd in {out, err}:
        os.close(fd)
    child_output.forward_log_records(child_output.path(workdir, index, "logs"), spec.label, log_level)
    child_output.answer_stack_requests(workdir, index)
    succeeded = False
    notes = _collect_notes()
    recorder, recorded_before = _recorder_mark()
    lifeline.become_subreaper()  # what the code under test starts and orphans (a setsid daemon) comes back here
    try:
        if go is not None:
            go.wait()  # (the parent dying meanwhile ends this child too: start_child)
        if spec.prepare is not None:
            spec.prepare()
        value = spec.fn(*spec.args, **spec.kwargs)
        _end_what_it_left(notes)
        row = spec.judge(None) if spec.judge is not None else None
        try:
            answer = wire.dumps(wire.Answer("ok", value, notes=tuple(notes), row=row,
                                            artefacts=_artefacts(recorder, recorded_before)))
        except Exception as exc:  # noqa: BLE001
            raise TypeError(
                f"{spec.label} returned {a_type(value)} that cannot be pickled: {exc}") from None
        succeeded = True
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent, KeyboardInterrupt too
        with contextlib.suppress(Exception):
            _end_what_it_left(notes)
        answer = _raised(exc, spec, notes, _artefacts(recorder, recorded_before))
    child_coverage.save(cov)  # os._exit skips coverage's own save; before the answer, after which the parent may kill
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    conn.send_bytes(answer)
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


def _raised(exc: BaseException, spec: ChildSpec, notes: list, artefacts: Optional[dict]) -> bytes:
    """The answer of a child whose function raised ``exc``: the exception, and (a check's child) its row judged here,
    where the exception is itself whether or not it pickles."""
    exception = wire.exception_bytes(exc)
    rendered = row = None
    if spec.render is not None:
        with contextlib.suppress(Exception):
            rendered = spec.render(exc)
    if spec.judge is not None:
        try:
            row = spec.judge(exc)
        except Exception as broke:  # noqa: BLE001 - the judge is this project's code: its bug is said, the parent judges
            notes.append(f"the row could not be judged in the child: {type(broke).__name__}: {broke}")
    return wire.dumps(wire.Answer("raised", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                                  exception=exception, rendered=rendered, notes=tuple(str(n) for n in notes),
                                  row=row, artefacts=artefacts))


def _end_what_it_left(notes: list) -> None:
    """End what the code under test left running, and say so in its row (before the answer goes back)."""
    left = lifeline.end_descendants()
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


def _recorder_mark():
    """In a child: the test's recorder it inherited (a forked child; ``None`` elsewhere) and how much of it was the
    parent's at the fork, so that only what the child records goes back."""
    recorders = sys.modules.get("pytest_llmload.instruments.recorder")  # (no import here: a fork may hold its lock)
    recorder = recorders.current_recorder() if recorders is not None else None
    return recorder, (recorder.mark() if recorder is not None else None)


def _artefacts(recorder, since) -> Optional[dict]:
    """What the child's copy of the test's recorder saw since the fork, as plain data; ``None`` where it saw nothing
    (or has no recorder)."""
    if recorder is None:
        return None
    with contextlib.suppress(Exception):  # a picture missing from the HTML report, never a failing child
        artefacts = recorder.artefacts(since)
        for phase in artefacts["phases"]:
            phase.setdefault("child", os.getpid())  # (the report marks a child's phases; a grandchild's keep theirs)
        return artefacts if artefacts["models"] or artefacts["phases"] else None
    return None


def _keep_artefacts(artefacts) -> None:
    """In the parent: what a child's recorder saw joins the running test's recorder (the HTML report's pictures)."""
    recorders = sys.modules.get("pytest_llmload.instruments.recorder")
    recorder = recorders.current_recorder() if recorders is not None and artefacts else None
    if recorder is not None:
        recorder.add_from_child(artefacts)


def _die_with_parent(parent_pid) -> None:
    """SIGKILL this child when the process that started it dies (killed pytest, CI timeout), so that no child
    outlives it. ``parent_pid`` is the forking test process; ``None`` for a forkserver child, whose parent is the
    forkserver (which ends with the test process)."""
    if not lifeline.die_with_parent(os.getppid() if parent_pid is None else parent_pid, signal.SIGKILL):
        os._exit(1)  # the parent died before the tie took effect
