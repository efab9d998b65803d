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
``MASTER_ADDR:MASTER_PORT``; under srun and mpirun, rank 0 hosts one there), exchanging plain data only, each key's
value of the :class:`~.wire.Shape` it holds and signed with the run's secret (:mod:`.wire`): a value refused there
stops the run with a sentence naming the key and the rank (:func:`refused`). Waits: a run's ranks wait for each
other's results at most ``timeout`` plus a margin (:data:`RESULT_MARGIN_S`) after their own child ended. Waiting for
a peer to reach a test or end a phase has no deadline of its own and does not count against this rank's
pytest-timeout (:func:`outer_deadline_paused`: rank 1 skips the rank-0-only tests and waits while rank 0 runs them):
a rank that hangs in a test's body is ended by its own pytest-timeout and reports it to the others, and a rank that
dies ends the job (torchrun, mpirun and ``srun --kill-on-bad-exit=1`` end the others). A rank that ends its session
early (``-x`` on a rank-0-only test) ends the others' at their next meeting. :func:`agree` decides what a phase ends
with on this rank, given every rank's outcome.

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
from pytest_llmload.runners.wire import Shape  # (plain Python: the codecs import what they use when a value crosses)

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
    """One rank's view of the job: a key-value store all ranks share, and the keys they meet at. ``secret``: what
    signs the values (default: ``$PYTEST_LLMLOAD_RUN_SECRET``); ``every_interface_allowed``: the user asked for the
    stores rank 0 hosts to listen on every interface (``MASTER_ADDR=0.0.0.0``)."""

    def __init__(self, launch: Launch, store=None, *, secret: Optional[bytes] = None,
                 every_interface_allowed: bool = False):
        self.launch = launch
        self._store = store  # a torch.distributed Store (or the same interface); made on first use
        self.secret = run_secret(os.environ) if secret is None else secret
        self.every_interface_allowed = every_interface_allowed
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
                                         port=launch.master_port, multi_tenant=True,
                                         every_interface_allowed=self.every_interface_allowed)
            else:
                store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=False,
                                      wait_for_workers=False, multi_tenant=True, timeout=timeout)
            self._store = dist.PrefixStore(MEETING_PREFIX, store)
        return self._store

    def post(self, key: str, value: Any, shape: Shape) -> None:
        from pytest_llmload.runners import wire

        name = f"{key}/{self.launch.rank}"
        self.store.set(name, wire.seal(name, value, self.secret, shape))
        self.store.add(f"{key}/count", 1)

    def posted(self, key: str) -> int:
        """How many ranks say they posted under ``key``: a hint for a look at their values (a count is not signed:
        a process outside the job can raise it), never a value."""
        return self.store.add(f"{key}/count", 0)

    def read(self, key: str, rank: int, shape: Shape) -> Any:
        """Rank ``rank``'s value under ``key``: plain data of ``shape``, signed with this run's secret, or the run
        stops here (:func:`refused`): anything that reaches the store's port can write a key."""
        from pytest_llmload.runners import wire

        name = f"{key}/{rank}"
        try:
            return wire.unseal(name, self.store.get(name), self.secret, shape, rank)
        except wire.RefusedValue as exc:
            raise refused(str(exc), self.launch.rank, bool(self.secret)) from None

    def gather(self, key: str, value: Any, shape: Shape, *, deadline: Optional[float] = None,
               abort: Optional[Callable[[], None]] = None) -> dict[int, Any]:
        """Post ``value`` under ``key`` and return every rank's, by rank (see :meth:`collect`)."""
        self.post(key, value, shape)
        return self.collect(key, shape, deadline=deadline, abort=abort)

    def collect(self, key: str, shape: Shape, *, deadline: Optional[float] = None,
                abort: Optional[Callable[[], None]] = None) -> dict[int, Any]:
        """Every rank's value under ``key``, by rank, each of ``shape``. Waits for all of them until ``deadline``
        (``time.monotonic()``; None: as long as it takes) and returns those that came; ``abort()``, called while
        waiting, may raise to stop waiting (default: raise when a peer ended its session)."""
        abort = abort or self._stop_if_a_peer_ended
        world = range(self.launch.world_size)
        keys = [f"{key}/{r}" for r in world]
        delay = 0.001
        try:
            with outer_deadline_paused():
                while not self.store.check(keys):  # (every rank's key: a count is no proof)
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
        return {r: self.read(key, r, shape) for r in world if self.store.check([f"{key}/{r}"])}

    def _stop_if_a_peer_ended(self) -> None:
        if not self.posted(SESSION_END):
            return
        ended = {r: self.read(SESSION_END, r, EXIT_STATUS) for r in range(self.launch.world_size)
                 if self.store.check([f"{SESSION_END}/{r}"])}
        if not ended:  # (a count raised from outside the job: no rank ended)
            return
        raise pytest.exit.Exception(
            "; ".join(f"rank {r} ended its session (exit status {s})" for r, s in ended.items())
            + f" while rank {self.launch.rank} still had tests to meet it at (-x or --maxfail on a test that ran on "
            "rank 0 only, or a usage error there): this rank stops too.", returncode=max(ended.values()))


# Where the ranks' keys live in the launcher's store (torch's PrefixStore adds the "/").
MEETING_PREFIX = "llmload"
# Where every rank posts its exit status at the end of its session (a peer still waiting learns of it there).
SESSION_END = "session-end"


def run_secret(environ: Mapping[str, str]) -> bytes:
    """What signs the values between the ranks: ``$PYTEST_LLMLOAD_RUN_SECRET``, which every rank inherits from the
    launcher (empty where the job exports none: a signature anyone can make)."""
    from pytest_llmload.config.vocabulary import RUN_SECRET_ENV

    return environ.get(RUN_SECRET_ENV, "").encode()


def refused(reason: str, rank: int, signed: bool) -> BaseException:
    """What a rank raises for a value it refused (``reason``, naming the key and its rank): the run stops, as
    pytest stops on ``pytest.exit`` (its sentence printed, no INTERNALERROR), and the other ranks stop at their next
    meeting, learning this rank's exit status."""
    from pytest_llmload.config.vocabulary import RUN_SECRET_ENV

    how = (f"signed with this run's ${RUN_SECRET_ENV}" if signed else
           f"but this job exports no ${RUN_SECRET_ENV}, so any process that reaches the store can post one: export "
           "one before the launcher (openssl rand -hex 16)")
    return pytest.exit.Exception(
        f"{reason} Rank {rank} stops this run: a value between the ranks is plain data of its key's shape, {how} "
        "(docs/reliability.md).", returncode=pytest.ExitCode.INTERRUPTED)


def _is_phase_outcome(value: Any) -> bool:
    if type(value) is not dict or type(value.get("outcome")) is not str:
        return False
    fields = {"passed": {}, "failed": {"text": str, "agreed": bool}, "skipped": {"reason": str, "agreed": bool},
              "xfailed": {"reason": str, "agreed": bool}}.get(value["outcome"])
    return fields is not None and value.keys() == {"outcome", *fields} and all(
        type(value[name]) is kind for name, kind in fields.items())


# What each key of this module holds (a test's phases: test_key; the others: plugin.launched_run's).
EXIT_STATUS = Shape("an exit status (an integer)", lambda v: type(v) is int and -(1 << 31) <= v < 1 << 31, 64)
PHASE_OUTCOME = Shape(
    "a phase's outcome ({'outcome': 'passed'}, {'outcome': 'failed', 'text': ..., 'agreed': ...}, or 'skipped' or "
    "'xfailed' with a 'reason' and 'agreed')", _is_phase_outcome, 16 << 20)


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
