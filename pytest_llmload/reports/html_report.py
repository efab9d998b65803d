"""Pictures of where each model went and of memory per phase, in a self-contained HTML report.

``--llmload-html PATH`` (ini ``llmload_html``) writes one HTML file at the end of the session: a header (the loader,
the stack's versions, when and how long, counts by verdict); then each failing row (failed, error, then predicted)
as a card: its finding (the row's sentence, as the main job prints it), the known failure it names and its fix (the
row's ``fix``, as the main job and JUnit give it; the catalog's field reports linked), and its pictures; then every
other row collapsed (``<details>``) in one table, with their pictures below it. For each test that loaded a model,
two figures drawn with matplotlib (Agg): where its models went (one picture per placement, a bar per device,
cpu/disk/meta included, its bytes and the modules on it; the loads that had it listed below) and the memory of
each phase, its axis starting near the lowest value shown. A picture is embedded once, where it first appears: a
later one with the same input data (hashed, :class:`_Pictures`) says "same picture as" and links to it.
For each prediction (``--llmload-runner``), where the model would go on the runner instead: a bar per device
filled against its capacity, the modules it holds on it, the predicted failure beside it (:func:`prediction_html`,
plain HTML and CSS from the row's :attr:`~pytest_llmload.reports.row.Row.prediction`; the stand-in loads of a
prediction are this process's, and are not drawn). CSS and images are inline (palette PNG data URIs): the file can
be mailed or kept as a CI artifact alone.

With pytest-html in the run (``--html``), the same PNGs go into its report as extras (``report.extras``, the API
pytest-html documents), whether or not ``--llmload-html`` is given.

Nothing is computed twice: the device maps are those :mod:`.phases` recorded when each model was loaded
(``LoadedModel.device_map``, ``hf_device_map`` at load), the memory is each phase's record (``Phase.as_dict``),
both taken from the test's :class:`~.phases.PhaseRecorder` that :mod:`.report` keeps. The bytes on each device are
the checkpoint's tensors (read from its safetensors headers) under each ``hf_device_map`` entry: the weights as
stored, before any cast or quantization at load.

Most checks run in a child forked from the test process (:mod:`pytest_llmload.runners.isolation`), where their
loads and phases go to the child's copy of the recorder. While the report is on, a child forked during a test writes
them to a spool file as they happen, and the test process reads them back into the test's record.

Under xdist each worker puts a test's record (plain data) on its teardown report as ``report.llmload_html``;
pytest serialises a report's attributes for xdist (``pytest_report_to_serializable``), so the controller receives
it in ``pytest_runtest_logreport``, as pytest-html's controller receives ``report.extras``. Only the controller (or
a run without xdist) writes the file.

A run without ``--llmload-html`` or ``--html`` does nothing here; matplotlib is imported only to draw.
"""

from __future__ import annotations

import base64
import hashlib
import html
import importlib.util
import io
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest

from pytest_llmload.config.distribution import FIELD_REPORT_URL
from pytest_llmload.reports.known_failures import SECTION as KNOWN_FAILURE_SECTION
from pytest_llmload.reports.row import Row
from pytest_llmload.placement.picture import device_order, placement_tiers
from pytest_llmload.instruments.device_map_summary import compress_modules
from pytest_llmload.system.sizes import format_bytes

RECORD_ATTRIBUTE = "llmload_html"  # the report attribute a worker's record travels in
INSTALL_HINT = "pip install 'pytest-llmload[report]'"
PLUGIN_NAME = "llmload-html-report"

state_key = pytest.StashKey["HtmlReport"]()


def matplotlib_available() -> bool:
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a None in sys.modules (blocked), or a module without a spec
        return False


# --- configuration ----------------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    from pytest_llmload.config import settings

    path = settings.value(config, "html")
    pytest_html = bool(config.getoption("htmlpath", None)) and config.pluginmanager.hasplugin("html")
    if not path and not pytest_html:
        return
    drawing = matplotlib_available()
    if path and not drawing:
        raise pytest.UsageError(f"--llmload-html draws its figures with matplotlib, which is not installed: "
                                f"{INSTALL_HINT}")
    target = None
    if path:
        target = Path(os.path.expandvars(path)).expanduser()
        target = target if target.is_absolute() else Path(config.invocation_params.dir) / target
    state = config.stash[state_key] = HtmlReport(config, target, extras=pytest_html and drawing,
                                                 missing_matplotlib=pytest_html and not drawing)
    config.pluginmanager.register(state, PLUGIN_NAME)


def pytest_unconfigure(config: pytest.Config) -> None:
    state = config.stash.get(state_key, None)
    if state is not None and config.pluginmanager.is_registered(state):
        config.pluginmanager.unregister(state)


# --- per test: the record, and pytest-html's extras --------------------------------------------------------


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    state = item.config.stash.get(state_key, None)
    if state is None or not state.active or call.when not in ("call", "teardown"):
        return report
    if call.when == "call" and not state.extras:
        return report
    record = record_of(item)
    if record is None or _is_prediction(Row.of_report(report)):  # (its loads are stand-ins: this process's memory)
        return report
    if call.when == "teardown":
        setattr(report, RECORD_ATTRIBUTE, record)
    elif record["models"]:
        # pytest-html's convention: extras on the call report, in a makereport hookwrapper.
        from pytest_html import extras

        report.extras = [*getattr(report, "extras", []),
                         *(extras.png(base64.b64encode(png).decode("ascii"), name)
                           for name, png in figures(record, report.nodeid))]
    return report


def record_of(item: pytest.Item) -> Optional[dict]:
    """What the report shows of one test, as plain data: its models' placement and its phases' memory, from the
    test's recorder and from the isolated children it forked (their records come back through the spool)."""
    from pytest_llmload.reports.sections import recorder_key

    recorder = item.stash.get(recorder_key, None)
    if recorder is None:
        return None
    phases = [phase_dict(p) for p in list(recorder.phases)]
    models = [loaded_dict(m) for m in list(recorder.models)]
    for kind, data in _spooled():
        (phases if kind == "phase" else models).append(data)
    phases.sort(key=lambda p: p.get("started") or 0.0)
    loads = [p for p in phases if p["name"] == "load" and not p["running"]]
    return {"models": [_model_record(m, loads) for m in models], "phases": phases}


