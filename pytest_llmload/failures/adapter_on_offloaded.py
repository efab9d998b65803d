"""adapter-on-offloaded: a trained LoRA adapter put onto a base model that ``device_map`` offloaded to cpu/disk.

The serving-side twin of write-up 002 (meta-backward). The field's inference scripts (tloen/alpaca-lora's
``generate.py`` and its forks) load the base with ``device_map="auto"`` and then call
``PeftModel.from_pretrained(base, adapter_dir)``. When the budget offloads part of the base, peft's
``load_adapter`` removes accelerate's hooks (leaving the offloaded weights on ``meta``), plans a new device map
*without* the loader's ``max_memory``, finds that the model now "fits" one device, and ``dispatch_model`` calls
``model.to(device)``: ``NotImplementedError: Cannot copy out of meta tensor; no data! Please use
torch.nn.Module.to_empty() instead of torch.nn.Module.to() when moving module from meta to a different device.``
Measured here (peft 0.21, accelerate 1.15, transformers 5.23, torch 2.13, CPU with disk offload):

- ``PeftModel.from_pretrained(offloaded_base, adapter_dir)`` raises that error, in ``load_adapter`` ->
  ``accelerate.big_modeling.dispatch_model`` -> ``Module.to``; before raising it writes copies of the
  offloaded shards to a path *relative to the working directory* (peft's ``_update_offload`` rebuilds an
  absolute path with ``os.path.join(*path.split(os.sep))``, which drops the leading ``/``);
- passing the budget on (``PeftModel.from_pretrained(base, dir, max_memory=..., offload_folder=...)``, or
  ``AutoPeftModelForCausalLM.from_pretrained(dir, device_map="auto", max_memory=...)``) loads, but every LoRA
  weight is left on ``meta`` and ``generate``/``merge_and_unload`` raise ``KeyError:
  '...q_proj.base_layer.weight'`` (the new map sends a layer to disk that the offload index does not hold);
- transformers' own ``base.load_adapter(dir)`` (and ``AutoModelForCausalLM.from_pretrained(adapter_dir,
  device_map="auto", max_memory=...)``) loads *silently* with the LoRA weights of the disk-offloaded layers on
  ``meta`` and generates garbage (token 0 repeated here).

Measured on the hf-4.56 stack (peft 0.17.1, accelerate 1.10.1, transformers 4.56.2, torch 2.13), the same calls
fail earlier and louder:

- ``PeftModel.from_pretrained(offloaded_base, adapter_dir)``, with or without the budget, raises ``KeyError:
  'base_model.model.model.model.layers.0.input_layernorm'`` in peft's ``_update_offload`` (before any
  ``dispatch_model``): it prefixes the checkpoint's keys, which already start with ``model.``, with the root
  module's name again (huggingface/peft#2213, hiyouga/LlamaFactory#6030; later peft tries both forms);
- transformers' ``base.load_adapter(dir)`` re-dispatches the model without removing accelerate's hooks, and
  ``dispatch_model``'s ``model.to(device)`` hits accelerate's guard: ``RuntimeError: You can't move a model that
  has some modules offloaded to cpu or disk.`` (that text alone is the ``move-offloaded`` entry's signature).

The fix that worked in the field (tloen/alpaca-lora#368): one device, no offload -- load the base whole
(``device_map={"": device}``), then the adapter; :mod:`pytest_llmload.fixes.adapters` does that
(``adapter_placement_kwargs``, ``put_adapter``). The check's verdicts and the fix's
refusals all carry the id (``TAG``).

The check (see :mod:`pytest_llmload.failures.meta_backward` for the calling convention)::

    from pytest_llmload.failures import adapter_on_offloaded

    @pytest.mark.timeout(120)
    def test_my_loader_serves_an_adapter_under_a_budget(llmload_checkpoint, tmp_path):
        adapter_on_offloaded.check_adapter_on_offloaded_base(my_loader, llmload_checkpoint, tmp_path)
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pytest_llmload.checks.base import Check, KnownFailure, not_exercised
from pytest_llmload.checks import contract
from pytest_llmload.fixes.adapters import TAG
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.loader.tiny_models import copy_tokenizer
from pytest_llmload.checks.ground_truth import input_ids, offload_budget, plain_model, refusal_problem
from pytest_llmload.system import tracebacks

Loader = Callable[[LoadRequest], Any]

# torch's text when a meta tensor is copied to a real device (Module.to on a model with offloaded weights).
META_COPY = r"Cannot copy out of meta tensor"
# peft <= 0.17's _update_offload (adapter on a disk-offloaded base) looks up a module name with the root prefix
# doubled: KeyError: 'base_model.model.model.model.layers.0.input_layernorm' (huggingface/peft#2213).
PEFT_OFFLOAD_KEY = r"KeyError: 'base_model\.model\.[\w.]+'"
# Frames where an adapter is put on (or merged into) a model: peft's and transformers' integration.
ADAPTER_FRAMES = r"\bin (load_adapter|_update_offload|merge_and_unload|_unload_and_optionally_merge)\b"
# The same frames in the check's "module:function -> ..." form (see _frames).
_ADAPTER_CALLS = r"(?:^| )peft\.|:(?:load_adapter|_update_offload|merge_and_unload|_unload_and_optionally_merge)\b"

FAILURE = KnownFailure(
    id="adapter-on-offloaded",
    order=7,
    title="a trained PEFT adapter put onto a base model that device_map offloaded to cpu/disk",
    write_up=("tloen/alpaca-lora#368, tloen/alpaca-lora#536, SCIR-HI/Huatuo-Llama-Med-Chinese#75, "
              "QwenLM/Qwen3#297, huggingface/peft#2213, hiyouga/LlamaFactory#6030"),
    signatures=(META_COPY, PEFT_OFFLOAD_KEY, TAG),
    # torch raises META_COPY for any copy of a meta tensor (a .cpu() of an offloaded model too), and a KeyError on
    # a peft module name can come from anywhere: this entry needs the adapter's frames.
    context=(rf"{ADAPTER_FRAMES}|{TAG}",),
    root_cause=(
        "The base was loaded with device_map and a max_memory it exceeds, so part of it is on 'meta' behind "
        "accelerate's hooks. PeftModel.from_pretrained/load_adapter removes the hooks and re-dispatches the model "
        "with a device map planned without the loader's budget: when that map has one device it calls "
        "model.to(device) on meta weights (the error); otherwise the adapter weights of offloaded layers stay on "
        "meta, and generate or merge_and_unload fail (KeyError in accelerate's weights map) or, through "
        "transformers' load_adapter, silently generate garbage. peft <= 0.17 fails before that, in "
        "_update_offload (KeyError on a 'base_model.model.model.model...' name); transformers 4.x's "
        "load_adapter re-dispatches without removing the hooks and accelerate refuses the move (RuntimeError)."
    ),
    fix=(
        "Do not put an adapter on an offloaded base: load the base whole on one device (device_map={'': device}) "
        "and then the adapter (tloen/alpaca-lora#368); where the device's budget cannot hold it, load it whole on "
        "the host, merge_and_unload there and dispatch the merged model under the budget, or refuse the budget "
        "before loading (pytest_llmload.fixes.adapters.adapter_placement_kwargs / put_adapter)."
    ),
    script_fix=(
        "Do not put an adapter on an offloaded base: load the base whole on one device (device_map={'': device}) and "
        "then the adapter (tloen/alpaca-lora#368); where the device's budget cannot hold it, load it whole on the "
        "host, merge_and_unload there and dispatch the merged model under the budget, or refuse the budget before "
        "loading."
    ),
    occurs=("peft 0.x with accelerate offload (reproduced: peft 0.21, accelerate 1.15, transformers 5.23, "
            "torch 2.13, CPU with disk offload; and peft 0.17.1, accelerate 1.10.1, transformers 4.56.2 as a "
            "KeyError in peft's _update_offload / accelerate's move refusal); reports on cuda:N with cpu/disk "
            "offload, 8-bit bases included."),
    tell=(f"(?:{tracebacks.frame_pattern('peft_model.py', '_update_offload')}"
          f"|{tracebacks.frame_pattern('big_modeling.py', 'dispatch_model')})"),
    without_tell=(
        "no accelerate dispatch_model (or peft _update_offload) frame in the traceback: check hf_device_map for "
        "'cpu'/'disk' entries and where the adapter's lora_ weights are (meta?) before blaming the adapter load."
    ),
)

LORA_TARGETS = ("q_proj", "v_proj")


# --- the adapter -----------------------------------------------------------------------------------------


def write_adapter(checkpoint, dest, *, seed: int = 0, r: int = 8, lora_alpha: int = 32,
                  targets: tuple[str, ...] = LORA_TARGETS) -> Path:
    """Save a LoRA adapter for ``checkpoint`` to ``dest`` (``get_peft_model(...).save_pretrained(dest)``), with the
    checkpoint's tokenizer beside it.

    Its weights are random, not zero (``init_lora_weights=False``): they stand in for a trained adapter, and
    what matters is that the adapter changes what the model generates (a fresh LoRA's ``B`` is zero and would
    change nothing). Same ``seed``, same adapter. Returns ``dest``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = Path(dest)
    base = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = get_peft_model(base, LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=0.0,
                                                target_modules=list(targets), init_lora_weights=False,
                                                task_type="CAUSAL_LM"))
    model.save_pretrained(dest)
    # As real projects find a trained adapter: its tokenizer beside it (inference scripts often load it from there).
    AutoTokenizer.from_pretrained(checkpoint, local_files_only=True).save_pretrained(dest)
    copy_tokenizer(checkpoint, dest)  # the slow classes' files too, which save_pretrained leaves out
    return dest


