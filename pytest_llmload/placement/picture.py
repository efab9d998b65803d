"""A prediction's placement in words: how many modules and bytes go to each of gpu, cpu and disk, a line per device
against its capacity, and the block the main job's table and pytest's terminal print. Read from the plain record a
prediction makes (:meth:`pytest_llmload.prediction.records.Prediction.record`), so the main job's parent, which
imports no check, says it from the progress file. Imports nothing but the size printer."""

from __future__ import annotations

from pytest_llmload.system.sizes import format_bytes

TIERS = ("gpu", "cpu", "disk")
HOLDS_CHARS = 72  # the modules a device holds, on its line: the whole list is in --json


def tier_of(device: str) -> str:
    """``gpu`` for an accelerator (``cuda:0``), else the device itself (``cpu``, ``disk``)."""
    return device if device in ("cpu", "disk", "meta") else "gpu"


def device_order(device: str) -> tuple:
    """Where a device comes in a list of them: CUDA devices by index, other accelerators, cpu, disk, meta."""
    kind, _, index = device.partition(":")
    rank = {"cpu": 2, "disk": 3, "meta": 4}.get(kind, 0 if kind == "cuda" else 1)
    return (rank, int(index) if index.isdigit() else 0, device)


def placement_tiers(prediction: dict) -> str:
    """How many modules and bytes go to each of gpu, cpu and disk, none left out:
    ``gpu 43 modules, 22.0 GiB (1 device); cpu 8 modules, 60.6 GiB; disk 33 modules, 40.1 GiB``."""
    parts = []
    for tier in TIERS:
        held = prediction["tiers"][tier]
        if not held["modules"]:
            parts.append(f"{tier} none")
            continue
        size = "" if held["bytes"] is None else f", {format_bytes(held['bytes'])}"
        devices = f" ({held['devices']} device{'s' if held['devices'] != 1 else ''})" if tier == "gpu" else ""
        parts.append(f"{tier} {held['modules']} module{'s' if held['modules'] != 1 else ''}{size}{devices}")
    return "; ".join(parts)


def placement_lines(prediction: dict) -> list[str]:
    """One line per device: the modules the map sends there, their weights (and the predicted peak where a training
    step adds to them) against the device's capacity, ``OVER`` where they do not fit, and which modules they are
    (layers as ranges): ``cuda:0:  43 modules   22.0 GiB of 23.7 GiB  model.embed_tokens, model.layers.0-41``."""
    lines = []
    for d in prediction["devices"]:
        line = f"{d['device']:>6}: {d['modules']:>3} module{'s' if d['modules'] != 1 else ' '}"
        if d["weights"] is not None:
            line += f" {format_bytes(d['weights']):>10}"
            if d["peak"] is not None and d["peak"] != d["weights"]:
                line += f" (peak {format_bytes(d['peak'])})"
            if d["capacity"] is not None:
                line += f" of {format_bytes(d['capacity'])}" + (" OVER" if (d["peak"] or 0) > d["capacity"] else "")
        holds = prediction["placement"].get(d["device"], "")
        lines.append(f"{line}  {holds if len(holds) <= HOLDS_CHARS else holds[:HOLDS_CHARS - 1] + chr(0x2026)}")
    return lines


def where_the_model_goes(rows: list[tuple[str, dict]], every_entry: str) -> list[str]:
    """For each ``(check, prediction)`` whose prediction planned a map, passing or not: how many modules and bytes go
    to each of gpu, cpu and disk (:func:`placement_tiers`), then a line per device (:func:`placement_lines`). Rows of
    one runner whose devices read the same share their lines; ``[]`` where none planned a map. ``every_entry``
    says where the whole maps are."""
    shared: dict[tuple, list[str]] = {}
    for check, prediction in rows:
        if prediction["devices"]:
            lines = (placement_tiers(prediction), *placement_lines(prediction))
            shared.setdefault((prediction["runner"], lines), []).append(check)
    if not shared:
        return []
    out = ["", f"where the model would go (every map entry: {every_entry}):"]
    for (_, (tiers, *devices)), checks in shared.items():
        out += [f"{', '.join(checks)}: {tiers}", *(f"  {line}" for line in devices)]
    return out
