"""A check's row in pytest's own report files (:mod:`pytest_llmload.reports.pytest_report_files`): JUnit XML writes an
``error`` row as ``<error>``, pytest-reportlog's stream gets each row as a record, and neither needs the other."""

import json
import xml.etree.ElementTree as ET

import pytest

pytestmark = pytest.mark.timeout(180)

# Three checks of a repo's own (a failure seen, the check's own crash: an error row, a pass) and a plain test.
FILES = {
    "mychecks": (
        "from pytest_llmload.checks.base import Check\n"
        "from pytest_llmload.failures import BY_ID\n\n"
        "def check_sees_its_failure(loader, checkpoint, workdir):\n"
        "    '''Sees the mechanism.'''\n"
        "    assert False, 'the mechanism, observed'\n\n"
        "def check_breaks(loader, checkpoint, workdir):\n"
        "    '''Crashes: an error, not the failure it guards against.'''\n"
        "    raise ValueError('the check broke')\n\n"
        "def check_passes(loader, checkpoint, workdir):\n"
        "    '''Passes.'''\n\n"
        "CHECKS = [Check(check_sees_its_failure, failure=BY_ID['meta-backward']),\n"
        "          Check(check_breaks, failure=BY_ID['offload-hang']),\n"
        "          Check(check_passes, failure=BY_ID['dp-dtype'])]\n\n"
        "def load(request):\n"
        "    return None\n"),
    "test_gate": (
        "from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks\n"
        "from mychecks import CHECKS, load\n\n"
        "@parametrize_with_loader_checks([load], checks=CHECKS)\n"
        "def test_loader(loader, check, tmp_path):\n"
        "    check(loader, tmp_path, tmp_path)\n\n"
        "def test_plain():\n"
        "    assert 1 == 2\n"),
}


@pytest.fixture
def gate(pytester, monkeypatch):
    pytester.makepyfile(**FILES)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))  # (xdist's workers, new interpreters, import mychecks too)
    monkeypatch.syspath_prepend(pytester.path)
    return pytester


def _testcases(path) -> dict[str, ET.Element]:
    return {case.get("name").rpartition("-")[2].rstrip("]"): case for case in ET.parse(path).getroot().iter("testcase")}


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_an_error_row_is_an_error_in_junit_xml_and_a_failure_stays_a_failure(gate, xdist):
    """Before (issue 39): every failing check's call was a ``<failure>``, the check's own crash (or the loader's
    error) included, which JUnit readers count as the code under test failing."""
    args = ["-p", "no:randomly", "--junitxml", "out.xml"]
    result = gate.runpytest_subprocess(*args, "-p", "xdist", "-n", "2") if xdist else gate.runpytest(*args)
    result.assert_outcomes(passed=1, failed=3)  # (pytest's own counts: an error row failed in its call)
    cases = _testcases(gate.path / "out.xml")
    assert [child.tag for child in cases["check_breaks"] if child.tag in ("failure", "error")] == ["error"]
    assert "the check broke" in cases["check_breaks"].find("error").text
    assert [child.tag for child in cases["check_sees_its_failure"] if child.tag in ("failure", "error")] == ["failure"]
    assert cases["test_plain"].find("failure") is not None  # (no row: pytest's own)
    properties = {p.get("name"): p.get("value") for p in cases["check_breaks"].iter("property")}
    assert (properties["llmload_verdict"], properties["llmload_cause"]) == ("error", "check")
    suite = ET.parse(gate.path / "out.xml").getroot().find("testsuite")
    assert (suite.get("errors"), suite.get("failures"), suite.get("tests")) == ("1", "2", "4")


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_each_row_is_a_record_in_the_report_log_after_its_report(gate, xdist):
    pytest.importorskip("pytest_reportlog")
    args = ["-p", "no:randomly", "--report-log", "log.jsonl"]
    result = gate.runpytest_subprocess(*args, "-p", "xdist", "-n", "2") if xdist else gate.runpytest(*args)
    result.assert_outcomes(passed=1, failed=3)
    records = [json.loads(line) for line in (gate.path / "log.jsonl").read_text().splitlines()]
    rows = [r for r in records if r["$report_type"] == "LlmloadRow"]
    assert sorted((r["check"], r["verdict"], r["outcome"]) for r in rows) == [
        ("check_breaks", "error", "error"), ("check_passes", "passed", "passed"),
        ("check_sees_its_failure", "failed", "failed")]
    for row in rows:  # each right after its check's call report, with the row's fields (the main job's --json's)
        before = records[records.index(row) - 1]
        assert (before["$report_type"], before["nodeid"], before["when"]) == ("TestReport", row["nodeid"], "call")
        assert {"guards", "failure", "cause", "sentence", "notes", "fix", "loader"} <= set(row)
    assert next(r for r in rows if r["check"] == "check_sees_its_failure")["failure"] == "meta-backward"


def test_without_pytest_reportlog_junit_xml_still_gets_its_errors(gate):
    """The plugin needs neither: pytest-reportlog off, its option unknown, the JUnit part works."""
    result = gate.runpytest("-p", "no:randomly", "-p", "no:reportlog", "--junitxml", "out.xml")
    result.assert_outcomes(passed=1, failed=3)
    assert _testcases(gate.path / "out.xml")["check_breaks"].find("error") is not None
