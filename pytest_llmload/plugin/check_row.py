"""A check's row at its report: around a check's call, the configuration's options and the notes it makes; at each
phase's report, the one :class:`~pytest_llmload.reports.row.Row` built from what happened (``llmload_strict``
applied first), recorded on the report and handed to ``pytest_llmload_check_result``; the status of a PREDICTED row
the repo does not gate on; and the known-failure section of any failing test, with its summary lines."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import pytest

from pytest_llmload.plugin.fixtures import configuration_of
from pytest_llmload.plugin.gates import in_use_key

if TYPE_CHECKING:
    from pytest_llmload.reports.row import Row

seconds_key = pytest.StashKey[float]()  # a test's phases so far, in seconds: its row's time


def check_of(item: pytest.Item):
    """The :class:`~pytest_llmload.checks.base.Check` a test runs (its ``check`` parameter), or ``None``."""
    check = getattr(getattr(item, "callspec", None), "params", {}).get("check")
    return check if hasattr(check, "failure") and hasattr(check, "function") else None


@pytest.hookimpl(wrapper=True, trylast=True)  # innermost: the known-failure section comes before the sub-plugins' ones
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    check = check_of(item)
    if check is not None:
        item.stash[seconds_key] = item.stash.get(seconds_key, 0.0) + report.duration
    failed = report.failed and call.excinfo is not None  # (before --llmload-strict turns a skip into a failure)
    if report.skipped and configuration_of(item.config).strict and isinstance(report.longrepr, tuple):
        from pytest_llmload.checks.base import NOT_EXERCISED

        reason = report.longrepr[2].removeprefix("Skipped: ")
        if reason.startswith(NOT_EXERCISED):
            report.outcome = "failed"
            report.longrepr = f"llmload strict: a check that exercised nothing is a failure here: {reason}"
    elif report.passed and call.when == "call" and check is not None and configuration_of(item.config).strict:
        assumed = _assumptions(item)
        if assumed:  # a verdict that rests on an assumption judged nothing the repo showed
            report.outcome = "failed"
            report.longrepr = (f"llmload strict: a verdict that rests on an assumption is not judged here: "
                               f"{'; '.join(assumed)}")
    if check is not None and (call.when == "call" or not report.passed):
        row = _row(item, check, report, call)
        if row.cause == "check":  # the check's own crash: say so first, the traceback below
            report.longrepr = f"{row.sentence}\n\n{report.longreprtext}"
        _record(item, report, row.properties())
        item.ihook.pytest_llmload_check_result(item=item, check=check, result=row.as_dict())
        if row.verdict == "predicted" and not (row.prediction or {}).get("gated", True):
            report.outcome = "passed"  # reported, not failing: the repo does not gate on this runner and model
    if failed:  # any failing test, llmload's or not; a check's section reads its row's verdict
        from pytest_llmload.reports import known_failures

        known_failures.annotate(item, call, report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Around a test that runs a check: the options the configuration gives checks, so that a repo's own
    ``parametrize_with_loader_checks`` test honours the ini keys without asking for ``llmload_check_options``."""
    if check_of(item) is None:
        return (yield)
    from pytest_llmload.config.stash_keys import check_notes, configured, notes_key

    notes: list[str] = []
    item.stash[notes_key] = notes
    tokens = (configured.set(configuration_of(item.config)), check_notes.set(notes))
    try:
        return (yield)
    finally:
        configured.reset(tokens[0])
        check_notes.reset(tokens[1])


def _assumptions(item: pytest.Item) -> tuple[str, ...]:
    """The notes a check made that its verdict rests on as assumptions (:data:`~pytest_llmload.checks.base.ASSUMED`)."""
    from pytest_llmload.checks.base import ASSUMED
    from pytest_llmload.config.stash_keys import notes_key

    return tuple(note for note in item.stash.get(notes_key, None) or () if note.startswith(ASSUMED))


def _row(item: pytest.Item, check, report: pytest.TestReport, call: pytest.CallInfo) -> Row:
    """The check's row (:func:`pytest_llmload.reports.verdict.row_of`) from what this phase's report says happened,
    with what the run carries: the runner a prediction is for, the notes it made wherever it ran, the loader that
    ran (a ``parametrize_with_loader_checks`` test's own, else the configured one), what the test's recorder saw (its
    isolated children's records came back into it with their answers; a prediction's loads are stand-ins: none)."""
    from pytest_llmload.config.stash_keys import notes_key, prediction_record_key
    from pytest_llmload.fixes.reference_loader import chosen_loader
    from pytest_llmload.plugin.loader_hang import FAILED_FAST
    from pytest_llmload.reports.progress import summary_line
    from pytest_llmload.reports.sections import recorder_key
    from pytest_llmload.reports.verdict import row_of

    params = getattr(getattr(item, "callspec", None), "params", {})
    happened: dict = {}
    if hasattr(report, "wasxfail"):
        happened["xfail"] = (not report.skipped, report.wasxfail)
    elif report.skipped and isinstance(report.longrepr, tuple):
        happened["skipped"] = report.longrepr[2].removeprefix("Skipped: ")
    elif report.failed:  # what the check raised, judged; else (a setup, a strict failure) pytest's line
        if call.when == "call" and call.excinfo is not None:
            happened["raised"] = call.excinfo.value
        happened.update(failed=summary_line(report), failed_in=report.when)
    recorder, prediction = item.stash.get(recorder_key, None), item.stash.get(prediction_record_key, None)
    artefacts = recorder.artefacts() if recorder is not None and prediction is None else None
    return row_of(check, runner=params.get("runner"), **happened,
                  loader=getattr(params.get("loader"), "name", None) or chosen_loader(item.config).spec,
                  notes=tuple(item.stash.get(notes_key, None) or ()), assumptions=_assumptions(item),
                  prediction=prediction, artefacts=artefacts if artefacts and any(artefacts.values()) else None,
                  not_run=report.failed and
                  summary_line(report).removeprefix(f"{check.name}: ").startswith(FAILED_FAST),
                  seconds=round(item.stash[seconds_key], 3))


def _record(item: pytest.Item, report: pytest.TestReport, pairs: list) -> None:
    """Properties of this phase's report (what the progress file reads) and of the item (what JUnit XML writes,
    from the teardown report, which copies the item's)."""
    report.user_properties.extend(pairs)
    item.user_properties.extend(pairs)


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    """A PREDICTED row the repo does not gate on passed the run, and says what it is: ``P``, ``PREDICTED``."""
    if report.when != "call" or not report.passed or not config.stash.get(in_use_key, False):
        return None  # (a run that never uses the plugin imports none of its reports)
    from pytest_llmload.reports.row import VERDICT_PROPERTY

    if (VERDICT_PROPERTY, "predicted") in report.user_properties:
        return "predicted", "P", "PREDICTED (not gated)"
    return None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    known_failures = sys.modules.get("pytest_llmload.reports.known_failures")
    for line in known_failures.summary_lines(config) if known_failures else ():
        terminalreporter.write_line(line)
