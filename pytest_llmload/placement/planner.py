"""Where ``from_pretrained(device_map=..., max_memory=...)`` puts a model: transformers' own decision, run on an empty
model, for a machine this process need not be. The project's one planner: the distributed check plans a 2-GPU
runner with it, the runner predictions any profile.

What is simulated is the machine, and only that (:mod:`.simulated_devices`): how many CUDA devices there are, their
free memory and the host's, as the planner's own code asks torch and psutil for them. The decision
(``get_max_memory``, ``get_balanced_memory``, ``infer_auto_device_map``, the quantizer's adjustments, and the
headroom they keep when no ``max_memory`` is given) is the installed transformers' and accelerate's code, run
unchanged on every supported stack. tests/prediction/test_planner_exact.py holds the planner to from_pretrained's
own map, taken from from_pretrained itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from pytest_llmload.placement.simulated_devices import Machine, simulated

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


def plan(model: Any, device_map: Any, max_memory: Optional[dict], *, dtype: Any, hf_quantizer: Any = None,
         machine: Optional[Machine] = None) -> dict[str, str]:
    """``{module: device}`` as from_pretrained decides it (``"0"``, ``"cpu"``, ``"disk"``), for ``model`` built empty,
    on ``machine`` (by default the one ``max_memory`` describes: a GPU per integer key).

    ``device_map`` as a loader passes it: a strategy (:data:`STRATEGIES`), an explicit map, one device, or ``None``
    (no map: from_pretrained loads the model whole on the cpu, where a script moves it). ``max_memory`` as the
    loader passes it too: ``None`` leaves the budget to accelerate, which reads ``machine``'s free memory and keeps
    its own headroom, as from_pretrained does on the runner."""
    from pytest_llmload.loader.transformers_compat import get_device_map

    if device_map is None:
        return {"": "cpu"}
    if isinstance(device_map, dict):
        return {name: str(where) for name, where in device_map.items()}
    if not isinstance(device_map, str) or device_map not in STRATEGIES:
        return {"": str(device_map)}
    if machine is None:
        machine = machine_for(max_memory)
    budget = None if max_memory is None else dict(max_memory)  # accelerate converts its sizes in place
    with simulated(machine):
        planned = get_device_map(model, device_map, budget, hf_quantizer, dtype)
    return {name: str(where) for name, where in planned.items()}


def machine_for(max_memory: Optional[dict]) -> Machine:
    """The machine a ``max_memory`` budget is written for: a GPU for each integer key up to the highest. Given a
    budget, accelerate plans within it and reads no device's free memory, so the machine's sizes stay 0."""
    if max_memory is None:
        raise TypeError("a plan without max_memory needs the machine whose free memory accelerate would read")
    gpus = [key for key in max_memory if isinstance(key, int) and not isinstance(key, bool)]
    return Machine(gpus=max(gpus, default=-1) + 1, gpu_memory=0, host_memory=0)


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
