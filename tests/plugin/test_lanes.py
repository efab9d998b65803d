"""--llmload-lanes N: the tests in N processes forked from the pytest process (pytest_llmload.plugin.lanes).

Plain tests here (no model): each records the process it ran in. What the lanes must keep: every test runs once,
the run reports as one (outcomes, exit status, JUnit XML), a lane that dies is an error for its test and the rest
still run, an interruption stops every lane, and runs where lanes would change the meaning keep to one process.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

# Each test appends "<name> <pid>" to ran.txt; the conftest writes the pytest process's own pid to main.txt.
CONFTEST = """
import os

def pytest_configure(config):
    if not hasattr(config, "workerinput"):
        with open("main.txt", "w") as out:
            out.write(str(os.getpid()))
"""
RECORD = """
import os, time

def _ran(name):
    with open({ran!r}, "a") as out:
        out.write(f"{{name}} {{os.getpid()}}\\n")
"""


def _tests(pytester, body: str, count: int = 6) -> None:
    pytester.makeconftest(CONFTEST)
    head = RECORD.format(ran=str(pytester.path / "ran.txt"))
    pytester.makepyfile(head + "".join(body.format(n=n) for n in range(count)))


def _ran(pytester) -> list[tuple[str, int]]:
    path = pytester.path / "ran.txt"
    lines = path.read_text().splitlines() if path.exists() else []
    return [(name, int(pid)) for name, pid in (line.split() for line in lines)]


PASSES = """
def test_{n}():
    _ran("test_{n}")
    time.sleep(0.2)
"""


def test_two_lanes_run_every_test_once_in_two_processes_and_report_as_one_run(pytester):
    _tests(pytester, PASSES + """
def test_fails_{n}():
    _ran("test_fails_{n}")
    assert {n} == 99, "fails in whatever lane"
""", count=3)
    result = pytester.runpytest("-p", "no:randomly", "--llmload-lanes", "2", "--junitxml", "out.xml")
    result.assert_outcomes(passed=3, failed=3)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    ran = _ran(pytester)
    assert sorted(name for name, _ in ran) == sorted([f"test_{n}" for n in range(3)] +
                                                      [f"test_fails_{n}" for n in range(3)])  # each once
    assert len({pid for _, pid in ran}) == 2
    # the failures of the other lane are told here, whole, as this process's own
    result.stdout.fnmatch_lines(["*fails in whatever lane*"])
    cases = ET.parse(pytester.path / "out.xml").getroot().iter("testcase")
    assert len([c for c in cases if c.find("failure") is not None]) == 3


def test_a_lane_that_dies_is_an_error_for_its_test_and_lane_zero_runs_what_it_left(pytester):
    # The other lane takes the tests from the start: the first one ends that lane's process.
    _tests(pytester, """
def test_{n}():
    _ran("test_{n}")
    if {n} == 0 and os.getpid() != int(open("main.txt").read()):
        os._exit(7)
    time.sleep(0.2)
""")
    result = pytester.runpytest("-p", "no:randomly", "--llmload-lanes", "2", "-rA")
    result.assert_outcomes(passed=5, failed=1)
    result.stdout.fnmatch_lines(["*_ test_0 _*", "pytest's lane 1 (a fork of the pytest process) ended (exit code 7) "
                                 "while this test ran*"])
    ran = [name for name, _ in _ran(pytester)]
    assert sorted(ran) == sorted(f"test_{n}" for n in range(6))  # the dying one once, every other once


@pytest.mark.parametrize("args", [("-x",), ("--maxfail", "2"), ("--sw",), ("--collect-only",),
                                  ("-k", "test_0 or test_1")],
                         ids=["exitfirst", "maxfail", "stepwise", "collect-only", "two-tests"])
def test_runs_that_lanes_would_change_keep_to_one_process(pytester, args):
    _tests(pytester, PASSES)
    result = pytester.runpytest("-p", "no:randomly", "--llmload-lanes", "2", *args)
    assert result.ret == pytest.ExitCode.OK
    assert len({pid for _, pid in _ran(pytester)}) <= 1


def test_with_a_gpu_visible_the_tests_that_use_it_keep_to_lane_zero_and_the_others_spread(pytester, monkeypatch):
    # Issue 40: one lane wherever a GPU was visible made the H200's main job one chain. Now only the GPU's tests keep
    # to one process (never two at once on the GPU); the other lane takes the rest, from the start.
    from pytest_llmload.system import gpus

    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 1)  # (what counts them)
    _tests(pytester, PASSES + """
