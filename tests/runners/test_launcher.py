"""pytest under the cluster's launcher (:mod:`pytest_llmload.plugin.launched_run`, its hooks;
:mod:`pytest_llmload.runners.launcher`, detection and the ranks' meeting): torchrun starting pytest on 2 ranks,
with tests that agree, fail on one rank, hang on one rank, skip on one rank; and how the launcher is detected.

Each torchrun run starts 2 pytest processes that import torch: the scenarios share one run, read back from the
junit xml that rank 0 alone writes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from fixtures import warm_runs
from pytest_llmload.runners import launcher
from pytest_llmload.plugin.launched_run import check_same_tests
from pytest_llmload.runners.launcher import Launch, LauncherError, agree, detect

pytestmark = pytest.mark.timeout(180)

SCENARIOS = '''
import os
import time

import pytest

RANK = int(os.environ["RANK"])


def all_reduce():
    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    return dist.get_rank(), total.item()


def refuse_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()


def wait_forever_on_rank_0():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.barrier()


def skip_on_rank_1():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        pytest.skip("rank 1 has no use for it")


def test_agree(distributed_env):
    assert distributed_env.run(all_reduce, world_size=2, backend="gloo") == [(0, 3.0), (1, 3.0)]
    assert distributed_env.run(all_reduce, world_size=2, backend="gloo") == [(0, 3.0), (1, 3.0)]  # a fresh group


def test_rank_1_raises(distributed_env):
    distributed_env.run(refuse_on_rank_1, world_size=2, backend="gloo", timeout=20)


def test_rank_0_hangs(distributed_env):  # (forked ranks meet and answer in ~0.1 s: 1.5 s is a hang)
    distributed_env.run(wait_forever_on_rank_0, world_size=2, backend="gloo", timeout=1.5)


def test_rank_1_skips(distributed_env):
    distributed_env.run(skip_on_rank_1, world_size=2, backend="gloo")


def test_body_fails_on_rank_1(distributed_env):
    distributed_env.run(all_reduce, world_size=2, backend="gloo")
    assert RANK != 1, "the body of rank 1 disagrees"


@pytest.mark.timeout(2)
def test_body_hangs_on_rank_1(distributed_env):
    distributed_env.run(all_reduce, world_size=2, backend="gloo")
    if RANK == 1:
        time.sleep(3600)


def test_other_world_size(distributed_env):
    distributed_env.run(all_reduce, world_size=1, backend="gloo")


@pytest.fixture
def unusable_on_rank_1():
    if RANK == 1:
        pytest.skip("rank 1 lacks something at setup")


def test_setup_skips_on_rank_1(unusable_on_rank_1, distributed_env):
    distributed_env.run(all_reduce, world_size=2, backend="gloo")


def test_agree_on_rank_0_only():
    with open("ran-on", "a") as f:
        f.write(f"{RANK}\\n")


def test_a_pytest_started_by_a_rank_is_plain(pytester):
    pytester.makepyfile("def test_inner(distributed_env): pass")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
'''

# Each rank writes the status it exits with (after the plugin's exchange: this conftest's hook runs last).
CONFTEST = '''
import os
import pytest

pytest_plugins = ["pytester"]

@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
    with open(f"exit-status-{os.environ['RANK']}", "w") as f:
        f.write(str(int(session.exitstatus)))
'''


def torchrun_pytest(path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items()  # (this test process may itself run under a launcher)
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "PYTEST_ADDOPTS",
                        launcher.RANK_OF_ENV)}
    env["OMP_NUM_THREADS"] = "1"
    started = time.monotonic()
    result = subprocess.run(
        # (--log-dir: torchrun's own, a torchelastic_* dir in $TMPDIR by default, which it leaves behind)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "--log-dir", str(path / "torchrun-logs"), "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-rs", "--junitxml=report.xml", *args],
        cwd=path, env=env, capture_output=True, text=True, timeout=150,
    )
    return result, time.monotonic() - started


def junit_outcomes(path) -> dict[str, tuple[str, str]]:
    """test name -> (passed / failure / error / skipped, its message: a skip's reason, a failure's report)."""
    outcomes = {}
    for case in ET.parse(path / "report.xml").getroot().iter("testcase"):
        kinds = [(child.tag, child.text if child.tag == "failure" else child.get("message", "")) for child in case
                 if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = kinds[0] if kinds else ("passed", "")
    return outcomes


def statuses(path) -> list[str]:
    return [(path / f"exit-status-{rank}").read_text() for rank in (0, 1)]


def test_two_ranks_under_torchrun_agree_on_every_outcome(tmp_path):
    (tmp_path / "test_scenarios.py").write_text(SCENARIOS)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    result, took = torchrun_pytest(tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert took < 90, f"the hung rank held the job for {took:.0f} s"
    assert statuses(tmp_path) == ["1", "1"]  # the failures are every rank's
    outcomes = junit_outcomes(tmp_path)
    assert outcomes["test_agree"] == ("passed", ""), output

    kind, text = outcomes["test_rank_1_raises"]
    assert kind == "failure"
    assert "2 of 2 ranks failed (gloo, deadline 20 s); first: rank 1 raised ValueError: rank 1 refuses" in text, text
    assert "in refuse_on_rank_1" in text and 'raise ValueError("rank 1 refuses")' in text, text

    kind, text = outcomes["test_rank_0_hangs"]
    assert kind == "failure"
    assert "2 of 2 ranks failed (gloo, deadline 1.5 s); first: rank 0 was still running at the deadline" in text, text
    assert "thread stacks of rank 0 at the deadline" in text and "in wait_forever_on_rank_0" in text, text
    assert "in barrier" in text, text  # rank 1, waiting for rank 0

    assert outcomes["test_rank_1_skips"] == ("skipped", "rank 1 has no use for it (on rank 1)")

    kind, text = outcomes["test_body_fails_on_rank_1"]
    assert kind == "failure"
    assert "rank 1 failed this test (a failure on one rank fails it on every rank)" in text, text
    assert "AssertionError: the body of rank 1 disagrees" in text, text

    kind, text = outcomes["test_body_hangs_on_rank_1"]  # rank 1's deadline ends it; rank 0 waited for its report
    assert kind == "failure"
    assert "rank 1 failed this test" in text and "time.sleep(3600)" in text and "Timeout (>2.0s)" in text, text

    kind, text = outcomes["test_other_world_size"]
    assert kind == "skipped"
    assert "asks for world_size=1, but torchrun started 2 (RANK/WORLD_SIZE=0/2)" in text, text
    assert outcomes["test_setup_skips_on_rank_1"] == ("skipped", "rank 1 lacks something at setup (on rank 1)")

    assert outcomes["test_agree_on_rank_0_only"] == ("passed", "")
    assert outcomes["test_a_pytest_started_by_a_rank_is_plain"] == ("passed", ""), output
    assert (tmp_path / "ran-on").read_text() == "0\n"
    # One report, rank 0's.
    assert result.stdout.count("test session starts") == 1
    assert "llmload: rank 0 of 2 under torchrun" in result.stdout and "rank 1 of 2" not in result.stdout
    assert result.stdout.count("short test summary info") == 1


def test_a_passing_run_ends_every_rank_with_status_0(tmp_path):
    (tmp_path / "test_scenarios.py").write_text(SCENARIOS)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    result, _ = torchrun_pytest(tmp_path, "-k", "agree")
    assert result.returncode == 0, result.stdout + result.stderr
    assert statuses(tmp_path) == ["0", "0"]
    assert junit_outcomes(tmp_path) == {"test_agree": ("passed", ""), "test_agree_on_rank_0_only": ("passed", "")}


# --- detection, from the environment alone -------------------------------------------------------------------

MASTER = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(("environ", "expected"), [
    ({**MASTER, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "TORCHELASTIC_USE_AGENT_STORE": "True"},
     Launch("torchrun", 3, 4, 1, "node0", 29500, agent_store=True)),
    ({**MASTER, "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"},
     Launch("srun", 5, 8, 1, "node0", 29500, agent_store=False)),
    ({**MASTER, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1"},
     Launch("mpirun", 1, 2, 1, "node0", 29500, agent_store=False)),
    ({**MASTER, "RANK": "0", "WORLD_SIZE": "1"}, Launch("torchrun", 0, 1, 0, "node0", 29500, agent_store=False)),
], ids=["torchrun", "srun", "mpirun", "one-rank"])
def test_a_launchers_variables_place_this_process_in_its_job(environ, expected):
    assert detect(environ) == expected


@pytest.mark.parametrize("environ", [
    {},
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},  # no MASTER_ADDR/MASTER_PORT: nothing to meet at
    {**MASTER, "SLURM_PROCID": "0", "SLURM_NTASKS": "4"},  # an sbatch script itself, not one of srun's tasks
    {**MASTER, "RANK": "1", "WORLD_SIZE": "2", launcher.RANK_OF_ENV: "torchrun rank 1 of 2, pid 7"},  # pytester
], ids=["plain", "no-master", "sbatch-script", "started-by-a-rank"])
def test_without_a_launcher_a_run_is_plain(environ):
    assert detect(environ) is None


@pytest.mark.parametrize(("environ", "message"), [
    ({**MASTER, "RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' in the environment is not an integer >= 0"),
    ({**MASTER, "RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
])
def test_unusable_launcher_variables_are_named(environ, message):
    with pytest.raises(LauncherError, match=message):
        detect(environ)


@pytest.mark.parametrize(("env", "args", "message"), [
    ({"RANK": "x"}, (), "ERROR: RANK='x' in the environment is not an integer >= 0*"),
    ({}, ("-n", "2"), "ERROR: pytest -n 2 under torchrun: each of its 2 ranks would start its own xdist workers*"),
], ids=["bad-rank", "xdist"])
def test_misuse_under_a_launcher_is_a_usage_error(pytester, monkeypatch, env, args, message):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", **MASTER, **env}.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile("def test_nothing(): pass\n")
    result = warm_runs.runpytest(pytester, *args)  # its own process, forked from this one (fixtures/warm_runs.py)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


# --- agreement -----------------------------------------------------------------------------------------------


def test_every_rank_must_collect_the_same_tests_in_the_same_order():
    check_same_tests({0: ["a", "b"], 1: ["a", "b"]})
    with pytest.raises(pytest.UsageError, match=r"rank 1 collected 2 tests that use distributed_env, rank 0 2; at "
                                                r"position 1 rank 0 has a, rank 1 b\. The ranks meet"):
        check_same_tests({0: ["a", "b"], 1: ["b", "a"]})
    with pytest.raises(pytest.UsageError, match="at position 3 rank 0 has no more, rank 1 c"):
        check_same_tests({0: ["a", "b"], 1: ["a", "b", "c"]})


PASSED, SKIPPED = {"outcome": "passed"}, {"outcome": "skipped", "reason": "no GPU"}
FAILED = {"outcome": "failed", "text": "E   AssertionError: rank 1"}


def test_a_failure_wins_over_a_skip_and_a_skip_over_a_pass():
    agree({0: PASSED, 1: PASSED}, 0, None, "this test")
    with pytest.raises(pytest.fail.Exception, match="(?s)rank 1 failed this test .*AssertionError: rank 1"):
        agree({0: SKIPPED, 1: FAILED}, 0, pytest.skip.Exception("no GPU"), "this test")
    with pytest.raises(pytest.skip.Exception, match=r"no GPU \(on rank 1\)"):
        agree({0: PASSED, 1: SKIPPED}, 0, None, "this test")
    own = AssertionError("rank 0's own")
    with pytest.raises(AssertionError, match="rank 0's own") as excinfo:  # its own report, the other's as a note
        agree({0: {**FAILED, "text": "rank 0's"}, 1: FAILED}, 0, own, "this test")
    assert excinfo.value is own and "rank 1 failed this test too" in excinfo.value.__notes__[0]


SRUN_TEST = '''
def all_reduce():
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), t.item()


def test_agree(distributed_env):
    assert distributed_env.run(all_reduce, world_size=2, backend="gloo") == [(0, 3.0), (1, 3.0)]
'''


def test_two_ranks_under_srun_meet_at_a_store_rank_0_hosts_on_master_addr_only(tmp_path):
    """srun's ranks (its variables, set here by hand as srun sets them): rank 0 hosts the meeting store on
    MASTER_ADDR's address only, shared with the env:// groups it makes (multi-tenant), and with a run secret the
    ranks' keys live under it (issue 36)."""
    import socket

    (tmp_path / "test_srun.py").write_text(SRUN_TEST)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTEST_ADDOPTS",
                                                           launcher.RANK_OF_ENV)}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SLURM_STEP_NUM_TASKS="2", SLURM_NTASKS="2",
               OMP_NUM_THREADS="1", PYTEST_LLMLOAD_RUN_SECRET="a secret of this job")
    ranks = [subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_srun.py"],
                              cwd=tmp_path, env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    assert "1 passed" in outputs[0], outputs[0]
