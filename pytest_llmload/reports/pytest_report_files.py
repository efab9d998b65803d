"""A check's row in the report files pytest users already read: JUnit XML (``--junitxml``) and pytest-reportlog's
stream (``--report-log``).

- JUnit XML: pytest writes a test that failed in its call as ``<failure>``; a row whose verdict is ``error`` (the
  loader's own error, a broken contract, a hang, a crash: nothing the check guards against,
  :mod:`pytest_llmload.reports.verdict`) is written as ``<error>``, and counted in the suite's ``errors``, as pytest
  does for a setup that failed. Its text is pytest's; its message is the row's finding and fix (a CI summary shows the
  message alone: pytest's would be the exception's first line, a loader's error or a line of this plugin's source);
  its properties are the row's (:meth:`~pytest_llmload.reports.row.Row.properties`).
- pytest-reportlog: after each check's report, its row as one record, ``{"$report_type": "LlmloadRow", "nodeid":
  ..., "outcome": ..., **row}``: the same fields as the main job's ``--json`` rows, in the stream pytest users
  already parse. Without pytest-reportlog installed, or without ``--report-log``, nothing is written.

Registered by the plugin at configure only where one of those options is given; it reads reports in the process
that writes the files (xdist's controller).
"""

from __future__ import annotations

import pytest

from pytest_llmload.reports.row import Row

ROW_RECORD = "LlmloadRow"  # the record's $report_type


MESSAGE_CHARACTERS = 400  # of the finding's first line (pytest's own budget for the whole attribute is 500)


def junit_message(row: Row) -> str:
    """A failed or error row's JUnit ``message``: its finding's first line, then the fix where the row names one."""
    finding = next((line.strip() for line in row.sentence.splitlines() if line.strip()), row.verdict)
    finding = finding if len(finding) <= MESSAGE_CHARACTERS else finding[:MESSAGE_CHARACTERS] + "..."
    return f"{finding}\nfix: {row.fix}" if row.fix else finding


class RowsInReportFiles:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(trylast=True)  # after pytest's junitxml and pytest-reportlog have written the report
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and not report.failed and not report.skipped:
            return  # (a passing setup or teardown: a row is on the phase that decided the outcome)
        row = Row.of_report(report)
        if row is None:  # a test that runs no check
            return
        if report.when == "call" and report.failed:
            self._junit_row(report, row)
        self._report_log(report, row)

    def _junit_row(self, report: pytest.TestReport, row: Row) -> None:
        """The ``<failure>`` pytest just wrote for this call with the row's message, and as ``<error>`` where the
        row's verdict is an error."""
        from _pytest.junitxml import xml_key  # (pytest's own key for its LogXML: no public handle exists)

        xml = self.config.stash.get(xml_key, None)
        if xml is None:
            return
        testcase = xml.node_reporter(report)
        failure = next((node for node in reversed(testcase.nodes) if node.tag == "failure"), None)
        if failure is None:
            return
        failure.set("message", junit_message(row))
        if row.verdict == "error":
            failure.tag = "error"
            xml.stats["failure"] -= 1
            xml.stats["error"] += 1

    def _report_log(self, report: pytest.TestReport, row: Row) -> None:
        plugin = getattr(self.config, "_report_log_plugin", None)  # (pytest-reportlog's, where --report-log is given)
        write = getattr(plugin, "_write_json_data", None)  # its one writer: a JSON line, flushed
        if write is not None:
            write({"$report_type": ROW_RECORD, "nodeid": report.nodeid, "when": report.when, **row.as_dict()})
