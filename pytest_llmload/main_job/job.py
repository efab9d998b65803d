"""The main job: run every shipped check against one loader and print one row per check.

The parent stays light (it never imports torch): pytest runs the shipped suite in a child process, whose
full output goes to a log file, and the parent prints each check's row as its result arrives.
Exit codes: 0 nothing failed, 1 a check failed, 2 usage error (a loader that does not import, say),
128 + N when stopped by signal N (130 for Ctrl-C, 143 for SIGTERM).

The parent owns everything below it: the pytest child runs in its own process group, ends when the parent ends
however it ends (:mod:`pytest_llmload.runners.lifeline`), and gets SIGINT for Ctrl-C, SIGTERM for SIGTERM or
SIGHUP, so that it stops as on Ctrl-C and its finalizers kill the checks' children and remove their temp dirs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from pytest_llmload.system import json_lines as jsonl
from pytest_llmload.loader.seam import ENV_VAR, OPTION, LoaderSpecError, choose_loader

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
INTERRUPTED = 2  # pytest's ExitCode.INTERRUPTED, passed on as it is
HEARTBEAT_SECONDS = 10.0
# After passing a signal on, how long pytest gets to stop and clean up before its process group is killed.
STOP_GRACE_S = 10.0
POLL_S = 0.2  # how often the progress file is read
FAILED_OUTCOMES = ("failed", "predicted", "error", "xpassed")
WAIT_AFTER_HANG = "--wait-after-hang"


class UsageError(Exception):
    """A command line the main job cannot run; the message is one sentence saying what to change."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmload",
        description="Run pytest-llmload's regression checks against a model loader and print one row per check.",
        epilog="Extra arguments after '--' go to pytest (e.g. -- -x --tb=long). "
        f"The loader defaults to ${ENV_VAR}, then the ini key llmload_loader, then the built-in reference loader.",
    )
    parser.add_argument("--loader", metavar="MODULE:FUNCTION",
                        help="the loader under test: a callable taking a pytest_llmload.LoadRequest")
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="only checks matching this pytest -k expression")
    parser.add_argument("--log", metavar="PATH", help="where pytest's full output goes (default: a temp file)")
    parser.add_argument("--list", action="store_true", help="list the checks and the failures they guard, then exit")
    parser.add_argument("--strict", action="store_true",
                        help="count a check that could not judge the loader (skipped 'not exercised') as failed")
    parser.add_argument(WAIT_AFTER_HANG, action="store_true",
                        help="after the loader hangs in one check, run every other check to its deadline too "
                        "(default: they fail at once, naming the hang)")
    parser.add_argument("--json", metavar="PATH", dest="json_path",
                        help="also write the results to PATH: one document with the run (loader and its source, "
                        "stack versions, devices, order, start, duration) and its results, one object per check "
                        "(check, outcome, failure, cause, note, reason, seconds, detail)")
    parser.add_argument("--runner", metavar="PROFILE[,PROFILE]",
                        help="also predict each scenario on these runner profiles (shipped names, or profile .json "
                        "files): rows marked PREDICTED say what the loader would do there")
    parser.add_argument("--model", metavar="NAME|CONFIG",
                        help="the architecture the predictions load at full size, without weights (default llama-3-8b)")
    parser.add_argument("--checks", metavar="MODULE:ATTRIBUTE", action="append", default=[],
                        help="also run these checks (a pytest_llmload.Check, a list of them, or a module with CHECKS); "
                        "repeatable. Installed packages' 'pytest_llmload.checks' entry points run too.")
    parser.add_argument("--lanes", metavar="N", default=None,
                        help="run the checks in N processes, forked once the checks are collected (default: 2 where 2 "
                        "CPUs are usable, else 1; one where a GPU is visible)")
    parser.add_argument("--list-runners", action="store_true", help="list the shipped runner profiles, then exit")
    parser.add_argument("--list-models", action="store_true", help="list the shipped architectures, then exit")
    parser.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    return parser


