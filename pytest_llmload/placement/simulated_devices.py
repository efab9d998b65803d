"""The GPUs a placement is planned for, answered to accelerate and transformers as CUDA would answer, on a machine
that need not have them.

from_pretrained's planner learns about the machine from torch and psutil, and from nothing else: how many CUDA
devices there are (``torch.cuda.device_count``), what ``torch.device(0)`` is (accelerate before 1.15 resolves each
key of ``max_memory`` so, which raises where there is no accelerator), each device's free memory
(``torch.cuda.mem_get_info``, after a tensor put on it to start its context), whether it shares the host's memory
(``get_device_properties(i).is_integrated``), what the caching allocator holds unused (``memory_reserved`` less
``memory_allocated``: nothing, in a process that has loaded nothing) and the host's available memory
(``psutil.virtual_memory().available``). Inside :func:`simulated` those questions get the :class:`Machine`'s answers
and the planner's own code runs unchanged on them, whatever version is installed.

Only the thread that entered :func:`simulated` gets the simulated answers: the functions are replaced for the
whole process while any thread is inside (they are module attributes), but each replacement asks the real one for
every other thread, so a heartbeat or a memory probe running beside a prediction sees this machine as it is.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace
from typing import Any, Iterator, NamedTuple


class Machine(NamedTuple):
    """The devices from_pretrained would find: ``gpus`` CUDA devices of ``gpu_memory`` bytes each, all of it free
    (an idle card: the few hundred MiB its CUDA context takes are not counted), and ``host_memory`` bytes of
    available host memory."""

    gpus: int
    gpu_memory: int
    host_memory: int


_current = threading.local()  # .machine: the Machine of the thread inside simulated(), absent elsewhere
_installed_lock = threading.Lock()
_inside = [0]  # how many threads are inside simulated(): the replacements stay installed while any is
_originals: dict = {}


def _machine() -> Any:
    return getattr(_current, "machine", None)


class _DeviceType(type):
    """``torch.device`` as seen while a plan is made: the real type for ``isinstance``, and a bare index (or a
    bare ``"cuda"``) resolved to a CUDA device in the simulating thread, as torch resolves it on a CUDA machine."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        real = _originals["device"]
        if _machine() is not None and len(args) == 1 and not kwargs:
            (what,) = args
            if isinstance(what, int) and not isinstance(what, bool):
                return real("cuda", what)
        return real(*args, **kwargs)

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _originals["device"])

    def __subclasscheck__(cls, subclass: type) -> bool:
        return issubclass(subclass, _originals["device"])


class _Device(metaclass=_DeviceType):
    pass


def _on_cuda(device: Any) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    return str(device).split(":")[0] == "cuda"


def _replacements() -> dict:
    """``(owner, name) -> replacement`` for every question the planner asks about the machine."""
    import psutil
    import torch

    def simulated_or_real(name: str, answer):
        real = getattr(torch.cuda, name)

        def replacement(*args: Any, **kwargs: Any) -> Any:
            machine = _machine()
            return real(*args, **kwargs) if machine is None else answer(machine, *args, **kwargs)

        return replacement

    def index(machine: Machine, device: Any = None) -> int:
        which = 0 if device is None else device if isinstance(device, int) else _originals["device"](device).index
        which = 0 if which is None else which
        if not 0 <= which < machine.gpus:
            raise RuntimeError(f"CUDA error: invalid device ordinal {which} (the simulated machine has "
                               f"{machine.gpus} GPUs)")
        return which

    def mem_get_info(machine: Machine, device: Any = None) -> tuple[int, int]:
        index(machine, device)
        return machine.gpu_memory, machine.gpu_memory

    def properties(machine: Machine, device: Any = None) -> Any:
        return SimpleNamespace(name=f"simulated GPU {index(machine, device)}", total_memory=machine.gpu_memory,
                               is_integrated=False, major=9, minor=0)

    real_tensor, real_virtual_memory = torch.tensor, psutil.virtual_memory

    def tensor(*args: Any, **kwargs: Any) -> Any:
        if _machine() is not None and _on_cuda(kwargs.get("device", "cpu")):
            kwargs["device"] = "meta"  # accelerate starts each device's context so: nothing to allocate here
        return real_tensor(*args, **kwargs)

    def virtual_memory() -> Any:
        machine, real = _machine(), real_virtual_memory()
        return real if machine is None else real._replace(available=machine.host_memory)

    return {
        (torch.cuda, "is_available"): simulated_or_real("is_available", lambda machine: machine.gpus > 0),
        (torch.cuda, "device_count"): simulated_or_real("device_count", lambda machine: machine.gpus),
        (torch.cuda, "mem_get_info"): simulated_or_real("mem_get_info", mem_get_info),
        (torch.cuda, "get_device_properties"): simulated_or_real("get_device_properties", properties),
        (torch.cuda, "memory_reserved"): simulated_or_real("memory_reserved", lambda machine, device=None: 0),
        (torch.cuda, "memory_allocated"): simulated_or_real("memory_allocated", lambda machine, device=None: 0),
        (torch, "device"): _Device,
        (torch, "tensor"): tensor,
        (psutil, "virtual_memory"): virtual_memory,
    }


@contextlib.contextmanager
def simulated(machine: Machine) -> Iterator[Machine]:
    """Within the block, in this thread, accelerate and transformers find ``machine``'s devices."""
    import torch

    with _installed_lock:
        if not _inside[0]:
            _originals["device"] = torch.device
            replacements = _replacements()
            _originals["saved"] = {key: getattr(*key) for key in replacements}
            for (owner, name), replacement in replacements.items():
                setattr(owner, name, replacement)
        _inside[0] += 1
    outer = _machine()
    _current.machine = machine
    try:
        yield machine
    finally:
        _current.machine = outer
        with _installed_lock:
            _inside[0] -= 1
            if not _inside[0]:
                for (owner, name), real in _originals.pop("saved").items():
                    setattr(owner, name, real)
