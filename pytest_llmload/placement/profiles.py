"""Runner profiles: a machine the checks' loaders will meet, as a small data file a user can copy and edit.

A profile is a JSON object with these fields (:data:`FIELDS`; any other is refused, so that a misspelt one is not
silently ignored):

- ``devices`` (required): the GPUs one process of that runner sees, 0 to :data:`MAX_DEVICES`;
- ``device_memory`` (required where ``devices`` is not 0): per GPU, as CUDA reports the total (the budget
  accelerate plans against), 1 GiB to :data:`MAX_DEVICE_MEMORY`;
- ``host_memory`` (required): what offload to ``cpu`` may use, 1 GiB to :data:`MAX_HOST_MEMORY`;
- ``disk`` (required): what offload to ``disk`` may use, 0 (no offload to disk) to :data:`MAX_DISK`;
- ``name`` (default: the file's name without ``.json``), ``description`` and ``device`` (the GPU's name; default
  none), ``sources`` (where each figure comes from: an object of texts; default none).

Sizes are numbers of bytes or strings with a unit, as ``max_memory`` reads them (``"80GiB"``, ``"234GB"``). The
shipped ones are in ``profiles/``; a path to a ``.json`` of the same shape names a user's own. A bad one is a
:class:`ProfileError` naming the file and the field: the run's usage error, never a prediction.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple, Union

from pytest_llmload.system.sizes import format_bytes, parse_size

SHIPPED = Path(__file__).parent / "profiles"
# Bounds checked before anything is allocated for a file a user names: a profile is a few hundred bytes, a
# config.json a few KiB. A profile is what one process of a runner sees: the largest nodes sold hold 16 GPUs
# (DGX-2/HGX-2), the largest GPUs 288 GB (B300, MI355X), the largest servers 32 TiB of memory; the bounds leave
# room above each, and refuse what is a typo (a unit missing or one too large) or no machine.
MAX_FILE_BYTES = 1 << 20
MAX_DEVICES = 64
MIN_MEMORY = 1 << 30
MAX_DEVICE_MEMORY = 1 << 40
MAX_HOST_MEMORY = 64 << 40
MAX_DISK = 1 << 50
# field: what it is, for the sentence that names it
FIELDS = {"name": "the profile's name", "description": "a line about the runner", "devices": "the GPUs",
          "device": "the GPU's name", "device_memory": "the memory of each GPU",
          "host_memory": "what offload to cpu may use", "disk": "what offload to disk may use",
          "sources": "where each figure comes from"}


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
    """A shipped profile by name (``8xH100-80GB``), or a profile file by path; :class:`ProfileError` naming the file
    and the field for anything else."""
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
        return _profile(data, path)
    except (OSError, ValueError) as exc:
        raise ProfileError(f"runner profile {path} ({source} {text!r}) cannot be read: {exc}. A profile needs "
                           "devices, device_memory (where devices is not 0), host_memory and disk (sizes like "
                           f"'80GiB'); see the shipped ones in {SHIPPED}.") from None


def _profile(data: dict, path: Path) -> RunnerProfile:
    """The profile ``data`` describes, each field checked (``ValueError`` naming the first that is wrong)."""
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        which = "is not a field" if len(unknown) == 1 else "are not fields"
        raise ValueError(f"{', '.join(map(repr, unknown))} {which} of a profile (the fields: {', '.join(FIELDS)})")
    devices = _required(data, "devices")
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 0:
        raise ValueError(f"devices={devices!r} is not a count of GPUs")
    if devices > MAX_DEVICES:
        raise ValueError(f"devices={devices} is more GPUs than one runner holds (at most {MAX_DEVICES} here: a "
                         "profile is what one node's processes see)")
    device_memory = _size(data, "device_memory", MIN_MEMORY, MAX_DEVICE_MEMORY) if devices else 0
    host_memory = _size(data, "host_memory", MIN_MEMORY, MAX_HOST_MEMORY)
    disk = _size(data, "disk", 0, MAX_DISK)
    texts = {field: data.get(field, "") for field in ("name", "description", "device")}
    for field, value in texts.items():
        if not isinstance(value, str):
            raise ValueError(f"{field}={value!r} is not a text")
    sources = data.get("sources", {})
    if not isinstance(sources, dict):
        raise ValueError(f"sources={sources!r} is not an object (a source per figure)")
    return RunnerProfile(name=texts["name"] or path.stem, devices=devices, device_memory=device_memory,
                         host_memory=host_memory, disk=disk, description=texts["description"], device=texts["device"],
                         source=str(path))


def _required(data: dict, field: str):
    if field not in data:
        raise ValueError(f"{field} ({FIELDS[field]}) is missing")
    return data[field]


def _size(data: dict, field: str, least: int, most: int) -> int:
    """The size in ``data[field]``, between ``least`` and ``most`` bytes."""
    value = _required(data, field)
    nbytes = parse_size(value, what=field)
    if not least <= nbytes <= most:
        limit = (f"less than {format_bytes(least)}: no runner has so little (a number without a unit is bytes; "
                 "write one, e.g. '80GiB')" if nbytes < least
                 else f"more than the {most >> 40} TiB any runner has (a unit too large?)")
        raise ValueError(f"{field} {value!r} ({format_bytes(nbytes)}) is {limit}")
    return nbytes
