"""``distributed_env`` under a launcher (see :mod:`.launched_run`): ``run(fn, world_size)`` runs ``fn`` on this
process's rank of the launcher's job, in a child forked from it (:mod:`pytest_llmload.runners.children`, as every
child starts), and every rank returns every rank's result or raises the same failure."""

from __future__ import annotations

import datetime
import functools
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, Callable, Optional

import pytest

from pytest_llmload.system import gpus
from pytest_llmload.plugin.launched_run import meeting_of
from pytest_llmload.runners import children, isolation, ranks, wire
from pytest_llmload.runners.children import ChildOutcome
from pytest_llmload.runners.launcher import (
    PHASE_OUTCOME,
    RESULT_MARGIN_S,
    Launch,
    Meeting,
    agree,
    agreed,
    test_key,
)
from pytest_llmload.runners.ranks import DistributedEnv, DistributedRunFailed


class LaunchedEnv(DistributedEnv):
    """``distributed_env`` under a launcher: ``run`` runs ``fn`` on this process's rank of the launcher's job."""

    def __init__(self, meeting: Meeting, nodeid: str, gpu_count: Callable[[], int], skip: Callable[[str], Any]):
        super().__init__(gpu_count, skip)
        self._meeting, self._nodeid, self._runs = meeting, nodeid, 0

    def skip_reason(self, world_size: int, backend: str, deepspeed: bool) -> Optional[str]:
        launch = self._meeting.launch
        if world_size != launch.world_size:
            return (f"distributed_env: this test asks for world_size={world_size}, but {launch.launcher} started "
                    f"{launch.world_size} ({launch.variables()}={launch.rank}/{launch.world_size}); run it where the "
                    f"launcher's world size is {world_size}, or without a launcher")
        return super().skip_reason(world_size, backend, deepspeed)

    def _nccl_skip_reason(self, world_size: int) -> Optional[str]:
        local = self._meeting.launch.local_rank
        reason = gpus.skip_reason(local + 1)
        return None if reason is None else (
            f"distributed_env: rank {self._meeting.launch.rank} would run nccl on cuda:{local} (its LOCAL_RANK), "
            f"which {reason}")

    def _start(self, fn, world_size, *, args, kwargs, backend, timeout, env, init_process_group) -> list[Any]:
        __tracebackhide__ = True  # the report is the ranks' outcomes, not this function's frames
        isolation.check_timeout(timeout)
        self._runs += 1
        meeting, launch = self._meeting, self._meeting.launch
        test = test_key(self._nodeid, meeting.attempts[self._nodeid])
        key = f"{test}/run{self._runs}"
        what = f"distributed_env.run #{self._runs} of this test"
        abort = functools.partial(_peer_left, meeting, f"{test}/call", what)
        server = listener = once_forked = None
        try:
            if launch.rank == 0:
                # A fresh store for this run's process group: a group made by env:// on a store that earlier
                # groups used would find their keys. The ranks connect to it as clients, as to torchrun's agent.
                # It listens on MASTER_ADDR's address only, not on every interface (runners.wire). Its serving
                # thread starts once this rank's child is forked, and the others learn its port only then: a
                # child forked while that thread serves another rank's connection can inherit the C library's
                # resolver mid-lookup and hang in its rendezvous for good (see ranks.run_rank_groups).
                listener = wire.listening_socket(launch.world_size, host=launch.master_addr,
                                                 every_interface_allowed=meeting.every_interface_allowed)
                port = listener.getsockname()[1]

                def once_forked():
                    nonlocal server, listener
                    server, listener = wire.bound_store(launch.world_size, datetime.timedelta(seconds=timeout),
                                                        host=launch.master_addr, listener=listener), None
                    meeting.gather(f"{key}/ready", port, PORT, abort=abort)
            else:
                port = meeting.gather(f"{key}/ready", None, PORT, abort=abort)[0]
            outcome = _run_here(launch, fn, args, kwargs, backend, timeout, env, init_process_group, port,
                                once_forked)
            deadline = time.monotonic() + timeout + RESULT_MARGIN_S
            outcomes = meeting.gather(f"{key}/result", _portable(outcome), RESULT, deadline=deadline)
        finally:
            if listener is not None:  # (the ranks did not meet: no store took it over)
                listener.close()
            del server  # closes the port: every rank's child has ended
        results = _outcomes(outcomes, launch.world_size, timeout + RESULT_MARGIN_S)
        if all(o.status == "ok" for o in results):
            return [o.value for o in results]
        skipped = [o for o in results if o.status != "ok" and o.skip is not None]
        if skipped and all(o.skip is not None or ranks.lost_a_peer(o) for o in results if o.status != "ok"):
            raise agreed(pytest.skip.Exception(f"{skipped[0].skip} (on {skipped[0].label})",
                                                _use_item_location=True))
        raise agreed(DistributedRunFailed(ranks._failure_message(results, backend, timeout), results))


