"""The premises every check stands on, in one place: what the loader returned, compared with what was asked.

Every check loads through :func:`load` (a test enumerates the registry and proves it). Before any check judges,
the model is compared with the :class:`~pytest_llmload.LoadRequest`; a loader that did not honour it gets an
``error`` row with the contract sentence (:class:`ContractGap`), never one of the known failures:

- nothing loaded: every parameter on the meta device with no offload map;
- the weights' dtype: the dtype holding most of the base weights (adapters and quantized storage left out) is the
  one asked; a train request may also get float32 (master weights, k-bit training's upcast), never a narrower one;
  a 4-bit request is honoured by its layers' compute dtype too;
- quantization: a quantized model for a request that asked for none;
- the device: weights on an accelerator for a cpu request, or none on the requested accelerator (a train request
  in a distributed rank or under DeepSpeed may get the model whole on the cpu: the training set-up moves it);
- the vocabulary: fewer embedding rows than the checkpoint's ``vocab_size`` (more is fine: chat templates add
  tokens; comparisons use the checkpoint's rows, :func:`checkpoint_logits`).

What a scenario needs and the loader simply did not do (nothing offloaded, a 4-bit request served unquantized,
an adapter_path never read) is a ``not exercised`` skip: :func:`require`, with :func:`observe`'s facts.

The train/eval mode is not a premise: a check puts the model in the mode its consumer would (Trainer calls
``model.train()``, a server ``model.eval()``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from pytest_llmload.failures.base import not_exercised
from pytest_llmload.fixes import is_distributed
from pytest_llmload.loading import LoaderContractError, LoadResult, call_loader
from pytest_llmload.request import LoadRequest

# A test seam, read in every process a check runs in (isolated children, ranks): the name of a check whose code
# should crash right after its load, to prove that a check's own crash is an error row, never a verdict.
INJECT_CRASH_ENV = "PYTEST_LLMLOAD_INJECT_CHECK_CRASH"

_QUANTIZED_LAYERS = ("Linear4bit", "Linear8bitLt")
_ADAPTER_MARKERS = ("lora_", "modules_to_save", "lokr_", "loha_", "ia3_", "prompt_encoder")


class ContractGap(LoaderContractError):
    """The loader returned something other than what the request asked for: an ``error`` row, no known failure."""

    def __init__(self, sentence: str, *, check: str, request: LoadRequest) -> None:
        self.sentence = sentence
        super().__init__(f"contract: {sentence} ({check}: {_asked(request)}). The check judges nothing on a model "
                         "that is not the one asked for; make the loader honour this LoadRequest field.")


class Facts(NamedTuple):
    """What a loaded model shows, read once, for the premises and the checks' messages."""

    weight_dtype: Optional[str]  # the dtype holding most of the base weights; None when nothing is materialised
    quantized: bool
    compute_dtypes: tuple[str, ...]  # of the 4-bit layers (bnb_4bit_compute_dtype)
    adapter_weights: int  # adapter parameters (peft) present
    adapter_on_meta: int
    offloaded: tuple[str, ...]  # scenarios.offloaded_parts
    devices: tuple[str, ...]
    vocab: Optional[int]  # rows of the input embeddings
    checkpoint_vocab: Optional[int]
    all_on_meta: bool

    @property
    def where(self) -> str:
        return f"whole on {self.devices[0]}" if len(self.devices) == 1 else f"on {', '.join(self.devices)}"


def load(loader: Callable[[LoadRequest], Any], request: LoadRequest, *, check: str) -> LoadResult:
    """Call the loader (:func:`~pytest_llmload.loading.call_loader`) and verify what it returned against
    ``request``; raises :class:`ContractGap` for a model that is not the one asked for."""
    result = call_loader(loader, request)
    verify(result.model, request, check=check)
    if os.environ.get(INJECT_CRASH_ENV) == check:
        raise IndexError(f"injected by ${INJECT_CRASH_ENV}={check}: a crash in the check's own code")
    return result


def observe(model: Any, request: Optional[LoadRequest] = None) -> Facts:
    """The :class:`Facts` of ``model`` (``request``: where its checkpoint is, for the vocabulary)."""
    from pytest_llmload.scenarios import offloaded_parts

    params = list(model.named_parameters())
    by_dtype: dict[str, int] = {}
    adapter = adapter_meta = 0
    quantized = any(type(m).__name__ in _QUANTIZED_LAYERS for m in model.modules())
    compute = tuple(sorted({str(m.compute_dtype).removeprefix("torch.") for m in model.modules()
                            if getattr(m, "compute_dtype", None) is not None}))
    for name, p in params:
        if any(marker in name for marker in _ADAPTER_MARKERS):
            adapter += 1
            adapter_meta += p.device.type == "meta"
            continue
        if p.is_floating_point() and type(p).__name__ not in ("Params4bit", "Int8Params"):
            dtype = str(p.dtype).removeprefix("torch.")
            by_dtype[dtype] = by_dtype.get(dtype, 0) + (getattr(p, "ds_numel", None) or p.numel())  # ZeRO-3: partitioned
    weight_dtype = max(by_dtype, key=by_dtype.get) if any(by_dtype.values()) else None
    devices = tuple(sorted({str(p.device) for _, p in params}))
    embeddings = _input_embeddings(model)
    shape = None if embeddings is None else tuple(getattr(embeddings.weight, "ds_shape", embeddings.weight.shape))
    vocab = int(shape[0]) if shape is not None and len(shape) == 2 and shape[0] > 0 else None
    mapped = {str(v) for v in (getattr(model, "hf_device_map", None) or {}).values()}
    return Facts(
        weight_dtype=weight_dtype, quantized=quantized, compute_dtypes=compute, adapter_weights=adapter, adapter_on_meta=adapter_meta,
        offloaded=tuple(offloaded_parts(model)), devices=devices, vocab=vocab,
        checkpoint_vocab=None if request is None else checkpoint_vocab(request.model_path),
        all_on_meta=bool(params) and devices == ("meta",) and not (mapped - {"meta"}),
    )


