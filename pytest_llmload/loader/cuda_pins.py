"""A loader that pins CUDA, on a runner without it (issue 46, 4): a device the runner lacks is not a red build.

A loader that hard-codes ``device_map={"": 0}`` or ``.cuda()`` is right on the GPU machines its users run it on. On
a runner without a CUDA device (:func:`pytest_llmload.system.gpus.visible_gpu_count`), a request for the cpu (what
every check but the ``_cuda`` variants asks) is answered inside the loader call
(:func:`pytest_llmload.loader.seam.call_loader`) as follows:

- mapped to the cpu, and the row says so: a ``from_pretrained`` ``device_map`` that puts the whole model on one CUDA
  device (``{"": 0}``, ``0``, ``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, a map whose every entry is that
  device) becomes the same map on ``"cpu"``; ``module.cuda()`` and ``module.to("cuda")`` (any form torch parses)
  become a move to the cpu. Only where the call as the loader made it fails for want of CUDA: a check that simulates
  GPUs beneath (the Trainer check plans a pin on its simulated machine) sees the loader's own map. What a check
  observes is unchanged: an explicit map is not planned (no ``max_memory`` is read), so on the cpu as on the GPU
  the whole model lands on one device, nothing offloaded; a quantized load whole on the cpu has the same
  bitsandbytes layers as the unpinned one the checks' quantized requests get here (both stacks, measured); a
  model's own ``to``/``cuda`` (an 8-bit model's refusal, accelerate's for an offloaded one) runs first, as called,
  as on the GPU.
- a skip naming the loader's line, where mapping would change what the check observes: a map that spreads the model
  over several CUDA devices or mixes one with the cpu or disk, or a ``max_memory`` budget for GPUs that
  ``"auto"``/``"balanced"`` plans by (where each part lands, by each device's budget, is what the offload and
  distributed checks observe). A GPU runner (``pytest -m gpu``) judges it.
- the loader's error, with its cause and fix (:mod:`pytest_llmload.loader.faults`' "device pin"), where it needs
  CUDA in a way no mapping covers (a tensor made on ``"cuda"``, ``torch.cuda.current_device()``): the runner cannot
  run that code at all.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, NamedTuple, Optional

from pytest_llmload.system import gpus, tracebacks

GPU_RUNNER = "a GPU runner (`pytest -m gpu`)"


class Pin(NamedTuple):
    """A CUDA placement the loader asked for: ``what`` (``device_map={'': 0}``, ``.cuda()``), the ``devices`` it
    names, and ``where``, the loader's line (``path:line``)."""

    what: str
    devices: str
    where: str

    def __str__(self) -> str:
        return f"{self.devices} ({self.where}: {self.what})"


# Frames that are not the loader's own code: installed libraries, Python's, this package's (a spy, a check).
_NOT_THE_LOADERS = ("/site-packages/", "/lib/python", "<frozen")


def loaders_line() -> str:
    """``path:line`` of the innermost frame of the calling stack in the loader's own code: outside installed
    libraries and this package (else outside installed libraries: a loader of this package's, the reference one)."""
    frame = (tracebacks.culprit(sys._getframe(1), _NOT_THE_LOADERS + (tracebacks.PACKAGE_DIR,))
             or tracebacks.culprit(sys._getframe(1), _NOT_THE_LOADERS))
    if frame is None:
        return "an unknown line"
    path = frame.f_code.co_filename
    under_cwd = os.path.abspath(path).startswith(os.getcwd() + os.sep)
    return f"{os.path.relpath(path) if under_cwd else path}:{frame.f_lineno}"


def cuda_devices(device_map: Any) -> tuple[str, ...]:
    """The devices of ``device_map`` (a ``from_pretrained`` argument), ``"cuda:0"`` for an index, in order and once
    each, where one of them is a CUDA device; ``()`` where none is (``"auto"``, ``"cpu"``, ``None``)."""
    values = list(device_map.values()) if isinstance(device_map, dict) else [device_map]
    named = list(dict.fromkeys(_device_name(value) for value in values))
    return tuple(named) if any(name.startswith("cuda") for name in named) else ()


def _budgeted_gpus(max_memory: Any) -> tuple[str, ...]:
    """The CUDA devices a ``max_memory`` budget names (``{0: "20GiB", "cpu": ...}``), as ``"cuda:0"``."""
    keys = [_device_name(int(key) if str(key).isdigit() else key) for key in (max_memory or {})]
    return tuple(key for key in keys if key.startswith("cuda"))


