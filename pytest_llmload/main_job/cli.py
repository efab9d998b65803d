"""The main job's command line (``python -m pytest_llmload``, ``llmload``): its options, the usage errors caught
before pytest starts, and :func:`run`, which starts the pytest process (:mod:`.process`) and prints its table
(:mod:`.table`).

This process stays light: it never imports torch, nor any check. What it can judge from the command line alone is
judged here (a loader spec's form, ``--runner``/``--model``, ``--log``/``--json`` paths); the rest is the
child's (the loader imported, the ini key read, the checks and installed extensions read), which reports back
through its progress file. ``--list`` is the one command that reads the check registry here: it starts no pytest.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Optional

from pytest_llmload.config.vocabulary import SETTING
from pytest_llmload.loader.seam import ENV_VAR, LoaderSpecError, choose_loader
from pytest_llmload.main_job.process import (
    DEADLINE,
    EXIT_OK,
    EXIT_USAGE,
    FAIL_NOT_EXERCISED,
    WAIT_AFTER_HANG,
    Interrupted,
    MainJob,
    in_main_job_terms,
    signals_interrupt,
)
from pytest_llmload.main_job.table import report, report_interrupted
from pytest_llmload.system.output_files import UnsafeOutputFile, open_output, unsafe_reason

# What --log and --json need free at least before the run starts (the log of a run is tens of KiB).
MIN_FREE_BYTES = 1 << 20


class UsageError(Exception):
    """A command line the main job cannot run; the message is one sentence saying what to change."""


class _Parser(argparse.ArgumentParser):
    """argparse, with pytest's exit code for a command line it cannot read (argparse's own is 2, which pytest uses
    for an interrupted run)."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")

    def format_help(self) -> str:
        """The help ends with the extras' table, read from the checks' records: built for --help only, so that a
        run's parent imports no check. The texts are wrapped here (the table keeps its columns)."""
        from pytest_llmload.config.distribution import extras_table
        from pytest_llmload.failures import REGISTRY

        width = max(shutil.get_terminal_size().columns - 2, 40)  # (argparse's own width)
        plain = self.description, self.epilog
        self.description = textwrap.fill(self.description, width)
        self.epilog = f"{textwrap.fill(self.epilog, width)}\n\n{extras_table(REGISTRY, width=width)}"
        try:
            return super().format_help()
        finally:
            self.description, self.epilog = plain


# Seconds as a person writes them, in ASCII digits: float() also reads '1e3', 'inf', 'nan', '-1' and '١٠'.
_DECIMAL = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", re.ASCII)


def _deadline_seconds(text: str) -> float:
    """``--deadline``: a number of seconds above 0, or a usage error naming the value."""
    if not _DECIMAL.fullmatch(text.strip()) or not float(text) > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0; give e.g. {DEADLINE} 3600")
    return float(text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="llmload",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # (wrapped by _Parser.format_help)
        description="Run pytest-llmload's regression checks against a model loader and print one row per check.",
        epilog="Extra arguments after '--' go to pytest (e.g. -- -x --tb=long). "
        f"The loader defaults to ${ENV_VAR}, then the ini key llmload_loader, then the built-in reference loader.",
    )
    parser.add_argument("--loader", metavar="MODULE:FUNCTION",
                        help="the loader under test: a callable taking a pytest_llmload.LoadRequest")
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="only checks matching this pytest -k expression")
    parser.add_argument("--log", metavar="PATH", help="where pytest's full output goes (default: a temp file)")
    parser.add_argument("--list", action="store_true", help="list the checks and the failures they guard, then exit")
    parser.add_argument(FAIL_NOT_EXERCISED, action="store_true",
                        help="count a check that could not judge the loader (skipped 'not exercised') as failed "
                        "(pytest: --llmload-strict)")
    parser.add_argument(WAIT_AFTER_HANG, action="store_true",
                        help="after the loader hangs in one check, run every other check to its deadline too "
                        "(default: they fail at once, naming the hang)")
    parser.add_argument(DEADLINE, type=_deadline_seconds, metavar="SECONDS",
                        help="stop the run after SECONDS as an interruption (exit 2): the rows so far, an error row "
                        "for the check it stopped in with its children's stacks, --json marked interrupted, and "
                        "pytest's report files marked too (pytest: --llmload-run-deadline)")
    parser.add_argument("--json", metavar="PATH", dest="json_path",
                        help="also write the results to PATH: one document with the run (loader and its source, "
                        "stack versions, devices, order, start, duration) and its results, one object per check "
                        "(check, outcome, failure, cause, note, reason, seconds, detail; a prediction's map and "
                        "bytes per device)")
    parser.add_argument("--runner", metavar="PROFILE[,PROFILE]",
                        help="also predict each scenario on these runner profiles (shipped names, or profile .json "
                        "files): rows marked PREDICTED say what the loader would do there")
    parser.add_argument("--model", metavar="NAME|CONFIG",
                        help="the architecture the predictions load at full size, without weights (default llama-3-8b)")
    parser.add_argument("--checks", metavar="MODULE:ATTRIBUTE", action="append", default=[],
                        help="also run these checks (a pytest_llmload.Check, a list of them, or a module with CHECKS); "
                        "repeatable. Installed packages' 'pytest_llmload.checks' entry points run too.")
    parser.add_argument("--list-runners", action="store_true", help="list the shipped runner profiles, then exit")
    parser.add_argument("--list-models", action="store_true", help="list the shipped architectures, then exit")
    parser.add_argument("--print-constraints", action="store_true",
                        help="print the versions this release was tested with, as a pip constraints file for your "
                        "repo (python -m pytest_llmload --print-constraints > constraints.txt), then exit")
    parser.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    return parser


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