import pytest

@pytest.mark.needs_gpus(1)
def test_gpu_{n}():
    _ran("test_gpu_{n}")
    time.sleep(0.2)
""", count=3)
    result = pytester.runpytest("-p", "no:randomly", "--llmload-lanes", "2")
    result.assert_outcomes(passed=6)
    main = int((pytester.path / "main.txt").read_text())
    ran = _ran(pytester)
    assert {pid for name, pid in ran if name.startswith("test_gpu")} == {main}
    assert len({pid for _, pid in ran}) == 2


@pytest.mark.skipif(sys.platform == "win32", reason="signals and fork")
def test_ctrl_c_to_the_pytest_process_stops_every_lane(pytester):
    # The process is the subject: a real pytest, interrupted while both lanes are inside a test.
    _tests(pytester, """
def test_{n}():
    _ran("test_{n}")
    time.sleep(60)
""", count=4)
    env = {**os.environ, "PYTEST_ADDOPTS": "-p no:randomly -p no:hypothesispytest"}
    with open(pytester.path / "out.log", "w") as log:
        # Python's own Ctrl-C handler set explicitly: a process started where SIGINT is ignored (a CI job run in the
        # background of a non-interactive shell) inherits the ignoring, and Python keeps it.
        run = subprocess.Popen([sys.executable, "-c", SIGINT_AS_CTRL_C, "--llmload-lanes", "2"], cwd=pytester.path,
                               stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 60
        while len(_ran(pytester)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = {pid for _, pid in _ran(pytester)}
        assert len(pids) == 2, (pytester.path / "out.log").read_text()
        run.send_signal(signal.SIGINT)
        try:
            code = run.wait(60)
        except subprocess.TimeoutExpired:
            alive = {pid: _alive(pid) for pid in pids}
            run.kill()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail(f"pytest still ran 60 s after SIGINT (lanes alive: {alive}); its output:\n"
                        + (pytester.path / "out.log").read_text())
    assert code == pytest.ExitCode.INTERRUPTED, (pytester.path / "out.log").read_text()
    time.sleep(0.2)
    assert [pid for pid in pids if _alive(pid)] == []


SIGINT_AS_CTRL_C = "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); " \
    "sys.exit(pytest.main(sys.argv[1:]))"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone
        return stat.read().rpartition(")")[2].split()[0] != "Z"


SETUP_RECORDER = """
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    with open("setup.txt", "a") as out:
        out.write(f"{item.name} {os.getpid()}\\n")
"""


# Tests parametrized by "check" as the main job's suite is: the lanes read what each check needs from it.
CHECK_PARAMS = """
import pytest
from pytest_llmload.checks.base import Check
from pytest_llmload.failures.offload_hang import FAILURE

def _check(**needs):
    return Check(function=print, failure=FAILURE, **needs)  # (never called: the tests only carry it)

@pytest.mark.parametrize("check", [{checks}])
def test_{n}(check):
    _ran("test_{n}")
    time.sleep(0.2)  # (each lane gets some: quicker, the first could run them all before the other starts)
