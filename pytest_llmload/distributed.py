"""Real multi-process runs for tests, and the rule that says whether this process is one rank of a job.

``run_ranks(fn, world_size)`` runs ``fn`` on every rank of a real ``torch.distributed`` process group and
returns the ranks' results in rank order::

    def all_reduce_ranks():
        import torch, torch.distributed as dist
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        return t.item()

    assert run_ranks(all_reduce_ranks, world_size=2) == [3.0, 3.0]

The ranks are forked from the calling process, which has already imported torch and the Hugging Face
stack, so a 2-rank run costs the work, not the imports (a fresh interpreter pays seconds for them). Each rank
sees what a launcher would give it (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and nothing of the launcher variables of the test process. A rank that raises, hangs or
dies makes ``run_ranks`` raise :class:`DistributedRunFailed` with that rank's traceback, thread stacks or
exit code; no process, port or temporary directory outlives the call, also on Ctrl-C.

This module imports nothing heavy at import time: the reference loader imports it for :func:`is_distributed`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import faulthandler
import importlib
import importlib.util
import logging
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Optional

# ---------------------------------------------------------------------------------------------------------
# Is this process one rank of a distributed job? (write-up 004)
# ---------------------------------------------------------------------------------------------------------

DISTRIBUTED_ENV_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
_INT_RE = re.compile(r"-?[0-9]+")


def _env_int(environ: Mapping[str, str], name: str, *, minimum: int) -> Optional[int]:
    """``environ[name]`` as an int, ``None`` when unset; a ValueError naming the variable otherwise."""
    raw = environ.get(name)
    if raw is None:
        return None
    if not isinstance(raw, str) or not _INT_RE.fullmatch(raw.strip()):
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; a launcher sets it to a number "
            f"(torchrun, deepspeed and accelerate all do). Unset it or give it a number."
        )
    value = int(raw.strip())
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} is out of range: it must be at least {minimum}.")
    return value


def is_distributed(environ: Mapping[str, str], deepspeed: bool = False) -> bool:
    """Whether a process with this environment is one rank of a distributed job (the rule of write-up 004).

    True when ``deepspeed`` is set, when ``WORLD_SIZE`` is not 1, or when ``RANK`` or ``LOCAL_RANK`` is set
    (so ``WORLD_SIZE=1 RANK=0``, what ``torchrun --nproc-per-node 1`` gives, is distributed: accelerate
    treats it as such too). ``LOCAL_RANK=-1`` and ``RANK=-1`` mean "not distributed", the convention of
    ``TrainingArguments.local_rank`` and of accelerate's own check. A value that is empty or not a number
    raises ``ValueError`` naming the variable and the value, rather than a crash deep inside torch::

        >>> is_distributed({"WORLD_SIZE": "2"})
        True
        >>> is_distributed({"LOCAL_RANK": "-1"})
        False
        >>> is_distributed({"RANK": ""})
        Traceback (most recent call last):
        ...
        ValueError: environment variable RANK='' is not an integer; ...
    """
    if not isinstance(deepspeed, bool):
        raise TypeError(f"is_distributed(deepspeed={deepspeed!r}): expected True or False.")
    # Parse every variable first, so an odd value is reported even when another variable decides.
    world_size = _env_int(environ, "WORLD_SIZE", minimum=1)
    rank = _env_int(environ, "RANK", minimum=-1)
    local_rank = _env_int(environ, "LOCAL_RANK", minimum=-1)
    if deepspeed:
        return True
    if world_size is not None and world_size != 1:
        return True
    return any(value is not None and value != -1 for value in (rank, local_rank))


def local_rank(environ: Mapping[str, str]) -> int:
    """This rank's index on its machine (``LOCAL_RANK``, else 0): which GPU a rank pins its model to."""
    value = _env_int(environ, "LOCAL_RANK", minimum=-1)
    return 0 if value is None or value < 0 else value


# ---------------------------------------------------------------------------------------------------------
# Running a function on N ranks
# ---------------------------------------------------------------------------------------------------------

# Launcher variables a rank must not inherit from the test process: they describe some other job (the
# shell that started pytest may itself run under torchrun or SLURM) and would change what accelerate decides;
# ACCELERATE_BYPASS_DEVICE_MAP=true, for one, silences the very error of write-up 004.
_LAUNCHER_VARS = frozenset(
    ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
     "ROLE_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK", "CROSS_SIZE")
)
_LAUNCHER_PREFIXES = ("ACCELERATE_", "FSDP_", "TORCHELASTIC_", "OMPI_COMM_WORLD_", "PMI_", "MV2_")

