"""The warm forkserver (pytest_llmload.runners.warm_server): the children a GPU runner must start from a forkserver
find the stack imported, from a server that never initialised CUDA; the cold switch and a restart for another
DeepSpeed accelerator. (Its speed: benchmarks/bench_forkserver.py.)"""

import os
import sys

import pytest

from pytest_llmload.runners import isolation, warm_server

pytestmark = pytest.mark.timeout(240)


def what_the_child_finds():
    torch = sys.modules["torch"]
    return {"deepspeed engine": "deepspeed.runtime.engine" in sys.modules,
            "transformers": "transformers.modeling_utils" in sys.modules,
            "cuda initialised": torch.cuda.is_initialized(),
            "nvml check": os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"),
            "ds accelerator": os.environ.get("DS_ACCELERATOR")}


def test_a_forkserver_child_finds_the_stack_imported_and_no_cuda_initialised(monkeypatch):
    monkeypatch.delenv(warm_server.COLD_ENV, raising=False)  # (the suite's conftest runs cold: see there)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)  # (DeepSpeed's import sets it here too)
    found = isolation.run_isolated(what_the_child_finds, start="forkserver", timeout=200)
    assert found == {"deepspeed engine": True, "transformers": True, "cuda initialised": False, "nvml check": "1",
                     "ds accelerator": os.environ.get("DS_ACCELERATOR")}
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ  # the server's only, not this process's


# Each server costs a new interpreter importing torch (~2.5 s of CPU), and a server is only restarted for other
# settings: the tests below run in an order where the cold server of one serves the next (cold switch, fork, another
# accelerator), so that this module starts 4 servers, not 5.
def test_the_cold_switch_restarts_the_server_with_torch_alone(monkeypatch):
    monkeypatch.setenv(warm_server.COLD_ENV, "1")
    found = isolation.run_isolated(what_the_child_finds, start="forkserver", timeout=200)
    assert found["deepspeed engine"] is False and found["transformers"] is False


def what_a_fork_finds() -> tuple:
    before = warm_server.forkserver_pid()
    # the same settings: its parent's server serves it, its child included
    served_by = isolation.run_isolated(os.getppid, start="forkserver", timeout=100)
    warm_server.ensure(accelerator="cpu", gpus_hidden=True)  # other settings: its own, its parent's left running
    return before, served_by, warm_server.forkserver_pid()


def test_a_fork_uses_the_server_its_parent_started_and_leaves_it_running(monkeypatch):
    # An isolated test's child forked after the GPU-less server started must use it, not start another
    # (multiprocessing's own check of a server is waitpid, which a fork cannot call on its parent's child).
    monkeypatch.setenv(warm_server.COLD_ENV, "1")  # (cheap: which server serves is tested, not the stack)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    warm_server.ensure(accelerator="cpu")
    parents = warm_server.forkserver_pid()
    before, served_by, own = isolation.run_isolated(what_a_fork_finds, timeout=150)
    assert before == served_by == parents
    assert own not in (None, parents)
    assert warm_server.forkserver_pid() == parents  # still running for this process


def test_another_accelerator_restarts_the_server_with_it(monkeypatch):
    monkeypatch.setenv(warm_server.COLD_ENV, "1")  # (cheap: the restart is what is tested, not the stack)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    warm_server.ensure(accelerator="cpu")
    first = warm_server.forkserver_pid()
    warm_server.ensure(accelerator="cpu")
    assert warm_server.forkserver_pid() == first  # the same request: the same server
    monkeypatch.setenv("DS_ACCELERATOR", "mps")  # (only read by DeepSpeed, not imported cold)
    warm_server.ensure(accelerator=None)
    assert warm_server.forkserver_pid() not in (None, first)


def test_the_gpu_less_server_starts_early_only_where_a_gpu_is_visible_and_a_check_starts_ranks(monkeypatch):
    # Issue 40: on the H200 the main job waited about 20 s inside its distributed check for this server's imports.
    from pytest_llmload.checks.base import Check
    from pytest_llmload.failures.offload_hang import FAILURE

    started = []
    monkeypatch.setattr(warm_server, "ensure", lambda **settings: started.append(settings))
    ranks, gpu_ranks, plain = (Check(print, FAILURE, world_size=2), Check(print, FAILURE, world_size=1, needs_gpus=1),
                               Check(print, FAILURE))
    assert not warm_server.start_early([ranks, plain], gpus_visible=0)  # no GPU: ranks fork from the test process
    assert not warm_server.start_early([plain, gpu_ranks], gpus_visible=1)  # nothing starts gloo ranks
    assert warm_server.start_early([plain, ranks], gpus_visible=1)
    assert started == [{"accelerator": "cpu", "gpus_hidden": True}]


RANKS_AND_PLAIN = """
import pytest
from pytest_llmload.checks.base import Check
from pytest_llmload.failures.offload_hang import FAILURE

@pytest.mark.parametrize("check", [Check(print, FAILURE, world_size=2), Check(print, FAILURE)])
def test_carries(check):
    pass
"""


def test_the_plugin_starts_it_once_the_checks_are_collected_where_one_starts_ranks(pytester, monkeypatch):
    # The lanes' until they went (issue 47): one process runs the checks, and the server still imports meanwhile.
    from pytest_llmload.system import gpus

    started = []
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: 1)
    monkeypatch.setattr(warm_server, "start_early", lambda checks, gpus_visible: started.append(len(checks)))
    pytester.makepyfile(RANKS_AND_PLAIN)
    assert pytester.runpytest("-p", "no:randomly", "--llmload-wait-after-hang", "--collect-only").ret == 0
    assert started == []  # nothing runs
    pytester.runpytest("-p", "no:randomly", "--llmload-wait-after-hang").assert_outcomes(passed=2)
    assert started == [1]


def test_the_gpu_less_server_imports_what_the_ranks_imported_each(monkeypatch):
    from multiprocessing import forkserver

    asked = []
    monkeypatch.delenv(warm_server.COLD_ENV, raising=False)
    monkeypatch.setattr(warm_server, "_started", None)
    monkeypatch.setattr(forkserver._forkserver, "set_forkserver_preload", asked.append)
    monkeypatch.setattr(forkserver._forkserver, "ensure_running", lambda: None)
    monkeypatch.setattr(forkserver._forkserver, "_forkserver_pid", None)
    warm_server.ensure(accelerator="cpu", gpus_hidden=True)
    warm_server.ensure(accelerator="cuda")
    hidden, gpu = asked
    assert {"peft", "transformers.models.llama.modeling_llama"} <= set(hidden) - set(gpu)
    assert "peft" not in gpu  # (a server that sees a GPU must not: bitsandbytes initialises CUDA at import)
