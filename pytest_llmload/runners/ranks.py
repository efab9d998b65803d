"""Real multi-process runs for tests: a function on every rank of a real process group.

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

This module imports nothing heavy at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any, Callable, NamedTuple, Optional

from pytest_llmload.system import gpus, tracebacks
from pytest_llmload.runners import children, isolation, wire
from pytest_llmload.runners.child_output import LOG_TAIL_LINES
from pytest_llmload.runners.children import ChildOutcome

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

# What a rank would otherwise import itself, imported here before forking (runners.preload).
from pytest_llmload.runners.preload import DEEPSPEED_PRELOAD, preload  # noqa: E402

_GRACE_AFTER_FAILURE_S = 5.0
# Errors a rank reports when a peer went away first: a consequence, listed after the cause.
_PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "remote worker", "Broken pipe",
              "NCCL communicator was aborted", "ProcessGroupNCCL")


# DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (deepspeed.comm.torch.build_shm_op) in
# every process that starts a DeepSpeed group: 40-75 s on 2 cores on first use in an environment, under a lock
# file in ~/.cache/torch_extensions that a rank killed at its deadline leaves behind (every later DeepSpeed run on
# the machine then waited on it), rebuilt whenever another venv's torch shares the cache. The op only speeds up
# collectives; where DeepSpeed cannot build it, it returns None and runs them through torch.distributed
# (gloo here), which is what the checks need: their failures are device_map and ZeRO decisions, not
# communication. So the ranks, and the tests that start DeepSpeed, take that path: no build ever happens.
def _no_shm_op() -> None:
    return None


def disable_deepspeed_shm_op() -> None:
    """In a rank (or any process that imported ``deepspeed.comm.torch``, as ``run``'s bootstrap does): for the rest of
    its life."""
    comm_torch = sys.modules.get("deepspeed.comm.torch")
    if comm_torch is not None:
        comm_torch.build_shm_op = _no_shm_op


@contextlib.contextmanager
def deepspeed_without_shm_op():
    """In a test process: while a test that starts DeepSpeed runs (the plugin enters it around those)."""
    comm_torch = sys.modules.get("deepspeed.comm.torch")
    if comm_torch is None:
        yield
        return
    built = comm_torch.build_shm_op
    comm_torch.build_shm_op = _no_shm_op
    try:
        yield
    finally:
        comm_torch.build_shm_op = built


def deepspeed_setup_error(exc: BaseException) -> str:
    """The sentence for a DeepSpeed that cannot be imported here (an unknown ``DS_ACCELERATOR``, or one this
    machine lacks)."""
    value = os.environ.get("DS_ACCELERATOR")
    given = "unset" if value is None else repr(value)
    accelerators = getattr(sys.modules.get("deepspeed.accelerator.real_accelerator"), "SUPPORTED_ACCELERATOR_LIST",
                           None) or ["cuda", "cpu"]
    return (f"DeepSpeed cannot start in this run, with DS_ACCELERATOR={given} (from the environment): setting it up "
            f"(import) raised {type(exc).__name__}: {exc}. Set DS_ACCELERATOR to one of "
            f"{accelerators} that this machine has (cpu without GPUs), or unset it; the tests that start DeepSpeed "
            "error with this sentence, the others run.")


def lost_a_peer(outcome: ChildOutcome) -> bool:
    """The rank raised because another rank went away first: a consequence, not the cause."""
    return outcome.status == "raised" and any(text in outcome.error for text in _PEER_LOSS)


class DistributedRunFailed(AssertionError):
    """One or more ranks raised, hung or died. ``outcomes`` holds every rank's :class:`~.children.ChildOutcome`."""

    def __init__(self, message: str, outcomes: Sequence[ChildOutcome]):
        super().__init__(message)
        self.outcomes = list(outcomes)


RANK_RESULT_KINDS = ("ok", "skip", "refusal", "error")


@dataclasses.dataclass(frozen=True)
class RankResult:
    """What a rank's work tells the check that judges the ranks (the function a check runs on each rank returns one;
    :func:`run_ranks` hands them back in rank order), by its ``kind``:

    - ``ok``: the work ran; ``data`` is what it measured;
    - ``skip``: what the check needs did not happen on this rank; ``reason`` says what (the check's not exercised);
    - ``refusal``: the load was refused; ``reason`` is the refusal's message, ``data`` what goes with it;
    - ``error``: the work failed in a way the rank reports rather than raises; ``reason`` is the error, ``data`` what
      goes with it.

    A rank that raises, hangs or dies has no result: the run raises :class:`DistributedRunFailed`.
    """

    kind: str
    reason: str = ""
    data: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in RANK_RESULT_KINDS:
            raise ValueError(f"RankResult(kind={self.kind!r}); expected one of {RANK_RESULT_KINDS}.")

    @classmethod
    def ok(cls, **data: Any) -> "RankResult":
        return cls("ok", data=data)

    @classmethod
    def skip(cls, reason: str) -> "RankResult":
        return cls("skip", reason)

    @classmethod
    def refusal(cls, reason: str, **data: Any) -> "RankResult":
        return cls("refusal", reason, data)

    @classmethod
    def error(cls, reason: str, **data: Any) -> "RankResult":
        return cls("error", reason, data)

    def with_data(self, **more: Any) -> "RankResult":
        """The same result, with more in its ``data``."""
        return dataclasses.replace(self, data={**self.data, **more})


def start_method(backend: str, requested: Optional[str] = None) -> str:
    """How ranks are started: ``fork`` on CPU (fast: the imports are done), ``forkserver`` for GPU ranks.

    A forked child of a process that has initialised CUDA inherits a CUDA context it cannot use (and hangs
    or fails on its first CUDA call), so GPU ranks start from a forkserver: a clean server process that
    never touches CUDA forks them, and all CUDA work happens in the ranks. The same holds for gloo ranks when
    this process has initialised CUDA.
    """
    return children.start_for(requested, backend=backend).method


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    **options: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results, in rank order. ``options``:
    ``backend``, ``timeout``, ``env``, ``init_process_group``, ``start``, ``tmp_root``, ``gpus_hidden`` (the keywords
    of :func:`run_rank_groups`, defaults there).

    ``backend``: ``gloo`` (CPU) or ``nccl`` (one GPU per rank, ``cuda:LOCAL_RANK``). With
    ``init_process_group`` (default) the default process group is up when ``fn`` starts; without it the
    rank finds the launcher variables (and ``TORCHELASTIC_USE_AGENT_STORE``) and may initialise it itself
    with ``init_method="env://"``. ``timeout`` (seconds) is the deadline for the whole run, process group
    timeout included. ``env`` is set in every rank after the launcher variables. Results must pickle.
    ``gpus_hidden`` (gloo): ranks that simulate a runner without accelerators see no GPU and run DeepSpeed's cpu
    accelerator, also on a machine with GPUs.

    Raises :class:`DistributedRunFailed` when any rank raises, dies or is still running at the deadline.
    """
    (result,) = run_rank_groups([RankGroup(fn, args, kwargs)], world_size, **options)
    if isinstance(result, DistributedRunFailed):
        raise result
    return result


class RankGroup(NamedTuple):
    """One process group's work for :func:`run_rank_groups`: ``fn(*args, **kwargs)`` on each of its ranks."""

    fn: Callable[..., Any]
    args: Sequence[Any] = ()
    kwargs: Optional[Mapping[str, Any]] = None


def run_rank_groups(
    groups: Sequence[RankGroup],
    world_size: int = 2,
    *,
    backend: str = "gloo",
    timeout: float = 60.0,
    env: Optional[Mapping[str, str]] = None,
    init_process_group: bool = True,
    start: Optional[str] = None,
    tmp_root: Optional[os.PathLike] = None,
    gpus_hidden: bool = False,
) -> list[Any]:
    """:func:`run_ranks` for several independent process groups at once, each with its own ranks and rendezvous:
    for each group in order, its ranks' results, or the :class:`DistributedRunFailed` it would have raised. A group
    that fails cuts no other group short: its surviving ranks get their grace once every other group is done."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}; expected a positive int.")
    isolation.check_timeout(timeout)
    if gpus_hidden and backend != "gloo":
        raise ValueError(f"run_ranks(backend={backend!r}, gpus_hidden=True): only gloo ranks can run without GPUs.")
    import torch.distributed as dist

    if ":" not in backend and not dist.is_backend_available(backend):  # ("cpu:gloo,cuda:nccl" is one too)
        raise ValueError(f"backend={backend!r} is not a torch.distributed backend available here (gloo on CPU, "
                         f"nccl with CUDA; torch knows {[b for b in dist.Backend.backend_list if b != 'undefined']}).")

    if dist.is_initialized():
        raise RuntimeError(
            "run_ranks: this process already has a torch.distributed process group, and its ranks would "
            "inherit it half-working. Call torch.distributed.destroy_process_group() first."
        )
    how = children.start_for(start, backend=backend, gpus_hidden=gpus_hidden)
    # Each group's rendezvous store lives here, bound to a port the OS picked, for as long as the ranks run: nothing
    # has to guess a free port and race another test or xdist worker for it. The ranks connect to it as
    # clients, as torchrun's workers connect to their agent's store.
    # On the loopback interface only (runners.wire): another user's process on a shared runner cannot write a key.
    stores = [wire.bound_store(world_size, datetime.timedelta(seconds=timeout)) for _ in groups]
    group_of = [g for g in range(len(groups)) for _ in range(world_size)]

    def grace_once_the_others_are_done(outcomes):
        # The failed group's other ranks are most likely blocked in a collective with the failed rank: a short
        # grace lets them report the lost peer, then they count as hung and their stacks are taken. A group with
        # no failure runs on to its end.
        failed = {group_of[o.index] for o in outcomes if o.status in ("raised", "died")}
        if all(o.status != "pending" or group_of[o.index] in failed for o in outcomes):
            return time.monotonic() + _GRACE_AFTER_FAILURE_S
        return None

    # Each rank of a check judges what it raised where it ran, as an isolated check's child does, and its row's judged
    # fields come back with its answer (checks.judgement takes the most telling); outside a check, no judge.
    from pytest_llmload.config.stash_keys import running_checks_judge

    judge = running_checks_judge.get()
    try:
        specs = [
            children.ChildSpec(
                f"rank {rank}", group.fn, group.args, group.kwargs, merge_output=True, judge=judge,
                prepare=functools.partial(_prepare_rank, rank, world_size, store.port, backend, dict(env or {}),
                                          init_process_group, timeout),
            )
            for group, store in zip(groups, stores) for rank in range(world_size)
        ]
        outcomes = children.run_children(
            specs, timeout, start=how, tmp_root=tmp_root, prefix="llmload-ranks-",
            on_failure=grace_once_the_others_are_done,
            # All forks first, then the ranks: a rank forked while this process's store thread serves another
            # rank's connection can inherit the C library's resolver mid-lookup (torch names socket addresses by
            # reverse DNS; here a lookup stalls 5 s every 5 s) and hang in its own rendezvous for good. Measured on
            # 2 cores, 4 groups of 2 trivial ranks at once, 30 s deadline: 16 of 160 groups hung before, 0 of 240.
            start_together=True,
        )
    finally:
        del stores  # closes the ports
    results: list[Any] = []
    for g in range(len(groups)):
        mine = outcomes[g * world_size:(g + 1) * world_size]
        for rank, outcome in enumerate(mine):
            outcome.index = rank  # (the rank's number in its group's report)
        if all(outcome.status == "ok" for outcome in mine):
            results.append([outcome.value for outcome in mine])
        else:
            results.append(DistributedRunFailed(_failure_message(mine, backend, timeout), mine))
    return results


def _failure_message(outcomes: Sequence[ChildOutcome], backend: str, timeout: float) -> str:
    failed = [o for o in outcomes if o.status != "ok"]

    def cause_first(o: ChildOutcome):
        kind = 2 if lost_a_peer(o) else 1 if o.status == "hung" else 0
        return kind, o.finished_at if o.finished_at is not None else float("inf"), o.index

    failed.sort(key=cause_first)
    lines = [
        f"{len(failed)} of {len(outcomes)} ranks failed ({backend}, {tracebacks.deadline_text(timeout, of=False)}); "
        f"first: {failed[0].describe()}"
    ]
    for o in failed:
        lines.append(f"----- {o.describe()}")
        if o.traceback:
            lines.append(o.traceback.rstrip())
        if o.stacks:
            lines.append(f"thread stacks of rank {o.index} at the deadline (most recent call first):")
            lines.append(o.stacks)
        if o.output.strip():
            lines.append(f"output of rank {o.index} (last {LOG_TAIL_LINES} lines):")
            lines.append(o.output.rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Inside a rank
# ---------------------------------------------------------------------------------------------------------


def _prepare_rank(rank, world_size, port, backend, env, init_pg, timeout):
    """Run in the rank before ``fn``: a launcher's environment, no inherited state, the process group."""
    _set_launcher_env(rank, world_size, port, backend, env)
    import torch

    # (children.start_child has set one OpenMP thread: 2 ranks on 2 cores want no more, and GNU OpenMP is not
    # fork-safe.) accelerate sets torch's thread count from OMP_NUM_THREADS when it is unset: see the env.
    _forget_inherited_state()
    disable_deepspeed_shm_op()
    if init_pg:
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # (a launcher's rank 9 may be cuda:1 of its node)
        dist.init_process_group(
            backend=backend, init_method="env://", world_size=world_size, rank=rank,
            timeout=datetime.timedelta(seconds=timeout),
        )


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
        # accelerate sets torch's thread count from this when it is unset (see children.start_child for why 1).
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
        reason = self.skip_reason(world_size, backend, deepspeed)
        if reason is not None:
            self._skip(reason)
        if deepspeed:
            preload(DEEPSPEED_PRELOAD)
        return self._start(fn, world_size, args=args, kwargs=kwargs, backend=backend, timeout=timeout, env=env,
                           init_process_group=init_process_group)

    def skip_reason(self, world_size: int, backend: str, deepspeed: bool) -> Optional[str]:
        """Why these ranks cannot run here (too few GPUs for nccl ranks, no DeepSpeed), or ``None``."""
        if backend == "nccl":
            reason = self._nccl_skip_reason(world_size)
            if reason is not None:
                return reason
        if deepspeed and importlib.util.find_spec("deepspeed") is None:
            return "distributed_env(deepspeed=True): deepspeed is not installed"
        return None

    # The seams a launcher's distributed_env replaces (pytest_llmload.plugin.launched_env): its ranks are the
    # launcher's processes, not forked here.
    def _nccl_skip_reason(self, world_size: int) -> Optional[str]:
        reason = gpus.skip_reason(world_size)
        return None if reason is None else f"distributed_env: {world_size} nccl ranks {reason}"

    def _start(self, fn: Callable[..., Any], world_size: int, **options) -> list[Any]:
        return run_ranks(fn, world_size, **options)
