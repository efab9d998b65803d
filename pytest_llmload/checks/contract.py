"""The premises every check stands on, in one place: what the loader returned, compared with what was asked.

Every check loads through :func:`load` (a test enumerates the registry and proves it). A loader is judged on its
own terms, as scikit-learn's estimator tags decide which checks apply: it is asked in a dtype it loads, and a
request field it simply does not honour in the way a check's mechanism needs is a note or a ``not exercised`` skip,
not a refusal to judge.

- the weights' dtype: the dtype holding most of the base weights (adapters and quantized storage left out). A
  loader that declares its dtypes (``load.llmload_dtypes``, ini ``llmload_loader_dtypes``) is asked in one of them;
  one that returns another dtype than asked (a float16-only or bfloat16-only loader) is asked again in the dtype its
  weights have, its ``max_memory`` budget resized to that dtype, and the row notes it (:func:`load`); the check then
  judges the model in that dtype (its ground truth too: :attr:`Loaded.request`). A train request may get float32
  (master weights, k-bit training's upcast) as it is; a 4-bit request is honoured by its layers' compute dtype too.

A loader that did not honour the rest gets an ``error`` row with the contract sentence (:class:`ContractGap`),
never one of the known failures, naming the field to honour:

- nothing loaded: every parameter on the meta device with no offload map;
- quantization: a quantized model for a request that asked for none, where the check compares the model with the
  unquantized checkpoint (``needs=("unquantized",)``); elsewhere it is judged as the quantized model it is, noted
  (an 8-bit LoRA trainer that loads 8-bit whatever is asked);
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

from pytest_llmload.checks.base import not_exercised
from pytest_llmload.fixes.training_scripts import is_distributed
from pytest_llmload.loader.seam import LoaderContractError, LoadResult, call_loader
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.config.vocabulary import INJECT_CRASH_ENV  # (a test seam: see there)

_QUANTIZED_LAYERS = ("Linear4bit", "Linear8bitLt")
_ADAPTER_MARKERS = ("lora_", "modules_to_save", "lokr_", "loha_", "ia3_", "prompt_encoder")


class ContractGap(LoaderContractError):
    """The loader returned something other than what the request asked for: an ``error`` row, no known failure.
    ``field`` is the :class:`~pytest_llmload.LoadRequest` field it did not honour."""

    def __init__(self, sentence: str, *, check: str, request: LoadRequest, field: str = "") -> None:
        self.sentence, self.field = sentence, field
        honour = (f"make the loader honour LoadRequest.{field}" if field
                  else "make the loader return the model it loaded")
        super().__init__(f"contract: {sentence} ({check}: {_asked(request)}). The check judges nothing on a model "
                         f"that is not the one asked for; {honour}, or declare that {check} does not apply to this "
                         f"repo (load.llmload_not_applicable = {{{check!r}: 'why'}}).")


class Loaded(LoadResult):
    """What :func:`load` returns: the loader's :class:`~pytest_llmload.loader.seam.LoadResult` (it unpacks as
    ``model, tokenizer``) with ``request``, the request the model answers: the one the check made, or the same in the
    dtype the loader loads. A check sizes its ground truth by it (``plain_model(..., dtype=loaded.request.dtype)``)."""

    request: LoadRequest  # (no __slots__: set once, by load)

    @property
    def model_and_request(self) -> tuple:
        return self.model, self.request


# Per process (a check's child or rank): the dtype a loader answered a request in, by (loader, purpose,
# quantization, dtype asked), so the requests after the first are asked in it at once.
_ANSWERED_DTYPE: dict[tuple, str] = {}


class Facts(NamedTuple):
    """What a loaded model shows, read once, for the premises and the checks' messages."""

    weight_dtype: Optional[str]  # the dtype holding most of the base weights; None when nothing is materialised
    quantized: bool
    quantization: Optional[str]  # "4bit" | "8bit" by its bitsandbytes layers; None: not quantized
    compute_dtypes: tuple[str, ...]  # of the 4-bit layers (bnb_4bit_compute_dtype)
    adapter_weights: int  # adapter parameters (peft) present
    adapter_on_meta: int
    offloaded: tuple[str, ...]  # device_map_summary.offloaded_parts
    devices: tuple[str, ...]
    vocab: Optional[int]  # rows of the input embeddings
    checkpoint_vocab: Optional[int]
    all_on_meta: bool

    @property
    def where(self) -> str:
        return f"whole on {self.devices[0]}" if len(self.devices) == 1 else f"on {', '.join(self.devices)}"


