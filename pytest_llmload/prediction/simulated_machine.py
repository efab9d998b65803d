"""The runner a prediction runs the loader on, simulated in this process: ``torch.cuda`` answering as the runner's
(:func:`cuda_as_on`), ZeRO-3 enabled, the launcher's environment, and :func:`run_loader`, which runs the loader there
with ``from_pretrained`` intercepted (:mod:`pytest_llmload.prediction.interception`); a stand-in model
(:class:`StandIn`) for the scenarios that go on after loading, and each device's share (:func:`device_shares`) against
the runner's capacity."""

from __future__ import annotations

import contextlib
import copy
import os
import threading
import types
from unittest import mock
from typing import Any, Callable, Optional

from pytest_llmload.placement import architectures, planned, planner
from pytest_llmload.placement.profiles import RunnerProfile
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.prediction.interception import (
    Call,
    Intercepted,
    after_loading_recorded,
    from_pretrained_intercepted,
    placed_by_accelerate,
)
from pytest_llmload.prediction.records import DevicePrediction, PredictedFailure, device_name
from pytest_llmload.system import tracebacks


# The compute capability of the shipped profiles' cards (NVIDIA's table); another card is answered as an Ampere
# (8.0: bfloat16 and flash attention, what loaders ask the capability about).
_CAPABILITY = {"RTX 4090": (8, 9), "A100": (8, 0), "H100": (9, 0), "H200": (9, 0)}


@contextlib.contextmanager
def cuda_as_on(profile: RunnerProfile):
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


# What a loader reaches a process group through: the frames past them are the loader's own.
_DISTRIBUTED_LIBRARIES = tracebacks.LOADING_LIBRARIES + ("deepspeed", "unittest", "pytest_llmload")


@contextlib.contextmanager
def no_rendezvous():
    """While the loader runs on the simulated runner: no real process group, no compiled op. A process group
    (``torch.distributed.init_process_group``, what accelerate's ``PartialState``, DeepSpeed's ``init_distributed`` and
    a loader's own call come to) waits for the launcher's other ranks, which a prediction never starts: under the
    launcher's environment (``MASTER_PORT=29500``) it waited for good, deaf to SIGTERM, after DeepSpeed's CPU backend
    had compiled its shared-memory op for minutes into the user's extensions cache. So the op is not built, and the
    process group is refused: the row is ``not exercised``, naming the loader's line (a prediction cannot judge a
    loader that starts the job's process group itself; the launcher checks do, on real ranks)."""
    import importlib.util
    import sys

    import pytest
    import torch.distributed as dist

    from pytest_llmload.checks.judgement import NOT_EXERCISED
    from pytest_llmload.runners.ranks import deepspeed_without_shm_op

    def refused(what: str):
        def refuse(*args, **kwargs):
            frame = sys._getframe(1)
            while frame is not None and tracebacks.is_library(tracebacks.module_of(frame), _DISTRIBUTED_LIBRARIES):
                frame = frame.f_back
            where = f" at {tracebacks.where(frame)}" if frame is not None else ""
            raise pytest.skip.Exception(
                f"{NOT_EXERCISED}the loader starts the job's process group itself ({what}{where}): a prediction runs "
                f"one rank of the runner in this process and starts no rendezvous (the other ranks never come) and "
                f"compiles no op; the launcher checks judge this loader on real ranks")
        return refuse

    with contextlib.ExitStack() as stack:
        stack.enter_context(deepspeed_without_shm_op())
        stack.enter_context(mock.patch.object(dist, "init_process_group",
                                              refused("torch.distributed.init_process_group")))
        if importlib.util.find_spec("deepspeed") is not None:  # (what compiles: 0.3 s to import, only where it can)
            import torch.utils.cpp_extension as cpp_extension

            stack.enter_context(mock.patch.object(cpp_extension, "load",
                                                  refused("an op compiled by torch.utils.cpp_extension.load")))
        yield


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
    """Run ``loader(request)`` as on the runner (:func:`cuda_as_on`), stopped at ``from_pretrained`` (or, with
    ``stand_in``, given that model and run to its end, what it does after loading recorded in ``after``): the
    loader's call that decides, which is the first one the runner accepts, else the one it refused that the loader
    let through. The loader's own error propagates as :class:`~pytest_llmload.loader.seam.LoaderError`."""
    from pytest_llmload.loader.seam import LoaderError

    _preload_outside_the_simulation()
    calls: list[Call] = []
    context = _zero3_enabled() if zero3 else contextlib.nullcontext()
    recorded = after_loading_recorded(after, getattr(stand_in, "dispatched", None)) if after is not None \
        else contextlib.nullcontext()
    environment = mock.patch.dict(os.environ, {key: str(value) for key, value in (env or {}).items()})
    with environment, context, no_rendezvous(), cuda_as_on(profile), from_pretrained_intercepted(calls, stand_in), \
            placed_by_accelerate(calls, stand_in), recorded:
        try:
            loader(request)
        except Intercepted:
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



def device_shares(model: Any, device_map: dict, profile: RunnerProfile, *, dtype: Any, quantizer: Any = None,
                  step: Any = None) -> tuple[DevicePrediction, ...]:
    """Per device of ``device_map``: its modules, their bytes as the planner counts them, and the peak there (the
    weights, and with ``step`` its share of a training step's other memory) against the device's capacity."""
    shares = planner.shares(model, device_map, dtype=dtype, hf_quantizer=quantizer)
    total_weights = sum(share.bytes for share in shares.values()) or 1
    devices = []
    for where, share in shares.items():
        extra = 0 if step is None else int((step.total - step["weights"]) * share.bytes / total_weights)
        devices.append(DevicePrediction(device_name(str(where)), len(share.modules), share.bytes,
                                        share.bytes + extra, _capacity(profile, str(where))))
    return tuple(devices)


class StandIn:
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
        self.devices = device_shares(call.model, self.placement, self.profile, dtype=call.kwargs["dtype"],
                                     quantizer=getattr(call.model, "hf_quantizer", None))

    def __call__(self, kwargs: dict) -> Any:
        from pytest_llmload.loader.transformers_compat import leaves_hf_device_map

        model, device_map, quantizer, dtype = planned.place(self.config, kwargs, self.request, self.profile)
        self.placement.update(device_map)
        self.devices = device_shares(model, device_map, self.profile, dtype=dtype, quantizer=quantizer)
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