def verify(model: Any, request: LoadRequest, *, check: str) -> Facts:
    """Compare ``model`` with ``request``; raise :class:`ContractGap` with the sentence where they differ."""
    facts = observe(model, request)

    def gap(sentence: str):
        raise ContractGap(sentence, check=check, request=request)

    if facts.all_on_meta:
        gap("the loader returned every parameter on the meta device: nothing was loaded (an init_empty_weights "
            "model, or weights never materialised)")
    if facts.quantized and request.quantization is None:
        gap("the loader returned a quantized model (bitsandbytes layers) for a request with quantization=None")
    asked = request.dtype
    got = facts.weight_dtype
    # A 4-bit model honours the dtype through bnb_4bit_compute_dtype too (QLoRA scripts often pass only that).
    computes_as_asked = request.quantization is not None and facts.compute_dtypes == (asked,)
    if got is not None and got != asked and not (request.purpose == "train" and got == "float32") \
            and not computes_as_asked:
        widened = " (a train request may also get float32 master weights, never a narrower dtype)" \
            if request.purpose == "train" else ""
        gap(f"the loader returned {got} weights for a {asked} request{widened}")
    if facts.vocab is not None and facts.checkpoint_vocab is not None and facts.vocab < facts.checkpoint_vocab:
        gap(f"the loader returned a vocabulary of {facts.vocab} rows for a checkpoint of {facts.checkpoint_vocab}")
    on_accelerator = [d for d in facts.devices if d not in ("cpu", "meta")]
    if request.device == "cpu" and on_accelerator:
        gap(f"the loader put weights on {', '.join(on_accelerator)} for a device='cpu' request")
    if request.device != "cpu" and not on_accelerator and not facts.all_on_meta \
            and not _placed_by_training(facts, request):
        gap(f"the loader returned the model {facts.where} for a device={request.device!r} request")
    return facts


def _placed_by_training(facts: Facts, request: LoadRequest) -> bool:
    """A train request in one rank of a distributed job, or under DeepSpeed, is honoured by a model whole on the cpu
    too: ``deepspeed.initialize``, ``accelerate.prepare`` and Trainer move a model that is whole on one device to the
    rank's own, and loading without a ``device_map`` there is write-up 004's fix (the first H200 run called the
    reference loader's DeepSpeed load a gap)."""
    return (request.purpose == "train" and facts.devices == ("cpu",) and not facts.offloaded
            and is_distributed(os.environ, deepspeed=request.deepspeed))


def require(condition: bool, check: str, did_instead: str, missing: str) -> None:
    """A scenario's premise: skip ``not exercised`` when the loader did not put the model in the state the check
    needs (the scenario did not happen; nothing to judge, nothing wrong)."""
    if not condition:
        not_exercised(check, did_instead, missing)


def note(text: str) -> None:
    """Say in the check's row how it judged (``simulated: ...``): shown beside the verdict, in ``--json`` and JUnit."""
    from pytest_llmload.keys import check_notes

    notes = check_notes.get()
    if notes is not None:
        notes.append(text)


def checkpoint_logits(logits: Any, request_or_vocab: Any) -> Any:
    """``logits`` over the checkpoint's own vocabulary: rows a loader added (chat tokens) are not the checkpoint's."""
    vocab = request_or_vocab if isinstance(request_or_vocab, int) else checkpoint_vocab(request_or_vocab.model_path)
    return logits if vocab is None else logits[..., :vocab]


def checkpoint_vocab(model_path: "os.PathLike[str] | str") -> Optional[int]:
    """``vocab_size`` of the checkpoint's config.json; ``None`` where it has none (a hub id, a nested config)."""
    try:
        value = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8")).get("vocab_size")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def _input_embeddings(model: Any):
    getter = getattr(model, "get_input_embeddings", None)
    try:
        return getter() if getter is not None else None
    except (NotImplementedError, AttributeError):
        return None


def _asked(request: LoadRequest) -> str:
    fields = [f"purpose={request.purpose}", f"dtype={request.dtype}", f"device={request.device}"]
    fields += [f"quantization={request.quantization}"] if request.quantization else []
    fields += [f"max_memory={request.max_memory}"] if request.max_memory is not None else []
    fields += ["lora=True"] if request.lora else []
    fields += ["adapter_path=..."] if request.adapter_path else []
    return "LoadRequest(" + ", ".join(fields) + ")"
