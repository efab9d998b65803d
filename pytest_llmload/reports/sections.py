"""Diagnostics in the test report: phase timings, where the models are, and a summary of the session.

Switched on by its gate in ``plugin.gates`` when a run uses the plugin. For every test:

- its phases (:mod:`pytest_llmload.instruments.phases`: loads through the loader seam, the checks' steps, your own
  ``with phase(...)``) are recorded; a failing test's report gets a section ``llmload: phases`` with the
  table and the phase that was running when it failed (a pytest-timeout deadline included);
- a phase that runs longer than ``llmload_phase_progress_seconds`` prints a progress line to the terminal
  (stderr) every that many seconds: write-up 001's silence, broken;
- a failing test's report gets ``llmload: where the models are`` for each model it loaded
  (:mod:`pytest_llmload.instruments.device_map_summary`);
- under pytest-timeout's ``thread`` method, which ends the process without a report, the phase table is
  printed shortly before the deadline instead (5% of it or 0.5 s before, whichever is earlier).

The session ends with a summary: models loaded and their load times, the peak memory seen in a phase, the tests
and checks that took more than ``llmload_near_deadline`` (default 0.8) of their deadline, and, for a run with
predictions, where the model would go on each runner (:func:`pytest_llmload.placement.picture.where_the_model_goes`).
Nothing here imports torch.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import NamedTuple, Optional

import pytest

from pytest_llmload.reports.row import Row, assumption_lines
from pytest_llmload.placement.picture import where_the_model_goes
from pytest_llmload.instruments.device_map_summary import placement_lines
from pytest_llmload.system.sizes import format_bytes
from pytest_llmload.config.vocabulary import SETTING
from pytest_llmload.instruments.heartbeat import heartbeat
from pytest_llmload.instruments.recorder import PhaseRecorder, recording

DEFAULT_NEAR_DEADLINE = SETTING["near_deadline"].default
# Under pytest-timeout's thread method the table is printed this long before the kill: 5% of the deadline, but
# at least 0.5 s (a busy 2-core runner can take 0.1 s to wake the printing thread) and at most half of it.
THREAD_METHOD_LEAD = (0.05, 0.5)
SLOWEST_SHOWN = 5
PHASES_SECTION = "llmload: phases"
MODELS_SECTION = "llmload: where the models are"


class Settings(NamedTuple):
    progress_every: Optional[float]
    near_deadline: float
    emit: "TerminalLines"


class Deadline(NamedTuple):
    started: float
    timeout: float
    method: str
    func_only: bool


settings_key = pytest.StashKey[Settings]()
session_key = pytest.StashKey["SessionDiagnostics"]()
recorder_key = pytest.StashKey[PhaseRecorder]()
deadline_key = pytest.StashKey[Deadline]()
call_end_key = pytest.StashKey[float]()


def thread_method_warning_after(timeout: float) -> float:
    """Seconds into a pytest-timeout deadline at which the phase table is printed under the thread method."""
    fraction, floor = THREAD_METHOD_LEAD
    return timeout - min(max(fraction * timeout, floor), timeout / 2)


class TerminalLines:
    """Writes lines to the terminal's stderr from any thread, past pytest's output capture: the file
    descriptor is duplicated at configure time, while capture is suspended. Under xdist a worker's stderr
    is the terminal's too."""

    def __init__(self) -> None:
        try:
            self._stream = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
            self._owned = True
        except (OSError, ValueError):
            self._stream, self._owned = sys.__stderr__, False
        self._last_head = None

    def __call__(self, line: str) -> None:
        # A new phase's first line starts on a line of its own, not after the progress dots.
        head = line.partition(" running for ")[0]
        lead = "" if head == self._last_head else "\n"
        self._last_head = head
        try:
            self._stream.write(lead + line + "\n")
            self._stream.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self._owned:
            self._stream.close()


# --- configuration ----------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    from pytest_llmload.config import settings

    every, near = settings.value(config, "phase_progress_seconds"), settings.value(config, "near_deadline")
    config.stash[settings_key] = Settings(every or None, near, TerminalLines())
    session = config.stash[session_key] = SessionDiagnostics(near, strict=bool(settings.value(config, "strict")))
    config.pluginmanager.register(session, "llmload-diagnostics-session")


def pytest_unconfigure(config: pytest.Config) -> None:
    settings = config.stash.get(settings_key, None)
    if settings is not None:
        settings.emit.close()
    session = config.stash.get(session_key, None)
    if session is not None and config.pluginmanager.is_registered(session):
        config.pluginmanager.unregister(session)


