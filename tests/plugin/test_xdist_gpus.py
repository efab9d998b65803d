"""A GPU per xdist worker (:mod:`pytest_llmload.plugin.xdist_gpus`): the plain functions (the visible list as
CUDA reads it, the plan, ``-n auto``), then real ``pytest -n N`` runs on CPU with the GPUs faked through the
test seam ``PYTEST_LLMLOAD_FAKE_GPUS``: what each worker sees, from its first conftest import on."""

from __future__ import annotations

import json

import pytest

from fixtures import warm_runs
from pytest_llmload.system import gpus
from pytest_llmload.system.gpus import Physical, visible_devices
from pytest_llmload.plugin import xdist_gpus
from pytest_llmload.plugin.xdist_gpus import PlanError, plan

pytestmark = pytest.mark.timeout(180)

NVIDIA_SMI_L = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5f3e1c2a-0000-1111-2222-333344445555)
GPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-9a8b7c6d-0000-1111-2222-333344445555)
  MIG 3g.20gb     Device  0: (UUID: MIG-1b2c3d4e-0000-1111-2222-333344445555)
  MIG 3g.20gb     Device  1: (UUID: MIG-6f7a8b9c-0000-1111-2222-333344445555)
"""


def test_nvidia_smi_listing_counts_gpus_and_keeps_every_uuid():
    physical = gpus.parse_nvidia_smi(NVIDIA_SMI_L)
    assert physical.count == 2
    assert [uuid[:12] for uuid in physical.uuids] == ["GPU-5f3e1c2a", "GPU-9a8b7c6d", "MIG-1b2c3d4e", "MIG-6f7a8b9c"]


@pytest.mark.parametrize(("outer", "expected"), [
    (None, ["0", "1", "2", "3"]),  # unset: every GPU
    ("", []), ("-1", []),  # hides every GPU
    ("3,1", ["3", "1"]),  # the runner's order, as written
    (" 2 , 0", ["2", "0"]),
    ("0,7,1", ["0"]),  # CUDA stops at the first index past the last GPU
    ("1,-1,2", ["1"]),
    ("1,1,2", ["1"]),  # a repeat is invalid too
    ("GPU-c,GPU-a", ["GPU-c", "GPU-a"]),
    ("GPU-c,GPU-zz,GPU-a", ["GPU-c"]),  # an unknown UUID stops it
    ("GPU-c,0", ["GPU-c", "0"]),
])
def test_visible_list_is_read_as_cuda_reads_it(outer, expected):
    assert visible_devices(outer, Physical(4, ("GPU-a", "GPU-b", "GPU-c", "GPU-d"))) == expected


def test_uuid_prefixes_and_mig_devices_name_devices():
    physical = gpus.parse_nvidia_smi(NVIDIA_SMI_L)
    assert visible_devices("MIG-6f7a,MIG-1b2c3d4e,GPU-5f3e", physical) == ["MIG-6f7a", "MIG-1b2c3d4e", "GPU-5f3e"]


def test_without_nvidia_smi_indices_are_trusted_and_only_the_count_bounds_them():
    assert visible_devices("5,GPU-x", Physical(None)) == ["5", "GPU-x"]
    assert visible_devices("1,5", Physical(2)) == ["1"]
    assert visible_devices(None, Physical(None)) == []  # count unknown: assign nothing


def test_plan_gives_disjoint_slices_of_the_visible_list():
    devices = ["GPU-h", "GPU-b", "2", "GPU-f", "4", "5", "6", "7"]
    assert plan(4, devices, None, "x").lists == [["GPU-h", "GPU-b"], ["2", "GPU-f"], ["4", "5"], ["6", "7"]]
    assert plan(8, devices, None, "x").lists == [[d] for d in devices]
    assert plan(3, devices, None, "x") == (2, 8, [["GPU-h", "GPU-b"], ["2", "GPU-f"], ["4", "5"]])
    assert plan(2, devices, 3, "x").lists == [["GPU-h", "GPU-b", "2"], ["GPU-f", "4", "5"]]


def test_more_workers_than_gpus_is_an_error_naming_g_n_k_and_what_to_run():
    with pytest.raises(PlanError) as error:
        plan(8, ["0", "1", "2", "3"], None, "CUDA_VISIBLE_DEVICES unset")
    assert str(error.value) == (
        "pytest -n 8 with 1 GPU per xdist worker needs 8 GPUs, but 4 are visible (CUDA_VISIBLE_DEVICES unset): "
        "run -n 4 (or -n auto), or pass --llmload-gpus-per-worker off to let every worker see every GPU, or set "
        "CUDA_VISIBLE_DEVICES= for a run that uses no GPU.")
    with pytest.raises(PlanError, match=r"-n 4 with 2 GPUs per xdist worker needs 8 GPUs, .*: run -n 2 "):
        plan(4, ["0", "1", "2", "3"], 2, "")
    with pytest.raises(PlanError, match=r"run --llmload-gpus-per-worker 2 -n 1, "):
        plan(1, ["0", "1"], 4, "")


def test_auto_caps_xdists_cpu_count_to_the_workers_the_gpus_serve():
    assert xdist_gpus.auto_workers(8, None, cpu_workers=32) == 8
    assert xdist_gpus.auto_workers(8, 2, cpu_workers=32) == 4
    assert xdist_gpus.auto_workers(8, None, cpu_workers=4) == 4
    assert xdist_gpus.auto_workers(1, 2, cpu_workers=4) == 1  # too few: configure then says what to run


@pytest.mark.parametrize("value", ["0", "two", "-1", "1.5"])
def test_a_bad_per_worker_value_is_a_usage_error(value):
    with pytest.raises(pytest.UsageError, match=rf"--llmload-gpus-per-worker={value!r} is neither a positive"):
        _per_worker(value, "--llmload-gpus-per-worker")


def _per_worker(value, where):
    from pytest_llmload.config.settings import PARSERS
    from pytest_llmload.config.vocabulary import SETTING

    return PARSERS["gpus"](value, where, SETTING["gpus_per_worker"])


def test_per_worker_values():
    assert _per_worker("2", "x") == 2
    assert _per_worker("OFF", "x") == "off"
    assert _per_worker("", "x") is None  # not given: the default


def test_worker_hint_names_the_worker_its_share_and_the_command():
    environ = {gpus.WORKER_GPUS_ENV: "GPU-c", "CUDA_VISIBLE_DEVICES": "GPU-c", gpus.TOTAL_ENV: "8",
               "PYTEST_XDIST_WORKER": "gw3"}
    assert gpus.worker_hint(2, environ) == (
        "xdist worker gw3 holds 1 of the run's 8 GPUs: run it with -n 4, or with --llmload-gpus-per-worker 2")
    assert gpus.worker_hint(16, environ) == "xdist worker gw3 holds 1 of the run's 8 GPUs"
    assert gpus.worker_hint(2, {}) is None  # not a worker that got GPUs
    # A test (or conftest) that set its own CUDA_VISIBLE_DEVICES gets the plain reason.
    assert gpus.worker_hint(2, {**environ, "CUDA_VISIBLE_DEVICES": "0"}) is None


# --- real xdist runs, GPUs faked ------------------------------------------------------------------------------

CONFTEST = """
import json, os
import pytest

