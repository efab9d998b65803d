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
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional

from pytest_llmload.instruments import memory_probe
from pytest_llmload.system.sizes import format_bytes

Clock = Callable[[], float]


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


# --- where phases go -------------------------------------------------------------------------------------


class LoadedModel:
    """A model loaded during a test: what it is, where from, how long it took, where it went. Holds the
    model weakly: a test that frees a model to load the next one is not kept from doing so."""

    def __init__(self, model: Any, source: str, seconds: Optional[float]) -> None:
        self.kind = type(model).__name__
        self.source = source
        self.seconds = seconds
        device_map = getattr(model, "hf_device_map", None)
        self.device_map = dict(device_map) if isinstance(device_map, dict) else None
        self.where = self._where(model)
        try:
            self._ref = weakref.ref(model)
        except TypeError:
            self._ref = lambda: None

    @property
    def model(self) -> Any:
        return self._ref()

    def _where(self, model: Any) -> str:
        """``cpu+disk`` from ``hf_device_map``, else the device of the first parameter."""
        if self.device_map:
            seen: list[str] = []
            for value in self.device_map.values():
                name = f"cuda:{value}" if isinstance(value, int) else str(value)
                if name not in seen:
                    seen.append(name)
            return "+".join(seen)
        for parameter in getattr(model, "parameters", lambda: ())():
            return str(parameter.device)
        return "?"

    def as_dict(self) -> dict:
        return {"kind": self.kind, "source": self.source, "seconds": self.seconds, "where": self.where}


class PhaseRecorder:
    """The phases of one test (or one script run), the models it loaded, and the deadlines it met.

    ``progress_every``: seconds between progress lines while a phase runs (``None`` or 0: none);
    ``emit``: where a progress line goes (default: stderr).
    """

    def __init__(self, label: str = "", *, progress_every: Optional[float] = None,
                 emit: Optional[Callable[[str], None]] = None, clock: Clock = time.monotonic,
                 heartbeat: Optional["Heartbeat"] = None) -> None:
        self.label = label
        self.progress_every = progress_every or None
        self.emit = emit or _stderr_line
        self.clock = clock
        self.heartbeat = heartbeat
        self.phases: list[Phase] = []
        self.models: list[LoadedModel] = []
        self.deadlines: list[tuple[str, float, float]] = []  # (what, seconds taken, deadline seconds)
        self._lock = threading.Lock()

    # called by Phase
    def _opened(self, p: Phase) -> None:
        p._clock = self.clock
        with self._lock:
            self.phases.append(p)
        if self.progress_every:
            (self.heartbeat or heartbeat()).schedule(p, self.progress_every, self._progress_line, every=self.progress_every)

    def _closed(self, p: Phase) -> None:
        if self.progress_every:
            (self.heartbeat or heartbeat()).cancel(p)

    def _progress_line(self, p: Phase) -> None:
        if not p.running:
            return
        elapsed = p.seconds
        shown = f"{elapsed:.0f} s" if elapsed >= 10 else f"{elapsed:.1f} s"
        memory = p.memory_now()
        where = f"{self.label}: " if self.label else ""
        self.emit(f"llmload: {where}phase '{p.label}' running for {shown}" + (f"; {memory}" if memory else ""))
        p.progressed.set()

    def track_model(self, model: Any, source: str = "", seconds: Optional[float] = None) -> LoadedModel:
        loaded = LoadedModel(model, source, seconds)
        with self._lock:
            self.models.append(loaded)
        return loaded

    def running(self) -> list[Phase]:
        return [p for p in self.phases if p.running]

    def interrupted(self) -> Optional[Phase]:
        """The innermost phase that a failure ended (a raised exception, a pytest-timeout ``Failed``)."""
        failed = [p for p in self.phases if p.error is not None]
        return max(failed, key=lambda p: (p.depth, p.started or 0.0)) if failed else None

    def table(self) -> str:
        """The phases as a small aligned table; the phase running or ended by a failure is marked ``>``."""
        return phase_table(self.phases, marked=self.running() or [self.interrupted()])


def phase_table(phases: Sequence[Phase], marked: Sequence[Optional[Phase]] = ()) -> str:
    devices = sorted({i for p in phases for i in (*p.cuda_after, *p.cuda_peak)})
    header = ["", "phase", "seconds", "RSS before -> after (peak)"]
    header += [f"cuda:{i} allocated after (peak) / reserved" for i in devices]
    header.append("")
    rows = [header]
    for p in phases:
        rss = f"{_fmt(p.rss_before)} -> {_fmt(p.rss_after) if not p.running else '...'}"
        if p.rss_peak is not None:
            rss += f" ({_fmt(p.rss_peak)})"
        row = [">" if any(p is m for m in marked) else "", "  " * p.depth + p.label,
               f"{p.seconds:.3f}" + ("+" if p.running else ""), rss]
        for i in devices:
            allocated, reserved = p.cuda_after.get(i, (None, None))
            peak = p.cuda_peak.get(i)
            row.append(f"{_fmt(allocated)} ({_fmt(peak)}) / {_fmt(reserved)}")
        row.append("running" if p.running else (f"raised {p.error}" if p.error else ""))
        rows.append(row)
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    widths[0] = 1  # the marker column keeps its place whether or not a row is marked
    lines = ["  ".join(cell.ljust(width) if c < len(header) - 1 else cell for c, (cell, width) in
                       enumerate(zip(row, widths))).rstrip() for row in rows]
    return "\n".join(lines)


