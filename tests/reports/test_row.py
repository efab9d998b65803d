"""One row record (pytest_llmload.reports.row): decided once where the check's outcome is decided, and read as data by the
progress file (the main job's table and --json), JUnit XML and the pytest_llmload_check_result hook."""

import json
import xml.etree.ElementTree as ET

import pytest

from fixtures import warm_runs
from pytest_llmload.reports.row import Row, outcome_of


def test_a_row_travels_as_one_property_and_comes_back_whole():
    row = Row(check="check_x", verdict="error", guards="meta-backward", cause="loader",
              sentence="loader error: ImportError:\n  No module named 'flash_attn'", notes=("judged in float16, ...",),
              loader="mypkg:load")

    class Report:
        user_properties = row.properties()

    assert Row.of_report(Report) == row
    flat = dict(row.properties())
    assert (flat["llmload_verdict"], flat["llmload_cause"], flat["llmload_loader"]) == ("error", "loader", "mypkg:load")
    assert flat["llmload_sentence"].endswith("No module named 'flash_attn'"), "every line of the reason"
    assert outcome_of(row) == "error" and outcome_of(Row(check="c", verdict="not applicable")) == "skipped"


def test_the_progress_file_junit_and_the_hook_read_the_same_row(pytester):
    pytester.makepyfile(bf16="""
        from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

        def load(request):
            return load_model_and_tokenizer(request.replace(dtype="bfloat16"))

        load.llmload_not_applicable = {"check_load_writes_only_offload_folder": "we never offload"}
    """)
    pytester.makepyfile(hookplug="""
        import json

        def pytest_llmload_check_result(item, check, result):
            with open("hook.jsonl", "a") as out:
                out.write(json.dumps(result) + "\\n")
    """)  # (a plugin by -p: a conftest.py here is not the shipped suite's)
    result = warm_runs.runpytest(pytester, "--pyargs", "pytest_llmload.suite", "--llmload-loader", "bf16:load",
                                 "-k", "pad_token_set_offline or writes_only", "--llmload-progress", "progress.jsonl",
                                 "--junitxml", "out.xml", "-p", "hookplug", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)
    hook = {r["check"]: r for r in map(json.loads, (pytester.path / "hook.jsonl").read_text().splitlines())}
    progress = {r["check"]: r for r in map(json.loads, (pytester.path / "progress.jsonl").read_text().splitlines())
                if r.get("event") == "result"}
    junit = {case.get("name").split("[")[1].rstrip("]"): {p.get("name"): p.get("value") for p in case.iter("property")}
             for case in ET.parse(pytester.path / "out.xml").getroot().iter("testcase")}
    pad, writes = "check_pad_token_set_offline", "check_load_writes_only_offload_folder"
    assert hook[pad]["notes"] == progress[pad]["notes"] == [
        "judged in bfloat16, the dtype its weights came in when asked float32 (max_memory budgets sized for bfloat16)"]
    assert json.loads(junit[pad]["llmload_row"])["notes"] == hook[pad]["notes"]
    assert hook[writes]["verdict"] == progress[writes]["verdict"] == junit[writes]["llmload_verdict"] == \
        "not applicable"
    assert progress[writes]["outcome"] == "skipped" and "we never offload" in progress[writes]["reason"]
    assert {hook[pad]["loader"], progress[pad]["loader"], junit[pad]["llmload_loader"]} == {"bf16:load"}


@pytest.mark.parametrize("strict", [False, True])
def test_a_strict_run_counts_a_not_exercised_row_as_failed_in_the_row_too(pytester, strict):
    pytester.makepyfile(whole="""
        from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

        def load(request):
            return load_model_and_tokenizer(request.replace(max_memory=None))
    """)
    args = ["--pyargs", "pytest_llmload.suite", "--llmload-loader", "whole:load", "-k", "check_offload_inference and "
            "not cuda", "--llmload-progress", "progress.jsonl", "-p", "no:cacheprovider"]
    result = warm_runs.runpytest(pytester, *args, *(["--llmload-strict"] if strict else []))
    result.assert_outcomes(**({"failed": 1} if strict else {"skipped": 1}))
    (row,) = [r for r in map(json.loads, (pytester.path / "progress.jsonl").read_text().splitlines())
              if r.get("event") == "result"]
    assert (row["outcome"], row["verdict"]) == (("failed", "failed") if strict else ("skipped", "not exercised"))
