"""What the loader under test would do on a runner profile with a full-size architecture: each scenario runs the
loader as it would run there, stops it at ``from_pretrained`` (nothing is loaded or allocated), plans the placement
with transformers' own code (:mod:`pytest_llmload.placement.planned`), estimates memory
(:mod:`pytest_llmload.fixes.training_memory`) and names the known failure the runner would hit, or OOM with the
figures. Every row is a prediction and says what was simulated. The scenarios are the functions declared with
``@_scenario``, each naming the known failure it predicts by its id (the catalog, a layer below, names none).

What the loader sees, as on each rank of that runner: the request in the profile's sizes (``max_memory`` the
profile's capacities, or under a launcher each rank's own budget; ``gpu_count`` its GPUs, ``device``
``cuda:<rank>``, the dtype one the loader declares), the launcher's environment for the distributed scenarios,
DeepSpeed ZeRO-3 enabled for the ZeRO-3 one (``from_pretrained`` refuses a ``device_map`` there, to the loader, as
transformers does), and ``torch.cuda`` answering as the runner's while the loader runs (:func:`_cuda_as_on`).

A failure is predicted only where its mechanism is, and the row names the loader's line that reaches it: offloaded
modules are those a ``device_map`` with an accelerator in it sends to cpu or disk (:func:`offloaded`), never a model
loaded whole on the host.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import threading
import time
import types
import warnings
from unittest import mock
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from pytest_llmload.placement import architectures, planned, planner
from pytest_llmload.placement.profiles import RunnerProfile
from pytest_llmload.placement.picture import TIERS, device_order, placement_lines, placement_tiers, tier_of
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.system.sizes import format_bytes
from pytest_llmload.system.words import a

PREDICTION_PREFIX = "predict_"
DEFAULT_DTYPE = "bfloat16"  # what runs on these runners use; --llmload-dtype changes it


class PredictedFailure(AssertionError):
    """A scenario predicts that the runner would hit ``failure`` (a catalog id, or ``"OOM"``); ``prediction`` is
    the :meth:`Prediction.record` of where the model would go, where the scenario planned one."""

    def __init__(self, failure: str, message: str, prediction: Optional[dict] = None) -> None:
        super().__init__(message)
        self.failure = failure
        self.prediction = prediction

    def __reduce__(self):  # crosses a process boundary (an isolated child) as itself
        return PredictedFailure, (self.failure, str(self), self.prediction)


class DevicePrediction(NamedTuple):
    device: str
    modules: int
    weights: int  # bytes of weights placed there
    peak: int  # the scenario's predicted peak there (load, or a training step)
    capacity: Optional[int]  # None: disk, unbounded here


class Prediction(NamedTuple):
    scenario: str
    runner: str
    model: str
    placement: dict  # {module: device}, from the loader's own from_pretrained arguments
    devices: tuple[DevicePrediction, ...]
    asked: dict  # the placement arguments the loader passed (device_map, max_memory, quantization)
    simulated: tuple[str, ...]
    failure: Optional[str] = None
    reason: str = ""
    seconds: float = 0.0
    at: str = ""  # the loader's line the verdict comes from (its from_pretrained call, or what it did after loading)

    def summary(self) -> str:
        """One line: the verdict's reason, then how many modules and bytes go to each of gpu, cpu and disk, and
        the fullest device against its capacity."""
        if not self.placement and not self.devices:
            return self.reason
        record = self.record()
        sized = [d for d in self.devices if d.capacity]
        fullest = max(sized, key=lambda d: d.peak / d.capacity, default=None)
        fill = "" if fullest is None else (f"; the fullest {fullest.device} {format_bytes(fullest.peak)} of "
                                           f"{format_bytes(fullest.capacity)}")
        return f"{self.reason} [{placement_tiers(record)}{fill}]"

    def table(self) -> str:
        """The verdict, then per tier and per device: the modules, the weights, the predicted peak against the
        capacity, which modules they are; then what was simulated."""
        lines = [f"on {self.runner} with {self.model}, would hit {self.failure}: {self.reason}" if self.failure
                 else f"on {self.runner} with {self.model}, nothing known: {self.reason}"]
        if self.placement or self.devices:
            record = self.record()
            lines += [f"  {placement_tiers(record)}", *(f"  {line}" for line in placement_lines(record))]
        lines += [f"  simulated: {note}" for note in self.simulated]
        return "\n".join(lines)

    def record(self) -> dict:
        """Where the model would go, as plain data (a row's :attr:`~pytest_llmload.reports.row.Row.prediction`,
        ``--json``'s, the HTML report's): per device (``devices``, accelerators first) its modules, weights, peak
        and capacity in bytes; per tier (``tiers``: gpu, cpu, disk) the modules, bytes and devices; per device the
        modules it holds, layers as ranges (``placement``: ``{"cuda:0": "model.embed_tokens, model.layers.0-41"}``);
        and the whole map, module by module (``device_map``)."""
        from pytest_llmload.instruments.device_map_summary import compress_modules

        device_map = {name: _device_name(str(where)) for name, where in self.placement.items()}
        held: dict[str, list[str]] = {}
        for name, device in device_map.items():
            held.setdefault(device, []).append(name)
        known = {d.device: {"device": d.device, "tier": tier_of(d.device), **d._asdict()} for d in self.devices}
        unsized = {"weights": None, "peak": None, "capacity": None}  # a map planned without its sizes
        devices = [*known.values(), *({"device": device, "tier": tier_of(device), "modules": len(names), **unsized}
                                      for device, names in held.items() if device not in known)]
        devices.sort(key=lambda d: device_order(d["device"]))
        tiers = {}
        for tier in TIERS:
            there = [d for d in devices if tier_of(d["device"]) == tier]
            weights = [d["weights"] for d in there]
            tiers[tier] = {"modules": sum(d["modules"] for d in there), "devices": len(there),
                           "bytes": None if None in weights else sum(weights)}
        return {"scenario": self.scenario, "runner": self.runner, "model": self.model, "failure": self.failure,
                "reason": self.reason, "tiers": tiers, "devices": devices,
                "placement": {device: compress_modules(names, dash="-") for device, names in
                              sorted(held.items(), key=lambda item: device_order(item[0]))},
                "device_map": device_map, "simulated": list(self.simulated)}


def bare_record(scenario: str, runner: str, model: str, failure: Optional[str], reason: str) -> dict:
    """The :meth:`Prediction.record` of a row that planned no map (Trainer's decision, a placement from_pretrained
    refuses)."""
    return Prediction(scenario, runner, model, {}, (), {}, (), failure, reason).record()


class _Intercepted(BaseException):
    """Raised in place of loading: a BaseException so that a loader's ``except Exception`` does not swallow it."""