def load(loader: Callable[[LoadRequest], Any], request: LoadRequest, *, check: str,
         needs: tuple[str, ...] = ()) -> Loaded:
    """Call the loader (:func:`~pytest_llmload.loader.seam.call_loader`) in a dtype it loads and verify what it returned
    against the request; raises :class:`ContractGap` for a model that is not the one asked for.

    The dtype is asked as the loader declares (``llmload_dtypes``), else as the check asks; a loader that answers
    in another dtype is asked again in that one (with its budget resized: a float32 budget holds a float16 model
    whole, and the offloading scenario would not happen), and the row says so. A quantized model for an unquantized
    request (an 8-bit LoRA trainer that always loads 8-bit) is judged as the model it is, with a note, unless the
    check's mechanism ``needs`` the model as asked: ``"unquantized"`` for a check that compares it with the
    unquantized checkpoint."""
    key = (getattr(loader, "function", loader), request.purpose, request.quantization, request.dtype)
    asked = request
    request = in_dtype(request, _dtype_to_ask(loader, request, _ANSWERED_DTYPE.get(key)))
    result = call_loader(loader, request)
    facts = verify(result.model, request, check=check, needs=needs)
    answered = _answered_dtype(facts, request)
    if answered is not None:
        _ANSWERED_DTYPE[key] = answered
        again = in_dtype(request, answered)
        if again.max_memory != request.max_memory:  # the budget was for another dtype: load as sized for this one
            del result
            result = call_loader(loader, again)
            facts = verify(result.model, again, check=check, needs=needs)
            if _answered_dtype(facts, again) is not None:
                raise ContractGap(f"the loader returned {facts.weight_dtype} weights when asked "
                                  f"again in the {answered} it had returned", check=check, request=again,
                                  field="dtype")
        request = again
    if request.dtype != asked.dtype:
        declared = getattr(loader, "dtypes", None)
        why = (f"the dtypes the loader declares ({', '.join(declared)})" if declared and request.dtype in declared
               else f"the dtype its weights came in when asked {asked.dtype}")
        note(f"judged in {request.dtype}, {why} (max_memory budgets sized for {request.dtype})")
    if facts.quantization is not None and request.quantization is None:
        request = request.replace(quantization=facts.quantization)
        note(f"judged as the {facts.quantization} model the loader returns for an unquantized request "
             "(quantization=None asked)")
    if os.environ.get(INJECT_CRASH_ENV) == check:
        raise IndexError(f"injected by ${INJECT_CRASH_ENV}={check}: a crash in the check's own code")
    loaded = Loaded(*result)
    loaded.request = request
    return loaded


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def in_dtype(request: LoadRequest, dtype: str) -> LoadRequest:
    """``request`` in ``dtype``, its ``max_memory`` resized by the weights' size in that dtype, so that it places
    the same share of the model (a budget of ``"10GiB"`` keeps its format as bytes)."""
    if dtype == request.dtype:
        return request
    if request.max_memory is None:
        return request.replace(dtype=dtype)
    from pytest_llmload.system.sizes import parse_size

    ratio = _ITEMSIZE[dtype] / _ITEMSIZE[request.dtype]
    return request.replace(dtype=dtype, max_memory={
        device: int(parse_size(size) * ratio) for device, size in request.max_memory.items()})


def _dtype_to_ask(loader: Any, request: LoadRequest, answered_before: Optional[str]) -> str:
    declared = getattr(loader, "dtypes", None)
    if declared and request.dtype not in declared:
        return declared[0]
    return answered_before or request.dtype


def _answered_dtype(facts: Facts, request: LoadRequest) -> Optional[str]:
    """The dtype the loader answered ``request`` in, where it is not the one asked and not one a request of its kind
    may get (float32 for a train request; a 4-bit model computing as asked); ``None`` otherwise."""
    asked, got = request.dtype, facts.weight_dtype
    if got is None or got == asked or got not in _ITEMSIZE:
        return None
    if request.purpose == "train" and got == "float32":
        return None  # master weights, k-bit training's upcast: as good as asked for training
    if request.quantization is not None and facts.compute_dtypes == (asked,):
        return None  # QLoRA scripts often pass only bnb_4bit_compute_dtype
    return got


def observe(model: Any, request: Optional[LoadRequest] = None) -> Facts:
    """The :class:`Facts` of ``model`` (``request``: where its checkpoint is, for the vocabulary)."""
    from pytest_llmload.instruments.device_map_summary import offloaded_parts

    params = list(model.named_parameters())
    by_dtype: dict[str, int] = {}
    adapter = adapter_meta = 0
    layers = {type(m).__name__ for m in model.modules()} & set(_QUANTIZED_LAYERS)
    quantized = bool(layers)
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
        weight_dtype=weight_dtype, quantized=quantized,
        quantization=("4bit" if "Linear4bit" in layers else "8bit") if layers else None, compute_dtypes=compute,
        adapter_weights=adapter, adapter_on_meta=adapter_meta,
        offloaded=tuple(offloaded_parts(model)), devices=devices, vocab=vocab,
        checkpoint_vocab=None if request is None else checkpoint_vocab(request.model_path),
        all_on_meta=bool(params) and devices == ("meta",) and not (mapped - {"meta"}),
    )


def verify(model: Any, request: LoadRequest, *, check: str, needs: tuple[str, ...] = ("unquantized",)) -> Facts:
    """Compare ``model`` with ``request``; raise :class:`ContractGap` with the sentence where they differ (the dtype
    is :func:`load`'s to settle: it asks again)."""
    facts = observe(model, request)

    def gap(sentence: str, field: str = ""):
        raise ContractGap(sentence, check=check, request=request, field=field)

    if facts.all_on_meta:
        gap("the loader returned every parameter on the meta device: nothing was loaded (an init_empty_weights "
            "model, or weights never materialised)")
    if facts.quantized and request.quantization is None and "unquantized" in needs:
        gap("the loader returned a quantized model (bitsandbytes layers) for a request with quantization=None",
            "quantization")
    if facts.vocab is not None and facts.checkpoint_vocab is not None and facts.vocab < facts.checkpoint_vocab:
        gap(f"the loader returned a vocabulary of {facts.vocab} rows for a checkpoint of {facts.checkpoint_vocab}",
            "model_path")
    on_accelerator = [d for d in facts.devices if d not in ("cpu", "meta")]
    if request.device == "cpu" and on_accelerator:
        gap(f"the loader put weights on {', '.join(on_accelerator)} for a device='cpu' request", "device")
    if request.device != "cpu" and not on_accelerator and not facts.all_on_meta \
            and not _placed_by_training(facts, request):
        gap(f"the loader returned the model {facts.where} for a device={request.device!r} request", "device")
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
    from pytest_llmload.config.stash_keys import add_note

    add_note(text)


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
