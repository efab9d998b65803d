"""What the main job prints once its pytest has ended: the summary table, the failed rows with their fixes, the
closing line, and the ``--json`` document; the exit code the rows give.

Every field comes from the child's progress records (:mod:`pytest_llmload.reports.progress`: a check's record is
its row, :class:`pytest_llmload.checks.row.Row`, what it guards against included): this process imports no check.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pytest_llmload.main_job.process import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    HOUSE_PLUGINS,
    INTERRUPTED,
    in_main_job_terms,
    progress_row,
    shown,
)

if TYPE_CHECKING:
    from pytest_llmload.main_job.process import MainJob

FAILED_OUTCOMES = ("failed", "predicted", "error", "xpassed")
LOG_TAIL_BYTES = 64 << 10


def _summary(record: dict) -> str:
    """A failed row's cause in one line (the progress file's ``summary``: a signal, an exit code, the exception)."""
    line = record.get("summary") or next((line.strip() for line in record["reason"].splitlines() if line.strip()), "")
    return line.removeprefix(f"{record['check']}: ")  # an isolated check's death starts with its name


def _tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    """The last ``limit`` bytes of ``path`` as text: a log read back is bounded, whatever the run wrote."""
    try:
        with path.open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - limit))
            return log.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(the log {path} could not be read: {exc})"


def report(job: "MainJob", code: int) -> tuple[int, bool]:
    """Print the summary of a finished run; returns the exit code and whether the log is kept."""
    args, out = job.args, job.out
    if job.usage_error is not None:  # (the child's, read at its configure: nothing ran, nothing to keep)
        print(f"llmload: error: {in_main_job_terms(job.usage_error)}", file=sys.stderr)
        return EXIT_USAGE, False
    for error in job.collect_errors:  # whole, as pytest raised them (its short summary cuts them at 80 columns)
        print(f"llmload: collection error in {error['nodeid'] or 'the session'}:\n    "
              + in_main_job_terms(error["message"].rstrip()).replace("\n", "\n    "), file=sys.stderr)
    crashed = code < 0 or code == 3 or code > 5
    # pytest's exit 2 is an interruption (a KeyboardInterrupt: raised in the loader or the check, or Ctrl-C in its
    # terminal); mid-check, the rows so far are the run's, and the check it stopped in says so.
    interrupted = code == INTERRUPTED and bool(job.running)
    rows = (job.crash_rows(code) if crashed else job.interrupted_rows() if interrupted
            else job.crash_rows(code, "pytest ended without this check's result") if job.running else [])
    for row in rows:
        job.results.append(row)
        print(progress_row(len(job.results), job.total, row), file=out, flush=True)
    if crashed and not rows and job.results:
        print(f"llmload: pytest itself ended (exit code {code}) between checks; its output: {job.log_path}",
              file=sys.stderr)
    if not job.results:  # a usage or collection error, or pytest died before any check ran
        log_text = _tail(job.log_path)
        if not job.collect_errors:
            lines = [line for line in log_text.splitlines() if line.startswith("ERROR")] or log_text.splitlines()[-15:]
            for line in lines:
                print(f"llmload: {in_main_job_terms(line)}", file=sys.stderr)
        keep = crashed or not (job.collect_errors or code == 4)  # else the errors above are the whole story
        where = f"full output: {job.log_path}" if keep or args.log else "pytest output removed (--log PATH keeps it)"
        print(f"llmload: pytest exited {code} before any check ran; {where}", file=sys.stderr)
        return (EXIT_FAILED if crashed else EXIT_USAGE), keep

    rank = {check: n for n, check in enumerate(job.order)}
    job.results.sort(key=lambda record: rank.get(record["check"], len(rank)))  # (stable; a name not collected last)
    print("", file=out)
    for line in summary_table(job.results):
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
            text = in_main_job_terms(_summary(record)).replace("\n", "\n    ")
            print(f"{label} {record['check']}: {text}", file=out)
            # What to do, where the mechanism shows: the row names its fix only where it observed (or predicted) the
            # very failure the check guards against.
            if record["outcome"] in ("failed", "predicted") and record.get("fix") is not None:
                print(f"    fix ({record['failure']}): {in_main_job_terms(record['fix'])}", file=out)
    if fast:
        names = ", ".join(r["check"] for r in fast)
        print(f"NOT RUN {names}: {in_main_job_terms(_summary(fast[0]))}", file=out)
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


def _failed_fast(record: dict) -> bool:
    """A check that did not wait: the loader under test hung in an earlier one (the row says so)."""
    return bool(record.get("not_run"))


def summary_table(results: list[dict]) -> list[str]:
    """The table: each check, the failure it guards against and where that comes from (``002``: its write-up in
    shared/seeds; ``field``: upstream issue trackers; ``extension``: a repo's own), its result and its time."""
    rows = [("check", "guards against", "result", "time")]
    for record in results:
        guards = f"{record['guards']} ({record.get('guards_origin')})" if record.get("guards") else ""
        outcome = shown(record["outcome"])
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
    from pytest_llmload.reports.header import installed_versions

    args = job.args
    ordered = "random (pytest-randomly, asked after --; its seed is in the log)" if any(
        flag in " ".join(args.pytest_args) for flag in HOUSE_PLUGINS["randomly"]) else "collection order"
    return {
        "tool": "pytest-llmload", "loader": job.loader, "stack": installed_versions(),
        "devices": {"gpus": gpus.physical_devices().count, "cuda_visible_devices": gpus.visible_devices_label()},
        "predictions": {"runner": args.runner, "model": args.model} if args.runner else None,
        "order": ordered, "started": job.started_at, "seconds": round(time.monotonic() - job.started, 2),
        "pytest_args": list(args.pytest_args), "results": json_records(job.results),
    }


def json_records(results: list[dict]) -> list[dict]:
    """``--json``: one object per check. ``failure`` is the catalog id the row is attributed to, only where the
    check observed that failure's mechanism (the verdict decided from the exception,
    :mod:`pytest_llmload.reports.verdict`); ``cause`` says what an error row is (loader, contract, model, hang, died,
    check)."""
    records = []
    for record in results:
        outcome = record["outcome"]
        failure = record.get("failure") if outcome in ("failed", "predicted") else None
        detail = in_main_job_terms(_summary(record)) if outcome in FAILED_OUTCOMES else record["reason"]
        records.append({"check": record["check"], "outcome": outcome, "verdict": record.get("verdict", outcome),
                        "failure": failure, "cause": record.get("cause"), "note": record.get("note"),
                        "notes": record.get("notes") or ([record["note"]] if record.get("note") else []),
                        "fix": record.get("fix"), "loader": record.get("loader"), "reason": record["reason"],
                        "seconds": record["seconds"], "detail": detail})
    return records
