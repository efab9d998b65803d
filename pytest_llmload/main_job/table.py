"""What the main job prints once its pytest has ended: the summary table, the failed rows with their fixes, the
closing line, and the ``--json`` document; the exit code the rows give.

Every field comes from the child's progress records (:mod:`pytest_llmload.reports.progress`), each a row,
:class:`pytest_llmload.reports.row.Row` (what it guards against included), taken as it is: nothing here derives,
renames or parses a field. This process imports no check.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from pytest_llmload.main_job.process import (
    EXIT_FAILED,
    EXIT_NO_TESTS,
    EXIT_OK,
    EXIT_USAGE,
    FAIL_NOT_EXERCISED,
    HOUSE_PLUGINS,
    INTERRUPTED,
    STOP_GRACE_S,
    Interrupted,
    exit_described,
    in_main_job_terms,
    seconds_shown,
    shown,
)
from pytest_llmload.main_job.terminal import NAME_PARTS, at_most, wrap
from pytest_llmload.placement.picture import where_the_model_goes
from pytest_llmload.reports.row import Row, assumption_lines, failed_lines
from pytest_llmload.system.output_files import open_output

if TYPE_CHECKING:
    from pytest_llmload.main_job.process import MainJob

FAILED_OUTCOMES = ("failed", "predicted", "error", "xpassed")
GAP = "  "  # between the table's columns
GUARDS_MIN = 18  # "guards against" narrows to this before the check names are wrapped ("offload-hang (000)")
REASON_LINES, REASON_INDENT = 3, "    "  # a reason below its row: at most 3 lines there (whole in --json, the log)
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


def report(job: "MainJob", code: int) -> tuple[int, bool]:
    """Print the summary of a finished run; returns the exit code and whether the log is kept."""
    args, out = job.args, job.out
    if job.usage_error is not None:  # (the child's, read at its configure: nothing ran, nothing to keep)
        said = f"llmload: error: {in_main_job_terms(job.usage_error)}"
        print(said, file=sys.stderr)
        write_json(job, stopped=said.removeprefix("llmload: "))
        return EXIT_USAGE, False
    for error in job.collect_errors:  # whole, as pytest raised them (its short summary cuts them at 80 columns)
        print(f"llmload: collection error in {error['nodeid'] or 'the session'}:\n    "
              + in_main_job_terms(error["message"].rstrip()).replace("\n", "\n    "), file=sys.stderr)
    crashed = code < 0 or code == 3 or code > 5
    # pytest's exit 2 is an interruption (a KeyboardInterrupt: raised in the loader or the check, or Ctrl-C in its
    # terminal); mid-check, the rows so far are the run's, and the check it stopped in says so.
    interrupted = code == INTERRUPTED and (bool(job.running) or job.interruption is not None)
    rows = (job.crash_rows(code) if crashed else job.interrupted_rows() if interrupted
            else job.crash_rows(code, "pytest ended without this check's result") if job.running else [])
    for row in rows:
        job.results.append(row)
        job.print_row(row)
    if crashed and not rows and job.results:
        print(f"llmload: pytest itself ended (exit code {code}) between checks; its output: {job.log_path}",
              file=sys.stderr)
    if not job.results and code == EXIT_NO_TESTS and not job.collect_errors:  # -k (or -m, ...) selected nothing
        said = next((line.strip(" =") for line in reversed(_tail(job.log_path).splitlines()) if line.strip()), "")
        which = f": -k {args.keyword!r} matched none of the checks (--list lists them)" if args.keyword else ""
        job.say(f"llmload: no tests ran (pytest: {said}){which}")
        write_json(job, stopped=f"no tests ran (pytest: {said}){which}")
        return EXIT_NO_TESTS, False
    if not job.results:  # a usage or collection error, or pytest died before any check ran
        log_text = _tail(job.log_path)
        if not job.collect_errors:
            lines = [line for line in log_text.splitlines() if line.startswith("ERROR")] or log_text.splitlines()[-15:]
            for line in lines:
                print(f"llmload: {in_main_job_terms(line)}", file=sys.stderr)
        keep = crashed or not (job.collect_errors or code == EXIT_USAGE)  # else the errors above are the whole story
        where = f"full output: {job.log_path}" if keep or args.log else "pytest output removed (--log PATH keeps it)"
        by = job.interrupted_by()  # (the run's deadline during collection, say)
        said = f"{by} before any check ran" if by else f"pytest exited {code} before any check ran"
        print(f"llmload: {said}; {where}", file=sys.stderr)
        errors = "; ".join(f"collection error in {error['nodeid'] or 'the session'}" for error in job.collect_errors)
        write_json(job, stopped=f"{said}{': ' + errors if errors else ''}; {where}", interrupted=code == INTERRUPTED)
        # pytest's own code where it has one for this (2: collection errors or an interruption; 4: a usage error)
        return (EXIT_FAILED if crashed else code if code in (INTERRUPTED, EXIT_USAGE) else EXIT_USAGE), keep

    rank = {check: n for n, check in enumerate(job.order)}
    job.results.sort(key=lambda row: rank.get(row.check, len(rank)))  # (stable; a name not collected last)
    print("", file=out)
    lines, cut_any = _laid_out(_cells(job.results), job.width)
    for line in lines:
        print(line, file=out)
    reported = [row for row in job.results if row.outcome in FAILED_OUTCOMES]
    # (a prediction on a runner/model pair the repo does not gate on, llmload_gate_runners: reported, exit 0)
    failed = [row for row in reported if (row.prediction or {}).get("gated", True)]
    _append_to_log(job.log_path, ["", "llmload: the table, every reason whole:", *summary_table(job.results)])
    if cut_any:
        log = "pytest's log" + ("" if failed or args.log else " (--log PATH keeps it)")
        json_option = "--json" if args.json_path else "--json PATH"
        job.say(f"(reasons cut to fit {job.width} columns: whole in {log} and in {json_option})")
    counts: dict[str, int] = {}
    for row in job.results:
        counts[row.outcome] = counts.get(row.outcome, 0) + 1
    print("", file=out)
    fast = [row for row in failed if row.not_run]
    for row in reported:
        if row not in fast:
            # What to do: the row names a fix where it observed (or predicted) the very failure the check guards
            # against, or where the loader's own error is a known fault (loader.faults; its text may say it already).
            label = "" if row in failed else \
                {"error": "ERROR", "predicted": "PREDICTED"}.get(row.outcome, "FAILED") + " (not gated)"
            for line in failed_lines(row, "the loader", label=label, terms=in_main_job_terms):
                job.say(line)
    if fast:
        names = ", ".join(row.check for row in fast)
        job.say(f"NOT RUN {names}: {in_main_job_terms(fast[0].finding)}")
    predictions = [(row.check, row.prediction) for row in job.results if row.prediction]
    for line in where_the_model_goes(predictions, "--json" if args.json_path else "--json PATH"):
        job.say(line)
    assumed = [(row.check, row.guards, row.assumptions) for row in job.results if row.assumptions]
    if assumed:
        for line in assumption_lines(assumed, FAIL_NOT_EXERCISED, args.fail_not_exercised):
            job.say(in_main_job_terms(line))  # (an assumption may name a pytest option)
    running = ", ".join(row.check for row in rows)
    during = f"while {running} ran" if rows else "between checks"
    by = job.interrupted_by()
    stopped = (f"{by} {during}" if interrupted and by else
               f"interrupted {during} (pytest's exit {code}: a KeyboardInterrupt, raised in the loader or the check, "
               "or Ctrl-C in its terminal)" if interrupted else
               f"pytest itself ended ({exit_described(code)}) {during}" if crashed else None)
    json_lost = not write_json(job, stopped=stopped, interrupted=interrupted)
    summary = ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items()))
    keep = bool(failed) or json_lost or crashed or bool(args.log)
    where = f"pytest output: {job.log_path}" if keep else "nothing failed: pytest output removed (--log PATH keeps it)"
    job.say(f"llmload: {summary} in {time.monotonic() - job.started:.1f}s; {where}")
    if interrupted:
        print(f"llmload: {stopped}; the rows before it are above", file=sys.stderr)
        return INTERRUPTED, True
    return (EXIT_FAILED if failed or json_lost or code not in (0, 5) else EXIT_OK), keep


def _append_to_log(path: Path, lines: list[str]) -> None:
    """The table whole at the end of pytest's log (the terminal's copy cuts long reasons to its width)."""
    try:
        with open_output(path, append=True) as log:
            log.write("\n".join(lines) + "\n")
    except OSError:  # (the table above is the run's; a log that cannot take it loses nothing else)
        pass


def summary_table(results: list[Row], width: Optional[int] = None) -> list[str]:
    """The table: each check, the failure it guards against and where that comes from (``002``: its write-up in
    shared/seeds; ``field``: upstream issue trackers; ``extension``: a repo's own), its result and its time; in lines
    no wider than ``width`` (:func:`_laid_out`; ``None``: every cell whole, as the log keeps it)."""
    return _laid_out(_cells(results), width)[0]


def _cells(results: list[Row]) -> list[tuple[str, str, str, str]]:
    """The table's cells, whole: a header, then a row per check."""
    cells = [("check", "guards against", "result", "time")]
    for row in results:
        guards = f"{row.guards} ({row.guards_origin})" if row.guards else ""
        outcome = shown(row.outcome)
        if row.outcome in ("skipped", "xfailed") and row.sentence:
            outcome += f" ({row.sentence})"
        elif row.not_run:
            outcome += " (not run: the loader hung before)"
        elif row.outcome == "predicted" and row.failure:
            outcome += f" {row.failure}"
        elif row.note:
            outcome += f" ({row.note})"
        cells.append((row.check, guards, outcome, seconds_shown(row)))
    return cells


def _laid_out(rows: list[tuple[str, str, str, str]], width: Optional[int]) -> tuple[list[str], bool]:
    """The table's lines, no wider than ``width``; and whether a reason was cut. Each row on one line where every
    row fits so (``width`` ``None``: always, every cell whole). Else a result too wide for its column keeps its word
    there (``skipped``) and its reason goes below the row, wrapped and cut at :data:`REASON_LINES` lines; where the
    names alone are too wide, the "guards against" column narrows first, then the check's, their cells wrapped."""
    rows = [(check, guards, " ".join(result.split()), seconds) for check, guards, result, seconds in rows]
    check_w, guards_w, result_w, time_w = (max(len(row[i]) for row in rows) for i in range(4))
    time_w = max(time_w, 7)
    if width is None or check_w + guards_w + result_w + time_w + 3 * len(GAP) <= width:
        lines = [GAP.join((check.ljust(check_w), guards.ljust(guards_w), result.ljust(result_w), seconds.rjust(time_w)))
                 for check, guards, result, seconds in rows]
        return lines[:1] + ["-" * len(lines[0])] + lines[1:], False
    word_w = max(len(result.partition(" ")[0]) for _, _, result, _ in rows)
    room = width - word_w - time_w - 3 * len(GAP)  # for the check's name and what it guards against
    if check_w + guards_w > room:
        guards_w = max(min(guards_w, GUARDS_MIN), room - check_w)
        check_w = room - guards_w
        if check_w < GUARDS_MIN // 2:  # (a terminal of 40 to 60 columns: both narrow)
            guards_w = room // 3
            check_w = room - guards_w
    fits = width - check_w - guards_w - time_w - 3 * len(GAP)
    result_w = max(len(result) if len(result) <= fits else len(result.partition(" ")[0]) for _, _, result, _ in rows)
    lines, cut_any = [], False
    for check, guards, result, seconds in rows:
        below: list[str] = []
        if len(result) > result_w:  # its word stays in the column, the rest goes below the row
            result, _, reason = result.partition(" ")
            reason = reason[1:-1] if reason.startswith("(") and reason.endswith(")") else reason
            below, was_cut = at_most(wrap(reason, width - len(REASON_INDENT)), REASON_LINES, width - len(REASON_INDENT))
            below, cut_any = [REASON_INDENT + line for line in below], cut_any or was_cut
        cells = (wrap(check, check_w, breaks=NAME_PARTS), wrap(guards, guards_w, breaks=NAME_PARTS), [result],
                 [seconds])
        for i in range(max(map(len, cells))):
            check_part, guards_part, result_part, seconds_part = (cell[i] if i < len(cell) else "" for cell in cells)
            lines.append(GAP.join((check_part.ljust(check_w), guards_part.ljust(guards_w), result_part.ljust(result_w),
                                   seconds_part.rjust(time_w))).rstrip())
        lines += below
    return lines[:1] + ["-" * (check_w + guards_w + result_w + time_w + 3 * len(GAP))] + lines[1:], cut_any


def write_json(job: "MainJob", stopped: Optional[str] = None, interrupted: bool = False) -> bool:
    """``--json``, where asked, written whatever ended the run (:func:`json_document`); False where it could not be
    written (said on stderr: the table, printed first, is the run's)."""
    path = job.args.json_path
    if not path:
        return True
    try:
        with open_output(path) as document:  # (no link another user made)
            document.write(json.dumps(json_document(job, stopped, interrupted), indent=1) + "\n")
        return True
    except OSError as exc:
        print(f"llmload: --json {path!r} could not be written after the run ({type(exc).__name__}: {exc}); "
              "the table above is the run's", file=sys.stderr)
        return False


def json_document(job: "MainJob", stopped: Optional[str] = None, interrupted: bool = False) -> dict:
    """``--json``: one document: what ran (the loader and where it was chosen, the stack, the devices, the order,
    when and how long), whether it was interrupted (a signal, a KeyboardInterrupt) and why it stopped before its
    end (``stopped``: ``null`` for a run that ran every check it selected), then one object per check, the rows so
    far (:func:`json_records`)."""
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
        "pytest_args": list(args.pytest_args), "interrupted": interrupted, "stopped": stopped,
        "results": json_records(job.results),
    }


