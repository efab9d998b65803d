"""The training memory estimate (write-up 002's table) against what a process measures on CPU.

For each configuration, a fresh Python process warms up (imports, one step of the same model), then loads
the model through the reference loader and runs two AdamW steps, and reports

- the peak of torch's CPU allocations in the main thread (profiler memory events), plus the base weights,
  which the profiler does not see (mapped from safetensors, or converted in transformers' loading threads):
  what a GPU would have to hold ("allocated");
- the rise of the process's peak RSS over the same stretch ("peak RSS"): allocations, mapped weight pages,
  and the C allocator's own slack.

The tiny Llama (0.19 M parameters) and a scaled-up one (28 M) built here. Run:
``python benchmarks/bench_memory_estimate.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import print_table  # noqa: E402

MEDIUM = {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
          "num_key_value_heads": 4, "vocab_size": 16000, "max_position_embeddings": 512}

CHILD = r"""
import ctypes, gc, json, os, sys, warnings
warnings.filterwarnings("ignore")
import torch
from transformers.utils import logging
logging.disable_progress_bar()
from pytest_llmload import LoadRequest
from pytest_llmload.instruments import memory_probe
from pytest_llmload.plugin.memory_limit import _CpuAllocations
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

ckpt, dtype, lora, gc_on, batch, seq = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4] == "1", int(sys.argv[5]), int(sys.argv[6])
request = LoadRequest(ckpt, purpose="train", dtype=dtype, lora=lora, gradient_checkpointing=gc_on)

def run():
    model, _ = load_model_and_tokenizer(request)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(2, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model

with _CpuAllocations():
    run()  # warm-up: code paths, lazy imports, the profiler's start
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
rss_before = memory_probe.rss_bytes()
watch = memory_probe.start_peak()
with _CpuAllocations() as allocations:
    model = run()
rss_peak = memory_probe.stop_peak(watch).rss_peak
# The profiler does not see the weights: loaded in the checkpoint's dtype they stay mapped from the safetensors
# files (copy on write where a full fine-tune updates them); converted, they are allocated in transformers'
# loading threads, which the profiler does not follow. Counted from the parameters instead.
mapped = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "lora_" not in name)
print(json.dumps({"allocated": allocations.peak, "rss_rise": rss_peak - rss_before, "mapped_weights": mapped}))
"""


def _child(checkpoint, dtype, lora, gc_on, batch, seq) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    argv = [sys.executable, "-c", CHILD, str(checkpoint), dtype, str(int(lora)), str(int(gc_on)), str(batch), str(seq)]
    out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _medium_checkpoint(dest: Path, tiny: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from pytest_llmload.loader.tiny_models import config_dict

    config = AutoConfig.for_model(**{**config_dict("llama"), **MEDIUM})
    AutoModelForCausalLM.from_config(config).save_pretrained(dest, safe_serialization=True, max_shard_size="40MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, dest / name)
    return dest


def main(configs: str = "all") -> list:
    from pytest_llmload import LoadRequest
    from pytest_llmload.fixes.training_memory import estimate_training_memory, format_bytes
    from pytest_llmload.loader.tiny_models import build_tiny_checkpoint

    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tiny = build_tiny_checkpoint(Path(tmp) / "tiny", "llama")
        cases = [("tiny", tiny, dtype, lora, gc_on, 2, 128)
                 for dtype in ("float32", "bfloat16") for lora in (False, True) for gc_on in (False, True)]
        if configs == "all":
            medium = _medium_checkpoint(Path(tmp) / "medium", tiny)
            cases += [("28M", medium, "float32", False, False, 2, 256), ("28M", medium, "float32", True, False, 2, 256),
                      ("28M", medium, "float32", True, True, 2, 256), ("28M", medium, "bfloat16", True, False, 2, 256)]
        for name, checkpoint, dtype, lora, gc_on, batch, seq in cases:
            request = LoadRequest(checkpoint, purpose="train", dtype=dtype, lora=lora, gradient_checkpointing=gc_on)
            estimate = estimate_training_memory(request, batch_size=batch, seq_len=seq).total
            measured = _child(checkpoint, dtype, lora, gc_on, batch, seq)
            allocated = measured["allocated"] + measured["mapped_weights"]
            rss = measured["rss_rise"]
            results.append({"model": name, "dtype": dtype, "lora": lora, "gc": gc_on, "estimate": estimate,
                            "allocated": allocated, "rss_rise": rss})
            rows.append((name, dtype, "LoRA" if lora else "full", "on" if gc_on else "off", f"{batch}x{seq}",
                         format_bytes(estimate), format_bytes(allocated), f"{estimate / allocated - 1:+.0%}",
                         format_bytes(rss), f"{estimate / rss - 1:+.0%}"))
    print_table("training memory estimate vs measured on CPU (load + 2 AdamW steps)", rows,
                ("model", "dtype", "tune", "ckpt", "batch", "estimate", "allocated", "error", "peak RSS rise", "error"))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny-only", action="store_true", help="skip the 28 M-parameter model")
    main("tiny" if parser.parse_args().tiny_only else "all")
