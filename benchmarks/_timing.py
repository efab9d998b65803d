"""Shared helpers for the benchmark scripts: run a command several times, report medians.

Wall time on a shared machine moves with everyone else's load; the CPU time of a command (user + system,
its waited-for children included: xdist workers, forked ranks) moves much less, so both are reported.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]


def repo_env(**overrides: str) -> dict:
    """This process's environment with the repo first on PYTHONPATH and DeepSpeed on CPU."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.update(overrides)
    return env


def run_timed(argv: list[str], cwd=None, env=None, check: bool = True, log=None) -> tuple[float, float, int]:
    """``(wall seconds, CPU seconds, exit status)`` of one run of ``argv``; its output goes to the file ``log``
    (a path), else nowhere."""
    start = time.perf_counter()
    out = subprocess.DEVNULL if log is None else open(log, "wb")  # noqa: SIM115 - closed below
    try:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    finally:
        if log is not None:
            out.close()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, argv)
    return wall, usage.ru_utime + usage.ru_stime, proc.returncode


def timed(fn) -> float:
    """Wall seconds of one call of ``fn()``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_command(argv: list[str], runs: int, cwd=None, env=None) -> list[float]:
    """Wall times of ``runs`` runs of ``argv`` (after one warm-up run that is not counted)."""
    run_timed(argv, cwd=cwd, env=env)
    return [run_timed(argv, cwd=cwd, env=env)[0] for _ in range(runs)]


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float], scale: float = 1.0, unit: str = "s", digits: int = 2) -> str:
    """``median (min-max)`` of ``values`` times ``scale``."""
    return (f"{median(values) * scale:.{digits}f} {unit} "
            f"({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})")


def load_average() -> str:
    try:
        return "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def print_table(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    sys.stdout.flush()


def time_test_runs(commands: dict, labels: dict, runs: int, only=None, log_prefix: str = "llmload-bench",
                   env: Optional[dict] = None) -> tuple:
    """Each of ``commands`` (key -> argv, a pytest command line) ``runs`` times, from the repo, in ``env`` (default
    :func:`repo_env`): ``(results, rows)``, results a dict per key (median wall and CPU time, the exit statuses),
    rows ``(label, wall, CPU, outcome, loads)`` for :func:`print_table`. A failed run says which tests failed and
    keeps its log."""
    import tempfile
    from pathlib import Path

    results, rows = {}, []
    for key, argv in commands.items():
        if only and key != only:
            continue
        samples, loads = [], []
        for run in range(runs):
            loads.append(load_average())
            log = Path(tempfile.gettempdir(), f"{log_prefix}-{key}-{run}.log")
            samples.append(run_timed(argv, cwd=REPO, env=env or repo_env(), check=False, log=log))
            if samples[-1][2] != 0:  # say which tests failed, and keep the log
                failed = [line for line in log.read_text(errors="replace").splitlines()
                          if line.startswith(("FAILED", "ERROR"))]
                print(f"{labels[key]}, run {run + 1}: exit status {samples[-1][2]}; log {log}", *failed, sep="\n  ")
            else:
                log.unlink()
        walls, cpus = [w for w, _, _ in samples], [c for _, c, _ in samples]
        statuses = sorted({status for _, _, status in samples})
        results[key] = {"wall_s": median(walls), "cpu_s": median(cpus), "exit_statuses": statuses}
        rows.append((labels[key], spread(walls, digits=1), spread(cpus, digits=1),
                     "passed" if statuses == [0] else f"exit status {statuses}", "; ".join(loads)))
    return results, rows
