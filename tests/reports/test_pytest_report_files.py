"""A check's row in pytest's own report files (:mod:`pytest_llmload.reports.pytest_report_files`): JUnit XML writes an
``error`` row as ``<error>``, pytest-reportlog's stream gets each row as a record, and neither needs the other."""

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fixtures.xdist_run import GATE

pytestmark = pytest.mark.timeout(180)

@pytest.fixture
def gate(pytester, monkeypatch):
    """Three checks of a repo's own (a failure seen, the check's own crash: an error row, a pass) and a plain test:
    the module test_gate of the shared xdist run (fixtures/xdist_run.py), here in a run of its own."""
    pytester.makepyfile(**GATE)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path))  # (xdist's workers, new interpreters, import mychecks too)
    monkeypatch.syspath_prepend(pytester.path)
    return pytester


def _testcases(path) -> dict[str, ET.Element]:
    """test_gate's test cases by check (or test) name."""
    return {case.get("name").rpartition("-")[2].rstrip("]"): case for case in ET.parse(path).getroot().iter("testcase")
            if case.get("classname") == "test_gate"}


def _run(request, xdist: bool, *args: str) -> tuple[dict[str, int], Path]:
    """test_gate's outcomes and the directory its report files are in: a run of its own, or under xdist the shared
    run's (every output on, the other modules' tests beside)."""
    if xdist:
        shared = request.getfixturevalue("xdist_run")
        return shared.outcomes("test_gate"), shared.path
    gate = request.getfixturevalue("gate")
    result = gate.runpytest("-p", "no:randomly", *args)
    return {k: v for k, v in result.parseoutcomes().items() if k not in ("warnings", "warning")}, gate.path


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_an_error_row_is_an_error_in_junit_xml_and_a_failure_stays_a_failure(request, xdist):
    """Before (issue 39): every failing check's call was a ``<failure>``, the check's own crash (or the loader's
    error) included, which JUnit readers count as the code under test failing."""
    outcomes, path = _run(request, xdist, "--junitxml", "out.xml")
    assert outcomes == {"passed": 1, "failed": 3}  # (pytest's own counts: an error row failed in its call)
    cases = _testcases(path / "out.xml")
    assert [child.tag for child in cases["check_breaks"] if child.tag in ("failure", "error")] == ["error"]
    assert "the check broke" in cases["check_breaks"].find("error").text
    assert [child.tag for child in cases["check_sees_its_failure"] if child.tag in ("failure", "error")] == ["failure"]
    assert cases["test_plain"].find("failure") is not None  # (no row: pytest's own)
    properties = {p.get("name"): p.get("value") for p in cases["check_breaks"].iter("property")}
    assert (properties["llmload_verdict"], properties["llmload_cause"]) == ("error", "check")
    suite = ET.parse(path / "out.xml").getroot().find("testsuite")
    # Under xdist the shared run's other modules add their 19 tests and 1 failure (test_isolated's hang).
    assert (suite.get("errors"), suite.get("failures"), suite.get("tests")) == (("1", "3", "23") if xdist else
                                                                              ("1", "2", "4"))


@pytest.mark.parametrize("xdist", [False, True], ids=["plain", "xdist"])
def test_each_row_is_a_record_in_the_report_log_after_its_report(request, xdist):
    pytest.importorskip("pytest_reportlog")
    outcomes, path = _run(request, xdist, "--report-log", "log.jsonl")
    assert outcomes == {"passed": 1, "failed": 3}
    records = [json.loads(line) for line in (path / "log.jsonl").read_text().splitlines()]
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
