"""What the loader under test does, seen without loading anything: ``from_pretrained`` intercepted where it is called
(its keywords, the loader's line, ZeRO-3's refusal of a ``device_map``), the placement accelerate's ``dispatch_model``
or ``.to()`` is asked for, and what the loader does to the model after loading (:func:`after_loading_recorded`: moves,
casts, adapters), each an :class:`Event` at the loader's line. :func:`offloaded` says which modules a map offloads."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from unittest import mock
from typing import Any, Callable, NamedTuple, Optional

from pytest_llmload.prediction.records import device_name


class Intercepted(BaseException):
    """Raised in place of loading: a BaseException so that a loader's ``except Exception`` does not swallow it."""


class Stopped(Intercepted):
    """Raised where the loader meets a failure's mechanism after loading (a move of an offloaded model, a dtype cast of
    a quantized one, an adapter on an offloaded base): the runner raises there too, and nothing after it would run."""


class Call(NamedTuple):
    """One ``from_pretrained`` call of the loader (``kwargs`` ``None``: it never called it): where in the loader's
    code it was made (``at``, ``path:line``), and transformers' refusal of it where the runner's own set-up refuses
    it (``refusal``: a ``device_map`` under ZeRO-3), which the loader got raised as from_pretrained raises it. Or a
    placement accelerate makes of a model the loader built itself (``model``: ``load_checkpoint_and_dispatch``,
    ``dispatch_model``), ``kwargs`` then holding the map accelerate made and the dtype it loads in."""

    kwargs: Optional[dict]
    at: str = ""
    refusal: Optional[str] = None
    model: Any = None


def _shown(filename: str) -> str:
    """A file as rows name it: from the working directory where it lies below it."""
    relative = os.path.relpath(filename)
    return filename if relative.startswith("..") else relative


def _loader_line() -> str:
    """Where the loader's own code made the call being recorded (``path:line``): the innermost frame that is neither
    a library's nor this package's plumbing (the loader's line that called ``from_pretrained``, ``.to()``, peft,
    ...; the built-in loader's own lines, in ``pytest_llmload.fixes``, count as a loader's)."""
    from pytest_llmload.system import tracebacks

    frame = sys._getframe(1)
    while frame is not None:
        filename, module = frame.f_code.co_filename, tracebacks.module_of(frame)
        ours = module.startswith("pytest_llmload.") and not module.startswith("pytest_llmload.fixes.")
        if not (ours or tracebacks.is_installed(filename) or tracebacks.is_frozen(filename)):
            return f"{_shown(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return ""


def _zero3_refusal(device_map: Any) -> Optional[str]:
    """transformers' own refusal of ``device_map`` while a ZeRO-3 set-up is alive in this process (the simulated one
    of the ZeRO-3 scenario, as accelerate or Trainer makes it before the training script loads), ``None`` otherwise.
    Asked inside the set-up, where from_pretrained asks it."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    from pytest_llmload.loader.transformers_compat import zero3_device_map_refusal

    return zero3_device_map_refusal(device_map) if is_deepspeed_zero3_enabled() else None


def from_pretrained_intercepted(calls: list, stand_in: Optional[Callable[[dict], Any]] = None):
    """``from_pretrained`` records the loader's :class:`Call` and stops the loader there: nothing is read or
    allocated. A call the runner's set-up refuses (a ``device_map`` under ZeRO-3) raises transformers' refusal into
    the loader, as from_pretrained would (a loader may catch it and load again). With ``stand_in``, it returns
    ``stand_in(kwargs)`` instead (an empty model placed as planned), so that what the loader does after loading can
    be seen."""
    from transformers import PreTrainedModel

    def stop(klass, *args, **kwargs):
        call = Call({"class": klass.__name__, **kwargs}, _loader_line(), _zero3_refusal(kwargs.get("device_map")))
        calls.append(call)
        if call.refusal is not None:
            raise ValueError(call.refusal)
        if stand_in is not None:
            return stand_in(kwargs)
        raise Intercepted()

    return mock.patch.object(PreTrainedModel, "from_pretrained", classmethod(stop))


def _placed_after_loading(model: Any, device_map: Optional[dict], dtype: Any = None) -> Call:
    """The loader's :class:`Call` for a placement accelerate makes of ``model`` after it is built (``dtype``:
    load_checkpoint_and_dispatch's, else the model's own floating parameters')."""
    import torch

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    device_map = {name: str(where) for name, where in (device_map or {"": "cpu"}).items()}
    return Call({"class": type(model).__name__, "device_map": device_map, "dtype": dtype}, _loader_line(), model=model)


