"""pytest under the cluster's own launcher: each pytest process is one rank of the job, and the tests that use
``distributed_env`` run on every rank, in process groups made of the launcher's ranks::

    torchrun --nproc-per-node 2 -m pytest tests/
    torchrun --nnodes 2 --node-rank 0 --master-addr node0 --master-port 29500 --nproc-per-node 8 -m pytest tests/
    srun --ntasks 16 --kill-on-bad-exit=1 python -m pytest tests/    # with MASTER_ADDR and MASTER_PORT exported

What a launcher changes:

- Every rank collects the same tests. The ranks meet at each test that uses ``distributed_env``, so the ordered
  list of those must be the same on every rank (compared after collection: a usage error naming the first
  difference otherwise).
- A test that uses ``distributed_env`` runs on every rank. ``distributed_env.run(fn, world_size)`` runs ``fn``
  once on this process's rank and returns every rank's result on every rank, or raises the same
  :class:`~pytest_llmload.runners.ranks.DistributedRunFailed` on every rank, naming the rank that raised, hung or
  died, with its traceback or thread stacks; ``pytest.skip`` in ``fn`` on one rank skips the test on all.
  ``world_size`` must be the launcher's ``WORLD_SIZE`` (else the test skips, naming both).
- Each phase (setup, call, teardown) of such a test ends with the ranks exchanging their outcomes: a failure on
  one rank fails the phase on every rank, with that rank's report; a skip on one rank skips it on all.
- The other tests run on rank 0 only (the other ranks skip them): they use no process group, and repeating
  them on every rank would only repeat rank 0's work.
- Rank 0 writes the report (terminal, ``--junitxml``, ``--llmload-progress``, the cache); the others write none,
  and every rank exits with the same status.

``fn`` runs in a child forked from this rank's pytest process, which makes the process group for that run
(gloo on CPU, nccl on ``cuda:LOCAL_RANK``; a fresh TCP store that rank 0 hosts on a port the OS picks on
``MASTER_ADDR``'s host). A child, not the pytest process itself: a rank stuck in a collective cannot be
interrupted, but its child can be ended at the deadline, with its thread stacks, while the pytest process reports
and goes on to the next test; what ``fn`` changes process-wide dies with it, as with ``distributed_env``'s forked
ranks; and a failed run leaves no broken group to the next test. The ranks meet through the launcher's store
(torchrun's agent store at ``MASTER_ADDR:MASTER_PORT``; under srun and mpirun, rank 0 hosts one there).

Launchers, detected from the environment alone (nothing is imported for it):

- torchrun (``python -m torch.distributed.run``) and any launcher that sets torch's ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``;
- srun: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID`` (the step's variables: a batch script,
  where ``SLURM_PROCID`` and ``SLURM_NTASKS`` are set too, is no launcher);
- Open MPI's mpirun: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``;

each only with ``MASTER_ADDR`` and ``MASTER_PORT`` set (torchrun sets them; export them for srun and mpirun).
Without them a run is a plain run, and ``distributed_env`` forks its ranks as always; so is a pytest that a
rank's tests start (pytester), though it inherits the launcher's variables (``PYTEST_LLMLOAD_RANK_OF``).

Waits: a run's ranks wait for each other's results at most ``timeout`` plus a margin after their own child
ended. Waiting for a peer to reach a test or end a phase has no deadline of its own and does not count against
this rank's pytest-timeout (rank 1 skips the rank-0-only tests and waits while rank 0 runs them): a rank that
hangs in a test's body is ended by its own pytest-timeout and reports it to the others, and a rank that dies
ends the job (torchrun, mpirun and ``srun --kill-on-bad-exit=1`` end the others). A rank that ends its session
early (``-x`` on a rank-0-only test) ends the others' at their next meeting.

This module (detection, the ranks' meeting point, the hooks) imports nothing heavy: the plugin loads it on
every pytest run. ``distributed_env``'s object under a launcher is in :mod:`.launched_env`, imported by the
first test that uses it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any, Callable, NamedTuple, Optional

import pytest

# (launcher, rank, world size, local rank): the variables each one sets, in the order they are looked for.
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("srun", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),
    ("mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
)
EVERY_RANK_FIXTURE = "distributed_env"
# Set by a rank's pytest for what it starts: a pytest run from its tests (pytester, in-process or not) sees the
# launcher's variables too, but is no rank of the job, and runs plain.
RANK_OF_ENV = "PYTEST_LLMLOAD_RANK_OF"
# Report writers the other ranks leave to rank 0: option dest -> its "off" value (those of plugins not
# installed are absent and skipped).
_REPORT_OPTIONS = {"xmlpath": None, "llmload_progress": None, "report_log": None, "json_report": False,
                   "htmlpath": None}
# Beyond a run's deadline: a child's stack collection and reaping, and the skew between the ranks' starts.
RESULT_MARGIN_S = 30.0
# How long a rank tries to reach the launcher's store, and how long rank 0 keeps hosting it for the others to
# read the last keys (srun, mpirun).
STORE_CONNECT_S = 300.0
_EXIT_READ_S = 30.0
_POLL_MAX_S = 0.05


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
                    delay = min(delay * 2, _POLL_MAX_S)
        except BaseException as exc:  # Ctrl-C, a lost store: say who this rank was waiting for
            missing = [f"rank {r}" for r in world if not self.store.check([f"{key}/{r}"])]
            exc.add_note(f"(rank {self.launch.rank} was waiting for the other ranks at {key!r}; "
                         f"{', '.join(missing) + ' had not come' if missing else 'all came meanwhile'})")
            raise
        return {r: self.read(key, r) for r in world if self.store.check([f"{key}/{r}"])}

    def _stop_if_a_peer_ended(self) -> None:
        if not self.posted(_SESSION_END):
            return
        ended = {r: self.read(_SESSION_END, r) for r in range(self.launch.world_size)
                 if self.store.check([f"{_SESSION_END}/{r}"])}
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


_COLLECTED = "collected"
_SESSION_END = "session-end"
_REPORT_WRITTEN = "report-written"
_LEFT = "left"


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


def phase_outcome(item: pytest.Item, exc: Optional[BaseException]) -> dict:
    """What a phase of a test did on this rank, in words another rank can report."""
    if exc is None:
        return {"outcome": "passed"}
    if isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)):
        kind = "xfailed" if isinstance(exc, pytest.xfail.Exception) else "skipped"
        return {"outcome": kind, "reason": exc.msg, "agreed": getattr(exc, "llmload_agreed", False)}
    try:
        text = str(item.repr_failure(pytest.ExceptionInfo.from_exception(exc)))
    except Exception:  # noqa: BLE001 - a failure that cannot be rendered is still reported, by its type
        text = f"{type(exc).__name__}: {exc}"
    return {"outcome": "failed", "text": text, "agreed": getattr(exc, "llmload_agreed", False)}


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


# ---------------------------------------------------------------------------------------------------------
# The plugin's hooks (registered by plugin.switch_on under a launcher); idle without one
# ---------------------------------------------------------------------------------------------------------

meeting_key = pytest.StashKey[Meeting]()
_devnull_key = pytest.StashKey[Any]()
_statuses_key = pytest.StashKey[dict]()


def meeting_of(config: pytest.Config) -> Optional[Meeting]:
    """The launcher's job this pytest process is a rank of, or ``None`` for a plain run."""
    return config.stash.get(meeting_key, None)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    try:
        launch = detect(os.environ)
    except LauncherError as exc:
        raise pytest.UsageError(str(exc)) from None
    if launch is None or hasattr(config, "workerinput"):
        return
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError(
            f"pytest -n {config.option.numprocesses} under {launch.launcher}: each of its {launch.world_size} ranks "
            "would start its own xdist workers, each of them a rank again. Drop -n (or pass -n 0): the launcher's "
            "ranks are the parallel processes.")
    config.stash[meeting_key] = Meeting(launch)
    os.environ[RANK_OF_ENV] = f"{launch.launcher} rank {launch.rank} of {launch.world_size}, pid {os.getpid()}"
    if config.option.basetemp:  # a shared --basetemp would be emptied by each rank in turn
        config.option.basetemp = os.path.join(config.option.basetemp, f"rank{launch.rank}")
    if launch.rank != 0:
        for dest, off in _REPORT_OPTIONS.items():
            if hasattr(config.option, dest):
                setattr(config.option, dest, off)
        # The terminal reporter takes sys.stdout when it is made (in terminal's pytest_configure, after this
        # one): devnull, until the session starts.
        config.stash[_devnull_key] = (sys.stdout, open(os.devnull, "w"))  # noqa: SIM115 - lives as long as pytest
        sys.stdout = config.stash[_devnull_key][1]


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    saved = session.config.stash.get(_devnull_key, None)
    if saved is None:
        return
    if sys.stdout is saved[1]:
        sys.stdout = saved[0]
    cache = getattr(session.config, "cache", None)
    if cache is not None:
        cache.set = lambda key, value: None  # the cache (last failed, stepwise) is rank 0's to write


