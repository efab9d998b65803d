"""The ``limit_torch_memory`` marker: fail a test whose peak torch allocation passes a limit, with the figures.

In the manner of pytest-memray's ``limit_memory``::

    @pytest.mark.limit_torch_memory("24 MB")
    def test_lora_step_fits(llmload_load): ...

What is measured, during the test's call (not its fixtures' setup, as pytest-memray):

- on GPU (``device="cuda"``, the default where CUDA is visible): each device's peak allocation by torch's
  caching allocator (``torch.cuda.max_memory_allocated``) above what was allocated when the call started;
  the test fails when any device passes the limit.
- on CPU: the peak of what torch's CPU allocator handed out during the call, from the profiler's memory
  events (``torch.profiler.profile(profile_memory=True)``): every tensor torch allocates in the test's
  thread (and torch's own intra-op threads), an op's temporaries included. Not seen: memory torch did not
  allocate (weights ``from_pretrained`` maps straight from safetensors files, numpy-backed tensors, Python
  objects) and allocations in other Python threads (transformers 5 converts weights' dtypes in a loading
  thread pool). So on CPU the marker budgets compute (forward, backward, optimizer, generate), not a load.
  The profiler slows a tiny-model load by about a fifth and costs about a second once per process to start
  (done during setup, outside the measured call).

It skips with the reason where it cannot measure (no torch; ``device="cuda"`` and no GPU; a torch whose
profiler reports no memory events; another profiler already running). Sizes read as ``max_memory`` does:
``KB``/``MB``/``GB`` are powers of 1000, ``KiB``/``MiB``/``GiB`` powers of 1024, ``Mb`` bits
(:mod:`pytest_llmload.system.sizes`).
"""

from __future__ import annotations

import sys
from typing import NamedTuple, Optional

import pytest

from pytest_llmload.system import gpus
from pytest_llmload.instruments import memory_probe
from pytest_llmload.plugin.markers import fail_invalid_markers, read_marker
from pytest_llmload.system.sizes import format_bytes, parse_size
from pytest_llmload.config.vocabulary import MEMORY_LIMIT_MARKER as MARKER

limit_key = pytest.StashKey["MemoryLimit"]()
measured_key = pytest.StashKey["Measured"]()
_EXPECTED = ("expected a size such as '24 MB' (powers of 1000), '1.5 GiB' (powers of 1024) or a positive int of "
             "bytes, and optionally device='cuda' or device='cpu': @pytest.mark.limit_torch_memory(\"24 MB\")")


class MemoryLimit(NamedTuple):
    nbytes: int
    written: str  # the limit as the marker wrote it, for messages
    device: str  # "cuda" or "cpu"


class Measured(NamedTuple):
    peaks: dict[str, int]  # device name -> peak bytes above the start of the call
    baseline: dict[str, int]  # device name -> bytes allocated when the call started
    how: str


def _signature(limit, /, *, device=None):  # Python itself rejects missing or unexpected arguments
    return limit, device


def limit_for(item: pytest.Item) -> Optional[MemoryLimit]:
    """The item's limit, ``None`` without the marker; raises :class:`~pytest_llmload.plugin.markers.InvalidMarker`."""
    call = read_marker(item, MARKER, _signature, _EXPECTED)
    if call is None:
        return None
    limit, device = call.value
    try:
        nbytes = parse_size(limit, positive=True)
    except ValueError as exc:
        raise call.invalid(item, str(exc)) from None
    if device not in (None, "cuda", "cpu"):
        raise call.invalid(item, f"device={device!r} is neither 'cuda' nor 'cpu'")
    if device is None:
        device = "cuda" if gpus.visible_gpu_count() > 0 else "cpu"
    return MemoryLimit(nbytes, limit if isinstance(limit, str) else f"{limit} B", device)


_profiler_checked: Optional[str] = None  # "" once the profiler is known to report memory; else why not


def _profiler_skip_reason() -> Optional[str]:
    """Start the profiler once per process (its first start costs about a second) and check that it reports
    allocations; ``None`` when it does, else why not."""
    global _profiler_checked
    if _profiler_checked is None:
        try:
            import torch

            if torch.autograd.profiler._is_profiler_enabled:
                return "another torch profiler is already running"
            with _CpuAllocations() as probe:
                torch.empty(1 << 16, dtype=torch.uint8)
            _profiler_checked = "" if probe.peak >= 1 << 16 else (
                f"torch {torch.__version__}'s profiler reported {probe.peak} B for a 64 KiB allocation")
        except Exception as exc:  # an API this torch lacks: say so and skip
            _profiler_checked = f"torch's profiler gives no memory events here ({type(exc).__name__}: {exc})"
    return _profiler_checked or None


