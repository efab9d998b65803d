"""The ``distributed_env`` fixture and its runner (:mod:`pytest_llmload.runners.ranks`): real ranks, what each
rank sees, and what a test reports when a rank raises, hangs or dies; nothing is left behind."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import time

import pytest

from fixtures.processes import gone
from pytest_llmload.runners import ranks as distributed
from pytest_llmload.runners import children
from pytest_llmload.runners.ranks import DistributedRunFailed, run_ranks

pytestmark = pytest.mark.timeout(60)


def rank_view() -> dict:
    """What a rank sees of its launcher and process group."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    launcher = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_BYPASS_DEVICE_MAP")
    return {"rank": dist.get_rank(), "world_size": dist.get_world_size(), "backend": dist.get_backend(),
            "sum": total.item(), "env": {name: os.environ.get(name) for name in launcher}, "pid": os.getpid(),
            "threads": torch.get_num_threads()}


def _refused(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def test_two_ranks_see_a_launchers_environment_and_nothing_of_the_test_process(distributed_env, monkeypatch):
    # The shell that started pytest may itself be a rank of some job; its variables must not reach the ranks.
    for name, value in {"WORLD_SIZE": "16", "RANK": "7", "LOCAL_RANK": "3", "MASTER_PORT": "1",
                        "ACCELERATE_BYPASS_DEVICE_MAP": "true"}.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    views = distributed_env.run(rank_view, world_size=2)
    assert os.environ == before
    port = views[0]["env"]["MASTER_PORT"]
    assert port != "1" and views[1]["env"]["MASTER_PORT"] == port
    for rank, view in enumerate(views):
        assert view["rank"] == rank and view["world_size"] == 2 and view["sum"] == 3.0
        assert view["backend"] == distributed_env.default_backend()
        assert view["env"] == {"WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "ACCELERATE_BYPASS_DEVICE_MAP": None}
    # Nothing outlives the run: the ranks are reaped and the rendezvous port is closed.
    assert all(gone(view["pid"]) for view in views)
    assert multiprocessing.active_children() == []
    assert _refused(int(port))


def log_in_teardown() -> int:
    """A rank whose process-group teardown logs, a little after the rank has answered."""
    import torch.distributed as dist

    original = dist.destroy_process_group

    def logged_teardown(*args, **kwargs):
        time.sleep(0.2)
        logging.getLogger("ranks").warning("rank %d tearing down", dist.get_rank())
        return original(*args, **kwargs)

    dist.destroy_process_group = logged_teardown
    return dist.get_rank()


def test_what_the_ranks_log_reaches_the_test_also_after_they_answered(distributed_env, caplog):
    assert distributed_env.run(log_in_teardown, world_size=2, backend="gloo", timeout=30) == [0, 1]
    messages = sorted(r.getMessage() for r in caplog.records if r.name == "ranks")
    assert messages == ["rank 0 tearing down", "rank 1 tearing down"]


def test_default_backend_is_gloo_without_a_gpu(distributed_env, monkeypatch):
    monkeypatch.setattr(distributed_env, "_gpu_count", lambda: 0)
    assert distributed_env.default_backend() == "gloo"
    monkeypatch.setattr(distributed_env, "_gpu_count", lambda: 1)
    assert distributed_env.default_backend() == "nccl"


def accelerate_view() -> tuple[str, int]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    return str(accelerator.distributed_type), accelerator.num_processes


def test_accelerate_state_of_the_test_process_is_not_inherited(distributed_env, monkeypatch):
    # accelerate keeps its state in class-level singletons; a forked rank would inherit DistributedType.NO
    # from a test process that ever made an Accelerator, and write-up 004's error would not happen.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    try:
        assert str(Accelerator(cpu=True).distributed_type) == "DistributedType.NO"
        assert distributed_env.run(accelerate_view, world_size=2, backend="gloo") == [
            ("DistributedType.MULTI_CPU", 2)] * 2
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def matmul_on_rank() -> float:
    import torch

    x = torch.ones(256, 256)
    return float((x @ x).sum())


def test_openmp_used_before_the_fork_does_not_hang_the_ranks(distributed_env):
    # GNU OpenMP is not fork-safe: after a parallel region in the parent, a forked child's first parallel
    # region with 2+ threads never returns. The ranks run with one thread each.
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.ones(256, 256)
        (x @ x).sum()
    finally:
        torch.set_num_threads(threads)
    assert distributed_env.run(matmul_on_rank, world_size=2, backend="gloo", timeout=20) == [256.0**3] * 2


def exit_on_rank_1(how: str):
    import torch.distributed as dist

    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return "rank 0 got past the barrier"


@pytest.mark.parametrize(("how", "described"), [
    ("exit", "rank 1 died: exit code 3, before it returned a result"),
    ("kill", "rank 1 died: killed by SIGKILL (exit code -9)"),
])
def test_a_dying_rank_reports_its_exit_code_and_leaves_nothing_behind(tmp_path, how, described):
    started = time.monotonic()
    with pytest.raises(DistributedRunFailed) as excinfo:
        run_ranks(exit_on_rank_1, 2, args=(how,), timeout=30, tmp_root=tmp_path)
    assert time.monotonic() - started < 10
    message = str(excinfo.value)
    assert message.startswith(f"2 of 2 ranks failed (gloo, deadline 30 s); first: {described}\n")
    outcomes = excinfo.value.outcomes
    assert [o.status for o in outcomes] == ["raised", "died"]
    assert distributed.lost_a_peer(outcomes[0])  # rank 0 learnt of it in the barrier, and is listed after the cause
    assert message.index(described) < message.index("----- rank 0 raised")
    assert all(gone(o.pid) for o in outcomes)
    assert list(tmp_path.iterdir()) == []


def segfault():
    import ctypes

    ctypes.string_at(0)


def test_a_segfault_reports_the_signal_and_the_ranks_stack(tmp_path):
    with pytest.raises(DistributedRunFailed) as excinfo:
        run_ranks(segfault, 1, timeout=30, tmp_root=tmp_path)
    message = str(excinfo.value)
    assert "rank 0 died: killed by SIGSEGV (exit code -11)" in message
    assert "Fatal Python error: Segmentation fault" in message and "in segfault" in message
    assert list(tmp_path.iterdir()) == []


def sleep_on_rank_0(pid_dir: str):
    import torch.distributed as dist

    with open(os.path.join(pid_dir, f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.barrier()


def test_a_hanging_rank_is_killed_at_its_deadline_with_every_ranks_stack(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    runs = tmp_path / "runs"
    runs.mkdir()
    started = time.monotonic()
    with pytest.raises(DistributedRunFailed) as excinfo:
        run_ranks(sleep_on_rank_0, 2, args=(os.fspath(pid_dir),), timeout=2, tmp_root=runs)
    assert time.monotonic() - started < 2 + 4  # deadline + stack collection + reaping
    outcomes = excinfo.value.outcomes
    assert [o.status for o in outcomes] == ["hung", "hung"]
    assert "in sleep_on_rank_0" in outcomes[0].stacks and "time.sleep" not in outcomes[0].stacks
    assert "in barrier" in outcomes[1].stacks
    assert "in _bootstrap" not in outcomes[0].stacks  # the frames inherited from the test process are cut
    assert all(gone(int((pid_dir / f"rank{r}.pid").read_text())) for r in (0, 1))
    assert list(runs.iterdir()) == []


def test_a_ranks_result_says_what_it_is_by_its_kind():
    """What a check's rank function returns (ok / skip with reason / refusal / error): read by kind, not dict keys."""
    from pytest_llmload.runners.ranks import RankResult

    assert RankResult.ok(loss=1.5) == RankResult("ok", data={"loss": 1.5})
    assert RankResult.skip("a frozen base") == RankResult("skip", "a frozen base")
    refused = RankResult.refusal("too large", device_map="auto")
    assert (refused.kind, refused.reason, refused.data) == ("refusal", "too large", {"device_map": "auto"})
    assert RankResult.error("prepare() raised").with_data(planned=None).data == {"planned": None}
    with pytest.raises(ValueError, match=r"RankResult\(kind='maybe'\); expected one of \('ok', 'skip', 'refusal', "
                                         r"'error'\)"):
        RankResult("maybe")


def unpicklable_result():
    return lambda: None


def test_an_unpicklable_result_is_a_rank_error():
    with pytest.raises(DistributedRunFailed, match="rank 0 raised TypeError: rank 0 returned a function that "
                                                   "cannot be pickled"):
        run_ranks(unpicklable_result, 1, timeout=30)


def test_misuse_is_refused_with_the_value():
    with pytest.raises(ValueError, match="world_size=0; expected a positive int"):
        run_ranks(rank_view, 0)
    with pytest.raises(ValueError, match="start_method='thread'"):
        distributed.start_method("gloo", "thread")


def test_gpu_ranks_and_a_cuda_parent_never_fork(monkeypatch):
    assert distributed.start_method("gloo") == "fork"
    assert distributed.start_method("nccl") == "forkserver"
    monkeypatch.setattr(children, "cuda_initialised", lambda: True)
    assert distributed.start_method("gloo") == "forkserver"
    with pytest.raises(RuntimeError, match="this process has initialised CUDA"):
        distributed.start_method("gloo", "fork")


def test_forkserver_ranks_work_too():
    # The start method of GPU ranks, exercised here with gloo: the function and results go by pickle.
    views = run_ranks(rank_view, 2, start="forkserver", timeout=60)
    assert [v["sum"] for v in views] == [3.0, 3.0]


def what_the_rank_sees() -> tuple:
    from deepspeed.accelerator import get_accelerator

    return os.environ.get("CUDA_VISIBLE_DEVICES"), get_accelerator().device_name(), os.getppid()


def test_ranks_simulating_a_runner_without_gpus_see_none_on_a_machine_with_gpus(monkeypatch):
    # On the H200 the main job's gloo ranks (2 simulated GPUs) saw its one GPU and DeepSpeed's cuda accelerator,
    # imported by the test process: they start from a server that shows no GPU and runs DeepSpeed on the cpu.
    from pytest_llmload.system import gpus
    from pytest_llmload.system.gpus import FAKE_GPUS_ENV
    from pytest_llmload.runners import warm_server

    pytest.importorskip("deepspeed")
    distributed.preload(distributed.DEEPSPEED_PRELOAD)
    # (no GPU here: the ranks see the variable as this process has it, unset or empty as on a GPU runner's CPU job)
    assert {v[0] for v in run_ranks(what_the_rank_sees, 2, gpus_hidden=True, timeout=60)} == {
        os.environ.get("CUDA_VISIBLE_DEVICES")}
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 1)  # (what counts them; their ids are faked for torch)
    monkeypatch.setenv(FAKE_GPUS_ENV, "GPU-1")
    views = run_ranks(what_the_rank_sees, 2, gpus_hidden=True, timeout=90)
    assert views == [("", "cpu", warm_server.forkserver_pid())] * 2
    with pytest.raises(ValueError, match="only gloo ranks can run without GPUs"):
        run_ranks(what_the_rank_sees, 1, backend="nccl", gpus_hidden=True)


def shm_op_and_group() -> tuple:
    import sys

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return sys.modules["deepspeed.comm.torch"].build_shm_op(), deepspeed.comm.get_world_size()


@pytest.mark.skipif(os.environ.get("DS_ACCELERATOR") != "cpu", reason="DeepSpeed's CPU accelerator only")
def test_deepspeed_ranks_start_without_building_the_shm_op(tmp_path, monkeypatch):
    # The op's JIT build (40-75 s here, under a lock file a killed rank left behind) is never started: DeepSpeed
    # runs its collectives through torch.distributed, as it does wherever it cannot build the op.
    pytest.importorskip("deepspeed")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    distributed.preload(distributed.DEEPSPEED_PRELOAD)
    assert run_ranks(shm_op_and_group, 2, timeout=60) == [(None, 2)] * 2
    assert not (tmp_path / "ext").exists()


# Ctrl-C during a run (ranks killed, temp dir removed): tests/runners/test_isolation.py, with the isolated runner that
# starts the ranks.


# --- through pytest, as a user meets it ----------------------------------------------------------------------

FAILING_RANKS = '''
import os, time
import pytest

def refuse_on_rank_1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()

def wait_forever():
    import torch.distributed as dist
    if dist.get_rank() == 0:
        time.sleep(3600)
    dist.barrier()

def test_raises(distributed_env):
    distributed_env.run(refuse_on_rank_1, world_size=2, backend="gloo")

def test_hangs(distributed_env):
    distributed_env.run(wait_forever, world_size=2, backend="gloo", timeout=2)

def test_too_many_gpu_ranks(distributed_env):
    distributed_env.run(wait_forever, world_size=2, backend="nccl")
'''


@pytest.fixture
def failing_ranks(pytester, monkeypatch):
    from pytest_llmload.system import gpus

    # In-process pytester: the inner run sees this machine as one without GPUs, whatever it has.
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile(test_failing_ranks=FAILING_RANKS)
    return pytester


def test_a_raising_rank_fails_the_test_with_its_traceback(failing_ranks):
    result = failing_ranks.runpytest("-k", "test_raises")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "E*2 of 2 ranks failed (gloo, deadline 60 s); first: rank 1 raised ValueError: rank 1 refuses",
        "E*----- rank 1 raised ValueError: rank 1 refuses",
        "E*Traceback (most recent call last):",
        "E*in refuse_on_rank_1",
        'E*raise ValueError("rank 1 refuses")',
        # gloo says "closed" or "reset", depending on timing: both are the lost peer (distributed._PEER_LOSS)
        "E*----- rank 0 raised RuntimeError: *Connection * by peer*",
    ])


def test_a_hanging_rank_fails_the_test_within_its_deadline_with_the_stacks(failing_ranks):
    started = time.monotonic()
    result = failing_ranks.runpytest("-k", "test_hangs")
    assert time.monotonic() - started < 15
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "E*2 of 2 ranks failed (gloo, deadline 2 s); first: rank 0 was still running at the deadline",
        "E*thread stacks of rank 0 at the deadline (most recent call first):",
        "E*in wait_forever",
        "E*----- rank 1 was still running at the deadline",
        "E*thread stacks of rank 1 at the deadline*",
        "E*in barrier",
    ])