class _Stopped(_Intercepted):
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


def _from_pretrained_intercepted(calls: list, stand_in: Optional[Callable[[dict], Any]] = None):
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
        raise _Intercepted()

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


def _placed_by_accelerate(calls: list, stand_in: Optional["_StandIn"]):
    """A placement made after the model is built, as from_pretrained's ``device_map`` is: the loader's
    ``load_checkpoint_and_dispatch`` plans with accelerate's own code (``get_balanced_memory``,
    ``infer_auto_device_map``) on the runner's devices, and is recorded where it would read the checkpoint
    (``load_checkpoint_in_model``: nothing is read); a ``dispatch_model`` the loader calls with a map of its own is
    recorded with that map. Each is the loader's :class:`Call` (with its ``model``), and stops it there; with
    ``stand_in``, the map becomes the stand-in's placement and the loader runs on (``dispatch_model`` is then the
    after-loading recorder's, :func:`_after_loading_recorded`)."""
    import accelerate
    import accelerate.big_modeling as big_modeling

    def placed(model, device_map, dtype=None) -> None:
        call = _placed_after_loading(model, device_map, dtype)
        if stand_in is not None:
            stand_in.dispatched(call)
            return
        calls.append(call)
        raise _Intercepted()

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
_MOVES = ("to", "cuda", "cpu")
_CASTS = {"half": "float16", "float": "float32", "bfloat16": "bfloat16"}


# torch.nn.init's in-place initialisers (what nn.Linear and peft's LoRA layers call as they are built).
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "xavier_uniform_",
                 "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


def _left_as_allocated(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


@contextlib.contextmanager
def _after_loading_recorded(seen: list, on_dispatch: Optional[Callable] = None):
    """What the loader does to the stand-in (a model on meta) after loading, recorded in ``seen`` as :class:`Event`:
    moves and casts of the model (the stand-in, or peft's model around it; of its blocks, skipped), ``dispatch_model``
    (the map kept as ``hf_device_map``, nothing placed), adapters, test generations; none of them done. peft's objects
    are its own: ``get_peft_model``, ``PeftModel.from_pretrained`` (its adapter's weights not read: the stand-in has
    none either) and ``merge_and_unload`` run as written, on meta. Where a call meets a failure's mechanism (a move
    of an offloaded model, a dtype cast of a quantized one, an adapter on an offloaded base) the loader is stopped
    there (:class:`_Stopped`), as the runner would stop it."""
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
                dtype = getattr(torch, _CASTS[name])
            if not isinstance(self, PreTrainedModel) and not hasattr(self, "get_base_model"):
                return self  # a block of the model (QLoRA casts its norms to float32): not the model moved or cast
            event = Event(name, dtype, None if device is None else _device_name(str(device)), _loader_line(),
                          offloads_of(self))
            seen.append(event)
            if (device is not None and event.on_offloaded) or (
                    dtype is not None and getattr(self, "hf_quantizer", None) is not None):
                raise _Stopped()  # accelerate refuses the move; transformers refuses the cast of a quantized model
            return self
        return record

    def generate(self, *args, **kwargs):  # a loader's test generation: recorded, as on the runner it would run
        seen.append(Event("generate", at=_loader_line()))
        return kwargs.get("input_ids", args[0] if args else None)

    def load_adapter(self, *args, **kwargs):  # transformers' own adapter loading: recorded, not done
        seen.append(Event("load_adapter", at=_loader_line(), on_offloaded=offloads_of(self)))
        if seen[-1].on_offloaded:
            raise _Stopped()

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
        for name in (*_MOVES, *_CASTS):  # nn.Module's, and transformers' own where it overrides them
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
                    raise _Stopped()  # peft would re-dispatch the offloaded base without its budget
                with warnings.catch_warnings():  # (the adapter's weights, not read, are "missing")
                    warnings.filterwarnings("ignore", message="Found missing adapter keys")
                    # its layers made on meta, as the weights they would be given (not initialised for nothing)
                    return real_from_pretrained(klass, model, *args, **{"low_cpu_mem_usage": True, **kwargs})

            patches.enter_context(mock.patch.object(PeftModel, "from_pretrained", classmethod(adapter)))
            patches.enter_context(mock.patch.object(peft.peft_model, "load_peft_weights", lambda *a, **k: {}))
            patches.enter_context(mock.patch.object(peft.peft_model, "dispatch_model", dispatch_model))
        yield


# The compute capability of the shipped profiles' cards (NVIDIA's table); another card is answered as an Ampere
# (8.0: bfloat16 and flash attention, what loaders ask the capability about).
_CAPABILITY = {"RTX 4090": (8, 9), "A100": (8, 0), "H100": (9, 0), "H200": (9, 0)}


@contextlib.contextmanager
def _cuda_as_on(profile: RunnerProfile):
    """``torch.cuda`` as one process of the runner answers it, in the thread that runs the loader: the machine
    from_pretrained's planner reads (:mod:`pytest_llmload.placement.simulated_devices`: the runner's GPUs, all their
    memory free, ``torch.device(0)`` a CUDA device, a tensor put on one is made on meta), and what loaders ask
    besides: the current device (0 until ``set_device`` or ``torch.cuda.device(...)`` changes it), the card's name,
    properties and capability, bfloat16 support, the allocator's statistics (nothing allocated), ``synchronize`` and
    ``empty_cache`` (nothing to wait for or free). A device the runner does not have raises as CUDA does."""
    import torch

    from pytest_llmload.placement.simulated_devices import simulated

    loader_thread = threading.get_ident()
    current = [0]
    name = profile.device or "GPU"
    capability = next((value for card, value in _CAPABILITY.items() if card in name), (8, 0))

    def ordinal(device: Any = None) -> int:
        if not profile.devices:
            raise RuntimeError(f"No CUDA GPUs are available (the runner {profile.name} has none)")
        index = device if isinstance(device, int) else None if device is None else torch.device(device).index
        index = current[0] if index is None else index
        if not 0 <= index < profile.devices:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (the runner {profile.name} has "
                               f"{profile.devices} GPU(s))")
        return index

    def set_device(device: Any) -> None:
        current[0] = ordinal(device)

    def exchange(device: int) -> int:  # torch.cuda.device(...)'s way in and out
        if device < 0:
            return -1
        before, current[0] = current[0], ordinal(device)
        return before

    def properties(device: Any = None) -> Any:
        ordinal(device)
        return types.SimpleNamespace(name=name, total_memory=profile.device_memory, is_integrated=False,
                                     major=capability[0], minor=capability[1], multi_processor_count=132)

    def on_a_device(value: Any) -> Callable:  # a question about one device: the answer, for a device it has
        return lambda device=None: (ordinal(device), value)[1]

    answers = {
        "current_device": lambda: ordinal(), "set_device": set_device, "_exchange_device": exchange,
        "_maybe_exchange_device": exchange, "get_device_properties": properties,
        "get_device_name": lambda device=None: properties(device).name,
        "get_device_capability": lambda device=None: (properties(device).major, properties(device).minor),
        "is_bf16_supported": lambda *args, **kwargs: profile.devices > 0 and capability >= (8, 0),
        "is_initialized": lambda: profile.devices > 0, "init": lambda: (ordinal(), None)[1],
        "synchronize": on_a_device(None), "empty_cache": lambda: None, "reset_peak_memory_stats": on_a_device(None),
        **{stat: on_a_device(0) for stat in ("memory_allocated", "memory_reserved", "max_memory_allocated",
                                              "max_memory_reserved")},
    }

    def in_loader_thread(stat: str, answer: Callable) -> Callable:
        real = getattr(torch.cuda, stat)
        return lambda *args, **kwargs: (answer if threading.get_ident() == loader_thread else real)(*args, **kwargs)

    with simulated(planned.machine_of(profile)):
        with mock.patch.multiple(torch.cuda, **{stat: in_loader_thread(stat, answer)
                                                for stat, answer in answers.items()}):
            yield


@contextlib.contextmanager
def _zero3_enabled():
    """DeepSpeed ZeRO-3 as transformers sees it (``is_deepspeed_zero3_enabled()``), as accelerate sets it up."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        yield config
    finally:
        unset_hf_deepspeed_config()


def launcher_env(rank: int, world_size: int) -> dict:
    """What torchrun sets in rank ``rank`` of ``world_size`` on one node."""
    return {"WORLD_SIZE": world_size, "RANK": rank, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world_size,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}


def _preload_outside_the_simulation() -> None:
    """Import what loaders import (peft, which imports bitsandbytes) before ``torch.cuda`` is made to report the
    runner's GPUs: bitsandbytes picks its CUDA backend at import when CUDA looks available, and that fails on a
    machine without it. Where GPUs are visible the report is the machine's own, and nothing is imported early (an
    import that initialises CUDA here would stop the isolated checks from forking)."""
    from pytest_llmload.system import gpus

    if gpus.visible_gpu_count() == 0:
        for module in ("peft", "bitsandbytes"):
            with contextlib.suppress(ImportError):
                __import__(module)


def run_loader(loader: Callable, request: LoadRequest, profile: RunnerProfile, *, env: Optional[dict] = None,
               zero3: bool = False, stand_in: Optional[Callable[[dict], Any]] = None,
               after: Optional[list] = None) -> Call:
    """Run ``loader(request)`` as on the runner (:func:`_cuda_as_on`), stopped at ``from_pretrained`` (or, with
    ``stand_in``, given that model and run to its end, what it does after loading recorded in ``after``): the
    loader's call that decides, which is the first one the runner accepts, else the one it refused that the loader
    let through. The loader's own error propagates as :class:`~pytest_llmload.loader.seam.LoaderError`."""
    from pytest_llmload.loader.seam import LoaderError

    _preload_outside_the_simulation()
    calls: list[Call] = []
    context = _zero3_enabled() if zero3 else contextlib.nullcontext()
    recorded = _after_loading_recorded(after, getattr(stand_in, "dispatched", None)) if after is not None \
        else contextlib.nullcontext()
    environment = mock.patch.dict(os.environ, {key: str(value) for key, value in (env or {}).items()})
    with environment, context, _cuda_as_on(profile), _from_pretrained_intercepted(calls, stand_in), \
            _placed_by_accelerate(calls, stand_in), recorded:
        try:
            loader(request)
        except _Intercepted:
            pass
        except planned.PlacementRefused as refused:
            raise PredictedFailure("OOM", f"on {profile.name}, from_pretrained would refuse the placement: "
                                   f"{type(refused.refusal).__name__}: {refused.refusal}") from None
        except Exception as exc:
            original = exc.original if isinstance(exc, LoaderError) else exc
            let_through = next((call for call in calls if call.refusal is not None and type(original) is ValueError
                                and str(original) == call.refusal), None)
            if let_through is not None:
                return let_through
            if isinstance(exc, LoaderError):
                raise
            raise LoaderError(exc, getattr(loader, "__qualname__", repr(loader)), request) from exc
    accepted = [call for call in calls if call.refusal is None]
    return (accepted or calls or [Call(None)])[0]


