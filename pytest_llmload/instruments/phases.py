"""Phase timings: how long each step of a load or a generation took, with memory before, after and at peak.

Write-up 001's team could not tell where a 70B model stalled: the log stopped after "Starting
model.generate()". Here every load and generation done through the plugin's fixtures and checks is a
phase, and downstream code can add its own::

    from pytest_llmload.instruments.phases import phase

    with phase("generate", max_new_tokens=512):
        out = model.generate(**batch, max_new_tokens=512)

Inside a pytest run with the plugin, phases go into the running test's record: a test that fails or hits
its deadline gets a report section with the table and the phase that was running, and a phase that runs
long prints a progress line every ``llmload_phase_progress_seconds``. Outside pytest, record them yourself::

    from pytest_llmload.instruments.phases import recording

    with recording(progress_every=30) as record:
        texts = timed_generate(model, tokenizer, ["Hello"], max_new_tokens=64)
    print(record.table())

Memory is the process RSS (its peak from the kernel) and, where torch has initialised CUDA, each device's
allocated and reserved bytes (peak allocated from torch); see :mod:`pytest_llmload.instruments.memory_probe`.

This module is the timed step (:class:`Phase`) and a timed generation; where phases go is
:mod:`pytest_llmload.instruments.recorder`, and the thread that prints progress lines
:mod:`pytest_llmload.instruments.heartbeat` (both importable from here too).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Optional

from pytest_llmload.instruments import memory_probe
from pytest_llmload.instruments.heartbeat import Clock
from pytest_llmload.instruments.recorder import PhaseRecorder, current_recorder
# The documented entry points (reference/api.md, docs/diagnostics.md) beside phase(): defined in recorder.
from pytest_llmload.instruments.recorder import recording, track_model  # noqa: F401  (public here)
from pytest_llmload.system.sizes import format_bytes


def _detail(detail: str, facts: dict) -> str:
    parts = [detail] if detail else []
    parts += [f"{key}={value}" for key, value in facts.items()]
    return ", ".join(parts)


class Phase:
    """One timed step. Use it through :func:`phase`; ``progressed`` is set each time a progress line was
    shown for it (a test can wait on it instead of sleeping)."""

    def __init__(self, name: str, detail: str = "", clock: Clock = time.monotonic) -> None:
        self.name = name
        self.detail = detail
        self.depth = 0
        self.thread = ""
        self.started: Optional[float] = None
        self.ended: Optional[float] = None
        self.rss_before: Optional[int] = None
        self.rss_after: Optional[int] = None
        self.rss_peak: Optional[int] = None
        self.cuda_before: dict[int, tuple[int, int]] = {}
        self.cuda_after: dict[int, tuple[int, int]] = {}
        self.cuda_peak: dict[int, int] = {}
        self.error: Optional[str] = None  # "<Exception>: <message>" when the block raised
        self.progressed = threading.Event()
        self._clock = clock
        self._recorder: Optional[PhaseRecorder] = None
        self._watch: Optional[memory_probe.PeakWatch] = None

    def note(self, **facts: Any) -> None:
        """Add facts learnt during the phase to its detail: ``p.note(tokens=456)``."""
        self.detail = _detail(self.detail, facts)

    @property
    def running(self) -> bool:
        return self.started is not None and self.ended is None

    @property
    def seconds(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended if self.ended is not None else self._clock()) - self.started

    @property
    def label(self) -> str:
        return f"{self.name} ({self.detail})" if self.detail else self.name

    def __enter__(self) -> "Phase":
        self._recorder = current_recorder()
        stack = _open_phases()
        self.depth = len(stack)
        self.thread = threading.current_thread().name
        self.rss_before = memory_probe.rss_bytes()
        self.cuda_before = memory_probe.cuda_now()
        self._watch = memory_probe.start_peak()
        stack.append(self)
        if self._recorder is not None:
            self._recorder._opened(self)
        self.started = self._clock()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.ended = self._clock()
        watch = memory_probe.stop_peak(self._watch)
        self.rss_peak, self.cuda_peak = watch.rss_peak, watch.cuda_peak
        self.rss_after = memory_probe.rss_bytes()
        self.cuda_after = memory_probe.cuda_now()
        if exc_type is not None:
            self.error = f"{exc_type.__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
        stack = _open_phases()
        if stack and stack[-1] is self:
            stack.pop()
        elif self in stack:
            stack.remove(self)
        if self._recorder is not None:
            self._recorder._closed(self)

    def memory_now(self) -> str:
        """``RSS 1.2 GiB; cuda:0 25.3 GiB allocated / 28.1 GiB reserved``: for progress lines."""
        parts = []
        rss = memory_probe.rss_bytes()
        if rss is not None:
            parts.append(f"RSS {format_bytes(rss)}")
        parts += [f"cuda:{i} {format_bytes(a)} allocated / {format_bytes(r)} reserved"
                  for i, (a, r) in memory_probe.cuda_now().items()]
        return "; ".join(parts)

    def as_dict(self) -> dict:
        """A plain, JSON-able record (sent from xdist workers to the controller)."""
        return {
            "name": self.name, "detail": self.detail, "depth": self.depth, "seconds": round(self.seconds, 6),
            "running": self.running, "error": self.error, "rss_before": self.rss_before,
            "rss_after": self.rss_after, "rss_peak": self.rss_peak,
            "cuda_after": {str(i): list(v) for i, v in self.cuda_after.items()},
            "cuda_peak": {str(i): v for i, v in self.cuda_peak.items()},
        }

    def __repr__(self) -> str:
        state = "running" if self.running else f"{self.seconds:.3f} s"
        return f"<Phase {self.label!r} {state}>"


def phase(name: str, detail: str = "", /, **facts: Any) -> Phase:
    """A context manager that times a step and records memory around it::

        with phase("tokenize", prompts=3) as p:
            batch = tokenizer(prompts, return_tensors="pt")
            p.note(tokens=batch["input_ids"].shape[-1])
    """
    return Phase(name, _detail(detail, facts))


_local = threading.local()


def _open_phases() -> list[Phase]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _after_fork_in_child() -> None:
    _local.__dict__.clear()  # only the forking thread survives: its open phases are the parent's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- a timed generation ----------------------------------------------------------------------------------


def _input_device(model: Any):
    """Where inputs go: the input embeddings' device, or the CPU when they are offloaded (on meta)."""
    try:
        weight = model.get_input_embeddings().weight
        if weight.device.type != "meta":
            return weight.device
    except (AttributeError, NotImplementedError):
        pass
    device_map = getattr(model, "hf_device_map", None) or {}
    for name, device in device_map.items():
        if "embed" in name and device not in ("disk", "meta"):
            return f"cuda:{device}" if isinstance(device, int) else device
    return "cpu"


def timed_generate(model: Any, tokenizer: Any, prompts: Sequence[str] | str, **generate_kwargs: Any) -> list[str]:
    """Write-up 001's ``_call_llm``, timed: tokenize, move to the model's device, generate, decode, each a
    phase. Returns the generated continuations (prompt removed)::

        texts = timed_generate(model, tokenizer, ["Hello"], max_new_tokens=8, do_sample=False)
    """
    import torch

    prompts = [prompts] if isinstance(prompts, str) else list(prompts)
    with phase("tokenize", prompts=len(prompts)) as p:
        batch = tokenizer(prompts, return_tensors="pt", padding=len(prompts) > 1)
        p.note(tokens=int(batch["input_ids"].shape[-1]))
    device = _input_device(model)
    with phase("to device", device=str(device)):
        batch = {key: value.to(device) for key, value in batch.items()}
    shown = {k: v for k, v in generate_kwargs.items() if k in ("max_new_tokens", "do_sample", "num_beams")}
    with phase("generate", **shown), torch.no_grad():
        out = model.generate(**batch, **generate_kwargs)
    with phase("decode") as p:
        texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[-1]:], skip_special_tokens=True)
        p.note(chars=sum(len(t) for t in texts))
    return texts
