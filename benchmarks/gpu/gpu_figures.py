"""The GPU figures of docs/gpu.md, measured in one run on a lent GPU (benchmarks/gpu/run_on_device.sh figures).

- a ``gpu_model`` load (the reference loader onto cuda:0), median of 5 after one warm-up
- the 1-rank nccl distributed check (write-up 004's check, its three modes), median of 3 on the warm forkserver,
  with its first run, its modes' rank groups (started at once), a bare 1-rank all-reduce, and one run on the cold server
- ``limit_torch_memory``'s measure of a 16,000,000 B block against ``torch.cuda.max_memory_allocated``
- the training-memory estimate against CUDA's peak of two AdamW steps: the tiny Llama, and SmolLM-135M's
  real config with random weights (a few hundred MB)
- write-up 002's error text as it reads on CUDA

Prints a table and writes every figure to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # fixtures/ (the before-loaders) is not an installed package


def median_seconds(fn, runs: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _all_reduce_one() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    return t.item()


def nccl_check(checkpoint: Path, work: Path, cold: bool = True) -> dict:
    """Write-up 004's check on 1 nccl rank: its first run (the warm forkserver starts), the next three, each mode's
    rank group, a bare 1-rank all-reduce (fork, CUDA and NCCL set-up alone), and one check on the cold server
    (torch alone preloaded: the 33.3 s of docs/gpu.md) in the same run."""
    import os

    from pytest_llmload.failures import distributed_device_map
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer
    from pytest_llmload.runners import ranks, warm_server

    groups: list[float] = []
    run_rank_groups = ranks.run_rank_groups

    def timed_run_rank_groups(*args, **kwargs):
        start = time.perf_counter()
        try:
            return run_rank_groups(*args, **kwargs)
        finally:
            groups.append(round(time.perf_counter() - start, 3))

    def check():
        start = time.perf_counter()
        distributed_device_map.check_distributed_train_step(
            load_model_and_tokenizer, checkpoint, work / "nccl", backend="nccl", world_size=1)
        return round(time.perf_counter() - start, 3)

    ranks.run_rank_groups = timed_run_rank_groups
    try:
        first = check()
        runs = [check() for _ in range(3)]
        warm_groups = groups[1:]  # (one call a check: its modes' groups at once)
        bare: list = []
        try:
            for _ in range(3):
                start = time.perf_counter()
                ranks.run_ranks(_all_reduce_one, 1, backend="nccl")
                bare.append(round(time.perf_counter() - start, 3))
        except Exception as exc:  # (a figure lost, not the others)
            bare.append(f"{type(exc).__name__}: {exc}"[:400])
        cold_s = None
        if cold:
            os.environ[warm_server.COLD_ENV] = "1"  # the server restarts with torch alone: the check before issue 28
            try:
                cold_s = check()
            except Exception as exc:
                cold_s = f"{type(exc).__name__}: {exc}"[:400]
            finally:
                del os.environ[warm_server.COLD_ENV]
    finally:
        ranks.run_rank_groups = run_rank_groups
    return {"nccl_1rank_check_s": statistics.median(runs), "nccl_1rank_check_runs_s": runs,
            "nccl_1rank_check_first_s": first, "nccl_modes": list(distributed_device_map.MODES),
            "nccl_rank_groups_s": warm_groups, "nccl_bare_all_reduce_s": bare,
            "nccl_1rank_check_cold_server_s": cold_s}


def gpu_model_load(checkpoint: Path) -> dict:
    from pytest_llmload import LoadRequest, call_loader
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

    request = LoadRequest(checkpoint, device="cuda:0")
    return {"gpu_model_load_s": median_seconds(lambda: call_loader(load_model_and_tokenizer, request), runs=5)}


def limit_measure() -> dict:
    import torch

    from pytest_llmload.plugin.memory_limit import _Measure

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    with _Measure("cuda:0") as measure:
        block = torch.ones(4_000_000, device="cuda:0")  # 16,000,000 B asked for
        del block
    return {"limit_asked_B": 16_000_000, "limit_measured_B": measure.result.peaks["cuda:0"],
            "max_memory_allocated_above_start_B": torch.cuda.max_memory_allocated() - before}


def training_estimate(checkpoint: Path, label: str, dtype: str, lora: bool, checkpointing: bool,
                      batch: int, seq: int) -> dict:
    import torch

    from pytest_llmload import LoadRequest
    from pytest_llmload.fixes.training_memory import estimate_training_memory
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

    torch.cuda.empty_cache()
    start = torch.cuda.memory_allocated()
    request = LoadRequest(checkpoint, purpose="train", device="cuda:0", dtype=dtype, lora=lora,
                          gradient_checkpointing=checkpointing)
    model, _ = load_model_and_tokenizer(request)
    loaded = torch.cuda.memory_allocated() - start
    estimate = estimate_training_memory(request, batch_size=batch, seq_len=seq)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(2, model.config.vocab_size, (batch, seq), device="cuda:0")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):  # the second step has the optimizer state: the steady-state peak
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - start
    predicted = estimate.total
    row = {"model": label, "dtype": dtype, "lora": lora, "checkpointing": checkpointing, "batch": batch,
           "seq": seq, "estimate_B": predicted, "cuda_peak_B": peak, "error": predicted / peak - 1,
           "weights_estimate_B": estimate["weights"] + (estimate["adapters"] if lora else 0),
           "weights_allocated_B": loaded}
    del model, optimizer
    torch.cuda.empty_cache()
    return row


def meta_backward_text(checkpoint: Path, work: Path) -> dict:
    from fixtures.loaders import before_meta_backward
    from pytest_llmload import LoadRequest, call_loader
    from pytest_llmload.checks.ground_truth import offload_budget

    import torch

    request = LoadRequest(checkpoint, purpose="train", device="cuda:0", dtype="float16", lora=True,
                          gradient_checkpointing=True, offload_folder=work / "offload",
                          max_memory=offload_budget(checkpoint, "cuda:0", dtype="float16"))
    model = call_loader(before_meta_backward.load, request).model
    ids = torch.randint(2, model.config.vocab_size, (2, 16), device="cuda:0")
    try:
        model(input_ids=ids, labels=ids).loss.backward()
        text = None
    except RuntimeError as exc:
        text = str(exc)
    return {"meta_backward_device_map": {k: str(v) for k, v in model.hf_device_map.items()},
            "meta_backward_text": text}


def build_from_config(config_path: Path, dest: Path, dtype: str) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pytest_llmload.loader.tiny_models import build_tokenizer

    raw = {k: v for k, v in json.loads(config_path.read_text()).items() if not k.startswith("_")}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**raw)).to(getattr(torch, dtype))
    model.save_pretrained(dest, max_shard_size="100MB", safe_serialization=True)
    build_tokenizer(1000).save_pretrained(dest)
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only-nccl", action="store_true", help="the warm nccl check alone (no cold run, no others)")
    args = parser.parse_args()
    from pytest_llmload.loader.tiny_models import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="gpu-figures-"))
    tiny = build_tiny_checkpoint(work / "tiny")
    figures: dict = {}
    steps = [
        ("nccl", lambda: nccl_check(tiny, work)),  # first: its ranks start before this process touches CUDA
        ("gpu_model", lambda: gpu_model_load(tiny)),
        ("limit", limit_measure),
        ("meta_backward", lambda: meta_backward_text(tiny, work)),
    ]
    if args.only_nccl:
        steps = [("nccl", lambda: nccl_check(tiny, work, cold=False))]
    for name, step in steps:
        try:
            figures.update(step())
        except Exception as exc:
            figures[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
    rows = []
    if args.only_nccl:
        print(json.dumps(figures))
        if args.out:
            args.out.write_text(json.dumps(figures, indent=1))
        return 0
    smol = build_from_config(ROOT / "benchmarks/gpu/smollm_135m.json", work / "smollm", "bfloat16")
    for label, path, dtype, lora, ckpt, batch, seq in [
        ("tiny-llama", tiny, "float32", True, False, 2, 128),
        ("tiny-llama", tiny, "float32", True, True, 2, 128),
        ("tiny-llama", tiny, "bfloat16", False, False, 2, 128),
        ("smollm-135m", smol, "bfloat16", True, True, 4, 512),
        ("smollm-135m", smol, "bfloat16", True, False, 4, 512),
        ("smollm-135m", smol, "bfloat16", False, True, 4, 512),
        ("smollm-135m", smol, "float32", False, False, 2, 512),
    ]:
        try:
            rows.append(training_estimate(path, label, dtype, lora, ckpt, batch, seq))
        except Exception as exc:
            rows.append({"model": label, "dtype": dtype, "lora": lora, "checkpointing": ckpt,
                         "error_text": f"{type(exc).__name__}: {exc}"})
    figures["training_estimate"] = rows
    import torch
    import transformers

    figures["device"] = torch.cuda.get_device_name(0)
    figures["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))
    for key, value in figures.items():
        if key != "training_estimate":
            print(f"{key}: {value}")
    print(f"{'model':12} {'dtype':9} {'lora':5} {'ckpt':5} {'b x seq':8} {'estimate':>12} {'cuda peak':>12} {'error':>7}")
    for r in rows:
        if "error_text" in r:
            print(f"{r['model']:12} {r['dtype']:9} {r['lora']!s:5} {r['checkpointing']!s:5} {r['error_text']}")
        else:
            print(f"{r['model']:12} {r['dtype']:9} {r['lora']!s:5} {r['checkpointing']!s:5} "
                  f"{r['batch']}x{r['seq']:<6} {r['estimate_B']:>12,} {r['cuda_peak_B']:>12,} {r['error']:>+7.1%}  "
                  f"weights est {r['weights_estimate_B']:,} vs allocated {r['weights_allocated_B']:,}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
