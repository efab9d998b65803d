"""The process side of pytest under a cluster's own launcher (torchrun, srun, mpirun): which rank of which job this
pytest process is, and where the ranks meet. What a launcher changes in a pytest run (every rank collects the same
tests, those that use ``distributed_env`` run on every rank and agree on their outcomes, rank 0 writes the report)
is the plugin's: :mod:`pytest_llmload.plugin.launched_run`, whose hooks use what is here; ``distributed_env``'s
object under a launcher is :mod:`pytest_llmload.plugin.launched_env`.

Launchers, detected from the environment alone (nothing is imported for it: :func:`detect`):

- torchrun (``python -m torch.distributed.run``) and any launcher that sets torch's ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``;
- srun: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID`` (the step's variables: a batch script,
  where ``SLURM_PROCID`` and ``SLURM_NTASKS`` are set too, is no launcher);
- Open MPI's mpirun: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``;

each only with ``MASTER_ADDR`` and ``MASTER_PORT`` set (torchrun sets them; export them for srun and mpirun).
Without them a run is a plain run, and ``distributed_env`` forks its ranks as always; so is a pytest that a
rank's tests start (pytester), though it inherits the launcher's variables (``PYTEST_LLMLOAD_RANK_OF``).

The ranks meet (:class:`Meeting`) through the launcher's store (torchrun's agent store at
``MASTER_ADDR:MASTER_PORT``; under srun and mpirun, rank 0 hosts one there), exchanging plain data only
(:mod:`.wire`). Waits: a run's ranks wait for each other's results at most ``timeout`` plus a margin
(:data:`RESULT_MARGIN_S`) after their own child ended. Waiting for a peer to reach a test or end a phase has no
deadline of its own and does not count against this rank's pytest-timeout (:func:`outer_deadline_paused`: rank 1
skips the rank-0-only tests and waits while rank 0 runs them): a rank that hangs in a test's body is ended by its
own pytest-timeout and reports it to the others, and a rank that dies ends the job (torchrun, mpirun and
``srun --kill-on-bad-exit=1`` end the others). A rank that ends its session early (``-x`` on a rank-0-only test)
ends the others' at their next meeting. :func:`agree` decides what a phase ends with on this rank, given every
rank's outcome.

This module imports nothing heavy: the plugin loads it with its hooks under a launcher.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, Callable, NamedTuple, Optional

import pytest

from pytest_llmload.config.vocabulary import RANK_OF_ENV  # (set by a rank's pytest for what it starts)

# (launcher, rank, world size, local rank): the variables each one sets, in the order they are looked for.
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
)
# Beyond a run's deadline: a child's stack collection and reaping, and the skew between the ranks' starts.
RESULT_MARGIN_S = 30.0
# How long a rank tries to reach the launcher's store.
STORE_CONNECT_S = 300.0
POLL_MAX_S = 0.05  # the longest pause between two looks at the store while waiting for the other ranks


class LauncherError(ValueError):
    """The launcher's variables are set but unusable; the message names the variable and its value."""


class Launch(NamedTuple):
    launcher: str  # "torchrun", "srun", "mpirun"
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT; else rank 0 hosts it

    def variables(self) -> str:
        names = next(row for row in LAUNCHERS if row[0] == self.launcher)[1:3]
        return "/".join(names)


