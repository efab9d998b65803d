"""One daemon thread per process that calls scheduled callbacks: the phases' progress lines, and the report's phase
table printed shortly before pytest-timeout's thread method kills the run, are scheduled on it.

Imports nothing heavy. A forked child starts its own thread when it first schedules something.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from typing import Any, Callable, Optional

Clock = Callable[[], float]


def stderr_line(line: str) -> None:
    """Write one line to stderr at once (progress lines must show while a test's output is captured)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class Heartbeat:
    """Calls scheduled callbacks from one daemon thread: ``schedule(key, delay, callback, every=N)``.

    ``run_due(now)`` does one pass and returns when the next callback is due, so a test can drive it with a
    fake clock and no thread (``start_thread=False``).
    """

    def __init__(self, clock: Clock = time.monotonic, start_thread: bool = True) -> None:
        self._clock = clock
        self._start_thread = start_thread
        self._cond = threading.Condition()
        self._due: dict[Any, list] = {}  # key -> [due, every, callback]
        self._thread: Optional[threading.Thread] = None
        self._waiting_until = 0.0  # while the thread waits: when it wakes; otherwise 0 (no notify needed)

    def schedule(self, key: Any, delay: float, callback: Callable[[Any], None], every: Optional[float] = None) -> None:
        with self._cond:
            due = self._clock() + delay
            self._due[key] = [due, every, callback]
            if self._start_thread and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="llmload-heartbeat", daemon=True)
                self._thread.start()
            if due < self._waiting_until:
                self._cond.notify()

    def cancel(self, key: Any) -> None:
        with self._cond:
            self._due.pop(key, None)

    def run_due(self, now: Optional[float] = None) -> float:
        """Call every callback due at ``now``; returns when the next one is due (``inf``: none)."""
        calls = []
        with self._cond:
            now = self._clock() if now is None else now
            for key, entry in list(self._due.items()):
                due, every, callback = entry
                if due <= now:
                    calls.append((callback, key))
                    if every:
                        entry[0] = due + every * max(1, math.floor((now - due) / every) + 1)
                    else:
                        del self._due[key]
        for callback, key in calls:
            try:
                callback(key)
            except Exception as exc:  # a progress line must never take the test down
                stderr_line(f"llmload: progress callback failed: {type(exc).__name__}: {exc}")
        with self._cond:
            return min((entry[0] for entry in self._due.values()), default=math.inf)

    def _run(self) -> None:
        while True:
            with self._cond:
                next_due = min((entry[0] for entry in self._due.values()), default=math.inf)
                now = self._clock()
                if next_due > now:
                    self._waiting_until = next_due
                    self._cond.wait(None if next_due == math.inf else next_due - now)
                    self._waiting_until = 0.0
                    continue
            self.run_due()


_heartbeat: Optional[Heartbeat] = None


def heartbeat() -> Heartbeat:
    """The process's heartbeat (its thread starts with the first thing scheduled)."""
    global _heartbeat
    if _heartbeat is None:
        _heartbeat = Heartbeat()
    return _heartbeat


def _after_fork_in_child() -> None:
    global _heartbeat
    _heartbeat = None  # threads do not survive fork; the child starts its own when it needs one


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
