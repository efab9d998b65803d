"""Wall time of 2-rank scenarios through pytest_llmload.runners.ranks (ranks forked from a warm parent).

    DS_ACCELERATOR=cpu python benchmarks/bench_distributed.py [--runs 5] [--torchrun]

Prints the median, min and max of ``--runs`` runs of each scenario, after one warm-up run (whose time, which
includes importing the stack into the parent once, is shown apart). ``--torchrun`` adds the same DeepSpeed
step launched the usual way, two fresh interpreters under torchrun, for comparison.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average, print_table, timed  # noqa: E402

TORCHRUN_SCRIPT = textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from pytest_llmload.failures.distributed_device_map import _load_prepare_and_step
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer
    dist.init_process_group("gloo")
    _load_prepare_and_step(load_model_and_tokenizer, sys.argv[1], sys.argv[2], "deepspeed", "gloo")
    dist.destroy_process_group()
""")


def all_reduce() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return t.item()


def main(runs: int = 5, torchrun: bool = False) -> dict:
    from pytest_llmload.runners import ranks as distributed
    from pytest_llmload.failures.distributed_device_map import _load_prepare_and_step
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer
    from pytest_llmload.loader.tiny_models import build_tiny_checkpoint

    import transformers

    transformers.utils.logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    checkpoint = build_tiny_checkpoint(work / "llama")

    def step(mode):
        return lambda: distributed.run_ranks(
            _load_prepare_and_step, 2, args=(load_model_and_tokenizer, str(checkpoint), str(work), mode, "gloo"))

    def preload_then(scenario, modules):
        return lambda: (distributed.preload(modules), scenario())

    scenarios = [
        ("2-rank gloo all_reduce", lambda: distributed.run_ranks(all_reduce, 2),
         ("torch.distributed",)),
        ("2-rank DDP (MULTI_CPU) load + prepare + step", step("ddp"),
         distributed.HF_PRELOAD + ("transformers.models.llama.modeling_llama",)),
        ("2-rank DeepSpeed ZeRO-2 load + prepare + step", step("deepspeed"), distributed.DEEPSPEED_PRELOAD),
    ]
    rows, medians = [], {}
    for name, scenario, modules in scenarios:
        first = timed(preload_then(scenario, modules))
        times = [timed(scenario) for _ in range(runs)]
        medians[name] = statistics.median(times)
        rows.append((name, f"{statistics.median(times):.2f}", f"{min(times):.2f}", f"{max(times):.2f}", f"{first:.2f}"))
    if torchrun:
        script = work / "torchrun_step.py"
        script.write_text(TORCHRUN_SCRIPT)
        launcher = Path(sys.executable).with_name("torchrun")
        command = [str(launcher), "--standalone", "--nproc-per-node", "2", str(script), str(checkpoint), str(work)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        times = [timed(lambda: subprocess.run(command, env=env, check=True, capture_output=True))
                 for _ in range(max(1, min(runs, 3)))]
        name = "torchrun: 2 fresh interpreters, DeepSpeed ZeRO-2 step"
        medians[name] = statistics.median(times)
        rows.append((name, f"{statistics.median(times):.2f}", f"{min(times):.2f}", f"{max(times):.2f}", "-"))
    print_table(
        f"2-rank scenarios, {runs} runs each after the first ({os.cpu_count()} CPUs, torch threads per rank: 1; "
        f"{load_average()})",
        rows, ("scenario", "median s", "min s", "max s", "first run s (imports the stack)"),
    )
    return medians


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--torchrun", action="store_true", help="also time the DeepSpeed step under torchrun")
    options = parser.parse_args()
    main(options.runs, options.torchrun)