# --- per test ---------------------------------------------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    settings = item.config.stash[settings_key]
    recorder = PhaseRecorder(item.nodeid, progress_every=settings.progress_every, emit=settings.emit)
    item.stash[recorder_key] = recorder
    try:
        with recording(recorder=recorder):
            return (yield)
    finally:
        heartbeat().cancel(("deadline", item.nodeid))
        del item.stash[recorder_key]


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings):
    """pytest-timeout starts a test's timer: note when, and under the thread method (which ends the process
    without a report) print the phase table just before it fires."""
    item.stash[deadline_key] = Deadline(time.monotonic(), float(settings.timeout), settings.method,
                                        bool(settings.func_only))
    recorder = item.stash.get(recorder_key, None)
    if settings.method == "thread" and recorder is not None:
        emit = item.config.stash[settings_key].emit

        after = thread_method_warning_after(float(settings.timeout))

        def warn(_key) -> None:
            emit(f"llmload: {item.nodeid} is {after:g} s into its {settings.timeout:g} s "
                 f"pytest-timeout (method thread: the process ends without a report); phases so far:\n"
                 + recorder.table())

        heartbeat().schedule(("deadline", item.nodeid), after, warn)
    return (yield)


def _phases_section(recorder: PhaseRecorder, report: pytest.TestReport) -> str:
    running = [p for p in recorder.phases if p.running]
    ended_by = recorder.interrupted()
    if not report.failed:
        return recorder.table()
    if running:
        first = "; ".join(f"phase '{p.label}' was still running ({p.seconds:.2f} s in, thread {p.thread})"
                          for p in running)
    elif ended_by is not None:
        first = (f"the test failed in phase '{ended_by.label}', {ended_by.seconds:.2f} s in: "
                 f"{ended_by.error}")
    else:
        last = max(recorder.phases, key=lambda p: p.ended or 0.0)
        first = f"no phase was running when it failed; the last to end was '{last.label}'"
    return first + "\n" + recorder.table()


def _models_section(recorder: PhaseRecorder) -> str:
    blocks = []
    for loaded in recorder.models:
        took = f", loaded in {loaded.seconds:.2f} s" if loaded.seconds is not None else ""
        head = f"{loaded.kind} from {loaded.source or '?'}{took}"
        model = loaded.model
        if model is None:
            lines = ["(no longer alive when the report was made)"]
            if loaded.device_map:
                lines.append(f"hf_device_map at load: {loaded.device_map}")
        else:
            lines = placement_lines(model)
        blocks.append("\n".join([head] + [f"  {line}" for line in lines]))
    return "\n".join(blocks)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    recorder = item.stash.get(recorder_key, None)
    if recorder is None:
        return report
    if recorder.phases and (report.failed or (call.when == "call" and report.passed)):
        report.sections.append((PHASES_SECTION, _phases_section(recorder, report)))
    if report.failed and recorder.models:
        report.sections.append((MODELS_SECTION, _models_section(recorder)))
    if call.when == "call":
        item.stash[call_end_key] = time.monotonic()
    if call.when == "teardown":
        report.llmload_diagnostics = _test_record(item, recorder)
    return report


def _test_record(item: pytest.Item, recorder: PhaseRecorder) -> dict:
    """What the session summary needs from one test, as plain data (xdist sends it to the controller)."""
    record: dict = {"models": [m.as_dict() for m in recorder.models],
                    "checks": [list(d) for d in recorder.deadlines]}
    peaks = [(p.rss_peak, p.label) for p in recorder.phases if p.rss_peak is not None]
    if peaks:
        record["rss_peak"] = list(max(peaks))
    cuda: dict[str, list] = {}
    for p in recorder.phases:
        for index, peak in p.cuda_peak.items():
            if peak > cuda.get(str(index), [-1])[0]:
                cuda[str(index)] = [peak, p.label]
    if cuda:
        record["cuda_peak"] = cuda
    deadline = item.stash.get(deadline_key, None)
    if deadline is not None and deadline.timeout > 0:
        end = item.stash.get(call_end_key, None) if deadline.func_only else None
        record["deadline"] = [(end or time.monotonic()) - deadline.started, deadline.timeout]
    return record


# --- the session ------------------------------------------------------------------------------------------


