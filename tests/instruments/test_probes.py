"""pytest_llmload.instruments.probes: the deadline the checks and the plugin's imports run under."""

import signal
import time

import pytest

from pytest_llmload.instruments.probes import DeadlineExceeded, deadline

pytestmark = pytest.mark.timeout(30)


def takes_sigalrm_and_hangs(seconds: float) -> None:
    signal.signal(signal.SIGALRM, lambda signum, frame: None)  # the guarded code's own handler: the alarm is its now
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        time.sleep(0.01)


def test_a_deadline_holds_where_the_guarded_code_takes_sigalrm_for_itself():
    """Before (issue 49, 8): a loader module that set its own SIGALRM handler removed the deadline; the block ran its
    whole 3 s and failed only as late, without the frame it was blocked in."""
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as excinfo, deadline(0.2, "the guarded block"):
        takes_sigalrm_and_hangs(3)
    assert time.monotonic() - started < 2
    text = str(excinfo.value)
    assert text.startswith("the guarded block did not return: deadline of 0.2 s exceeded, blocked in "
                           "takes_sigalrm_and_hangs (")
    assert "Stacks of every thread:" in text and "time.sleep(0.01)" in text
    with deadline(0.3, "a block that ends in time"):  # nothing of the last one's is left to interrupt this one
        time.sleep(0.05)
