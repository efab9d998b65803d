"""The whole CPU suite (``pytest tests``), serial and with ``-n 2`` (goal: under 90 s serial).

Each variant runs ``--runs`` times (default 3); reports the median wall time and the median CPU time (user +
system of pytest and everything it waited for: xdist workers, forked children and ranks) with the exit
status. Wall time on a shared machine includes everyone else's load; the load average is printed with it.

    python benchmarks/bench_suite.py [--runs 3] [--only serial|n2]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import REPO, load_average, median, print_table, repo_env, run_timed, spread  # noqa: E402

VARIANTS = {"serial": [], "n2": ["-n", "2"]}
LABELS = {"serial": "pytest tests (serial)", "n2": "pytest tests -n 2"}


def main(runs: int = 3, only=None) -> dict:
    results, rows = {}, []
    for key, extra in VARIANTS.items():
        if only and key != only:
            continue
        argv = [sys.executable, "-m", "pytest", "tests", "-q", "-rfE", "-p", "no:cacheprovider", *extra]
        samples, loads = [], []
        for run in range(runs):
            loads.append(load_average())
            log = Path(tempfile.gettempdir(), f"llmload-bench-suite-{key}-{run}.log")
            samples.append(run_timed(argv, cwd=REPO, env=repo_env(), check=False, log=log))
            if samples[-1][2] != 0:  # say which tests failed, and keep the log
                failed = [line for line in log.read_text(errors="replace").splitlines()
                          if line.startswith(("FAILED", "ERROR"))]
                print(f"{LABELS[key]}, run {run + 1}: exit status {samples[-1][2]}; log {log}", *failed, sep="\n  ")
            else:
                log.unlink()
        walls, cpus = [w for w, _, _ in samples], [c for _, c, _ in samples]
        statuses = sorted({status for _, _, status in samples})
        results[key] = {"wall_s": median(walls), "cpu_s": median(cpus), "exit_statuses": statuses}
        rows.append((LABELS[key], spread(walls, digits=1), spread(cpus, digits=1),
                     "passed" if statuses == [0] else f"exit status {statuses}", loads[0]))
    print_table(f"the CPU suite, median (min-max) of {runs} runs", rows,
                ("variant", "wall time", "CPU time", "suite", "first run started at"))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=sorted(VARIANTS))
    options = parser.parse_args()
    main(options.runs, options.only)