def detect(environ: Mapping[str, str]) -> Optional[Launch]:
    """This process's place in a launcher's job, from the environment alone; ``None`` for a plain run.

    Raises :class:`LauncherError` for variables that are set but not integers in range."""
    if not (environ.get("MASTER_ADDR") and environ.get("MASTER_PORT")) or RANK_OF_ENV in environ:
        return None
    for launcher, rank_var, size_var, local_var in LAUNCHERS:
        if rank_var in environ and size_var in environ:
            rank, world_size = _int(environ, rank_var, 0), _int(environ, size_var, 1)
            local_rank = _int(environ, local_var, 0) if local_var in environ else rank
            port = _int(environ, "MASTER_PORT", 1)
            if rank >= world_size:
                raise LauncherError(f"{rank_var}={rank} is not below {size_var}={world_size}: the launcher's "
                                    "variables contradict each other; check what sets them.")
            return Launch(launcher, rank, world_size, local_rank, environ["MASTER_ADDR"], port,
                          environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
    return None


def _int(environ: Mapping[str, str], name: str, minimum: int) -> int:
    try:
        value = int(environ[name])
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise LauncherError(f"{name}={environ[name]!r} in the environment is not an integer >= {minimum}: "
                            "pytest-llmload reads it as this process's place in a launcher's job; fix or unset it.")
    return value


# ---------------------------------------------------------------------------------------------------------
# The ranks' meeting point
# ---------------------------------------------------------------------------------------------------------


class Meeting:
    """One rank's view of the job: a key-value store all ranks share, and the keys they meet at."""

    def __init__(self, launch: Launch, store=None):
        self.launch = launch
        self._store = store  # a torch.distributed Store (or the same interface); made on first use
        self.attempts: Counter = Counter()  # per test: how often its setup started here (reruns)
        self.every_rank: set[str] = set()  # node ids of the tests that run on every rank

    @property
    def store(self):
        if self._store is None:
            import torch.distributed as dist

            from pytest_llmload.runners import wire

            launch = self.launch
            timeout = datetime.timedelta(seconds=STORE_CONNECT_S)
            # torchrun's agent already hosts a store there; under srun/mpirun rank 0 hosts it, listening on
            # MASTER_ADDR's address only (multi_tenant: a process group this process makes with env:// on the same
            # port shares the server).
            if launch.rank == 0 and not launch.agent_store:
                store = wire.bound_store(launch.world_size, timeout, host=launch.master_addr,
                                            port=launch.master_port, multi_tenant=True)
            else:
                store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False,
                                      wait_for_workers=False, multi_tenant=True, timeout=timeout)
            self._store = dist.PrefixStore(meeting_prefix(os.environ), store)
        return self._store

    def post(self, key: str, value: Any) -> None:
        from pytest_llmload.runners import wire  # (not at plugin load: a plain run never needs it)

        self.store.set(f"{key}/{self.launch.rank}", wire.dumps(value))
        self.store.add(f"{key}/count", 1)

    def posted(self, key: str) -> int:
        return self.store.add(f"{key}/count", 0)

    def read(self, key: str, rank: int) -> Any:
        """Rank ``rank``'s value under ``key``, as plain data only: anything that reaches the store's port can write a
        key, so nothing read there is unpickled as it is (:mod:`pytest_llmload.runners.wire`)."""
        from pytest_llmload.runners import wire

        return wire.loads(self.store.get(f"{key}/{rank}"), what=f"rank {rank}'s value under {key!r}")

    def gather(self, key: str, value: Any, *, deadline: Optional[float] = None,
               abort: Optional[Callable[[], None]] = None) -> dict[int, Any]:
        """Post ``value`` under ``key`` and return every rank's, by rank (see :meth:`collect`)."""
        self.post(key, value)
        return self.collect(key, deadline=deadline, abort=abort)

    def collect(self, key: str, *, deadline: Optional[float] = None,
                abort: Optional[Callable[[], None]] = None) -> dict[int, Any]:
        """Every rank's value under ``key``, by rank. Waits for all of them until ``deadline``
        (``time.monotonic()``; None: as long as it takes) and returns those that came; ``abort()``, called while
        waiting, may raise to stop waiting (default: raise when a peer ended its session)."""
        abort = abort or self._stop_if_a_peer_ended
        world = range(self.launch.world_size)
        delay = 0.001
        try:
            with outer_deadline_paused():
                while self.posted(key) < len(world):
                    abort()
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    time.sleep(delay)
                    delay = min(delay * 2, POLL_MAX_S)
        except BaseException as exc:  # Ctrl-C, a lost store: say who this rank was waiting for
            missing = [f"rank {r}" for r in world if not self.store.check([f"{key}/{r}"])]
            exc.add_note(f"(rank {self.launch.rank} was waiting for the other ranks at {key!r}; "
                         f"{', '.join(missing) + ' had not come' if missing else 'all came meanwhile'})")
            raise
        return {r: self.read(key, r) for r in world if self.store.check([f"{key}/{r}"])}

    def _stop_if_a_peer_ended(self) -> None:
        if not self.posted(SESSION_END):
            return
        ended = {r: self.read(SESSION_END, r) for r in range(self.launch.world_size)
                 if self.store.check([f"{SESSION_END}/{r}"])}
        raise pytest.exit.Exception(
            "; ".join(f"rank {r} ended its session (exit status {int(s)})" for r, s in ended.items())
            + f" while rank {self.launch.rank} still had tests to meet it at (-x or --maxfail on a test that ran on "
            "rank 0 only, or a usage error there): this rank stops too.", returncode=max(map(int, ended.values())))


