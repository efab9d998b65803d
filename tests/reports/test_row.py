"""One row record (pytest_llmload.reports.row): decided once where the check's outcome is decided, and read as data by the
progress file (the main job's table and --json), JUnit XML and the pytest_llmload_check_result hook."""

import json
import xml.etree.ElementTree as ET

import pytest

from fixtures import warm_runs
from pytest_llmload.reports.row import Row


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
    assert row.outcome == "error" and Row(check="c", verdict="not applicable").outcome == "skipped"
    assert Row.from_dict(row.as_dict()) == row


# A repo's own checks (docs/extension.md): any name, one that fails, one whose own code crashes in its isolated
# child, one that skips, one that passes. None loads a model.
OWN_CHECKS = '''
import pytest
from pytest_llmload import Check, KnownFailure

FAILURE = KnownFailure(
    id="use-cache-off", title="an inference load with the KV cache switched off", write_up="myrepo#12",
    signatures=(), root_cause="the loader copies its training set-up", fix="set use_cache only for train requests",
    occurs="myrepo since 2.3")


def own_thing(loader, checkpoint, workdir):
    assert False, "the inference model has config.use_cache=False"


def own_broken(loader, checkpoint, workdir):
    return {}["missing"]


def own_skip(loader, checkpoint, workdir):
    pytest.skip("not exercised: the loader never sets use_cache")


def own_pass(loader, checkpoint, workdir):
    pass


CHECKS = [Check(own_thing, FAILURE), Check(own_broken, FAILURE, isolated=True), Check(own_skip, FAILURE),
          Check(own_pass, FAILURE)]
'''


