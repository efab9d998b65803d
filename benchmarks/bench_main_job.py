"""The main job against its floor, and `pytest -m gpu` on a runner without GPUs (issue 18's first-contact goals).

- main job: ``python -m pytest_llmload`` (the reference loader, every check) and, right before each run, one bare
  import of the stack it uses (``import torch, transformers, accelerate, peft, deepspeed``): the floor. Pairing
  cancels the drift of a shared machine; the goal is a median ratio within 1.25. The checkouts' own modules are
  compiled to bytecode first (as an install has them; the floor's libraries have theirs).
- ``pytest -m gpu`` of this repo's tests with ``CUDA_VISIBLE_DEVICES=`` (every GPU test skips): the goal is
  under 3 s, which holds only if nothing imports torch before the skips.

    python benchmarks/bench_main_job.py [--runs 5] [--against DIR] [--python PY] [--simulate-gpu]
                                        [--import-torch PY ...]

``--against DIR``: also the main job of another checkout (a ``git worktree`` of an earlier commit), in the same
rounds, so that a before/after comparison shares the machine's drift: each round runs the floor, then this
checkout's main job, then DIR's, and says both (wall and CPU, with the load) as it ends, so that the noise shows; the
table gives the medians of the paired ratios, in wall time and in CPU. Issue 47 measured the lanes this way (a
checkout of d992cc3, whose ``--lanes 1`` was this main job's one process, against its default of two lanes:
docs/performance.md), then removed them.

Issue 40 (the GPU runner's path, measured where no GPU is lent): ``--python PY`` runs the floor and the main jobs with
another venv's interpreter (``.venv-cuda/bin/python``: the CUDA build of torch, which a GPU runner imports in every new
interpreter); the table names that torch's build. ``--simulate-gpu``: each main job also runs with one GPU faked for
the plugin (``$PYTEST_LLMLOAD_FAKE_GPUS``: the distributed checks' GPU-less server takes its GPU path; torch itself
sees none) and without the ``_cuda`` checks, which need a real one. ``--import-torch PY ...``:
``python -c "import torch"`` of each interpreter, in the same rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import subprocess  # noqa: E402

from _timing import REPO, load_average, median, print_table, repo_env, run_timed, spread  # noqa: E402

STACK = "import torch, transformers, accelerate, peft, deepspeed"
# One GPU, faked for the plugin only (system.gpus' test seam); the _cuda checks need a real one.
SIMULATED_GPU = {"PYTEST_LLMLOAD_FAKE_GPUS": "GPU-simulated"}
WITHOUT_CUDA_CHECKS = ["-k", "not _cuda"]


def torch_build(python: str) -> str:
    """``torch 2.14.1+cu130 (CUDA 13.0)`` / ``torch 2.13.0+cpu (CPU build)`` of that interpreter."""
    out = subprocess.run([python, "-c", "import torch; print(torch.__version__, torch.version.cuda or '')"],
                         capture_output=True, text=True, check=True).stdout.split()
    return f"torch {out[0]} ({'CUDA ' + out[1] if len(out) > 1 else 'CPU build'})"


def count_orphans() -> None:
    """Make this process the reaper of its runs' orphans (Linux): the main job's pytest ends with ``os._exit`` and
    leaves its forkserver (and the ranks the server reaps) to end after it, so their CPU never reached the main job's
    own count. :func:`run_counted` reaps them and adds it."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def run_counted(argv: list[str], **options) -> tuple[float, float]:
    """``(wall, CPU)`` of one run, the CPU of what it left running (reaped here once it ends) included."""
    wall, cpu, _ = run_timed(argv, **options)
    while True:
        try:
            _, _, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return wall, cpu
        cpu += usage.ru_utime + usage.ru_stime


def compile_bytecode(python: str, checkout: Path) -> None:
    """The checkout's package compiled to bytecode, as pip compiles a wheel's modules at install: the floor's
    libraries have theirs, and where ``$PYTHONDONTWRITEBYTECODE`` is set (this project's machines) an editable
    checkout's never gets written, so each main job compiled the plugin's modules afresh (~0.1-0.2 s)."""
    subprocess.run([python, "-m", "compileall", "-q", str(Path(checkout) / "pytest_llmload")], check=True)