def _capacity(profile: RunnerProfile, device: str) -> Optional[int]:
    if device == "disk":
        return profile.disk
    if device == "cpu":
        return profile.host_memory
    return profile.device_memory


def _device_name(where: str) -> str:
    return f"cuda:{where}" if where.isdigit() else where


def _devices(model: Any, device_map: dict, profile: RunnerProfile, *, dtype: Any, quantizer: Any = None,
             step: Any = None) -> tuple[DevicePrediction, ...]:
    """Per device of ``device_map``: its modules, their bytes as the planner counts them, and the peak there (the
    weights, and with ``step`` its share of a training step's other memory) against the device's capacity."""
    shares = planner.shares(model, device_map, dtype=dtype, hf_quantizer=quantizer)
    total_weights = sum(share.bytes for share in shares.values()) or 1
    devices = []
    for where, share in shares.items():
        extra = 0 if step is None else int((step.total - step["weights"]) * share.bytes / total_weights)
        devices.append(DevicePrediction(_device_name(str(where)), len(share.modules), share.bytes,
                                        share.bytes + extra, _capacity(profile, str(where))))
    return tuple(devices)


class _StandIn:
    """What ``from_pretrained`` returns on the runner, without weights: the model built empty (its quantizer's own
    layers where it asks for one), with the ``hf_device_map`` from_pretrained would leave on it
    (:func:`~pytest_llmload.loader.transformers_compat.leaves_hf_device_map`). Keeps the planned map, the devices'
    shares and whether a quantized model was asked for."""

    def __init__(self, config: dict, request: LoadRequest, profile: RunnerProfile) -> None:
        self.config, self.request, self.profile = config, request, profile
        self.placement: dict = {}
        self.devices: tuple[DevicePrediction, ...] = ()
        self.quantized = False
        self.dispatch: Optional[Call] = None  # the loader's own placement of the model after loading, where it made one

    def dispatched(self, call: Call) -> None:
        """The loader placed the model after loading (``dispatch_model``, ``load_checkpoint_and_dispatch``: ``call``):
        where it goes now, its bytes counted on the model it placed, as the planner counts them."""
        self.dispatch, self.placement = call, dict(call.kwargs["device_map"])
        self.devices = _devices(call.model, self.placement, self.profile, dtype=call.kwargs["dtype"],
                                quantizer=getattr(call.model, "hf_quantizer", None))

    def __call__(self, kwargs: dict) -> Any:
        from pytest_llmload.loader.transformers_compat import leaves_hf_device_map

        model, device_map, quantizer, dtype = planned.place(self.config, kwargs, self.request, self.profile)
        self.placement.update(device_map)
        self.devices = _devices(model, device_map, self.profile, dtype=dtype, quantizer=quantizer)
        # the planned model is built once per architecture, and the loader may change what it gets: a copy of it
        # (quantized layers, whose parameters do not copy, are built again, each with a quantizer of its own)
        fresh = copy.deepcopy(model) if quantizer is None else architectures.empty_model(
            self.config, dtype, quantizer=planned.quantizer_of(kwargs), device_map=kwargs.get("device_map"))
        if kwargs.get("device_map") is not None and leaves_hf_device_map(device_map):
            fresh.hf_device_map = dict(device_map)
        if quantizer is not None:
            self.quantized = True
            fresh.hf_quantizer, fresh.is_loaded_in_4bit = quantizer, self.request.quantization == "4bit"
        return fresh


