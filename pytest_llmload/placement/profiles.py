"""Runner profiles: a machine the checks' loaders will meet, as a small data file a user can copy and edit.

A profile is JSON: ``name``, ``devices`` (GPUs), ``device_memory`` (per GPU, as CUDA reports the total: the
budget accelerate plans against), ``host_memory`` (what offload to ``cpu`` may use), ``disk`` (what offload to
``disk`` may use), ``sources`` (where each figure comes from). The shipped ones are in ``profiles/``; a path to a
``.json`` of the same shape names a user's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Union

from pytest_llmload.system.sizes import format_bytes, parse_size

SHIPPED = Path(__file__).parent / "profiles"
# Bounds checked before anything is allocated for a file a user names: a profile is a few hundred bytes, a
# config.json a few KiB; a runner has at most a few dozen GPUs.
MAX_FILE_BYTES = 1 << 20
MAX_DEVICES = 1024


class ProfileError(ValueError):
    """A profile name that is not shipped, or a profile file that cannot be read; the message says what to do."""


class RunnerProfile(NamedTuple):
    name: str
    devices: int
    device_memory: int  # bytes per GPU
    host_memory: int  # bytes for cpu offload
    disk: int  # bytes for disk offload
    description: str = ""
    device: str = ""
    source: str = ""  # the file it was read from

    @property
    def max_memory(self) -> dict:
        """The runner's capacities in ``from_pretrained``'s ``max_memory`` format: what accelerate plans against."""
        return {**{i: self.device_memory for i in range(self.devices)}, "cpu": self.host_memory}

    @property
    def device_names(self) -> list[str]:
        return [f"cuda:{i}" for i in range(self.devices)] or ["cpu"]

    def describe(self) -> str:
        gpus = (f"{self.devices} x {self.device or 'GPU'} ({format_bytes(self.device_memory)} each)" if self.devices
                else "no GPU")
        return f"{self.name}: {gpus}, host {format_bytes(self.host_memory)}, disk {format_bytes(self.disk)}"


def read_small_json(path: Path) -> object:
    """The JSON in ``path``, refused (``ValueError`` saying why) when the file is larger than
    :data:`MAX_FILE_BYTES` or nested deeper than Python's parser can follow, before either is read into memory."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ValueError(f"it is {format_bytes(size)}, more than the {format_bytes(MAX_FILE_BYTES)} such a file "
                         "ever needs")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError("its JSON is nested too deeply to read") from None


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def load_profile(name_or_path: Union[str, Path], *, source: str = "--runner") -> RunnerProfile:
    """A shipped profile by name (``8xH100-80GB``), or a profile file by path."""
    text = str(name_or_path)
    path = Path(text) if text.endswith(".json") else SHIPPED / f"{text}.json"
    if not path.is_file():
        known = ", ".join(shipped_names())
        raise ProfileError(f"{source} {text!r} is neither a shipped runner profile ({known}) nor a profile file "
                           "(a path ending in .json); copy a shipped one from "
                           f"{SHIPPED} and edit it for your runner.")
    try:
        data = read_small_json(path)
        if not isinstance(data, dict):
            raise ValueError(f"it holds a JSON {type(data).__name__}, not an object")
        devices = data["devices"]
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 0:
            raise ValueError(f"devices={devices!r} is not a count of GPUs")
        if devices > MAX_DEVICES:
            raise ValueError(f"devices={devices} is more GPUs than one runner holds (at most {MAX_DEVICES} here)")
        return RunnerProfile(
            name=str(data.get("name") or path.stem), devices=devices,
            device_memory=parse_size(data.get("device_memory", 0), what="device_memory") if devices else 0,
            host_memory=parse_size(data["host_memory"], what="host_memory", positive=True),
            disk=parse_size(data.get("disk", 0), what="disk"),
            description=str(data.get("description", "")), device=str(data.get("device", "")), source=str(path))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        what = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ProfileError(f"runner profile {path} ({source} {text!r}) cannot be read: {what}. A profile needs "
                           "devices, device_memory, host_memory and disk (sizes like '80GiB'); see the shipped ones "
                           f"in {SHIPPED}.") from None
