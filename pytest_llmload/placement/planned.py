"""The placement ``from_pretrained`` would give one loader call on a runner profile: the dtype and quantizer the call
asks for, the full-size model built empty for them, and the map transformers' own planner (:mod:`.planner`) makes.

Shared by the runner predictions (:mod:`pytest_llmload.prediction.predict`) and the checks that place a model as on
GPUs this machine does not have (dp-dtype's, :mod:`pytest_llmload.failures.dp_dtype`).
"""

from __future__ import annotations

import json
from typing import Any, Optional

from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.placement import architectures, planner
from pytest_llmload.placement.profiles import RunnerProfile
from pytest_llmload.placement.simulated_devices import Machine


class PlacementRefused(BaseException):
    """from_pretrained's own planning refused the placement on the runner (a quantized model that does not fit the
    GPUs, say): what the load would raise there. A BaseException, past the loader's ``except Exception``."""

    def __init__(self, refusal: BaseException):
        super().__init__(refusal)
        self.refusal = refusal


def dtype_of(kwargs: dict, request: LoadRequest):
    """The ``torch.dtype`` a ``from_pretrained(**kwargs)`` call loads in."""
    import torch

    asked = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if isinstance(asked, torch.dtype):
        return asked
    if isinstance(asked, str) and asked != "auto":
        return getattr(torch, asked)
    return request.torch_dtype  # "auto" or none: the checkpoint's, which is what the request names here


def quantization_of(kwargs: dict) -> Any:
    """The quantization config a ``from_pretrained(**kwargs)`` call asks for (``load_in_4bit=True`` as the
    ``BitsAndBytesConfig`` transformers makes of it), ``None`` for none."""
    config = kwargs.get("quantization_config")
    if config is None and (kwargs.get("load_in_4bit") or kwargs.get("load_in_8bit")):
        from transformers import BitsAndBytesConfig

        config = BitsAndBytesConfig(load_in_4bit=bool(kwargs.get("load_in_4bit")),
                                    load_in_8bit=bool(kwargs.get("load_in_8bit")))
    return config


def _quantizer_for(config: Any) -> Any:
    if config is None:
        return None
    from transformers.quantizers import AutoHfQuantizer

    return AutoHfQuantizer.from_config(config, pre_quantized=False)


def quantizer_of(kwargs: dict):
    """transformers' quantizer for the quantization a ``from_pretrained(**kwargs)`` call asks for, ``None`` for none."""
    return _quantizer_for(quantization_of(kwargs))


# key -> (the empty model, the quantizer that prepared it): a quantizer keeps what preparing the model set on it
# (bitsandbytes' modules_to_not_convert: the lm_head it leaves unquantized), and its planning reads that, so a
# model is planned with its own quantizer, never a fresh one.
_EMPTY_MODELS: dict = {}


def _key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def _prepared(config: dict, dtype: Any, quantization_config: Any = None, device_map: Any = None) -> tuple[Any, Any]:
    """The empty model and its quantizer (``None`` unquantized), built once per architecture, dtype and
    quantization: every rank of a launcher, and every scenario of a run, plans the same one (a 70B model takes
    about 0.4 s to build, the first of a process 3-4 s)."""
    key = (_key(config), str(dtype), repr(quantization_config),
           repr(device_map) if quantization_config is not None else None)
    if key not in _EMPTY_MODELS:
        quantizer = _quantizer_for(quantization_config)
        model = architectures.empty_model(config, dtype, quantizer=quantizer, device_map=device_map)
        _EMPTY_MODELS[key] = (model, quantizer)
    return _EMPTY_MODELS[key]


def empty(config: dict, dtype: Any, quantization_config: Any = None, device_map: Any = None) -> Any:
    """The empty model of ``config`` in ``dtype`` (quantized as ``quantization_config`` asks), built once."""
    return _prepared(config, dtype, quantization_config, device_map)[0]


def first_built_for(config: dict) -> Any:
    """The first empty model :func:`empty` built for ``config`` (whatever its dtype and quantization)."""
    return next(model for key, (model, _) in _EMPTY_MODELS.items() if key[0] == _key(config))


def machine_of(profile: RunnerProfile) -> Machine:
    """The devices from_pretrained finds on ``profile``'s runner: its GPUs, each idle (all its memory free), and its
    host memory available."""
    return Machine(gpus=profile.devices, gpu_memory=profile.device_memory, host_memory=profile.host_memory)


def place(config: dict, kwargs: dict, request: LoadRequest, profile: RunnerProfile) -> tuple[Any, dict, Any, Any]:
    """The empty model and the map from_pretrained would give it on ``profile`` for the loader's ``kwargs``
    (``max_memory`` as the loader passes it, none included), with the quantizer and dtype it was planned for.
    Raises :class:`PlacementRefused` where the quantizer's own check of the planned map refuses it."""
    dtype = dtype_of(kwargs, request)
    device_map = kwargs.get("device_map")
    model, quantizer = _prepared(config, dtype, quantization_of(kwargs), device_map)
    budget: Optional[dict] = kwargs.get("max_memory")  # none: accelerate's own, from the runner's free memory
    try:
        planned = planner.plan(model, device_map, budget, dtype=dtype, hf_quantizer=quantizer,
                               machine=machine_of(profile))
    except ValueError as refusal:  # the quantizer's own check of the planned map (validate_environment)
        raise PlacementRefused(refusal) from None
    return model, planned, quantizer, dtype
