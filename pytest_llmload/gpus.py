"""How many CUDA devices this process can see, without paying for a torch import where there are none.

The count is taken lazily (first marker or header that asks) and cached for the process. On a machine
without an NVIDIA driver the answer is 0 without importing torch: collection on CPU CI stays cheap.
"""

from __future__ import annotations

import functools
import os
import sys

_DRIVER_PROC = "/proc/driver/nvidia/gpus"


def visible_devices_label() -> str:
    """How the visible set was chosen, for skip reasons: ``CUDA_VISIBLE_DEVICES=0,1`` or ``... unset``."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value}"


def _driver_present() -> bool:
    return os.path.isdir(_DRIVER_PROC) or os.path.exists("/dev/nvidiactl")


@functools.lru_cache(maxsize=None)
def visible_gpu_count() -> int:
    """Number of CUDA devices torch would see. Cached; imports torch only where a driver exists."""
    from pytest_llmload.runners import xdist_gpus  # its test seam (small, imports nothing heavy)

    if xdist_gpus.FAKE_GPUS_ENV in os.environ:  # the test seam: GPUs faked on a CPU machine
        outer = os.environ.get("CUDA_VISIBLE_DEVICES")
        return len(xdist_gpus.visible_devices(outer, xdist_gpus.physical_devices()))
    if "torch" not in sys.modules:
        if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
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
    from pytest_llmload.runners.xdist_gpus import worker_hint

    hint = worker_hint(needed)  # under pytest -n: this worker's share of the GPUs, and what would run the test
    return reason if hint is None else f"{reason}; {hint}"