# Modules a rank would otherwise import lazily, paying for them in every rank of every run (what a forked
# child imports dies with it). DeepSpeed's engine imports its Muon optimizer, which calls torch.compile at
# import time and pulls in torch._inductor: about 3 s per rank on 2 cores.
HF_PRELOAD = (
    "torch.distributed",
    "transformers.modeling_utils",
    "transformers.models.auto.modeling_auto",
    "transformers.loss.loss_utils",
    "accelerate",
    "accelerate.utils",
)
DEEPSPEED_PRELOAD = HF_PRELOAD + (
    "deepspeed",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.zero.stage_1_and_2",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "torch._inductor.compile_fx",
    "accelerate.utils.deepspeed",
    "transformers.integrations.deepspeed",
)

_STACK_WAIT_S = 2.0
_GRACE_AFTER_FAILURE_S = 5.0
_JOIN_S = 2.0
_LOG_TAIL_LINES = 40
# Errors a rank reports when a peer went away first: a consequence, listed after the cause.
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "remote worker", "Broken pipe",
              "NCCL communicator was aborted", "ProcessGroupNCCL")


def preload(modules: Sequence[str]) -> None:
    """Import ``modules`` here, before forking, so that no rank pays for them; a missing one is skipped."""
    for name in modules:
        if name in sys.modules:
            continue
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    if "deepspeed" in modules and "deepspeed" in sys.modules:
        prebuild_deepspeed_ops()


def prebuild_deepspeed_ops() -> None:
    """Build (or load the cached build of) DeepSpeed's CPU shared-memory comm op here, before forking.

    Every DeepSpeed process group JIT-compiles that C++ op on first use, under a lock file in
    ``TORCH_EXTENSIONS_DIR`` (about 30 s on 2 cores). Built in a rank, every rank waits on the lock, and a rank
    killed at its deadline mid-build leaves the lock behind: every later DeepSpeed run on the machine then
    hangs. DeepSpeed keeps loaded ops in ``OpBuilder._loaded_ops``, so a forked rank reuses the parent's.
    The build directory defaults to one per Python environment: two venvs sharing ``~/.cache`` (tox, CI)
    would otherwise rebuild the op over each other.
    """
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(sys.prefix, "torch_extensions"))
    with contextlib.suppress(ImportError):
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()  # returns None where the accelerator has no such op (CUDA)


@dataclasses.dataclass
class RankOutcome:
    """What became of one rank: ``status`` is ``ok``, ``raised``, ``died`` or ``hung``."""

    rank: int
    pid: Optional[int] = None
    status: str = "pending"
    value: Any = None
    error: str = ""
    traceback: str = ""
    exitcode: Optional[int] = None
    stacks: str = ""
    output: str = ""
    finished_at: Optional[float] = None

    @property
    def lost_a_peer(self) -> bool:
        return self.status == "raised" and any(text in self.error for text in _PEER_LOSS)

    def describe(self) -> str:
        if self.status == "raised":
            return f"rank {self.rank} raised {self.error}"
        if self.status == "died":
            return f"rank {self.rank} died: {describe_exitcode(self.exitcode)}"
        if self.status == "hung":
            return f"rank {self.rank} was still running at the deadline"
        return f"rank {self.rank}: {self.status}"


class DistributedRunFailed(AssertionError):
    """One or more ranks raised, hung or died. ``outcomes`` holds every rank's :class:`RankOutcome`."""

    def __init__(self, message: str, outcomes: Sequence[RankOutcome]):
        super().__init__(message)
        self.outcomes = list(outcomes)


def describe_exitcode(code: Optional[int]) -> str:
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


