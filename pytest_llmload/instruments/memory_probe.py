"""What this process holds in memory now, and the most it held over a stretch of time.

Two sources, both cheap enough to read around every phase: the process RSS (``/proc/self/statm``; its peak
is the kernel's ``VmHWM``), and, where torch has already initialised CUDA, each device's allocated and
reserved bytes and peak allocation. Nothing here imports torch or initialises CUDA.

Peaks nest: a phase inside a test inside a ``limit_torch_memory`` marker each want the peak of their own
stretch, but the kernel and torch keep one peak counter each. :func:`start_peak` folds the current peaks
into every open watch *before* it resets the counters, so an outer watch never loses the inner peaks::

    >>> from pytest_llmload.instruments.memory_probe import start_peak, stop_peak
    >>> watch = start_peak()
    >>> _ = bytearray(50_000_000)
    >>> stop_peak(watch).rss_peak >= 50_000_000  # doctest: +SKIP
    True

The RSS peak resets through ``/proc/self/clear_refs`` (Linux >= 4.0): other readers of ``VmHWM`` in this
process see the peak since the latest reset. Where that file cannot be written, RSS peaks are ``None``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from typing import Optional

_STATM = "/proc/self/statm"
_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> Optional[int]:
    """The process's resident set size now, or ``None`` where ``/proc`` has no answer."""
    try:
        with open(_STATM, "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def _hwm_bytes() -> Optional[int]:
    try:
        with open(_STATUS, "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


def _open_clear_refs() -> Optional[int]:
    try:
        return os.open(_CLEAR_REFS, os.O_WRONLY)
    except OSError:
        return None


# Opened once, at import: resetting is then a plain os.write, which raises no audit event, so the checks that
# watch a loader's file writes (checks.offload.record_writes) never see the plugin's own bookkeeping.
_clear_refs_fd: Optional[int] = _open_clear_refs()


def _reset_hwm() -> bool:
    if _clear_refs_fd is None:
        return False
    try:
        os.write(_clear_refs_fd, b"5")  # 5: reset the peak RSS to the current RSS
        return True
    except OSError:
        return False


def _cuda():
    """torch.cuda where torch is imported and CUDA already initialised (never initialise it here: a process
    that has initialised CUDA must not fork, and the distributed runner forks)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    cuda = getattr(torch, "cuda", None)
    try:
        return cuda if cuda is not None and cuda.is_initialized() else None
    except Exception:  # a torch without CUDA support
        return None


def cuda_now() -> dict[int, tuple[int, int]]:
    """``{device index: (allocated bytes, reserved bytes)}``; empty where CUDA is not in use."""
    cuda = _cuda()
    if cuda is None:
        return {}
    return {i: (cuda.memory_allocated(i), cuda.memory_reserved(i)) for i in range(cuda.device_count())}


def _cuda_peaks() -> dict[int, int]:
    cuda = _cuda()
    if cuda is None:
        return {}
    return {i: cuda.max_memory_allocated(i) for i in range(cuda.device_count())}


@dataclasses.dataclass
class PeakWatch:
    """The most RSS and CUDA allocation seen between :func:`start_peak` and :func:`stop_peak`."""

    rss_peak: Optional[int] = None  # None: the kernel's peak counter cannot be reset here
    cuda_peak: dict[int, int] = dataclasses.field(default_factory=dict)

    def _fold(self, hwm: Optional[int], cuda: dict[int, int]) -> None:
        if self.rss_peak is not None and hwm is not None:
            self.rss_peak = max(self.rss_peak, hwm)
        for index, peak in cuda.items():
            self.cuda_peak[index] = max(self.cuda_peak.get(index, 0), peak)


_lock = threading.Lock()
_open: list[PeakWatch] = []


def _fold_all() -> None:
    if _open:
        hwm, cuda = _hwm_bytes(), _cuda_peaks()
        for watch in _open:
            watch._fold(hwm, cuda)


def start_peak() -> PeakWatch:
    """Open a watch: fold the counters into the watches already open, then reset them."""
    with _lock:
        _fold_all()
        watch = PeakWatch()
        _open.append(watch)
        if _reset_hwm():
            watch.rss_peak = rss_bytes()
        cuda = _cuda()
        if cuda is not None:
            for index in range(cuda.device_count()):
                cuda.reset_peak_memory_stats(index)
            watch.cuda_peak = _cuda_peaks()
        return watch


def stop_peak(watch: PeakWatch) -> PeakWatch:
    """Close a watch and return it with its peaks."""
    with _lock:
        _fold_all()
        try:
            _open.remove(watch)
        except ValueError:
            pass
        return watch


def _after_fork_in_child() -> None:
    global _lock, _clear_refs_fd
    _lock = threading.Lock()  # a lock held by another thread at fork time would never be released
    if _clear_refs_fd is not None:  # the inherited descriptor is the parent's /proc entry
        os.close(_clear_refs_fd)
        _clear_refs_fd = _open_clear_refs()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