def _fmt(n: Optional[float]) -> str:
    return "?" if n is None else format_bytes(n)


def _stderr_line(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


_recorders: list[PhaseRecorder] = []


def current_recorder() -> Optional[PhaseRecorder]:
    """The recorder phases go to now (the running test's, under pytest), or ``None``."""
    return _recorders[-1] if _recorders else None


@contextmanager
def recording(label: str = "", **kwargs: Any) -> Iterator[PhaseRecorder]:
    """Record the phases of a block: ``with recording(progress_every=30) as record: ...``."""
    recorder = kwargs.pop("recorder", None) or PhaseRecorder(label, **kwargs)
    _recorders.append(recorder)
    try:
        yield recorder
    finally:
        _recorders.remove(recorder)


def track_model(model: Any, source: str = "", seconds: Optional[float] = None) -> None:
    """Note that ``model`` was loaded (where from, how long): a failing test's report shows where its
    parameters are. A no-op outside a recording."""
    recorder = current_recorder()
    if recorder is not None:
        recorder.track_model(model, str(source), seconds)


def note_deadline(what: str, seconds: float, deadline_s: float) -> None:
    """Note how long a block with a deadline took, for the session summary of checks near their deadline."""
    recorder = current_recorder()
    if recorder is not None:
        recorder.deadlines.append((what, seconds, deadline_s))


# --- progress: one thread per process --------------------------------------------------------------------


class Heartbeat:
    """Calls scheduled callbacks from one daemon thread: ``schedule(key, delay, callback, every=N)``.

    ``run_due(now)`` does one pass and returns when the next callback is due, so a test can drive it with a
    fake clock and no thread (``start_thread=False``).
    """

    def __init__(self, clock: Clock = time.monotonic, start_thread: bool = True) -> None:
        self._clock = clock
        self._start_thread = start_thread
        self._cond = threading.Condition()
        self._due: dict[Any, list] = {}  # key -> [due, every, callback]
        self._thread: Optional[threading.Thread] = None
        self._waiting_until = 0.0  # while the thread waits: when it wakes; otherwise 0 (no notify needed)

    def schedule(self, key: Any, delay: float, callback: Callable[[Any], None], every: Optional[float] = None) -> None:
        with self._cond:
            due = self._clock() + delay
            self._due[key] = [due, every, callback]
            if self._start_thread and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llmload-heartbeat", daemon=True)
                self._thread.start()
            if due < self._waiting_until:
                self._cond.notify()

    def cancel(self, key: Any) -> None:
        with self._cond:
            self._due.pop(key, None)

    def run_due(self, now: Optional[float] = None) -> float:
        """Call every callback due at ``now``; returns when the next one is due (``inf``: none)."""
        calls = []
        with self._cond:
            now = self._clock() if now is None else now
            for key, entry in list(self._due.items()):
                due, every, callback = entry
                if due <= now:
                    calls.append((callback, key))
                    if every:
                        entry[0] = due + every * max(1, math.floor((now - due) / every) + 1)
                    else:
                        del self._due[key]
        for callback, key in calls:
            try:
                callback(key)
            except Exception as exc:  # a progress line must never take the test down
                _stderr_line(f"llmload: progress callback failed: {type(exc).__name__}: {exc}")
        with self._cond:
            return min((entry[0] for entry in self._due.values()), default=math.inf)

    def _run(self) -> None:
        while True:
            with self._cond:
                next_due = min((entry[0] for entry in self._due.values()), default=math.inf)
                now = self._clock()
                if next_due > now:
                    self._waiting_until = next_due
                    self._cond.wait(None if next_due == math.inf else next_due - now)
                    self._waiting_until = 0.0
                    continue
            self.run_due()


_heartbeat: Optional[Heartbeat] = None


def heartbeat() -> Heartbeat:
    """The process's heartbeat (its thread starts with the first thing scheduled)."""
    global _heartbeat
    if _heartbeat is None:
        _heartbeat = Heartbeat()
    return _heartbeat


def _after_fork_in_child() -> None:
    global _heartbeat
    _heartbeat = None  # threads do not survive fork; the child starts its own when it needs one
    _local.__dict__.clear()


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
