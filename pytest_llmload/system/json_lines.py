"""JSON lines between the processes of a run: the progress file the main job follows. Imports nothing heavy: the
main job's parent reads with it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from pytest_llmload.system import output_files


def open_for_appending(path: "str | os.PathLike[str]") -> int:
    return output_files.open_output_fd(path, append=True, mode=0o644)  # (a progress path another user linked: refused)


def append(fd: int, record: dict, default=None) -> None:
    """``record`` as one line in one write(2) to ``fd`` (opened for appending): a reader sees whole lines, and
    processes that share the file never interleave theirs (a buffered file writes a long line in pieces).
    ``default``: :func:`json.dumps`'s, for values JSON has no type for."""
    data = (json.dumps(record, default=default) + "\n").encode("utf-8")
    while data:
        data = data[os.write(fd, data):]


def read_from(path: Path, offset: int) -> tuple[list[dict], int]:
    """The whole lines written to ``path`` after byte ``offset`` (a line still being written waits for the next
    call), and the offset to read from next."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            chunk = handle.read()
    except FileNotFoundError:
        return [], offset
    complete = chunk[:chunk.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line], offset + len(complete)
