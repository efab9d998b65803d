"""Offline mode while llmload fixtures and checks run: the hub is off and the network is closed.

``HF_HUB_OFFLINE=1`` alone is not enough: huggingface_hub reads it once, at import, into a module
constant, so a process that imported it earlier stays online. The guard sets both, and closes
``socket.connect`` to anything but loopback and Unix sockets (process groups rendezvous on loopback), so
whatever still reaches for the network fails at once with a sentence that names who tried.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
import traceback
from collections.abc import Iterator
from typing import Optional

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

# Frames of these packages are plumbing; the culprit named in the error is the first frame outside them.
_PLUMBING = ("socket", "ssl", "http", "urllib", "urllib3", "requests", "httpx", "httpcore", "h11", "anyio",
             "asyncio", "huggingface_hub/utils/_http", "pytest_llmload/offline", "pytest_llmload/probes",
             "contextlib")


class NetworkAccessBlocked(OSError):
    """Raised when code under an llmload fixture or check tries to open a network connection."""


def _is_local(address) -> bool:
    if not isinstance(address, tuple) or not address:
        return True  # AF_UNIX paths and the like
    host = address[0]
    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost would need DNS: that is the network


def _culprit() -> str:
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace(os.sep, "/")
        if not any(f"/{p}" in path for p in _PLUMBING):
            return f"{frame.name} ({path}:{frame.lineno})"
    return "unknown caller"


@contextlib.contextmanager
def network_guard(record: Optional[list] = None) -> Iterator[None]:
    """Close the network to everything but loopback for the duration; nests safely.

    With ``record``, each refused attempt is also appended to it (``"connect ('huggingface.co', 443) from
    <caller>"``), so a check sees an attempt even when the code under test catches the error and goes on."""
    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex
    original_sendto = socket.socket.sendto
    original_getaddrinfo = socket.getaddrinfo
    original_gethostbyname = socket.gethostbyname
    original_gethostbyname_ex = socket.gethostbyname_ex

    def refuse(what: str, address) -> None:
        culprit = _culprit()
        if record is not None:
            record.append(f"{what} {address!r} from {culprit}")
        raise NetworkAccessBlocked(
            f"pytest-llmload blocked a network connection to {address!r} from {culprit}: llmload fixtures "
            "and checks run offline (HF_HUB_OFFLINE=1). Load models from a local path (LoadRequest.model_path, "
            "local_files_only=True); nothing may be downloaded at test time."
        )

    def guarded_connect(sock, address):
        if not _is_local(address):
            refuse("connect", address)
        return original_connect(sock, address)

    def guarded_connect_ex(sock, address):
        if not _is_local(address):
            refuse("connect", address)
        return original_connect_ex(sock, address)

    def guarded_sendto(sock, data, *args):
        address = args[-1]  # sendto(data, address) or sendto(data, flags, address): UDP needs no connect
        if not _is_local(address):
            refuse("sendto", address)
        return original_sendto(sock, data, *args)

    def guarded_getaddrinfo(host, port, *args, **kwargs):
        # Name lookup comes before connect: a DNS query is already the network.
        if host is not None and not _is_local((host.decode() if isinstance(host, bytes) else host, port)):
            refuse("getaddrinfo", (host, port))
        return original_getaddrinfo(host, port, *args, **kwargs)

    def guarded_gethostbyname(host):
        if not _is_local((host, 0)):
            refuse("gethostbyname", host)
        return original_gethostbyname(host)

    def guarded_gethostbyname_ex(host):
        if not _is_local((host, 0)):
            refuse("gethostbyname_ex", host)
        return original_gethostbyname_ex(host)

    socket.socket.connect = guarded_connect
    socket.socket.connect_ex = guarded_connect_ex
    socket.socket.sendto = guarded_sendto
    socket.getaddrinfo = guarded_getaddrinfo
    socket.gethostbyname = guarded_gethostbyname
    socket.gethostbyname_ex = guarded_gethostbyname_ex
    try:
        yield
    finally:
        socket.socket.connect = original_connect
        socket.socket.connect_ex = original_connect_ex
        socket.socket.sendto = original_sendto
        socket.getaddrinfo = original_getaddrinfo
        socket.gethostbyname = original_gethostbyname
        socket.gethostbyname_ex = original_gethostbyname_ex


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """Set the offline variables, and the constant huggingface_hub derived from them if it is imported."""
    saved_env = {key: os.environ.get(key) for key in OFFLINE_ENV}
    os.environ.update(OFFLINE_ENV)
    constants = sys.modules.get("huggingface_hub.constants")
    saved_constant = getattr(constants, "HF_HUB_OFFLINE", None)
    if constants is not None:
        constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if constants is not None:
            constants.HF_HUB_OFFLINE = saved_constant


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Both guards: the hub is offline and non-loopback connections fail naming the caller."""
    with hub_offline(), network_guard():
        yield
