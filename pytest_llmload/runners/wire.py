"""What crosses a process boundary, in one scheme: a pickle, read back by an unpickler that knows which classes it may
build; and stores bound where only the run's ranks can reach them.

Every value one process of a run hands another goes through here, whoever wrote it:

- **a socket** (a rendezvous store): a key-value server on a TCP port with no authentication (torch's ``TCPStore``),
  where whatever process reaches the port can write a key. So nothing read from one is ever unpickled as it is:
  :func:`loads` reads with an allow-list (numbers, strings, bytes, ``None``, tuples, lists, dicts, sets, and the
  built-in exception types); a pickle that names anything else (``os.system``, a class of a module, a tensor) is
  refused with :class:`UnsafeValue`, before any of it runs;
- **a child this process started** (:mod:`.children`: an isolated call or check, a rank): its one answer
  (:class:`Answer`, through its own pipe) and its log records (through its own file) are read with
  ``trusted=True``: the child runs this process's code, and what its function returns may be any value that
  pickles (a tensor, a dataclass).

An exception crosses as itself, its class, message and attributes (:func:`exception_bytes`): a class that claims
another module than its own (pytest's outcomes say ``builtins``) goes by where it lives, and one whose ``__init__``
takes more than the message (the loader seam's errors) is a :class:`Portable`: rebuilt from its message and what of
its state pickles. One that does not survive the trip comes back as its text only.

A store made for the ranks of one machine listens on the loopback interface only (:func:`bound_store`), and one made
for the ranks of a launched job on the launcher's own address (``MASTER_ADDR``), not on every interface. The threat
model, stated in docs/reliability.md: another process that can reach a store's port (a local user, or a host on the
cluster network for a launched job's store) can disturb a run (write or delete keys: the run fails or hangs, to its
deadline), never run code in it.

Imports nothing heavy, not even :mod:`pickle` until a value crosses (the loader seam's errors are :class:`Portable`,
and a run that never sends one need not load it); ``torch.distributed`` only inside :func:`bound_store`.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import io
import sys
from collections.abc import Iterator
from typing import Any, NamedTuple, Optional

# The only names a pickle read from a socket may refer to: data types and the built-in exceptions (a rank's error
# travels as one), all of them harmless to construct.
_DATA = {"tuple", "list", "dict", "set", "frozenset", "bytes", "bytearray", "str", "int", "float", "complex",
         "bool", "range", "slice"}
_ALLOWED = {("builtins", name) for name in _DATA} | {
    ("builtins", name) for name, value in vars(builtins).items()
    if isinstance(value, type) and issubclass(value, BaseException)} | {("collections", "OrderedDict")}

# Where exception classes live that claim another module: pytest's outcomes (skip, xfail, fail, exit) say
# "builtins", for shorter reports, so pickle cannot find them by name.
_EXCEPTION_HOMES = ("_pytest.outcomes",)
_EXCEPTION_LIMIT = 1 << 20  # bytes of a child's exception; a larger one comes back as its text


class UnsafeValue(Exception):
    """A value read from a store that is not plain data: refused, never unpickled."""


@functools.cache
def _reader_class() -> type:
    import pickle

    class Reader(pickle.Unpickler):
        """Builds only the classes ``allowed`` names (``None``: any, for what a child of this process wrote)."""

        def __init__(self, file, allowed: Optional[set]):
            super().__init__(file)
            self.allowed = allowed

        def find_class(self, module: str, name: str):
            if self.allowed is None or (module, name) in self.allowed:
                return super().find_class(module, name)
            raise UnsafeValue(f"{module}.{name}")

    return Reader


def _reader(file, trusted: bool):
    return _reader_class()(file, None if trusted else _ALLOWED)


def dumps(value: Any, *, trusted: bool = False) -> bytes:
    """``value`` as bytes that :func:`loads` reads back. For a socket (not ``trusted``), a value that is not plain data
    is refused here, where it is made, with the same sentence a reader would give."""
    import pickle

    data = pickle.dumps(value)
    if not trusted:
        loads(data, what="a value to send")
    return data


def loads(data: bytes, *, what: str = "a value read from the store", trusted: bool = False) -> Any:
    """The value in ``data``. From a socket (not ``trusted``): plain data only, :class:`UnsafeValue` naming the first
    type that is not, before any of it runs. ``trusted``: what a child of this process wrote (any class)."""
    try:
        return _reader(io.BytesIO(data), trusted).load()
    except UnsafeValue as exc:
        raise UnsafeValue(
            f"{what} refers to {exc}, which is not plain data: between ranks only numbers, strings, bytes, None, "
            "tuples, lists, dicts, sets and built-in exceptions travel (a value from a store's socket is never "
            "unpickled as it is: anything that reaches the port could have written it). Return plain data from "
            "the function distributed_env runs, e.g. tensor.tolist().") from None


def picklable(value: Any) -> bool:
    import pickle

    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - whatever pickle raises, the value does not travel
        return False
    return True


def write_record(file, value: Any) -> None:
    """Append ``value`` to a file that :func:`read_records` reads (a child's log records, written one by one)."""
    file.write(dumps(value, trusted=True))


def read_records(file) -> Iterator[Any]:
    """What :func:`write_record` wrote to ``file``, in order, up to its end or to a record cut short (a child killed
    while it wrote one: only that one is lost). Trusted: a file of a child of this process."""
    while True:
        try:
            yield _reader(file, trusted=True).load()
        except Exception:  # noqa: BLE001 - the end of the file, or a record cut short by a kill
            return


# ---------------------------------------------------------------------------------------------------------
# A child's answer, and the exceptions in it
# ---------------------------------------------------------------------------------------------------------


class Answer(NamedTuple):
    """The one message a child sends its parent, when its function has ended: what the parent makes the child's
    :class:`~.children.ChildOutcome` of, and a check's row (:class:`pytest_llmload.reports.row.Row`) with it: the
    exception and the notes (the row is judged and written in the parent). A child that sends none died."""

    status: str  # "ok" or "raised"
    value: Any = None  # what the function returned (ok)
    error: str = ""  # "Type: message" of what it raised
    traceback: str = ""  # the child's traceback, as Python prints it
    exception: Optional[bytes] = None  # the exception (exception_bytes); None where it could not travel
    rendered: Optional[str] = None  # the child's own rendering of the failure (a pytest test's report)
    notes: tuple[str, ...] = ()  # what the check said about how it judged (config.stash_keys.add_note)


def exception_bytes(exc: BaseException) -> Optional[bytes]:
    """``exc`` as bytes that ``loads(..., trusted=True)`` makes the same exception of (class, args, attributes);
    ``None`` when it does not survive the trip (or is too large to send)."""
    import pickle

    travelling: Any = exc
    cls = type(exc)
    for home in _EXCEPTION_HOMES:
        module = sys.modules.get(home)
        if module is not None and getattr(module, cls.__qualname__, None) is cls and cls.__module__ != home:
            travelling = _ByReference(home, cls.__qualname__, exc.args, dict(vars(exc)))
            break
    with contextlib.suppress(Exception):
        data = pickle.dumps(travelling)
        if len(data) <= _EXCEPTION_LIMIT:
            loads(data, trusted=True)  # one that pickles but does not unpickle is no use to the parent
            return data
    return None


class Portable:
    """A base for exceptions whose ``__init__`` takes more than the message: they still cross a process boundary (an
    isolated check's child, a rank) as themselves, rebuilt from the message and whatever of their state pickles
    (what does not, the loader's own exception say, is in the message)."""

    def __reduce__(self):
        state = {key: value for key, value in vars(self).items() if picklable(value)}
        cls = type(self)
        return _rebuilt, (cls.__module__, cls.__qualname__, (str(self),), state)


class _ByReference:
    """An exception whose class claims another module, pickled by where the class lives."""

    def __init__(self, module: str, qualname: str, args: tuple, state: dict):
        self.module, self.qualname, self.args, self.state = module, qualname, args, state

    def __reduce__(self):
        return _rebuilt, (self.module, self.qualname, self.args, self.state)


def _rebuilt(module: str, qualname: str, args: tuple, state: dict) -> BaseException:
    """The exception of class ``module.qualname`` with these ``args`` and attributes, its ``__init__`` not called."""
    import importlib

    cls: Any = importlib.import_module(module)
    for name in qualname.split("."):
        cls = getattr(cls, name)
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


# ---------------------------------------------------------------------------------------------------------
# Stores
# ---------------------------------------------------------------------------------------------------------


def listening_socket(world_size: int, *, host: str = "127.0.0.1", port: int = 0):
    """A socket bound to ``port`` on ``host`` and listening, with no thread serving it yet: clients' connections
    wait in its backlog until :func:`bound_store` takes it over."""
    import socket

    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(max(128, world_size))
    except BaseException:
        listener.close()
        raise
    return listener


def bound_store(world_size: int, timeout, *, host: str = "127.0.0.1", port: int = 0, multi_tenant: bool = False,
                listener=None):
    """A ``TCPStore`` server on ``port`` (0: one the OS picks), listening on ``host`` only (the loopback interface by
    default; a launched job's stores: the launcher's own address), or on ``listener`` (:func:`listening_socket`),
    which it takes over. The store owns the listening socket (it closes it when it is deleted). ``multi_tenant``: a
    process group this process makes with env:// on the same port shares the server, as torch's own multi-tenant
    store does."""
    import torch.distributed as dist

    if listener is None:
        listener = listening_socket(world_size, host=host, port=port)
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
                              timeout=timeout, master_listen_fd=listener.fileno(), multi_tenant=multi_tenant)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # (the store closes the descriptor: this object must not close it again)
    return store
