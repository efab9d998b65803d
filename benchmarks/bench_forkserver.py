"""The ranks a GPU runner starts from a forkserver, on the CPU path of the same mechanism (issue 28, goal 1).

GPU ranks cannot be forked from a process that has initialised CUDA, so they start from multiprocessing's
forkserver (pytest_llmload.runners.warm_server). This times the 2-rank DeepSpeed ZeRO-2 step (load, prepare, one
step; gloo) started three ways, in one process, alternating so the machine's drift spreads over all three:

- fork: the CPU default, ranks forked from this process, which has imported the stack;
- forkserver, cold: the server imports torch only (``PYTEST_LLMLOAD_COLD_FORKSERVER=1``, what GPU ranks had);
- forkserver, warm: the server imports the stack once (the default now).

    DS_ACCELERATOR=cpu python benchmarks/bench_forkserver.py [--runs 5]

The first run of each forkserver mode includes starting its server (shown apart). On a GPU the same step adds
CUDA and NCCL initialisation per rank; that figure needs a GPU runner (docs/performance.md says which ran).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average, print_table, timed  # noqa: E402


def main(runs: int = 5) -> dict:
    import transformers

    from pytest_llmload.failures.distributed_device_map import _load_prepare_and_step
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer
    from pytest_llmload.runners import preload, ranks, warm_server
    from pytest_llmload.loader.tiny_models import build_tiny_checkpoint

    transformers.utils.logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix="bench-forkserver-"))
    checkpoint = build_tiny_checkpoint(work / "llama")
    preload.preload(preload.DEEPSPEED_PRELOAD + preload.model_module(checkpoint))

    def step(start: str, cold: bool):
        def run():
            if cold:
                os.environ[warm_server.COLD_ENV] = "1"
            else:
                os.environ.pop(warm_server.COLD_ENV, None)
            ranks.run_ranks(_load_prepare_and_step, 2, start=start, timeout=300,
                            args=(load_model_and_tokenizer, str(checkpoint), str(work), "deepspeed", "gloo"))
        return run

    modes = {"fork (CPU default)": step("fork", False), "forkserver, cold (torch only)": step("forkserver", True),
             "forkserver, warm (the stack)": step("forkserver", False)}
    first, times = {}, {name: [] for name in modes}
    for name, run in modes.items():
        first[name] = timed(run)  # (a forkserver mode: starts its server)
        for _ in range(runs):
            # Alternate: a warm run restarts nothing, a cold one after a warm restarts the server; time the second
            # of two consecutive runs of each mode.
            run()
            times[name].append(timed(run))
    rows = [(name, f"{statistics.median(t):.2f}", f"{min(t):.2f}", f"{max(t):.2f}", f"{first[name]:.2f}")
            for name, t in times.items()]
    print_table(f"2-rank DeepSpeed ZeRO-2 step by start method, {runs} runs each ({os.cpu_count()} CPUs; "
                f"{load_average()})", rows, ("start", "median s", "min s", "max s", "first run s (starts the server)"))
    return {name: statistics.median(t) for name, t in times.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    main(parser.parse_args().runs)
