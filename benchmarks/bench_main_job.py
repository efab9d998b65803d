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
lanes, ``pytest_llmload.runners.lanes``, save).
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
    floor, job, ratios, other, other_ratios, single = [], [], [], [], [], []
    for _ in range(runs):
        floor.append(run_timed(FLOOR, cwd=REPO, env=env)[0])
        job.append(run_timed(MAIN_JOB, cwd=REPO, env=env)[0])
        ratios.append(job[-1] / floor[-1])
        if other_env is not None:
            other.append(run_timed(MAIN_JOB, cwd=against, env=other_env)[0])
            other_ratios.append(other[-1] / floor[-1])
        if one_lane:
            single.append(run_timed(ONE_LANE, cwd=REPO, env=env)[0])
    gpu_env = repo_env(CUDA_VISIBLE_DEVICES="")
    run_timed(GPU_ONLY, cwd=REPO, env=gpu_env)
    gpu_only = [run_timed(GPU_ONLY, cwd=REPO, env=gpu_env)[0] for _ in range(runs)]
    print_table(f"main job against the bare import of its stack ({runs} pairs; load {load_average()})", [
        ("bare import: torch, transformers, accelerate, peft, deepspeed", spread(floor)),
        ("python -m pytest_llmload (reference loader, every check)", spread(job)),
        ("main job / import, median of the pairs (goal <= 1.25)", f"{statistics.median(ratios):.2f} "
         f"({min(ratios):.2f}-{max(ratios):.2f})"),
        *(() if against is None else (
            (f"the main job of {against}", spread(other)),
            (f"{against}'s main job / import", f"{statistics.median(other_ratios):.2f} "
             f"({min(other_ratios):.2f}-{max(other_ratios):.2f})"),
            ("this main job / that one, median of the rounds",
             f"{statistics.median(j / o for j, o in zip(job, other)):.2f}"),
        )),
        *(() if not one_lane else (
            ("python -m pytest_llmload --lanes 1", spread(single)),
            ("its main job / import, median of the pairs",
             f"{statistics.median(s / f for s, f in zip(single, floor)):.2f}"),
            ("this main job / --lanes 1, median of the rounds",
             f"{statistics.median(j / s for j, s in zip(job, single)):.2f}"),
        )),
        ("pytest -m gpu, no GPU visible (goal < 3 s)", spread(gpu_only)),
    ], ("measure", "wall: median (min-max)"))
    return {"floor_s": median(floor), "main_job_s": median(job), "ratio": statistics.median(ratios),
            "gpu_only_s": median(gpu_only)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--against", type=Path, metavar="DIR", help="another checkout's main job, in the same rounds")
    parser.add_argument("--one-lane", action="store_true", help="also this main job with --lanes 1, in the same rounds")
    arguments = parser.parse_args()
    main(arguments.runs, arguments.against, arguments.one_lane)