def test_more_gpu_ranks_than_gpus_skips_with_the_counts(failing_ranks):
    result = failing_ranks.runpytest("-rs", "-k", "test_too_many_gpu_ranks")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*distributed_env: 2 nccl ranks needs 2 GPUs, 0 visible "
                                 "(CUDA_VISIBLE_DEVICES=)"])


def test_the_fixture_is_documented(pytester):
    result = pytester.runpytest("--fixtures")
    result.stdout.fnmatch_lines(["distributed_env*", "*Run a function on N ranks of a real torch.distributed*"])


# --- GPU ---------------------------------------------------------------------------------------------------


def device_view() -> tuple[str, float]:
    import torch
    import torch.distributed as dist

    total = torch.ones(1, device="cuda") * (dist.get_rank() + 1)
    dist.all_reduce(total)
    return str(total.device), total.item()


@pytest.mark.needs_gpus(1)
def test_nccl_world_size_one(distributed_env):
    assert distributed_env.run(device_view, world_size=1, backend="nccl") == [("cuda:0", 1.0)]


@pytest.mark.needs_gpus(2)
def test_nccl_two_ranks_each_on_its_own_gpu(distributed_env):
    assert distributed_env.run(device_view, world_size=2, backend="nccl") == [("cuda:0", 3.0), ("cuda:1", 3.0)]