def predict_placement(scenario: str, loader: Callable, request: LoadRequest, profile: RunnerProfile,
                      config: dict, model_name: str, *, env: Optional[dict] = None, zero3: bool = False,
                      simulated: tuple[str, ...] = (), training: bool = False, to_the_end: bool = False) -> Prediction:
    """One rank's load on ``profile``: where each module goes, bytes and peaks per device. ``to_the_end``: the loader
    gets the :class:`_StandIn` and runs on, so that what it does with the model it got counts (a loader that checks
    the placement after loading and refuses it, naming the budget, raises here)."""
    from pytest_llmload.fixes.training_memory import estimate_training_memory, model_tensors

    start = time.perf_counter()
    ran_on = {"stand_in": _StandIn(config, request, profile), "after": []} if to_the_end else {}
    call = run_loader(loader, request, profile, env=env, zero3=zero3, **ran_on)
    notes = (f"torch.cuda reports {profile.devices} GPU(s) of {format_bytes(profile.device_memory)}"
             if profile.devices else "torch.cuda reports no GPU",) + simulated + (
        ("the loader ran to its end on an empty stand-in placed as planned",) if to_the_end else ())
    if call.kwargs is None:
        return Prediction(scenario, profile.name, model_name, {}, (), {}, notes, None,
                          "the loader never called from_pretrained: nothing to predict", time.perf_counter() - start)
    kwargs = call.kwargs
    dispatch = getattr(ran_on.get("stand_in"), "dispatch", None)
    if dispatch is not None:  # the loader placed the model itself after loading: that placement is the row's
        call = dispatch._replace(kwargs={**kwargs, **dispatch.kwargs})
        kwargs = call.kwargs
    asked = {key: kwargs.get(key) for key in ("device_map", "max_memory", "quantization_config", "offload_state_dict")
             if kwargs.get(key)}
    zero3 = None if call.refusal is None else (
        f"from_pretrained(device_map={kwargs.get('device_map')!r}) at {call.at} under ZeRO-3: transformers raises "
        f"{call.refusal!r}, and the loader lets it through")
    try:
        if call.model is not None:  # accelerate placed the loader's own model: its map, on that model
            model, device_map, dtype = call.model, kwargs["device_map"], kwargs["dtype"]
            quantizer = getattr(model, "hf_quantizer", None)
        else:
            model, device_map, quantizer, dtype = planned.place(config, kwargs, request, profile)
    except planned.PlacementRefused as refused:
        if zero3 is not None:  # from_pretrained's first check refuses it before any placement is tried
            return Prediction(scenario, profile.name, model_name, {}, (), asked, notes, "zero3-device-map", zero3,
                              time.perf_counter() - start, call.at)
        raise PredictedFailure("OOM", f"on {profile.name}, from_pretrained would refuse the placement: "
                               f"{type(refused.refusal).__name__}: {refused.refusal}") from None
    step = estimate_training_memory(request, tensors=model_tensors(model)) if training else None
    moved = _moved_whole_to(request, profile, kwargs, device_map)
    # (a model moved whole to its GPU trains there: the host holds its weights only while it loads)
    devices = _devices(model, device_map, profile, dtype=dtype, quantizer=quantizer,
                       step=None if moved else step)
    prediction = Prediction(scenario, profile.name, model_name, device_map, devices, asked, notes,
                            seconds=time.perf_counter() - start, at=call.at)
    if zero3 is not None:  # (the map it asked for, which from_pretrained refuses before placing anything)
        return prediction._replace(failure="zero3-device-map", reason=zero3)
    oom = _over_capacity(prediction, "a training step" if training and not moved else "the load")
    if oom.failure is not None:
        return oom
    if moved is not None:
        gpu = _devices(model, {"": moved}, profile, dtype=dtype, quantizer=quantizer, step=step)
        return _over_capacity(prediction._replace(
            placement={"": moved}, devices=gpu, simulated=prediction.simulated + (
                f"no device_map: from_pretrained loads the model whole on the host, then Trainer (its "
                f"_move_model_to_device), DDP or the training script moves it whole to this rank's {moved}",),
            reason=f"no device_map: loaded whole on the host, then moved whole to {moved} to be trained; nothing is "
                   "offloaded"), f"the model moved whole to {moved} (from_pretrained at {call.at}, no device_map)"
                                  + (", with a training step," if step is not None else ""))
    if kwargs.get("device_map") is None:
        return prediction._replace(reason="no device_map: from_pretrained loads the model whole on the host (cpu), "
                                   "where the script, DDP or DeepSpeed moves it whole; nothing is offloaded")
    where = ", ".join(d.device for d in devices) if len(devices) <= 2 else f"{len(devices)} devices"
    return prediction._replace(reason=f"{len(device_map)} map entr{'y' if len(device_map) == 1 else 'ies'} over "
                               f"{where}")


def _moved_whole_to(request: LoadRequest, profile: RunnerProfile, kwargs: dict, device_map: dict) -> Optional[str]:
    """The GPU a train load's model goes to whole, where from_pretrained leaves it whole on the host (no
    ``device_map``) on a runner with GPUs: the rank's own (``request.device``), where Trainer's
    ``_move_model_to_device``, DDP (``DistributedDataParallel(model.to(rank))``) or the training script moves it
    before the first step. ``None`` elsewhere: an inference load (what the script does after loading is
    ``predict_moved_after_loading``'s to see), a map of the loader's own, a CPU runner, or DeepSpeed, whose engine
    places the model by its ZeRO stage (:func:`_deepspeed_states`)."""
    if (request.purpose != "train" or request.deepspeed or not profile.devices or kwargs.get("device_map") is not None
            or device_map != {"": "cpu"}):
        return None
    return request.device