def _cuda_initialised() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def start_method(backend: str, requested: Optional[str] = None) -> str:
    """How ranks are started: ``fork`` on CPU (fast: the imports are done), ``forkserver`` for GPU ranks.

    A forked child of a process that has initialised CUDA inherits a CUDA context it cannot use (and hangs
    or fails on its first CUDA call), so GPU ranks start from a forkserver: a clean server process that
    never touches CUDA forks them, and all CUDA work happens in the ranks. The same holds for gloo ranks when
    this process has initialised CUDA.
    """
    if requested is not None:
        if requested not in ("fork", "forkserver", "spawn"):
            raise ValueError(f"start_method={requested!r}; expected 'fork', 'forkserver' or 'spawn'.")
        if requested == "fork" and _cuda_initialised():
            raise RuntimeError(
                "start_method='fork' refused: this process has initialised CUDA, and a forked rank cannot use "
                "it. Use 'forkserver' (the default for GPU ranks)."
            )
        return requested
    if backend != "gloo" or _cuda_initialised():
        return "forkserver"
    return "fork"


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    backend: str = "gloo",
    timeout: float = 60.0,
    env: Optional[Mapping[str, str]] = None,
    init_process_group: bool = True,
    start: Optional[str] = None,
    tmp_root: Optional[os.PathLike] = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results, in rank order.

    ``backend``: ``gloo`` (CPU) or ``nccl`` (one GPU per rank, ``cuda:LOCAL_RANK``). With
    ``init_process_group`` (default) the default process group is up when ``fn`` starts; without it the
    rank finds the launcher variables (and ``TORCHELASTIC_USE_AGENT_STORE``) and may initialise it itself
    with ``init_method="env://"``. ``timeout`` (seconds) is the deadline for the whole run, process group
    timeout included. ``env`` is set in every rank after the launcher variables. Results must pickle.

    Raises :class:`DistributedRunFailed` when any rank raises, dies or is still running at the deadline.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}; expected a positive int.")
    if timeout <= 0:
        raise ValueError(f"timeout={timeout!r}; expected a positive number of seconds.")
    import multiprocessing as mp

    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError(
            "run_ranks: this process already has a torch.distributed process group, and its ranks would "
            "inherit it half-working. Call torch.distributed.destroy_process_group() first."
        )
    method = start_method(backend, start)
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Imported once by the server (none of them initialises CUDA), not by every rank of every run.
        ctx.set_forkserver_preload(["torch", "torch.distributed", __name__])
    workdir = tempfile.mkdtemp(prefix="llmload-ranks-", dir=None if tmp_root is None else os.fspath(tmp_root))
    outcomes = [RankOutcome(rank) for rank in range(world_size)]
    procs: list = []
    conns: list = []
    store = None
    try:
        # The rendezvous store lives here, bound to a port the OS picked, for as long as the ranks run:
        # nothing has to guess a free port and race another test or xdist worker for it. The ranks
        # connect to it as clients, as torchrun's workers connect to their agent's store.
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
            timeout=datetime.timedelta(seconds=timeout),
        )
        for rank in range(world_size):
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_rank_main,
                name=f"llmload-rank{rank}",
                args=(rank, world_size, store.port, backend, fn, tuple(args), dict(kwargs or {}), sender, workdir,
                      dict(env or {}), init_process_group, timeout, os.getpid() if method == "fork" else None),
                daemon=True,
            )
            with warnings.catch_warnings():
                # Python 3.12+ warns on every fork from a process with threads (torch starts one at
                # import). The hazards that are real here (OpenMP, inherited singletons) are handled in
                # _rank_main; a warning per rank would only break runs with -W error.
                warnings.filterwarnings(
                    "ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning
                )
                proc.start()
            sender.close()
            procs.append(proc)
            conns.append(receiver)
            outcomes[rank].pid = proc.pid
        pending = _collect(procs, conns, outcomes, deadline=time.monotonic() + timeout)
        if pending:
            _dump_stacks(procs, outcomes, pending, workdir)
        for outcome in outcomes:
            outcome.output = _tail(os.path.join(workdir, f"rank{outcome.rank}.log"))
        if all(outcome.status == "ok" for outcome in outcomes):
            return [outcome.value for outcome in outcomes]
        raise DistributedRunFailed(_failure_message(outcomes, backend, timeout), outcomes)
    finally:
        _reap(procs, outcomes)
        for conn in conns:
            conn.close()
        del store  # closes the port
        shutil.rmtree(workdir, ignore_errors=True)


def _reap(procs, outcomes: Sequence[RankOutcome]) -> None:
    """Let the ranks that answered exit, kill the rest (hung, or interrupted) with their process groups."""
    end = time.monotonic() + _JOIN_S
    for proc, outcome in zip(procs, outcomes):
        if outcome.status in ("ok", "raised"):
            proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # the rank leads its own process group
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
    for proc in procs:
        proc.join(5)


def _collect(procs, conns, outcomes, deadline: float) -> set[int]:
    """Receive results until every rank has answered, died, or the deadline passed; returns the hung ranks."""
    from multiprocessing.connection import wait

    pending = set(range(len(procs)))
    owner = {conn: rank for rank, conn in enumerate(conns)}
    owner.update({proc.sentinel: rank for rank, proc in enumerate(procs)})
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready = wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=left)
        for obj in ready:
            rank = owner[obj]
            if rank not in pending:
                continue
            _receive(procs[rank], conns[rank], outcomes[rank])
            pending.discard(rank)
        if pending and any(o.status in ("raised", "died") for o in outcomes):
            # The others are most likely blocked in a collective with the failed rank: a short grace
            # lets them report the lost peer, then they count as hung and their stacks are taken.
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
    return pending


