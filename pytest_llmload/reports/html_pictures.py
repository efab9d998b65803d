"""The HTML report's pictures, drawn with matplotlib (Agg), imported only to draw: where a test's models went (one
picture per placement, a bar per device, its bytes and the modules on it) and the memory of each phase, its axis
starting near the lowest value shown; each a palette PNG, also pytest-html's extras (:func:`figures`).
"""

from __future__ import annotations

import io
import json
import math
import os

from pytest_llmload.instruments.device_map_summary import compress_modules
from pytest_llmload.system.sizes import format_bytes

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
