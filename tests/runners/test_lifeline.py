"""Which processes tie themselves to the main job (the end-to-end signal tests are in tests/main_job/test_main_job.py)."""

import os
import subprocess
import sys

import pytest

from pytest_llmload.runners.lifeline import PARENT_ENV

pytestmark = pytest.mark.timeout(60)

TIE = "from pytest_llmload.runners import lifeline; lifeline.tie_to_main_job(); print('running')"


def run_with_parent(pid: int):
    return subprocess.run([sys.executable, "-c", TIE], env={**os.environ, PARENT_ENV: str(pid)},
                          capture_output=True, text=True, timeout=30)


def test_a_process_further_down_the_tree_is_left_alone():
    # The variable names a live process that is not this one's parent: a check's own subprocess inherited it.
    assert run_with_parent(os.getppid()).stdout == "running\n"


def test_a_process_whose_main_job_already_died_stops():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    result = run_with_parent(gone.pid)
    assert (result.returncode, result.stdout) == (143, "")