def _device_name(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"cuda:{value}"
    text = str(value)
    return "cuda:0" if text == "cuda" else text


@contextlib.contextmanager
def mapped_to_cpu(request: Any) -> Iterator[list]:
    """Within the block, the loader's CUDA pins are mapped to the cpu, or the row skips, as the module says; yields
    the list of :class:`Pin` mapped. Nothing changes on a runner with CUDA, for a request on an accelerator, or where
    torch is not imported. The skip is a BaseException (pytest's): no ``except Exception`` of the loader's catches
    it."""
    torch = sys.modules.get("torch")
    mapped: list[Pin] = []
    # (the count is NVML's: torch.cuda.is_available() may initialise CUDA, after which this process cannot fork)
    if torch is None or request.device != "cpu" or gpus.visible_gpu_count() > 0:
        yield mapped
        return

    def mapped_or_skipped(pin: Pin, *, spreads: bool = False) -> None:
        if spreads:
            import pytest

            pytest.skip(f"the loader places the model on {pin}, devices this runner lacks (no CUDA device); mapped "
                        "to the cpu it would not be the same load (where each part lands, by each device's budget, "
                        f"is what the check observes): {GPU_RUNNER} judges it")
        mapped.append(pin)

    try:
        with contextlib.ExitStack() as stack:
            for patch in (_from_pretrained_patch(mapped_or_skipped), *_module_patches(torch, mapped_or_skipped)):
                if patch is not None:
                    stack.enter_context(patch)
            yield mapped
    finally:
        if mapped:
            from pytest_llmload.config.stash_keys import add_note

            pins = "; ".join(dict.fromkeys(str(pin) for pin in mapped))
            add_note(f"ran on cpu: the loader pins {pins}, a device this runner lacks; {GPU_RUNNER} judges it there")


def _failed_for_want_of_cuda(exc: BaseException) -> bool:
    """Whether ``exc`` is a CUDA device this runner lacks (:mod:`.faults`' "device pin", by what raised it)."""
    from pytest_llmload.loader.faults import diagnose

    diagnosis = diagnose(exc)
    return diagnosis is not None and diagnosis.fault == "device pin"


def _from_pretrained_patch(mapped_or_skipped):
    """``PreTrainedModel.from_pretrained`` that, where the call as the loader made it fails for want of CUDA, loads it
    again on the cpu if its ``device_map`` pins the whole model to one CUDA device, and skips if the placement spreads
    over GPUs (a map, a budget). The call as made comes first: a check that simulates GPUs below this (the Trainer
    check plans the pin on its simulated machine) sees the loader's own map and needs no mapping. ``None``:
    transformers is not imported."""
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    pretrained = getattr(modeling_utils, "PreTrainedModel", None)
    if pretrained is None:
        return None
    from unittest import mock

    original = pretrained.__dict__["from_pretrained"]

    def from_pretrained(klass, *args, **kwargs):
        device_map = kwargs.get("device_map")
        max_memory = dict(kwargs.get("max_memory") or {})  # (as asked: accelerate converts its sizes in place)
        try:
            return original.__func__(klass, *args, **kwargs)
        except Exception as exc:
            devices, budgeted = cuda_devices(device_map), _budgeted_gpus(max_memory)
            if not (devices or budgeted) or not _failed_for_want_of_cuda(exc):
                raise
        if len(devices) == 1:  # the whole model on one GPU: an explicit map, which no budget changes
            mapped_or_skipped(Pin(f"device_map={device_map!r}", devices[0], loaders_line()))
            on_cpu = {name: "cpu" for name in device_map} if isinstance(device_map, dict) else "cpu"
            kwargs = {key: value for key, value in kwargs.items() if not (key == "max_memory" and budgeted)}
            return original.__func__(klass, *args, **{**kwargs, "device_map": on_cpu})
        asked = f"device_map={device_map!r}" + (f", max_memory={max_memory!r}" if budgeted else "")
        mapped_or_skipped(Pin(asked, ", ".join(dict.fromkeys(devices + budgeted)), loaders_line()), spreads=True)

    return mock.patch.object(pretrained, "from_pretrained", classmethod(from_pretrained))


def _module_patches(torch, mapped_or_skipped) -> list:
    """``nn.Module.to`` and ``nn.Module.cuda`` that, where the move as called fails for want of CUDA, move to the cpu
    (nothing moved before it failed: torch initialises CUDA at the first tensor). A model's own override
    (``PreTrainedModel.to``/``.cuda``: an 8-bit model's refusal) runs first, as called, as it would on a GPU."""
    from unittest import mock

    module = torch.nn.Module
    real_to, real_cuda = module.to, module.cuda

    def to(self, *args, **kwargs):
        try:
            return real_to(self, *args, **kwargs)
        except Exception as exc:
            device = torch._C._nn._parse_to(*args, **kwargs)[0]
            if device is None or device.type != "cuda" or not _failed_for_want_of_cuda(exc):
                raise
        shown = ", ".join([repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()])
        mapped_or_skipped(Pin(f".to({shown})", _device_name(device), loaders_line()))
        args = tuple("cpu" if _is_cuda(torch, a) else a for a in args)
        return real_to(self, *args, **{k: "cpu" if k == "device" else v for k, v in kwargs.items()})

    def cuda(self, device=None):
        try:
            return real_cuda(self, device)
        except Exception as exc:
            if not _failed_for_want_of_cuda(exc):
                raise
        mapped_or_skipped(Pin(".cuda()" if device is None else f".cuda({device!r})",
                              _device_name(0 if device is None else device), loaders_line()))
        return real_to(self, "cpu")

    return [mock.patch.object(module, "to", to), mock.patch.object(module, "cuda", cuda)]


def _is_cuda(torch, value: Any) -> bool:
    if isinstance(value, (str, torch.device)) or (isinstance(value, int) and not isinstance(value, bool)):
        return _device_name(value).startswith("cuda")
    return False
