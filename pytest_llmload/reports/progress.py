"""A machine-readable record of a run, one JSON line per event, for the main job's live table.

Enabled by ``--llmload-progress PATH``; the main job (``python -m pytest_llmload``) reads the file while
pytest writes it, so a long check shows progress instead of silence. Events: ``usage_error`` (a check spec or an
installed extension that gives no checks, read at configure: the main job's usage error), ``loader`` (the loader
this run tests, and where that choice came from), ``collected`` (the count, the checks in collection order, and
what each guards against), ``collect_error``, ``console`` (a line the run shows at once: a slow import's progress),
``start`` and ``result`` (one per test, its row as it is, :class:`~pytest_llmload.reports.row.Row`: a check's as the
plugin decided it, a test's that runs no check one with no guards; the main job's parent makes the row again,
:meth:`~pytest_llmload.reports.row.Row.from_dict`), ``interrupted`` (what stopped the run early — its deadline, a
signal — with the stopped check's children's stacks). The main job's parent
learns everything it prints from these events: it imports no check. They hang off hooks that run in the
controlling process under xdist too.
"""

from __future__ import annotations

import os
import re
import time
from typing import Optional

import pytest

from pytest_llmload.system import json_lines
from pytest_llmload.reports.row import Row, row_name

_PARAM_ID = re.compile(r"\[(?:[^\]-]*-)?((?:check|predict)_[^\]]+)\]$")


def check_name(nodeid: str) -> str:
    """``check_x`` from ``...::test_loader_check[check_x]`` or ``...[loader-check_x]``; else the test name."""
    found = _PARAM_ID.search(nodeid)
    return found.group(1) if found else nodeid.rpartition("::")[2]


def name_of(item) -> str:
    """A collected test's name in the rows: its check's own (:func:`~pytest_llmload.reports.row.row_name`; a repo's
    check need not be named ``check_*``), else :func:`check_name`."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    check = params.get("check")
    return row_name(check, params.get("runner")) if hasattr(check, "failure") else check_name(item.nodeid)


_LOADER_ERRORS = ("pytest_llmload.loader.seam.LoaderError", "pytest_llmload.loader.seam.LoaderContractError",
                  "pytest_llmload.loader.seam.LoaderModelError", "LoaderError: ", "LoaderContractError: ",
                  "LoaderModelError: ")


def _guards(items) -> dict[str, list[str]]:
    """``{check: [failure id, origin]}`` for the collected tests that run a check: what the main job's table says a
    check guards against, also for a row it writes itself (a check that was running when pytest died)."""
    from pytest_llmload.reports.verdict import failure_origin

    guards = {}
    for item in items:
        check = getattr(getattr(item, "callspec", None), "params", {}).get("check")
        failure = getattr(check, "failure", None)
        if failure is not None:
            guards[name_of(item)] = [failure.id, failure_origin(failure)]
    return guards


def _crash_message(report: pytest.TestReport) -> str:
    """The exception line pytest found (``AssertionError: ...``), else the whole report text."""
    crash = getattr(report.longrepr, "reprcrash", None)
    return getattr(crash, "message", "") if crash is not None else str(report.longrepr or "")


def _raised_by_the_loader(report: pytest.TestReport) -> bool:
    message = _crash_message(report)
    return any(message.startswith(prefix) or f"\n{prefix}" in message for prefix in _LOADER_ERRORS) or \
        "loader error: " in (message.splitlines() or [""])[0]


def row_of_report(report: pytest.TestReport, seconds: float) -> Optional[Row]:
    """The row of the phase that decided a test's outcome (``None`` for a phase that passed before its call): a
    check's, decided once by the plugin and carried on its report, taken as it is; else, for a test that runs no
    check (a repo's own), a row with no guards, ``seconds`` its time. The progress file and the HTML report read
    the same row."""
    if report.when != "call" and report.outcome == "passed":
        return None
    row = Row.of_report(report)
    if row is not None:
        return row
    verdict, sentence = report.outcome, ""
    if hasattr(report, "wasxfail"):
        verdict, sentence = ("xfailed" if report.skipped else "xpassed"), report.wasxfail
    elif report.skipped and isinstance(report.longrepr, tuple):
        sentence = report.longrepr[2].removeprefix("Skipped: ")
    elif report.failed:
        verdict, sentence = ("failed" if report.when == "call" else "error"), summary_line(report)
        if _raised_by_the_loader(report):
            verdict = "error"  # the loader's own error, or a broken contract: not the check's failure
    return Row(check=check_name(report.nodeid), verdict=verdict, sentence=sentence, seconds=round(seconds, 3))


def summary_line(report) -> str:
    """A failure's cause in one line: the exception line pytest found (``AssertionError: ...``), else the
    report's first line (a child's death or deadline, a strict failure), never a tail of captured output. A check's
    row says more: its verdict's sentence (:mod:`pytest_llmload.reports.verdict`)."""
    line = next((line.strip() for line in _crash_message(report).splitlines() if line.strip()), "")
    return line.removeprefix("Failed: ")  # pytest.fail()'s message is the sentence; "Failed" says nothing


class ProgressWriter:
    def __init__(self, path: str) -> None:
        self._fd = json_lines.open_for_appending(path)
        self._started: dict[str, float] = {}
        self._names: dict[str, str] = {}  # nodeid -> the name its rows have (collected here; not under xdist)
        self._collected = False

    def write(self, **record) -> None:
        json_lines.append(self._fd, record)

    # Registered as a plugin object: these are its hooks.
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        from pytest_llmload.fixes.reference_loader import chosen_loader

        choice = chosen_loader(session.config)
        inifile = session.config.inipath if choice.source.startswith("ini ") else None
        self.write(event="loader", spec=choice.spec, source=choice.source,
                   inifile=None if inifile is None else str(inifile))

    @pytest.hookimpl(tryfirst=True)  # before the sub-plugins' (a DeepSpeed preload takes seconds): the count at once
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        if not self._collected:  # under xdist the controller collects nothing: see the next hook
            self._collected = True
            self._names = {item.nodeid: name_of(item) for item in session.items}
            self.write(event="collected", count=len(session.items), order=list(self._names.values()),
                       guards=_guards(session.items))

    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids) -> None:
        if not self._collected:  # every worker collects the same tests
            self._collected = True
            self.write(event="collected", count=len(ids), order=[check_name(nodeid) for nodeid in ids])

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.write(event="collect_error", nodeid=report.nodeid, message=report.longreprtext)

    def pytest_runtest_logstart(self, nodeid: str, location) -> None:
        self._started[nodeid] = time.perf_counter()
        self.write(event="start", nodeid=nodeid, check=self._names.get(nodeid) or check_name(nodeid))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """One record per test, from the phase that decided its outcome (a later teardown error adds one)."""
        started = self._started.get(report.nodeid, time.perf_counter())
        row = row_of_report(report, time.perf_counter() - started)
        if row is not None:
            self.write(event="result", nodeid=report.nodeid, row=row.as_dict())

    def close(self) -> None:
        os.close(self._fd)
