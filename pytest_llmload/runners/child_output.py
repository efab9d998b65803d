"""What a child writes, handed to its parent: stdout, stderr, log records and, at a deadline, its thread stacks.

Each child of :func:`.children.run_children` writes them to files of the run's temporary directory (never to the
parent's streams: under pytest, ``sys.stdout`` is pytest's capture object, whose file the parent is still writing),
record by record and line by line, so that a child that hangs or dies still leaves what it wrote. When the children
have ended, the parent reads the files: the log records go to its own loggers, in the order they were made (pytest's
"Captured log" sections and ``caplog`` see them as if the work had run here), and stdout, stderr and stacks to the
children's :class:`~.children.ChildOutcome`.

Imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import signal
import sys
import time

from pytest_llmload.runners import wire
from pytest_llmload.system import tracebacks

STACK_WAIT_S = 2.0
LOG_TAIL_LINES = 40  # lines of a child's output in a failure message
_OUTPUT_LIMIT = 1 << 20  # bytes of a child's stdout/stderr replayed into the caller's streams
# The child's entry point (children._child_main): the frames below it in a forked child's stacks are its parent's.
_ENTRY = "_child_main"


def path(workdir: str, index: int, kind: str) -> str:
    """Child ``index``'s file of ``kind``: ``out``, ``err``, ``logs`` or ``stacks``."""
    return os.path.join(workdir, f"child{index}.{kind}")


def open_for_child(file: str) -> int:
    return os.open(file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)


# ---------------------------------------------------------------------------------------------------------
# In the child
# ---------------------------------------------------------------------------------------------------------


def redirect_output(stdout_fd: int, stderr_fd: int) -> None:
    """Send a child's stdout/stderr (fds 1 and 2, and new ``sys.stdout``/``sys.stderr`` on them) to its own files
    (an isolated child's log records go to the parent: :func:`forward_log_records`).

    Under pytest, sys.stdout is pytest's capture object, whose file the parent is still writing: a child
    writing there would interleave with the test's own output; the parent replays the files instead.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os.dup2(stdout_fd, 1)
    os.dup2(1 if stderr_fd == stdout_fd else stderr_fd, 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")  # noqa: SIM115


class _RecordForwarder(logging.Handler):
    """In a child: writes each log record, made picklable, to a file the parent replays. Written and flushed
    record by record, so a child that hangs or dies still leaves what it logged."""

    def __init__(self, file: str, label: str):
        super().__init__()
        self._file = open(file, "ab")  # noqa: SIM115 - lives as long as the child
        self._label = label

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "llmload_child", None):  # already forwarded by a handler further down the tree
            return
        try:
            fields = dict(record.__dict__)
            fields["msg"], fields["args"] = record.getMessage(), None
            if record.exc_info:
                fields["exc_text"] = record.exc_text or logging.Formatter().formatException(record.exc_info)
            fields["exc_info"] = None
            fields["llmload_child"] = record.llmload_child = self._label
            for key, value in fields.items():
                if not wire.picklable(value):  # an `extra` value that does not pickle travels as its repr
                    fields[key] = repr(value)
            wire.write_record(self._file, fields)
            self._file.flush()
        except Exception:  # noqa: BLE001
            self.handleError(record)


def forward_log_records(file: str, label: str, log_level: int) -> None:
    """Replace the child's log handlers (copies of the parent's, pytest's capture handlers among them, whose
    records would die with the child) by one that sends every record to the parent, which handles it as its
    own. A logger that does not propagate gets one too."""
    forwarder = _RecordForwarder(file, label)
    root = logging.getLogger()
    root.setLevel(log_level)  # a forkserver child starts with logging's defaults, not the parent's level
    loggers = [logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    for logger in [root] + loggers:
        if logger is root or (logger.handlers and not logger.propagate):
            logger.handlers = [forwarder]
        elif logger.handlers:
            logger.handlers = []


def answer_stack_requests(workdir: str, index: int) -> None:
    """On SIGUSR1 (:func:`take_stacks`), write every thread's stack to this child's stacks file."""
    stacks = open(path(workdir, index, "stacks"), "w")  # noqa: SIM115 - lives as long as the child
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)


# ---------------------------------------------------------------------------------------------------------
# In the parent
# ---------------------------------------------------------------------------------------------------------


def take_stacks(procs, outcomes, pending, workdir: str) -> None:
    """The thread stacks of the children still running at the deadline (``pending``), who are marked ``hung``."""
    paths = {i: path(workdir, i, "stacks") for i in pending}
    for i in pending:
        outcomes[i].status = "hung"
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[i].pid, signal.SIGUSR1)
    end = time.monotonic() + STACK_WAIT_S
    while time.monotonic() < end:
        # faulthandler writes every thread in one go; a non-empty file that stopped growing is complete.
        sizes = {i: _size(file) for i, file in paths.items()}
        if all(sizes.values()):
            time.sleep(0.05)
            if sizes == {i: _size(file) for i, file in paths.items()}:
                break
        time.sleep(0.02)
    for i, file in paths.items():
        outcomes[i].stacks = trim_stacks(_read(file)) or f"(no stacks: {outcomes[i].label} did not answer SIGUSR1)"


def hand_back(workdir: str, outcomes, specs) -> None:
    """Once the children have ended: their log records to this process's loggers, their output to their outcomes."""
    _replay_log_records(workdir, outcomes)
    for outcome, spec in zip(outcomes, specs):
        out = _read(path(workdir, outcome.index, "out"), _OUTPUT_LIMIT)
        err = "" if spec.merge_output else _read(path(workdir, outcome.index, "err"), _OUTPUT_LIMIT)
        outcome.stdout, outcome.stderr = out, err
        outcome.output = "\n".join(trim_stacks(out + err).splitlines()[-LOG_TAIL_LINES:])


def _replay_log_records(workdir: str, outcomes) -> None:
    """Hand the children's log records to this process's loggers, in the order they were made: pytest's
    "Captured log" sections, ``caplog`` and live logging see them as if the work had run here. A child killed
    mid-record loses only that record."""
    records = []
    for outcome in outcomes:
        with contextlib.suppress(OSError), open(path(workdir, outcome.index, "logs"), "rb") as f:
            records += [logging.makeLogRecord(fields) for fields in wire.read_records(f)]
    for record in sorted(records, key=lambda r: r.created):
        with contextlib.suppress(Exception):
            logging.getLogger(record.name).handle(record)


def _size(file: str) -> int:
    try:
        return os.path.getsize(file)
    except OSError:
        return 0


def _read(file: str, limit: int = -1) -> str:
    try:
        with open(file, errors="replace") as f:
            return f.read(limit)
    except OSError:
        return ""


def trim_stacks(text: str) -> str:
    """Drop the frames below the child's entry point from faulthandler dumps: a forked child inherits its parent's
    call stack (pytest's frames), which would push the child's own frames out of the report."""
    return tracebacks.up_to(text, _ENTRY)