def _lanes(text: Optional[str]) -> Optional[int]:
    """``--lanes``: a positive whole number, or ``None`` (the default: 2 where 2 CPUs are usable)."""
    if text is None:
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise UsageError(f"--lanes {text!r} is not a positive whole number; give e.g. --lanes 2, or --lanes 1 to run "
                         "every check in one process.")
    return int(text)


def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def pytest_command(loader: Optional[str], keyword: Optional[str], progress: Path, extra: list[str],
                   strict: bool = False, wait_after_hang: bool = False, runner: Optional[str] = None,
                   model: Optional[str] = None, checks: tuple = (), lanes: Optional[int] = None) -> list[str]:
    from pytest_llmload.config.vocabulary import CHECKS_OPTION, LANES_OPTION, MODEL_OPTION, RUNNER_OPTION, WAIT_OPTION

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
    asked = " ".join(extra)
    for plugin, flags in _HOUSE_PLUGINS.items():
        if not any(flag in asked for flag in flags):
            argv += ["-p", f"no:{plugin}"]
    # Two lanes where two CPUs are usable (runners.lanes: the pytest process forks once collected; issue 28)
    lanes = min(2, usable_cpus()) if lanes is None else lanes
    if lanes > 1:
        argv += [LANES_OPTION, str(lanes)]
    if strict:
        argv.append("--llmload-strict")
    if wait_after_hang:
        argv.append(WAIT_OPTION)
    if loader:
        argv += [OPTION, loader]
    if runner:
        argv += [RUNNER_OPTION, runner]
    if model:
        argv += [MODEL_OPTION, model]
    for spec in checks:
        argv += [CHECKS_OPTION, spec]
    if keyword:
        argv += ["-k", keyword]
    return argv + extra


# Plugins the main job turns off unless the arguments after '--' use them: name -> the flags that ask for it.
_HOUSE_PLUGINS = {"randomly": ("-p randomly", "--randomly"), "pytest_cov": ("--cov",),
                  "xdist": ("-n", "--dist", "--tx"), "anyio": ("-p anyio",), "html": ("--html",),
                  "metadata": ("--html", "--metadata")}


def _in_main_job_terms(text: str) -> str:
    """The pytest options a message names, as this command spells them."""
    from pytest_llmload.config.vocabulary import WAIT_OPTION

    return text.replace(OPTION, "--loader").replace(WAIT_OPTION, WAIT_AFTER_HANG)


def _row(done: int, total: int, record: dict) -> str:
    width = len(str(total)) if total else 2
    outcome = _shown(record["outcome"])
    return f"[{done:>{width}}/{total or '?'}] {record['check']:<48} {outcome:<8} {record['seconds']:7.2f}s"


def _shown(outcome: str) -> str:
    """The result column: passed, FAILED (the check saw its failure), PREDICTED (a runner profile would hit one),
    error (the loader's own error), skipped."""
    return outcome.upper() if outcome in ("failed", "predicted", "xpassed") else outcome


def _summary(record: dict) -> str:
    """A failed row's cause in one line (the progress file's ``summary``: a signal, an exit code, the exception)."""
    line = record.get("summary") or next((line.strip() for line in record["reason"].splitlines() if line.strip()), "")
    return line.removeprefix(f"{record['check']}: ")  # an isolated check's death starts with its name


def _failed_fast(record: dict) -> bool:
    from pytest_llmload.plugin.loader_hang import FAILED_FAST

    return record["outcome"] == "error" and _summary(record).startswith(FAILED_FAST)


def _check_prediction_args(args: argparse.Namespace) -> None:
    """``--runner``/``--model``: names and files read here, so that a typo is a usage error before pytest starts."""
    if args.model and not args.runner:
        raise UsageError(f"--model {args.model!r} names the architecture of the predictions, which run for a runner "
                         "profile: add --runner (e.g. --runner 8xH100-80GB); --list-runners lists them.")
    if not args.runner:
        return
    from pytest_llmload.placement import architectures, profiles
    from pytest_llmload.placement.planner import unsupported_reason

    reason = unsupported_reason()
    if reason is not None:
        raise UsageError(f"--runner {args.runner!r}: {reason}.")
    try:
        for name in (n.strip() for n in args.runner.split(",")):
            if not name:
                raise UsageError(f"--runner {args.runner!r} has an empty name; give profiles as NAME[,NAME].")
            profiles.load_profile(name)
        architectures.load_config(args.model or architectures.DEFAULT)
    except (profiles.ProfileError, architectures.ArchitectureError) as exc:
        raise UsageError(str(exc)) from None


