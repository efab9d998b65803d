"""The one ``pytest -n 2`` run several tests read (fixtures/xdist_run.py): it counts one module's outcomes as pytest
counts a run's, and a test starts xdist workers of its own only where its run needs a configuration of its own
(issue 47: each such run costs two new interpreters that import the stack)."""

import json
import re
from pathlib import Path

from fixtures.xdist_run import XdistRun

ROOT = Path(__file__).parent.parent
# The test modules that start a `pytest -n N` of their own, and why the shared run cannot serve them.
OWN_XDIST_RUNS = {
    "tests/reports/test_html_report.py": "its report's every row and picture are counted: a run of its own suite",
    "tests/main_job/test_main_job.py": "the main job's own pytest under xdist, the loader from its ini",
    "tests/plugin/test_xdist_gpus.py": "a worker count and GPUs of each case's own (its workers import no stack)",
    "tests/loader/test_seam.py": "a usage error before any worker starts",
    "tests/test_bad_inputs.py": "usage errors before any worker starts",
    "tests/runners/test_launcher.py": "refused under torchrun before any worker starts",
}
STARTS_WORKERS = re.compile(r'"-n",\s*"(?:\d+|auto)"')


def test_only_a_run_that_needs_a_configuration_of_its_own_starts_xdist_workers():
    """Before: the tests of a row in JUnit XML and pytest-reportlog under xdist, of the header, of isolated tests,
    of offline mode and of the session summary each started their own ``pytest -n 2`` (two workers importing the
    stack each)."""
    starting = {str(path.relative_to(ROOT)) for path in (ROOT / "tests").rglob("*.py")
                if STARTS_WORKERS.search(path.read_text(encoding="utf-8"))}
    own_runs_without_a_reason = sorted(starting - set(OWN_XDIST_RUNS))
    assert not own_runs_without_a_reason, f"use the xdist_run fixture instead: {own_runs_without_a_reason}"


def _report(nodeid: str, when: str, outcome: str) -> str:
    return json.dumps({"$report_type": "TestReport", "nodeid": nodeid, "when": when, "outcome": outcome})


def test_a_modules_outcomes_are_counted_as_pytest_counts_a_runs(tmp_path):
    lines = [
        json.dumps({"$report_type": "SessionStart"}),
        _report("test_a.py::test_passes", "setup", "passed"), _report("test_a.py::test_passes", "call", "passed"),
        _report("test_a.py::test_passes", "teardown", "passed"),
        _report("test_a.py::test_fails", "call", "failed"),
        _report("test_a.py::test_skips", "setup", "skipped"),
        _report("test_a.py::test_setup_breaks", "setup", "failed"),
        _report("test_a.py::test_teardown_breaks", "call", "passed"),
        _report("test_a.py::test_teardown_breaks", "teardown", "failed"),
        _report("test_ab.py::test_elsewhere", "call", "failed"),  # another module, its name starting alike
    ]
    (tmp_path / "log.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    run = XdistRun(result=None, path=tmp_path)
    assert run.outcomes("test_a") == {"passed": 2, "failed": 1, "skipped": 1, "errors": 2}
