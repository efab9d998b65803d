"""What a train request needs on its device, estimated before anything is loaded (write-up 002).

Write-up 002 ran out of GPU memory, spread the model over ``max_memory`` with CPU offload, and got
``MmBackward0 returned an invalid gradient ... expected device meta``. Its fix was a budget, in a table:
weights, adapters, gradients, optimizer state, activations. This module computes that table from the
checkpoint's safetensors headers and ``config.json`` (no torch import, no weights read), so a loader can
refuse a budget that cannot hold the model for training instead of offloading something that cannot train::

    >>> from pytest_llmload import LoadRequest
    >>> from pytest_llmload.fixes.training_memory import estimate_training_memory
    >>> print(estimate_training_memory(LoadRequest(ckpt, purpose="train", lora=True)).table())  # doctest: +SKIP

:func:`estimate_inference_memory` does the same for a load and a generation (weights, KV cache, the
prefill's working set). Neither counts allocator slack or the CUDA context; how close they come to what
is measured is stated in ``docs/diagnostics.md`` and checked in ``tests/fixes/test_memory_estimate_accuracy.py``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Optional, Union

from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.system.sizes import format_bytes, parse_size

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# The reference loader's adapter (pytest_llmload.fixes.reference_loader): rank 8 on q_proj/v_proj; peft keeps
# adapter weights in float32 (autocast_adapter_dtype) whatever the base dtype.
DEFAULT_LORA_RANK = 8
DEFAULT_LORA_TARGETS = ("q_proj", "v_proj")
# The write-up's MAX_SEQ_LENGTH, capped by the model's own context.
DEFAULT_SEQ_LEN = 512
# Modules bitsandbytes leaves unquantized: embeddings, the output head, norms.
_NOT_QUANTIZED = ("embed", "lm_head", "norm", "wte", "wpe")


class TrainingBudgetError(ValueError):
    """A train request whose ``max_memory`` cannot hold the model for training, refused before loading."""


def budget_for_device(max_memory: Mapping, device: str) -> Optional[int]:
    """The bytes ``max_memory`` gives ``device`` (``"cpu"``, ``"cuda:0"`` under key ``0``, ``"0"`` or
    ``"cuda:0"``), or ``None`` when it does not name it (accelerate then puts nothing there)."""
    kind, _, index = device.partition(":")
    keys = [device] if kind != "cuda" else [int(index or 0), str(index or 0), f"cuda:{index or 0}"]
    for key in keys:
        if key in max_memory:
            return parse_size(max_memory[key], what="max_memory value")
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


def model_tensors(model) -> list[TensorInfo]:
    """Every parameter of ``model`` (built empty, on meta, in its dtype) as :class:`TensorInfo`: what a full-size
    architecture without weights gives the estimates in place of a checkpoint's headers."""
    return [TensorInfo(name, tuple(p.shape), p.numel() * p.element_size()) for name, p in model.named_parameters()]


def _tensors(request: LoadRequest, tensors: Optional[list[TensorInfo]]) -> list[TensorInfo]:
    return list(tensors) if tensors is not None else checkpoint_tensors(request.model_path)


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
class MemoryEstimate:
    """The estimate, one row a component: ``(component, bytes, how it was counted)``."""

    subject: str
    rows: tuple[tuple[str, int, str], ...]
    kind: str = "training"

    @property
    def total(self) -> int:
        return sum(nbytes for _, nbytes, _ in self.rows)

    def __getitem__(self, component: str) -> int:
        for name, nbytes, _ in self.rows:
            if name == component:
                return nbytes
        raise KeyError(component)

    def table(self, budget: Union[None, int, str] = None) -> str:
        """The estimate as a small text table, the write-up's budget made exact; with ``budget`` (bytes or
        a size like ``"24GB"``), the margin left, as the write-up's "Available margin: ~4.0 GB"::

            training memory estimate: llama, float32, LoRA r=8 on q_proj/v_proj, ...
              weights            738.2 KiB  186,880 params x 4 B (float32)
              ...
              total                5.6 MiB
              budget              24.0 MiB  margin 18.4 MiB
        """
        width = max(len(name) for name, _, _ in self.rows + (("total", 0, ""), ("budget", 0, "")))
        lines = [f"{self.kind} memory estimate: {self.subject}"]
        lines += [f"  {name:<{width}}  {format_bytes(nbytes):>10}  {how}" for name, nbytes, how in self.rows]
        lines.append(f"  {'total':<{width}}  {format_bytes(self.total):>10}")
        if budget is not None:
            nbytes = parse_size(budget, what="budget")
            left = nbytes - self.total
            verdict = f"margin {format_bytes(left)}" if left >= 0 else f"SHORT by {format_bytes(-left)}"
            lines.append(f"  {'budget':<{width}}  {format_bytes(nbytes):>10}  {verdict}")
        return "\n".join(lines)




