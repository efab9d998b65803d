"""``python -m pytest_llmload``: one row per check, exit 0 / 1 / 2, progress while it runs."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _temp_dirs_in_tmp_path(tmp_path, monkeypatch):
    # A main job keeps its temp dir when a check failed (by design); these tests fail checks on purpose.
    (tmp_path / "tmpdir").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))


def main_job(*args, cwd=REPO, env=None):
    return subprocess.run([sys.executable, "-m", "pytest_llmload", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=280, env=env)


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


LOADERS = '''
from pytest_llmload.reference_loader import load_model_and_tokenizer


def breaks_on_train(request):
    """A loader's own bug (a keyword its helper does not take): an error, not a known failure."""
    if request.purpose == "train":
        raise TypeError("load_model() got an unexpected keyword argument 'load_in_4bit'")
    return load_model_and_tokenizer(request)


def never_offloads(request):
    """Ignores the budget: loads whole, so an offloading check exercises nothing."""
    return load_model_and_tokenizer(request.replace(max_memory=None))


def for_evaluation(request):
    return load_model_and_tokenizer(request)


for_evaluation.llmload_purposes = ("inference",)
'''


@pytest.fixture
def odd_loaders(tmp_path):
    (tmp_path / "odd_loaders.py").write_text(LOADERS)
    return tmp_path


def test_a_loaders_own_error_is_an_error_row_not_a_known_failure(odd_loaders):
    import json

    run = main_job("--loader", "odd_loaders:breaks_on_train", "-k", "train_request_trains and not cuda",
                   "--json", str(odd_loaders / "out.json"), cwd=odd_loaders)
    assert run.returncode == 1, run.stdout + run.stderr
    assert re.search(r"^check_train_request_trains +meta-backward \(002\) +error ", run.stdout, re.M), run.stdout
    assert "ERROR check_train_request_trains: " in run.stdout and "'load_in_4bit'" in run.stdout
    (record,) = json.loads((odd_loaders / "out.json").read_text())
    assert (record["check"], record["outcome"], record["failure"]) == ("check_train_request_trains", "error", None)
    assert set(record) == {"check", "outcome", "failure", "reason", "seconds", "detail"}


def test_a_check_that_exercised_nothing_skips_and_strict_fails_it(odd_loaders):
    run = main_job("--loader", "odd_loaders:never_offloads", "-k", "check_offload_inference and not cuda",
                   cwd=odd_loaders)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipped (not exercised: check_offload_inference: the loader loaded the model whole on cpu" in run.stdout
    strict = main_job("--loader", "odd_loaders:never_offloads", "-k", "check_offload_inference and not cuda",
                      "--strict", cwd=odd_loaders)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "FAILED check_offload_inference: llmload strict: a check that exercised nothing is a failure" in strict.stdout


def test_an_inference_only_loader_skips_the_training_checks(odd_loaders):
    run = main_job("--loader", "odd_loaders:for_evaluation", "-k", "train_request_trains and not cuda",
                   cwd=odd_loaders)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "skipped (check_train_request_trains: loader odd_loaders:for_evaluation is declared for inference only" \
        in run.stdout


def test_the_main_job_leaves_nothing_behind_unless_a_check_failed(odd_loaders):
    import os

    tmp = odd_loaders / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    ok = main_job("-k", "pad_token and not cuda", env=env, cwd=odd_loaders)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "nothing failed: pytest output removed (--log PATH keeps it)" in ok.stdout
    assert [p.name for p in tmp.iterdir() if p.name.startswith("llmload-main-")] == []
    failed = main_job("--loader", "odd_loaders:breaks_on_train", "-k", "train_request_trains and not cuda",
                      env=env, cwd=odd_loaders)
    assert failed.returncode == 1
    (kept,) = [p for p in tmp.iterdir() if p.name.startswith("llmload-main-")]
    assert [p.name for p in kept.iterdir()] == ["pytest.log"] and f"pytest output: {kept / 'pytest.log'}" in failed.stdout
