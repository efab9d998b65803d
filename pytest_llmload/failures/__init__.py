"""The known failures, one module each, named by the failure's id (``dp-dtype`` is :mod:`.dp_dtype`).

Each module holds the failure's catalog entry (``FAILURE``, a :class:`~.base.KnownFailure`: signatures, root
cause, fix) and its conformance checks (``CHECKS``, :class:`~.base.Check` records). The catalog and the
check registry are both built from :data:`MODULES`; so are the homes outside the package, which follow the
id: the write-up's "before" loader ``fixtures/loaders/before_<id>.py`` and the regression tests
``tests/failures/test_<id>.py``. Adding a failure: one module here, one before-loader, one test module, and a
row in the README's table.
"""

from __future__ import annotations

import os
from typing import Union

from pytest_llmload.failures import (
    adapter_on_offloaded,
    distributed_device_map,
    dp_dtype,
    fp16_unscale,
    inference_stall,
    meta_backward,
    move_offloaded,
    offload_hang,
    quantized_cast,
    zero3_device_map,
)
from pytest_llmload.failures.base import Check, KnownFailure

# The write-ups' five first (shared/seeds), then those taken from upstream issue trackers.
MODULES = (meta_backward, offload_hang, inference_stall, dp_dtype, distributed_device_map,
           move_offloaded, adapter_on_offloaded, quantized_cast, zero3_device_map, fp16_unscale)

CATALOG: tuple[KnownFailure, ...] = tuple(module.FAILURE for module in MODULES)
BY_ID: dict[str, KnownFailure] = {failure.id: failure for failure in CATALOG}
# The order the main job runs them in: the CPU checks, then those that need GPUs.
REGISTRY: tuple[Check, ...] = tuple(sorted((check for module in MODULES for check in module.CHECKS),
                                           key=lambda check: check.needs_gpus > 0))


def match(text: str) -> list[KnownFailure]:
    """The known failures whose signatures appear in ``text`` (a failure's message and traceback)."""
    return [failure for failure in CATALOG if failure.matches(text)]


def preload_for_isolated_checks(checkpoint: Union["os.PathLike[str]", str], *, peft: bool = True) -> None:
    """Import here, before an isolated check forks, what the checks import: what a child imports dies with it,
    and the next check would pay for it again (1.5 s a check for peft and its dependencies, measured).

    peft (``peft=True``: a check that uses adapters) only where no GPU is visible: it imports bitsandbytes, whose
    import reads the devices' compute capability and so initialises CUDA, and a process that has initialised CUDA
    can no longer fork. A run of inference checks alone never imports it (about 2.5 s of CPU).
    """
    from pytest_llmload import gpus
    from pytest_llmload.runners import ranks

    modules = ranks.HF_PRELOAD + distributed_device_map.model_module(checkpoint)
    if peft and gpus.visible_gpu_count() == 0:
        modules += ("peft",)
    ranks.preload(modules)


__all__ = ["BY_ID", "CATALOG", "Check", "KnownFailure", "MODULES", "REGISTRY", "match",
           "preload_for_isolated_checks"]
