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
