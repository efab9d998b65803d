"""pytest_llmload.plugin.guarded_import: a repo's module (its loader's, its checks') imported before any test runs,
offline, with its progress on the console and under a deadline it cannot remove (issue 49, 7 and 8)."""

import time

import pytest

from fixtures import warm_runs

pytestmark = pytest.mark.timeout(120)

# Takes SIGALRM for itself, then blocks in a call no exception reaches until it returns.
SLOW_LOADER = """
import signal
import time

signal.signal(signal.SIGALRM, lambda signum, frame: None)
time.sleep(30)


def load(request):
    return None
"""


def test_a_slow_loader_import_shows_its_progress_on_the_main_jobs_console_and_ends_at_its_deadline(pytester):
    """Before: under the main job the progress lines went only to pytest's log (the console silent for 205 s), and a
    module with its own SIGALRM handler removed the import deadline (here: 30 s, then another error)."""
    pytester.makepyfile(slow_loader=SLOW_LOADER)
    pytester.makeini("[pytest]\nllmload_phase_progress_seconds = 0.2\nllmload_import_timeout = 0.5\n")
    env = {**warm_runs.new_tmpdir(pytester.path), "PYTHONPATH": str(pytester.path), "COLUMNS": "200"}
    started = time.monotonic()
    out = warm_runs.main_job("--loader", "slow_loader:load", "--log", "pytest.log", cwd=pytester.path, env=env)
    assert time.monotonic() - started < 20
    assert out.returncode == pytest.ExitCode.USAGE_ERROR, out.stdout + out.stderr
    assert "llmload: still importing the loader's module 'slow_loader' (" in out.stdout, out.stdout
    failure = ("ERROR: importing the loader's module 'slow_loader' (--loader) did not return: deadline of 0.5 s "
               "exceeded, blocked in <module> (")
    assert f"llmload: {failure}" in out.stderr and "slow_loader.py:5)." in out.stderr, out.stderr
    # pytest's own words in its log, with every thread's stack
    log = pytester.path.joinpath("pytest.log").read_text().splitlines()
    pytest.LineMatcher(log).fnmatch_lines([
        "ERROR: importing the loader's module 'slow_loader' (--llmload-loader) did not return: deadline of 0.5 s "
        "exceeded, blocked in <module> (*slow_loader.py:5).",
        "Stacks of every thread:", "*slow_loader.py*line 5, in <module>", "    time.sleep(30)",
        "Make importing 'slow_loader' quick (no work at import: put it in the loader function), or raise "
        "--llmload-import-timeout."])


CHECKS_THAT_REACH_OUT = """
import socket

from pytest_llmload.failures import REGISTRY

try:
    socket.getaddrinfo("models.example.com", 443)
except OSError:
    pass  # what a module that tolerates being offline does: the attempt is still named
CHECKS = [REGISTRY[0]]
"""
CHECKS_THAT_DO_NOT_IMPORT_OFFLINE = """
import socket

socket.getaddrinfo("models.example.com", 443)
"""


@pytest.mark.parametrize(("caught", "says"), [
    (True, ["llmload: importing the checks' modules 'reaching_checks' (--llmload-checks) reached for the network 1 "
            "time(s), refused (the checks run offline): getaddrinfo ('models.example.com', 443) from "
            "<module> (*reaching_checks.py:6); make importing 'reaching_checks' need no network."]),
    (False, ["ERROR: check spec 'reaching_checks:CHECKS' from --llmload-checks does not import (NetworkAccessBlocked: "
             "pytest-llmload blocked a network connection to ('models.example.com', 443) from <module> "
             "(*reaching_checks.py:3): *; make importing it need no network: the checks run offline."]),
], ids=["caught: named on the console", "not caught: the usage error names it"])
def test_a_check_module_is_imported_offline_as_the_loader_is(pytester, caught, says):
    """Before (issue 49, 8): the repo's check modules were imported outside the offline guard; their reach for the
    network went out."""
    source = CHECKS_THAT_REACH_OUT if caught else CHECKS_THAT_DO_NOT_IMPORT_OFFLINE
    pytester.makepyfile(reaching_checks=source, test_plain="def test_plain():\n    pass\n")
    pytester.syspathinsert()
    result = pytester.runpytest("--llmload-checks", "reaching_checks:CHECKS", "-p", "no:cacheprovider", "test_plain.py")
    result.stderr.fnmatch_lines(says)
    assert result.ret == (pytest.ExitCode.OK if caught else pytest.ExitCode.USAGE_ERROR)
