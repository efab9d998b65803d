"""How many CUDA devices this process can see, without paying for a torch import where there are none.

The count is taken lazily (first marker or header that asks) and cached for as long as the variables it reads keep
their values. On a machine without an NVIDIA driver the answer is 0 without importing torch: collection on CPU CI
stays cheap.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import sys
from typing import NamedTuple, Optional

from pytest_llmload.config.vocabulary import (
    FAKE_GPUS_ENV,
    GPUS_PER_WORKER_OPTION,
    GPUS_TOTAL_ENV as TOTAL_ENV,
    WORKER_GPUS_ENV,
)

_DRIVER_PROC = "/proc/driver/nvidia/gpus"


def visible_devices_label() -> str:
    """How the visible set was chosen, for skip reasons: ``CUDA_VISIBLE_DEVICES=0,1`` or ``... unset``."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value}"


def _driver_present() -> bool:
    return os.path.isdir(_DRIVER_PROC) or os.path.exists("/dev/nvidiactl")


def visible_gpu_count() -> int:
    """Number of CUDA devices torch would see; imports torch only where a driver exists. Cached by what it reads
    (``CUDA_VISIBLE_DEVICES`` and the fake-GPUs seam): a changed environment is counted again, an unchanged one
    is not probed twice."""
    return _count_of(os.environ.get(FAKE_GPUS_ENV), os.environ.get("CUDA_VISIBLE_DEVICES"))


@functools.lru_cache(maxsize=None)
def _count_of(fake: Optional[str], outer: Optional[str]) -> int:
    if fake is not None:  # the test seam: GPUs faked on a CPU machine
        return len(visible_devices(outer, physical_devices()))
    if "torch" not in sys.modules:
        if outer in ("", "-1"):
            return 0
        if not _driver_present():
            return 0
    import torch

    # device_count() asks NVML and does not initialise CUDA (is_available() may), so a process that
    # counted can still fork workers that use CUDA.
    return torch.cuda.device_count()


