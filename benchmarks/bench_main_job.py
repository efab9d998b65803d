"""The main job against its floor, and `pytest -m gpu` on a runner without GPUs (issue 18's first-contact goals).

- main job: ``python -m pytest_llmload`` (the reference loader, every check) and, right before each run, one bare
  import of the stack it uses (``import torch, transformers, accelerate, peft, deepspeed``): the floor. Pairing
  cancels the drift of a shared machine; the goal is a median ratio within 1.25.
- ``pytest -m gpu`` of this repo's tests with ``CUDA_VISIBLE_DEVICES=`` (every GPU test skips): the goal is
  under 3 s, which holds only if nothing imports torch before the skips.

    python benchmarks/bench_main_job.py [--runs 5] [--against DIR] [--one-lane]

``--against DIR``: also the main job of another checkout (a ``git worktree`` of an earlier commit), in the same
rounds, so that a before/after comparison shares the machine's drift: each round runs the floor, then this
checkout's main job, then DIR's. ``--one-lane``: also this main job with ``--lanes 1`` in each round (what the
lanes, ``pytest_llmload.plugin.lanes``, save).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import REPO, load_average, median, print_table, repo_env, run_timed, spread  # noqa: E402

FLOOR = [sys.executable, "-c", "import torch, transformers, accelerate, peft, deepspeed"]
MAIN_JOB = [sys.executable, "-m", "pytest_llmload"]
ONE_LANE = [*MAIN_JOB, "--lanes", "1"]
GPU_ONLY = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]


def main(runs: int = 5, against=None, one_lane: bool = False) -> dict:
    env = repo_env()
    other_env = None if against is None else {**env, "PYTHONPATH": os.pathsep.join(
        [str(against), *env["PYTHONPATH"].split(os.pathsep)[1:]])}
    run_timed(MAIN_JOB, cwd=REPO, env=env)  # warm-up: page cache, .pyc
    # label -> [(wall, CPU)] per round: CPU (user + system, children included) moves less than wall with the load
    runs_of: dict[str, list[tuple[float, float]]] = {"floor": [], "job": [], "other": [], "single": []}
    for _ in range(runs):
        runs_of["floor"].append(run_timed(FLOOR, cwd=REPO, env=env)[:2])
        runs_of["job"].append(run_timed(MAIN_JOB, cwd=REPO, env=env)[:2])
        if other_env is not None:
            runs_of["other"].append(run_timed(MAIN_JOB, cwd=against, env=other_env)[:2])
        if one_lane:
            runs_of["single"].append(run_timed(ONE_LANE, cwd=REPO, env=env)[:2])
    gpu_env = repo_env(CUDA_VISIBLE_DEVICES="")
    run_timed(GPU_ONLY, cwd=REPO, env=gpu_env)
    gpu_only = [run_timed(GPU_ONLY, cwd=REPO, env=gpu_env)[0] for _ in range(runs)]
    floor, job, other, single = ([wall for wall, _ in runs_of[k]] for k in ("floor", "job", "other", "single"))

    def row(label: str, key: str) -> tuple[str, str, str]:
        return label, spread([wall for wall, _ in runs_of[key]]), f"{median([cpu for _, cpu in runs_of[key]]):.2f} s"

    def ratio(label: str, these: list[float], those: list[float]) -> tuple[str, str, str]:
        ratios = [a / b for a, b in zip(these, those)]
        return label, f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})", ""

    print_table(f"main job against the bare import of its stack ({runs} pairs; load {load_average()})", [
        row("bare import: torch, transformers, accelerate, peft, deepspeed", "floor"),
        row("python -m pytest_llmload (reference loader, every check)", "job"),
        ratio("main job / import, median of the pairs (goal <= 1.25)", job, floor),
        *(() if against is None else (
            row(f"the main job of {against}", "other"),
            ratio(f"{against}'s main job / import", other, floor),
            ratio("this main job / that one, median of the rounds", job, other),
        )),
        *(() if not one_lane else (
            row("python -m pytest_llmload --lanes 1", "single"),
            ratio("its main job / import, median of the pairs", single, floor),
            ratio("this main job / --lanes 1, median of the rounds", job, single),
        )),
        ("pytest -m gpu, no GPU visible (goal < 3 s)", spread(gpu_only), ""),
    ], ("measure", "wall: median (min-max)", "CPU: median"))
    return {"floor_s": median(floor), "main_job_s": median(job),
            "ratio": statistics.median(j / f for j, f in zip(job, floor)), "gpu_only_s": median(gpu_only)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--against", type=Path, metavar="DIR", help="another checkout's main job, in the same rounds")
    parser.add_argument("--one-lane", action="store_true", help="also this main job with --lanes 1, in the same rounds")
    arguments = parser.parse_args()
    main(arguments.runs, arguments.against, arguments.one_lane)
