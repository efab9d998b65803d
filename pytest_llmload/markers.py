"""The ``needs_gpus(n)`` and ``gpu`` markers: validation, skipping, and marking GPU tests automatically."""

from __future__ import annotations

from typing import Optional

import pytest

from pytest_llmload import gpus

NEEDS_GPUS_HELP = (
    "needs_gpus(n): skip unless at least n CUDA devices are visible (n a positive int); also marks the test 'gpu'."
)
GPU_HELP = "gpu: the test needs a GPU; set automatically on needs_gpus tests and tests using a GPU fixture. Select with -m gpu."
DEEPSPEED_HELP = (
    "llmload_deepspeed: the test starts DeepSpeed; its one-time C++ op build happens after collection, "
    "outside any test's deadline."
)
GPU_FIXTURES_INI = "llmload_gpu_fixtures"
GPU_FIXTURES_HELP = "extra fixture names that need a GPU: tests using them are marked 'gpu' (default: gpu_model)."
BUILTIN_GPU_FIXTURES = ("gpu_model",)


def _needs_gpus_signature(n):  # Python itself rejects a missing or unexpected argument
    return n


def needed_gpus(item: pytest.Item) -> tuple[Optional[int], Optional[str]]:
    """``(n, None)`` for a valid ``needs_gpus`` marker, ``(None, message)`` for an invalid one, ``(None, None)``."""
    marker = item.get_closest_marker("needs_gpus")
    if marker is None:
        return None, None
    written = ", ".join([repr(a) for a in marker.args] + [f"{k}={v!r}" for k, v in marker.kwargs.items()])
    expected = "expected one positive int, the number of GPUs the test needs, e.g. @pytest.mark.needs_gpus(2)"
    try:
        n = _needs_gpus_signature(*marker.args, **marker.kwargs)
    except TypeError as exc:
        why = str(exc).replace("_needs_gpus_signature()", "needs_gpus()")
        return None, f"{item.nodeid}: @pytest.mark.needs_gpus({written}) is invalid ({why}); {expected}."
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return None, f"{item.nodeid}: @pytest.mark.needs_gpus({written}) is invalid: got {n!r}; {expected}."
    return n, None


def gpu_fixture_names(config: pytest.Config) -> set[str]:
    return set(BUILTIN_GPU_FIXTURES) | set(config.getini(GPU_FIXTURES_INI))


def mark_gpu_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add the ``gpu`` marker to every test that needs GPUs, so ``-m gpu`` / ``-m "not gpu"`` split the suite."""
    gpu_fixtures = gpu_fixture_names(config)
    for item in items:
        uses_gpu_fixture = bool(gpu_fixtures.intersection(getattr(item, "fixturenames", ())))
        if item.get_closest_marker("needs_gpus") is not None or uses_gpu_fixture:
            if item.get_closest_marker("gpu") is None:
                item.add_marker(pytest.mark.gpu)


def enforce_needs_gpus(item: pytest.Item) -> None:
    """At setup: an invalid marker errors the test; too few GPUs skips it with the counts."""
    n, error = needed_gpus(item)
    if error is not None:
        pytest.fail(error, pytrace=False)
    if n is not None:
        reason = gpus.skip_reason(n)
        if reason is not None:
            # Reported at the test's own location, as pytest's skipif does.
            raise pytest.skip.Exception(reason, _use_item_location=True)


def needs_deepspeed(item: pytest.Item) -> bool:
    """A test marked ``llmload_deepspeed``, or a conformance check that starts a process group."""
    if item.get_closest_marker("llmload_deepspeed") is not None:
        return True
    check = getattr(item, "callspec", None) and item.callspec.params.get("check")
    return getattr(check, "world_size", 1) > 1


def will_start_deepspeed(item: pytest.Item) -> bool:
    """Needs DeepSpeed and will run here: not errored by its ``needs_gpus`` marker nor skipped for want of
    GPUs (what :func:`enforce_needs_gpus` decides at setup), so `pytest -m gpu` on a CPU runner builds nothing."""
    if not needs_deepspeed(item):
        return False
    n, error = needed_gpus(item)
    return error is None and (n is None or gpus.skip_reason(n) is None)
