"""The transformers API differences this package bridges, each in one place.

- the dtype keyword: ``dtype=`` from transformers 4.56, ``torch_dtype=`` before (5.x warns on the old one)
- gradient checkpointing: ``activation_checkpointing_enable`` where transformers has it (5.x, which announces
  that ``gradient_checkpointing_enable`` will be removed in v6), ``gradient_checkpointing_enable`` before
"""

from __future__ import annotations

from typing import Any, Optional


def dtype_kwarg(torch_dtype: Any) -> dict:
    """``{"dtype": torch_dtype}`` for ``from_pretrained`` on transformers >= 4.56, else ``{"torch_dtype": ...}``."""
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"
    return {key: torch_dtype}


def enable_gradient_checkpointing(model: Any, *, use_reentrant: Optional[bool] = None) -> None:
    """Turn on gradient (activation) checkpointing through the installed transformers' current name."""
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)



# --- planning a placement (pytest_llmload.placement.planner) ----------------------------------------------
# transformers decides where each module goes in a private helper, `_get_device_map`: in
# transformers.integrations.accelerate from 5.x (model, device_map, max_memory, hf_quantizer), in
# transformers.modeling_utils before (also dtype and keep_in_fp32_regex, which from_pretrained builds inline just
# before the call). The planner calls it with what from_pretrained would pass, so a prediction is what
# from_pretrained itself would decide; tests/prediction/test_planner_exact.py compares the two on every stack.


def get_device_map(model: Any, device_map: Any, max_memory: Optional[dict], hf_quantizer: Any, dtype: Any) -> dict:
    """``from_pretrained``'s own placement of ``model`` (built empty, in ``dtype``) for ``device_map`` and
    ``max_memory``, through the installed transformers' helper. ``max_memory`` is handed over as it is (accelerate
    converts its sizes in place, as in from_pretrained): pass a copy."""
    try:
        from transformers.integrations.accelerate import _get_device_map
    except ImportError:
        from transformers.modeling_utils import _get_device_map

        return _get_device_map(model, device_map, max_memory, hf_quantizer, dtype,
                               _keep_in_fp32_regex(model, hf_quantizer, dtype))
    return _get_device_map(model, device_map, max_memory, hf_quantizer)


def _keep_in_fp32_regex(model: Any, hf_quantizer: Any, dtype: Any) -> Any:
    """The modules transformers 4.x keeps in float32, as from_pretrained builds the pattern it hands
    ``_get_device_map`` (inline there, so followed here: its conditions and its pattern)."""
    import re

    import torch

    modules = []
    if model._keep_in_fp32_modules is not None and (
            dtype == torch.float16 or getattr(hf_quantizer, "use_keep_in_fp32_modules", False)):
        modules.extend(model._keep_in_fp32_modules)
    strict = getattr(model, "_keep_in_fp32_modules_strict", None)
    if strict is not None and dtype in (torch.float16, torch.bfloat16):
        modules.extend(strict)
    return re.compile("|".join(rf"((^|\.){module}($|\.))" for module in modules)) if modules else None


def module_sizes(model: Any, hf_quantizer: Any, dtype: Any) -> dict:
    """Bytes of each module of ``model`` as the placement counts them (quantized parameters at their packed size)."""
    try:
        from transformers.integrations.accelerate import compute_module_sizes

        return dict(compute_module_sizes(model, hf_quantizer)[0])
    except ImportError:
        from accelerate.utils import compute_module_sizes

        special = hf_quantizer.get_special_dtypes_update(model, dtype) if hf_quantizer is not None else None
        target = hf_quantizer.adjust_target_dtype(dtype) if hf_quantizer is not None else dtype
        return dict(compute_module_sizes(model, dtype=target, special_dtypes=special))


def quantize_empty_model(model: Any, hf_quantizer: Any, dtype: Any, device_map: Any) -> None:
    """Replace ``model``'s layers with the quantizer's own (bitsandbytes ``Linear4bit``/``Linear8bitLt``), on meta,
    as ``from_pretrained`` does before it loads weights."""
    import inspect

    accepted = inspect.signature(hf_quantizer.preprocess_model).parameters
    kwargs = {"model": model, "device_map": device_map}
    if "dtype" in accepted:
        kwargs["dtype"] = dtype
    if "keep_in_fp32_modules" in accepted:
        kwargs["keep_in_fp32_modules"] = getattr(model, "_keep_in_fp32_modules", None) or []
    hf_quantizer.preprocess_model(**kwargs)


def zero3_device_map_refusal(device_map: Any) -> Optional[str]:
    """transformers' refusal of ``device_map`` under DeepSpeed ZeRO-3 (which must be enabled), or ``None``: its
    own ``check_and_set_device_map`` from 5.x; before, the same check inline in ``from_pretrained`` (same text)."""
    if device_map is None:
        return None
    try:
        from transformers.integrations.accelerate import check_and_set_device_map
    except ImportError:
        return "DeepSpeed Zero-3 is not compatible with passing a `device_map`."
    try:
        check_and_set_device_map(device_map)
    except ValueError as refusal:
        return str(refusal)
    return None


def leaves_hf_device_map(device_map: dict) -> bool:
    """Whether ``from_pretrained`` leaves ``hf_device_map`` on a model it placed by ``device_map`` (the map it
    planned): from 5.x only where it dispatches the model (more than one device, or disk); before, for any
    ``device_map`` (its ``dispatch_model`` ran for every one, and set it)."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__).release < (5,):
        return True
    devices = {str(where) for where in device_map.values()}
    return len(devices) > 1 or "disk" in devices