def _receive(proc, conn, outcome: RankOutcome) -> None:
    message = None
    if conn.poll():
        with contextlib.suppress(EOFError, OSError):
            message = pickle.loads(conn.recv_bytes())
    if message is None:  # the rank ended without a word: it died
        proc.join(_JOIN_S)
        outcome.status, outcome.exitcode = "died", proc.exitcode
    elif message[0] == "ok":
        outcome.status, outcome.value = "ok", message[1]
    else:
        outcome.status, outcome.error, outcome.traceback = "raised", message[1], message[2]
    outcome.finished_at = time.monotonic()


def _dump_stacks(procs, outcomes, pending: set[int], workdir: str) -> None:
    paths = {rank: os.path.join(workdir, f"rank{rank}.stacks") for rank in pending}
    for rank in pending:
        outcomes[rank].status = "hung"
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    end = time.monotonic() + _STACK_WAIT_S
    while time.monotonic() < end:
        # faulthandler writes every thread in one go; a non-empty file that stopped growing is complete.
        sizes = {rank: _size(path) for rank, path in paths.items()}
        if all(sizes.values()):
            time.sleep(0.05)
            if sizes == {rank: _size(path) for rank, path in paths.items()}:
                break
        time.sleep(0.02)
    for rank, path in paths.items():
        outcomes[rank].stacks = _trim_stacks(_read(path)) or "(no stacks: the rank did not answer SIGUSR1)"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tail(path: str) -> str:
    return "\n".join(_trim_stacks(_read(path)).splitlines()[-_LOG_TAIL_LINES:])


def _trim_stacks(text: str) -> str:
    """Drop the frames below ``_rank_main`` from faulthandler dumps: a forked rank inherits the test
    process's call stack (pytest's frames), which would push the rank's own frames out of the report."""
    kept, skipping = [], False
    for line in text.splitlines():
        if skipping and line.startswith('  File "'):
            continue
        skipping = False
        kept.append(line)
        if line.startswith('  File "') and line.endswith(" in _rank_main"):
            skipping = True
    return "\n".join(kept).strip()


def _failure_message(outcomes: Sequence[RankOutcome], backend: str, timeout: float) -> str:
    failed = [o for o in outcomes if o.status != "ok"]

    def cause_first(o: RankOutcome):
        kind = 2 if o.lost_a_peer else 1 if o.status == "hung" else 0
        return kind, o.finished_at if o.finished_at is not None else float("inf"), o.rank

    failed.sort(key=cause_first)
    lines = [
        f"{len(failed)} of {len(outcomes)} ranks failed ({backend}, deadline {timeout:g} s); "
        f"first: {failed[0].describe()}"
    ]
    for o in failed:
        lines.append(f"----- {o.describe()}")
        if o.traceback:
            lines.append(o.traceback.rstrip())
        if o.stacks:
            lines.append(f"thread stacks of rank {o.rank} at the deadline (most recent call first):")
            lines.append(o.stacks)
        if o.output.strip():
            lines.append(f"output of rank {o.rank} (last {_LOG_TAIL_LINES} lines):")
            lines.append(o.output.rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Inside a rank
# ---------------------------------------------------------------------------------------------------------


def _rank_main(rank, world_size, port, backend, fn, args, kwargs, conn, workdir, env, init_pg, timeout,
               parent_pid):
    # Own process group: the parent kills the rank together with anything it started, and a Ctrl-C in the
    # terminal reaches only the parent, which then kills the ranks (no traceback per rank).
    os.setpgid(0, 0)
    _die_with_parent(parent_pid)
    _redirect_output(os.path.join(workdir, f"rank{rank}.log"))
    stacks = open(os.path.join(workdir, f"rank{rank}.stacks"), "w")  # noqa: SIM115 - lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=sys.stderr, all_threads=True)  # a segfault leaves its stack in the rank's output
    _set_launcher_env(rank, world_size, port, backend, env)
    succeeded = False
    try:
        import torch

        # GNU OpenMP is not fork-safe: a forked child whose parent has run a parallel region hangs in its
        # first parallel region with more than one thread. One thread per rank avoids it (and 2 ranks on
        # 2 cores want no more).
        torch.set_num_threads(1)
        _forget_inherited_state()
        if init_pg:
            import torch.distributed as dist

            if backend == "nccl":
                torch.cuda.set_device(rank)
            dist.init_process_group(
                backend=backend, init_method="env://", world_size=world_size, rank=rank,
                timeout=datetime.timedelta(seconds=timeout),
            )
        value = fn(*args, **kwargs)
        try:
            payload = pickle.dumps(("ok", value))
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"rank {rank} returned a {type(value).__name__} that cannot be pickled: {exc}") from None
        succeeded = True
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the test, KeyboardInterrupt too
        payload = pickle.dumps(("raised", f"{type(exc).__name__}: {exc}", traceback.format_exc()))
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    conn.send_bytes(payload)
    conn.close()
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_initialized():
            if succeeded:
                # Stay connected until every peer is done too: a rank that exits as soon as its own work is
                # done can close its gloo pairs while a slower peer is still in connectFullMesh ("Connection
                # closed by peer" on a run where nothing failed). A peer that failed makes this raise at once.
                dist.barrier()
            dist.destroy_process_group()
    os._exit(0)  # never run the test process's atexit handlers or pytest's teardown in a rank