def phase_dict(p: Any) -> dict:
    return dict(p.as_dict(), label=p.label, started=p.started)


def loaded_dict(loaded: Any) -> dict:
    """A :class:`~.phases.LoadedModel` as plain data, its device map as recorded at load."""
    device_map = loaded.device_map
    if device_map:
        device_map = {str(k): v if isinstance(v, int) and not isinstance(v, bool) else str(v)
                      for k, v in device_map.items()}
    return {"kind": loaded.kind, "source": str(loaded.source or ""), "seconds": loaded.seconds, "where": loaded.where,
            "device_map": device_map or None}


def _model_record(loaded: dict, loads: list[dict]) -> dict:
    """One model load: its device map as recorded at load, grouped by device, with the bytes on each device."""
    from pytest_llmload.instruments.device_map_summary import _device_name, _tier

    seconds = loaded["seconds"]
    timed = next((p for p in loads if seconds is not None and abs(p["seconds"] - seconds) < 1e-5), None)
    if timed is not None:  # the phase that timed the load: what was loaded, how
        loads.remove(timed)
    device_map, where = loaded["device_map"], loaded["where"]
    modules: dict[str, list[str]] = {}
    if device_map:
        for key, device in device_map.items():
            modules.setdefault(_device_name(device), []).append(key or "<whole model>")
        map_source = "hf_device_map at load"
    else:
        modules[where] = ["<whole model>"]
        map_source = f"no hf_device_map: whole model on {where} (its first parameter's device)"
    sizes: Optional[dict[str, int]] = None
    unmatched = 0
    tensors = _checkpoint_tensors(loaded["source"])
    if tensors is not None:
        sizes = dict.fromkeys(modules, 0)
        for name, nbytes in tensors:
            device = _tier(name, device_map) if device_map else where
            if device is None:
                unmatched += nbytes
            else:
                sizes[device] = sizes.get(device, 0) + nbytes
    devices = sorted(modules.keys() | (sizes or {}).keys(), key=device_order)
    return {"kind": loaded["kind"], "source": loaded["source"], "seconds": seconds,
            "load": timed["detail"] if timed is not None else "", "map_source": map_source,
            "devices": [{"device": d, "modules": modules.get(d, []), "bytes": None if sizes is None else sizes.get(d, 0)}
                        for d in devices],
            "unmatched_bytes": unmatched}


# --- isolated checks: the records of a forked child --------------------------------------------------------
# Most checks run in a child forked from the test process (pytest_llmload.runners.isolation); the child inherits
# the test's recorder, and its loads and phases go there, in the child's memory, which dies with it. While a test
# runs with the report on, a child forked from it writes each model it tracks and each phase it ends to a spool
# file (JSON lines), which the test process reads back into the test's record.

_spool_dir: Optional[str] = None  # the running test's spool folder (inherited by the children it forks)
_child_spool: Optional["_Spool"] = None  # in a forked child: what writes its records


def _after_fork_in_child() -> None:
    """Opens the child's spool file at once, before the check runs: a check that watches the files its load writes
    (``record_writes``: Python's audit events) sees no open, and ``os.write`` on the descriptor raises no event."""
    global _child_spool
    if _spool_dir is None:
        return
    recorders = sys.modules.get("pytest_llmload.instruments.recorder")  # no import here: a fork may hold its lock
    recorder = recorders.current_recorder() if recorders is not None else None
    if recorder is None:
        return
    try:
        fd = os.open(os.path.join(_spool_dir, f"child-{os.getpid()}.jsonl"), os.O_WRONLY | os.O_CREAT | os.O_APPEND
                     | os.O_CLOEXEC, 0o600)
    except OSError:
        return
    if _child_spool is not None and _child_spool.recorder is recorder:  # a grandchild: the wrapping is inherited
        _child_spool.fd = fd
    else:
        _child_spool = _Spool(recorder, fd)


class _Spool:
    """Wraps a forked child's copy of the test's recorder: what it records is also written to ``fd``."""

    def __init__(self, recorder: Any, fd: int) -> None:
        self.recorder, self.fd = recorder, fd
        closed, track = recorder._closed, recorder.track_model

        def closed_and_spooled(p) -> None:
            closed(p)
            self.write("phase", dict(phase_dict(p), child=os.getpid()))

        def track_and_spool(model, source="", seconds=None):
            loaded = track(model, source, seconds)
            self.write("model", loaded_dict(loaded))
            return loaded

        recorder._closed, recorder.track_model = closed_and_spooled, track_and_spool

    def write(self, kind: str, data: dict) -> None:
        try:
            os.write(self.fd, (json.dumps([kind, data], default=str) + "\n").encode("utf-8"))
        except (OSError, TypeError, ValueError):
            pass  # a picture missing from the report, never a failing check


def _spooled() -> list[tuple[str, dict]]:
    if _spool_dir is None or not os.path.isdir(_spool_dir):
        return []
    found = []
    for name in sorted(os.listdir(_spool_dir)):
        try:
            with open(os.path.join(_spool_dir, name), encoding="utf-8") as spool:
                lines = spool.read().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                kind, data = json.loads(line)
            except ValueError:
                continue  # a line cut short by a child killed mid-write
            found.append((kind, data))
    return found


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    global _spool_dir
    state = item.config.stash.get(state_key, None)
    if state is None or not state.active:
        return (yield)
    import shutil
    import tempfile

    _spool_dir = tempfile.mkdtemp(prefix="llmload-html-")
    try:
        return (yield)
    finally:
        shutil.rmtree(_spool_dir, ignore_errors=True)
        _spool_dir = None


_TENSORS: dict[str, Optional[list[tuple[str, int]]]] = {}