class SessionDiagnostics:
    """The session's figures; registered as a plugin per config, it collects each test's record (in the
    xdist controller, from the workers' reports)."""

    def __init__(self, near_fraction: float = DEFAULT_NEAR_DEADLINE, strict: bool = False) -> None:
        self.near_fraction = near_fraction
        self.models: list[tuple[str, dict]] = []  # (nodeid, model record)
        self.rss_peak: Optional[tuple[int, str, str]] = None  # (bytes, nodeid, phase)
        self.cuda_peak: dict[str, tuple[int, str, str]] = {}
        self.near: list[tuple[float, float, str, str]] = []  # (seconds, deadline, nodeid, what)
        self.torch_peak: Optional[tuple[int, str, str]] = None  # (bytes, device, nodeid)
        self.predictions: dict[str, tuple[str, dict]] = {}  # nodeid: (check, its row's prediction)
        self.assumptions: dict[str, tuple[str, Optional[str], tuple[str, ...]]] = {}  # nodeid: (check, guards, ...)
        self.strict = strict  # (--llmload-strict: the rows that rest on an assumption failed)

    def add(self, nodeid: str, record: dict) -> None:
        near_fraction = self.near_fraction
        self.models += [(nodeid, model) for model in record.get("models", [])]
        if "rss_peak" in record and (self.rss_peak is None or record["rss_peak"][0] > self.rss_peak[0]):
            self.rss_peak = (record["rss_peak"][0], nodeid, record["rss_peak"][1])
        for index, (peak, label) in record.get("cuda_peak", {}).items():
            if peak > self.cuda_peak.get(index, (-1,))[0]:
                self.cuda_peak[index] = (peak, nodeid, label)
        if "deadline" in record:
            took, timeout = record["deadline"]
            if took > near_fraction * timeout:
                self.near.append((took, timeout, nodeid, "pytest-timeout"))
        for what, took, deadline in record.get("checks", []):
            if deadline > 0 and took > near_fraction * deadline:
                self.near.append((took, deadline, nodeid, f"check deadline: {what}"))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        record = getattr(report, "llmload_diagnostics", None)
        if record is not None:
            self.add(report.nodeid, record)
        row = Row.of_report(report)  # (a teardown report carries the call's row again: one per test)
        if row is not None and row.prediction:
            self.predictions[report.nodeid] = (row.check, row.prediction)
        if row is not None and row.assumptions:
            self.assumptions[report.nodeid] = (row.check, row.guards, row.assumptions)
        for device, peak in (getattr(report, "llmload_torch_peak", None) or {}).items():
            if self.torch_peak is None or peak > self.torch_peak[0]:
                self.torch_peak = (peak, device, report.nodeid)

    def lines(self) -> list[str]:
        near_fraction, lines = self.near_fraction, []
        if self.models:
            times = [m["seconds"] for _, m in self.models if m.get("seconds") is not None]
            tests = len({nodeid for nodeid, _ in self.models})
            lines.append(f"models loaded: {len(self.models)} in {tests} test{'s' if tests != 1 else ''}"
                         + (f", {sum(times):.2f} s in all (median {statistics.median(times):.2f} s, "
                            f"slowest {min(SLOWEST_SHOWN, len(times))}):" if times else ""))
            slowest = sorted(self.models, key=lambda nm: -(nm[1].get("seconds") or 0.0))[:SLOWEST_SHOWN]
            for nodeid, m in slowest:
                source = os.path.basename(str(m.get("source") or "").rstrip("/")) or "?"
                lines.append(f"  {m.get('seconds') or 0.0:7.2f} s  {m['kind']} from {source} on {m['where']}  {nodeid}")
        peaks = []
        if self.rss_peak is not None:
            peaks.append(f"process RSS {format_bytes(self.rss_peak[0])} ({self.rss_peak[1]}, phase "
                         f"'{self.rss_peak[2]}')")
        peaks += [f"cuda:{i} allocated {format_bytes(b)} ({nodeid}, phase '{label}')"
                  for i, (b, nodeid, label) in sorted(self.cuda_peak.items())]
        if self.torch_peak is not None:
            peaks.append(f"torch allocation under limit_torch_memory {format_bytes(self.torch_peak[0])} on "
                         f"{self.torch_peak[1]} ({self.torch_peak[2]})")
        if peaks:
            lines.append("peak memory: " + "; ".join(peaks))
        if self.near:
            lines.append(f"near or past their deadline (over {near_fraction:.0%} of it):")
            for took, deadline, nodeid, what in sorted(self.near, key=lambda n: -n[0] / n[1]):
                lines.append(f"  {took:.2f} s of {deadline:g} s ({took / deadline:.0%})  {nodeid}  ({what})")
        lines += where_the_model_goes(list(self.predictions.values()), "each row's llmload_row property")[1:]
        lines += assumption_lines(list(self.assumptions.values()), SETTING["strict"].option, self.strict)
        return lines


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or session_key not in config.stash:
        return
    lines = config.stash[session_key].lines()
    if lines:
        terminalreporter.write_sep("=", "llmload diagnostics")
        for line in lines:
            terminalreporter.write_line(line)