def json_records(results: list[Row]) -> list[dict]:
    """``--json``: one object per check, its row as it is (:meth:`~pytest_llmload.reports.row.Row.as_dict`, the
    progress file's record and pytest-reportlog's ``LlmloadRow`` too). ``failure`` is the catalog id the row is
    attributed to, only where the check observed that failure's mechanism (the verdict decided from the exception,
    :mod:`pytest_llmload.reports.verdict`); ``cause`` says what an error row is (loader, contract, model, hang, died,
    check); ``sentence`` its whole reason; ``prediction``, a prediction row's, where the model would go
    (``devices``: each one's modules, weights, peak and capacity in bytes; ``tiers``: gpu, cpu and disk;
    ``placement``: the modules per device, layers as ranges; ``device_map``: every entry), else ``null``."""
    return [row.as_dict() for row in results]


def report_interrupted(job: "MainJob", stop: Interrupted) -> int:
    """The one line an interrupted main job prints, after stopping its pytest; the exit code, 128 + the signal's
    number (pytest's interrupted, 2, at the run's deadline). The rows so far survive: those pytest wrote while it
    stopped, an ``error`` row (cause ``interrupted``) for each check still running, and ``--json`` with them, marked
    interrupted."""
    stopped = job.stop(stop.signum)
    job.keep_rows_at_a_stop(f"{stop.said()} while this check ran")
    how = "stopped and cleaned up" if stopped else f"killed: it had not stopped {STOP_GRACE_S:g} s after the signal"
    log = f"pytest output: {job.log_path}" if job.args.log else "pytest output removed (--log PATH keeps it)"
    said = (f"{stop.said()} after {time.monotonic() - job.started:.1f}s with "
            f"{sum(row.cause != 'interrupted' for row in job.results)} of {job.total or '?'} checks done")
    write_json(job, stopped=said, interrupted=True)
    print(f"llmload: {said}; pytest {how}; {log}", file=sys.stderr, flush=True)
    return INTERRUPTED if stop.deadline is not None else 128 + stop.signum
