"""The HTML report's data: what it shows of one test, as plain data (its models' placement, its phases' memory),
from the test's recorder and from the isolated children it forked.

Most checks run in a child forked from the test process (:mod:`pytest_llmload.runners.isolation`), where their
loads and phases go to the child's copy of the recorder. While the report is on, a child forked during a test writes
them to a spool file as they happen (:func:`spooling`), and the test process reads them back into the test's record.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Optional

import pytest

from pytest_llmload.placement.picture import device_order

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


@contextlib.contextmanager
def spooling():
    """While a test runs with the report on: the folder its forked children spool their records to."""
    global _spool_dir
    _spool_dir = tempfile.mkdtemp(prefix="llmload-html-")
    try:
        yield
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