def meeting_prefix(environ: Mapping[str, str]) -> str:
    """Where the ranks' keys live in the launcher's store (torch's ``PrefixStore`` adds the ``/``): ``llmload``, and
    under it a digest of
    ``$PYTEST_LLMLOAD_RUN_SECRET`` where the job exports one (every rank inherits it from the launcher): a process that
    reaches the store's port without it cannot name a key the ranks read."""
    import hashlib

    from pytest_llmload.config.vocabulary import RUN_SECRET_ENV

    secret = environ.get(RUN_SECRET_ENV, "")
    return "llmload" + ("/" + hashlib.sha256(secret.encode()).hexdigest()[:32] if secret else "")


# Where every rank posts its exit status at the end of its session (a peer still waiting learns of it there).
SESSION_END = "session-end"


@contextlib.contextmanager
def outer_deadline_paused() -> Iterator[None]:
    """pytest-timeout's alarm (its signal method: a real-time interval timer) stopped meanwhile and re-armed with
    what was left: a rank's deadline counts its own work, not its wait for the others. Rank 1 waits at the setup
    of a test while rank 0 runs the tests that run on rank 0 only; rank 0 waits for the report of a rank that
    hangs, whose own deadline ends it."""
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return
    left, interval = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield
    finally:
        if left:
            signal.setitimer(signal.ITIMER_REAL, left, interval)


# ---------------------------------------------------------------------------------------------------------
# Outcomes of a test's phases, agreed by the ranks
# ---------------------------------------------------------------------------------------------------------


def agree(outcomes: Mapping[int, dict], rank: int, exc: Optional[BaseException], what: str) -> None:
    """Raise what this rank's phase must end with, given every rank's outcome (``exc``: this rank's own
    exception, re-raised when it is the verdict). A failure anywhere fails the phase everywhere; then a skip."""
    __tracebackhide__ = True
    failed = _failures(outcomes)
    others = {r: o for r, o in failed.items() if r != rank}
    if exc is not None and rank in failed:
        _note_failures(exc, outcomes, rank, what)
        raise exc
    if others:
        raise agreed(pytest.fail.Exception("\n\n".join(
            f"rank {r} failed {what} (a failure on one rank fails it on every rank):\n{o['text']}"
            for r, o in others.items()), pytrace=False))
    if exc is not None:
        raise exc
    for r, o in outcomes.items():
        if o["outcome"] in ("skipped", "xfailed") and r != rank:
            reason = o["reason"] if o.get("agreed") else f"{o['reason']} (on rank {r})"
            if o["outcome"] == "xfailed":
                raise agreed(pytest.xfail.Exception(reason))
            raise agreed(pytest.skip.Exception(reason, _use_item_location=True))


def _failures(outcomes: Mapping[int, dict]) -> dict[int, dict]:
    """The ranks that failed of their own (not because another rank did)."""
    return {r: o for r, o in outcomes.items() if o["outcome"] == "failed" and not o.get("agreed")}


def _note_failures(exc: BaseException, outcomes: Mapping[int, dict], rank: int, what: str) -> None:
    """Add the other ranks' failures to this rank's own report."""
    for r, o in _failures(outcomes).items():
        if r != rank:
            with contextlib.suppress(Exception):  # (an exception type with __slots__ takes no note)
                exc.add_note(f"\nrank {r} failed {what} too:\n{o['text']}")


def agreed(exc: BaseException) -> BaseException:
    exc.llmload_agreed = True  # raised because of another rank's outcome: not a cause of its own
    return exc


def test_key(nodeid: str, attempt: int) -> str:
    """Where the ranks meet for attempt ``attempt`` of test ``nodeid`` (a rerun meets at fresh keys)."""
    return f"test/{nodeid}/{attempt}"
