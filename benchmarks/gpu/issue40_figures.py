"""Issue 40's GPU figures in one run on a lent GPU (``benchmarks/gpu/run_on_device.sh issue40``): goals 1 and 2.

Each round, paired as ``benchmarks/bench_main_job.py`` pairs them (the CPU counts what a run left to end after it:
the forkserver and the ranks it reaps):

- ``python -c "import torch"`` (the CUDA build) and the bare import of the stack: the main job's floor;
- goal 1: ``python -m pytest_llmload`` (the reference loader, every check: the CPU, GPU and distributed ones), its
  rows (``--json``: each check's time), against the floor (goal: under 30 s; within 1.5x of its floor on a CPU
  machine with the CUDA build);
- goal 2: ``pytest -m gpu -n 4`` (4 workers sharing the one GPU, the default with fewer GPUs than workers; a test
  measuring its CUDA peak holds it alone, ``system.gpus.held_by_test``): wall, CPU, outcomes (goal: under 60 s; 141.3 s before),
  twice: as this repo's conftest.py sets it up (``PYTEST_LLMLOAD_COLD_FORKSERVER=1``: every forkserver child, each
  ``_cuda`` check of a worker that has initialised CUDA, imports the stack itself) and with the warm server
  (the variable set empty, which the conftest keeps).

    python benchmarks/gpu/issue40_figures.py [--rounds 1] [--out figures.json] [--skip-gpu-suite]

Prints a table and writes every figure to ``--out`` (JSON); the main job's rows and the suite's log go beside it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from _timing import REPO, load_average, median, print_table, repo_env  # noqa: E402
from bench_main_job import STACK, count_orphans, run_counted, torch_build  # noqa: E402

# The repo's conftest.py sets PYTEST_LLMLOAD_COLD_FORKSERVER=1 where it is unset, and keeps a value set empty.
SERVERS = {"cold": {}, "warm": {"PYTEST_LLMLOAD_COLD_FORKSERVER": ""}}
GPU_SUITE = ["-m", "pytest", "-m", "gpu", "-n", "4", "-q", "-rfE",
             "-p", "no:cacheprovider"]


def main(rounds: int, out: Path, skip_gpu_suite: bool) -> dict:
    python = sys.executable
    env = {key: value for key, value in repo_env().items() if key != "DS_ACCELERATOR"}  # (a GPU runner's own)
    out.parent.mkdir(parents=True, exist_ok=True)
    count_orphans()
    figures: dict = {"torch": torch_build(python), "load": load_average(), "rounds": []}
    for n in range(rounds):
        job_json = out.with_name(f"main-{n}.json")
        round_ = {
            "import torch": run_counted([python, "-c", "import torch"], cwd=REPO, env=env),
            "floor": run_counted([python, "-c", STACK], cwd=REPO, env=env),
            "main job": run_counted([python, "-m", "pytest_llmload", "--json", str(job_json),
                                     "--log", str(out.with_name(f"main-{n}.log"))], cwd=REPO, env=env, check=False),
        }
        if job_json.exists():  # each check's outcome and seconds, as the main job's table shows them
            results = json.loads(job_json.read_text())["results"]
            round_["main job checks"] = {r["check"]: [r["outcome"], r["seconds"]] for r in results}
        for server in () if skip_gpu_suite else SERVERS:
            key, log = f"pytest -m gpu -n 4, {server} server", out.with_name(f"gpu-n4-{server}-{n}.log")
            junit = out.with_name(f"junit-gpu-n4-{server}-{n}.xml")
            round_[key] = run_counted([python, *GPU_SUITE, "--junitxml", str(junit)], cwd=REPO,
                                      env={**env, **SERVERS[server]}, log=log, check=False)
            summary = [line for line in log.read_text(errors="replace").splitlines() if re.search(r" in [\d.]+s", line)]
            round_[f"{key}: outcome"] = summary[-1].strip("= ") if summary else "no summary line (see the log)"
        figures["rounds"].append(round_)
        print(f"round {n + 1}: {json.dumps(round_)}", flush=True)

    def walls(key):
        return [r[key][0] for r in figures["rounds"] if key in r]

    def cpus(key):
        return [r[key][1] for r in figures["rounds"] if key in r]

    ratios = [r["main job"][0] / r["floor"][0] for r in figures["rounds"]]
    figures["summary"] = {key: {"wall_s": median(walls(key)), "cpu_s": median(cpus(key))}
                          for key in ("import torch", "floor", "main job", *(f"pytest -m gpu -n 4, {server} server"
                                                                             for server in SERVERS)) if walls(key)}
    figures["summary"]["main job / floor"] = median(ratios)
    out.write_text(json.dumps(figures, indent=2))
    rows = [(key, f"{value['wall_s']:.1f} s", f"{value['cpu_s']:.1f} s")
            for key, value in figures["summary"].items() if isinstance(value, dict)]
    rows.append(("main job / floor, median of the rounds", f"{median(ratios):.2f}", ""))
    print_table(f"issue 40 on this GPU runner ({figures['torch']}; {rounds} rounds; {figures['load']})", rows,
                ("measure", "wall: median", "CPU: median"))
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("/tmp/out/issue40.json"))
    parser.add_argument("--skip-gpu-suite", action="store_true", help="goal 1 only")
    arguments = parser.parse_args()
    main(arguments.rounds, arguments.out, arguments.skip_gpu_suite)