def _peer_left(meeting: Meeting, call_key: str, what: str) -> None:
    """While waiting for the others at a run: a rank that ended the test's call phase will not come."""
    if not meeting.posted(call_key):
        return
    world = range(meeting.launch.world_size)
    left = {r: meeting.read(call_key, r, PHASE_OUTCOME) for r in world if meeting.store.check([f"{call_key}/{r}"])}
    if not left:  # (a count raised from outside the job: no rank left)
        return
    agree(left, meeting.launch.rank, None, "this test")  # a peer's failure or skip: the same here
    raise agreed(pytest.fail.Exception(
        f"{', '.join(f'rank {r}' for r in left)} ended this test without calling {what}: every rank must make "
        "the same distributed_env.run calls, in the same order.", pytrace=False))


def _run_here(launch: Launch, fn, args, kwargs, backend, timeout, env, init_process_group, port,
              once_forked) -> ChildOutcome:
    """``fn`` on this rank, in a child forked from this process that joins the run's process group once
    ``once_forked()`` (if any) has returned."""
    rank_env = {"LOCAL_RANK": str(launch.local_rank), "MASTER_ADDR": launch.master_addr}
    if "LOCAL_WORLD_SIZE" in os.environ:  # (torchrun's; without it the child is told the whole world is local)
        rank_env["LOCAL_WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    rank_env.update(env or {})
    prepare = functools.partial(ranks._prepare_rank, launch.rank, launch.world_size, port, backend, rank_env,
                                init_process_group, timeout)
    from pytest_llmload.config.stash_keys import running_checks_judge

    # The rank judges what it raised with its check's judge, as a rank the check forked does (runners.ranks).
    spec = children.ChildSpec(f"rank {launch.rank}", fn, args, kwargs, merge_output=True, prepare=prepare,
                              judge=running_checks_judge.get())
    (outcome,) = children.run_children([spec], timeout, start=children.start_for(backend=backend),
                                       prefix="llmload-rank-", once_forked=once_forked)
    return outcome


_SENT = ("status", "value", "error", "traceback", "exitcode", "stacks", "output", "pid", "row")
# What each key of a run holds: rank 0's port of the run's store (the others post None); every rank's outcome.
PORT = wire.Shape("a port number (rank 0's) or None", lambda v: v is None or (type(v) is int and 0 < v < 65536), 64)
_RESULT_FIELDS = {"status": str, "error": str, "traceback": str, "stacks": str, "output": str, "host": str,
                  "exitcode": (int, type(None)), "pid": (int, type(None)), "skip": (str, type(None)),
                  "finished_at": (float, int, type(None)), "row": (dict, type(None))}
RESULT = wire.Shape(
    f"a rank's outcome (a dict of {', '.join(('value', *_RESULT_FIELDS))}; the value plain data)",
    lambda v: type(v) is dict and v.keys() == {"value", *_RESULT_FIELDS} and all(
        type(v[name]) in (kinds if isinstance(kinds, tuple) else (kinds,)) for name, kinds in _RESULT_FIELDS.items()),
    64 << 20)


def _portable(outcome: ChildOutcome) -> dict:
    """The outcome, for the other ranks: plain values, the exception as its skip reason only, the time on the
    wall clock (monotonic clocks of different hosts do not compare)."""
    fields = {name: getattr(outcome, name) for name in _SENT}
    fields["skip"] = outcome.exception.msg if isinstance(outcome.exception, pytest.skip.Exception) else None
    fields["finished_at"] = None if outcome.finished_at is None else time.time() - (time.monotonic() -
                                                                                      outcome.finished_at)
    fields["host"] = socket.gethostname()
    return fields


def _outcomes(received: Mapping[int, dict], world_size: int, waited: float) -> list[ChildOutcome]:
    several_hosts = len({fields["host"] for fields in received.values()}) > 1
    outcomes = []
    for rank in range(world_size):
        fields = received.get(rank)
        label = f"rank {rank}" + (f" ({fields['host']})" if several_hosts and fields else "")
        outcome = ChildOutcome(rank, label)
        outcome.skip = None
        if fields is None:
            outcome.status, outcome.exitcode = "died", None
            outcome.error = f"sent no result within {waited:g} s of this rank's: its pytest process hung or died"
        else:
            for name, value in fields.items():
                setattr(outcome, name, value)
        outcomes.append(outcome)
    return outcomes


def distributed_env_for(request: pytest.FixtureRequest, gpu_count: Callable[[], int], skip: Callable[[str], Any]):
    """The ``distributed_env`` of a test under a launcher (a :class:`LaunchedEnv`); ``None`` for
    a plain run."""
    meeting = meeting_of(request.config)
    if meeting is None:
        return None
    return LaunchedEnv(meeting, request.node.nodeid, gpu_count, skip)
