"""The test command (``python -m pytest -n 2``) and the inner loop (``-m "not slow"``), as a developer runs them.

- whole: ``python -m pytest -n 2 -q -p no:randomly``, tox.ini's addopts on top (the CI command, in a fixed order);
- inner loop: the same with ``-m "not slow"`` (the tests marked slow in tox.ini's ``[pytest] markers`` left out).

Each runs ``--runs`` times (default 1: the whole command takes minutes); reports the median wall time and the median
CPU time (user + system of pytest and everything it waited for: xdist workers, the main jobs and pytest runs the tests
start, forked children and ranks) with the exit status. Wall time on a shared machine includes everyone else's load;
the load average at each start is printed with it.

    python benchmarks/bench_test_command.py [--runs 1] [--only whole|inner]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import REPO, load_average, median, print_table, repo_env, run_timed, spread  # noqa: E402

BASE = [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:randomly"]
VARIANTS = {"whole": BASE, "inner": [*BASE, "-m", "not slow"]}
LABELS = {"whole": "pytest -n 2 -q -p no:randomly (the test command)",
          "inner": 'pytest -m "not slow" -n 2 -q -p no:randomly (the inner loop)'}


def main(runs: int = 1, only=None) -> dict:
    results, rows = {}, []
    for key, argv in VARIANTS.items():
        if only and key != only:
            continue
        samples, loads = [], []
        for run in range(runs):
            loads.append(load_average())
            log = Path(tempfile.gettempdir(), f"llmload-bench-test-command-{key}-{run}.log")
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
                     "passed" if statuses == [0] else f"exit status {statuses}", "; ".join(loads)))
    print_table(f"the test command, median (min-max) of {runs} run(s)", rows,
                ("command", "wall time", "CPU time", "tests", "load at each start"))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--only", choices=sorted(VARIANTS))
    options = parser.parse_args()
    main(options.runs, options.only)
