"""Where ``from_pretrained(device_map=..., max_memory=...)`` puts a model: transformers' own decision, run on an empty
model, for a machine this process need not be. The project's one planner: the distributed check plans a 2-GPU
runner with it, the runner predictions any profile.

What is simulated: the capacity of each device is the profile's (accelerate would read the free memory of the
real devices); nothing else is. The decision (``get_balanced_memory``, ``infer_auto_device_map``, the quantizer's
adjustments) is the installed transformers' and accelerate's code.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
# The oldest transformers the predictions run on: its placement helper (_get_device_map) and from_config(dtype=)
# came with 4.56 (the version matrix: 4.56 and newer green; 4.46 has neither).
OLDEST_TRANSFORMERS = "4.56"


def unsupported_reason() -> Optional[str]:
    """Why the installed transformers cannot run the predictions, or ``None`` where it can."""
    from importlib import metadata

    from packaging.version import Version

    installed = metadata.version("transformers")
    if Version(installed) >= Version(OLDEST_TRANSFORMERS):
        return None
    return (f"the predictions need transformers >= {OLDEST_TRANSFORMERS} (its own placement planner, which they run); "
            f"this environment has {installed}: upgrade transformers, or leave the runner out")


class Share(NamedTuple):
    """What one device holds: the modules the map sends there, and their bytes."""

    modules: tuple[str, ...]
    bytes: int


def plan(model: Any, device_map: Any, max_memory: Optional[dict], *, dtype: Any,
         hf_quantizer: Any = None) -> dict[str, str]:
    """``{module: device}`` as from_pretrained decides it (``"0"``, ``"cpu"``, ``"disk"``), for ``model`` built empty.

    ``device_map`` as a loader passes it: a strategy (:data:`STRATEGIES`), an explicit map, one device, or ``None``
    (no map: from_pretrained loads the model whole on the cpu, where a script moves it)."""
    from pytest_llmload.loader.transformers_compat import get_device_map

    if device_map is None:
        return {"": "cpu"}
    if isinstance(device_map, dict):
        return {name: str(where) for name, where in device_map.items()}
    if not isinstance(device_map, str) or device_map not in STRATEGIES:
        return {"": str(device_map)}
    try:
        planned = get_device_map(model, device_map, max_memory, hf_quantizer, dtype)
    except RuntimeError:  # accelerate < 1.15 resolves torch.device(0) to balance, which fails without accelerators
        balanced = (balanced_by_hand(model, max_memory, dtype, hf_quantizer=hf_quantizer)
                    if device_map != "sequential" else max_memory)
        planned = get_device_map(model, "sequential", balanced, hf_quantizer, dtype)
    return {name: str(where) for name, where in planned.items()}


def balanced_by_hand(model: Any, max_memory: dict, dtype: Any, *, hf_quantizer: Any = None) -> dict:
    """What accelerate's ``get_balanced_memory`` gives (the weights shared out over the GPUs, plus the largest
    unsplittable block as headroom), for accelerate versions whose own cannot run without accelerators.

    With ``hf_quantizer`` (a quantized load), the weights are counted as from_pretrained hands them to
    ``get_balanced_memory``: at the quantizer's target dtype (:func:`shares`' count). Counted in ``dtype`` instead,
    a 4-bit model's share was its bf16 size, which then held the whole 4-bit model on GPU 0."""
    from accelerate.utils import compute_module_sizes

    no_split = getattr(model, "_no_split_modules", None) or []
    if hf_quantizer is None:
        sizes = compute_module_sizes(model, dtype=dtype)
    else:
        from pytest_llmload.loader.transformers_compat import module_sizes

        sizes = module_sizes(model, hf_quantizer, dtype)
    blocks = [sizes[name] for name, module in model.named_modules() if type(module).__name__ in no_split]
    gpus = [key for key in max_memory if isinstance(key, int)]
    share = sizes[""] // max(len(gpus), 1) + max(blocks, default=0)
    return {key: (min(share, value) if isinstance(key, int) and key != gpus[-1] else value)
            for key, value in max_memory.items()}


def shares(model: Any, device_map: dict[str, str], *, dtype: Any, hf_quantizer: Any = None) -> dict[str, Share]:
    """Per device of ``device_map``: the modules it holds and their bytes, counted as the planner counts them."""
    from pytest_llmload.loader.transformers_compat import module_sizes

    sizes = module_sizes(model, hf_quantizer, dtype)
    held: dict[str, list[str]] = {}
    for name, where in device_map.items():
        held.setdefault(where, []).append(name)
    return {where: Share(tuple(names), sum(sizes.get(name, 0) for name in names)) for where, names in held.items()}


def spreads(device_map: dict[str, str]) -> bool:
    """Whether accelerate refuses a model so placed in a distributed mode: its own ``Accelerator.verify_device_map``
    (which reads only the modules' ``hf_device_map``: more than one entry), asked about a module carrying the map."""
    import torch
    from accelerate import Accelerator

    holder = torch.nn.Module()
    holder.hf_device_map = dict(device_map)
    return bool(Accelerator.verify_device_map(None, holder))  # self is unused: no Accelerator (and no state) made