def _checkpoint_tensors(source: str) -> Optional[list[tuple[str, int]]]:
    """``(name, bytes)`` of every tensor in a local safetensors checkpoint, from its headers; ``None`` where there
    is none to read (a hub id, a .bin checkpoint)."""
    if not source or not os.path.isdir(source):
        return None
    if source not in _TENSORS:
        from pytest_llmload.fixes.training_memory import checkpoint_tensors

        try:
            _TENSORS[source] = [(t.name, t.nbytes) for t in checkpoint_tensors(source)]
        except (OSError, ValueError, KeyError):
            _TENSORS[source] = None
    return _TENSORS[source]


# --- the figures -----------------------------------------------------------------------------------------

DPI = 100
WIDTH_IN = 11.0
# A chart is a few flat colours and antialiased text: as a palette PNG of this many colours it is a third of its
# full-colour size, with no difference to see (the reference loader's report: 1.5 MB before, see docs/html_report.md).
PNG_COLOURS = 64
DEVICE_COLOURS = {"cpu": "#e6862e", "disk": "#8c6d4f", "meta": "#d62728"}
CUDA_COLOURS = ("#1f77b4", "#2ca02c", "#9467bd", "#17becf", "#bcbd22", "#e377c2", "#7f7f7f", "#393b79")
LABEL_CHARS = 64
PHASE_LABEL_WIDTH = 46
# A memory axis starts at 0 only where the values shown span more than this share of the largest: else near the
# lowest, so that a rise of a few MiB on a process of hundreds is seen.
MEMORY_SPAN_FROM_ZERO = 0.5


def device_colour(device: str) -> str:
    kind, _, index = device.partition(":")
    if kind in DEVICE_COLOURS:
        return DEVICE_COLOURS[kind]
    return CUDA_COLOURS[int(index) % len(CUDA_COLOURS) if index.isdigit() else 0]


def _unit(largest: float) -> tuple[str, float]:
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if largest >= size:
            return name, float(size)
    return "B", 1.0


def _short(text: str, limit: int = LABEL_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False)) or text


def _png(fig) -> bytes:
    """The figure as a palette PNG of :data:`PNG_COLOURS` colours (Pillow is matplotlib's own dependency)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    FigureCanvasAgg(fig)
    drawn = io.BytesIO()
    fig.savefig(drawn, format="png", dpi=DPI, metadata={"Software": None})
    image = Image.open(io.BytesIO(drawn.getvalue())).convert("RGB")
    buffer = io.BytesIO()
    image.quantize(PNG_COLOURS, method=Image.Quantize.MEDIANCUT).save(buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def _test_name(nodeid: str) -> str:
    """The check's name for a check's row (``check_offload_inference``), else the test's node id."""
    from pytest_llmload.reports.progress import check_name

    name = check_name(nodeid)
    return name if name.startswith("check_") else nodeid


def _model_name(model: dict) -> str:
    name = os.path.basename(model["source"].rstrip("/\\")) or "?"
    return f"{model['kind']} from {name}"


def _style(ax) -> None:
    ax.tick_params(axis="x", labelsize=9.5)
    ax.grid(axis="x", alpha=0.35)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def placement(model: dict) -> dict:
    """What a device-map picture draws of one load: its bars (a device, its bytes, its modules) and the bytes under
    no entry. Loads with the same placement have the same picture: the report draws it once."""
    return {"devices": model["devices"], "unmatched_bytes": model.get("unmatched_bytes") or 0}


def placements(models: list[dict]) -> list[list[dict]]:
    """A test's loads grouped by placement, in the order of their first load."""
    groups: dict[str, list[dict]] = {}
    for model in models:
        groups.setdefault(json.dumps(placement(model), sort_keys=True), []).append(model)
    return list(groups.values())


def load_line(model: dict) -> str:
    """One load in words: ``LlamaForCausalLM from llama-float32-seed0 for train on cpu, lora, in 0.32 s``."""
    took = f", in {model['seconds']:.2f} s" if model.get("seconds") else ""
    what = f"{model['kind']} from {model['load']}" if model.get("load") else _model_name(model)
    return what + took


