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


def quantizer_of(kwargs: dict):
    """transformers' quantizer for the quantization a ``from_pretrained(**kwargs)`` call asks for, ``None`` for none."""
    config = kwargs.get("quantization_config")
    if config is None and (kwargs.get("load_in_4bit") or kwargs.get("load_in_8bit")):
        from transformers import BitsAndBytesConfig

        config = BitsAndBytesConfig(load_in_4bit=bool(kwargs.get("load_in_4bit")),
                                    load_in_8bit=bool(kwargs.get("load_in_8bit")))
    if config is None:
        return None
    from transformers.quantizers import AutoHfQuantizer

    return AutoHfQuantizer.from_config(config, pre_quantized=False)


_EMPTY_MODELS: dict = {}


def _key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def empty(config: dict, dtype: Any, quantizer: Any = None, quantization_config: Any = None,
          device_map: Any = None) -> Any:
    """The empty model, built once per architecture, dtype and quantization: every rank of a launcher, and every
    scenario of a run, plans the same one (a 70B model takes about 0.4 s to build, the first of a process 3-4 s)."""
    key = (_key(config), str(dtype), repr(quantization_config), repr(device_map) if quantizer is not None else None)
    if key not in _EMPTY_MODELS:
        _EMPTY_MODELS[key] = architectures.empty_model(config, dtype, quantizer=quantizer, device_map=device_map)
    return _EMPTY_MODELS[key]


def first_built_for(config: dict) -> Any:
    """The first empty model :func:`empty` built for ``config`` (whatever its dtype and quantization)."""
    return next(model for key, model in _EMPTY_MODELS.items() if key[0] == _key(config))


def place(config: dict, kwargs: dict, request: LoadRequest, profile: RunnerProfile) -> tuple[Any, dict, Any, Any]:
    """The empty model and the map from_pretrained would give it on ``profile`` for the loader's ``kwargs``, with
    the quantizer and dtype it was planned for. Raises :class:`PlacementRefused` where the quantizer's own check
    of the planned map refuses it."""
    dtype = dtype_of(kwargs, request)
    quantizer = quantizer_of(kwargs)
    device_map = kwargs.get("device_map")
    model = empty(config, dtype, quantizer, kwargs.get("quantization_config"), device_map)
    budget: Optional[dict] = kwargs.get("max_memory")
    max_memory = dict(budget) if budget is not None else profile.max_memory
    try:
        planned = planner.plan(model, device_map, max_memory, dtype=dtype, hf_quantizer=quantizer)
    except ValueError as refusal:  # the quantizer's own check of the planned map (validate_environment)
        raise PlacementRefused(refusal) from None
    return model, planned, quantizer, dtype
