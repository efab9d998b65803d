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


# --- GPUs shared by several xdist workers (pytest -m gpu -n 4 --llmload-gpus-per-worker off on one GPU) ----------


@pytest.fixture
def sharing_worker(monkeypatch, tmp_path):
    """This process as xdist's worker gw0 of 4, every worker seeing the one (faked) GPU; the locks under tmp_path."""
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, "GPU-0a1b")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv(gpus.WORKER_GPUS_ENV, raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "4")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # (read $TMPDIR again)


def _waits_for(hold, **how) -> bool:
    """Whether entering ``hold(**how)`` in another thread (another holder: flock's locks are per open file) waits."""
    import threading

    entered = threading.Event()

    def enter():
        with hold(**how):
            entered.set()

    thread = threading.Thread(target=enter, daemon=True)
    thread.start()
    waited = not entered.wait(0.5)
    return waited, thread


def test_a_test_that_may_fill_a_shared_gpu_holds_it_alone(sharing_worker):
    assert gpus.shares_gpus_with_other_workers()
    assert gpus.lock_names() == ["GPU-0a1b"]
    with gpus.held_by_test(True, alone=True):
        waited, thread = _waits_for(gpus.held_by_test, uses_gpu=True, alone=False)
        assert waited  # another GPU test waits while it runs
    thread.join(5)
    assert not thread.is_alive()  # and runs once it is done
    with gpus.held_by_test(True, alone=False):
        assert not _waits_for(gpus.held_by_test, uses_gpu=True, alone=False)[0]  # ordinary GPU tests run side by side
        assert _waits_for(gpus.held_by_test, uses_gpu=True, alone=True)[0]


@pytest.mark.parametrize("environment", [{gpus.WORKER_GPUS_ENV: "GPU-0a1b"}, {"PYTEST_XDIST_WORKER_COUNT": "1"}],
                         ids=["the worker holds its own GPUs", "one worker"])
def test_where_no_other_worker_shares_the_gpus_nothing_is_held(sharing_worker, monkeypatch, environment):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert not gpus.shares_gpus_with_other_workers()
    with gpus.held(["GPU-0a1b"], alone=True):
        assert not _waits_for(gpus.held_by_test, uses_gpu=True, alone=True)[0]


def test_an_index_and_its_uuid_name_one_lock(sharing_worker, monkeypatch):
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, "GPU-0a1b,GPU-2c3d")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-0a")
    assert gpus.lock_names() == ["GPU-0a1b", "GPU-2c3d"]
