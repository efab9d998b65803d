"""The count of visible GPUs (pytest_llmload.system.gpus): it follows the environment it reads, and probes once per
environment.

GPUs are faked through the test seam (``PYTEST_LLMLOAD_FAKE_GPUS``): no torch, no driver needed. Each test fakes its
own UUIDs, so that no count cached by another test answers for it.
"""

import pytest

from pytest_llmload.system import gpus


@pytest.fixture
def probes(monkeypatch):
    """The probes of the machine's GPUs made from now on (each one is a ``nvidia-smi -L`` where GPUs are real)."""
    made = []
    real = gpus.physical_devices

    def counted():
        made.append(1)
        return real()

    monkeypatch.setattr(gpus, "physical_devices", counted)
    return made


def test_a_changed_environment_is_counted_again(monkeypatch, probes):
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, "GPU-changed-a,GPU-changed-b,GPU-changed-c")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus.visible_gpu_count() == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpus.visible_gpu_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # hides every GPU
    assert gpus.visible_gpu_count() == 0
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, "GPU-changed-a")  # another machine, as the seam says
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpus.visible_gpu_count() == 1
    assert gpus.skip_reason(2) == "needs 2 GPUs, 1 visible (CUDA_VISIBLE_DEVICES unset)"
    assert len(probes) == 4


def test_an_unchanged_environment_is_not_probed_again(monkeypatch, probes):
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, "GPU-same-a,GPU-same-b")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert [gpus.visible_gpu_count() for _ in range(3)] == [2, 2, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpus.visible_gpu_count() == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # back to what was counted first: its count stands
    assert gpus.visible_gpu_count() == 2
    assert len(probes) == 2
