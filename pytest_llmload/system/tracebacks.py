"""Frames and deadline texts, each defined once: which frame is a library's, ours, the loader call's or the
culprit; and the text a deadline that passed writes, beside the readers that parse it back.

A frame comes three ways: live (``sys._getframe``, ``traceback.walk_tb``: its module is known), printed (a
``FrameSummary`` of ``traceback.extract_tb``, or traceback text from a child or a faulthandler dump: a path only),
or as a :class:`Frame` (both). Only the standard library is imported: system/ sits below every layer that reads a
frame.
"""

from __future__ import annotations

import linecache
import os
import re
import traceback
from typing import Any, NamedTuple, Optional

# --- frames: whose code is it ----------------------------------------------------------------------------

# Libraries whose frames mean "raised while loading" (not "refused before loading"), and whose calls made on a
# loader's behalf are not the loader's own.
LOADING_LIBRARIES = ("torch", "transformers", "accelerate", "peft", "safetensors", "huggingface_hub", "bitsandbytes")


class Frame(NamedTuple):
    """One frame of a traceback: what Python prints of it, and the module it ran in."""

    name: str
    filename: str
    lineno: int
    module: str

    @property
    def line(self) -> str:
        """Its source line, stripped (``''`` where there is no source)."""
        return linecache.getline(self.filename, self.lineno).strip()


def frames(exc: BaseException) -> list[Frame]:
    """The frames ``exc`` passed through, outermost first (as ``traceback.extract_tb`` lists them)."""
    found = []
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        linecache.lazycache(frame.f_code.co_filename, frame.f_globals)  # (as extract_tb does: zipped modules)
        found.append(Frame(frame.f_code.co_name, frame.f_code.co_filename, lineno, module_of(frame)))
    return found


def module_of(frame: Any) -> str:
    """The module ``frame`` ran in: a live frame's ``__name__``, a :class:`Frame`'s; for a printed frame
    (``FrameSummary``), the module its installed file holds (:func:`installed_module`). ``''`` where unknown."""
    if isinstance(frame, Frame):
        return frame.module
    if isinstance(frame, traceback.FrameSummary):
        return installed_module(frame.filename) or ""
    return str(frame.f_globals.get("__name__") or "")


def is_library(module: str, libraries: tuple[str, ...] = LOADING_LIBRARIES) -> bool:
    """The one definition of a library frame: its module is one of ``libraries`` or inside one
    (``torch.nn.modules.module``)."""
    return module.split(".")[0] in libraries


def installed_module(filename: str) -> Optional[str]:
    """The module an installed file holds, read from its path (``.../site-packages/peft/peft_model.py``:
    ``peft.peft_model``); ``None`` for a file that is not under site-packages."""
    parts = _slashed(filename).split("/site-packages/")
    return parts[1].removesuffix(".py").replace("/", ".") if len(parts) == 2 else None


def is_installed(filename: str) -> bool:
    """Installed code, a library's or Python's own (under site-packages or lib/python): not a loader's, not a
    script's."""
    return "site-packages" in filename or "/lib/python" in filename


# This package's own folder: a frame there is a check's, a spy's or the seam's, never a loader's or a repo's own check.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def is_ours(filename: str) -> bool:
    """A file of this package (pytest_llmload)."""
    return os.path.abspath(filename).startswith(PACKAGE_DIR)


def is_frozen(filename: str) -> bool:
    """Python's frozen modules (importlib's bootstrap, ``os``, ...): never where a user's code raised."""
    return filename.startswith("<frozen")


def is_importing(filename: str) -> bool:
    """A frame of the import machinery: the code above it runs while a module is imported."""
    return filename.startswith("<frozen importlib")


def _slashed(filename: str) -> str:
    return filename.replace(os.sep, "/")


def where(frame: Any) -> str:
    """``name (path:line)``: how messages name a frame (live, printed or a :class:`Frame`)."""
    if isinstance(frame, (Frame, traceback.FrameSummary)):
        return f"{frame.name} ({frame.filename}:{frame.lineno})"
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"


# --- frames: the culprit ---------------------------------------------------------------------------------

# Frames that wait on something else (threads, queues, futures, selectors): what a stuck block waits for is past them.
WAITING_PLUMBING = ("threading.py", "queue.py", "concurrent/futures", "selectors.py")
# The network stack, and the guard's own frames: the code that reached for the network is past them.
NETWORK_PLUMBING = tuple(f"/{p}" for p in (
    "socket", "ssl", "http", "urllib", "urllib3", "requests", "httpx", "httpcore", "h11", "anyio", "asyncio",
    "huggingface_hub/utils/_http", "pytest_llmload/system/offline", "pytest_llmload/instruments/probes", "contextlib"))