# What the worker's environment holds when its first conftest is imported.
with open(os.path.join(os.path.dirname(__file__), "imports.jsonl"), "a") as out:
    out.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER"),
                          "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "unset")}) + "\\n")

@pytest.fixture
def record(request):
    from pytest_llmload.system import gpus
    with open(os.path.join(os.path.dirname(__file__), "tests.jsonl"), "a") as out:
        out.write(json.dumps({"test": request.node.name, "worker": os.environ.get("PYTEST_XDIST_WORKER"),
                              "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "unset"),
                              "visible_gpu_count": gpus.visible_gpu_count(),
                              "shares": gpus.shares_gpus_with_other_workers()}) + "\\n")
"""

TESTS = """
import pytest

@pytest.mark.parametrize("i", range(8))
def test_one(record, i):
    pass

@pytest.mark.needs_gpus(2)
@pytest.mark.parametrize("i", range(2))
def test_two(record, i):
    pass
"""

EIGHT = ",".join(f"GPU-{letter}" for letter in "abcdefgh")
FOUR = "GPU-a,GPU-b,GPU-c,GPU-d"


@pytest.fixture
def project(pytester, monkeypatch):
    """A project whose conftest records each worker's view; the environment is that of a plain CI runner."""
    for name in ("CUDA_VISIBLE_DEVICES", gpus.FAKE_GPUS_ENV, gpus.WORKER_GPUS_ENV, gpus.TOTAL_ENV,
                 "PYTEST_XDIST_AUTO_NUM_WORKERS",
                 "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT"):  # (set when this suite itself runs under -n)
        monkeypatch.delenv(name, raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_gpus=TESTS)
    return pytester


def run(pytester, *args):
    # The controller forked from this process (fixtures/warm_runs.py); its workers are xdist's own new interpreters.
    return warm_runs.runpytest(pytester, "-p", "xdist", "-p", "no:randomly", "-p", "no:cacheprovider", "-rs", *args)


def records(pytester, name) -> list[dict]:
    path = pytester.path / name
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def workers_views(pytester) -> dict[str, str]:
    """Worker id -> its CUDA_VISIBLE_DEVICES at its first conftest import (the controller's line left out)."""
    return {r["worker"]: r["cuda_visible_devices"] for r in records(pytester, "imports.jsonl") if r["worker"]}


