"""The main job's pytest process: its command line, starting it, following its progress file, stopping it.

pytest runs the shipped suite in a child process (its full output goes to a log file); this process reads the
child's progress file (:mod:`pytest_llmload.reports.progress`) as it is written and prints each check's row as its
result arrives, a heartbeat while one runs long, each line fitted to the terminal (:mod:`.terminal`). Everything it
prints comes from those events: the loader the child chose, the checks collected and what each guards against, each
row. Exit codes, pytest's own: 0 nothing failed, 1 a check failed, 2 interrupted (a KeyboardInterrupt in a check, or
collection errors), 4 usage error (a loader that does not import, say), 5 no check selected (``-k`` matched none),
128 + N when the main job itself was stopped by signal N (130 for Ctrl-C, 143 for SIGTERM); 2 too when the run's
``--deadline`` passed.

The parent owns everything below it: the pytest child runs in its own process group, ends when the parent ends
however it ends (:mod:`pytest_llmload.runners.lifeline`), and gets the signal the parent got (SIGINT, SIGTERM,
SIGHUP), so that it stops as on Ctrl-C, its finalizers kill the checks' children and remove their temp dirs, and its
report files say what stopped it. ``--deadline S`` is pytest's own run deadline (``--llmload-run-deadline``), which
marks its report files; the parent stops pytest itself where it has not ended :data:`STOP_GRACE_S` after it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from pytest_llmload.config.vocabulary import (
    CHECKS_OPTION,
    LOADER_OPTION,
    MODEL_OPTION,
    RUNNER_OPTION,
    SETTING,
    WAIT_OPTION,
)
from pytest_llmload.main_job.terminal import columns, cut, wrapped
from pytest_llmload.reports.row import Row
from pytest_llmload.system import json_lines, output_files

# pytest's exit codes (pytest.ExitCode: this process does not import pytest), passed on as pytest means them.
EXIT_OK, EXIT_FAILED, INTERRUPTED, EXIT_USAGE, EXIT_NO_TESTS = 0, 1, 2, 4, 5
HEARTBEAT_SECONDS = 10.0
# After passing a signal on, how long pytest gets to stop and clean up before its process group is killed.
STOP_GRACE_S = 10.0
POLL_S = 0.2  # how often the progress file is read
WAIT_AFTER_HANG = "--wait-after-hang"
FAIL_NOT_EXERCISED = "--fail-not-exercised"  # pytest's --llmload-strict
DEADLINE = "--deadline"  # pytest's --llmload-run-deadline

# The pytest options the main job passes on under its own names: how a message from pytest is shown here.
_OWN_NAMES = {LOADER_OPTION: "--loader", WAIT_OPTION: WAIT_AFTER_HANG, CHECKS_OPTION: "--checks",
              RUNNER_OPTION: "--runner", MODEL_OPTION: "--model", SETTING["strict"].option: FAIL_NOT_EXERCISED,
              SETTING["run_deadline"].option: DEADLINE}


def in_main_job_terms(text: str) -> str:
    """The pytest options a message names, as this command spells them."""
    for option, own in _OWN_NAMES.items():
        text = text.replace(option, own)
    return text


SUITE_DIR = Path(__file__).resolve().parents[1] / "suite"  # pytest_llmload/suite: the shipped suite


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_command(loader: Optional[str], keyword: Optional[str], progress: Path, extra: list[str],
                   strict: bool = False, wait_after_hang: bool = False, runner: Optional[str] = None,
                   model: Optional[str] = None, checks: tuple = (), deadline: Optional[float] = None) -> list[str]:
    # (no:hypothesispytest: its plugin imports all of hypothesis at the end of a run, a second for nothing here)
    # (pytest_llmload.suite's __main__: pytest, without the interpreter's 2 s teardown of the stack)
    # (no:unraisableexception: at its end it runs gc.collect() twice over the stack's millions of objects, 0.5 s for a
    # warning about an exception in a __del__; such an exception still reaches the log, through Python's own hook)
    argv = [sys.executable, "-m", "pytest_llmload.suite", "--pyargs", "pytest_llmload.suite", "-p", "no:cacheprovider",
            "-p", "no:hypothesispytest", "-p", "no:unraisableexception", "-o", "python_files=test_*.py", "--tb=short",
            "-q", "--llmload-progress", str(progress)]
    # The main job decides what it runs under, not the repo's addopts: its rows in a stable order (no
    # pytest-randomly), no coverage, no xdist, no plugin its checks never use (anyio's, pytest-html and its
    # pytest-metadata: 0.3 s of pytest's start), unless asked for after '--' (then the plugin is left on).
    argv += ["-o", "addopts="]
    # Nor the conftest.py files above the suite's folder, which pytest loads where the package lies inside a repo (an
    # editable install, a venv in the repo): this repo's own made the GPU-less server import torch alone, so that every
    # rank of the distributed checks imported the stack itself (issue 40: 56.5 s and 18.5 s on the H200).
    argv += ["--confcutdir", str(SUITE_DIR)]
    asked = " ".join(extra)
    for plugin, flags in HOUSE_PLUGINS.items():
        if not any(flag in asked for flag in flags):
            argv += ["-p", f"no:{plugin}"]
    if strict:
        argv.append("--llmload-strict")
    if wait_after_hang:
        argv.append(WAIT_OPTION)
    if loader:
        argv += [LOADER_OPTION, loader]
    if runner:
        argv += [RUNNER_OPTION, runner]
    if model:
        argv += [MODEL_OPTION, model]
    for spec in checks:
        argv += [CHECKS_OPTION, spec]
    if deadline:
        argv += [SETTING["run_deadline"].option, f"{deadline:g}"]
    if keyword:
        argv += ["-k", keyword]
    return argv + extra


# Plugins the main job turns off unless the arguments after '--' use them: name -> the flags that ask for it.
HOUSE_PLUGINS = {"randomly": ("-p randomly", "--randomly"), "pytest_cov": ("--cov",),
                 "xdist": ("-n", "--dist", "--tx"), "anyio": ("-p anyio",), "html": ("--html",),
                 "metadata": ("--html", "--metadata")}


def shown(outcome: str) -> str:
    """The result column: passed, FAILED (the check saw its failure), PREDICTED (a runner profile would hit one),
    error (the loader's own error), skipped."""
    return outcome.upper() if outcome in ("failed", "predicted", "xpassed") else outcome


OUTCOME_WIDTH = len("PREDICTED")  # the longest word of the result column


def seconds_shown(row: Row, width: int = 0) -> str:
    """A row's time, ``5.35s`` (``?`` where the row has none)."""
    return f"{row.seconds:{width}.2f}s" if row.seconds is not None else "?".rjust(width + 1)


def progress_row(done: int, total: int, row: Row, name_width: int = 48, width: Optional[int] = None) -> str:
    """A row as its result arrives: ``[1/3] check_x   passed   5.35s``, the name padded to ``name_width`` (the
    longest collected), and cut where the line would be wider than ``width``."""
    digits = len(str(total)) if total else 2
    counter = f"[{done:>{digits}}/{total or '?'}] "
    seconds = seconds_shown(row, 7)
    room = name_width if width is None else min(name_width, width - len(counter) - OUTCOME_WIDTH - len(seconds) - 2)
    room = max(room, 8)
    return f"{counter}{cut(row.check, room):<{room}} {shown(row.outcome):<{OUTCOME_WIDTH}} {seconds}"


def deadline_passed(seconds: float) -> str:
    return f"the run's deadline ({DEADLINE} {seconds:g}) passed"


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP reached the main job; or its ``--deadline`` (``deadline``, seconds) passed, and its
    pytest had not stopped itself."""

    def __init__(self, signum: int, deadline: Optional[float] = None):
        super().__init__(signum)
        self.signum, self.deadline = signum, deadline

    def said(self) -> str:
        """What stopped the run: ``interrupted by SIGTERM``, ``the run's deadline (--deadline 2) passed``."""
        if self.deadline is not None:
            return deadline_passed(self.deadline)
        return f"interrupted by {'SIGINT (Ctrl-C)' if self.signum == signal.SIGINT else signal.Signals(self.signum).name}"


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum, frame) -> None:
    for stop in STOP_SIGNALS:  # one stop at a time: a second signal must not break off the clean-up
        signal.signal(stop, signal.SIG_IGN)
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_interrupt():
    """SIGINT, SIGTERM and SIGHUP raise :class:`Interrupted` in the block (from the main thread only)."""
    if threading.current_thread() is not threading.main_thread():  # run() called from a thread: leave them be
        yield
        return
    saved = {signum: signal.signal(signum, _raise_interrupted) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


class MainJob:
    """One run: the pytest child, and what its progress file said so far.

    ``popen`` starts the child: :class:`subprocess.Popen` (a new interpreter), or what takes its arguments and
    returns a handle like it; this repo's tests pass :func:`fixtures.warm_popen.popen_forked`, which forks
    the child from the test process, where the stack is imported already."""

    def __init__(self, args: argparse.Namespace, workdir: Path, out, popen=None) -> None:
        self.args, self.workdir, self.out = args, workdir, out
        self.popen = popen or subprocess.Popen
        self.progress = workdir / "progress.jsonl"
        self.tmp = workdir / "tmp"
        self.log_path = Path(args.log) if args.log else workdir / "pytest.log"
        self.child: Optional[subprocess.Popen] = None
        self.child_started = time.monotonic()
        self.results: list[Row] = []  # (the progress file's rows, made again: Row.from_dict)
        self.collect_errors: list[dict] = []
        self.usage_error: Optional[str] = None  # the child's, read at its configure (a check spec that gives none)
        self.total = 0
        self.order: list[str] = []  # the checks in collection order, the table's and JSON's
        self.guards: dict[str, list[str]] = {}  # check -> [failure it guards against, where that comes from]
        self.running: dict[str, tuple[str, float]] = {}  # nodeid -> (check, started): no result yet
        self.started = time.monotonic()
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.loader: Optional[dict] = None  # the child's own choice (its "loader" event)
        self.interruption: Optional[dict] = None  # what stopped the child, as it said (its "interrupted" event)
        self.width = columns(out)  # every line printed fits it
        self.name_width = 48  # the progress rows' name column: the longest collected name, once collected
        self._offset = 0

    def start(self) -> None:
        args = self.args
        command = pytest_command(args.loader, args.keyword, self.progress, args.pytest_args,
                                 strict=args.fail_not_exercised, wait_after_hang=args.wait_after_hang,
                                 runner=args.runner, model=args.model, checks=tuple(args.checks),
                                 deadline=args.deadline)
        from pytest_llmload.runners.lifeline import PARENT_ENV, PARENT_WORKDIR_ENV

        # The child ends with this process (lifeline), and removes this temp dir if this process dies first. Its
        # own temp dirs (pytest's, the isolated checks') are made in here: one removal takes them all, on every path.
        self.tmp.mkdir()
        env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},  # (the main job decides; see above)
               "TMPDIR": str(self.tmp), PARENT_ENV: str(os.getpid()),
               PARENT_WORKDIR_ENV: str(self.workdir)}
        with output_files.open_output(self.log_path) as log:  # (--log: no link another user made)
            # Its own process group: a Ctrl-C in the terminal reaches this process only, which passes it on once.
            self.child = self.popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    process_group=0)
        self.child_started = time.monotonic()  # (its run deadline counts from here)

    def follow(self) -> int:
        """Print a row per result as the child writes them, a heartbeat while one check runs long; the exit code."""
        last_beat = time.monotonic()
        while True:
            code = self.child.poll()
            for record in self._new_records():
                if record["event"] == "start":
                    last_beat = time.monotonic()
                self._take(record)
            if code is not None:
                return code
            deadline = self.args.deadline
            if deadline and time.monotonic() - self.child_started > deadline + STOP_GRACE_S:  # pytest missed its own
                raise Interrupted(signal.SIGTERM, deadline)
            if self.running and time.monotonic() - last_beat > HEARTBEAT_SECONDS:
                last_beat = time.monotonic()
                for check, started in self.running.values():
                    print(cut(f"    ... {check} still running ({time.monotonic() - started:.0f}s)", self.width),
                          file=self.out, flush=True)
            # (a wait, not a sleep: the run's end is seen within 50 ms, not after up to 0.2 s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.child.wait(POLL_S)

    def _new_records(self) -> list[dict]:
        records, self._offset = json_lines.read_from(self.progress, self._offset)
        return records

    def _take(self, record: dict) -> None:
        event, out = record["event"], self.out
        if event == "usage_error":  # said by table.report, as this command's own usage error
            self.usage_error = record["message"]
        elif event == "loader":  # the child's own choice: what this line says is the loader it runs
            self.loader = {"spec": record["spec"], "source": in_main_job_terms(record["source"]),
                           "inifile": record.get("inifile")}
            source = in_main_job_terms(record["source"])
            if record.get("inifile"):
                source += f" in {record['inifile']}"
            self.say(f"llmload: checking loader {record['spec']} (from {source})")
        elif event == "collected":
            self.total = record["count"]
            self.order = record.get("order", [])
            self.name_width = max(map(len, self.order), default=self.name_width)
            self.guards = record.get("guards", {})
            print(f"llmload: {self.total} checks collected", file=out, flush=True)
        elif event == "collect_error":
            self.collect_errors.append(record)
        elif event == "interrupted":  # what stopped it (a deadline, a signal) and the stacks it took
            self.interruption = record
        elif event == "console":  # a line the run shows at once (a slow import's progress): on this console too
            self.say(record["line"])
        elif event == "start":
            self.running[record["nodeid"]] = (record["check"], time.monotonic())
        elif event == "result":
            row = Row.from_dict(record["row"])
            self.results.append(row)
            self.running.pop(record["nodeid"], None)
            self.print_row(row)

    def print_row(self, row: Row) -> None:
        """A result's progress row, numbered after the results so far (``row`` the last of them)."""
        print(progress_row(len(self.results), self.total, row, self.name_width, self.width), file=self.out,
              flush=True)

    def say(self, text: str, file=None) -> None:
        """``text`` wrapped to the terminal's width, each line continued four columns further in."""
        print(wrapped(text, self.width), file=file or self.out, flush=True)

    def stop(self, signum: int) -> bool:
        """Pass the signal on to the child's process group (its report files name it) and wait for it to clean up;
        kill the group if it has not ended within :data:`STOP_GRACE_S`. False if it had to be killed."""
        child = self.child
        if child is None or child.poll() is not None:
            return True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signum)
        try:
            child.wait(STOP_GRACE_S)
            return True
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return False

    def keep_rows_at_a_stop(self, reason: str) -> None:
        """After the main job stopped its pytest: the results pytest wrote before it ended, then an ``error`` row
        (cause ``interrupted``) with ``reason`` for each check still running."""
        with contextlib.suppress(Exception):  # (a progress file cut mid-line: the rows read before it stand)
            for record in self._new_records():
                self._take(record)
        self.results += self._running_rows(reason, cause="interrupted")

    def interrupted_by(self) -> Optional[str]:
        """What stopped pytest (its exit 2), as it said: this job's ``--deadline`` (or pytest's own run deadline),
        a signal sent to pytest itself; ``None`` where it said nothing (a KeyboardInterrupt raised in the loader or
        the check, Ctrl-C in its terminal)."""
        said = self.interruption or {}
        if said.get("by") == "deadline":
            deadline = getattr(self.args, "deadline", None)
            return deadline_passed(deadline) if deadline else in_main_job_terms(said["stopped"])
        return f"interrupted by {said['by']}" if said.get("by") else None

    def interrupted_rows(self) -> list[Row]:
        """The rows of the checks that were running when the run was interrupted (pytest's exit 2), with the stacks
        of their children where pytest took them (at a deadline)."""
        by = self.interrupted_by()
        reason = f"{by} while this check ran" if by else \
            "interrupted while this check ran (a KeyboardInterrupt: raised in the loader or the check, or Ctrl-C)"
        reason += f"; its output: {self.log_path}"
        stacks = (self.interruption or {}).get("stacks")
        if stacks:
            reason += f"; its children's stacks when it stopped:\n{stacks}"
        return self._running_rows(reason, cause="interrupted")

    def crash_rows(self, code: int, what: str = "pytest itself ended") -> list[Row]:
        """The rows of the checks that were running when pytest itself ended abnormally (a signal, an internal
        error), or ended with no result for a check it had started."""
        return self._running_rows(f"{what} ({exit_described(code)}) while this check ran; its output: {self.log_path}")

    def _running_rows(self, reason: str, cause: Optional[str] = None) -> list[Row]:
        """An ``error`` row with ``reason`` for each check that was running, with what it guards against as the child
        said when it collected it."""
        rows = []
        for check, started in self.running.values():
            guards, origin = self.guards.get(check, (None, None))
            rows.append(Row(check=check, verdict="error", cause=cause, sentence=reason, guards=guards,
                            guards_origin=origin, seconds=round(time.monotonic() - started, 3)))
        return rows


def exit_described(code: int) -> str:
    """pytest's exit in words: ``killed by SIGKILL (exit code -9)``, ``exit code 3``."""
    from pytest_llmload.runners.children import describe_exitcode

    return describe_exitcode(code) if code < 0 else f"exit code {code}"