def main(runs: int = 5, against=None, python: str = sys.executable,
         simulate_gpu: bool = False, import_torch: tuple = ()) -> dict:
    python, import_torch = os.path.abspath(python), tuple(map(os.path.abspath, import_torch))  # (--against's cwd)
    FLOOR = [python, "-c", STACK]
    MAIN_JOB = [python, "-m", "pytest_llmload"]
    GPU_ONLY = [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
    SIMULATED = [*MAIN_JOB, *WITHOUT_CUDA_CHECKS]
    # What the GPU-less server imports before it forks a rank (runners.warm_server), in a new interpreter
    SERVER = [python, "-c", "import importlib; from pytest_llmload.runners.warm_server import GPU_LESS_PRELOAD; "
              "[importlib.import_module(m) for m in GPU_LESS_PRELOAD]"]
    count_orphans()
    env = repo_env()
    simulated_env = repo_env(**SIMULATED_GPU)
    other_env = None if against is None else {**env, "PYTHONPATH": os.pathsep.join(
        [str(against), *env["PYTHONPATH"].split(os.pathsep)[1:]])}
    for checkout in (REPO, *(() if against is None else (Path(against),))):
        compile_bytecode(python, checkout)
    run_timed(MAIN_JOB, cwd=REPO, env=env)  # warm-up: the page cache
    # label -> [(wall, CPU)] per round: CPU (user + system, children included, and what a run left to end after it)
    # moves less than wall with the load
    runs_of: dict[str, list[tuple[float, float]]] = {
        "floor": [], "job": [], "other": [], "gpu job": [], "gpu other": [], "server": [],
        **{f"import torch: {py}": [] for py in import_torch}}
    for _ in range(runs):
        for py in import_torch:
            runs_of[f"import torch: {py}"].append(run_counted([py, "-c", "import torch"], cwd=REPO, env=env))
        runs_of["floor"].append(run_counted(FLOOR, cwd=REPO, env=env))
        runs_of["job"].append(run_counted(MAIN_JOB, cwd=REPO, env=env))
        if other_env is not None:
            runs_of["other"].append(run_counted(MAIN_JOB, cwd=against, env=other_env))
            print("round: this main job {:.2f} s wall, {:.2f} s CPU; {} {:.2f} s wall, {:.2f} s CPU ({})".format(
                *runs_of["job"][-1], against, *runs_of["other"][-1], load_average()), file=sys.stderr, flush=True)
        if simulate_gpu:
            runs_of["gpu job"].append(run_counted(SIMULATED, cwd=REPO, env=simulated_env))
            runs_of["server"].append(run_counted(SERVER, cwd=REPO, env={**env, "CUDA_VISIBLE_DEVICES": ""}))
            if other_env is not None:
                runs_of["gpu other"].append(run_counted(SIMULATED, cwd=against, env={**other_env, **SIMULATED_GPU}))
    gpu_env = repo_env(CUDA_VISIBLE_DEVICES="")
    run_timed(GPU_ONLY, cwd=REPO, env=gpu_env)
    gpu_only = [run_timed(GPU_ONLY, cwd=REPO, env=gpu_env)[0] for _ in range(runs)]
    floor, job, other = ([wall for wall, _ in runs_of[k]] for k in ("floor", "job", "other"))

    def row(label: str, key: str) -> tuple[str, str, str]:
        return label, spread([wall for wall, _ in runs_of[key]]), f"{median([cpu for _, cpu in runs_of[key]]):.2f} s"

    def ratio(label: str, these: list[float], those: list[float]) -> tuple[str, str, str]:
        ratios = [a / b for a, b in zip(these, those)]
        return label, f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})", ""

    print_table(f"main job against the bare import of its stack ({runs} pairs; {torch_build(python)}; "
                f"load {load_average()})", [
        *(row(f"python -c 'import torch' ({torch_build(py)})", f"import torch: {py}") for py in import_torch),
        row("bare import: torch, transformers, accelerate, peft, deepspeed", "floor"),
        row("python -m pytest_llmload (reference loader, every check)", "job"),
        ratio("main job / import, median of the pairs (goal <= 1.25)", job, floor),
        *(() if against is None else (
            row(f"the main job of {against}", "other"),
            ratio(f"{against}'s main job / import", other, floor),
            ratio("this main job / that one, median of the rounds", job, other),
            ratio("the same in CPU (the process tree's user + system)", *([cpu for _, cpu in runs_of[key]]
                                                                          for key in ("job", "other"))),
        )),
        *(() if not simulate_gpu else (
            row("the GPU-less server's imports, in a new interpreter (GPU_LESS_PRELOAD)", "server"),
            row("a GPU visible, simulated: python -m pytest_llmload -k 'not _cuda'", "gpu job"),
            ratio("its main job / import, median of the pairs", [w for w, _ in runs_of["gpu job"]], floor),
            *(() if against is None else (
                row(f"the same, the main job of {against}", "gpu other"),
                ratio("this one / that one, median of the rounds", [w for w, _ in runs_of["gpu job"]],
                      [w for w, _ in runs_of["gpu other"]]),
            )),
        )),
        ("pytest -m gpu, no GPU visible (goal < 3 s)", spread(gpu_only), ""),
    ], ("measure", "wall: median (min-max)", "CPU: median"))
    return {"torch": torch_build(python), "floor_s": median(floor), "main_job_s": median(job),
            "ratio": statistics.median(j / f for j, f in zip(job, floor)), "gpu_only_s": median(gpu_only)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--against", type=Path, metavar="DIR", help="another checkout's main job, in the same rounds")
    parser.add_argument("--python", default=sys.executable, metavar="PY",
                        help="the interpreter (a venv's) that runs the floor and the main jobs")
    parser.add_argument("--simulate-gpu", action="store_true",
                        help="also each main job with one GPU faked for the plugin, without the _cuda checks")
    parser.add_argument("--import-torch", nargs="+", default=(), metavar="PY",
                        help="also python -c 'import torch' of each interpreter, in the same rounds")
    arguments = parser.parse_args()
    main(arguments.runs, arguments.against, arguments.python, arguments.simulate_gpu,
         tuple(arguments.import_torch))