def gpu_names() -> list[str]:
    """Names of the visible GPUs (empty where none); used by the report header.

    Asks ``nvidia-smi`` rather than torch: ``get_device_name`` initialises CUDA in this process, and a
    process that has initialised CUDA must not fork.
    """
    count = visible_gpu_count()
    if count == 0:
        return []
    import shutil  # not at module level: a CPU run never gets here, and plugin load stays cheap
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ["unknown GPU"] * count
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ["unknown GPU"] * count
    names = [line.strip() for line in out.splitlines() if line.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        picked = [names[int(i)] for i in visible.split(",") if i.strip().isdigit() and int(i) < len(names)]
        names = picked or names
    return names[:count]


def skip_reason(needed: int) -> str | None:
    """``None`` when ``needed`` GPUs are visible, else the skip reason with the counts."""
    have = visible_gpu_count()
    if have >= needed:
        return None
    unit = "GPU" if needed == 1 else "GPUs"
    reason = f"needs {needed} {unit}, {have} visible ({visible_devices_label()})"
    hint = worker_hint(needed)  # under pytest -n: this worker's share of the GPUs, and what would run the test
    return reason if hint is None else f"{reason}; {hint}"


# --- the machine's GPUs without torch, and a worker's share (plugin.xdist_gpus assigns them) -------------


class Physical(NamedTuple):
    """The machine's GPUs as the driver lists them: their count (``None``: unknown) and UUIDs (GPU and MIG)."""

    count: Optional[int]
    uuids: tuple[str, ...] = ()


def parse_nvidia_smi(listing: str) -> Physical:
    """``nvidia-smi -L`` output: one ``GPU i: name (UUID: GPU-...)`` line per GPU, MIG devices indented below."""
    gpu_lines = [line for line in listing.splitlines() if re.match(r"GPU \d+:", line)]
    return Physical(len(gpu_lines), tuple(re.findall(r"\(UUID: ((?:GPU|MIG)-[^)\s]+)\)", listing)))


def physical_devices() -> Physical:
    """The machine's GPUs, without torch: the test seam, else ``nvidia-smi -L``, else the driver's /proc entries."""
    fake = os.environ.get(FAKE_GPUS_ENV)
    if fake is not None:
        uuids = tuple(u.strip() for u in fake.split(",") if u.strip())
        return Physical(len(uuids), uuids)
    if not _driver_present():
        return Physical(0)
    import shutil  # only where a driver exists: plugin load stays cheap
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            listed = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            listed = None
        if listed is not None and listed.returncode == 0:
            return parse_nvidia_smi(listed.stdout)
    try:
        return Physical(len(os.listdir(_DRIVER_PROC)))
    except OSError:
        return Physical(None)


def _names_a_device(entry: str, physical: Physical) -> bool:
    if entry.isdigit():
        return physical.count is None or int(entry) < physical.count
    if entry.startswith(("GPU-", "MIG-")):  # CUDA accepts a unique prefix of a UUID
        return not physical.uuids or any(uuid.startswith(entry) for uuid in physical.uuids)
    return False


def visible_devices(outer: Optional[str], physical: Physical) -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (``outer``; ``None``: unset) that CUDA would use, as written.

    As CUDA does, reading stops at the first entry that names no device (``-1``, an index past the last GPU,
    an unknown UUID, a repeat), so ``""`` and ``"-1"`` hide every GPU. Unset: every GPU, by index."""
    if outer is None:
        return [str(i) for i in range(physical.count or 0)]
    entries: list[str] = []
    for entry in (part.strip() for part in outer.split(",")):
        if entry in entries or not _names_a_device(entry, physical):
            break
        entries.append(entry)
    return entries


def worker_hint(needed: int, environ=os.environ) -> Optional[str]:
    """For a test needing ``needed`` GPUs on a worker holding fewer: which worker, its share, what would run it.

    ``None`` outside such a worker, or where ``CUDA_VISIBLE_DEVICES`` is no longer what the worker was given."""
    assigned = environ.get(WORKER_GPUS_ENV)
    if assigned is None or environ.get("CUDA_VISIBLE_DEVICES") != assigned:
        return None
    k, total = len(assigned.split(",")), int(environ[TOTAL_ENV])
    worker = environ.get("PYTEST_XDIST_WORKER", "?")
    held = f"xdist worker {worker} holds {k} of the run's {total} GPUs"
    if needed > total:
        return held
    return f"{held}: run it with -n {total // needed}, or with {GPUS_PER_WORKER_OPTION} {needed}"


# --- GPUs shared by several xdist workers ---------------------------------------------------------------------------
# With fewer GPUs than xdist workers (`pytest -m gpu -n 4` on one GPU, issue 40) or --llmload-gpus-per-worker off
# (plugin.xdist_gpus), every worker sees every GPU. What each test measures is its own process's (CUDA's allocator
# counts per process), but a test that measures its peak against a limit may fill the device: it holds the GPUs
# alone, and every other GPU test holds them shared, so none runs beside it. A lock file per GPU (named by UUID where
# the driver lists them, so that an index and a UUID name one file), flock'ed: the lock goes with the process that
# holds it, also when it dies.

LOCK_DIR = "llmload-gpu-locks"


def shares_gpus_with_other_workers(environ=os.environ) -> bool:
    """An xdist worker among several that sees GPUs no assignment gave it alone (assignment off, or a worker spec
    that sets its own list)."""
    workers = environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    return (environ.get("PYTEST_XDIST_WORKER") is not None and workers.isdigit() and int(workers) > 1
            and WORKER_GPUS_ENV not in environ and visible_gpu_count() > 0)


def lock_names() -> list[str]:
    """The visible GPUs, each by its UUID where the driver lists them, else by its index; sorted (one order for every
    holder: two never wait on each other)."""
    physical = physical_devices()
    names = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), physical)
    if physical.uuids and physical.count == len(physical.uuids):  # (GPUs only: MIG devices have their own)
        names = [physical.uuids[int(n)] if n.isdigit() else next(
            (u for u in physical.uuids if u.startswith(n)), n) for n in names]
    return sorted(names)


@contextlib.contextmanager
def held(names: list[str], *, alone: bool):
    """Hold each GPU of ``names``: ``alone`` (no other holder meanwhile) or shared (with other shared holders)."""
    import fcntl
    import tempfile

    folder = os.path.join(tempfile.gettempdir(), LOCK_DIR)
    os.makedirs(folder, exist_ok=True)
    fds = []
    try:
        for name in names:
            fd = os.open(os.path.join(folder, re.sub(r"[^\w.-]", "_", name) + ".lock"), os.O_RDWR | os.O_CREAT, 0o666)
            fds.append(fd)
            fcntl.flock(fd, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # (releases its lock)


@contextlib.contextmanager
def held_by_test(uses_gpu: bool, *, alone: bool):
    """Around a test in a worker that shares its GPUs with other workers: ``alone`` for a test that may fill them,
    shared for any other that ``uses_gpu``; elsewhere nothing."""
    if not (uses_gpu or alone) or not shares_gpus_with_other_workers():
        yield
        return
    with held(lock_names(), alone=alone):
        yield