# --- the check -------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _record_loads(loads: list) -> Iterator[None]:
    """Record ``(caller module, hf_device_map of the result)`` for each ``PreTrainedModel.from_pretrained``."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.__dict__["from_pretrained"]

    def spy(klass, *args, **kwargs):
        caller = tracebacks.module_of(sys._getframe(1)) or "?"
        model = original.__func__(klass, *args, **kwargs)
        loads.append((caller, dict(getattr(model, "hf_device_map", None) or {})))
        return model

    PreTrainedModel.from_pretrained = classmethod(spy)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


_opened: list[list[str]] = []
_audit_installed = False


def _audit(event: str, args: tuple) -> None:
    if _opened and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        for record in _opened:
            record.append(os.fsdecode(args[0]))


@contextlib.contextmanager
def _record_opens(record: list) -> Iterator[None]:
    """Every file Python opens meanwhile (audit hook; a hook cannot be removed, so it idles outside)."""
    global _audit_installed
    if not _audit_installed:
        sys.addaudithook(_audit)
        _audit_installed = True
    _opened.append(record)
    try:
        yield
    finally:
        _opened.remove(record)


def _offloaded_tiers(device_map: dict, device: str) -> dict:
    """The entries of an ``hf_device_map`` that are not on ``device`` (disk; cpu below cuda:N)."""
    keep = {device, device.partition(":")[2]}
    return {k: v for k, v in device_map.items() if str(v) not in keep}


def _frames(exc: BaseException) -> str:
    """The library frames an exception passed through: ``peft.peft_model:load_adapter -> ...``."""
    names = []
    for frame in traceback.extract_tb(exc.__traceback__):  # as printed: each module read from its installed path
        if tracebacks.is_library(tracebacks.module_of(frame), ("peft", "accelerate", "transformers", "torch")):
            name = f"{tracebacks.module_of(frame)}:{frame.name}"
            if not names or names[-1] != name:
                names.append(name)
    kept = [n for n in names[:-1] if not n.startswith("torch.")] + names[-1:]  # torch's recursion says little
    return " -> ".join(kept)


def _lora_parameters(model) -> list:
    return [(n, p) for n, p in model.named_parameters() if "lora_" in n]


def _greedy(model, ids, new_tokens: int):
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids).logits.float().cpu()
        vocab = contract.checkpoint_vocab(model.config._name_or_path) if hasattr(model, "config") else None
        logits = contract.checkpoint_logits(logits, vocab) if vocab else logits
        out = model.generate(input_ids=ids[:1], attention_mask=torch.ones_like(ids[:1]), do_sample=False,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return logits, out.cpu()


def _close(a, b) -> bool:
    """Equal up to rounding: float32's 1e-4; a half-precision model's, where a merged adapter rounds otherwise."""
    import torch

    tolerance = 1e-4 if a.dtype == torch.float32 else 2e-2
    return bool(torch.isfinite(a).all()) and torch.allclose(a, b.to(a.dtype), rtol=tolerance, atol=tolerance)


def check_adapter_on_offloaded_base(loader: Loader, checkpoint, workdir, *, device: str = "cpu",
                                    new_tokens: int = 6) -> None:
    """Guards adapter-on-offloaded: an adapter under an offloading budget is served with real weights, or refused.

    A LoRA adapter (:func:`write_adapter`) is requested (``LoadRequest.adapter_path``) for inference under a
    ``max_memory`` that holds half the weights on ``device`` (:func:`~pytest_llmload.checks.ground_truth.offload_budget`).
    The loader either refuses clearly (an error naming the memory budget, raised by its own code, before or
    after loading the base: either way no adapter met an offloaded base) or returns a model with no ``lora_``
    weight on meta whose logits (rtol/atol 1e-4) and ``new_tokens`` greedy tokens equal those of the ground
    truth: the base loaded whole on ``device`` with the adapter merged. A loader error raised while peft puts
    the adapter on an offloaded base fails the check; any other loader error propagates as it is. Skips when
    the budget could hold the model whole, or the loader ignored ``adapter_path`` (never read the adapter and
    serves the base). The loader runs with ``workdir`` as working directory: peft writes files relative to it."""
    import torch
    from peft import PeftModel

    from pytest_llmload.loader.seam import LoaderContractError, LoaderError
    from pytest_llmload.fixes.training_memory import budget_for_device, checkpoint_tensors
    from pytest_llmload.system.sizes import format_bytes

    name = CHECK.name
    workdir = Path(workdir)
    adapter = write_adapter(checkpoint, workdir / "adapter")
    budget = offload_budget(checkpoint, device)
    weights = sum(t.nbytes for t in checkpoint_tensors(checkpoint))
    given = budget_for_device(budget, device)
    if given is not None and weights <= given:
        not_exercised(name, f"was given max_memory={budget} that holds all {format_bytes(weights)} of weights",
                      "an adapter on an offloaded base")
    request = LoadRequest(checkpoint, purpose="inference", device=device, max_memory=budget,
                          offload_folder=workdir / "offload", adapter_path=adapter)
    label = (f"{Path(checkpoint).name} + its adapter on {device}, max_memory={budget} "
             f"({format_bytes(weights)} of weights)")

    loads: list = []
    opened: list = []
    try:
        with _record_loads(loads), _record_opens(opened), contextlib.chdir(workdir):
            loaded = contract.load(loader, request, check=CHECK.name,
                                   needs=("unquantized",))  # (compared with the checkpoint)
    except LoaderContractError:  # a contract gap, an exit: never a refusal of the budget, whatever its text
        raise
    except Exception as exc:
        original = exc.original if isinstance(exc, LoaderError) else exc
        if refusal_problem(original) is None:
            return  # a clear refusal of the budget by the loader's own code: no adapter was put on an offloaded base
        offloaded = [_offloaded_tiers(m, device) for _, m in loads if _offloaded_tiers(m, device)]
        frames = _frames(original)
        if offloaded and (re.search(_ADAPTER_CALLS, frames) or META_COPY in str(original)):
            spread = offloaded[-1]
            raise AssertionError(
                f"{TAG}: putting the adapter on the offloaded base raised {type(original).__name__}: {original}\n"
                f"  [{label}]\n  the base was loaded with {len(spread)} modules off {device}: "
                f"{dict(list(spread.items())[:4])}\n  raised in: {frames}"
            ) from original
        raise

    model, request = loaded.model, loaded.request  # (in the dtype the loader loads)
    base = plain_model(checkpoint, device, request.dtype)
    ids = input_ids(base, device)
    base_logits, _ = _greedy(base, ids, new_tokens)
    truth = PeftModel.from_pretrained(base, adapter).merge_and_unload().eval()
    want_logits, want_tokens = _greedy(truth, ids, new_tokens)
    del truth, base

    facts = contract.observe(model, request)
    contract.require(bool(facts.offloaded), name, f"loaded the base {facts.where} under "
                     f"max_memory={request.max_memory}: nothing "
                     "was offloaded", "an adapter on an offloaded base")
    model.eval()  # as a server puts it before generating
    lora = _lora_parameters(model)
    on_meta = [n for n, p in lora if p.device.type == "meta"]
    read_adapter = any(os.path.realpath(p).startswith(os.path.realpath(adapter) + os.sep) for p in opened)
    device_map = getattr(model, "hf_device_map", None) or {}
    spread = _offloaded_tiers(device_map, device)
    where = (f"hf_device_map sends {len(spread)} modules off {device}: {dict(list(spread.items())[:4])}" if spread
             else f"parameters on {sorted({str(p.device) for p in model.parameters()})}")
    problems = []
    if on_meta:
        problems.append(f"{len(on_meta)} of {len(lora)} adapter (lora_) weights are on meta, e.g. {on_meta[:2]}")
    try:
        logits, tokens = _greedy(model, ids, new_tokens)
    except Exception as exc:
        if not (on_meta or spread or any(p.device.type == "meta" for p in model.parameters())):
            raise  # a model whole on its device that cannot generate: the loader's own bug
        problems.append(f"the model raised {type(exc).__name__}: {str(exc)[:300]} in its forward/generate")
    else:
        if not lora and not read_adapter and _close(logits, base_logits) and not _close(logits, want_logits):
            not_exercised(name, f"ignored adapter_path (never read {adapter}; no lora_ weights; it generates as "
                                f"the base alone), {where}", "an adapter on an offloaded base")
        if not (_close(logits, want_logits) and torch.equal(tokens, want_tokens)):
            diff = (logits - want_logits).abs().max().item()
            as_base = " -- as the base without the adapter" if _close(logits, base_logits) else ""
            problems.append(
                f"it generates {tokens[0, ids.shape[1]:].tolist()}, base + adapter merged on one device "
                f"{want_tokens[0, ids.shape[1]:].tolist()}{as_base}; logits max abs diff {diff:.3g}")
    if problems:
        raise AssertionError(
            f"{TAG}: the adapter request returned a model that does not serve the adapter "
            f"({'PeftModel' if isinstance(model, PeftModel) else type(model).__name__}, {len(lora)} lora_ weights, "
            f"{where}):\n  [{label}]\n  " + "\n  ".join(problems)
        )


# Isolated: the check patches from_pretrained and adds an audit hook while the loader runs, and changes the
# working directory (peft writes offload copies relative to it).
CHECK = Check(check_adapter_on_offloaded_base, failure=FAILURE, isolated=True, uses_adapters=True)
CHECKS = (CHECK,)
