"""Issue 48's measure: public projects' own commands (``fixtures/command_corpus/commands.json``), each run once
through ``python -m pytest_llmload run`` from a copy of its folder, its rows judged against what
``fixtures/command_corpus/EXPECTED.md`` says from the code (written before the first run).

    python benchmarks/bench_commands.py [--stack hf523|hf456] [--only ID ...] [--json PATH] [--keep-logs DIR]

Per cell: **right** (the row says what EXPECTED.md says), **false alarm** (the row failed where nothing fails),
**miss** (the row did not fail where the failure is caught), **wrong reason** (both agree nothing fails, but one says
"not observed" and the other "not reachable"). The command's own row is judged the same way (finished, crashed at
FILE:LINE, deadline). CPU seconds are the command's (the run and every process it started: ``wait4``'s rusage,
as ``/usr/bin/time -f "%U %S"`` gives them). Run one command at a time: the CPUs are shared. Each command's log
(``--keep-logs``) holds run's table and, where a row failed, the command's own output (run's kept folder is removed).

Some commands import packages neither stack installs (``datasets``, ``trl``, ``lm_eval``, ``fastapi``): they run
with ``--extras DIR`` on ``PYTHONPATH`` (made once with ``pip install --target DIR --no-deps`` of the packages that
``EXTRAS`` lists; the bench makes it where DIR is missing). The tiny checkpoints are built once into
``--cache-dir`` (default: a folder the bench keeps beside its output), so that a second run shows the cost after
the one-time builds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import REPO, load_average, print_table, repo_env, run_timed  # noqa: E402

CORPUS = REPO / "fixtures" / "command_corpus"
SHARED = REPO / "fixtures" / "commands"
STACKS = {"hf523": REPO / ".venv", "hf456": REPO / ".venv-hf456"}
EXTRAS = ("datasets pyarrow dill xxhash multiprocess pandas requests urllib3 idna certifi charset-normalizer "
          "python-dateutil pytz tzdata six httpx httpcore h11 anyio sniffio trl lm_eval evaluate jsonlines numexpr "
          "sqlitedict more_itertools word2number zstandard pytablewriter sacrebleu rouge_score portalocker tabulate "
          "colorama lxml dataproperty mbstrdecoder pathvalidate tabledata tcolorpy typepy chardet absl-py nltk regex "
          "joblib click fastapi starlette pydantic pydantic-core typing-inspection annotated-types uvicorn "
          "opentelemetry-api importlib-metadata zipp deprecated wrapt").split()
# A run's row verdict -> the expectation it stands for.
SAYS = {"failed": "caught", "passed": "not observed", "not exercised": "not reachable"}


def expected_table(path: Path = CORPUS / "EXPECTED.md") -> dict[str, dict[str, str]]:
    """``{command id: {column: cell}}`` from EXPECTED.md's table."""
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in path.read_text().splitlines() if line.startswith("|") and not line.startswith("|-")]
    header, *body = rows
    return {cells[0]: dict(zip(header[1:], cells[1:])) for cells in body}


def for_stack(cell: str, stack: str) -> str:
    """A cell's expectation on ``stack``: ``hf523: X; hf456: Y`` gives the stack's, a plain cell is both's."""
    parts = dict(part.strip().split(": ", 1) for part in cell.split(";") if part.strip().startswith("hf"))
    return parts.get(stack, cell)


def command_outcome(row: dict) -> str:
    """The command's row as EXPECTED.md writes it: finished, crashed FILE:LINE, deadline, exited."""
    if row["verdict"] == "passed":
        return "finished"
    sentence = row.get("sentence") or ""
    if row.get("cause") == "hang":
        return "deadline"
    crashed = re.search(r"crashed at (\S+?):(\d+) in", sentence)
    if crashed:
        return f"crashed {Path(crashed.group(1)).name}:{crashed.group(2)}"
    if "crashed at a library" in sentence:
        return "crashed in a library"
    return "exited"


def judge(expected: str, seen: str) -> str:
    if expected == seen:
        return "right"
    if seen == "caught":
        return "false alarm"
    if expected == "caught":
        return "miss"
    if expected.startswith(("finished", "crashed", "deadline")):
        return "wrong outcome"
    return "wrong reason"


def ensure_extras(directory: Path, python: Path) -> None:
    if directory.is_dir():
        return
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--target", str(directory), "--no-deps",
                    *EXTRAS], check=True)