def placed_by_accelerate(calls: list, stand_in: Optional["StandIn"]):
    """A placement made after the model is built, as from_pretrained's ``device_map`` is: the loader's
    ``load_checkpoint_and_dispatch`` plans with accelerate's own code (``get_balanced_memory``,
    ``infer_auto_device_map``) on the runner's devices, and is recorded where it would read the checkpoint
    (``load_checkpoint_in_model``: nothing is read); a ``dispatch_model`` the loader calls with a map of its own is
    recorded with that map. Each is the loader's :class:`Call` (with its ``model``), and stops it there; with
    ``stand_in``, the map becomes the stand-in's placement and the loader runs on (``dispatch_model`` is then the
    after-loading recorder's, :func:`after_loading_recorded`)."""
    import accelerate
    import accelerate.big_modeling as big_modeling

    def placed(model, device_map, dtype=None) -> None:
        call = _placed_after_loading(model, device_map, dtype)
        if stand_in is not None:
            stand_in.dispatched(call)
            return
        calls.append(call)
        raise Intercepted()

    def load_checkpoint_in_model(model, checkpoint, device_map=None, dtype=None, *args, **kwargs):
        placed(model, device_map, dtype)

    def dispatch_model(model, device_map, *args, **kwargs):
        placed(model, device_map)
        return model

    patches = contextlib.ExitStack()
    patches.enter_context(mock.patch.object(big_modeling, "load_checkpoint_in_model", load_checkpoint_in_model))
    if stand_in is None:
        for module in (accelerate, big_modeling):
            patches.enter_context(mock.patch.object(module, "dispatch_model", dispatch_model))
    return patches


def offloaded(device_map: dict) -> list[str]:
    """The modules ``device_map`` offloads: those it sends to disk, and those it sends to the cpu where it also puts
    modules on an accelerator (accelerate's hooks then bring them to it at each forward). A model whole on the host
    (no ``device_map``, or a map of the cpu alone) is not offloaded: it is a model on the cpu, which a training
    script, DDP or DeepSpeed moves whole."""
    on_accelerator = any(str(where) not in ("cpu", "disk", "meta") for where in device_map.values())
    tiers = ("cpu", "disk") if on_accelerator else ("disk",)
    return [name for name, where in device_map.items() if str(where) in tiers]


class Event(NamedTuple):
    """What the loader did to the model after loading, on the stand-in: ``name`` (a move or cast method,
    ``generate``, ``PeftModel.from_pretrained``, ``load_adapter``, ``dispatch_model``), the dtype a cast asks for,
    the device a move sends the model to, the loader's line that did it, and the modules the model's own
    ``hf_device_map`` offloaded at that moment (:func:`offloaded`)."""

    name: str
    dtype: Any = None
    device: Optional[str] = None
    at: str = ""
    on_offloaded: tuple[str, ...] = ()


# What a loader may do to the model after loading: moves, and casts (method: the dtype it casts to).
MOVES = ("to", "cuda", "cpu")
CASTS = {"half": "float16", "float": "float32", "bfloat16": "bfloat16"}


# torch.nn.init's in-place initialisers (what nn.Linear and peft's LoRA layers call as they are built).
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                 "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