def skip_reason(limit: MemoryLimit) -> Optional[str]:
    if "torch" not in sys.modules:
        try:
            import torch  # noqa: F401
        except ImportError:
            return "torch is not installed: nothing to measure"
    if limit.device == "cuda":
        reason = gpus.skip_reason(1)
        return None if reason is None else f"measuring GPU memory {reason}"
    reason = _profiler_skip_reason()
    if reason is None and sys.modules["torch"].autograd.profiler._is_profiler_enabled:
        reason = "another torch profiler is already running"
    return reason


class _CpuAllocations:
    """The peak of torch's CPU allocations in a block, from the profiler's memory events."""

    def __init__(self) -> None:
        self.peak = 0

    def __enter__(self) -> "_CpuAllocations":
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        from torch._C._profiler import _EventType

        self._profile.__exit__(*exc)
        first, highest = None, None
        stack = list(self._profile.profiler.kineto_results.experimental_event_tree())
        while stack:
            event = stack.pop()
            stack.extend(event.children)
            if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
                fields = event.extra_fields
                # total_allocated: the allocator's running total after this event, whatever the thread
                if first is None or event.start_time_ns < first[0]:
                    first = (event.start_time_ns, fields.total_allocated - fields.alloc_size)
                highest = fields.total_allocated if highest is None else max(highest, fields.total_allocated)
        self.peak = 0 if first is None else max(0, highest - first[1])


class _Measure:
    """Around a test's call: the peak above the start, per device."""

    def __init__(self, device: str) -> None:
        self.device = device

    def __enter__(self) -> "_Measure":
        if self.device == "cpu":
            self._cpu = _CpuAllocations().__enter__()
        else:
            self._baseline = {i: allocated for i, (allocated, _) in memory_probe.cuda_now().items()}
            self._watch = memory_probe.start_peak()
        return self

    def __exit__(self, *exc) -> None:
        if self.device == "cpu":
            self._cpu.__exit__(*exc)
            self.result = Measured({"cpu": self._cpu.peak}, {"cpu": 0},
                                   "torch's CPU allocator, profiler memory events")
            return
        peaks = memory_probe.stop_peak(self._watch).cuda_peak
        if not peaks:  # CUDA was first initialised during the call: its peak counter started with it
            cuda = memory_probe._cuda()
            peaks = {} if cuda is None else {i: cuda.max_memory_allocated(i) for i in range(cuda.device_count())}
        self.result = Measured(
            {f"cuda:{i}": max(0, peak - self._baseline.get(i, 0)) for i, peak in peaks.items()},
            {f"cuda:{i}": self._baseline.get(i, 0) for i in peaks},
            "torch.cuda.max_memory_allocated, above what was allocated when the call started",
        )


def failure_message(limit: MemoryLimit, measured: Measured) -> Optional[str]:
    over = {device: peak for device, peak in measured.peaks.items() if peak > limit.nbytes}
    if not over:
        return None
    device, peak = max(over.items(), key=lambda kv: kv[1])
    others = "".join(f"; {d} {format_bytes(p)}" for d, p in measured.peaks.items() if d != device)
    baseline = measured.baseline.get(device, 0)
    return (
        f"{MARKER}: the test's peak torch allocation on {device} was {format_bytes(peak)} ({peak:,} B), over its "
        f"limit of {limit.written!r} ({limit.nbytes:,} B) by {format_bytes(peak - limit.nbytes)}{others}. "
        f"Measured: {measured.how}" + (f" ({format_bytes(baseline)})" if baseline else "") + "."
    )


# --- hooks (switched on by plugin.gates' gate when a run uses the plugin) --------------------------------


def pytest_runtest_setup(item: pytest.Item) -> None:
    limit = fail_invalid_markers(item, limit_for)
    if limit is None:
        return
    reason = skip_reason(limit)
    if reason is not None:
        raise pytest.skip.Exception(f"{MARKER}: {reason}", _use_item_location=True)
    item.stash[limit_key] = limit


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    limit = item.stash.get(limit_key, None)
    # Under xdist workers that share the GPUs: a CUDA limit's test holds them alone, the other GPU tests shared
    alone = limit is not None and limit.device != "cpu"
    with gpus.held_by_test(item.get_closest_marker("gpu") is not None, alone=alone):
        if limit is None:
            return (yield)
        measure = _Measure(limit.device).__enter__()
        try:
            return (yield)
        finally:
            measure.__exit__(None, None, None)
            item.stash[measured_key] = measure.result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if call.when != "call" or limit_key not in item.stash or measured_key not in item.stash:
        return report
    limit, measured = item.stash[limit_key], item.stash[measured_key]
    figures = ", ".join(f"{d} {format_bytes(p)}" for d, p in measured.peaks.items()) or "no device"
    report.llmload_torch_peak = dict(measured.peaks)
    message = failure_message(limit, measured)
    if message is None:
        report.sections.append(("llmload: torch memory", f"peak {figures} (limit {limit.written}); {measured.how}"))
    elif report.passed:
        report.outcome = "failed"
        report.longrepr = message
    elif report.failed:
        report.sections.append(("llmload: torch memory", message))
    return report
