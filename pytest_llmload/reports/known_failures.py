"""Name the known failure when a test fails with one of its signatures: in this repo's tests and in any
repo that has the plugin installed, not only in the shipped checks."""

from __future__ import annotations

import traceback
from collections import Counter

import pytest


SECTION = "llmload: known failure"
matches_key = pytest.StashKey[Counter]()


def failure_text(excinfo: pytest.ExceptionInfo) -> str:
    """The exception, its chain and every frame's name: what the signatures are searched in."""
    return "".join(traceback.format_exception(excinfo.type, excinfo.value, excinfo.tb))


def annotate(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport) -> None:
    if not report.failed or call.excinfo is None:
        return
    from pytest_llmload.reports.row import Row

    row = Row.of_report(report)
    if row is not None and row.verdict != "failed":  # a check's error row names no known failure
        return
    text = failure_text(call.excinfo)
    from pytest_llmload import failures as catalog  # only a failing test needs it: plugin load stays cheap

    # A check's row names the failure it observed, and only that; any other failing test, what its text matches.
    found = [_observed(item, row.failure)] if row is not None and row.failure else catalog.match(text)
    found = [failure for failure in found if failure is not None]
    if not found:
        return
    report.sections.append((SECTION, "\n\n".join(failure.explain(text) for failure in found)))
    counter = item.config.stash.setdefault(matches_key, Counter())
    counter.update(failure.id for failure in found)


def _observed(item: pytest.Item, failure_id: str):
    """The failure a check's row names: a shipped one, or a repo's own (the check's record carries it)."""
    check = getattr(getattr(item, "callspec", None), "params", {}).get("check")
    if check is not None and getattr(check, "failure", None) is not None and check.failure.id == failure_id:
        return check.failure
    from pytest_llmload import failures as catalog

    return catalog.BY_ID.get(failure_id)


def summary_lines(config: pytest.Config) -> list[str]:
    counter = config.stash.get(matches_key, None)
    if not counter:
        return []
    named = ", ".join(f"{failure_id} ({count})" for failure_id, count in counter.most_common())
    return [f"llmload: failures matching known failures: {named}; see the '{SECTION}' sections above."]