def _left_as_allocated(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


@contextlib.contextmanager
def after_loading_recorded(seen: list, on_dispatch: Optional[Callable] = None):
    """What the loader does to the stand-in (a model on meta) after loading, recorded in ``seen`` as :class:`Event`:
    moves and casts of the model (the stand-in, or peft's model around it; of its blocks, skipped), ``dispatch_model``
    (the map kept as ``hf_device_map``, nothing placed), adapters, test generations; none of them done. peft's objects
    are its own: ``get_peft_model``, ``PeftModel.from_pretrained`` (its adapter's weights not read: the stand-in has
    none either) and ``merge_and_unload`` run as written, on meta. Where a call meets a failure's mechanism (a move
    of an offloaded model, a dtype cast of a quantized one, an adapter on an offloaded base) the loader is stopped
    there (:class:`Stopped`), as the runner would stop it."""
    import torch
    from transformers import PreTrainedModel
    from transformers.generation import GenerationMixin

    def offloads_of(model) -> tuple[str, ...]:
        return tuple(offloaded(getattr(model, "hf_device_map", None) or {}))

    def recorder(owner, name):
        real = getattr(owner, name)

        def record(self, *args, **kwargs):
            if not any(p.is_meta for p in self.parameters()):  # a real module of the loader's own: its own method
                return real(self, *args, **kwargs)
            device = dtype = None
            if name == "to":
                device, dtype = torch._C._nn._parse_to(*args, **kwargs)[:2]
            elif name == "cuda":
                index = args[0] if args else kwargs.get("device")
                device = f"cuda:{torch.cuda.current_device() if index is None else index}" if isinstance(
                    index, (int, type(None))) else str(torch.device(index))
            elif name == "cpu":
                device = "cpu"
            else:
                dtype = getattr(torch, CASTS[name])
            if not isinstance(self, PreTrainedModel) and not hasattr(self, "get_base_model"):
                return self  # a block of the model (QLoRA casts its norms to float32): not the model moved or cast
            event = Event(name, dtype, None if device is None else device_name(str(device)), _loader_line(),
                          offloads_of(self))
            seen.append(event)
            if (device is not None and event.on_offloaded) or (
                    dtype is not None and getattr(self, "hf_quantizer", None) is not None):
                raise Stopped()  # accelerate refuses the move; transformers refuses the cast of a quantized model
            return self
        return record

    def generate(self, *args, **kwargs):  # a loader's test generation: recorded, as on the runner it would run
        seen.append(Event("generate", at=_loader_line()))
        return kwargs.get("input_ids", args[0] if args else None)

    def load_adapter(self, *args, **kwargs):  # transformers' own adapter loading: recorded, not done
        seen.append(Event("load_adapter", at=_loader_line(), on_offloaded=offloads_of(self)))
        if seen[-1].on_offloaded:
            raise Stopped()

    def dispatch_model(model, device_map, *args, **kwargs):  # the map kept, nothing placed (the weights are meta)
        seen.append(Event("dispatch_model", at=_loader_line()))
        model.hf_device_map = {name: str(where) for name, where in dict(device_map).items()}
        if on_dispatch is not None:
            on_dispatch(_placed_after_loading(model, model.hf_device_map))
        return model

    from pytest_llmload.instruments import device_map_summary

    real_offloaded_parts = device_map_summary.offloaded_parts

    def offloaded_parts(model) -> list[str]:  # this package's helper (the adapter fix asks it): of the stand-in, its
        if all(p.is_meta for p in model.parameters()):  # map says what is offloaded, not its weights (all on meta)
            parts = offloads_of(model)
            return [f"hf_device_map offloads {len(parts)} module(s) to cpu/disk"] if parts else []
        return real_offloaded_parts(model)

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(device_map_summary, "offloaded_parts", offloaded_parts))
        # Layers the loader builds on the stand-in (peft's adapters) are never computed with: their initial values
        # are left as allocated (peft initialises each LoRA layer on the cpu: seconds a row on a busy runner).
        for name in _INITIALISERS:
            patches.enter_context(mock.patch.object(torch.nn.init, name, _left_as_allocated))
        for name in (*MOVES, *CASTS):  # nn.Module's, and transformers' own where it overrides them
            patches.enter_context(mock.patch.object(torch.nn.Module, name, recorder(torch.nn.Module, name)))
            if name in PreTrainedModel.__dict__:
                patches.enter_context(mock.patch.object(PreTrainedModel, name, recorder(PreTrainedModel, name)))
        patches.enter_context(mock.patch.object(PreTrainedModel, "load_adapter", load_adapter, create=True))
        patches.enter_context(mock.patch.object(GenerationMixin, "generate", generate))
        for module in ("accelerate", "accelerate.big_modeling"):
            patches.enter_context(mock.patch(f"{module}.dispatch_model", dispatch_model))
        with contextlib.suppress(ImportError):
            import peft.peft_model
            from peft import PeftModel

            real_from_pretrained = PeftModel.__dict__["from_pretrained"].__func__

            def adapter(klass, model, *args, **kwargs):
                seen.append(Event("PeftModel.from_pretrained", at=_loader_line(), on_offloaded=offloads_of(model)))
                if seen[-1].on_offloaded:
                    raise Stopped()  # peft would re-dispatch the offloaded base without its budget
                with warnings.catch_warnings():  # (the adapter's weights, not read, are "missing")
                    warnings.filterwarnings("ignore", message="Found missing adapter keys")
                    # its layers made on meta, as the weights they would be given (not initialised for nothing)
                    return real_from_pretrained(klass, model, *args, **{"low_cpu_mem_usage": True, **kwargs})

            patches.enter_context(mock.patch.object(PeftModel, "from_pretrained", classmethod(adapter)))
            patches.enter_context(mock.patch.object(peft.peft_model, "load_peft_weights", lambda *a, **k: {}))
            patches.enter_context(mock.patch.object(peft.peft_model, "dispatch_model", dispatch_model))
        yield

