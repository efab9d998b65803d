"""A GPU per pytest-xdist worker: under ``pytest -n N`` each worker gets its own ``CUDA_VISIBLE_DEVICES``.

The scheme: every worker holds the same number K of GPUs (``--llmload-gpus-per-worker``, default the visible
count G divided by N), and the workers' lists are disjoint slices of the visible list. A worker runs one test
at a time, so two running tests never share a GPU, and a ``needs_gpus(k)`` test runs on any worker when
k <= K (no scheduling needed); with k > K it skips naming the command that would run it. N * K > G is a usage
error naming G, N, K and what to run; ``-n auto`` asks for at most G // K workers.

When: the controller plans in ``pytest_configure`` and writes each worker's list into its execnet spec's
environment (``pytest_xdist_setupnodes``). execnet sets that environment in the worker process right after
spawning it, before the worker imports pytest, so no plugin or conftest of the worker can initialise CUDA
(or read ``CUDA_VISIBLE_DEVICES``) first; a worker that xdist restarts reuses its spec, and so its GPUs.

The visible list is the controller's ``CUDA_VISIBLE_DEVICES`` as CUDA reads it (indices or ``GPU-``/``MIG-``
UUIDs, up to the first invalid entry), else every GPU ``nvidia-smi -L`` lists; workers only ever get entries
of that list, written as it writes them. Counting never imports torch, and a machine without an NVIDIA
driver (or a run without xdist) changes nothing. Imported at plugin load: it imports nothing beyond the
standard library and pytest.
"""

from __future__ import annotations

import os
import re
from typing import NamedTuple, Optional, Sequence

import pytest

from pytest_llmload import gpus
from pytest_llmload.surface import GPUS_PER_WORKER_INI as INI, GPUS_PER_WORKER_OPTION as OPTION

# Test seam, never set in real use: the comma-separated UUIDs of the machine's GPUs, read in place of
# `nvidia-smi -L` (controller) and of torch's count (gpus.visible_gpu_count), so that the assignment and
# the skips can be tested on a CPU machine.
FAKE_GPUS_ENV = "PYTEST_LLMLOAD_FAKE_GPUS"
# Set in each worker that got GPUs: its list and G, for the skip reason of a test that needs more than it holds.
WORKER_GPUS_ENV = "PYTEST_LLMLOAD_WORKER_GPUS"
TOTAL_ENV = "PYTEST_LLMLOAD_GPUS_TOTAL"

OFF = "off"

_plan_key = pytest.StashKey["Plan"]()
_devices_key = pytest.StashKey[list]()


class Physical(NamedTuple):
    """The machine's GPUs as the driver lists them: their count (``None``: unknown) and UUIDs (GPU and MIG)."""

    count: Optional[int]
    uuids: tuple[str, ...] = ()


class Plan(NamedTuple):
    per_worker: int
    total: int
    lists: list[list[str]]  # one per worker, in the order xdist creates them


class PlanError(ValueError):
    """More workers than the GPUs can serve; the message names G, N, K and what to run."""


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
    if not gpus._driver_present():
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
        return Physical(len(os.listdir(gpus._DRIVER_PROC)))
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


