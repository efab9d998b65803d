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
# transformers.modeling_utils before (also dtype and keep_in_fp32_regex). The planner calls it, so a prediction
# is what from_pretrained itself would decide.


def get_device_map(model: Any, device_map: Any, max_memory: Optional[dict], hf_quantizer: Any, dtype: Any) -> dict:
    """``from_pretrained``'s own placement of ``model`` (built empty, in ``dtype``) for ``device_map`` and
    ``max_memory``, through the installed transformers' helper."""
    try:
        from transformers.integrations.accelerate import _get_device_map

        return _get_device_map(model, device_map, max_memory, hf_quantizer)
    except ImportError:
        import re

        from transformers.modeling_utils import _get_device_map

        keep = getattr(model, "_keep_in_fp32_modules", None) or []
        regex = re.compile("|".join(re.escape(m) for m in keep)) if keep else None
        return _get_device_map(model, device_map, max_memory, hf_quantizer, dtype, regex)


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
