"""The overhead of one isolated check over the same work in-process (goal: under 0.3 s).

Runs two shipped checks, ``check_pad_token_set_offline`` (one load of the tiny Llama through the reference
loader, the pad-token checks, the network guard) and ``check_train_request_trains`` (eight train loads, LoRA
and gradient checkpointing, a forward and backward each), alternately in this process and isolated in a child
forked from it, and reports the medians and their difference (the summary takes the larger); also an isolated
call that does nothing (the bare cost of fork, pipe, deadline and reaping) and, with ``--fresh``, the first
check in a fresh interpreter (what isolation by subprocess would cost: the imports).

    python benchmarks/bench_isolation.py [--runs 9] [--fresh]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import load_average, median, print_table, repo_env, run_timed, spread, timed  # noqa: E402

FRESH_SCRIPT = """
import sys
from pytest_llmload.failures.offload_hang import check_pad_token_set_offline
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer
check_pad_token_set_offline(load_model_and_tokenizer, sys.argv[1], sys.argv[2])
"""


def nothing() -> None:
    return None


CHECKS = ("check_pad_token_set_offline", "check_train_request_trains")


def main(runs: int = 9, fresh: bool = False) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # as in an isolated child: the same work on both sides
    import transformers

    transformers.utils.logging.disable_progress_bar()
    from pytest_llmload.runners import isolation
    from pytest_llmload.failures import REGISTRY
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer
    from pytest_llmload.loader.tiny_models import build_tiny_checkpoint

    rows, overheads = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_tiny_checkpoint(Path(tmp) / "llama")
        work = Path(tmp) / "work"
        work.mkdir()
        for name in CHECKS:
            (isolated,) = [c for c in REGISTRY if c.name == name]
            in_process = isolated._replace(isolated=False)
            for check in (in_process, isolated):  # warm-up: lazy imports, file cache
                check(load_model_and_tokenizer, checkpoint, work)
            times: dict[str, list[float]] = {"in-process": [], "isolated": []}
            for _ in range(runs):
                times["in-process"].append(timed(lambda: in_process(load_model_and_tokenizer, checkpoint, work)))
                times["isolated"].append(timed(lambda: isolated(load_model_and_tokenizer, checkpoint, work)))
            overheads[name] = median(times["isolated"]) - median(times["in-process"])
            rows += [(f"{name}, in-process", spread(times["in-process"])),
                     (f"{name}, isolated (forked child)", spread(times["isolated"])),
                     (f"{name}: overhead of isolation (difference of medians)", f"{overheads[name]:.3f} s")]
        noop = [timed(lambda: isolation.run_isolated(nothing, timeout=60)) for _ in range(runs)]
        rows.append(("isolated call doing nothing", spread(noop, scale=1000, unit="ms", digits=0)))
        fresh_times = []
        if fresh:
            script = Path(tmp) / "fresh_check.py"
            script.write_text(FRESH_SCRIPT)
            argv = [sys.executable, str(script), str(checkpoint), str(work)]
            fresh_times = [run_timed(argv, env=repo_env())[0] for _ in range(max(1, min(runs, 3)))]
            rows.append(("check_pad_token_set_offline in a fresh interpreter", spread(fresh_times)))
    print_table(f"one isolated check, median (min-max) of {runs} runs ({load_average()})", rows, ("what", "time"))
    return {"isolation_overhead_s": max(overheads.values()), "overheads_s": overheads,
            "isolated_noop_ms": median(noop) * 1000, "fresh_interpreter_s": median(fresh_times) if fresh_times else None}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--fresh", action="store_true", help="also time the check in a fresh interpreter")
    options = parser.parse_args()
    main(options.runs, options.fresh)
