"""``python -m pytest_llmload``: one row per check, exit 0 / 1 / 2, progress while it runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]


def main_job(*args, cwd=REPO):
    return subprocess.run([sys.executable, "-m", "pytest_llmload", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=280)


def test_reference_loader_passes_with_a_row_per_check():
    run = main_job("-k", "pad_token or offload_inference")
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "llmload: checking loader pytest_llmload.reference_loader:load_model_and_tokenizer (from built-in default)" in out
    assert "llmload: 3 checks collected" in out
    assert "[1/3] check_offload_inference" in out  # progress rows as results arrive
    table = out[out.index("check  "):]
    for row in (r"check_offload_inference +offload-hang \(000\) +passed +\d+\.\d\ds",
                r"check_pad_token_set_offline +offload-hang \(000\) +passed",
                r"check_offload_inference_cuda +offload-hang \(000\) +skipped \(needs 1 GPU, 0 visible"):
        assert re.search(f"^{row}", table, re.M), (row, table)
    assert "llmload: 2 passed, 1 skipped in" in out


def test_a_before_loader_fails_with_exit_1_naming_the_check():
    run = main_job("--loader", "fixtures.loaders.before_meta_backward:load", "-k", "train_request_trains and not cuda")
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"^check_train_request_trains +meta-backward \(002\) +FAILED", run.stdout, re.M), run.stdout
    assert "FAILED check_train_request_trains: AssertionError: 4 of 8 train requests failed (write-up 002" in run.stdout


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope_missing_pkg:load", "llmload: ERROR: loader spec 'nope_missing_pkg:load' from --loader: module "
                                  "'nope_missing_pkg' does not import"),
        ("not a spec", "llmload: error: loader spec 'not a spec' from --loader is not of the form 'module:function'"),
    ],
)
def test_a_bad_loader_is_a_usage_error_exit_2(spec, message):
    run = main_job("--loader", spec)
    assert run.returncode == 2, run.stdout + run.stderr
    assert message in run.stderr, run.stderr


def test_list_names_every_check_and_its_failure():
    run = main_job("--list")
    assert run.returncode == 0
    for line in ("check_train_request_trains", "meta-backward", "check_distributed_train_step",
                 "distributed-device-map", "check_trainer_does_not_wrap_placed_model", "dp-dtype"):
        assert line in run.stdout