def _check_output_path(path: str, option: str) -> None:
    """``--log`` / ``--json``: a file in an existing directory, checked before anything runs."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{option} {path!r} is a directory; name a file, e.g. {option} {target / 'llmload.out'}.")
    if not target.parent.is_dir():
        raise UsageError(f"{option} {path!r}: the directory {str(target.parent)!r} does not exist; create it "
                         "or name a file in an existing directory.")
    if not os.access(target.parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise UsageError(f"{option} {path!r} cannot be written (no permission); name a file you can write.")
    if target.exists() and not target.is_file() and os.path.realpath(target) != os.devnull:
        raise UsageError(f"{option} {path!r} is not a regular file (a device or a pipe, where a write can fail after "
                         "every check ran); name a file.")
    free = _free_bytes(target.parent)
    if free is not None and free < MIN_FREE_BYTES:
        raise UsageError(f"{option} {path!r}: the file system of {str(target.parent)!r} has {free} bytes free, too "
                         "few for the run's output; free some space or name a file elsewhere.")


# What --log and --json need free at least before the run starts (the log of a run is tens of KiB).
MIN_FREE_BYTES = 1 << 20


def _free_bytes(directory: Path) -> Optional[int]:
    try:
        stat = os.statvfs(directory)
    except (OSError, AttributeError):
        return None
    return stat.f_bavail * stat.f_frsize


def _hold_log(path: Path):
    """An open handle on ``--log``'s file holding an exclusive lock for the run: a second job given the same file is
    refused instead of truncating the first one's log mid-run. ``None`` where the file system has no locks."""
    import fcntl

    handle = path.open("a", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UsageError(f"--log {str(path)!r} is the log of another job running now; give each job its own --log "
                         "file.") from None
    except OSError:  # a file system without locks: nothing to hold
        handle.close()
        return None
    return handle


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP reached the main job."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum, frame) -> None:
    for stop in STOP_SIGNALS:  # one stop at a time: a second signal must not break off the clean-up
        signal.signal(stop, signal.SIG_IGN)
    raise Interrupted(signum)


@contextlib.contextmanager
def _signals_interrupt():
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

    def __init__(self, args: argparse.Namespace, workdir: Path, out, checks: "tuple | None" = (), popen=None) -> None:
        self.args, self.workdir, self.out = args, workdir, out
        self.popen = popen or subprocess.Popen
        self.checks = checks  # every check the run has (built-in and extensions): what each row guards against
        self.progress = workdir / "progress.jsonl"
        self.tmp = workdir / "tmp"
        self.log_path = Path(args.log) if args.log else workdir / "pytest.log"
        self.child: Optional[subprocess.Popen] = None
        self.results: list[dict] = []
        self.collect_errors: list[dict] = []
        self.total = 0
        self.order: list[str] = []  # the checks in collection order, the table's and JSON's (lanes finish out of it)
        self.running: dict[str, tuple[str, float]] = {}  # nodeid -> (check, started): no result yet (one a lane)
        self.started = time.monotonic()
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.loader: Optional[dict] = None  # the child's own choice (its "loader" event)
        self._offset = 0

    def start(self) -> None:
        args = self.args
        command = pytest_command(args.loader, args.keyword, self.progress, args.pytest_args, strict=args.strict,
                                 wait_after_hang=args.wait_after_hang, runner=args.runner, model=args.model,
                                 checks=tuple(args.checks), lanes=args.lanes)
        from pytest_llmload.runners.lifeline import PARENT_ENV, PARENT_WORKDIR_ENV

        # The child ends with this process (lifeline), and removes this temp dir if this process dies first. Its
        # own temp dirs (pytest's, the isolated checks') are made in here: one removal takes them all, on every path.
        self.tmp.mkdir()
        env = {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},  # (the main job decides; see above)
               "TMPDIR": str(self.tmp), PARENT_ENV: str(os.getpid()),
               PARENT_WORKDIR_ENV: str(self.workdir)}
        if self.args.log:
            self.log_lock = _hold_log(self.log_path)  # (closed with this process: the lock goes with it)
        with self.log_path.open("w", encoding="utf-8") as log:
            # Its own process group: a Ctrl-C in the terminal reaches this process only, which passes it on once.
            self.child = self.popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    process_group=0)

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
            if self.running and time.monotonic() - last_beat > HEARTBEAT_SECONDS:
                last_beat = time.monotonic()
                for check, started in self.running.values():
                    print(f"    ... {check} still running ({time.monotonic() - started:.0f}s)", file=self.out,
                          flush=True)
            # (a wait, not a sleep: the run's end is seen within 50 ms, not after up to 0.2 s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.child.wait(POLL_S)

    def _new_records(self) -> list[dict]:
        records, self._offset = jsonl.read_from(self.progress, self._offset)
        return records

    def _take(self, record: dict) -> None:
        event, out = record["event"], self.out
        if event == "loader":  # the child's own choice: what this line says is the loader it runs
            self.loader = {"spec": record["spec"], "source": _in_main_job_terms(record["source"]),
                           "inifile": record.get("inifile")}
            source = _in_main_job_terms(record["source"])
            if record.get("inifile"):
                source += f" in {record['inifile']}"
            print(f"llmload: checking loader {record['spec']} (from {source})", file=out, flush=True)
        elif event == "collected":
            self.total = record["count"]
            self.order = record.get("order", [])
            print(f"llmload: {self.total} checks collected", file=out, flush=True)
        elif event == "collect_error":
            self.collect_errors.append(record)
        elif event == "start":
            self.running[record["nodeid"]] = (record["check"], time.monotonic())
        elif event == "result":
            self.results.append(record)
            self.running.pop(record.get("nodeid"), None)
            print(_row(len(self.results), self.total, record), file=out, flush=True)

    def stop(self, signum: int) -> bool:
        """Pass the signal on (SIGINT as SIGINT, else SIGTERM) to the child's process group and wait for it to
        clean up; kill the group if it has not ended within :data:`STOP_GRACE_S`. False if it had to be killed."""
        child = self.child
        if child is None or child.poll() is not None:
            return True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM)
        try:
            child.wait(STOP_GRACE_S)
            return True
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            return False

    def interrupted_rows(self) -> list[dict]:
        """The rows of the checks that were running when the run was interrupted (pytest's exit 2)."""
        return self._running_rows(f"interrupted while this check ran (a KeyboardInterrupt: raised in the loader or "
                                  f"the check, or Ctrl-C); its output: {self.log_path}", cause="interrupted")

    def crash_rows(self, code: int, what: str = "pytest itself ended") -> list[dict]:
        """The rows of the checks that were running when pytest itself ended abnormally (a signal, an internal
        error), or ended with no result for a check it had started: one, or one a lane."""
        from pytest_llmload.runners.isolation import describe_exitcode

        how = describe_exitcode(code) if code < 0 else f"exit code {code}"
        return self._running_rows(f"{what} ({how}) while this check ran; its output: {self.log_path}")

    def _running_rows(self, reason: str, cause: Optional[str] = None) -> list[dict]:
        """An ``error`` row with ``reason`` for each check that was running (one, or one a lane)."""
        return [{"event": "result", "check": check, "outcome": "error", "reason": reason, "summary": reason,
                 "seconds": round(time.monotonic() - started, 3), **({"cause": cause} if cause else {})}
                for check, started in self.running.values()]


