"""Files a run writes where the user says (``--log``, ``--json``, ``--llmload-html``, pytest's ``--junitxml``, the
progress file): opened without following a link another user could have made.

In a directory other users can write (a shared ``/tmp``: the sticky bit keeps them from removing our files, not
from planting their own), a symbolic link at the path may be theirs, aimed at a file of ours that the open would
truncate or create; a file already there may be theirs, or a hard link to one of ours. Where the kernel does not
guard such links (``fs.protected_symlinks`` off, other systems), nothing else does. So, in such a directory, a
path through a symbolic link is refused, and so is a file there that is not ours alone: before the run
(:func:`unsafe_reason`), and again at the open (``O_NOFOLLOW``, the file's owner read from the open descriptor), so
that a link planted in between is not followed either. A directory only the user (or root) can write is the
user's own: a link there is theirs and followed, as before.

>>> with open_output("/tmp/run.log") as log:  # doctest: +SKIP
...     log.write("...")
"""

from __future__ import annotations

import fcntl
import os
import stat
from typing import Optional, TextIO


class UnsafeOutputFile(OSError):
    """An output path another user may control; the message is a sentence naming the path and what to do (also its
    ``strerror``, which callers that report an ``OSError`` by its words read)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.strerror = message


def others_can_write(directory: str) -> bool:
    """Whether a user other than this process's (and root) can add or replace entries in ``directory``: it is
    writable by everyone, or it belongs to another user. (A group-writable directory of one's own counts as one's
    own: with per-user groups, the usual umask 002 makes every directory so.)"""
    try:
        info = os.stat(directory)
    except OSError:  # (a directory that cannot be read is judged where it is opened)
        return False
    return bool(info.st_mode & stat.S_IWOTH) or info.st_uid not in (os.geteuid(), 0)


def unsafe_reason(path: "str | os.PathLike[str]") -> Optional[str]:
    """Why ``path`` may not be written as an output file, as the end of a sentence that starts with the path (and
    the option that named it); ``None`` where it may."""
    full = os.path.abspath(os.fspath(path))
    parts = full.split(os.sep)[1:]
    for depth in range(1, len(parts) + 1):
        here = os.sep + os.path.join(*parts[:depth])
        try:
            info = os.lstat(here)
        except OSError:  # (the rest does not exist yet: nothing there to follow)
            break
        directory = os.path.realpath(os.path.dirname(here))
        if not others_can_write(directory):
            continue
        if stat.S_ISLNK(info.st_mode):
            what = "is" if here == full else f"goes through {here!r}, which is"
            return (f"{what} a symbolic link in {directory!r}, a directory other users can write: the link may be "
                    f"another user's, aimed at a file of yours; name the file itself ({os.path.realpath(here)!r}) "
                    "or a path in a directory only you can write.")
        if here == full:
            return _not_ours_alone(info, directory)
    return None


def _not_ours_alone(info: os.stat_result, directory: str) -> Optional[str]:
    """A file in a directory others can write that another user owns, or that has another name (a hard link,
    maybe to a file of ours, that writing would change)."""
    if not stat.S_ISREG(info.st_mode):
        return None  # (a directory, a device: the caller's own checks name it)
    if info.st_uid != os.geteuid():
        return (f"is a file of another user (uid {info.st_uid}) in {directory!r}, a directory other users can "
                "write: its owner would read what the run writes; remove it or name a file in a directory only you "
                "can write.")
    if info.st_nlink > 1:
        return (f"has {info.st_nlink} names (a hard link) in {directory!r}, a directory other users can write: "
                "writing it would change the file it is linked to; remove it or name a file in a directory only "
                "you can write.")
    return None


def open_output_fd(path: "str | os.PathLike[str]", *, append: bool = False, mode: int = 0o666) -> int:
    """``path`` opened for writing (truncated, or for appending), as :func:`unsafe_reason` allows: a descriptor.
    :class:`UnsafeOutputFile` where it does not (a link planted since the run's own check included)."""
    reason = unsafe_reason(path)
    if reason is not None:
        raise UnsafeOutputFile(f"{os.fspath(path)!r} {reason}")
    directory = os.path.realpath(os.path.dirname(os.path.abspath(os.fspath(path))))
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else 0)
    if not others_can_write(directory):
        return os.open(path, flags | (0 if append else os.O_TRUNC), mode)
    # Not truncated until it is known to be ours; O_NONBLOCK: a FIFO planted there does not block the open.
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
    except OSError as exc:
        if not os.path.islink(path):
            raise
        raise UnsafeOutputFile(f"{os.fspath(path)!r} {unsafe_reason(path) or 'became a symbolic link'}") from exc
    try:
        info = os.fstat(fd)
        reason = _not_ours_alone(info, directory) or (
            None if stat.S_ISREG(info.st_mode) else
            f"is not a regular file in {directory!r}, a directory other users can write; name a file.")
        if reason is not None:
            raise UnsafeOutputFile(f"{os.fspath(path)!r} {reason}")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if not append:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_output(path: "str | os.PathLike[str]", *, append: bool = False, encoding: str = "utf-8") -> TextIO:
    """:func:`open_output_fd` as a text file."""
    return os.fdopen(open_output_fd(path, append=append), "a" if append else "w", encoding=encoding)
