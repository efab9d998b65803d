"""``python -m pytest_llmload run [options] -- COMMAND...``: the repo's own command run once on tiny weights
(:mod:`.command`), judged (:mod:`.rows`), and printed as the main job prints its checks: the same table, the failed
rows with their fixes, ``--json`` and exit codes (0 nothing failed, 1 a row failed, 4 a usage error, 130 Ctrl-C).

The run leaves nothing behind: its folder (bootstrap, findings, outputs, the command's output) is removed, unless a
row failed: then the command's output and the outputs stay where the rows name them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
from pathlib import Path
from typing import Optional

from pytest_llmload.main_job.cli import UsageError, check_output_path
from pytest_llmload.main_job.process import EXIT_FAILED, EXIT_OK, EXIT_USAGE, Interrupted, signals_interrupt
from pytest_llmload.main_job.table import json_records, summary_table
from pytest_llmload.main_job.terminal import columns, wrapped
from pytest_llmload.system.output_files import open_output
from pytest_llmload.reports.row import failed_lines

DEFAULT_STEPS = 2
DEFAULT_DEADLINE_S = 600.0
FAILED_VERDICTS = ("failed", "error")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmload run", description="Run the repo's own command (after '--') on tiny weights, bounded, every "
        "known failure watched; print one row per known failure and one for the command.")
    parser.add_argument("--json", metavar="PATH", dest="json_path", help="also write the rows to PATH")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                        help=f"optimizer steps before training stops (default {DEFAULT_STEPS})")
    parser.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE_S, metavar="SECONDS",
                        help=f"the whole command's deadline (default {DEFAULT_DEADLINE_S:g})")
    parser.add_argument("--model", action="append", default=[], metavar="ID=CONFIG",
                        help="the architecture of a model the command names that is not shipped: a shipped name "
                        "(--list-models) or a config.json; repeatable")
    parser.add_argument("--cache-dir", metavar="PATH", help="where tiny checkpoints are built and kept "
                        "(default ~/.cache/pytest-llmload/tiny-checkpoints)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after '--'")
    return parser


def _models(specs: list[str]) -> dict[str, str]:
    from pytest_llmload.placement import architectures

    models = {}
    for spec in specs:
        name, sep, config = spec.partition("=")
        if not sep or not name or not config:
            raise UsageError(f"--model {spec!r} is not ID=CONFIG; e.g. --model Qwen/Qwen2-0.5B=qwen2.5-7b")
        try:
            architectures.load_config(config, source=f"--model {name}=")
        except architectures.ArchitectureError as exc:
            raise UsageError(str(exc)) from None
        models[name] = config if not Path(config).exists() else str(Path(config).resolve())
    return models


def _parsed(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.command:
        raise UsageError("no command to run; give it after '--', e.g. python -m pytest_llmload run -- python "
                         "train.py --config ci.yaml")
    if args.steps < 1:
        raise UsageError(f"--steps {args.steps}: give 1 or more optimizer steps")
    if not args.deadline > 0:
        raise UsageError(f"--deadline {args.deadline:g}: give a number of seconds above 0")
    args.models = _models(args.model)
    if args.json_path:
        check_output_path(args.json_path, "--json")  # (the main job's checks of an output file, before the run)
    return args


def main(argv: Optional[list[str]] = None, out=None) -> int:
    from pytest_llmload.commands.command import CommandNotFound, new_workdir, run_command
    from pytest_llmload.commands.rows import rows_of

    out = out or sys.stdout
    try:
        args = _parsed(sys.argv[2:] if argv is None else argv)
    except UsageError as exc:
        print(f"llmload run: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    workdir, keep = new_workdir(), False
    try:
        try:
            with signals_interrupt():
                run = run_command(args.command, workdir, steps=args.steps, deadline=args.deadline,
                                  models=args.models, cache_dir=Path(args.cache_dir) if args.cache_dir else None)
        except CommandNotFound as exc:
            print(f"llmload run: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        except (Interrupted, KeyboardInterrupt) as stop:
            signum = getattr(stop, "signum", signal.SIGINT)
            print(f"llmload run: stopped by {signal.Signals(signum).name}; every process of the command was ended",
                  file=sys.stderr)
            return 128 + signum  # (the main job's codes: 130 for Ctrl-C, 143 for SIGTERM)
        rows = rows_of(run)
        failed = [row for row in rows if row.verdict in FAILED_VERDICTS]
        keep = bool(failed)
        _print(rows, failed, run, out)
        if args.json_path:
            document = {"tool": "pytest-llmload run", "command": run.argv, "returncode": run.returncode,
                        "seconds": round(run.seconds, 2), "cpu_seconds": round(run.cpu_seconds, 2),
                        "outputs": str(run.output_dir) if keep else None, "results": json_records(rows)}
            try:
                with open_output(args.json_path) as written:  # (no link another user made)
                    written.write(json.dumps(document, indent=1) + "\n")
            except OSError as exc:  # (the rows are above: the table was printed first)
                print(f"llmload run: error: --json {args.json_path!r} could not be written after the run "
                      f"({type(exc).__name__}: {exc}); the table above is the run's", file=sys.stderr)
                return EXIT_FAILED
        return EXIT_FAILED if failed else EXIT_OK
    finally:
        if keep:  # what the failed rows name stays; the run's own machinery goes
            shutil.rmtree(workdir / "bootstrap", ignore_errors=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _print(rows: list, failed: list, run, out) -> None:
    width = columns(out)
    print("", file=out)
    for line in summary_table(rows, width):
        print(line, file=out)
    print("", file=out)
    for row in failed:
        for line in failed_lines(row, "the command"):
            print(wrapped(line, width), file=out)
    where = f"; its output and outputs: {run.log.parent}" if failed else ""
    print(wrapped(f"llmload run: {len(failed)} failed of {len(rows)} rows; the command took {run.seconds:.1f}s, "
                  f"{run.cpu_seconds:.1f}s CPU{where}", width), file=out)
