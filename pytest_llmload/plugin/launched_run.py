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
ranks; and a failed run leaves no broken group to the next test.

The hooks of such a run are here (registered by the plugin under a launcher; idle without one). Which launcher,
which rank, and where and how the ranks meet and agree are :mod:`pytest_llmload.runners.launcher`'s;
``distributed_env``'s object under a launcher is in :mod:`.launched_env`, imported by the first test that uses it.
This module imports nothing heavy.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, Optional

import pytest

from pytest_llmload.config.vocabulary import RANK_OF_ENV, RUN_SECRET_ENV, SETTING
from pytest_llmload.runners.launcher import (
    EXIT_STATUS,
    PHASE_OUTCOME,
    POLL_MAX_S,
    SESSION_END,
    LauncherError,
    Meeting,
    agree,
    detect,
    test_key,
)
from pytest_llmload.runners.wire import Shape, every_interface

# The fixture whose tests run on every rank (the others run on rank 0 only).
EVERY_RANK_FIXTURE = "distributed_env"
# Report writers the other ranks leave to rank 0: option dest -> its "off" value (those of plugins not
# installed are absent and skipped).
_REPORT_OPTIONS = {"xmlpath": None, "llmload_progress": None, "report_log": None, "json_report": False,
                   "htmlpath": None}
# How long rank 0 keeps hosting the store for the others to read the last keys (srun, mpirun).
EXIT_READ_S = 30.0
# Where the ranks meet, besides each test's keys (runners.launcher.test_key) and SESSION_END, and what each holds.
COLLECTED, REPORT_WRITTEN, LEFT = "collected", "report-written", "left"
TEST_IDS = Shape("a list of test ids (strings)", lambda v: type(v) is list and all(type(t) is str for t in v),
                 64 << 20)
WRITTEN = Shape("true (rank 0 wrote its report)", lambda v: v is True, 64)

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
    from pytest_llmload.config import settings

    bind_all = settings.value(config, "bind_all_interfaces")
    if every_interface(launch.master_addr) and not bind_all:
        raise pytest.UsageError(
            f"MASTER_ADDR={launch.master_addr!r} in the environment means every interface of this machine: the "
            f"stores rank 0 hosts for the {launch.launcher} job would listen there, reachable from every network it "
            "is on. Set MASTER_ADDR to the address the other ranks reach rank 0 at (this node's name or its address "
            f"on the cluster network), or pass {SETTING['bind_all_interfaces'].option} (ini "
            f"{SETTING['bind_all_interfaces'].ini} = true) to listen on every interface knowingly.")
    if getattr(config.option, "numprocesses", None):
        raise pytest.UsageError(
            f"pytest -n {config.option.numprocesses} under {launch.launcher}: each of its {launch.world_size} ranks "
            "would start its own xdist workers, each of them a rank again. Drop -n (or pass -n 0): the launcher's "
            "ranks are the parallel processes.")
    config.stash[meeting_key] = Meeting(launch, every_interface_allowed=bind_all)
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
    signed = (f"signed with ${RUN_SECRET_ENV}" if meeting.secret else
              f"not signed (no ${RUN_SECRET_ENV}: any process that reaches MASTER_ADDR:MASTER_PORT can post one)")
    return [f"llmload: rank {launch.rank} of {launch.world_size} under {launch.launcher} "
            f"({launch.variables()}, MASTER_ADDR={launch.master_addr}): tests that use {EVERY_RANK_FIXTURE} run on "
            f"every rank, the others on rank 0 only; this report is rank 0's; values between the ranks {signed}"]


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    meeting = meeting_of(session.config)
    if meeting is None:
        return
    every_rank = [item.nodeid for item in session.items if EVERY_RANK_FIXTURE in getattr(item, "fixturenames", ())]
    meeting.every_rank = set(every_rank)
    check_same_tests(meeting.gather(COLLECTED, every_rank, TEST_IDS))
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
    agree(meeting.gather(key, phase_outcome(item, mine), PHASE_OUTCOME), meeting.launch.rank, mine, what)
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


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    meeting = meeting_of(session.config)
    if meeting is not None:
        statuses = meeting.gather(SESSION_END, int(session.exitstatus), EXIT_STATUS, abort=lambda: None)
        session.config.stash[_statuses_key] = statuses
        session.exitstatus = statuses[0] or max(statuses.values())


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    meeting = meeting_of(config)
    if meeting is None or _statuses_key not in config.stash:
        return
    # The others end only once rank 0 has written its report: torchrun ends every rank as soon as one exits
    # with a failure status, and rank 0 would be ended mid-report.
    try:
        meeting.gather(REPORT_WRITTEN, True, WRITTEN, abort=lambda: None)
    except pytest.exit.Exception as exc:  # (pytest's own catch of an exit is behind us: said as it says one)
        sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
        return
    launch = meeting.launch
    meeting.store.add(LEFT, 1)
    if launch.rank == 0 and not launch.agent_store:  # the others are still reading from this process's store
        deadline = time.monotonic() + EXIT_READ_S
        while meeting.store.add(LEFT, 0) < launch.world_size and time.monotonic() < deadline:
            time.sleep(POLL_MAX_S)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    statuses = config.stash.get(_statuses_key, {})
    if len(set(statuses.values())) > 1:
        terminalreporter.write_line(
            "llmload: exit status by rank: " + ", ".join(f"rank {r} {s}" for r, s in sorted(statuses.items()))
            + f"; every rank exits with {statuses[0] or max(statuses.values())}")
