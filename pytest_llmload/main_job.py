"""The main job: run every shipped check against one loader and print one row per check.

The parent stays light (it never imports torch): pytest runs the shipped suite in a child process, whose
full output goes to a log file, and the parent prints each check's row as its result arrives.
Exit codes: 0 nothing failed, 1 a check failed, 2 usage error (a loader that does not import, say).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from pytest_llmload.loading import ENV_VAR, OPTION, LoaderSpecError, choose_loader

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
HEARTBEAT_SECONDS = 10.0
FAILED_OUTCOMES = ("failed", "error", "xpassed")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmload",
        description="Run pytest-llmload's regression checks against a model loader and print one row per check.",
        epilog="Extra arguments after '--' go to pytest (e.g. -- -x --tb=long). "
        f"The loader defaults to ${ENV_VAR}, then the built-in reference loader.",
    )
    parser.add_argument("--loader", metavar="MODULE:FUNCTION",
                        help="the loader under test: a callable taking a pytest_llmload.LoadRequest")
    parser.add_argument("-k", dest="keyword", metavar="EXPR", help="only checks matching this pytest -k expression")
    parser.add_argument("--log", metavar="PATH", help="where pytest's full output goes (default: a temp file)")
    parser.add_argument("--list", action="store_true", help="list the checks and the failures they guard, then exit")
    parser.add_argument("--strict", action="store_true",
                        help="count a check that could not judge the loader (skipped 'not exercised') as failed")
    parser.add_argument("--json", metavar="PATH", dest="json_path",
                        help="also write the results to PATH: one object per check (check, outcome, failure, "
                        "reason, seconds, detail)")
    parser.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    return parser


def pytest_command(loader: Optional[str], keyword: Optional[str], progress: Path, extra: list[str],
                   strict: bool = False) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "--pyargs", "pytest_llmload.suite", "-p", "no:cacheprovider",
            "-o", "python_files=test_*.py", "--tb=short", "-q", "--llmload-progress", str(progress)]
    if strict:
        argv.append("--llmload-strict")
    if loader:
        argv += [OPTION, loader]
    if keyword:
        argv += ["-k", keyword]
    return argv + extra


def _row(done: int, total: int, record: dict) -> str:
    width = len(str(total)) if total else 2
    outcome = _shown(record["outcome"])
    return f"[{done:>{width}}/{total or '?'}] {record['check']:<48} {outcome:<8} {record['seconds']:7.2f}s"


def _shown(outcome: str) -> str:
    """The result column: passed, FAILED (the check saw its failure), error (the loader's own error), skipped."""
    return outcome.upper() if outcome in ("failed", "xpassed") else outcome


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.startswith("E "):
            return line[1:].strip()
    return (text.strip().splitlines() or [""])[-1].strip()


def _follow(child: subprocess.Popen, progress: Path, out) -> tuple[list[dict], int]:
    """Print a row per result as the child writes them; a heartbeat while one check runs long."""
    results: list[dict] = []
    total, offset, running, last_beat = 0, 0, None, time.monotonic()
    while True:
        finished = child.poll() is not None
        if progress.exists():
            with progress.open(encoding="utf-8") as handle:
                handle.seek(offset)
                chunk = handle.read()
            complete, _, _partial = chunk.rpartition("\n")
            offset += len(complete) + (1 if complete else 0)
            for line in filter(None, complete.splitlines()):
                record = json.loads(line)
                if record["event"] == "collected":
                    total = record["count"]
                    print(f"llmload: {total} checks collected", file=out, flush=True)
                elif record["event"] == "start":
                    running, last_beat = (record["check"], time.monotonic()), time.monotonic()
                elif record["event"] == "result":
                    results.append(record)
                    running = None
                    print(_row(len(results), total, record), file=out, flush=True)
        if finished:
            return results, total
        if running and time.monotonic() - last_beat > HEARTBEAT_SECONDS:
            last_beat = time.monotonic()
            print(f"    ... {running[0]} still running ({time.monotonic() - running[1]:.0f}s)", file=out, flush=True)
        time.sleep(0.2)


def summary_table(results: list[dict]) -> list[str]:
    rows = [("check", "guards against", "result", "time")]
    for record in results:
        failure = _failure_of(record["check"])
        guards = "" if failure is None else f"{failure.id} ({_source_tag(failure)})"
        outcome = _shown(record["outcome"])
        if record["outcome"] in ("skipped", "xfailed") and record["reason"]:
            outcome += f" ({record['reason']})"
        rows.append((record["check"], guards, outcome, f"{record['seconds']:.2f}s"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>7}" for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return lines


def json_records(results: list[dict]) -> list[dict]:
    """``--json``: one object per check. ``failure`` is the catalog id the row is attributed to: the check's own
    for a failed check; for an error, a known failure only where its signature is in the error; else null."""
    from pytest_llmload import failures

    records = []
    for record in results:
        outcome, failure = record["outcome"], None
        if outcome in ("failed", "xpassed") and "llmload strict: " not in record["reason"]:
            guarded = _failure_of(record["check"])
            failure = guarded.id if guarded is not None else None
        elif outcome == "error":
            matched = failures.match(record["reason"])
            failure = matched[0].id if matched else None
        detail = _first_line(record["reason"]) if outcome in FAILED_OUTCOMES else record["reason"]
        records.append({"check": record["check"], "outcome": outcome, "failure": failure,
                        "reason": record["reason"], "seconds": record["seconds"], "detail": detail})
    return records


def _source_tag(failure) -> str:
    """``002`` for a write-up in shared/seeds, ``field`` for a failure taken from upstream issue trackers."""
    return failure.write_up.split("/")[-1][:3] if failure.write_up.startswith("seeds/") else "field"


def _failure_of(check: str):
    """The known failure a check guards against, ``None`` for a name that is not a shipped check."""
    from pytest_llmload.failures import REGISTRY

    return next((c.failure for c in REGISTRY if c.name == check), None)


def run(argv: Optional[list[str]] = None, out=None) -> int:
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    if args.list:
        from pytest_llmload.conformance import describe_checks

        for record in describe_checks():
            print(f"{record['check']:<48} {record['failure']:<24} {record['summary']}", file=out)
        return EXIT_OK
    try:
        choice = choose_loader(args.loader, os.environ, None)
    except LoaderSpecError as exc:
        print(f"llmload: error: {str(exc).replace(OPTION, '--loader')}", file=sys.stderr)
        return EXIT_USAGE
    print(f"llmload: checking loader {choice.spec} (from {choice.source.replace(OPTION, '--loader')})", file=out)

    workdir = Path(tempfile.mkdtemp(prefix="llmload-main-"))
    progress = workdir / "progress.jsonl"
    log_path = Path(args.log) if args.log else workdir / "pytest.log"
    command = pytest_command(args.loader, args.keyword, progress, args.pytest_args, strict=args.strict)
    started = time.monotonic()
    with log_path.open("w", encoding="utf-8") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            results, _total = _follow(child, progress, out)
        except KeyboardInterrupt:
            child.terminate()
            child.wait(timeout=30)
            raise
    code = child.wait()
    log_text = log_path.read_text(encoding="utf-8", errors="replace")

    if code in (3, 4) or (code != 0 and not results):  # internal or usage error, or nothing ran
        errors = [line for line in log_text.splitlines() if line.startswith("ERROR")] or log_text.splitlines()[-15:]
        for line in errors:
            print(f"llmload: {line.replace(OPTION, '--loader')}", file=sys.stderr)
        print(f"llmload: pytest exited {code}; full output: {log_path}", file=sys.stderr)
        return EXIT_USAGE if code in (4, 5) or not results else EXIT_FAILED
    print("", file=out)
    for line in summary_table(results):
        print(line, file=out)
    failed = [r for r in results if r["outcome"] in FAILED_OUTCOMES]
    counts = {}
    for record in results:
        counts[record["outcome"]] = counts.get(record["outcome"], 0) + 1
    print("", file=out)
    for record in failed:
        label = "ERROR" if record["outcome"] == "error" else "FAILED"
        print(f"{label} {record['check']}: {_first_line(record['reason'])}", file=out)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(json_records(results), indent=1) + "\n", encoding="utf-8")
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    keep = bool(failed) or bool(args.log)
    where = f"pytest output: {log_path}" if keep else "nothing failed: pytest output removed (--log PATH keeps it)"
    print(f"llmload: {summary} in {time.monotonic() - started:.1f}s; {where}", file=out)
    # The log stays where --log put it, or in the temp dir while it explains a failure; nothing else is left.
    if args.log or not keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        progress.unlink(missing_ok=True)
    return EXIT_FAILED if failed or code not in (0, 5) else EXIT_OK