def _over_capacity(prediction: Prediction, what: str) -> Prediction:
    """``prediction`` as an OOM where ``what`` (the load, a training step) needs more on a device than it has."""
    over = [d for d in prediction.devices if d.capacity is not None and d.peak > d.capacity]
    if not over:
        return prediction
    return prediction._replace(failure="OOM", reason=f"{what} needs {format_bytes(over[0].peak)} on {over[0].device}, "
                               f"which has {format_bytes(over[0].capacity)}")


def model_dir(config: dict, workdir: Path) -> Path:
    """The directory the loader is pointed at (written once per workdir): config, tokenizer, the weights' header."""
    dest = Path(workdir) / "model"
    if not (dest / "config.json").is_file():
        import torch

        architectures.write_checkpoint_dir(config, dest, planned.empty(config, getattr(torch, DEFAULT_DTYPE)))
        # as a checkpoint ships it (loaders read it: GenerationConfig.from_pretrained(path))
        ids = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config}
        (dest / "generation_config.json").write_text(json.dumps(ids), encoding="utf-8")
    return dest


def adapter_dir(config: dict, workdir: Path) -> Path:
    """A trained LoRA adapter as peft saves one, for the base in :func:`model_dir` (``base_model_name_or_path``
    names it, as loaders that serve an adapter read it), on the first linear layer of its first block; without its
    weights, which the stand-in's peft does not read."""
    dest = Path(workdir) / "adapter"
    if not (dest / "adapter_config.json").is_file():
        import torch

        model = planned.empty(config, getattr(torch, DEFAULT_DTYPE))
        target = next(name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                      if isinstance(module, torch.nn.Linear) and ".0." in name)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "target_modules": [target],
            "base_model_name_or_path": str(model_dir(config, workdir))}), encoding="utf-8")
    return dest


# --- the scenarios: one row each, naming the known failure it predicts ------------------------------------------


class Scenario(NamedTuple):
    """A prediction row: ``function(loader, runner, config, model_name, workdir, checkpoint)`` returns the
    :class:`Prediction` or raises :class:`PredictedFailure`; ``failure`` the catalog entry it guards against."""

    function: Callable[..., Prediction]
    failure: Any
    needs_gpus: int = 0
    purpose: str = "inference"  # what the scenario asks the loader for; a loader declared for the other one skips it

    @property
    def name(self) -> str:
        return self.function.__name__

    def inapplicable_reason(self, loader: Any) -> Optional[str]:
        """Why this scenario does not apply to ``loader`` (a :class:`~pytest_llmload.loader.seam.LoaderUnderTest`),
        as :meth:`~pytest_llmload.checks.base.Check.inapplicable_reason` decides it for a check: the loader is
        declared for another purpose, the repo declared every check of the failure not applicable, or it declared
        that it never trains the way the scenario runs (only under DeepSpeed: no DDP launch). ``None``: it applies.
        (Trainer's declarations are the Trainer check's own, which the Trainer scenario runs.)"""
        from pytest_llmload.checks.base import DECLARED_NOT_APPLICABLE
        from pytest_llmload.failures import REGISTRY

        purposes = getattr(loader, "purposes", None)
        if purposes is not None and self.purpose not in purposes:
            return (f"{self.name}: loader {loader.name} is declared for {' and '.join(purposes)} only; this "
                    f"scenario runs {a(self.purpose)} load")
        declared = getattr(loader, "not_applicable_reason", lambda name: None)
        reasons = [declared(check.name) for check in REGISTRY if check.failure.id == self.failure.id
                   and not check.name.endswith("_cuda")]
        if reasons and all(reasons):
            return (f"{DECLARED_NOT_APPLICABLE}{self.name}: {reasons[0]} (declared for loader {loader.name}, for "
                    f"every check of {self.failure.id})")
        if self.name == "predict_launcher_ddp" and _declares(loader, "trains_under_deepspeed"):
            return (f"{DECLARED_NOT_APPLICABLE}{self.name}: loader {loader.name} is declared to train only under "
                    "DeepSpeed (llmload_trains_under_deepspeed): a DDP launch is not how it trains")
        return None

    @property
    def summary(self) -> str:
        return " ".join((self.function.__doc__ or "").strip().split("\n\n")[0].split())


def _declares(loader: Any, keyword: str) -> bool:
    """Whether the run declares ``keyword`` (a :data:`~pytest_llmload.config.vocabulary.TRAINING_DECLARATIONS`
    one) for the loader: the configuration's, else the loader function's attribute, as a check reads it."""
    from pytest_llmload.config.stash_keys import configured

    return configured.get().declares(keyword, loader)


# name -> (function, the id of the failure it predicts, GPUs a runner needs for it, purpose), in the order the
# functions are defined below: the rows'.
_SCENARIOS: dict[str, tuple[Callable[..., Prediction], str, int, str]] = {}


def _scenario(predicts: str, needs_gpus: int = 0, purpose: str = "inference") -> Callable:
    """Declares the function below a scenario that predicts the known failure whose id is ``predicts`` (a runner
    with fewer than ``needs_gpus`` GPUs skips it; a loader declared for another ``purpose`` skips it)."""

    def declare(function: Callable[..., Prediction]) -> Callable[..., Prediction]:
        _SCENARIOS[function.__name__] = (function, predicts, needs_gpus, purpose)
        return function

    return declare


def scenarios() -> tuple[Scenario, ...]:
    """Every scenario, in the order this module defines them, with the catalog entry of the failure it predicts."""
    from pytest_llmload.failures import BY_ID

    unknown = {name: failure_id for name, (_, failure_id, *_) in _SCENARIOS.items() if failure_id not in BY_ID}
    if unknown:
        raise LookupError(f"{__name__}: scenarios predict failures the catalog lacks: {unknown} (its ids: "
                          f"{sorted(BY_ID)})")
    return tuple(Scenario(function, BY_ID[failure_id], needs_gpus, purpose)
                 for function, failure_id, needs_gpus, purpose in _SCENARIOS.values())


def _request(model_path: Path, profile: RunnerProfile, loader: Any, rank: int = 0, **fields) -> LoadRequest:
    """What the scenario asks rank ``rank`` of the runner for, in a dtype the loader declares it loads
    (``llmload_dtypes``), as a check asks it."""
    device = f"cuda:{rank}" if profile.devices else "cpu"
    dtype = fields.pop("dtype", DEFAULT_DTYPE)
    declared = getattr(loader, "dtypes", None)
    return LoadRequest(model_path, dtype=declared[0] if declared and dtype not in declared else dtype, device=device,
                       gpu_count=profile.devices, **fields)