"""


@pytest.mark.parametrize("checks, preloaded", [
    ("_check(isolated=True, uses_adapters=True), _check(), _check(world_size=2)", [True]),
    ("_check(world_size=2), _check()", [False]),
    ("_check(isolated=True, uses_adapters=True, needs_gpus=1), _check()", []),  # skips without a GPU: nothing to share
    ("'a repo parameter named check', 3", []),  # not this plugin's checks
], ids=["peft-check", "ranks-only", "gpu-only", "not-checks"])
def test_what_the_checks_children_import_is_imported_once_before_the_lanes_fork(pytester, monkeypatch, checks,
                                                                                 preloaded):
    from pytest_llmload.runners import preload

    calls = []
    monkeypatch.setattr(preload, "preload_for_isolated_checks", lambda peft: calls.append((os.getpid(), peft)))
    _tests(pytester, CHECK_PARAMS.replace("{checks}", checks), count=3)
    result = pytester.runpytest("-p", "no:randomly", "--llmload-lanes", "2")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    assert len({pid for _, pid in _ran(pytester)}) == 2  # (forked after the preload: the lanes share it)
    assert calls == [(os.getpid(), peft) for peft in preloaded]


def test_a_preload_that_raises_leaves_the_error_to_the_checks_that_need_it(pytester, monkeypatch):
    from pytest_llmload.runners import preload

    def broken(peft):
        raise RuntimeError("bitsandbytes: no usable backend")

    monkeypatch.setattr(preload, "preload_for_isolated_checks", broken)
    _tests(pytester, CHECK_PARAMS.replace("{checks}", "_check(isolated=True, uses_adapters=True), _check()"), count=3)
    result = pytester.runpytest("-p", "no:randomly", "--llmload-lanes", "2")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()  # no INTERNALERROR: the run goes on in its lanes
    assert len({pid for _, pid in _ran(pytester)}) == 2
    # The failure is that run's: the rows of a later run in this process do not name it (issue 35's CI run did).
    assert preload.preload_failure() is None


def test_a_hang_of_the_loader_in_one_lane_fails_the_other_lanes_later_tests_at_once(pytester):
    # test_0 (the other lane's first) stands for a check whose loader hung: it records the hang as
    # pytest_llmload.plugin.loader_hang does, and keeps its lane busy; lane 0, which starts from the end, learns of it
    # from the other process and fails the test it had reserved at once, naming the hang.
    pytester.makeconftest(CONFTEST + SETUP_RECORDER)
    head = RECORD.format(ran=str(pytester.path / "ran.txt"))
    pytester.makepyfile(head + """
def test_0(request):
    from pytest_llmload.plugin.loader_hang import Hang, hang_key

    request.config.stash[hang_key] = Hang("check_that_hung", 1.0)
    time.sleep(1.5)
""" + "".join(f"""
def test_{n}(llmload_loader):
    time.sleep(0.4)
""" for n in range(1, 10)))
    result = pytester.runpytest("-p", "no:randomly", "--llmload-lanes", "2")
    main = int((pytester.path / "main.txt").read_text())
    lane_zero = [name for name, pid in (line.split() for line in (pytester.path / "setup.txt").read_text().splitlines())
                 if int(pid) == main]
    failed = {report.nodeid.rpartition("::")[2] for report in result.reprec.getfailures()}
    assert failed and "test_0" not in failed
    assert set(lane_zero) & failed, (lane_zero, failed)  # lane 0 failed one of its own for the other lane's hang
    result.stdout.fnmatch_lines(["the loader under test hung in check_that_hung (deadline 1 s); skipping the wait*"])


def test_lanes_writing_long_progress_lines_at_once_never_interleave_them(tmp_path):
    # The main job's progress file is shared by the lanes of a run: a failure's reason can be many kilobytes, which
    # a buffered file would write in pieces that another lane's line could land between.
    import json

    from pytest_llmload.reports.progress import ProgressWriter

    path = tmp_path / "progress.jsonl"
    writer = ProgressWriter(str(path))
    children = []
    for lane in range(2):
        pid = os.fork()
        if pid == 0:  # (a lane: a fork of this process, writing through the same writer)
            try:
                for n in range(200):
                    writer.write(event="result", lane=lane, n=n, reason=str(lane) * 50_000)
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    writer.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted((r["lane"], r["n"]) for r in records) == [(lane, n) for lane in range(2) for n in range(200)]
