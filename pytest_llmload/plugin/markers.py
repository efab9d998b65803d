"""The ``needs_gpus(n)`` and ``gpu`` markers (validation, skipping, marking GPU tests automatically), and the one
way every llmload marker's arguments are read: :func:`read_marker`."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import pytest

from pytest_llmload.system import gpus
from pytest_llmload.config.vocabulary import DEEPSPEED_MARKER

BUILTIN_GPU_FIXTURES = ("gpu_model",)


class InvalidMarker(ValueError):
    """A marker's arguments are wrong; the message names the test, the marker as written, and what is expected."""


class MarkerCall(NamedTuple):
    name: str
    written: str  # the arguments as the test wrote them, for messages
    value: Any  # what the signature function returned
    expected: str  # what a valid marker looks like

    def invalid(self, item: pytest.Item, detail: str) -> InvalidMarker:
        """The error for arguments that have the right shape but a wrong value (``detail`` says which)."""
        return InvalidMarker(f"{item.nodeid}: @pytest.mark.{self.name}({self.written}) is invalid: {detail}; "
                             f"{self.expected}.")


def read_marker(item: pytest.Item, name: str, signature: Callable, expected: str) -> Optional[MarkerCall]:
    """The closest ``name`` marker's arguments, read by calling ``signature`` with them, so that Python itself
    rejects a missing, extra or unknown argument (pytest-django's way); ``None`` without the marker.

    Raises :class:`InvalidMarker` with a sentence naming the test, the marker as written, Python's complaint
    and ``expected``."""
    marker = item.get_closest_marker(name)
    if marker is None:
        return None
    written = _written(marker)
    try:
        value = signature(*marker.args, **marker.kwargs)
    except TypeError as exc:
        why = str(exc).replace(f"{signature.__name__}()", f"{name}()")
        error = InvalidMarker(f"{item.nodeid}: @pytest.mark.{name}({written}) is invalid ({why}); {expected}.")
    else:
        return MarkerCall(name, written, value, expected)
    raise error  # outside the except block: the report shows no chained TypeError


def _written(marker: pytest.Mark) -> str:
    return ", ".join([repr(a) for a in marker.args] + [f"{k}={v!r}" for k, v in marker.kwargs.items()])


def fail_invalid_markers(item: pytest.Item, read: Callable[[pytest.Item], Any]) -> Any:
    """``read(item)``, or the test fails at once with the :class:`InvalidMarker` sentence (no traceback)."""
    try:
        return read(item)
    except InvalidMarker as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)


def _needs_gpus_signature(n):  # Python itself rejects a missing or unexpected argument
    return n


def needed_gpus(item: pytest.Item) -> Optional[int]:
    """``n`` for a valid ``needs_gpus`` marker, ``None`` without one; raises :class:`InvalidMarker`."""
    call = read_marker(item, "needs_gpus", _needs_gpus_signature,
                       "expected one positive int, the number of GPUs the test needs, e.g. @pytest.mark.needs_gpus(2)")
    if call is None:
        return None
    if isinstance(call.value, bool) or not isinstance(call.value, int) or call.value < 1:
        raise call.invalid(item, f"got {call.value!r}")
    # pytest's rule, the closest marker wins, would drop a stricter needs_gpus on the class or module silently.
    placed = [(node, mark) for node, mark in item.iter_markers_with_node("needs_gpus")]
    differing = [(node, mark) for node, mark in placed if _written(mark) != call.written]
    if differing:
        (near_node, near), (far_node, far) = placed[0], differing[0]
        raise InvalidMarker(
            f"{item.nodeid}: @pytest.mark.needs_gpus({_written(near)}) on {near_node.name} and "
            f"@pytest.mark.needs_gpus({_written(far)}) on {far_node.name} disagree; keep one, the number of GPUs "
            "the test needs."
        )
    return call.value


def _no_arguments():
    return None