def run_one(entry: dict, stack: str, cache: Path, extras: Path, logs: Path) -> dict:
    venv = STACKS[stack]
    source = (SHARED if entry.get("shared") else CORPUS) / entry["project"]
    with tempfile.TemporaryDirectory(prefix=f"corpus-{entry['id']}-") as scratch:
        repo = Path(scratch) / entry["project"]
        shutil.copytree(source, repo)
        report = Path(scratch) / "rows.json"
        env = repo_env(PATH=os.pathsep.join([str(venv / "bin"), os.environ.get("PATH", "")]), COLUMNS="200")
        if entry.get("extras"):
            env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(extras)])
        argv = [str(venv / "bin" / "python"), "-m", "pytest_llmload", "run", "--json", str(report), "--cache-dir",
                str(cache), *entry.get("options", []), "--", *entry["command"]]
        log = logs / f"{entry['id']}-{stack}.log"
        wall, cpu, code = run_timed(argv, cwd=repo, env=env, check=False, log=log)
        document = json.loads(report.read_text()) if report.is_file() else None
        if document and document.get("outputs"):  # (run keeps a failed command's folder; its output goes to the log)
            kept = Path(document["outputs"]).parent
            with log.open("a") as out:
                out.write("\n--- the command's own output ---\n" + (kept / "command.log").read_text(errors="replace"))
            shutil.rmtree(kept, ignore_errors=True)
    return {"id": entry["id"], "stack": stack, "exit": code, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
            "rows": document["results"] if document else None, "log": str(log)}


def cells(result: dict, expected: dict[str, str]) -> list[tuple[str, str, str, str]]:
    """``(column, expected, seen, judgement)`` for the command's row and each known failure's."""
    if result["rows"] is None:
        return [("command", for_stack(expected["command"], result["stack"]), "no rows (run itself failed)",
                 "wrong outcome")]
    rows = {row.get("guards") or row["check"]: row for row in result["rows"]}
    judged = []
    for column, cell in expected.items():
        want = for_stack(cell, result["stack"])
        row = rows.get(column)
        seen = "no row" if row is None else (command_outcome(row) if column == "command" else
                                             SAYS.get(row["verdict"], row["verdict"]))
        judged.append((column, want, seen, judge(want, seen)))
    return judged


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stack", choices=sorted(STACKS), default="hf523")
    parser.add_argument("--only", nargs="*", metavar="ID", help="these commands only (default: every one the "
                        "stack runs)")
    parser.add_argument("--json", metavar="PATH", help="also write every result and judgement to PATH")
    parser.add_argument("--extras", type=Path, default=Path(tempfile.gettempdir()) / "llmload-corpus-extras")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "llmload-corpus-tiny")
    parser.add_argument("--keep-logs", type=Path, default=Path(tempfile.gettempdir()) / "llmload-corpus-logs")
    args = parser.parse_args()

    entries = [entry for entry in json.loads((CORPUS / "commands.json").read_text())["commands"]
               if args.stack in entry["stacks"] and (not args.only or entry["id"] in args.only)]
    if any(entry.get("extras") for entry in entries):
        ensure_extras(args.extras, STACKS[args.stack] / "bin" / "python")
    args.keep_logs.mkdir(parents=True, exist_ok=True)
    table = expected_table()
    results, summary = [], []
    for entry in entries:
        print(f"{entry['id']} on {args.stack} ({load_average()}) ...", flush=True)
        result = run_one(entry, args.stack, args.cache_dir, args.extras, args.keep_logs)
        result["cells"] = cells(result, table[entry["id"]])
        results.append(result)
        counts = {kind: sum(1 for cell in result["cells"] if cell[3] == kind)
                  for kind in ("right", "false alarm", "miss", "wrong reason", "wrong outcome")}
        summary.append((entry["id"], str(result["exit"]), f"{result['cpu_s']:.1f}", f"{result['wall_s']:.1f}",
                        *(str(n) for n in counts.values())))
        for column, want, seen, verdict in result["cells"]:
            if verdict != "right":
                print(f"    {column}: expected {want!r}, run says {seen!r} ({verdict})", flush=True)
    print_table(f"the command corpus on {args.stack}", summary,
                ("command", "exit", "CPU s", "wall s", "right", "false alarm", "miss", "wrong reason",
                 "wrong outcome"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