def plan(workers: int, devices: Sequence[str], per_worker: Optional[int], source: str) -> Plan:
    """Disjoint slices of ``devices``, ``per_worker`` each (default: as many as divide evenly, at least 1).

    Raises :class:`PlanError` when ``workers`` slices do not fit; ``source`` says where ``devices`` came from."""
    total = len(devices)
    k = per_worker or max(1, total // workers)
    if workers * k > total:
        gpu_s = "GPU" if k == 1 else "GPUs"
        if total >= k:
            fix = f"run -n {total // k} (or -n auto)"
        else:
            fix = f"run {OPTION} {total} -n 1"
        raise PlanError(
            f"pytest -n {workers} with {k} {gpu_s} per xdist worker needs {workers * k} GPUs, but {total} are "
            f"visible ({source}): {fix}, or pass {OPTION} {OFF} to let every worker see every GPU, or "
            f"set CUDA_VISIBLE_DEVICES= for a run that uses no GPU."
        )
    return Plan(k, total, [list(devices[i * k:(i + 1) * k]) for i in range(workers)])


def auto_workers(total: int, per_worker: Optional[int], cpu_workers: int) -> int:
    """``-n auto`` with ``total`` GPUs: xdist's CPU-based count, capped to the workers the GPUs can serve."""
    return max(1, min(cpu_workers, total // (per_worker or 1)))


def parse_per_worker(value: Optional[str], where: str) -> "int | str | None":
    """The option's value: a positive int, ``'off'``, or ``None`` (not given); ``where`` names its source."""
    if value is None or value == "":
        return None
    if value.strip().lower() == OFF:
        return OFF
    if value.strip().isdigit() and int(value) > 0:
        return int(value)
    raise pytest.UsageError(
        f"{where}={value!r} is neither a positive number of GPUs nor '{OFF}'; pass e.g. {OPTION} 2 "
        f"(each xdist worker holds 2 GPUs) or {OPTION} {OFF}."
    )


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
    return f"{held}: run it with -n {total // needed}, or with {OPTION} {needed}"


# --- hooks (this module is a sub-plugin of pytest_llmload.plugin; its option is declared there) -------------


def _per_worker(config: pytest.Config) -> "int | str | None":
    option = config.getoption("llmload_gpus_per_worker", None)
    if option is not None:
        return parse_per_worker(option, OPTION)
    return parse_per_worker(config.getini(INI), f"ini {INI}")


def _local(spec) -> bool:
    """A worker on this machine whose GPUs are ours to give (a spec that sets its own list is left alone)."""
    return bool(spec.popen) and not spec.via and "CUDA_VISIBLE_DEVICES" not in spec.env


def _devices(config: pytest.Config) -> list[str]:
    """The controller's visible GPUs (:func:`visible_devices`), found once per run."""
    if _devices_key not in config.stash:
        outer = os.environ.get("CUDA_VISIBLE_DEVICES")
        # "" and "-1" hide every GPU: no need to ask the driver.
        found = [] if outer in ("", "-1") else visible_devices(outer, physical_devices())
        config.stash[_devices_key] = found
    return config.stash[_devices_key]


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> Optional[int]:
    per_worker = _per_worker(config)
    if per_worker == OFF:
        return None
    devices = _devices(config)
    if not devices:
        return None  # xdist's own answer: the CPUs
    from xdist.plugin import pytest_xdist_auto_num_workers as cpu_workers  # only runs under xdist

    return auto_workers(len(devices), per_worker, cpu_workers(config))


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config, "workerinput") or config.getvalue("collectonly"):
        return
    if getattr(config.option, "dist", "no") == "no" or not getattr(config.option, "tx", None):
        return  # not distributing: nothing to assign
    import execnet  # xdist is running, so both are loaded
    from xdist.workermanage import parse_tx_spec_config

    workers = sum(_local(execnet.XSpec(spec)) for spec in parse_tx_spec_config(config))
    per_worker = _per_worker(config)
    if not workers or per_worker == OFF:
        return
    devices = _devices(config)
    if not devices:
        return
    try:
        config.stash[_plan_key] = plan(workers, devices, per_worker, gpus.visible_devices_label())
    except PlanError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs) -> None:
    worker_plan = config.stash.get(_plan_key, None)
    if worker_plan is None:
        return
    for spec, devices in zip([spec for spec in specs if _local(spec)], worker_plan.lists):
        # execnet sets these in the worker before it runs any of pytest (see the module docstring).
        listed = ",".join(devices)
        spec.env.update({"CUDA_VISIBLE_DEVICES": listed, WORKER_GPUS_ENV: listed, TOTAL_ENV: str(worker_plan.total)})


def pytest_report_header(config: pytest.Config) -> list[str]:
    worker_plan = config.stash.get(_plan_key, None)
    if worker_plan is None:
        return []
    lists = " | ".join(",".join(devices) for devices in worker_plan.lists)
    gpu_s = "GPU" if worker_plan.per_worker == 1 else "GPUs"
    return [f"llmload: {len(worker_plan.lists)} xdist workers, {worker_plan.per_worker} {gpu_s} each, "
            f"their CUDA_VISIBLE_DEVICES: {lists}"]
