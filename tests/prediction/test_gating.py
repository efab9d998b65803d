"""Which PREDICTED rows fail the run (issue 46, point 6): the runner/model pairs a repo gates on
(``llmload_gate_runners``) and the rows it expects (``llmload_expected_predictions``, xfail-like, with a reason).

The reference loader under torchrun on 2 GPUs of 4 GiB with Phi-3-mini (7.6 GB in bfloat16) is a predicted OOM; on
2xH100-80GB it is not. Each run is forked from this test process (fixtures/warm_runs.py)."""

import json
from xml.etree import ElementTree

import pytest

from fixtures import warm_runs
from pytest_llmload.prediction.gating import Gating, GatingError, expected_rows, gated_pairs

pytestmark = [pytest.mark.llmload_deepspeed, pytest.mark.timeout(300)]

SMALL = "2x4GiB"  # the runner the row is predicted on


def _run(pytester, *ini_lines: str, runners: str = f"{SMALL}.json") -> pytest.RunResult:
    (pytester.path / f"{SMALL}.json").write_text(json.dumps(
        {"devices": 2, "device_memory": "4GiB", "host_memory": "64GiB", "disk": "100GiB"}))
    pytester.makeini("\n".join(["[pytest]", f"llmload_runner = {runners}", "llmload_model = phi-3-mini",
                                *ini_lines]) + "\n")
    return warm_runs.runpytest(pytester, "--pyargs", "pytest_llmload.suite", "-k", "predict_launcher_ddp",
                               "-p", "no:cacheprovider", "-v", "-rA", "--junitxml", "out.xml")


def test_a_prediction_on_a_pair_the_repo_does_not_gate_on_is_reported_and_exits_0(pytester):
    result = _run(pytester, "llmload_gate_runners = 2xH100-80GB:phi-3-mini")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([f"*predict_launcher_ddp@{SMALL}] PREDICTED (not gated)*", "*1 predicted*"])
    properties = {prop.get("name"): prop.get("value") for prop in
                  ElementTree.parse(pytester.path / "out.xml").iter("property")}
    assert properties["llmload_verdict"] == "predicted" and properties["llmload_failure"] == "OOM"
    assert json.loads(properties["llmload_row"])["prediction"]["gated"] is False


def test_a_prediction_on_a_gated_pair_fails_the_run_as_every_one_does_where_none_is_declared(pytester):
    gated = _run(pytester, f"llmload_gate_runners = 2xH100-80GB {SMALL}.json:phi-3-mini")
    assert gated.ret == pytest.ExitCode.TESTS_FAILED
    gated.stdout.fnmatch_lines(["*would hit OOM*", f"FAILED *predict_launcher_ddp@{SMALL}*"])


def test_an_expected_prediction_is_an_xfail_with_its_reason_and_one_no_longer_predicted_an_xpass(pytester):
    expected = _run(pytester, "llmload_expected_predictions =",
                    f"    predict_launcher_ddp@{SMALL}: our 4 GiB cards only serve it",
                    "    predict_launcher_ddp@2xH100-80GB: it used not to fit", runners=f"{SMALL}.json,2xH100-80GB")
    assert expected.ret == pytest.ExitCode.TESTS_FAILED  # (every pair gated: the xpass is strict)
    expected.stdout.fnmatch_lines([f"XFAIL *predict_launcher_ddp@{SMALL}* - our 4 GiB cards only serve it",
                                   "FAILED *predict_launcher_ddp@2xH100-80GB*"])
    assert "[XPASS(strict)] it used not to fit" in expected.stdout.str()


def test_which_pairs_a_repo_gates_on():
    gating = Gating(gated_pairs(["8xH100-80GB:llama-3-70b 2xH100-80GB", "1x24GB-RTX4090,"], "ini"))
    assert gating.gates("8xH100-80GB", "llama-3-70b") and not gating.gates("8xH100-80GB", "llama-3-8b")
    assert gating.gates("2xH100-80GB", "qwen2.5-7b") and gating.gates("1x24GB-RTX4090", "phi-3-mini")
    assert not gating.gates("8xA100-80GB", "llama-3-70b")
    assert Gating().gates("8xA100-80GB", "llama-3-70b")  # none declared: every pair


@pytest.mark.parametrize(("entries", "said"), [
    (["a100x2:llama-70b"], "ini 'llmload_gate_runners': 'a100x2' is neither a shipped runner profile"),
    (["2xH100-80GB:llama-70b"], "ini 'llmload_gate_runners': model 'llama-70b' is neither a shipped architecture"),
])
def test_a_pair_that_names_no_runner_or_model_says_which_and_what_to_give(entries, said):
    with pytest.raises(GatingError, match=r"name (the runner|it) as --llmload-(runner|model) names it") as caught:
        gated_pairs(entries, "ini 'llmload_gate_runners'")
    assert said in str(caught.value)


def test_an_expected_row_names_a_scenario_and_its_runner_as_rows_do():
    scenarios = ["predict_zero3", "predict_launcher_ddp"]
    assert expected_rows({"predict_zero3@8xH100-80GB": "why", "predict_launcher_ddp": "why not"}, scenarios,
                         "ini") == {"predict_zero3@8xH100-80GB": "why", "predict_launcher_ddp": "why not"}
    assert Gating(expected={"predict_zero3": "r"}).expected_reason("predict_zero3", "8xH100-80GB") == "r"
    with pytest.raises(GatingError, match="'predict_zero@8xH100-80GB' names no prediction scenario"):
        expected_rows({"predict_zero@8xH100-80GB": "typo"}, scenarios, "ini")


@pytest.mark.parametrize(("gated", "code"), [(False, 0), (True, 1)])
def test_the_main_job_shows_a_prediction_it_does_not_gate_on_and_exits_0(gated, code, tmp_path):
    import argparse
    import io

    from pytest_llmload.main_job import table
    from pytest_llmload.main_job.process import MainJob
    from pytest_llmload.prediction.predict import bare_record
    from pytest_llmload.reports.row import Row

    (tmp_path / "pytest.log").write_text("...")
    job = MainJob(argparse.Namespace(log=None, json_path=None, runner=SMALL, pytest_args=[]), tmp_path, io.StringIO())
    check = f"predict_launcher_ddp@{SMALL}"
    job.total, job.order = 1, [check]
    job.results = [Row(check=check, verdict="predicted", failure="OOM", sentence="would hit OOM", seconds=0.1,
                       guards="distributed-device-map",
                       prediction={**bare_record("predict_launcher_ddp", SMALL, "phi-3-mini", "OOM", "the load"),
                                   "gated": gated})]
    assert table.report(job, 0 if not gated else 1)[0] == code
    said = job.out.getvalue()
    assert f"PREDICTED{'' if gated else ' (not gated)'} {check}: would hit OOM" in said, said