def pytest_report_header(config: pytest.Config) -> Optional[list[str]]:
    meeting = meeting_of(config)
    if meeting is None:
        return None
    launch = meeting.launch
    return [f"llmload: rank {launch.rank} of {launch.world_size} under {launch.launcher} "
            f"({launch.variables()}, MASTER_ADDR={launch.master_addr}): tests that use {EVERY_RANK_FIXTURE} run on "
            "every rank, the others on rank 0 only; this report is rank 0's"]


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    meeting = meeting_of(session.config)
    if meeting is None:
        return
    every_rank = [item.nodeid for item in session.items if EVERY_RANK_FIXTURE in getattr(item, "fixturenames", ())]
    meeting.every_rank = set(every_rank)
    check_same_tests(meeting.gather(_COLLECTED, every_rank))
    launch = meeting.launch
    if launch.rank != 0:
        rank_0_only = pytest.mark.skip(reason=f"runs on rank 0 only under {launch.launcher}: it does not use "
                                              f"{EVERY_RANK_FIXTURE}")
        for item in session.items:
            if item.nodeid not in meeting.every_rank:
                item.add_marker(rank_0_only)


def check_same_tests(collected: Mapping[int, list[str]]) -> None:
    """Every rank collected the same tests that run on every rank, in the same order; else a usage error."""
    reference = collected[0]
    for rank, names in sorted(collected.items()):
        if names == reference:
            continue
        at = next((i for i, (a, b) in enumerate(zip(reference, names)) if a != b), min(len(reference), len(names)))

        def shown(tests: list[str]) -> str:
            return tests[at] if at < len(tests) else "no more"

        raise pytest.UsageError(
            f"rank {rank} collected {len(names)} tests that use {EVERY_RANK_FIXTURE}, rank 0 {len(reference)}; at "
            f"position {at + 1} rank 0 has {shown(reference)}, rank {rank} {shown(names)}. The ranks meet at each "
            "of these tests, so every rank must collect the same ones in the same order: the same pytest arguments "
            "and files on every rank, and no random order (pytest-randomly: -p no:randomly, or one --randomly-seed).")


