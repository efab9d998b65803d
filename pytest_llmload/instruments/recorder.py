"""Where phases go: the record of one test (or one script run), with the models it loaded and the deadlines it met.

A :class:`PhaseRecorder` is entered with :func:`recording` (the plugin enters one per test); every phase opened
meanwhile (:mod:`pytest_llmload.instruments.phases`) goes into it, a long one prints a progress line on the
heartbeat (:mod:`pytest_llmload.instruments.heartbeat`), and :meth:`PhaseRecorder.table` shows them. Outside a
recording, :func:`track_model` and :func:`note_deadline` do nothing.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional

from pytest_llmload.instruments.heartbeat import Clock, Heartbeat, heartbeat, stderr_line
from pytest_llmload.system.sizes import format_bytes

# A phases.Phase (that module imports this one, never the other way round: no circle, not even for type checkers).
Phase = Any


# What a model's class does for a name it lacks: getattr(model, name, default) and hasattr (transformers' and
# accelerate's too) catch AttributeError only.
MODEL_ATTRIBUTE_FIX = ("raise AttributeError(name)  # in the model class's __getattr__, for a name it does not have "
                       "(not KeyError or another error)")


class ModelAttributeError(Exception):
    """The loader's model raised when its attribute was read (a ``__getattr__`` that raises ``KeyError`` for a name
    it lacks, say): the model's fault, not the reader's. The loader's seam gives it to the judging as the model's."""

    def __init__(self, model: Any, attribute: str, error: BaseException) -> None:
        self.attribute, self.error = attribute, error
        super().__init__(f"the loader's model ({type(model).__name__}) raised {type(error).__name__}: {error} when "
                         f"pytest-llmload read its attribute {attribute!r}; a model's __getattr__ must raise "
                         "AttributeError for a name it does not have")


def _read(model: Any, attribute: str, default: Any = None) -> Any:
    try:
        return getattr(model, attribute, default)
    except Exception as exc:
        raise ModelAttributeError(model, attribute, exc) from exc


class LoadedModel:
    """A model loaded during a test: what it is, where from, how long it took, where it went. Holds the
    model weakly: a test that frees a model to load the next one is not kept from doing so."""

    def __init__(self, model: Any, source: str, seconds: Optional[float]) -> None:
        self.kind = type(model).__name__
        self.source = source
        self.seconds = seconds
        device_map = _read(model, "hf_device_map")
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
        parameters = _read(model, "parameters", lambda: ())
        try:
            for parameter in parameters():
                return str(parameter.device)
        except Exception as exc:
            raise ModelAttributeError(model, "parameters()", exc) from exc
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
                 heartbeat: Optional[Heartbeat] = None) -> None:
        self.label = label
        self.progress_every = progress_every or None
        self.emit = emit or stderr_line
        self.clock = clock
        self.heartbeat = heartbeat
        self.phases: list[Phase] = []
        self.models: list[LoadedModel] = []
        self.deadlines: list[tuple[str, float, float]] = []  # (what, seconds taken, deadline seconds)
        # What the children forked during the test recorded (their models and phases, as plain data): each child's
        # copy of this recorder dies with it, so they come back with its answer (pytest_llmload.runners.children).
        self.from_children: list[dict] = []
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

    def mark(self) -> tuple[int, int, int]:
        """How much is recorded now: :meth:`artefacts` from a mark gives only what came after it (a forked child's
        own records, not the parent's it inherited)."""
        return len(self.models), len(self.phases), len(self.from_children)

    def artefacts(self, since: tuple[int, int, int] = (0, 0, 0)) -> dict:
        """The models and phases recorded (since :meth:`mark` ``since``), the children's included, as plain data:
        ``{"models": [...], "phases": [...]}``, each model with its device map as recorded at load, each phase
        with its label and start (what the HTML report draws)."""
        models = [_loaded_dict(m) for m in list(self.models)[since[0]:]]
        phases = [dict(p.as_dict(), label=p.label, started=p.started) for p in list(self.phases)[since[1]:]]
        for child in list(self.from_children)[since[2]:]:
            models += child.get("models") or []
            phases += child.get("phases") or []
        return {"models": models, "phases": phases}

    def add_from_child(self, artefacts: dict) -> None:
        """What a child's copy of this recorder saw (its :meth:`artefacts` since the fork)."""
        self.from_children.append(artefacts)

    def running(self) -> list[Phase]:
        return [p for p in self.phases if p.running]

    def interrupted(self) -> Optional[Phase]:
        """The innermost phase that a failure ended (a raised exception, a pytest-timeout ``Failed``)."""
        failed = [p for p in self.phases if p.error is not None]
        return max(failed, key=lambda p: (p.depth, p.started or 0.0)) if failed else None

    def table(self) -> str:
        """The phases as a small aligned table; the phase running or ended by a failure is marked ``>``."""
        return phase_table(self.phases, marked=self.running() or [self.interrupted()])


def _loaded_dict(loaded: LoadedModel) -> dict:
    """A :class:`LoadedModel` as plain data, its device map as recorded at load."""
    device_map = loaded.device_map
    if device_map:
        device_map = {str(k): v if isinstance(v, int) and not isinstance(v, bool) else str(v)
                      for k, v in device_map.items()}
    return {"kind": loaded.kind, "source": str(loaded.source or ""), "seconds": loaded.seconds, "where": loaded.where,
            "device_map": device_map or None}


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