def _predicts(prediction: Prediction, failure: str, reason: str) -> None:
    """Raise the prediction that the runner would hit ``failure``, for ``reason``."""
    _raise_if(prediction._replace(failure=failure, reason=reason))


def _raise_if(prediction: Prediction) -> Prediction:
    if prediction.failure is not None:
        raise PredictedFailure(prediction.failure, prediction.table(), prediction.record())
    return prediction


@_scenario("offload-hang")
def predict_inference_load(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts offload-hang (000) or OOM: an inference load under the runner's memory, and where it offloads."""
    from importlib import metadata

    from packaging.version import Version

    request = _request(model_dir(config, workdir), profile, loader, purpose="inference",
                       max_memory=profile.max_memory, offload_folder=Path(workdir) / "offload")
    prediction = predict_placement("predict_inference_load", loader, request, profile, config, model_name)
    if prediction.failure is None and prediction.placement == {"": "cpu"}:  # whole on the host: a served model
        # may be placed after loading (accelerate's dispatch_model), which the row then predicts as from_pretrained's
        placed_after = predict_placement("predict_inference_load", loader, request, profile, config, model_name,
                                         to_the_end=True)
        prediction = placed_after if placed_after.placement != prediction.placement else prediction
    honours = Version(metadata.version("transformers")).release < (4, 57)
    if (prediction.failure is None and offloaded(prediction.placement) and honours
            and prediction.asked.get("offload_state_dict", False)):
        prediction = prediction._replace(failure="offload-hang", reason=(
            f"offload_state_dict=True at {prediction.at} with a placement that offloads, on a transformers that "
            "honours it: every cpu-bound weight round-trips through the system temp dir, silently"))
    return _raise_if(prediction)


def _refused(scenario: str, profile: RunnerProfile, model_name: str, exc: Any, request: LoadRequest, *,
             simulated: tuple = ()) -> Prediction:
    """The row of a loader that refuses the request before loading, naming its budget (write-up 002's fix): no
    failure. ``exc`` a :class:`~pytest_llmload.loader.seam.LoaderError` whose original is such a refusal; any
    other error of the loader is raised again."""
    from pytest_llmload.checks.ground_truth import refusal_problem

    if refusal_problem(exc.original) is not None:
        raise exc
    return Prediction(scenario, profile.name, model_name, {}, (), {}, simulated, None,
                      f"the loader refuses the {request.purpose} load, naming the budget (write-up 002's fix): "
                      f"{type(exc.original).__name__}")


@_scenario("meta-backward", purpose="train")
def predict_train_load(loader, profile, config, model_name, workdir, checkpoint=None, *,
                       max_memory: Optional[dict] = None) -> Prediction:
    """Predicts meta-backward (002) or OOM: a LoRA train load with gradient checkpointing under the runner's memory.

    ``max_memory``: the budget the run gives the loader (default: the runner's capacities)."""
    from pytest_llmload.loader.seam import LoaderError

    request = _request(model_dir(config, workdir), profile, loader, purpose="train", lora=True,
                       gradient_checkpointing=True, max_memory=profile.max_memory if max_memory is None else max_memory,
                       offload_folder=Path(workdir) / "offload")
    try:
        prediction = predict_placement("predict_train_load", loader, request, profile, config, model_name,
                                       training=True)
        if offloaded(prediction.placement) and prediction.failure is None:  # run on: does it check and refuse?
            prediction = predict_placement("predict_train_load", loader, request, profile, config, model_name,
                                           training=True, to_the_end=True)
    except LoaderError as exc:
        return _refused("predict_train_load", profile, model_name, exc, request)
    offloads = offloaded(prediction.placement)
    if offloads and prediction.failure is None:
        prediction = prediction._replace(failure="meta-backward", reason=(
            f"the model that will be trained is offloaded by from_pretrained(device_map="
            f"{prediction.asked.get('device_map')!r}) at {prediction.at}: {len(offloads)} module(s) on cpu/disk, "
            f"e.g. {offloads[:3]}; backward through them raises 'expected device meta' or trains nothing"))
    return _raise_if(prediction)


@_scenario("dp-dtype", needs_gpus=2, purpose="train")
def predict_trainer(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts dp-dtype (003): Trainer's n_gpu and wrap decision for the loader's 4-bit LoRA model on the runner's GPUs."""
    from pytest_llmload.failures import dp_dtype

    start = time.perf_counter()
    note = (f"Trainer's own decision for n_gpu={profile.devices}, made on the tiny checkpoint (it depends on the "
            "GPU count and the model's placement and quantization, not its size)")
    try:
        dp_dtype.CHECK(loader, checkpoint, Path(workdir) / "trainer", simulated_n_gpu=profile.devices)
    except AssertionError as exc:
        failure = dp_dtype.FAILURE.id
        reason = _trainer_on_this_stack(str(exc).splitlines()[0], profile.devices)
        raise PredictedFailure(failure, f"on {profile.name} with {model_name}, would hit {failure}: {reason}\n"
                               f"  simulated: {note}", bare_record("predict_trainer", profile.name, model_name,
                                                                   failure, reason)) from None
    return Prediction("predict_trainer", profile.name, model_name, {}, (), {}, (note,), None,
                      f"Trainer keeps n_gpu=1 for the loader's model on {profile.devices} GPUs",
                      time.perf_counter() - start)


def _trainer_on_this_stack(observed: str, n_gpu: int) -> str:
    """What Trainer does on the installed transformers with the loader's 4-bit model on ``n_gpu`` GPUs, from what the
    Trainer check observed of it (``observed``, its finding's line). transformers 4.x's ``_wrap_model`` wraps any
    model but an 8-bit one in ``nn.DataParallel`` where ``n_gpu > 1``, and the dtype mismatch of write-up 003 follows;
    5.x skips ``nn.DataParallel`` for 4-bit and 8-bit models but still counts every GPU (``TrainingArguments.n_gpu``
    is ``torch.cuda.device_count()`` outside a launcher, and only a map over several GPUs makes Trainer set it to 1)."""
    from importlib import metadata

    version = metadata.version("transformers")
    seen = observed.split("): ", 1)[-1] if observed.startswith("seed ") else observed  # (the check's own heading)
    if "Trainer wrapped the model in nn.DataParallel" in seen:
        return (f"on transformers {version}, Trainer wraps the loader's 4-bit model in nn.DataParallel (n_gpu={n_gpu}: "
                f"its _wrap_model skips only 8-bit models), and on the GPUs the replicas' first step mixes dtypes at "
                f"the lm_head. Seen on the tiny checkpoint: {seen}")
    return (f"on transformers {version}, Trainer does not wrap a 4-bit model in nn.DataParallel, but counts "
            f"n_gpu={n_gpu}: each step takes {n_gpu}x the per-device batch, its loss is scaled by n_gpu, and the steps "
            f"per epoch divide by {n_gpu}. Seen on the tiny checkpoint: {seen}")


def rank_budget(profile: RunnerProfile, rank: int, world: int) -> dict:
    """What one rank of a launcher job on ``profile`` may use, in ``max_memory``'s format: its own GPU (the one
    ``LOCAL_RANK`` names) and its share of the host's memory (every rank loads on the same host)."""
    return {rank: profile.device_memory, "cpu": profile.host_memory // world}


def _launched(scenario: str, profile, config, model_name, workdir, loader, *, deepspeed: bool, zero3: bool = False):
    """Every rank of a one-node launcher job, each asked twice as runs ask it: with no ``max_memory`` (write-up
    004's run) and with the rank's own budget (:func:`rank_budget`, for loaders that place by the budget they are
    given). The first (rank, budget) the runner would refuse, else rank 0's first."""
    from pytest_llmload.loader.seam import LoaderError

    world = max(profile.devices, 1)
    first = None
    for rank in range(world):
        for budget in (None, rank_budget(profile, rank, world)):
            request = _request(model_dir(config, workdir), profile, loader, rank=rank, purpose="train",
                               deepspeed=deepspeed, zero_stage=3 if zero3 else (2 if deepspeed else None),
                               max_memory=budget)
            given = "no max_memory" if budget is None else "its budget max_memory={" + ", ".join(
                f"{key!r}: {format_bytes(value)}" for key, value in budget.items()) + "}"
            simulated = (f"rank {rank} of {world} under torchrun's environment, {given}"
                         + (", DeepSpeed ZeRO-3 enabled" if zero3 else ""),)
            try:
                prediction = predict_placement(scenario, loader, request, profile, config, model_name,
                                               env=launcher_env(rank, world), zero3=zero3, simulated=simulated)
            except LoaderError as exc:
                prediction = _refused(scenario, profile, model_name, exc, request, simulated=simulated)
            if (deepspeed and prediction.placement == {"": "cpu"} and "device_map" not in prediction.asked
                    and prediction.failure is None):
                prediction = _deepspeed_states(prediction, profile, config, request, zero3=zero3, rank=rank)
            first = first or prediction
            if prediction.failure is None and not zero3 and planner.spreads(prediction.placement):
                prediction = prediction._replace(failure="distributed-device-map", reason=(
                    f"from_pretrained(device_map={prediction.asked.get('device_map')!r}) at {prediction.at}: rank "
                    f"{rank}'s map ({given}) spans {sorted(set(prediction.placement.values()))}: accelerate refuses "
                    "it in any distributed mode ('You can't train a model that has been loaded with "
                    "`device_map='auto'` in any distributed mode')"))
            if prediction.failure is not None:
                return _raise_if(prediction)
    return first


def _deepspeed_states(prediction: Prediction, profile, config: dict, request: LoadRequest, *, zero3: bool,
                      rank: int) -> Prediction:
    """No device_map under DeepSpeed: the engine places the model. Its memory per GPU from DeepSpeed's own estimator
    of model states (a full fine-tune, no offload), against the runner's GPU."""
    if not profile.devices:
        return prediction
    model = planned.first_built_for(config)
    total = sum(p.numel() for p in model.parameters())
    if zero3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        no_split = set(getattr(model, "_no_split_modules", None) or [])
        largest = max((sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in no_split),
                      default=total)
        _, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=profile.devices,
                                                          cpu_offload=False, cpu_offload_params=False)
        how = "estimate_zero3_model_states_mem_needs"
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, gpu = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=profile.devices, cpu_offload=False)
        how = "estimate_zero2_model_states_mem_needs"
    # The weights each GPU holds, in the bytes the planner counts for the loaded dtype (from_pretrained's map of the
    # whole model on the host): ZeRO-0/1/2 keep a full copy on every GPU, ZeRO-3 a 1/n partition of them.
    weights = sum(device.weights for device in prediction.devices) // (profile.devices if zero3 else 1)
    device = DevicePrediction(f"cuda:{rank}", 1, weights, max(int(gpu), weights), profile.device_memory)
    prediction = prediction._replace(devices=(device,), placement={"": f"cuda:{rank}"}, simulated=(
        prediction.simulated + (f"DeepSpeed places the model (no device_map): its model states per GPU by "
                                f"DeepSpeed's own {how} ({total / 1e9:.1f} B parameters, full fine-tune, no offload)",)),
        reason=f"DeepSpeed places the model: {format_bytes(gpu)} of model states per GPU ({how})")
    if weights > profile.device_memory:  # whatever is trained (LoRA too): the weights alone do not fit
        share = f"a 1/{profile.devices} partition" if zero3 else "a full copy"
        return prediction._replace(failure="OOM", reason=(
            f"DeepSpeed ZeRO-{3 if zero3 else 2} puts {share} of the weights on each GPU: {format_bytes(weights)} "
            f"on cuda:{rank}, which has {format_bytes(profile.device_memory)}"))
    if gpu > profile.device_memory:
        return prediction._replace(failure="OOM", reason=f"DeepSpeed's model states need {format_bytes(gpu)} on "
                                   f"each GPU, which has {format_bytes(profile.device_memory)}")
    return prediction


@_scenario("distributed-device-map", needs_gpus=2, purpose="train")
def predict_launcher_ddp(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts distributed-device-map (004): a train load on every rank of a torchrun job over the runner's GPUs."""
    return _launched("predict_launcher_ddp", profile, config, model_name, workdir, loader, deepspeed=False)


@_scenario("distributed-device-map", needs_gpus=2, purpose="train")
def predict_launcher_deepspeed(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts distributed-device-map (004): a train load on every rank of a DeepSpeed (ZeRO-2) job, write-up 004's."""
    return _launched("predict_launcher_deepspeed", profile, config, model_name, workdir, loader, deepspeed=True)


@_scenario("zero3-device-map", needs_gpus=1, purpose="train")
def predict_zero3(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts zero3-device-map: a train load on every rank under DeepSpeed ZeRO-3 passes no device_map."""
    return _launched("predict_zero3", profile, config, model_name, workdir, loader, deepspeed=True, zero3=True)


class AfterLoading(NamedTuple):
    """An inference load run to its end on the stand-in: the row so far, what the loader did after loading
    (:class:`Event`), what from_pretrained's map offloads (:func:`offloaded`), whether it was asked for a quantized
    model, and whether the loader refused the budget instead (nothing loaded)."""

    prediction: Prediction
    events: list
    offloads: list
    quantized: bool
    refused: bool = False

    def offloaded_before(self, event: Event) -> str:
        """The start of a finding about ``event``, a call the loader made on what the load offloaded."""
        return (f"from_pretrained(device_map={self.prediction.asked.get('device_map')!r}) at {self.prediction.at} "
                f"offloads {len(event.on_offloaded)} module(s)")

    def reason(self, nothing: str) -> str:
        """The row's reason: whether the load offloads, and what the loader did after it (``nothing``: if nothing)."""
        return f"{'offloads' if self.offloads else 'no offload'}; after loading: {_done(self.events) or nothing}"


def _after_loading(scenario: str, loader, profile, config, model_name, workdir, **fields) -> AfterLoading:
    """An inference load run to its end on the model from_pretrained would return, without weights
    (:class:`_StandIn`), what it does after loading recorded (:func:`_after_loading_recorded`)."""
    from pytest_llmload.loader.seam import LoaderError

    start = time.perf_counter()
    request = _request(model_dir(config, workdir), profile, loader, purpose="inference",
                       max_memory=profile.max_memory, offload_folder=Path(workdir) / "offload", **fields)
    stand_in = _StandIn(config, request, profile)
    after: list = []
    try:
        call = run_loader(loader, request, profile, stand_in=stand_in, after=after)
    except LoaderError as exc:
        refused = _refused(scenario, profile, model_name, exc, request)
        return AfterLoading(refused._replace(placement=stand_in.placement, devices=stand_in.devices), [], [],
                            stand_in.quantized, refused=True)
    notes = ("the loader ran to its end on an empty stand-in placed as planned, peft's own objects on its empty "
             "weights; its moves, casts, dispatches and test generations recorded, not done (stopped where the "
             "runner would raise)",)
    asked = {} if call.kwargs is None else {
        k: call.kwargs.get(k) for k in ("device_map", "max_memory", "quantization_config", "load_in_4bit",
                                        "load_in_8bit") if call.kwargs.get(k)}
    prediction = Prediction(scenario, profile.name, model_name, stand_in.placement, stand_in.devices, asked, notes,
                            seconds=time.perf_counter() - start, at=call.at)
    _raise_if(_over_capacity(prediction, "the load"))  # (the runner stops there: nothing after it runs)
    return AfterLoading(prediction, after, offloaded(stand_in.placement), stand_in.quantized)


def _done(events: list) -> str:
    """What the loader did after loading, in a few words: ``.to('cuda:0') at x.py:12, ...``."""
    def one(event: Event) -> str:
        what = f".{event.name}({event.device!r})" if event.name in _MOVES and event.device else (
            f".{event.name}()" if event.name in _MOVES or event.name in _CASTS else event.name)
        return f"{what} at {event.at}" if event.at else what

    return ", ".join(dict.fromkeys(one(event) for event in events if event.name != "generate"))


@_scenario("move-offloaded")
def predict_moved_after_loading(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts move-offloaded (or OOM): the loader moves a model the runner's placement offloads (or a whole one to
    a GPU that cannot hold it)."""
    loaded = _after_loading("predict_moved_after_loading", loader, profile, config, model_name, workdir)
    prediction = loaded.prediction
    if loaded.refused:  # the loader refused the budget: no model to move
        return prediction
    moves = [event for event in loaded.events if event.name in _MOVES]
    offloaded_moves = [event for event in moves if event.on_offloaded]
    if offloaded_moves:
        move = offloaded_moves[0]
        _predicts(prediction._replace(at=move.at), "move-offloaded", (
            f"{loaded.offloaded_before(move)} (e.g. {list(move.on_offloaded[:2])}) and the loader then calls "
            f".{move.name}() on the model at {move.at}: accelerate refuses a move while parameters are on meta"))
    weights = sum(device.weights for device in prediction.devices)
    to_gpu = [event for event in moves if (event.device or "").startswith("cuda")]
    if to_gpu and not loaded.offloads and profile.devices and weights > profile.device_memory:
        move = to_gpu[0]
        _predicts(prediction._replace(at=move.at), "OOM", (
            f"the loader moves the whole model ({format_bytes(weights)} of weights) to {move.device} at {move.at}, "
            f"which has {format_bytes(profile.device_memory)}"))
    return prediction._replace(reason=loaded.reason("no move or cast"))


@_scenario("adapter-on-offloaded")
def predict_adapter_on_offloaded(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts adapter-on-offloaded: the loader puts a trained adapter on a base the runner's placement offloads."""
    loaded = _after_loading("predict_adapter_on_offloaded", loader, profile, config, model_name, workdir,
                            adapter_path=adapter_dir(config, workdir))
    prediction = loaded.prediction
    if loaded.refused:  # the loader refused the budget: no adapter met an offloaded base
        return prediction
    adapters = [event for event in loaded.events if event.name in ("PeftModel.from_pretrained", "load_adapter")]
    on_offloaded = [event for event in adapters if event.on_offloaded]
    if on_offloaded:
        adapter = on_offloaded[0]
        _predicts(prediction._replace(at=adapter.at), "adapter-on-offloaded", (
            f"{loaded.offloaded_before(adapter)} and the loader then calls {adapter.name} at {adapter.at}: peft "
            "re-dispatches the base without its budget, and the adapter meets weights on meta"))
    return prediction._replace(reason=loaded.reason("no adapter loaded"))


@_scenario("quantized-cast")
def predict_quantized_cast(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts quantized-cast: the loader casts a 4-bit model after loading (transformers refuses any dtype cast)."""
    loaded = _after_loading("predict_quantized_cast", loader, profile, config, model_name, workdir,
                            quantization="4bit", dtype="float16")
    prediction = loaded.prediction
    if loaded.refused:
        return prediction
    casts = [event for event in loaded.events if event.dtype is not None]
    if casts and loaded.quantized:
        cast = casts[0]
        _predicts(prediction._replace(at=cast.at), "quantized-cast", (
            f"the loader asks for a 4-bit model at {prediction.at}, then calls .{cast.name}() with a dtype on it at "
            f"{cast.at}: transformers refuses any dtype cast of a bitsandbytes model"))
    return prediction._replace(reason=f"{'4-bit' if loaded.quantized else 'not quantized (the request was ignored)'}"
                               f"; casts after loading: {', '.join(f'.{e.name}() at {e.at}' for e in casts) or 'none'}")
