"""A run stopped from outside keeps its rows (issue 49, point 5): SIGTERM, SIGHUP and ``llmload_run_deadline``
stop pytest as Ctrl-C does; JUnit XML and the HTML report are written with the tests finished before it and say
what stopped the run. Before, pytest died of SIGTERM or SIGHUP and wrote neither file.

The runs are pytest forked from this process (:func:`fixtures.warm_popen.popen_forked`: the same command line, no
new interpreter's imports) on a file of plain tests: one that finishes, one that sleeps until it is stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

SLEEPER = """
import pathlib
import time

def test_finished(llmload_offline):  # an llmload fixture: the run uses the plugin
    pass

def test_sleeps():
    pathlib.Path("started").touch()
    time.sleep(60)

def test_never_started():
    pass
"""
WAIT_S = 60.0  # for a loaded runner; a run that works takes about a second


def _run(pytester: pytest.Pytester, *args: str, signum=None, env=None, tests: str = SLEEPER) -> tuple[int, str]:
    """pytest on ``tests`` (:data:`SLEEPER`) with ``args`` (and ``env`` added to the environment); ``signum`` sent
    once the sleeping test has started. Its exit code and output."""
    from fixtures.warm_popen import popen_forked

    pytester.makepyfile(test_sleeper=tests)
    env = {**os.environ, **(env or {}), "PYTHONPATH": os.pathsep.join(filter(None, [str(pytester.path),
                                                                                   os.environ.get("PYTHONPATH")]))}
    output_path = pytester.path / "output.txt"
    with open(output_path, "wb") as output:
        child = popen_forked([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args], stdout=output,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=pytester.path)
    try:
        if signum is not None:
            end = time.monotonic() + WAIT_S
            while not (pytester.path / "started").exists() and child.poll() is None and time.monotonic() < end:
                time.sleep(0.02)
            child.send_signal(signum)
        code = child.wait(WAIT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return code, output_path.read_text(errors="replace")


def _junit(pytester: pytest.Pytester) -> tuple[list[str], dict[str, str]]:
    """The testcases' names and the testsuite's properties of ``junit.xml``."""
    suite = ET.parse(pytester.path / "junit.xml").getroot().find("testsuite")
    return ([case.get("name") for case in suite.iter("testcase")],
            {prop.get("name"): prop.get("value") for prop in suite.iter("property")})


@pytest.mark.parametrize("under_main_job", [False, True], ids=["plain pytest", "the main job's pytest"])
def test_sigterm_writes_junit_with_the_rows_so_far(pytester: pytest.Pytester, under_main_job: bool) -> None:
    """Under the main job (which passes SIGTERM and SIGHUP on as they came) its pytest has the main job's handler
    (:func:`pytest_llmload.runners.lifeline.tie_to_main_job`, here with this process as the main job): the same
    file, the same property."""
    from pytest_llmload.config.vocabulary import PARENT_ENV

    code, output = _run(pytester, "--junitxml=junit.xml", signum=signal.SIGTERM,
                        env={PARENT_ENV: str(os.getpid())} if under_main_job else None)
    assert code == pytest.ExitCode.INTERRUPTED, output
    cases, properties = _junit(pytester)
    assert cases == ["test_finished"]  # (no nameless testcase for the test that was running)
    assert properties["llmload_interrupted"] == ("stopped by SIGTERM while test_sleeper.py::test_sleeps ran "
                                                 "(it has no row)")
    assert "llmload: the run was interrupted: stopped by SIGTERM" in output


def test_sighup_writes_the_html_report_with_a_banner(pytester: pytest.Pytester) -> None:
    pytest.importorskip("matplotlib", reason="--llmload-html needs matplotlib")
    code, output = _run(pytester, "--llmload-html=report.html", signum=signal.SIGHUP)
    assert code == pytest.ExitCode.INTERRUPTED, output
    page = (pytester.path / "report.html").read_text()
    assert ('<p class="interrupted" role="alert"><b>Interrupted:</b> stopped by SIGHUP while '
            "test_sleeper.py::test_sleeps ran (it has no row).") in page
    assert "test_finished" in page and "test_never_started" not in page


def test_run_deadline_stops_the_run_and_writes_the_reports(pytester: pytest.Pytester) -> None:
    code, output = _run(pytester, "--junitxml=junit.xml", "--llmload-run-deadline=2")
    assert code == pytest.ExitCode.INTERRUPTED, output
    cases, properties = _junit(pytester)
    assert cases == ["test_finished"]
    assert properties["llmload_interrupted"] == ("stopped at the run deadline, 2 s (--llmload-run-deadline) while "
                                                 "test_sleeper.py::test_sleeps ran (it has no row)")


def test_run_deadline_takes_the_stacks_of_the_running_tests_children(pytester: pytest.Pytester) -> None:
    """Before, the deadline's interruption killed a check's children without a word of where they were."""
    sleeper = SLEEPER.replace("    time.sleep(60)\n", "    run_isolated(sleeps_in_its_child, timeout=60)\n") + (
        "\nfrom pytest_llmload.runners.isolation import run_isolated\n\n\ndef sleeps_in_its_child():\n"
        "    time.sleep(60)\n")
    code, output = _run(pytester, "--llmload-run-deadline=2", tests=sleeper)
    assert code == pytest.ExitCode.INTERRUPTED, output
    stacks = output[output.index("llmload: the stacks of its children when it stopped:"):]
    assert 'test_sleeper.py", line ' in stacks and "in sleeps_in_its_child" in stacks, output


def test_a_handler_set_by_others_is_left_and_ours_undone(pytester: pytest.Pytester) -> None:
    """The user's (a conftest's) SIGHUP handler stays theirs; ours for SIGTERM is gone after the run."""
    pytester.makeconftest("""
        import signal

        def users_own(signum, frame):
            pass

        def pytest_configure(config):
            signal.signal(signal.SIGHUP, users_own)
    """)
    pytester.makepyfile("""
        import signal

        def test_handlers():
            assert signal.getsignal(signal.SIGHUP).__name__ == "users_own"
            assert signal.getsignal(signal.SIGTERM).__qualname__ == "Interruption._interrupt"
    """)
    saved = {signum: signal.signal(signum, signal.SIG_DFL) for signum in (signal.SIGTERM, signal.SIGHUP)}
    try:  # (as in a run of its own: this test process's pytest may hold them)
        result = pytester.runpytest("-p", "no:cacheprovider", "--llmload-strict")
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
    result.assert_outcomes(passed=1)