def _agreed_phase(item: pytest.Item, phase: str):
    meeting = meeting_of(item.config)
    if meeting is None or item.nodeid not in meeting.every_rank:
        return (yield)
    if phase == "setup":
        meeting.attempts[item.nodeid] += 1  # a rerun meets at fresh keys
    key = f"{test_key(item.nodeid, meeting.attempts[item.nodeid])}/{phase}"
    what = "this test" if phase == "call" else f"the {phase} of this test"
    try:
        result = yield
    except (KeyboardInterrupt, pytest.exit.Exception):
        raise  # the session ends: the other ranks learn it at their next meeting
    except BaseException as exc:
        mine = exc
    else:
        mine = None
    agree(meeting.gather(key, phase_outcome(item, mine)), meeting.launch.rank, mine, what)
    if mine is not None:
        raise mine
    return result


# Outermost (tryfirst) wrappers: what the other hooks of the phase raise (a needs_gpus skip, a fixture's error)
# is this rank's outcome too.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item):
    return (yield from _agreed_phase(item, "setup"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item):
    return (yield from _agreed_phase(item, "call"))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem):
    return (yield from _agreed_phase(item, "teardown"))


def test_key(nodeid: str, attempt: int) -> str:
    return f"test/{nodeid}/{attempt}"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    meeting = meeting_of(session.config)
    if meeting is not None:
        statuses = meeting.gather(_SESSION_END, int(session.exitstatus), abort=lambda: None)
        session.config.stash[_statuses_key] = statuses
        session.exitstatus = statuses[0] or max(statuses.values())


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    meeting = meeting_of(config)
    if meeting is None or _statuses_key not in config.stash:
        return
    # The others end only once rank 0 has written its report: torchrun ends every rank as soon as one exits
    # with a failure status, and rank 0 would be ended mid-report.
    meeting.gather(_REPORT_WRITTEN, True, abort=lambda: None)
    launch = meeting.launch
    meeting.store.add(_LEFT, 1)
    if launch.rank == 0 and not launch.agent_store:  # the others are still reading from this process's store
        deadline = time.monotonic() + _EXIT_READ_S
        while meeting.store.add(_LEFT, 0) < launch.world_size and time.monotonic() < deadline:
            time.sleep(_POLL_MAX_S)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    statuses = config.stash.get(_statuses_key, {})
    if len(set(statuses.values())) > 1:
        terminalreporter.write_line(
            "llmload: exit status by rank: " + ", ".join(f"rank {r} {s}" for r, s in sorted(statuses.items()))
            + f"; every rank exits with {statuses[0] or max(statuses.values())}")
