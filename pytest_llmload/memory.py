"""What a train request needs on its device, estimated before anything is loaded (write-up 002).

Write-up 002 ran out of GPU memory, spread the model over ``max_memory`` with CPU offload, and got
``MmBackward0 returned an invalid gradient ... expected device meta``. Its fix was a budget, in a table:
weights, adapters, gradients, optimizer state, activations. This module computes that table from the
checkpoint's safetensors headers and ``config.json`` (no torch import, no weights read), so a loader can
refuse a budget that cannot hold the model for training instead of offloading something that cannot train::

    >>> from pytest_llmload import LoadRequest
    >>> from pytest_llmload.memory import estimate_training_memory
    >>> print(estimate_training_memory(LoadRequest(ckpt, purpose="train", lora=True)).table())  # doctest: +SKIP

The estimate is a floor (no allocator fragmentation or CUDA context): a budget below it cannot work.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Optional, Union

from pytest_llmload.request import LoadRequest

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# The reference loader's adapter (pytest_llmload.reference_loader): rank 8 on q_proj/v_proj; peft keeps
# adapter weights in float32 (autocast_adapter_dtype) whatever the base dtype.
DEFAULT_LORA_RANK = 8
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")
# The write-up's MAX_SEQ_LENGTH, capped by the model's own context.
DEFAULT_SEQ_LEN = 512
# Modules bitsandbytes leaves unquantized: embeddings, the output head, norms.
_NOT_QUANTIZED = ("embed", "lm_head", "norm", "wte", "wpe")


class TrainingBudgetError(ValueError):
    """A train request whose ``max_memory`` cannot hold the model for training, refused before loading."""


def parse_size(size: Union[int, str]) -> int:
    """Bytes in a ``max_memory`` value, read as accelerate reads it: ``"5GB"`` is 10**9-based, ``"5GiB"``
    2**30-based, ``"5Gb"`` is bits; an int is bytes. ``parse_size("400KB") == 400_000``."""
    if isinstance(size, bool):
        raise ValueError(f"max_memory value {size!r} is not a size; use an int (bytes) or a string like '14GB'.")
    if isinstance(size, int):
        if size < 0:
            raise ValueError(f"max_memory value {size!r} is negative.")
        return size
    text = str(size).strip()
    units = (("GIB", 2**30, False), ("MIB", 2**20, False), ("KIB", 2**10, False),
             ("GB", 10**9, True), ("MB", 10**6, True), ("KB", 10**3, True))
    for suffix, factor, may_be_bits in units:
        if text.upper().endswith(suffix):
            try:
                value = int(float(text[: -len(suffix)]) * factor)
            except ValueError:
                break
            return value // 8 if may_be_bits and text.endswith("b") else value
    raise ValueError(
        f"max_memory value {size!r} is not a size; use an int (bytes) or a string with a unit like '14GB' or '500MiB'."
    )


def format_bytes(n: float) -> str:
    """``format_bytes(1536) == '1.5 KiB'``."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "GiB":
            break
    return f"{n:.1f} {unit}"


def budget_for_device(max_memory: Mapping, device: str) -> Optional[int]:
    """The bytes ``max_memory`` gives ``device`` (``"cpu"``, ``"cuda:0"`` under key ``0``, ``"0"`` or
    ``"cuda:0"``), or ``None`` when it does not name it (accelerate then puts nothing there)."""
    kind, _, index = device.partition(":")
    keys = [device] if kind != "cuda" else [int(index or 0), str(index or 0), f"cuda:{index or 0}"]
    for key in keys:
        if key in max_memory:
            return parse_size(max_memory[key])
    return None


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def checkpoint_tensors(checkpoint: Union[str, os.PathLike]) -> list[TensorInfo]:
    """Every tensor of a safetensors checkpoint (sharded or not), from the file headers only."""
    checkpoint = Path(checkpoint)
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{checkpoint} has no *.safetensors files; the training memory estimate reads tensor shapes from "
            "safetensors headers (save the checkpoint with safe_serialization=True)."
        )
    tensors = []
    for file in files:
        for name, info in _safetensors_header(file).items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            tensors.append(TensorInfo(name, tuple(info["shape"]), end - start))
    return tensors


@dataclasses.dataclass(frozen=True)
class TrainingMemoryEstimate:
    """The estimate, one row a component: ``(component, bytes, how it was counted)``."""

    subject: str
    rows: tuple[tuple[str, int, str], ...]

    @property
    def total(self) -> int:
        return sum(nbytes for _, nbytes, _ in self.rows)

    def __getitem__(self, component: str) -> int:
        for name, nbytes, _ in self.rows:
            if name == component:
                return nbytes
        raise KeyError(component)

    def table(self) -> str:
        """The estimate as a small text table, the write-up's budget made exact::

            training memory estimate: llama, float32, LoRA r=8 on q_proj/v_proj, batch 1 x 128 tokens
              weights            738.2 KiB  186,880 params x 4 B (float32)
              ...
              total                5.6 MiB
        """
        width = max(len(name) for name, _, _ in self.rows + (("total", 0, ""),))
        lines = [f"training memory estimate: {self.subject}"]
        lines += [f"  {name:<{width}}  {format_bytes(nbytes):>10}  {how}" for name, nbytes, how in self.rows]
        lines.append(f"  {'total':<{width}}  {format_bytes(self.total):>10}")
        return "\n".join(lines)


def _is_quantized(t: TensorInfo) -> bool:
    return len(t.shape) == 2 and t.name.endswith(".weight") and not any(k in t.name for k in _NOT_QUANTIZED)