def run(argv: Optional[list[str]] = None, out=None, popen=None) -> int:
    """The main job: its exit code. ``popen`` starts its pytest child (:class:`MainJob`)."""
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    if args.list_runners or args.list_models:
        from pytest_llmload.placement import architectures, profiles

        if args.list_runners:
            for name in profiles.shipped_names():
                print(profiles.load_profile(name).describe(), file=out)
        if args.list_models:
            for name in architectures.shipped_names():
                print(architectures.describe(architectures.load_config(name), name), file=out)
        return EXIT_OK
    # Every check this run has, the extensions' included (a spec that gives none is a usage error): read now where
    # --checks or --list asks, else while the pytest child starts (importing the catalog here takes 0.2 s).
    checks = _every_check(args) if args.checks or args.list else None
    if isinstance(checks, str):
        print(f"llmload: error: {checks}", file=sys.stderr)
        return EXIT_USAGE
    if args.list:
        from pytest_llmload.plugin.parametrize import describe_checks

        for record in describe_checks(checks):
            print(f"{record['check']:<48} {record['failure']:<24} {record['summary']}", file=out)
        return EXIT_OK
    try:
        # A bad --loader or $PYTEST_LLMLOAD_LOADER is a usage error before any pytest starts; the ini key is read
        # by the child, which reports the loader it really runs.
        choose_loader(args.loader, os.environ, None)
        _check_prediction_args(args)
        args.lanes = _lanes(args.lanes)  # (a number from here on)
        for path, option in ((args.log, "--log"), (args.json_path, "--json")):
            if path:
                _check_output_path(path, option)
    except (LoaderSpecError, UsageError) as exc:
        print(f"llmload: error: {_in_main_job_terms(str(exc))}", file=sys.stderr)
        return EXIT_USAGE

    workdir = Path(tempfile.mkdtemp(prefix="llmload-main-"))
    job, keep_log = MainJob(args, workdir, out, checks, popen), False
    try:
        with _signals_interrupt():
            try:
                try:
                    job.start()
                except UsageError as exc:  # (a --log another running job holds)
                    print(f"llmload: error: {exc}", file=sys.stderr)
                    return EXIT_USAGE
                if job.checks is None:
                    job.checks = _every_check(args)
                    if isinstance(job.checks, str):  # an installed package's entry point that gives no checks
                        job.stop(signal.SIGTERM)
                        print(f"llmload: error: {job.checks}", file=sys.stderr)
                        return EXIT_USAGE
                code, keep_log = _report(job, job.follow())
                return code
            except Interrupted as stop:
                return _interrupted(job, stop.signum)
    finally:
        lock = getattr(job, "log_lock", None)
        if lock is not None:  # (the --log's lock ends with the run, not when this object is collected)
            lock.close()
        # Nothing is left but the log where --log put it, or in the temp dir while it explains a failure.
        if keep_log and not args.log:
            job.progress.unlink(missing_ok=True)
            shutil.rmtree(job.tmp, ignore_errors=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


LOG_TAIL_BYTES = 64 << 10


def _tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of ``path`` as text: a log read back is bounded, whatever the run wrote."""
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - limit))
            return log.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(the log {path} could not be read: {exc})"


def _every_check(args: argparse.Namespace) -> "tuple | str":
    """Every check of the run (built-in, installed extensions, ``--checks``), or the usage error's sentence."""
    from pytest_llmload.plugin.check_registry import ExtensionError, every_check

    try:
        return every_check(args.checks, "--checks")
    except ExtensionError as exc:
        return str(exc)


def _interrupted(job: MainJob, signum: int) -> int:
    stopped = job.stop(signum)
    name = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
    how = "stopped and cleaned up" if stopped else f"killed: it had not stopped {STOP_GRACE_S:g} s after the signal"
    log = f"pytest output: {job.log_path}" if job.args.log else "pytest output removed (--log PATH keeps it)"
    print(f"llmload: interrupted by {name} after {time.monotonic() - job.started:.1f}s with {len(job.results)} of "
          f"{job.total or '?'} checks done; pytest {how}; {log}", file=sys.stderr, flush=True)
    return 128 + signum


def _report(job: MainJob, code: int) -> tuple[int, bool]:
    """Print the summary of a finished run; returns the exit code and whether the log is kept."""
    args, out = job.args, job.out
    for error in job.collect_errors:  # whole, as pytest raised them (its short summary cuts them at 80 columns)
        print(f"llmload: collection error in {error['nodeid'] or 'the session'}:\n    "
              + _in_main_job_terms(error["message"].rstrip()).replace("\n", "\n    "), file=sys.stderr)
    crashed = code < 0 or code == 3 or code > 5
    # pytest's exit 2 is an interruption (a KeyboardInterrupt: raised in the loader or the check, or Ctrl-C in its
    # terminal); mid-check, the rows so far are the run's, and the check it stopped in says so.
    interrupted = code == INTERRUPTED and bool(job.running)
    rows = (job.crash_rows(code) if crashed else job.interrupted_rows() if interrupted
            else job.crash_rows(code, "pytest ended without this check's result") if job.running else [])
    for row in rows:
        job.results.append(row)
        print(_row(len(job.results), job.total, row), file=out, flush=True)
    if crashed and not rows and job.results:
        print(f"llmload: pytest itself ended (exit code {code}) between checks; its output: {job.log_path}",
              file=sys.stderr)
    if not job.results:  # a usage or collection error, or pytest died before any check ran
        log_text = _tail(job.log_path)
        if not job.collect_errors:
            lines = [line for line in log_text.splitlines() if line.startswith("ERROR")] or log_text.splitlines()[-15:]
            for line in lines:
                print(f"llmload: {_in_main_job_terms(line)}", file=sys.stderr)
        keep = crashed or not (job.collect_errors or code == 4)  # else the errors above are the whole story
        where = f"full output: {job.log_path}" if keep or args.log else "pytest output removed (--log PATH keeps it)"
        print(f"llmload: pytest exited {code} before any check ran; {where}", file=sys.stderr)
        return (EXIT_FAILED if crashed else EXIT_USAGE), keep

    rank = {check: n for n, check in enumerate(job.order)}
    job.results.sort(key=lambda record: rank.get(record["check"], len(rank)))  # (stable; a name not collected last)
    print("", file=out)
    for line in summary_table(job.results, job.checks):
        print(line, file=out)
    failed = [r for r in job.results if r["outcome"] in FAILED_OUTCOMES]
    counts: dict[str, int] = {}
    for record in job.results:
        counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
    print("", file=out)
    fast = [r for r in failed if _failed_fast(r)]
    for record in failed:
        if record not in fast:
            label = {"error": "ERROR", "predicted": "PREDICTED"}.get(record["outcome"], "FAILED")
            text = _in_main_job_terms(_summary(record)).replace("\n", "\n    ")
            print(f"{label} {record['check']}: {text}", file=out)
            failure = _failure_of(record["check"], job.checks) if record["outcome"] in ("failed", "predicted") else None
            if failure is not None and record.get("failure") == failure.id:  # what to do, where the mechanism shows
                print(f"    fix ({failure.id}): {_in_main_job_terms(failure.fix)}", file=out)
    if fast:
        names = ", ".join(r["check"] for r in fast)
        print(f"NOT RUN {names}: {_in_main_job_terms(_summary(fast[0]))}", file=out)
    if args.json_path:
        try:
            Path(args.json_path).write_text(json.dumps(json_document(job), indent=1) + "\n", encoding="utf-8")
        except OSError as exc:  # (the rows are above: the table was printed first)
            print(f"llmload: --json {args.json_path!r} could not be written after the run ({type(exc).__name__}: "
                  f"{exc}); the table above is the run's", file=sys.stderr)
            failed = failed or [{"outcome": "error"}]
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    keep = bool(failed) or crashed or bool(args.log)
    where = f"pytest output: {job.log_path}" if keep else "nothing failed: pytest output removed (--log PATH keeps it)"
    print(f"llmload: {summary} in {time.monotonic() - job.started:.1f}s; {where}", file=out)
    if interrupted:
        stopped = ", ".join(row["check"] for row in rows)
        print(f"llmload: interrupted while {stopped} ran (pytest's exit {code}: a KeyboardInterrupt, raised in the "
              "loader or the check, or Ctrl-C in its terminal); the rows before it are above", file=sys.stderr)
        return INTERRUPTED, True
    return (EXIT_FAILED if failed or code not in (0, 5) else EXIT_OK), keep


def summary_table(results: list[dict], checks: tuple = ()) -> list[str]:
    rows = [("check", "guards against", "result", "time")]
    for record in results:
        failure = _failure_of(record["check"], checks)
        guards = "" if failure is None else f"{failure.id} ({_source_tag(failure)})"
        outcome = _shown(record["outcome"])
        if record["outcome"] in ("skipped", "xfailed") and record["reason"]:
            outcome += f" ({record['reason']})"
        elif _failed_fast(record):
            outcome += " (not run: the loader hung before)"
        elif record["outcome"] == "predicted" and record.get("failure"):
            outcome += f" {record['failure']}"
        elif record.get("note"):
            outcome += f" ({record['note']})"
        rows.append((record["check"], guards, outcome, f"{record['seconds']:.2f}s"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>7}" for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def json_document(job: "MainJob") -> dict:
    """``--json``: one document: what ran (the loader and where it was chosen, the stack, the devices, the order,
    when and how long), then one object per check (:func:`json_records`)."""
    from pytest_llmload.system import gpus
    from pytest_llmload.plugin.header import installed_versions

    args = job.args
    ordered = "random (pytest-randomly, asked after --; its seed is in the log)" if any(
        flag in " ".join(args.pytest_args) for flag in _HOUSE_PLUGINS["randomly"]) else "collection order"
    return {
        "tool": "pytest-llmload", "loader": job.loader, "stack": installed_versions(),
        "devices": {"gpus": gpus.physical_devices().count, "cuda_visible_devices": gpus.visible_devices_label()},
        "predictions": {"runner": args.runner, "model": args.model} if args.runner else None,
        "order": ordered, "started": job.started_at, "seconds": round(time.monotonic() - job.started, 2),
        "pytest_args": list(args.pytest_args), "results": json_records(job.results),
    }


def json_records(results: list[dict]) -> list[dict]:
    """``--json``: one object per check. ``failure`` is the catalog id the row is attributed to, only where the
    check observed that failure's mechanism (the verdict decided from the exception, :mod:`.failures.verdict`);
    ``cause`` says what an error row is (loader, contract, model, hang, died, check)."""
    records = []
    for record in results:
        outcome = record["outcome"]
        failure = record.get("failure") if outcome in ("failed", "predicted") else None
        detail = _in_main_job_terms(_summary(record)) if outcome in FAILED_OUTCOMES else record["reason"]
        records.append({"check": record["check"], "outcome": outcome, "verdict": record.get("verdict", outcome),
                        "failure": failure, "cause": record.get("cause"), "note": record.get("note"),
                        "notes": record.get("notes") or ([record["note"]] if record.get("note") else []),
                        "fix": record.get("fix"), "loader": record.get("loader"), "reason": record["reason"],
                        "seconds": record["seconds"], "detail": detail})
    return records


def _source_tag(failure) -> str:
    """``002`` for a write-up in shared/seeds, ``field`` for a failure taken from upstream issue trackers,
    ``extension`` for a repo's own."""
    from pytest_llmload.failures import BY_ID

    if BY_ID.get(failure.id) is not failure:
        return "extension"  # a repo's own known failure (pytest_llmload.plugin.check_registry)
    return failure.write_up.split("/")[-1][:3] if failure.write_up.startswith("seeds/") else "field"


def _failure_of(check: str, checks: tuple = ()):
    """The known failure a check guards against (``checks``: the run's, else the shipped ones), ``None`` for a name
    that is no check."""
    from pytest_llmload.failures import REGISTRY

    found = next((c.failure for c in checks or REGISTRY if c.name == check), None)
    if found is None and check.startswith("predict_"):  # a prediction row: predict_<scenario>@<runner>
        from pytest_llmload.prediction.predict import scenarios

        found = next((s.failure for s in scenarios() if s.name == check.split("@")[0]), None)
    return found
