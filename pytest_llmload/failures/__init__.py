"""The known failures, one module each, named by the failure's id (``dp-dtype`` is :mod:`.dp_dtype`).

Each module holds the failure's catalog entry (``FAILURE``, a :class:`~.base.KnownFailure`: signatures, root
cause, fix) and its conformance checks (``CHECKS``, :class:`~.base.Check` records). The catalog and the
check registry are both built from :data:`MODULES`; so are the homes outside the package, which follow the
id: the write-up's "before" loader ``fixtures/loaders/before_<id>.py`` and the regression tests
``tests/failures/test_<id>.py``. Adding a failure: one module here, one before-loader, one test module, and a
row in the README's table.
"""

from __future__ import annotations

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
from pytest_llmload.checks.base import Check, KnownFailure
from pytest_llmload.runners.ranks import preload_for_isolated_checks  # (its home: one floor down)

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


__all__ = ["BY_ID", "CATALOG", "Check", "KnownFailure", "MODULES", "REGISTRY", "match",
           "preload_for_isolated_checks"]