def check_output_path(path: str, option: str) -> None:
    """``--log`` / ``--json``: a file in an existing directory, not a link another user may have made, checked
    before anything runs."""
    target = Path(path)
    _check_not_planted(path, option)
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


def _check_not_planted(path: str, option: str) -> None:
    unsafe = unsafe_reason(path)
    if unsafe is not None:
        raise UsageError(f"{option} {path!r} {unsafe}")


# The report files pytest writes for options after '--' (their directories made as they are written): checked for a
# planted link before the run starts.
REPORT_OPTIONS = ("--junitxml", "--junit-xml", SETTING["html"].option)


def _report_paths(pytest_args: list[str]) -> list[tuple[str, str]]:
    """``(path, option)`` for each report file named after '--' (``--junitxml=PATH`` or ``--junitxml PATH``)."""
    found = []
    for index, arg in enumerate(pytest_args):
        option, equals, path = arg.partition("=")
        if option in REPORT_OPTIONS:
            path = path if equals else (pytest_args[index + 1] if index + 1 < len(pytest_args) else "")
            if path:
                found.append((path, option))
    return found


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

    try:
        handle = open_output(path, append=True)
    except UnsafeOutputFile as exc:  # (a link planted since the check before the run)
        raise UsageError(f"--log {exc}") from None
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


def _list(args: argparse.Namespace, out) -> int:
    """``--list``: every check (built-in, installed extensions', ``--checks``') and the failure it guards."""
    from pytest_llmload.plugin.check_registry import ExtensionError, every_check
    from pytest_llmload.plugin.parametrize import describe_checks

    try:
        checks = every_check(args.checks, "--checks")
    except ExtensionError as exc:
        print(f"llmload: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    for record in describe_checks(checks):
        print(f"{record['check']:<48} {record['failure']:<24} {record['summary']}", file=out)
    return EXIT_OK


def run(argv: Optional[list[str]] = None, out=None, popen=None) -> int:
    """The main job: its exit code. ``popen`` starts its pytest child (:class:`~.process.MainJob`)."""
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    if args.print_constraints:
        from pytest_llmload.config.distribution import tested_constraints

        out.write(tested_constraints())
        return EXIT_OK
    if args.list_runners or args.list_models:
        from pytest_llmload.placement import architectures, profiles

        if args.list_runners:
            for name in profiles.shipped_names():
                print(profiles.load_profile(name).describe(), file=out)
        if args.list_models:
            for name in architectures.shipped_names():
                print(architectures.describe(architectures.load_config(name), name), file=out)
        return EXIT_OK
    if args.list:
        return _list(args, out)
    try:
        # A bad --loader or $PYTEST_LLMLOAD_LOADER is a usage error before any pytest starts: its form only, nothing
        # imported. The child chooses the loader (the ini key too), imports it once, and reports its choice.
        choose_loader(args.loader, os.environ, None)
        _check_prediction_args(args)
        for path, option in ((args.log, "--log"), (args.json_path, "--json")):
            if path:
                check_output_path(path, option)
        for path, option in _report_paths(args.pytest_args):
            _check_not_planted(path, option)
    except (LoaderSpecError, UsageError) as exc:
        print(f"llmload: error: {in_main_job_terms(str(exc))}", file=sys.stderr)
        return EXIT_USAGE

    workdir = Path(tempfile.mkdtemp(prefix="llmload-main-"))
    job, keep_log, log_lock = MainJob(args, workdir, out, popen), False, None
    try:
        with signals_interrupt():
            try:
                if args.log:
                    try:
                        log_lock = _hold_log(job.log_path)
                    except UsageError as exc:  # (a --log another running job holds)
                        print(f"llmload: error: {exc}", file=sys.stderr)
                        return EXIT_USAGE
                job.start()
                code, keep_log = report(job, job.follow())
                return code
            except Interrupted as stop:
                return report_interrupted(job, stop)
    finally:
        if log_lock is not None:  # (the --log's lock ends with the run, not when its handle is collected)
            log_lock.close()
        # Nothing is left but the log where --log put it, or in the temp dir while it explains a failure.
        if keep_log and not args.log:
            job.progress.unlink(missing_ok=True)
            shutil.rmtree(job.tmp, ignore_errors=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
