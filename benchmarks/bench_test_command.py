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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import print_table, time_test_runs  # noqa: E402

BASE = [sys.executable, "-m", "pytest", "-n", "2", "-q", "-p", "no:randomly"]
VARIANTS = {"whole": BASE, "inner": [*BASE, "-m", "not slow"]}
LABELS = {"whole": "pytest -n 2 -q -p no:randomly (the test command)",
          "inner": 'pytest -m "not slow" -n 2 -q -p no:randomly (the inner loop)'}


def main(runs: int = 1, only=None) -> dict:
    results, rows = time_test_runs(VARIANTS, LABELS, runs, only, "llmload-bench-test-command")
    print_table(f"the test command, median (min-max) of {runs} run(s)", rows,
                ("command", "wall time", "CPU time", "tests", "load at each start"))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--only", choices=sorted(VARIANTS))
    options = parser.parse_args()
    main(options.runs, options.only)
