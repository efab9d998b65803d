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


def test_the_cold_switch_restarts_the_server_with_torch_alone(monkeypatch):
    monkeypatch.setenv(warm_server.COLD_ENV, "1")
    found = isolation.run_isolated(what_the_child_finds, start="forkserver", timeout=200)
    assert found["deepspeed engine"] is False and found["transformers"] is False


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