def device_map_figure(groups: list[list[dict]], titled: bool = True) -> bytes:
    """One panel per placement (:func:`placements`): a bar per device (its bytes), the modules on it written beside
    the bar. ``titled``: each panel names its loads and where its map comes from (pytest-html's extras, which have no
    text beside them); the HTML report says those in HTML, and draws each placement alone, untitled."""
    from matplotlib.figure import Figure

    heights = [(1.3 if titled else 0.75) + 0.5 * max(1, len(g[0]["devices"])) for g in groups]
    fig = Figure(figsize=(WIDTH_IN, sum(heights)), layout="constrained")
    axes = fig.subplots(len(groups), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, group in zip(axes, groups):
        drawn = placement(group[0])
        devices = drawn["devices"]
        known = all(d["bytes"] is not None for d in devices)
        raw = [d["bytes"] if known else len(d["modules"]) for d in devices]
        unit, scale = _unit(max(raw, default=0)) if known else ("", 1.0)
        values = [v / scale for v in raw]
        largest = max(values, default=0) or 1
        y = list(range(len(devices)))[::-1]
        ax.barh(y, values, color=[device_colour(d["device"]) for d in devices], height=0.62, edgecolor="#333333",
                linewidth=0.6)
        ax.set_yticks(y, [d["device"] for d in devices], fontsize=11.5, fontweight="bold")
        ax.set_xlim(0, largest * 1.02)
        ax.set_ylim(-0.6, len(devices) - 0.4)
        for yi, d, v in zip(y, devices, values):
            count = len(d["modules"])
            size = format_bytes(d["bytes"]) if known else "size unknown"
            text = f"{size} \u00b7 {count} module{'s' if count != 1 else ''}: {compress_modules(d['modules'])}"
            inside = v > 0.55 * largest
            dark = inside and d["device"] not in ("cpu",)
            room = v / largest if inside else 1 - v / largest  # of the axes' width, ~150 characters at this size
            width = max(30, int(140 * room))
            ax.text(v - largest * 0.015 if inside else v + largest * 0.012, yi, _wrap(_short(text, 3 * width), width),
                    va="center", ha="right" if inside else "left", fontsize=10,
                    color="white" if dark else "black")
        label = ("weights on the device ({}, as stored in the checkpoint)".format(unit) if known
                 else "modules on the device (the checkpoint's sizes could not be read)")
        if drawn["unmatched_bytes"]:
            label += f"; {format_bytes(drawn['unmatched_bytes'])} of tensors under no device-map entry"
        ax.set_xlabel(label, fontsize=10)
        _style(ax)
        if titled:
            title = "; ".join(load_line(m) for m in group)
            detail = f"device map: {group[0]['map_source']}"
            ax.set_title(_wrap(_short(title, 280), 110), fontsize=11, fontweight="bold", loc="left", pad=18)
            ax.text(0, 1.02, _wrap(detail, 140), transform=ax.transAxes, fontsize=9.5, color="#424a53", va="bottom")
    return _png(fig)


def _phase_label(p: dict) -> str:
    import textwrap

    label = ("\u2717 " if p.get("error") else "") + (p.get("label") or p["name"])
    lines = textwrap.wrap(label, PHASE_LABEL_WIDTH, break_on_hyphens=False) or [label]
    if len(lines) > 2:
        lines = [lines[0], _short(" ".join(lines[1:]), PHASE_LABEL_WIDTH)]
    indent = "   " * int(p.get("depth") or 0)
    return "\n".join(indent + line for line in lines)


def memory_rows(phases: list[dict]) -> list[dict]:
    """What the memory figure draws of a test's phases (the phases with a figure), and nothing else: two tests
    with the same rows have the same picture."""
    return [{"label": _phase_label(p), "error": p.get("error") or "", "child": bool(p.get("child")),
             "rss_before": p.get("rss_before") or 0,
             "rss_peak": p["rss_peak"] if p.get("rss_peak") is not None else (p.get("rss_after") or 0),
             "cuda_after": {str(i): int(v[0]) for i, v in (p.get("cuda_after") or {}).items()},
             "cuda_peak": {str(i): int(v) for i, v in (p.get("cuda_peak") or {}).items()}}
            for p in phases
            if p.get("rss_peak") is not None or p.get("rss_after") is not None or p.get("cuda_peak")]


def axis_start(values: list[int]) -> int:
    """Where a memory axis starts, in bytes: 0 where the values span most of the way from 0 (or one is 0), else a
    round number a little under the lowest value, so that the differences between the bars are what is seen."""
    low, high = min(values, default=0), max(values, default=0)
    if low <= 0 or high - low > MEMORY_SPAN_FROM_ZERO * high:
        return 0
    _, scale = _unit(high)  # (round in the axis' unit: it starts at 320 MiB, not at 335544320 bytes)
    span = max(high - low, high / 50) / scale  # (a flat test: the bars' ends still apart from the axis)
    step = 10 ** math.floor(math.log10(span))
    return max(0, int((low / scale - 0.3 * span) // step * step * scale))


def memory_figure(rows: list[dict]) -> Optional[bytes]:
    """Per phase (:func:`memory_rows`): the process RSS before it and at its peak (from the kernel), and each GPU's
    peak allocation; each axis starts near the lowest value it shows (:func:`axis_start`), and says so."""
    from matplotlib.figure import Figure

    if not rows:
        return None
    cuda = sorted({i for p in rows for i in p["cuda_peak"]}, key=int)
    panels = [None, *cuda]
    height = 1.0 + 0.5 * len(rows)
    fig = Figure(figsize=(WIDTH_IN, height * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    children = {p["child"] for p in rows}  # {True}: every phase ran in an isolated child
    y = list(range(len(rows)))[::-1]
    for ax, index in zip(axes, panels):
        if index is None:
            before, peak = [p["rss_before"] for p in rows], [p["rss_peak"] for p in rows]
            colour, what = "#e6862e", "process RSS"
            title = ("Process RSS: grey = before the phase, orange = its peak during the phase (the kernel's "
                     "high-water mark)" + ("; every phase ran in the check's isolated child process"
                                           if children == {True} else "; [child]: in the check's isolated child "
                                           "process" if True in children else ""))
        else:
            before = [p["cuda_after"].get(index, 0) for p in rows]
            peak = [p["cuda_peak"].get(index, 0) for p in rows]
            colour, what = device_colour(f"cuda:{index}"), f"cuda:{index} allocated"
            title = f"cuda:{index}: grey = allocated by torch at the end of the phase, coloured = its peak during it"
        start = axis_start([*before, *peak])
        unit, scale = _unit(max([*peak, *before, 1]))
        low, largest = start / scale, max([*peak, *before, 1]) / scale
        room = (largest - low) or 1.0
        ax.barh([v + 0.19 for v in y], [b / scale for b in before], height=0.36, color="#b9b9b9")
        ax.barh([v - 0.19 for v in y], [k / scale for k in peak], height=0.36, color=colour)
        for yi, b, k, p in zip(y, before, peak, rows):
            grew = f"  (+{format_bytes(k - b)})" if index is None and k > b else ""
            ax.text(k / scale + room * 0.01, yi - 0.19, f"{format_bytes(k)}{grew}", va="center", fontsize=9.5)
            if p["error"] and index is None:
                ax.text(k / scale + room * 0.01, yi + 0.19, _short(f"raised {p['error']}", 34), va="center",
                        fontsize=9, color="#c00000")
        ax.set_xlim(low, low + room * 1.5)  # (room on the right for the figures written beside the bars)
        ax.set_ylim(-0.65, len(rows) - 0.35)
        ax.set_yticks(y, [p["label"] + ("  [child]" if p["child"] and len(children) > 1 else "") for p in rows],
                      fontsize=9.5)
        for tick, p in zip(ax.get_yticklabels(), rows):
            if p["error"]:
                tick.set_color("#c00000")
        ax.set_xlabel(f"{what} ({unit})" + (f"; the axis starts at {format_bytes(start)}, not 0" if start else ""),
                      fontsize=10, color="#c00000" if start else "black")
        ax.set_title(_wrap(title, 84), fontsize=10, loc="left", color="#424a53")
        _style(ax)
    return _png(fig)


def figures(record: dict, nodeid: str) -> list[tuple[str, bytes]]:
    """The PNGs of one test for pytest-html's extras: its device maps (a panel per placement) and its memory per
    phase (only for a test that loaded a model)."""
    if not record.get("models"):
        return []
    found = [("llmload: device map", device_map_figure(placements(record["models"])))]
    memory = memory_figure(memory_rows(record.get("phases", [])))
    if memory is not None:
        found.append(("llmload: memory per phase", memory))
    return found


def placement_text(model: dict) -> str:
    """A placement in words (its picture's caption): ``cpu 224.5 KiB (model.embed_tokens, model.layers.0); ...``."""
    return "; ".join(f"{d['device']} {format_bytes(d['bytes']) if d['bytes'] is not None else '?'} "
                     f"({compress_modules(d['modules'])})" for d in model["devices"])


def memory_text(phases: list[dict]) -> str:
    """The highest peak in words (the figure's caption)."""
    peaks = [(p["rss_peak"], p.get("label") or p["name"]) for p in phases if p.get("rss_peak") is not None]
    parts = []
    if peaks:
        peak, label = max(peaks)
        parts.append(f"peak process RSS {format_bytes(peak)} in phase '{label}'")
    cuda: dict[str, tuple[int, str]] = {}
    for p in phases:
        for index, peak in (p.get("cuda_peak") or {}).items():
            if peak > cuda.get(index, (-1, ""))[0]:
                cuda[index] = (peak, p.get("label") or p["name"])
    parts += [f"cuda:{i} peak allocated {format_bytes(b)} in phase '{label}'" for i, (b, label) in sorted(cuda.items())]
    return "; ".join(parts)


# --- the session: rows, and the file ---------------------------------------------------------------------


def _outcome(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return "xpassed" if report.passed else "xfailed"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return report.outcome


class HtmlReport:
    """The run's rows (in the xdist controller, from the workers' reports) and the file written at its end."""

    def __init__(self, config: pytest.Config, path: Optional[Path], *, extras: bool, missing_matplotlib: bool) -> None:
        self.config = config
        self.path = path
        self.extras = extras
        self.missing_matplotlib = missing_matplotlib
        self.rows: dict[str, dict] = {}
        self.started = time.time()
        self.written: Optional[str] = None
        self.write_error: Optional[str] = None

    @property
    def active(self) -> bool:
        """Whether anything is drawn: the file, or pytest-html's extras."""
        return self.path is not None or self.extras

    @property
    def collects(self) -> bool:
        return self.path is not None and not hasattr(self.config, "workerinput")

    def _row(self, nodeid: str) -> dict:
        return self.rows.setdefault(nodeid, {"nodeid": nodeid, "outcome": "passed", "seconds": 0.0, "row": None,
                                             "note": "", "record": None, "known": ""})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.collects:
            return
        row = self._row(report.nodeid)
        row["seconds"] += report.duration
        outcome = _outcome(report)
        if outcome != "passed" and row["outcome"] in ("passed", "skipped") or outcome == "error":
            row["outcome"] = outcome
        row["row"] = Row.of_report(report) or row["row"]  # the check's row, taken as it is
        if report.skipped and isinstance(report.longrepr, tuple):
            row["note"] = report.longrepr[2].removeprefix("Skipped: ")
        elif report.failed and not row["note"]:
            row["note"] = _first_line(report.longreprtext)
        # A test that is not a check: the known failure its text matched, as pytest's report section says it.
        row["known"] = next((text for name, text in report.sections if name == KNOWN_FAILURE_SECTION), row["known"])
        record = getattr(report, RECORD_ATTRIBUTE, None)
        if record is not None:
            row["record"] = record

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if self.collects and report.failed:
            row = self._row(report.nodeid or "(collection)")
            row["outcome"], row["note"] = "error", _first_line(report.longreprtext)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if not self.collects:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(render_html(self.config, list(self.rows.values()), self.started, time.time()),
                                 encoding="utf-8")
            self.written = str(self.path)
        except OSError as exc:
            self.write_error = f"{type(exc).__name__}: {exc}"

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(self.config, "workerinput"):
            return
        if self.written:
            terminalreporter.write_sep("-", f"llmload: HTML report: {Path(self.written).as_uri()}")
        elif self.write_error:
            terminalreporter.write_sep("-", f"llmload: the HTML report was not written: {self.write_error}", red=True)
        if self.missing_matplotlib:
            terminalreporter.write_line(f"llmload: no pictures in pytest-html's report: matplotlib is not installed "
                                        f"({INSTALL_HINT})")


def _first_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[0][1:].strip() if errors else lines[-1] if lines else "")[:300]


VERDICT_COLOURS = {"passed": "#1a7f37", "failed": "#cf222e", "error": "#b35900", "predicted": "#8250df",
                   "skipped": "#6e7781", "not exercised": "#6e7781", "xfailed": "#6e7781", "xpassed": "#b35900"}
# The rows a red build is opened for: first, each as a card, in this order. Every other row is collapsed below them.
CARDS = ("failed", "error", "predicted")
FIELD_REPORT = re.compile(r"\b([\w.-]+/[\w.-]+)#(\d+)\b")  # a catalog's field report: owner/repo#number

CSS = """
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; color: #1f2328;
       margin: 24px auto; max-width: 1200px; padding: 0 16px; }
h1 { font-size: 26px; margin: 0 0 6px; }
h2 { font-size: 20px; margin: 24px 0 10px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
h3 { font-size: 17px; margin: 22px 0 6px; word-break: break-all; }
h4 { font-size: 14px; margin: 14px 0 4px; }
.meta { color: #424a53; margin: 2px 0; }
.counts span { display: inline-block; margin: 6px 8px 0 0; }
table { border-collapse: collapse; width: 100%; font-size: 14px; table-layout: fixed; }
col.c-test { width: 33%; } col.c-verdict { width: 49%; } col.c-failure { width: 11%; } col.c-seconds { width: 7%; }
th, td { border: 1px solid #d0d7de; padding: 5px 8px; text-align: left; vertical-align: top; }
th { background: #f6f8fa; }
td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
td.test, td.failure { overflow-wrap: anywhere; }
.verdict { display: inline-block; color: #fff; border-radius: 10px; padding: 1px 9px; font-size: 13px;
           font-weight: 600; white-space: nowrap; }
.sentence { white-space: pre-wrap; overflow-wrap: anywhere; color: #424a53; font-size: 13px; margin-top: 3px; }
code { font-size: 13px; }
figure { margin: 6px 0 14px; }
figure img { max-width: 100%; height: auto; border: 1px solid #d0d7de; display: block; }
figcaption { color: #57606a; font-size: 13px; }
figcaption ul { margin: 2px 0; padding-left: 20px; }
a { color: #0969da; }
.card { border: 1px solid #d0d7de; border-left: 6px solid #cf222e; border-radius: 6px; padding: 4px 18px 8px;
        margin: 12px 0 22px; }
.card.error { border-left-color: #b35900; } .card.predicted { border-left-color: #8250df; }
.card h3 { margin-top: 10px; }
.label { font-weight: 600; color: #1f2328; }
.finding .sentence { font: 13px/1.45 ui-monospace, "DejaVu Sans Mono", monospace; color: #1f2328;
                     background: #fff5f5; border: 1px solid #ffcecb; border-radius: 4px; padding: 8px 10px; }
.fix { background: #dafbe1; border: 1px solid #aceebb; border-radius: 4px; padding: 6px 10px; margin: 10px 0; }
.fix p { margin: 3px 0; }
.fix pre { white-space: pre-wrap; margin: 0; font-size: 13px; }
.notes { color: #424a53; font-size: 13px; }
.same { color: #57606a; font-size: 13px; margin: 2px 0; font-style: italic; }
details.rest { margin: 24px 0; }
details.rest > summary { cursor: pointer; font-size: 20px; font-weight: 600; padding: 4px 0;
                         border-bottom: 1px solid #d0d7de; }
details.rest > summary .verdict { font-size: 13px; vertical-align: middle; }
details.rest > summary > span { margin-left: 10px; font-size: 15px; }
.prediction { display: flex; gap: 16px; align-items: flex-start; margin: 6px 0 18px; }
.pred-bars { flex: 3; min-width: 0; }
.pred-verdict { flex: 1; min-width: 0; border-left: 3px solid #8250df; padding: 2px 0 2px 10px; font-size: 14px; }
.prediction[data-failure=""] .pred-verdict { border-left-color: #1a7f37; }
.device { display: flex; align-items: center; gap: 8px; margin: 4px 0; font-size: 13px; }
.device .dev { width: 56px; font-weight: 600; text-align: right; flex: none; }
.device .bar { position: relative; flex: 1; height: 22px; background: #f6f8fa; border: 1px solid #8c959f;
               border-radius: 3px; overflow: hidden; min-width: 0; }
.device.over .bar { border: 2px solid #cf222e; }
.device .bar .peak, .device .bar .weights { position: absolute; left: 0; top: 0; bottom: 0; }
.device .bar .peak { background: #d0d7de; }
.device .bar .holds { position: absolute; left: 6px; right: 6px; top: 2px; white-space: nowrap; overflow: hidden;
                      text-overflow: ellipsis; color: #1f2328; text-shadow: 0 0 3px #fff, 0 0 3px #fff; }
.device .figures { width: 250px; flex: none; font-variant-numeric: tabular-nums; color: #424a53; }
.device.over .figures b { color: #cf222e; }
"""


def _severity(kind: str) -> tuple[int, str]:
    order = ("failed", "error", "predicted", "xpassed", "not exercised", "passed", "skipped", "xfailed")
    return (order.index(kind) if kind in order else len(order), kind)


def _row_severity(row: dict) -> tuple[int, str]:
    return _severity(_verdict_of(row)[0])


def _badge(kind: str) -> str:
    return (f'<span class="verdict" style="background:{VERDICT_COLOURS.get(kind, "#57606a")}">'
            f"{html.escape(kind)}</span>")


def _verdict_of(row: dict) -> tuple[str, str, str]:
    """(kind, failure, sentence) of a row: the check's verdict where it has one, else pytest's outcome."""
    check_row = row["row"]
    if check_row is None:
        return row["outcome"], "", row["note"]
    kind = check_row.verdict
    if row["outcome"] == "error" and kind == "passed":  # a teardown error after the check passed
        kind = "error"
    failure = check_row.failure or (f"guards {check_row.guards}" if check_row.guards else "")
    return kind, failure, check_row.sentence or row["note"]


def _name(row: dict) -> str:
    """A row's name: its check's (its row's), else the test's name in its node id."""
    from pytest_llmload.reports.progress import check_name

    return row["row"].check if row["row"] is not None else check_name(row["nodeid"])


def _anchor(nodeid: str) -> str:
    return "t-" + re.sub(r"[^A-Za-z0-9_-]+", "-", nodeid).strip("-")


class _Pictures:
    """The pictures already in the file, by what they show (a hash of the figure's input data, never of its PNG):
    each is drawn and embedded once; a later row with the same one refers to it."""

    def __init__(self) -> None:
        self.first: dict[str, str] = {}  # key: the row that shows it

    def html(self, data: Any, draw, alt: str, row_name: str) -> str:
        key = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode("utf-8")).hexdigest()[:16]
        if key in self.first:
            return (f'<p class="same">same picture as <a href="#p-{key}">{html.escape(self.first[key])}\'s</a></p>')
        png = draw()
        self.first[key] = row_name
        return (f'<img id="p-{key}" alt="{html.escape(alt)}" '
                f'src="data:image/png;base64,{base64.b64encode(png).decode("ascii")}">')


def _pictures_html(row: dict, drawn: _Pictures) -> str:
    """A test's pictures: a device map per placement, the loads that had it listed below it; its memory per phase."""
    esc, record, name = html.escape, row["record"], _name(row)
    parts = ["<h4>Where the models went</h4>"]
    if not record["models"]:  # a failing test's card: the loader raised before it returned one, say
        parts.append('<p class="same">no model came back to be drawn (the finding says where it stopped)</p>')
    for group in placements(record["models"]):
        picture = drawn.html(["device map", placement(group[0])], lambda: device_map_figure([group], titled=False),
                             f"llmload: device map: {row['nodeid']}", name)
        loads = "".join(f"<li>{esc(load_line(m))} (device map: {esc(m['map_source'])})</li>" for m in group)
        parts.append(f'<figure class="device-map">{picture}<figcaption><b>{esc(placement_text(group[0]))}</b>'
                     f"<ul>{loads}</ul></figcaption></figure>")
    memory = memory_rows(record.get("phases", []))
    if memory:
        picture = drawn.html(["memory", memory], lambda: memory_figure(memory),
                             f"llmload: memory per phase: {row['nodeid']}", name)
        parts.append(f'<h4>Memory per phase</h4><figure class="memory">{picture}'
                     f'<figcaption>{esc(memory_text(record["phases"]))}</figcaption></figure>')
    return "".join(parts)


def _fix_html(failure_id: str, fix: str) -> str:
    """The known failure a row names and its fix, in the fix's own words (the row's, as the main job and JUnit give
    it); its write-up or the field reports it comes from (linked), from the catalog where it is one of ours."""
    from pytest_llmload import failures as catalog

    esc = html.escape
    known = catalog.BY_ID.get(failure_id)
    about = ""
    if known is not None:
        about = f": {esc(known.title)}"
        if known.write_up.startswith("seeds/"):
            about += f" (write-up {esc(known.write_up.rpartition('/')[2][:3])})"
        else:
            about += "<br>field reports: " + ", ".join(
                f'<a href="{esc(FIELD_REPORT_URL.format(repo=repo, number=number))}">{esc(repo)}#{number}</a>'
                for repo, number in dict.fromkeys(FIELD_REPORT.findall(known.write_up)))
    return (f'<div class="fix"><p><span class="label">Known failure</span> <code>{esc(failure_id)}</code>{about}</p>'
            f'<p><span class="label">fix ({esc(failure_id)}):</span> {esc(fix)}</p></div>')


def _card(row: dict, drawn: _Pictures) -> str:
    """A failing row (failed, error, predicted): what failed, what was found, the known failure and its fix, and
    its pictures (a prediction's: where the model would go)."""
    esc = html.escape
    kind, failure, sentence = _verdict_of(row)
    check_row, nodeid, name = row["row"], row["nodeid"], _name(row)
    finding = check_row.sentence.removeprefix(f"{check_row.check}: ") if check_row else sentence
    guards = f" &middot; guards {esc(check_row.guards)}" if check_row and check_row.guards else ""
    parts = [f'<section class="card {esc(kind)}" id="{_anchor(nodeid)}" data-check="{esc(name)}" '
             f'data-verdict="{esc(kind)}">',
             f"<h3>{esc(name)} {_badge(kind)}</h3>",
             f'<p class="meta"><code>{esc(nodeid)}</code> &middot; {row["seconds"]:.2f} s{guards}</p>',
             f'<div class="finding"><span class="label">Finding</span><div class="sentence">{esc(finding)}</div></div>']
    if check_row and check_row.notes:
        parts.append(f'<p class="notes"><span class="label">How it was judged:</span> {esc(check_row.note)}</p>')
    if check_row and check_row.fix and check_row.failure:
        parts.append(_fix_html(check_row.failure, check_row.fix))
    elif check_row and check_row.fix:  # the loader's own error, a known loader fault (loader.faults)
        parts.append(f'<div class="fix"><p><span class="label">fix (the loader):</span> <code>{esc(check_row.fix)}'
                     '</code></p></div>')
    elif row.get("known"):  # a test that runs no check: the known failure its text matched
        parts.append(f'<div class="fix"><span class="label">Known failure</span><pre>{esc(row["known"])}</pre></div>')
    if _is_prediction(check_row):
        parts.append(prediction_html(check_row))
    elif row["record"] and (row["record"].get("models") or memory_rows(row["record"].get("phases", []))):
        parts.append(_pictures_html(row, drawn))
    return "".join(parts) + "</section>"


def _table_row(row: dict, linked: bool) -> str:
    esc = html.escape
    kind, failure, sentence = _verdict_of(row)
    nodeid, name = row["nodeid"], _name(row)
    link = f' &middot; <a href="#{_anchor(nodeid)}">pictures</a>' if linked else ""
    return (f'<tr data-check="{esc(name)}" data-verdict="{esc(kind)}"><td class="test"><b>{esc(name)}</b>{link}<br>'
            f"<code>{esc(nodeid)}</code></td><td>{_badge(kind)}"
            + (f'<div class="sentence">{esc(sentence)}</div>' if sentence else "") + "</td>"
            f"<td class=\"failure\">{esc(failure)}</td><td class=\"num\">{row['seconds']:.2f}</td></tr>")


def _counts(rows: list[dict]) -> str:
    from collections import Counter

    kinds = Counter(_verdict_of(row)[0] for row in rows)
    return "".join(f"<span>{_badge(kind)} {kinds[kind]}</span>" for kind in sorted(kinds, key=_severity))


def render_html(config: pytest.Config, rows: list[dict], started: float, ended: float) -> str:
    """The file: the header and counts; the failing rows first, each as a card; every other row collapsed below."""
    from importlib import metadata

    from pytest_llmload.reports.header import header_lines

    esc = html.escape
    loaders = sorted({row["row"].loader for row in rows if row["row"] is not None and row["row"].loader})
    head = header_lines(config)[0].removeprefix("llmload: ")
    chosen, _, stack = head.removeprefix("loader ").partition("; ")
    if loaders and chosen.split(" (from ")[0] not in loaders:  # the rows name the loader they ran
        chosen = ", ".join(loaders)
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
    cards = sorted((row for row in rows if _verdict_of(row)[0] in CARDS), key=_row_severity)
    rest = [row for row in rows if _verdict_of(row)[0] not in CARDS]
    parts = [
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>pytest-llmload report</title>", f"<style>{CSS}</style>", "</head>", "<body>",
        "<h1>pytest-llmload report</h1>",
        f'<p class="meta"><b>loader:</b> {esc(chosen)}</p>',
        f'<p class="meta"><b>stack:</b> {esc(stack)}</p>',
        f'<p class="meta"><b>python</b> {esc(sys.version.split()[0])}, <b>pytest</b> {esc(metadata.version("pytest"))}; '
        f"started {esc(when)}, took {ended - started:.1f} s; {len(rows)} test{'s' if len(rows) != 1 else ''}</p>",
        f'<p class="counts">{_counts(rows)}</p>',
    ]
    drawn = _Pictures()  # (in the order of the page: a picture is embedded where it is first seen)
    if cards:
        parts.append(f"<h2>Failures ({len(cards)})</h2>")
        parts += [_card(row, drawn) for row in cards]
    else:
        parts.append('<p class="meta">Nothing failed: every row is below, collapsed (click to open).</p>')
    if not rest:
        return "\n".join(parts + ["</body>", "</html>", ""])
    predictions = [row for row in rest if _is_prediction(row["row"])]
    predicted = {row["nodeid"] for row in predictions}
    pictured = [row for row in rest if row["record"] and row["record"].get("models") and row["nodeid"] not in predicted]
    linked = predicted | {row["nodeid"] for row in pictured}  # (the rows with a section below the table)
    rows_word = f"row{'s' if len(rest) != 1 else ''}"
    summary = f"{len(rest)} other {rows_word}" if cards else f"All {len(rest)} {rows_word}"
    parts += [f'<details class="rest"><summary>{summary} {_counts(rest)}</summary>',
              '<table><colgroup><col class="c-test"><col class="c-verdict"><col class="c-failure">'
              '<col class="c-seconds"></colgroup><thead><tr><th>test / check</th><th>verdict</th>'
              "<th>known failure</th><th>seconds</th></tr></thead><tbody>"]
    parts += [_table_row(row, row["nodeid"] in linked) for row in sorted(rest, key=_row_severity)]
    parts.append("</tbody></table>")
    if pictured:
        parts.append("<h2>Where the models went, and memory per phase</h2>")
        parts.append('<p class="meta">Bars: the bytes of the checkpoint\'s tensors under each device-map entry '
                     "(as stored, before any cast or quantization), and each phase's memory as recorded.</p>")
    for row in pictured:
        parts.append(f'<section id="{_anchor(row["nodeid"])}" data-check="{esc(_name(row))}">'
                     f'<h3>{esc(_name(row))} {_badge(_verdict_of(row)[0])}</h3>'
                     f"{_pictures_html(row, drawn)}</section>")
    if predictions:
        parts.append("<h2>Where the model would go: the predictions</h2>")
        parts.append('<p class="meta">Per prediction, a bar per device of the runner profile, filled by what the '
                     "planned map puts there against the device's capacity (solid: the weights; lighter: the "
                     "predicted peak of a training step or of DeepSpeed's model states), with the modules it holds; "
                     "beside it, the failure the runner would hit. Planned, not measured: nothing was loaded.</p>")
    for row in predictions:
        check_row = row["row"]
        parts.append(f'<h3 id="{_anchor(row["nodeid"])}">{esc(check_row.check)} {_badge(_verdict_of(row)[0])}</h3>'
                     + prediction_html(check_row))
    parts += ["</details>", "</body>", "</html>", ""]
    return "\n".join(parts)


def _is_prediction(row: Optional[Row]) -> bool:
    """A prediction's row: it carries where the model would go, or predicts a failure (a placement refused)."""
    return row is not None and (row.prediction is not None or row.verdict == "predicted")


def _percent(part: Optional[int], whole: Optional[int]) -> float:
    return 0.0 if not part or not whole else min(100.0, 100.0 * part / whole)


def prediction_html(check_row: Row) -> str:
    """One prediction's bar group: a bar per device filled against its capacity, the modules it holds written on it,
    and the verdict beside the bars (the failure the runner would hit, or what was found). Plain HTML and CSS: the
    figures need no drawing library."""
    esc = html.escape
    prediction = check_row.prediction or {}
    failure = check_row.failure if check_row.verdict == "predicted" else None
    head = (f'<div class="prediction" data-check="{esc(check_row.check)}" '
            f'data-runner="{esc(prediction.get("runner", ""))}" data-failure="{esc(failure or "")}">')
    bars = []
    for d in prediction.get("devices", []):
        capacity, weights, peak = d["capacity"], d["weights"], d["peak"]
        over = capacity is not None and peak is not None and peak > capacity
        holds = prediction["placement"].get(d["device"], "")
        if weights is None:
            figures = f"{d['modules']} module{'s' if d['modules'] != 1 else ''}; sizes not planned"
        else:
            figures = format_bytes(weights) + (f" (peak {format_bytes(peak)})" if peak not in (None, weights) else "")
            if capacity is not None:
                figures += f" of {format_bytes(capacity)} ({100 * (peak or weights) / capacity:.0f}%)"
        data = " ".join(f'data-{key}="{"" if value is None else value}"' for key, value in (
            ("capacity", capacity), ("weights", weights), ("peak", peak), ("modules", d["modules"])))
        bars.append(
            f'<div class="device{" over" if over else ""}" data-device="{esc(d["device"])}" {data}>'
            f'<span class="dev">{esc(d["device"])}</span>'
            f'<span class="bar" title="{esc(holds)}">'
            f'<span class="peak" style="width:{_percent(peak, capacity):.1f}%"></span>'
            f'<span class="weights" style="width:{_percent(weights, capacity):.1f}%;'
            f'background:{device_colour(d["device"])}"></span>'
            f'<span class="holds">{esc(holds)}</span></span>'
            f'<span class="figures">{esc(figures)}{" <b>OVER</b>" if over else ""}</span></div>')
    if prediction:
        what = f"{prediction['model']} on {prediction['runner']}: {placement_tiers(prediction)}"
        body = f'<p class="meta">{esc(what)}</p>' + "".join(bars)
    else:
        body = '<p class="meta">no map: the placement was not planned (the sentence says why)</p>'
    said = prediction.get("reason") or check_row.sentence
    verdict = (f'<div class="pred-verdict"><b>{esc("would hit " + failure if failure else "no failure predicted")}'
               f'</b><div class="sentence">{esc(said)}</div></div>')
    return head + f'<div class="pred-bars">{body}</div>' + verdict + "</div>"
