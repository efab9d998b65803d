"""Offline mode while llmload tests run: the hub is off and the network is closed.

The plugin enters :func:`offline` around the setup, call and teardown of each test that uses an llmload fixture
(``llmload_offline`` is in its fixture closure) and leaves it after each phase, so the rest of a suite runs as it
would without the plugin.

``HF_HUB_OFFLINE=1`` alone is not enough: huggingface_hub reads it once, at import, into a module constant, so a
process that imported it earlier stays online. The guard sets both, and refuses connections, datagrams and name
lookups to anything but loopback and Unix sockets (process groups rendezvous on loopback), so whatever still
reaches for the network fails at once with a sentence that names who tried. It refuses them in an audit hook
(:func:`sys.addaudithook`): CPython raises the ``socket.*`` audit events inside the C functions themselves, so
the hook sees what patching the ``socket`` module misses (``_socket.socket.connect``, a ``from socket import
gethostbyname`` made earlier, a library's own reference to the function).
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import sys
import tempfile
from collections.abc import Iterator
from typing import Optional

from pytest_llmload.system import tracebacks

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# Module constants the offline variables are read into at import: (module, attribute). transformers < 4.50 kept
# its own copy of huggingface_hub's.
_OFFLINE_CONSTANTS = (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("transformers.utils.hub", "_is_offline_mode"))

# The audit events that reach the network, and where their arguments hold the address: connect and connect_ex
# raise socket.connect (socket, address), gethostbyname_ex raises socket.gethostbyname (host,).
_ADDRESS_OF = {
    "socket.connect": lambda args: args[1],
    "socket.sendto": lambda args: args[1],  # UDP needs no connect
    "socket.sendmsg": lambda args: args[1],  # None on a connected socket: its connect was checked
    "socket.getaddrinfo": lambda args: (args[0], args[1]),  # a DNS query is already the network
    "socket.gethostbyname": lambda args: (args[0],),  # a name lookup: the host alone
    "socket.gethostbyaddr": lambda args: (args[0],),
    "socket.getnameinfo": lambda args: args[0],  # a reverse lookup (sockaddr, flags): the network for a remote host
}


class NetworkAccessBlocked(OSError):
    """Raised when code under an llmload fixture or check tries to reach the network."""


def _is_local(address) -> bool:
    if not isinstance(address, tuple) or not address:
        return True  # AF_UNIX paths and the like; None for sendmsg on a connected socket
    host = address[0]
    if isinstance(host, (bytes, bytearray)):
        host = bytes(host).decode(errors="replace")
    if host in (None, "localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost would need DNS: that is the network


def _culprit() -> str:
    """Who reached for the network: the first frame outside the network stack and this guard."""
    found = tracebacks.culprit(sys._getframe(1), tracebacks.NETWORK_PLUMBING)
    return "unknown caller" if found is None else tracebacks.where(found)


# One entry per guard entered and not yet left, ``[its record list or None, the pid that entered it, its spool]``:
# the hook refuses while any is.
_active: list[list] = []
_hook_installed = False


def _audit(event: str, args: tuple) -> None:
    if not _active or event not in _ADDRESS_OF:  # every audited event in the process passes here: be quick
        return
    address = _ADDRESS_OF[event](args)
    if _is_local(address):
        return
    what, shown = event.removeprefix("socket."), address[0] if len(address) == 1 else address
    culprit = _culprit()
    for record, owner, spool in _active:
        if record is None:
            continue
        if os.getpid() == owner:
            record.append(f"{what} {shown!r} from {culprit}")
        else:  # a forked child's attempt: its list is its own copy, the spool file is shared with the guard's process
            with contextlib.suppress(OSError):
                os.write(spool, f"{what} {shown!r} from {culprit}\n".encode("utf-8", "replace"))
    access = "a name lookup of" if len(address) == 1 else "a network connection to"
    raise NetworkAccessBlocked(
        f"pytest-llmload blocked {access} {shown!r} from {culprit}: llmload fixtures and checks "
        "run offline (HF_HUB_OFFLINE=1). Load models from a local path (LoadRequest.model_path, "
        "local_files_only=True); nothing may be downloaded at test time."
    )


def guard_active() -> bool:
    """Whether a :func:`network_guard` is entered (in any thread) right now."""
    return bool(_active)


@contextlib.contextmanager
def network_guard(record: Optional[list] = None) -> Iterator[None]:
    """Close the network to everything but loopback for the duration, in the whole process; nests safely.

    With ``record``, each refused attempt is also appended to it (``"getaddrinfo ('huggingface.co', 443) from
    <caller>"``), so a check sees an attempt even when the code under test catches the error and goes on, or makes
    it in a process it forked (read back when the guard is left)."""
    global _hook_installed
    if not _hook_installed:  # an audit hook cannot be removed: one, idle while no guard is entered
        sys.addaudithook(_audit)
        _hook_installed = True
    spool = _open_spool() if record is not None else None
    entry = [record, os.getpid(), spool]  # its own object: guards with equal record lists nest too
    _active.append(entry)
    try:
        yield
    finally:
        del _active[next(i for i, e in enumerate(_active) if e is entry)]
        if spool is not None:
            record.extend(_read_spool(spool))


def _open_spool() -> int:
    """An unnamed file, appended to by forked children (one write a line: their lines never interleave); in memory
    where the system has them (no temp dir needed)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("llmload-network-attempts")
    else:
        fd, name = tempfile.mkstemp(prefix="llmload-network-")
        os.unlink(name)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    return fd


def _read_spool(fd: int) -> list[str]:
    try:
        data, chunk = b"", os.pread(fd, 1 << 16, 0)
        while chunk:
            data += chunk
            chunk = os.pread(fd, 1 << 16, len(data))
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace").splitlines()


def _offline_by_environment() -> bool:
    """What huggingface_hub derives from the environment at import."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in ("1", "ON", "YES", "TRUE")


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Set the offline variables, and the constants read from them by the modules already imported; restore both,
    also the constant of a module first imported meanwhile (it read the offline environment)."""
    saved_env = {key: os.environ.get(key) for key in OFFLINE_ENV}
    os.environ.update(OFFLINE_ENV)
    saved_constants = {}
    for module_name, attribute in _OFFLINE_CONSTANTS:
        module = sys.modules.get(module_name)
        if module is not None and hasattr(module, attribute):
            saved_constants[module_name] = getattr(module, attribute)
            setattr(module, attribute, True)
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for module_name, attribute in _OFFLINE_CONSTANTS:
            module = sys.modules.get(module_name)
            if module is not None and hasattr(module, attribute):
                setattr(module, attribute, saved_constants.get(module_name, _offline_by_environment()))


@contextlib.contextmanager
def offline(record: Optional[list] = None) -> Iterator[None]:
    """Both guards: the hub is offline and non-loopback connections and lookups fail naming the caller (each refused
    attempt also appended to ``record``, as :func:`network_guard` does)."""
    with hub_offline(), network_guard(record):
        yield
