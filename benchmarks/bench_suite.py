"""The whole CPU suite (``pytest tests``), serial and with ``-n 2`` (goal: under 90 s serial).

Each variant runs ``--runs`` times (default 3); reports the median wall time and the median CPU time (user +
system of pytest and everything it waited for: xdist workers, forked children and ranks) with the exit
status. Wall time on a shared machine includes everyone else's load; the load average is printed with it.

    python benchmarks/bench_suite.py [--runs 3] [--only serial|n2]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import print_table, time_test_runs  # noqa: E402

VARIANTS = {"serial": [], "n2": ["-n", "2"]}
LABELS = {"serial": "pytest tests (serial)", "n2": "pytest tests -n 2"}


def main(runs: int = 3, only=None) -> dict:
    commands = {key: [sys.executable, "-m", "pytest", "tests", "-q", "-rfE", "-p", "no:cacheprovider", *extra]
                for key, extra in VARIANTS.items()}
    results, rows = time_test_runs(commands, LABELS, runs, only, "llmload-bench-suite")
    print_table(f"the CPU suite, median (min-max) of {runs} runs", rows,
                ("variant", "wall time", "CPU time", "suite", "load at each start"))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", choices=sorted(VARIANTS))
    options = parser.parse_args()
    main(options.runs, options.only)