def estimate_training_memory(
    request: LoadRequest,
    *,
    batch_size: int = 1,
    seq_len: Optional[int] = None,
    lora_rank: int = DEFAULT_LORA_RANK,
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS,
) -> TrainingMemoryEstimate:
    """Estimate what training ``request`` needs on its device: weights (by dtype and quantization), LoRA
    adapters, gradients, AdamW state (two fp32 moments per trainable parameter) and activations (per layer,
    Korthikanti et al. 2022; with gradient checkpointing only each layer's input is kept, plus one layer
    being recomputed). ``seq_len`` defaults to ``min(512, max_position_embeddings)``."""
    config = json.loads((Path(request.model_path) / "config.json").read_text())
    tensors = checkpoint_tensors(request.model_path)
    dbytes = DTYPE_BYTES[request.dtype]

    rows: list[tuple[str, int, str]] = []
    n_params = sum(t.numel for t in tensors)
    if request.quantization is None:
        rows.append(("weights", n_params * dbytes, f"{n_params:,} params x {dbytes} B ({request.dtype})"))
    else:
        quantized = sum(t.numel for t in tensors if _is_quantized(t))
        kept = n_params - quantized
        # 4-bit: half a byte plus an fp32 absmax per 64-value block; 8-bit: a byte plus an fp32 scale per row.
        per_param = 0.5 + 4 / 64 if request.quantization == "4bit" else 1.0
        rows_scale = 0 if request.quantization == "4bit" else sum(
            t.shape[0] * 4 for t in tensors if _is_quantized(t))
        nbytes = int(quantized * per_param) + rows_scale + kept * dbytes
        rows.append(("weights", nbytes, f"{quantized:,} params {request.quantization} + {kept:,} params x "
                                        f"{dbytes} B ({request.dtype}, not quantized)"))

    if request.lora:
        adapted = [t for t in tensors if len(t.shape) == 2 and t.name.endswith(".weight")
                   and any(t.name.endswith(f"{target}.weight") for target in lora_targets)]
        trainable = sum(lora_rank * (t.shape[0] + t.shape[1]) for t in adapted)
        grad_bytes = 4
        rows.append(("adapters", trainable * 4, f"{trainable:,} params x 4 B (LoRA r={lora_rank} on "
                                                f"{'/'.join(lora_targets)}, {len(adapted)} modules, fp32)"))
    else:
        trainable, grad_bytes = n_params, dbytes
    rows.append(("gradients", trainable * grad_bytes, f"{trainable:,} trainable params x {grad_bytes} B"))
    rows.append(("optimizer state", trainable * 8, f"AdamW: 2 fp32 moments x {trainable:,} trainable params"))

    hidden = int(config["hidden_size"])
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    vocab = int(config["vocab_size"])
    s = seq_len if seq_len is not None else min(DEFAULT_SEQ_LEN, int(config.get("max_position_embeddings", 512)))
    b = batch_size
    act_bytes = dbytes  # activations are in the compute dtype
    # Korthikanti et al.: s*b*h*(34 + 5*a*s/h) bytes per layer at 16-bit; scaled to the compute dtype.
    full_layer = int(s * b * hidden * (34 + 5 * heads * s / hidden) * act_bytes / 2)
    if request.gradient_checkpointing:
        activations = layers * s * b * hidden * act_bytes + full_layer
        how = f"{layers} layer inputs + 1 layer recomputed, batch {b} x {s} tokens (gradient checkpointing)"
    else:
        activations = layers * full_layer
        how = f"{layers} layers x {format_bytes(full_layer)}, batch {b} x {s} tokens (no checkpointing)"
    logits = b * s * vocab * (act_bytes + 4)  # logits, and their fp32 upcast for the loss
    rows.append(("activations", activations + logits, how + f", + logits {format_bytes(logits)}"))

    adapter = f"LoRA r={lora_rank} on {'/'.join(lora_targets)}" if request.lora else "full fine-tune"
    subject = (f"{config.get('model_type', '?')}, {request.dtype}"
               f"{', ' + request.quantization if request.quantization else ''}, {adapter}, "
               f"gradient checkpointing {'on' if request.gradient_checkpointing else 'off'}, batch {b} x {s} tokens")
    return TrainingMemoryEstimate(subject, tuple(rows))


def check_training_budget(request: LoadRequest, **estimate_kwargs) -> Optional[TrainingMemoryEstimate]:
    """Refuse, before loading, a train request whose ``max_memory`` cannot hold the model for training on
    ``request.device``; raises :class:`TrainingBudgetError` with the estimate and the budget. Returns the
    estimate (``None`` when the request has no budget or is not for training)."""
    if request.purpose != "train" or request.max_memory is None:
        return None
    estimate = estimate_training_memory(request, **estimate_kwargs)
    budget = budget_for_device(request.max_memory, request.device)
    if budget is not None and estimate.total <= budget:
        return estimate
    given = "nothing (no entry for it)" if budget is None else format_bytes(budget)
    raise TrainingBudgetError(
        f"refusing to load {request.model_path} for training on {request.device}: the training memory estimate "
        f"is {format_bytes(estimate.total)} but max_memory={dict(request.max_memory)!r} gives {request.device} "
        f"{given}. Offloading the rest to cpu/disk would leave weights on 'meta' that cannot train (write-up "
        "002: 'Function MmBackward0 returned an invalid gradient ... expected device meta'). Raise the budget, "
        "or need less: LoRA, 4-bit, gradient checkpointing, shorter sequences.\n" + estimate.table()
    )