def check_flag_markers(item: pytest.Item) -> None:
    """``gpu`` and ``llmload_deepspeed`` take no arguments: ``gpu(2)`` would read as a GPU count and be ignored."""
    read_marker(item, "gpu", _no_arguments,
                "gpu takes no arguments; for a number of GPUs use @pytest.mark.needs_gpus(n), which also marks it gpu")
    read_marker(item, DEEPSPEED_MARKER, _no_arguments, f"expected @pytest.mark.{DEEPSPEED_MARKER}, without arguments")


def gpu_fixture_names(config: pytest.Config) -> set[str]:
    from pytest_llmload.config import settings

    return set(BUILTIN_GPU_FIXTURES) | set(settings.value(config, "gpu_fixtures"))


def gpu_fixture_used(item: pytest.Item, gpu_fixtures: set[str]) -> Optional[str]:
    """The first (by name) of ``gpu_fixtures`` that ``item`` uses, ``None`` when it uses none."""
    return min(gpu_fixtures.intersection(getattr(item, "fixturenames", ())), default=None)


def mark_gpu_tests(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Add the ``gpu`` marker to every test that needs GPUs, so ``-m gpu`` / ``-m "not gpu"`` split the suite."""
    gpu_fixtures = gpu_fixture_names(config)
    for item in items:
        if item.get_closest_marker("needs_gpus") is not None or gpu_fixture_used(item, gpu_fixtures) is not None:
            if item.get_closest_marker("gpu") is None:
                item.add_marker(pytest.mark.gpu)


def require_gpus(config: pytest.Config, items: list[pytest.Item], required: bool) -> None:
    """``--llmload-require-gpus``: a run that selects GPU tests and sees no GPU is a usage error, not a green run of
    skips (a GPU runner whose driver broke)."""
    if not required:
        return
    selected = [item for item in items if item.get_closest_marker("gpu") is not None]
    if selected and gpus.visible_gpu_count() == 0:
        from pytest_llmload.config.vocabulary import REQUIRE_GPUS_OPTION

        raise pytest.UsageError(f"{REQUIRE_GPUS_OPTION}: this run selects {len(selected)} GPU test(s) but sees no GPU "
                                f"({gpus.visible_devices_label()}); check the driver (nvidia-smi) and "
                                "CUDA_VISIBLE_DEVICES, or drop the option on a CPU runner.")


def enforce_needs_gpus(item: pytest.Item) -> None:
    """At setup: an invalid marker errors the test; too few GPUs skips it with the counts."""
    fail_invalid_markers(item, check_flag_markers)
    n = fail_invalid_markers(item, needed_gpus)
    if n is not None:
        reason = gpus.skip_reason(n)
    else:  # a GPU fixture: skipped here, before its fixtures build and load anything (`-m gpu` on a CPU runner)
        fixture = gpu_fixture_used(item, gpu_fixture_names(item.config))
        reason = None if fixture is None else gpus.skip_reason(1)
        reason = reason and f"{fixture} {reason}"
        if fixture is None and item.get_closest_marker("gpu") is not None:  # a bare @pytest.mark.gpu: one GPU
            reason = gpus.skip_reason(1)
            reason = reason and f"marked gpu: {reason}"
    if reason is not None:
        # Reported at the test's own location, as pytest's skipif does.
        raise pytest.skip.Exception(reason, _use_item_location=True)


def needs_deepspeed(item: pytest.Item) -> bool:
    """A test marked ``llmload_deepspeed``, or a conformance check that starts a process group."""
    if item.get_closest_marker(DEEPSPEED_MARKER) is not None:
        return True
    check = getattr(item, "callspec", None) and item.callspec.params.get("check")
    return getattr(check, "world_size", 1) > 1


def will_start_deepspeed(item: pytest.Item) -> bool:
    """Needs DeepSpeed and will run here: not errored by its ``needs_gpus`` marker nor skipped for want of
    GPUs (what :func:`enforce_needs_gpus` decides at setup), so `pytest -m gpu` on a CPU runner builds nothing."""
    if not needs_deepspeed(item):
        return False
    try:
        n = needed_gpus(item)
    except InvalidMarker:
        return False
    return n is None or gpus.skip_reason(n) is None
