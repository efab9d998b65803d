"""Where a model is: a compact summary of its placement for a failure report.

Modules per device, parameters on ``meta`` (how many, the first few names), weights offloaded by accelerate
(to cpu or disk, and how much), dtypes per device. Written for write-up 002's failure: a model spread over
``max_memory`` with offload, whose ``meta`` parameters could not train::

    >>> from pytest_llmload.instruments.device_map_summary import placement_lines
    >>> print("\\n".join(placement_lines(model)))  # doctest: +SKIP
    hf_device_map: cpu 2 (model.embed_tokens, model.layers.0), disk 6 (model.layers.1, model.layers.2, ...)
    modules with weights: cpu 10, meta 29
    parameters on meta: 29 of 39 (model.layers.1.self_attn.q_proj.weight, ..., +26 more)
    offloaded by accelerate: 29 weights, 545.5 KiB to disk (folder /tmp/offload), hooks on 30 modules
    dtypes: cpu float32 (10 params, 210.5 KiB); meta float32 (29 params, 545.5 KiB)

:func:`offloaded_parts` says in a few words whether a model is offloaded at all: the premise of the checks of an
offloading load, and what the adapter fix (:mod:`pytest_llmload.fixes.adapters`) refuses to put an adapter on.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any, Optional

from pytest_llmload.system.sizes import format_bytes

SHOWN_NAMES = 3
_WRAPPER_PREFIXES = ("base_model.model.", "module.", "_orig_mod.")


def _device_name(device: Any) -> str:
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def _tier(name: str, device_map: dict) -> Optional[str]:
    """The ``hf_device_map`` entry a parameter falls under (longest matching module prefix)."""
    candidates = [name] + [name[len(p):] for p in _WRAPPER_PREFIXES if name.startswith(p)]
    for candidate in candidates:
        best = None
        for key in device_map:
            if key == "" or candidate == key or candidate.startswith(key + "."):
                if best is None or len(key) > len(best):
                    best = key
        if best is not None:
            return _device_name(device_map[best])
    return None


def _offload_hooks(model: Any) -> tuple[int, Optional[str]]:
    """Modules with an offloading accelerate hook, and the folder their weights are read from (if on disk)."""
    count, folder = 0, None
    for _, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        hooks = getattr(hook, "hooks", None) or ([hook] if hook is not None else [])
        for h in hooks:
            if getattr(h, "offload", False):
                count += 1
                weights = getattr(h, "weights_map", None)
                dataset = getattr(weights, "dataset", weights)
                folder = folder or getattr(dataset, "save_folder", None)
    return count, folder


_NUMBERED = re.compile(r"^(.*\.)(\d+)$")


def compress_modules(names: list[str], dash: str = "\u2013") -> str:
    """``model.layers.1–3, model.norm, lm_head``: runs of numbered siblings written as a range (``dash`` between
    its ends); the whole model (the map's ``""`` entry) as ``<whole model>``."""
    parts: list[list] = []  # [prefix, first, last] or [name]
    for name in names:
        match = _NUMBERED.match(name)
        if match:
            prefix, number = match.group(1), int(match.group(2))
            last = parts[-1] if parts else None
            if last is not None and len(last) == 3 and last[0] == prefix and last[2] == number - 1:
                last[2] = number
                continue
            parts.append([prefix, number, number])
        else:
            parts.append([name or "<whole model>"])
    return ", ".join(p[0] if len(p) == 1 else (f"{p[0]}{p[1]}" if p[1] == p[2] else f"{p[0]}{p[1]}{dash}{p[2]}")
                     for p in parts)


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:SHOWN_NAMES])
    return shown + (f", +{len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


def placement_lines(model: Any) -> list[str]:
    """The summary, one line per aspect; empty for an object without parameters."""
    if not hasattr(model, "named_parameters"):
        return []
    params = list(model.named_parameters())
    if not params:
        return []
    device_map = getattr(model, "hf_device_map", None)
    device_map = device_map if isinstance(device_map, dict) else None
    lines = []
    if device_map:
        grouped: dict[str, list[str]] = defaultdict(list)
        for key, device in device_map.items():
            grouped[_device_name(device)].append(key or "<whole model>")
        lines.append("hf_device_map: " + ", ".join(f"{device} {len(keys)} ({_names(keys)})"
                                                  for device, keys in grouped.items()))

    modules: Counter = Counter()
    for _, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if own:
            modules["+".join(sorted({str(p.device) for p in own}))] += 1
    lines.append("modules with weights: " + ", ".join(f"{d} {n}" for d, n in modules.items()))

    meta = [name for name, p in params if p.device.type == "meta"]
    if meta:
        lines.append(f"parameters on meta: {len(meta)} of {len(params)} ({_names(meta)})")
        tiers: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for name, p in params:
            if p.device.type == "meta":
                tier = (_tier(name, device_map) if device_map else None) or "an unknown place"
                tiers[tier][0] += 1
                tiers[tier][1] += p.numel() * p.element_size()
        hooked, folder = _offload_hooks(model)
        where = "; ".join(f"{n} weights, {format_bytes(b)} to {tier}" + (f" (folder {folder})" if tier == "disk"
                                                                          and folder else "")
                          for tier, (n, b) in tiers.items())
        lines.append(f"offloaded by accelerate: {where}; hooks on {hooked} modules" if hooked else
                     f"not materialised: {where}; no accelerate hook loads them (they cannot run or train)")
    else:
        lines.append(f"parameters on meta: none of {len(params)}")

    dtypes: dict[str, Counter] = defaultdict(Counter)
    sizes: Counter = Counter()
    for _, p in params:
        key = (str(p.device), str(p.dtype).removeprefix("torch."))
        dtypes[key[0]][key[1]] += 1
        sizes[key] += p.numel() * p.element_size()
    lines.append("dtypes: " + "; ".join(
        f"{device} " + ", ".join(f"{dtype} ({n} params, {format_bytes(sizes[device, dtype])})"
                                 for dtype, n in counter.items())
        for device, counter in dtypes.items()))
    return lines


def offloaded_parts(model) -> list[str]:
    """What of ``model`` is offloaded (parameters on meta, accelerate hooks that offload, ``hf_device_map``
    entries on cpu/disk next to an accelerator); empty when it was loaded whole. The premise of every check
    of an offloading load: without it, the offloaded path was not exercised."""
    params = list(model.named_parameters())
    meta = [n for n, p in params if p.device.type == "meta"]
    hooked = [n for n, m in model.named_modules() if getattr(getattr(m, "_hf_hook", None), "offload", False)]
    tiers = {str(v) for v in (getattr(model, "hf_device_map", None) or {}).values()}
    parts = []
    if meta:
        parts.append(f"{len(meta)} of {len(params)} parameters on meta")
    if hooked:
        parts.append(f"{len(hooked)} modules with an offloading hook")
    if "disk" in tiers or ("cpu" in tiers and len(tiers) > 1):
        parts.append(f"hf_device_map tiers {sorted(tiers)}")
    return parts
