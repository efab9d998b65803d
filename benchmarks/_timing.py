"""Shared helpers for the benchmark scripts: run a command several times, report medians."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time


def time_command(argv: list[str], runs: int, cwd=None, env=None) -> list[float]:
    """Wall times of ``runs`` runs of ``argv`` (after one warm-up run that is not counted)."""
    subprocess.run(argv, cwd=cwd, env=env, check=True, capture_output=True)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, cwd=cwd, env=env, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)


def print_table(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    sys.stdout.flush()