def _die_with_parent(parent_pid: Optional[int]) -> None:
    """Linux: SIGKILL this rank if the test process dies (killed pytest, CI timeout) so no rank outlives it."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _redirect_output(path: str) -> None:
    """Send the rank's stdout/stderr (fds, sys.stdout/err and stream log handlers) to its own log file.

    Under pytest, sys.stdout is pytest's capture object, whose file the parent is still writing: a rank
    writing there would interleave with the test's own output.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115
    loggers = [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler:  # not pytest's capture handlers (subclasses)
                handler.setStream(sys.stderr)


def _set_launcher_env(rank: int, world_size: int, port: int, backend: str, env: Mapping[str, str]) -> None:
    for key in [k for k in os.environ if k in _LAUNCHER_VARS or k.startswith(_LAUNCHER_PREFIXES)]:
        del os.environ[key]
    os.environ.update(
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        # The store is hosted by the parent: rank 0 must connect to it, not try to host one on that port.
        TORCHELASTIC_USE_AGENT_STORE="True",
        # accelerate sets torch's thread count from this when it is unset (see _rank_main for why 1).
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
    )
    if backend == "gloo":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(env)


def _forget_inherited_state() -> None:
    """Reset the process-wide singletons a forked rank inherits from the test process.

    accelerate keeps its state (distributed type, number of processes) in class-level dicts: a test process
    that ever made an ``Accelerator`` would hand its ranks ``DistributedType.NO`` and one process, and write-up
    004's error would silently not happen. DeepSpeed keeps its communication backend in a module global.
    """
    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    comm = sys.modules.get("deepspeed.comm.comm")
    if comm is not None:
        comm.cdb = None


# ---------------------------------------------------------------------------------------------------------
# The fixture's object
# ---------------------------------------------------------------------------------------------------------


class DistributedEnv:
    """What the ``distributed_env`` fixture returns: ``run(fn, world_size=2, ...) -> [result per rank]``."""

    def __init__(self, gpu_count: Callable[[], int], skip: Callable[[str], Any]):
        self._gpu_count = gpu_count
        self._skip = skip

    def default_backend(self) -> str:
        """``nccl`` where a GPU is visible, else ``gloo``."""
        return "nccl" if self._gpu_count() > 0 else "gloo"

    def run(
        self,
        fn: Callable[..., Any],
        world_size: int = 2,
        *,
        args: Sequence[Any] = (),
        kwargs: Optional[Mapping[str, Any]] = None,
        backend: Optional[str] = None,
        deepspeed: bool = False,
        timeout: float = 60.0,
        env: Optional[Mapping[str, str]] = None,
        init_process_group: bool = True,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; see :func:`run_ranks`.

        ``backend=None`` picks nccl where a GPU is visible, else gloo. A GPU backend with fewer GPUs than
        ranks skips the test with the counts. ``deepspeed=True`` imports the DeepSpeed stack here first (skipping
        the test where DeepSpeed is not installed). Set ``DS_ACCELERATOR=cpu`` in the environment of a
        CPU run: DeepSpeed reads it once, when it is first imported (gloo ranks get it as a default).
        """
        backend = backend or self.default_backend()
        if backend == "nccl":
            from pytest_llmload import gpus

            reason = gpus.skip_reason(world_size)
            if reason is not None:
                self._skip(f"distributed_env: {world_size} nccl ranks {reason}")
        if deepspeed:
            if importlib.util.find_spec("deepspeed") is None:
                self._skip("distributed_env(deepspeed=True): deepspeed is not installed")
            preload(DEEPSPEED_PRELOAD)
        return run_ranks(fn, world_size, args=args, kwargs=kwargs, backend=backend, timeout=timeout, env=env,
                         init_process_group=init_process_group)
