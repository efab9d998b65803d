"""A deadline that passed inside the loader call is recognised as a hang, whatever enforced it; other failures
are not. (The fail-fast it leads to, end to end: tests/main_job/test_main_job.py.)"""

import signal
import time

import pytest

from pytest_llmload.plugin.loader_hang import Hang, hang_in_loader
from pytest_llmload.loader.seam import call_loader
from pytest_llmload.instruments.probes import deadline
from pytest_llmload.loader.request import LoadRequest

pytestmark = pytest.mark.timeout(60)


def hanging_loader(request):
    time.sleep(30)


def load_through_the_seam(tmp_path):
    call_loader(hanging_loader, LoadRequest(model_path=tmp_path))


def test_a_checks_own_deadline_in_the_loader_is_a_hang(tmp_path):
    with pytest.raises(AssertionError) as excinfo, deadline(0.2, "the load"):
        load_through_the_seam(tmp_path)
    assert hang_in_loader(excinfo.value, "check_x") == Hang("check_x", 0.2)


def test_the_same_deadline_outside_the_loader_is_not():
    with pytest.raises(AssertionError) as excinfo, deadline(0.2, "a forward pass"):
        time.sleep(30)
    assert hang_in_loader(excinfo.value, "check_x") is None
    assert hang_in_loader(AssertionError("4 of 8 train requests failed"), "check_x") is None


def test_pytest_timeouts_alarm_in_the_loader_is_a_hang(tmp_path):
    def as_pytest_timeout_does(signum, frame):
        pytest.fail("Timeout (>0.2s) from pytest-timeout.")

    previous = signal.signal(signal.SIGALRM, as_pytest_timeout_does)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(pytest.fail.Exception) as excinfo:
            load_through_the_seam(tmp_path)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert hang_in_loader(excinfo.value, "check_x") == Hang("check_x", 0.2)


def test_an_isolated_child_and_a_rank_still_in_the_loader_at_their_deadline_are_hangs(tmp_path):
    from pytest_llmload.runners.isolation import IsolationFailed, run_isolated
    from pytest_llmload.runners.ranks import DistributedRunFailed, run_ranks

    with pytest.raises(IsolationFailed) as isolated:
        run_isolated(load_through_the_seam, (tmp_path,), timeout=1, label="check_x")
    assert hang_in_loader(isolated.value, "check_x") == Hang("check_x", 1.0)
    with pytest.raises(DistributedRunFailed) as ranks:
        run_ranks(load_through_the_seam, 1, args=(tmp_path,), timeout=1, init_process_group=False)
    assert hang_in_loader(ranks.value, "check_y") == Hang("check_y", 1.0)
    with pytest.raises(IsolationFailed) as elsewhere:
        run_isolated(time.sleep, (30,), timeout=1, label="check_z")
    assert hang_in_loader(elsewhere.value, "check_z") is None


def _rank(index: int, status: str, stacks: str = ""):
    from pytest_llmload.runners.children import ChildOutcome

    outcome = ChildOutcome(index, f"rank {index}")
    outcome.status, outcome.stacks = status, stacks
    return outcome


IN_THE_LOADER = '  File "/src/pytest_llmload/loader/seam.py", line 10 in call_loader'


def test_the_row_and_the_fail_fast_read_the_children_by_one_judgement():
    """A rank still in the loader at its deadline beside a rank that died: the row says the loader hung (the verdict's
    reading), but later tests still wait (the hung rank may only have been waiting on the dead one)."""
    from types import SimpleNamespace

    from pytest_llmload.reports.verdict import of_exception
    from pytest_llmload.runners.children import ChildrenEnd, children_end
    from pytest_llmload.runners.ranks import DistributedRunFailed

    failure = SimpleNamespace(id="some-failure", hang_is_mechanism=False)
    alone = DistributedRunFailed("1 of 1 ranks failed (gloo, deadline 5 s)", [_rank(0, "hung", IN_THE_LOADER)])
    assert children_end(alone.outcomes) == ChildrenEnd("hung", in_loader=True, after_a_death=False)
    assert hang_in_loader(alone, "check_x") == Hang("check_x", 5.0)
    beside_a_death = DistributedRunFailed("2 of 2 ranks failed (gloo, deadline 5 s)",
                                          [_rank(0, "hung", IN_THE_LOADER), _rank(1, "died")])
    assert children_end(beside_a_death.outcomes) == ChildrenEnd("hung", in_loader=True, after_a_death=True)
    assert hang_in_loader(beside_a_death, "check_x") is None
    verdict = of_exception(beside_a_death, failure)
    assert (verdict.kind, verdict.cause) == ("error", "hang")
    assert verdict.sentence.startswith("the loader under test hung: ")
    elsewhere = DistributedRunFailed("1 of 1 ranks failed (gloo, deadline 5 s)", [_rank(0, "hung", "in sleep")])
    assert hang_in_loader(elsewhere, "check_x") is None and of_exception(elsewhere, failure).sentence.startswith(
        "the check did not finish in time: ")
    died = DistributedRunFailed("1 of 1 ranks failed", [_rank(0, "died")])
    assert children_end(died.outcomes).how == "died" and of_exception(died, failure).cause == "died"
