"""A GPU per pytest-xdist worker: under ``pytest -n N`` each worker gets its own ``CUDA_VISIBLE_DEVICES``.

The scheme: every worker holds the same number K of GPUs (``--llmload-gpus-per-worker``, default the visible
count G divided by N), and the workers' lists are disjoint slices of the visible list. A worker runs one test
at a time, so two running tests never share a GPU, and a ``needs_gpus(k)`` test runs on any worker when
k <= K (no scheduling needed); with k > K it skips naming the command that would run it. With more workers than
GPUs and K not given (``pytest -m gpu -n 4`` on one GPU), the workers share them: every worker sees every GPU, and
a test that may fill one (``limit_torch_memory``) holds them alone while the other GPU tests hold them shared
(:func:`pytest_llmload.system.gpus.held_by_test`). N * K > G with K given is a usage error naming G, N, K and what
to run; ``-n auto`` asks for at most G // K workers.

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
from typing import NamedTuple, Optional, Sequence

import pytest

from pytest_llmload.system import gpus
from pytest_llmload.system.gpus import TOTAL_ENV, WORKER_GPUS_ENV, physical_devices, visible_devices  # one floor down
from pytest_llmload.config.settings import GPUS_OFF as OFF
from pytest_llmload.config.vocabulary import GPUS_PER_WORKER_OPTION as OPTION


_plan_key = pytest.StashKey["Plan"]()
_shared_key = pytest.StashKey[tuple]()  # (workers, GPUs) where the workers share the GPUs
_devices_key = pytest.StashKey[list]()


class Plan(NamedTuple):
    per_worker: int
    total: int
    lists: list[list[str]]  # one per worker, in the order xdist creates them


class PlanError(ValueError):
    """More workers than the GPUs can serve; the message names G, N, K and what to run."""


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


# --- hooks (this module is a sub-plugin, pytest_llmload.plugin.gates'; its option is declared in config.vocabulary) 


def _per_worker(config: pytest.Config) -> "int | str | None":
    from pytest_llmload.config import settings

    return settings.value(config, "gpus_per_worker")


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
    if per_worker is None and workers > len(devices):
        # Not enough GPUs for one each, and no share asked for: the workers share them (module docstring).
        config.stash[_shared_key] = (workers, len(devices))
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
    shared = config.stash.get(_shared_key, None)
    if shared is not None:
        workers, total = shared
        them = "it" if total == 1 else "them"
        return [f"llmload: {workers} xdist workers share {total} GPU{'s' if total > 1 else ''} (fewer GPUs than "
                f"workers): a test that may fill {them} (limit_torch_memory) runs alone, the other GPU tests beside "
                f"each other; -n {total} gives each worker its own"]
    worker_plan = config.stash.get(_plan_key, None)
    if worker_plan is None:
        return []
    lists = " | ".join(",".join(devices) for devices in worker_plan.lists)
    gpu_s = "GPU" if worker_plan.per_worker == 1 else "GPUs"
    return [f"llmload: {len(worker_plan.lists)} xdist workers, {worker_plan.per_worker} {gpu_s} each, "
            f"their CUDA_VISIBLE_DEVICES: {lists}"]