def test_four_workers_on_four_gpus_get_one_each_before_any_conftest(project, monkeypatch):
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, FOUR)
    result = run(project, "-n", "4")
    result.assert_outcomes(passed=8, skipped=2)
    result.stdout.fnmatch_lines(["llmload: 4 xdist workers, 1 GPU each, their CUDA_VISIBLE_DEVICES: 0 | 1 | 2 | 3"])
    assert workers_views(project) == {"gw0": "0", "gw1": "1", "gw2": "2", "gw3": "3"}
    for test in records(project, "tests.jsonl"):  # the test sees what its worker got, and gpus counts it
        assert (test["cuda_visible_devices"], test["visible_gpu_count"]) == (workers_views(project)[test["worker"]], 1)
    result.stdout.fnmatch_lines(["SKIPPED * needs 2 GPUs, 1 visible (CUDA_VISIBLE_DEVICES=?); xdist worker gw? holds 1 "
                                 "of the run's 4 GPUs: run it with -n 2, or with --llmload-gpus-per-worker 2"])


def test_two_gpu_tests_run_where_workers_hold_two_within_a_runners_uuid_list(project, monkeypatch):
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, EIGHT)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-h,GPU-b,GPU-c,GPU-f")  # the CI runner's share
    result = run(project, "-n", "2")
    result.assert_outcomes(passed=10)
    assert workers_views(project) == {"gw0": "GPU-h,GPU-b", "gw1": "GPU-c,GPU-f"}
    two_gpu_tests = [t for t in records(project, "tests.jsonl") if t["test"].startswith("test_two")]
    assert [t["visible_gpu_count"] for t in two_gpu_tests] == [2, 2]


def test_an_outer_index_list_is_kept_as_written(project, monkeypatch):
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, EIGHT)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,1,3")
    result = run(project, "-n", "3", "--llmload-gpus-per-worker", "1", "-k", "test_one")
    result.assert_outcomes(passed=8)
    assert workers_views(project) == {"gw0": "6", "gw1": "1", "gw2": "3"}


def test_more_workers_than_gpus_share_them_where_no_share_is_asked_for(project, monkeypatch):
    # pytest -m gpu -n 4 on a one-GPU runner (issue 40): every worker sees the GPU, and knows it shares it, so that a
    # test that may fill it holds it alone (system.gpus.held_by_test; tests/system/test_gpus.py)
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, "GPU-a")
    result = run(project, "-n", "2", "-k", "test_one")
    result.assert_outcomes(passed=8)
    result.stdout.fnmatch_lines(["llmload: 2 xdist workers share 1 GPU (fewer GPUs than workers): a test that may "
                                 "fill it (limit_torch_memory) runs alone, the other GPU tests beside each other; "
                                 "-n 1 gives each worker its own"])
    assert workers_views(project) == {"gw0": "unset", "gw1": "unset"}
    assert {(t["visible_gpu_count"], t["shares"]) for t in records(project, "tests.jsonl")} == {(1, True)}


def test_more_workers_than_gpus_with_a_share_asked_for_is_a_usage_error_before_any_worker_starts(project,
                                                                                                 monkeypatch):
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, EIGHT)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    result = run(project, "-n", "8", "--llmload-gpus-per-worker", "1")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: pytest -n 8 with 1 GPU per xdist worker needs 8 GPUs, but 4 are visible "
                                 "(CUDA_VISIBLE_DEVICES=0,1,2,3): run -n 4 (or -n auto), *"])
    assert workers_views(project) == {}
    result = run(project, "-n", "2", "--llmload-gpus-per-worker", "two")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --llmload-gpus-per-worker='two' is neither a positive number of GPUs *"])


def test_auto_starts_one_worker_per_gpu(project, monkeypatch):
    monkeypatch.setenv(gpus.FAKE_GPUS_ENV, FOUR)
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "16")  # xdist's CPU-based answer, capped to 4
    result = run(project, "-n", "auto", "-k", "test_one")
    result.assert_outcomes(passed=8)
    assert sorted(workers_views(project).values()) == ["0", "1", "2", "3"]


@pytest.mark.parametrize("setting", ["no GPU", "assignment off"])
def test_without_gpus_or_with_assignment_off_nothing_changes(project, monkeypatch, setting):
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "2")
    if setting == "no GPU":
        monkeypatch.setenv(gpus.FAKE_GPUS_ENV, "")  # a machine without GPUs
        args = ("-n", "auto")
    else:
        monkeypatch.setenv(gpus.FAKE_GPUS_ENV, FOUR)
        args = ("-n", "auto", "--llmload-gpus-per-worker", "off")
    result = run(project, *args, "-k", "test_one")
    result.assert_outcomes(passed=8)
    assert workers_views(project) == {"gw0": "unset", "gw1": "unset"}  # xdist's worker count, the runner's devices
    assert "xdist workers" not in result.stdout.str()
