"""Write-up 003 on one GPU: nn.DataParallel(device_ids=[0, 0]) runs two replicas on cuda:0 in two threads.

The write-up's model (a bf16 stage-1 checkpoint reloaded in 4-bit nf4 with bf16 compute, device_map
"balanced", LoRA on q/v, kbit preparation) gets one training forward/backward through DataParallel, under
the autocast Trainer uses for bf16=True, and without it. Prints one line per variant: the error or the loss.
Run on a GPU machine: python benchmarks/gpu/dp_same_device.py
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # fixtures/ (the before-loaders) is not an installed package


def main() -> int:
    import torch

    from fixtures.loaders import before_dp_dtype
    from pytest_llmload import LoadRequest
    from pytest_llmload.failures.dp_dtype import write_stage1_checkpoint
    from pytest_llmload.loader.tiny_models import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="dp-same-device-"))
    checkpoint = build_tiny_checkpoint(work / "tiny")
    stage1 = write_stage1_checkpoint(checkpoint, work / "stage1")
    request = LoadRequest(stage1, purpose="train", dtype="bfloat16", quantization="4bit", lora=True)
    model = before_dp_dtype.load(request)[0]
    print(f"hf_device_map={getattr(model, 'hf_device_map', None)}; lm_head dtype="
          f"{model.get_output_embeddings().weight.dtype}")
    ids = torch.randint(0, model.config.vocab_size, (4, 16), device="cuda:0")
    outcomes = {}
    for name, autocast in (("autocast bf16 (Trainer bf16=True)", True), ("no autocast", False)):
        wrapped = torch.nn.DataParallel(model, device_ids=[0, 0])
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                out = wrapped(input_ids=ids, labels=ids)
            out.loss.mean().backward()
            outcomes[name] = f"ran: loss {out.loss.mean().item():.4f}"
        except Exception as exc:  # the point is to see what it raises
            frames = [f.name for f in traceback.extract_tb(exc.__traceback__)]
            outcomes[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]} (frames: {' > '.join(frames[-6:])})"
        model.zero_grad(set_to_none=True)
    for name, outcome in outcomes.items():
        print(f"DataParallel(device_ids=[0, 0]), {name}: {outcome}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
