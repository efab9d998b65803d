"""The HTML report's data: what it shows of one test, as plain data (its models' placement, its phases' memory),
from the test's recorder and from the isolated children it forked.

Most checks run in a child forked from the test process (:mod:`pytest_llmload.runners.isolation`), where their
loads and phases go to the child's copy of the recorder; they come back with the child's answer
(:mod:`pytest_llmload.runners.children`) into the test's recorder, whose records are the row's
:attr:`~pytest_llmload.reports.row.Row.artefacts`.
"""

from __future__ import annotations

import os
from typing import Optional

import pytest

from pytest_llmload.placement.picture import device_order


def record_of(item: pytest.Item) -> Optional[dict]:
    """What the report shows of one test, as plain data: its models' placement and its phases' memory, from the
    test's recorder, the isolated children's records included (they come back with their answers); ``None`` for a
    test with no recorder."""
    from pytest_llmload.reports.sections import recorder_key

    recorder = item.stash.get(recorder_key, None)
    return None if recorder is None else record_from(recorder.artefacts())


def record_from(artefacts: dict) -> dict:
    """The report's record of a test from what its recorders saw (a row's :attr:`~.row.Row.artefacts`,
    :meth:`~pytest_llmload.instruments.recorder.PhaseRecorder.artefacts`): each model's device map grouped by
    device, with the bytes on each, and the phases in the order they started."""
    phases = sorted((dict(p) for p in artefacts.get("phases") or ()), key=lambda p: p.get("started") or 0.0)
    loads = [p for p in phases if p["name"] == "load" and not p["running"]]
    return {"models": [_model_record(m, loads) for m in artefacts.get("models") or ()], "phases": phases}


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
