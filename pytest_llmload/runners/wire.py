"""What crosses a socket between ranks: plain data only, and stores bound where only the run's ranks can reach them.

A rendezvous store is a key-value server on a TCP port with no authentication (torch's ``TCPStore``): whatever
process reaches the port can write a key. So nothing read from one is ever unpickled as it is:

- values go as pickles that :func:`loads` reads with an allow-list: numbers, strings, bytes, ``None``, tuples,
  lists, dicts, sets, and the built-in exception types; a pickle that names anything else (``os.system``, a class
  of a module, a tensor) is refused with :class:`UnsafeValue`, before any of it runs;
- a store made for the ranks of one machine listens on the loopback interface only (:func:`bound_store`), and
  one made for the ranks of a launched job on the launcher's own address (``MASTER_ADDR``), not on every interface.

The threat model, stated in docs/reliability.md: another process that can reach a store's port (a local user, or a
host on the cluster network for a launched job's store) can disturb a run (write or delete keys: the run fails or
hangs, to its deadline), never run code in it.

Imports nothing heavy (``torch.distributed`` only inside :func:`bound_store`).
"""

from __future__ import annotations

import builtins
import io
import pickle
import socket
from typing import Any

# The only names a pickle read from a socket may refer to: data types and the built-in exceptions (a rank's error
# travels as one), all of them harmless to construct.
_DATA = {"tuple", "list", "dict", "set", "frozenset", "bytes", "bytearray", "str", "int", "float", "complex",
         "bool", "range", "slice"}
_ALLOWED = {("builtins", name) for name in _DATA} | {
    ("builtins", name) for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)} | {("collections", "OrderedDict")}


class UnsafeValue(Exception):
    """A value read from a store that is not plain data: refused, never unpickled."""


class _DataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise UnsafeValue(f"{module}.{name}")


def dumps(value: Any) -> bytes:
    """``value`` as bytes that :func:`loads` reads back; a value that is not plain data is refused here, where it is
    made, with the same sentence a reader would give."""
    data = pickle.dumps(value)
    loads(data, what="a value to send")
    return data


def loads(data: bytes, *, what: str = "a value read from the store") -> Any:
    """The plain data in ``data``; :class:`UnsafeValue` naming the first type that is not, before any of it runs."""
    try:
        return _DataUnpickler(io.BytesIO(data)).load()
    except UnsafeValue as exc:
        raise UnsafeValue(
            f"{what} refers to {exc}, which is not plain data: between ranks only numbers, strings, bytes, None, "
            "tuples, lists, dicts, sets and built-in exceptions travel (a value from a store's socket is never "
            "unpickled as it is: anything that reaches the port could have written it). Return plain data from "
            "the function distributed_env runs, e.g. tensor.tolist().") from None


def bound_store(world_size: int, timeout, *, host: str = "127.0.0.1", port: int = 0, multi_tenant: bool = False):
    """A ``TCPStore`` server on ``port`` (0: one the OS picks), listening on ``host`` only (the loopback interface by
    default; a launched job's stores: the launcher's own address). The store owns the listening socket (it closes it
    when it is deleted). ``multi_tenant``: a process group this process makes with env:// on the same port shares
    the server, as torch's own multi-tenant store does."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(max(128, world_size))
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
                              timeout=timeout, master_listen_fd=listener.fileno(), multi_tenant=multi_tenant)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # (the store closes the descriptor: this object must not close it again)
    return store