def culprit(frame: Any, plumbing: tuple[str, ...]) -> Optional[Any]:
    """The innermost live frame, from ``frame`` outwards, whose path holds none of ``plumbing`` (paths with ``/``):
    the code that is stuck, or that reached for the network; ``None`` where every frame is plumbing."""
    while frame is not None and any(p in _slashed(frame.f_code.co_filename) for p in plumbing):
        frame = frame.f_back
    return frame


# --- frames in printed text: ours, the loader call's -----------------------------------------------------

# A frame of pytest_llmload in traceback text: (path, line, function).
OWN_FRAME = re.compile(r'File "([^"]*pytest_llmload[/\\][^"]+)", line (\d+), in (\w+)')


def innermost_own_frame(text: str) -> str:
    """The innermost pytest_llmload frame of traceback ``text``, as ``name (folder/module.py:line)``; ``''``
    where there is none."""
    found = OWN_FRAME.findall(text)
    if not found:
        return ""
    path, line, name = found[-1]
    return f"{name} ({path.rsplit('pytest_llmload', 1)[-1].lstrip('/')}:{line})"


def frame_pattern(filename: str, function: str, *, dumped: bool = False) -> str:
    """A regular expression for the frame of ``function`` in a file named ``filename`` as Python's tracebacks
    print it (``peft_model.py", line 12, in _update_offload``); ``dumped``: as faulthandler's dumps print it too
    (no comma before ``in``)."""
    return rf'{re.escape(filename)}\", line \d+{",?" if dumped else ","} in {function}'


# The loader call's frame (loader.seam.call_loader) in a traceback or a dump: a stack that holds it stopped
# inside the loader under test.
LOADER_FRAME = re.compile(frame_pattern("seam.py", "call_loader", dumped=True) + r"\b")


def exception_text(exc: BaseException) -> str:
    """``exc``'s message and its frames as printed: what the readers of frames search."""
    return str(exc) + "".join(traceback.format_tb(exc.__traceback__))


def in_loader_call(text: str) -> bool:
    """Whether the stack printed in ``text`` is inside the loader call."""
    return LOADER_FRAME.search(text) is not None


def up_to(text: str, function: str) -> str:
    """A faulthandler dump with each thread's frames from the innermost up to ``function``'s: a forked child
    inherits its parent's call stack (pytest's frames), which would push the child's own frames out of a report."""
    kept, skipping = [], False
    for line in text.splitlines():
        if skipping and line.startswith('  File "'):
            continue
        skipping = False
        kept.append(line)
        if line.startswith('  File "') and line.endswith(f" in {function}"):
            skipping = True
    return "\n".join(kept).strip()


# --- deadline texts: written here, read back here ---------------------------------------------------------

# The name of probes.deadline's exception (instruments/ sits above: read by name, as an exception rebuilt in a
# child is).
DEADLINE_EXCEEDED = "DeadlineExceeded"
# pytest-timeout's failure: "Timeout (>5.0s) from pytest-timeout." (its own text, only read here).
_PYTEST_TIMEOUT_HEAD = "Timeout (>"
_PYTEST_TIMEOUT = r"Timeout \(>(\d+(?:\.\d+)?)s\) from pytest-timeout"


def deadline_text(seconds: float, *, of: bool = True) -> str:
    """``deadline of 5 s`` (``of=False``: ``deadline 5 s``, as the ranks' failure names it in brackets)."""
    return f"deadline {'of ' if of else ''}{seconds:g} s"


_OWN_DEADLINE = r"deadline (?:of )?(\d+(?:\.\d+)?) s\b"  # what deadline_text writes
_ANY_DEADLINE = re.compile(f"{_PYTEST_TIMEOUT}|{_OWN_DEADLINE}")


def did_not_return(what: str, seconds: float) -> str:
    """``<what> did not return: deadline of 5 s exceeded``: the head of a block still running at its deadline."""
    return f"{what} did not return: {deadline_text(seconds)} exceeded"


def ran_late(what: str, elapsed: float, seconds: float) -> str:
    """``<what> took 6.20 s: deadline of 5 s exceeded.``: a block that returned after its deadline."""
    return f"{what} took {elapsed:.2f} s: {deadline_text(seconds)} exceeded."


# The known failures' signatures of a hang: pytest-timeout's failure, a deadline of ours, a library's "Timed out
# after" (regular expressions, shown as written in the catalog).
HANG_SIGNATURES = (r"Timeout \(>[\d.]+s\) from pytest-timeout", r"deadline .* exceeded", r"Timed out after")


def is_passed_deadline(exc: BaseException) -> bool:
    """Whether ``exc`` is a deadline that passed in this process: probes.deadline's, or pytest-timeout's."""
    return type(exc).__name__ == DEADLINE_EXCEEDED or str(exc).startswith(_PYTEST_TIMEOUT_HEAD)


def deadline_seconds(text: str) -> Optional[float]:
    """The seconds of the first deadline ``text`` names (pytest-timeout's or one written here); ``None`` where it
    names none."""
    found = _ANY_DEADLINE.search(text)
    return float(found.group(1) or found.group(2)) if found else None