def test_the_progress_file_junit_and_the_hook_read_the_same_row(pytester):
    """Also a repo's own checks (issue 47): a check named ``own_thing`` showed as ``test_loader_check[own_thing]`` in
    every row, and one whose own code crashed in its isolated child was "a bug in pytest-llmload ... at _child_main
    (runners/children.py:...)" with this project's tracker; ``--json`` gives each verdict kind its reason and fix."""
    from pytest_llmload.main_job.table import json_records

    pytester.makepyfile(myrepo_checks=OWN_CHECKS)
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
                                 "--llmload-checks", "myrepo_checks",
                                 "-k", "pad_token_set_offline or writes_only or own_",
                                 "--llmload-progress", "progress.jsonl", "--junitxml", "out.xml", "-p", "hookplug",
                                 "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, skipped=2, failed=2)
    records = list(map(json.loads, (pytester.path / "progress.jsonl").read_text().splitlines()))
    hook = {r["check"]: r for r in map(json.loads, (pytester.path / "hook.jsonl").read_text().splitlines())}
    progress = {r["row"]["check"]: r["row"] for r in records if r.get("event") == "result"}
    junit = {json.loads(props["llmload_row"])["check"]: props for props in (
        {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in ET.parse(pytester.path / "out.xml").getroot().iter("testcase"))}
    pad, writes = "check_pad_token_set_offline", "check_load_writes_only_offload_folder"
    assert hook[pad]["notes"] == progress[pad]["notes"] == [
        "judged in bfloat16, the dtype its weights came in when asked float32 (max_memory budgets sized for bfloat16)"]
    assert json.loads(junit[pad]["llmload_row"])["notes"] == hook[pad]["notes"]
    assert hook[writes]["verdict"] == progress[writes]["verdict"] == junit[writes]["llmload_verdict"] == \
        "not applicable"
    assert progress[writes]["outcome"] == "skipped" and "we never offload" in progress[writes]["sentence"]
    assert {hook[pad]["loader"], progress[pad]["loader"], junit[pad]["llmload_loader"]} == {"bf16:load"}

    names = ["own_thing", "own_broken", "own_skip", "own_pass"]
    (collected,) = [r for r in records if r.get("event") == "collected"]
    assert collected["order"][-4:] == names and set(names) <= set(collected["guards"])
    assert set(names) <= {r["check"] for r in records if r.get("event") == "start"}
    assert set(names) <= set(progress) and sorted(progress) == sorted(hook) == sorted(junit)

    broken = hook["own_broken"]["sentence"]
    assert (hook["own_broken"]["verdict"], hook["own_broken"]["cause"]) == ("error", "check")
    line = (pytester.path / "myrepo_checks.py").read_text().splitlines().index('    return {}["missing"]') + 1
    assert f"KeyError: 'missing' at own_broken ({pytester.path / 'myrepo_checks.py'}:{line})" in broken, broken
    assert "pytest-llmload" not in broken and "children.py" not in broken and "issues" not in broken, broken

    as_json = {r["check"]: r for r in json_records([Row.from_dict(row) for row in progress.values()])}
    assert (as_json["own_thing"]["verdict"], as_json["own_thing"]["failure"]) == ("failed", "use-cache-off")
    assert "the inference model has config.use_cache=False" in as_json["own_thing"]["sentence"]
    assert as_json["own_thing"]["fix"] == "set use_cache only for train requests"
    assert as_json["own_broken"]["sentence"] == broken and as_json["own_broken"]["fix"] is None
    assert as_json["own_skip"]["verdict"] == "not exercised" and \
        as_json["own_skip"]["sentence"] == "not exercised: the loader never sets use_cache"
    assert (as_json["own_pass"]["verdict"], as_json["own_pass"]["sentence"]) == ("passed", "")
    assert all(row["seconds"] is not None for row in progress.values()), "the time is the row's, filled where made"


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
    (row,) = [r["row"] for r in map(json.loads, (pytester.path / "progress.jsonl").read_text().splitlines())
              if r.get("event") == "result"]
    assert (row["outcome"], row["verdict"]) == (("failed", "failed") if strict else ("skipped", "not exercised"))


def test_json_gives_each_verdict_kind_its_whole_reason_and_its_fix(tmp_path):
    """Every verdict kind, built by row_of, through the progress file to ``--json``: ``reason`` is the row's whole
    sentence wherever there is one (a FAILED row's too: issue 47 found it empty), ``fix`` the failure's where the row
    names it. Cheap: no pytest run, the report object the progress writer reads."""
    from types import SimpleNamespace

    from pytest_llmload.checks.base import Check, KnownFailure
    from pytest_llmload.main_job.table import json_records
    from pytest_llmload.reports.progress import ProgressWriter
    from pytest_llmload.reports.verdict import row_of

    failure = KnownFailure(id="use-cache-off", title="t", write_up="myrepo#12", signatures=(), root_cause="r",
                           fix="set use_cache only for train requests", occurs="o")

    def own_thing(loader, checkpoint, workdir):
        pass

    class PredictedFailure(Exception):  # (judged by its name, as prediction.predict's)
        failure = "use-cache-off"

    check = Check(own_thing, failure)
    rows = {"failed": row_of(check, raised=AssertionError("use_cache off:\n  in the inference load")),
            "predicted": row_of(check, raised=PredictedFailure("would hit use-cache-off on 1x24GB")),
            "error": row_of(check, raised=KeyError("missing")),
            "setup error": row_of(check, failed="fixture 'x' not found", failed_in="setup"),
            "not exercised": row_of(check, skipped="not exercised: never sets use_cache"),
            "not applicable": row_of(check, skipped="declared not applicable: we never offload"),
            "skipped": row_of(check, skipped="needs 1 GPU, 0 visible"),
            "xfailed": row_of(check, xfail=(False, "myrepo#12, known")),
            "passed": row_of(check)}
    writer = ProgressWriter(str(tmp_path / "progress.jsonl"))
    for name, row in rows.items():
        writer.pytest_runtest_logreport(SimpleNamespace(nodeid=name, when="call", outcome="passed",
                                                        user_properties=row.properties()))
    writer.close()
    results = [Row.from_dict(json.loads(line)["row"]) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    got = {name: (r["verdict"], r["sentence"], r["fix"]) for name, r in zip(rows, json_records(results))}
    fix = "set use_cache only for train requests"
    assert got["failed"] == ("failed", "use_cache off:\n  in the inference load", fix)
    assert got["predicted"] == ("predicted", "would hit use-cache-off on 1x24GB", fix)
    assert got["error"][:2] == ("error", rows["error"].sentence) and "KeyError: 'missing'" in got["error"][1]
    assert got["setup error"] == ("error", "fixture 'x' not found", None) and rows["setup error"].cause == "setup"
    for kind in ("not exercised", "not applicable", "skipped", "xfailed"):
        assert got[kind] == (kind, rows[kind].sentence, None) and got[kind][1], got[kind]
    assert got["passed"] == ("passed", "", None)


def test_the_progress_record_and_the_json_row_are_the_row_with_exactly_its_fields(tmp_path):
    """One record type: a check's row and a test's that runs no check are written as they are (no field renamed or
    added: before issue 47 the writer wrote ``reason``/``summary`` for ``sentence``), the parent makes the same Row
    again, and ``--json`` writes it as it is."""
    import dataclasses
    from types import SimpleNamespace

    from pytest_llmload.main_job.table import json_records
    from pytest_llmload.reports.progress import ProgressWriter
    from pytest_llmload.reports.row import SHOWN_BESIDE

    check_row = Row(check="own_thing", verdict="failed", guards="use-cache-off", failure="use-cache-off",
                    cause="mechanism", sentence="use_cache off", fix="set it for train only", seconds=0.25)
    crash = SimpleNamespace(reprcrash=SimpleNamespace(message="AssertionError: assert 1 == 2"))
    reports = [SimpleNamespace(nodeid="test_x.py::test_loader_check[own_thing]", when="call", outcome="failed",
                               user_properties=check_row.properties()),
               SimpleNamespace(nodeid="test_mine.py::test_own", when="call", outcome="failed", longrepr=crash,
                               skipped=False, failed=True, user_properties=[])]
    writer = ProgressWriter(str(tmp_path / "progress.jsonl"))
    for report in reports:
        writer.pytest_runtest_logreport(report)
    writer.close()
    records = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    fields = {field.name for field in dataclasses.fields(Row)} | set(SHOWN_BESIDE)
    assert [set(record) for record in records] == [{"event", "nodeid", "row"}] * 2
    assert [set(record["row"]) for record in records] == [fields] * 2
    rows = [Row.from_dict(record["row"]) for record in records]
    assert rows[0] == check_row
    assert (rows[1].check, rows[1].verdict, rows[1].guards, rows[1].sentence) == (
        "test_own", "failed", None, "AssertionError: assert 1 == 2")
    assert [set(record) for record in json_records(rows)] == [fields] * 2
    with pytest.raises(TypeError):  # a field the row does not have is no row
        Row.from_dict({**check_row.as_dict(), "reason": "renamed"})


def test_an_extension_checks_rows_and_hang_line_say_its_own_name(monkeypatch):
    """A repo's check named ``own_thing`` (docs/extension.md allows any name) showed as
    ``test_loader_check[own_thing]``, its name parsed from the node id; the name is the check's."""
    from types import SimpleNamespace

    from pytest_llmload.checks.base import Check, KnownFailure
    from pytest_llmload.main_job.table import summary_table
    from pytest_llmload.reports.progress import name_of

    failure = KnownFailure(id="use-cache-off", title="t", write_up="myrepo#12", signatures=(), root_cause="r",
                           fix="f", occurs="o")

    def own_thing(loader, checkpoint, workdir):
        pass

    item = SimpleNamespace(nodeid="tests/test_gate.py::test_loader_check[own_thing]", name="test_loader_check[own_thing]",
                           callspec=SimpleNamespace(params={"check": Check(own_thing, failure)}))
    assert name_of(item) == "own_thing"
    assert name_of(SimpleNamespace(nodeid="tests/test_mine.py::test_own", name="test_own")) == "test_own"
    table = "\n".join(summary_table([Row(check=name_of(item), verdict="passed", guards="use-cache-off",
                                         guards_origin="extension", seconds=0.1)]))
    assert "own_thing  use-cache-off (extension)" in table and "test_loader_check" not in table
    # The hang line of the tests after it ("the loader under test hung in own_thing") names the check too.
    from pytest_llmload.plugin import loader_hang

    monkeypatch.setattr(loader_hang, "hang_in_loader", lambda exc, test: loader_hang.Hang(test, 2.0))
    item.config, item.fixturenames = SimpleNamespace(stash=pytest.Stash()), ["llmload_loader"]
    wrapper = loader_hang.pytest_runtest_makereport(item, SimpleNamespace(when="call", excinfo=SimpleNamespace(
        value=TimeoutError("deadline"))))
    next(wrapper)
    with pytest.raises(StopIteration):
        wrapper.send(SimpleNamespace(failed=True))
    assert item.config.stash[loader_hang.hang_key].message().startswith("the loader under test hung in own_thing ")