def _is_quantized(t: TensorInfo) -> bool:
    return len(t.shape) == 2 and t.name.endswith(".weight") and not any(k in t.name for k in _NOT_QUANTIZED)


def _weights_row(request: LoadRequest, tensors: list[TensorInfo]) -> tuple[str, int, str]:
    dbytes = DTYPE_BYTES[request.dtype]
    n_params = sum(t.numel for t in tensors)
    if request.quantization is None:
        return ("weights", n_params * dbytes, f"{n_params:,} params x {dbytes} B ({request.dtype})")
    quantized = sum(t.numel for t in tensors if _is_quantized(t))
    kept = n_params - quantized
    # 4-bit: half a byte plus an fp32 absmax per 64-value block; 8-bit: a byte plus an fp32 scale per row.
    per_param = 0.5 + 4 / 64 if request.quantization == "4bit" else 1.0
    rows_scale = 0 if request.quantization == "4bit" else sum(t.shape[0] * 4 for t in tensors if _is_quantized(t))
    # peft's prepare_model_for_kbit_training (the reference loader's LoRA path) upcasts what stays unquantized.
    kept_bytes, kept_how = (4, "float32 after prepare_model_for_kbit_training") if request.purpose == "train" \
        and request.lora else (dbytes, request.dtype)
    nbytes = int(quantized * per_param) + rows_scale + kept * kept_bytes
    return ("weights", nbytes, f"{quantized:,} params {request.quantization} + {kept:,} params x {kept_bytes} B "
                               f"({kept_how}, not quantized)")


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What the activation count needs from ``config.json`` (Llama-style decoders: Llama, Qwen2, Mistral)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    model_type: str

    @classmethod
    def from_config(cls, config: dict) -> "_Shape":
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        return cls(hidden, int(config.get("intermediate_size") or 4 * hidden), int(config["num_hidden_layers"]),
                   heads, int(config.get("num_key_value_heads") or heads),
                   int(config.get("head_dim") or hidden // heads), int(config["vocab_size"]),
                   int(config.get("max_position_embeddings", DEFAULT_SEQ_LEN)), config.get("model_type", "?"))


# Which input each projection reads: projections that share an input share its saved copy.
_PROJECTION_INPUT = {"q_proj": "attention input", "k_proj": "attention input", "v_proj": "attention input",
                     "o_proj": "attention output", "gate_proj": "mlp input", "up_proj": "mlp input",
                     "down_proj": "mlp product"}


def _layer_activations(m: _Shape, p: int, seq: int, *, lora_targets: Optional[tuple[str, ...]], lora_rank: int,
                       attention: str) -> int:
    """Bytes autograd keeps per token for one decoder layer in training (what the backward needs).

    Counted from what each op of transformers' Llama/Qwen2 layer saves (measured with
    ``torch.autograd.graph.saved_tensors_hooks`` on tiny models: within 5% over dtypes, LoRA or full,
    sdpa or eager). ``lora_targets`` ``None`` means every weight trains (full fine-tune).
    """
    full = lora_targets is None
    width = {"attention input": m.hidden, "attention output": m.heads * m.head_dim, "mlp input": m.hidden,
             "mlp product": m.intermediate}
    n = 2 * (4 * m.hidden + 4)  # two RMSNorms: the input upcast to fp32, and 1/rms
    if full:
        n += 2 * p * m.hidden  # the normalised input, cast back, for the norm weight's gradient
        kept = set(width)  # every projection trains and keeps its input
    else:
        # Frozen projections keep nothing; an adapter keeps its input (shared when no cast is needed) ...
        kept = {_PROJECTION_INPUT[t] for t in lora_targets if t in _PROJECTION_INPUT} if p == 4 else set()
        if p != 4:  # ... or, peft casting each adapter's input to its fp32 weights, one fp32 copy per adapter
            n += sum(4 * width[_PROJECTION_INPUT[t]] for t in lora_targets if t in _PROJECTION_INPUT)
        n += len(lora_targets) * lora_rank * 4  # lora_A outputs (fp32)
    eager = attention == "eager"
    n += sum(width[name] * p for name in kept if name != "attention output" or eager)  # sdpa's output is a view
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    if eager:  # q, and k and v repeated to every head; softmax in fp32 (and its cast) over the whole sequence
        n += 3 * q * p + m.heads * seq * 4 + (m.heads * seq * p if p != 4 else 0)
    else:  # scaled_dot_product_attention keeps q, k, v, its output and the log-sum-exp
        n += 2 * q * p + 2 * kv * p + 4 * m.heads
    n += 3 * m.intermediate * p  # SwiGLU: gate, silu(gate), up
    return n


def _activations_row(m: _Shape, request: LoadRequest, batch: int, seq: int, lora_rank: int,
                     lora_targets: tuple[str, ...], attention: str) -> tuple[str, int, str]:
    p = DTYPE_BYTES[request.dtype]
    tokens = batch * seq
    layer = _layer_activations(m, p, seq, lora_targets=lora_targets if request.lora else None,
                               lora_rank=lora_rank, attention=attention)
    final_norm = 4 * m.hidden + 4 + (0 if request.lora else 2 * p * m.hidden)
    # The loss keeps the log-softmax in fp32; the backward starts with its gradient and the logits'.
    saved = (final_norm + 16 + 4 * m.vocab) * tokens  # + input ids and labels
    loss_grads = tokens * m.vocab * (4 + p)
    if request.gradient_checkpointing:
        # The loss gradients are freed before the last layer is recomputed: the larger of the two counts.
        recomputed = layer * tokens
        total = m.layers * m.hidden * p * tokens + saved + max(loss_grads, recomputed)
        how = (f"{m.layers} layer inputs + the larger of 1 layer recomputed ({format_bytes(recomputed)}) and the "
               f"loss gradients ({format_bytes(loss_grads)}), batch {batch} x {seq} tokens (gradient checkpointing)")
    else:
        total = m.layers * layer * tokens + saved + loss_grads
        how = (f"{m.layers} layers x {format_bytes(layer * tokens)}, batch {batch} x {seq} tokens ({attention}), "
               f"+ the loss and its gradients {format_bytes(saved + loss_grads - final_norm * tokens)}")
    return ("activations", total, how)


def estimate_training_memory(
    request: LoadRequest,
    *,
    batch_size: int = 1,
    seq_len: Optional[int] = None,
    lora_rank: int = DEFAULT_LORA_RANK,
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS,
    attention: str = "sdpa",
    tensors: Optional[list[TensorInfo]] = None,
) -> MemoryEstimate:
    """Estimate what training ``request`` needs on its device: weights (by dtype and quantization), LoRA
    adapters (fp32, as peft keeps them), gradients, AdamW state (two moments per trainable parameter, in its
    dtype) and activations: what autograd keeps per layer for the backward, counted op by op for
    Llama-style decoders (``attention`` ``"sdpa"``, transformers' default, or ``"eager"``); with gradient
    checkpointing, each layer's input plus one layer being recomputed. ``seq_len`` defaults to
    ``min(512, max_position_embeddings)``.

    The rows add up to the peak of a training step after the first (the optimizer state exists then); the
    gradients of a full fine-tune fill in as activations are freed, so there the sum is above the peak.
    Not counted: allocator slack, the CUDA context, temporaries inside one op. ``tensors`` (:func:`model_tensors`
    of a model built empty) stands in for the checkpoint's safetensors headers.
    """
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention={attention!r}; expected 'sdpa' or 'eager'.")
    config = json.loads((Path(request.model_path) / "config.json").read_text())
    tensors = _tensors(request, tensors)
    shape = _Shape.from_config(config)
    dbytes = DTYPE_BYTES[request.dtype]

    rows = [_weights_row(request, tensors)]
    n_params = sum(t.numel for t in tensors)
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
    rows.append(("optimizer state", trainable * 2 * grad_bytes,
                 f"AdamW: 2 moments x {trainable:,} trainable params x {grad_bytes} B"))

    s = seq_len if seq_len is not None else min(DEFAULT_SEQ_LEN, shape.context)
    b = batch_size
    rows.append(_activations_row(shape, request, b, s, lora_rank, lora_targets, attention))

    adapter = f"LoRA r={lora_rank} on {'/'.join(lora_targets)}" if request.lora else "full fine-tune"
    subject = (f"{shape.model_type}, {request.dtype}"
               f"{', ' + request.quantization if request.quantization else ''}, {adapter}, "
               f"gradient checkpointing {'on' if request.gradient_checkpointing else 'off'}, batch {b} x {s} tokens")
    return MemoryEstimate(subject, tuple(rows))


def estimate_inference_memory(
    request: LoadRequest,
    *,
    batch_size: int = 1,
    prompt_len: Optional[int] = None,
    new_tokens: int = 0,
    tensors: Optional[list[TensorInfo]] = None,
) -> MemoryEstimate:
    """Estimate what loading ``request`` and generating with it needs: weights (by dtype and quantization),
    the KV cache for ``prompt_len + new_tokens`` positions, and the largest transient of the prefill (one
    layer's working set under ``torch.no_grad``: the MLP's three intermediate tensors, and the last
    position's logits upcast to fp32, as ``generate`` computes them). ``prompt_len`` defaults to
    ``min(512, max_position_embeddings)``; ``new_tokens=0`` is a load and one forward pass::

        >>> print(estimate_inference_memory(LoadRequest(ckpt), prompt_len=64, new_tokens=32).table("24GB"))  # doctest: +SKIP
    """
    config = json.loads((Path(request.model_path) / "config.json").read_text())
    tensors = _tensors(request, tensors)
    m = _Shape.from_config(config)
    p = DTYPE_BYTES[request.dtype]
    s = prompt_len if prompt_len is not None else min(DEFAULT_SEQ_LEN, m.context)
    b, positions = batch_size, s + new_tokens
    rows = [_weights_row(request, tensors)]
    kv = 2 * m.layers * m.kv_heads * m.head_dim * positions * b * p
    rows.append(("KV cache", kv, f"2 x {m.layers} layers x {m.kv_heads * m.head_dim} x {positions} positions "
                                 f"x batch {b} x {p} B"))
    working = b * s * (3 * m.intermediate + 2 * m.hidden) * p
    logits = b * m.vocab * (p + 4)
    rows.append(("activations", working + logits,
                 f"prefill of {s} tokens, one layer at a time ({format_bytes(working)}), + last logits in fp32"))
    subject = (f"{m.model_type}, {request.dtype}{', ' + request.quantization if request.quantization else ''}, "
               f"batch {b} x {s} prompt tokens + {new_tokens} new")
    return MemoryEstimate(subject, tuple(rows), kind="inference")


def check_training_budget(request: LoadRequest, **estimate_kwargs) -> Optional[MemoryEstimate]:
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
