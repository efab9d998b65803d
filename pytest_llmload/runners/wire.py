"""What crosses a process boundary, in two schemes, by who could have written it; and stores bound where only the
run's ranks can reach them.

- **A store's socket** (the ranks of a launched job meeting in a rendezvous store): a key-value server on a TCP port
  (torch's ``TCPStore``) that any process reaching the port can read, list and write. So what travels there is
  plain data in JSON (:func:`seal`, :func:`unseal`): nothing read from a store is unpickled or builds anything but
  numbers, strings, bytes, ``None``, lists, tuples, dicts and sets; each value is bounded in size and checked against
  the :class:`Shape` its key holds (an exit status, a phase's outcome, ...), and carries an HMAC-SHA256 over its key
  and its JSON made with the run's secret (``$PYTEST_LLMLOAD_RUN_SECRET``): a value that is too large, not signed by
  this run, not plain data or not of its key's shape is refused (:class:`RefusedValue`) with a sentence naming the
  key and the rank, before anything is built from it. Exceptions do not travel there: a rank's error goes as its
  text (type, message, traceback).
- **A child this process started** (:mod:`.children`: an isolated call or check, a rank): its one answer
  (:class:`Answer`, through its own pipe) and its log records (through its own file) are pickles (:func:`dumps`,
  :func:`loads`): the child runs this process's code, and what its function returns may be any value that pickles
  (a tensor, a dataclass). Nothing read from a socket is ever read this way.

An exception crosses from a child as itself, its class, message and attributes (:func:`exception_bytes`): a class
that claims another module than its own (pytest's outcomes say ``builtins``) goes by where it lives, and one whose
``__init__`` takes more than the message (the loader seam's errors) is a :class:`Portable`: rebuilt from its message
and what of its state pickles. One that does not survive the trip comes back as its text only.

A store made for the ranks of one machine listens on the loopback interface only (:func:`bound_store`), and one made
for the ranks of a launched job on the launcher's own address (``MASTER_ADDR``), never on every interface unless the
user asks for it (:func:`every_interface`). The threat model, stated in docs/reliability.md: another process that
can reach a store's port (a local user, or a host on the cluster network for a launched job's store) can disturb a
run (delete keys, post values that are refused: the run stops or waits to its deadline), never run code in it, make
it build a large object, or, where the run has a secret, post a value it takes for a rank's.

Imports nothing heavy, not even :mod:`pickle` or :mod:`json` until a value crosses (the loader seam's errors are
:class:`Portable`, and a run that never sends one need not load it); ``torch.distributed`` only inside
:func:`bound_store`.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
from collections.abc import Iterator
from typing import Any, Callable, NamedTuple, Optional

from pytest_llmload.system.words import a_type

# Where exception classes live that claim another module: pytest's outcomes (skip, xfail, fail, exit) say
# "builtins", for shorter reports, so pickle cannot find them by name.
_EXCEPTION_HOMES = ("_pytest.outcomes",)
_EXCEPTION_LIMIT = 1 << 20  # bytes of a child's exception; a larger one comes back as its text


def dumps(value: Any) -> bytes:
    """``value`` as bytes that :func:`loads` reads back: for a child of this process and its parent only."""
    import pickle

    return pickle.dumps(value)


def loads(data: bytes) -> Any:
    """The value in ``data``, any class: only what a child of this process wrote (never a socket's bytes)."""
    import pickle

    return pickle.loads(data)


def picklable(value: Any) -> bool:
    import pickle

    try:
        pickle.dumps(value)
    except Exception:  # noqa: BLE001 - whatever pickle raises, the value does not travel
        return False
    return True


def write_record(file, value: Any) -> None:
    """Append ``value`` to a file that :func:`read_records` reads (a child's log records, written one by one)."""
    file.write(dumps(value))


def read_records(file) -> Iterator[Any]:
    """What :func:`write_record` wrote to ``file``, in order, up to its end or to a record cut short (a child killed
    while it wrote one: only that one is lost). A file of a child of this process."""
    import pickle

    while True:
        try:
            yield pickle.load(file)
        except Exception:  # noqa: BLE001 - the end of the file, or a record cut short by a kill
            return


# ---------------------------------------------------------------------------------------------------------
# A child's answer, and the exceptions in it
# ---------------------------------------------------------------------------------------------------------


class Answer(NamedTuple):
    """The one message a child sends its parent, when its function has ended: what the parent makes the child's
    :class:`~.children.ChildOutcome` of: the value or the exception, an isolated check's row as the child judged it
    (plain data, taken as it is by :func:`pytest_llmload.reports.verdict.row_of`), the notes, and what the test's
    recorder saw in the child. A child that sends none died."""

    status: str  # "ok" or "raised"
    value: Any = None  # what the function returned (ok)
    error: str = ""  # "Type: message" of what it raised
    traceback: str = ""  # the child's traceback, as Python prints it
    exception: Optional[bytes] = None  # the exception (exception_bytes); None where it could not travel
    rendered: Optional[str] = None  # the child's own rendering of the failure (a pytest test's report)
    notes: tuple[str, ...] = ()  # what the check said about how it judged (config.stash_keys.add_note)
    row: Optional[dict] = None  # an isolated check's row, judged in the child (checks.judgement.JUDGED_FIELDS)
    artefacts: Optional[dict] = None  # {"models": [...], "phases": [...]} the test's recorder saw in the child


def exception_bytes(exc: BaseException) -> Optional[bytes]:
    """``exc`` as bytes that :func:`loads` makes the same exception of (class, args, attributes);
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
            loads(data)  # one that pickles but does not unpickle is no use to the parent
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
# Values in a store: plain data, bounded, of their key's shape, signed by the run
# ---------------------------------------------------------------------------------------------------------

_MAC_BYTES = 64  # an HMAC-SHA256 in hex, before the value's JSON
# JSON has lists, strings, numbers, true/false/null; the other plain types go as a one-key object naming the type
# (every dict too, so a dict posted never reads as one of these).
_TAGS = ("tuple", "dict", "set", "frozenset", "bytes")
PLAIN_DATA = "numbers, strings, bytes, None, lists, tuples, dicts and sets"


class Shape(NamedTuple):
    """What a store key holds: ``what`` it is in words ("an exit status (an integer)"), whether a value ``fits``,
    and the most bytes of JSON a value there may take (a larger one is refused unread)."""

    what: str
    fits: Callable[[Any], bool]
    limit: int


class NotPlainData(TypeError):
    """A value this rank would post that is not plain data, or too large for its key."""


class RefusedValue(Exception):
    """A value read from a store that is refused: too large, not signed with this run's secret, not plain data, or
    not of its key's shape. The message names the key and the rank whose key it is."""


def seal(key: str, value: Any, secret: bytes, shape: Shape) -> bytes:
    """``value`` as what is posted under ``key``: an HMAC-SHA256 over the key and the JSON, made with ``secret``,
    then the JSON. A value that is not plain data, of another shape or too large is :class:`NotPlainData`."""
    import json

    try:
        text = json.dumps(_tagged(value), separators=(",", ":")).encode()
    except (_NotPlain, ValueError, RecursionError) as exc:  # (an int of 5,000 digits, a list that holds itself)
        held = exc if isinstance(exc, _NotPlain) else "an int too long or a structure too deep for JSON"
        raise NotPlainData(
            f"the value to post under {key!r} holds {held}, which is not plain data: between ranks only "
            f"{PLAIN_DATA} travel (a store's socket is open to any process that reaches it). Return plain data from "
            "the function distributed_env runs, e.g. tensor.tolist().") from None
    if len(text) > shape.limit:
        raise NotPlainData(f"the value to post under {key!r} is {len(text):,} bytes of JSON, over the "
                           f"{shape.limit:,} a value there may take; return less from the function distributed_env "
                           "runs.")
    if not shape.fits(value):  # (this rank's own value: a bug here, said before any peer reads it)
        raise NotPlainData(f"the value to post under {key!r} is {_shown(value)}, not {shape.what}.")
    return _mac(secret, key, text).encode() + text


def unseal(key: str, data: bytes, secret: bytes, shape: Shape, rank: int) -> Any:
    """The value ``data`` posted under ``key`` (rank ``rank``'s key) holds, checked in the order that costs least:
    its size, its MAC, then its JSON, its plain types and its shape. :class:`RefusedValue` otherwise, naming them."""
    import hmac
    import json

    mine = f"rank {rank}'s key {key!r}"
    if len(data) > _MAC_BYTES + shape.limit:
        raise RefusedValue(f"the value under {mine} is {len(data):,} bytes, over the {shape.limit:,} a value there "
                           "may take; refused unread.")
    mac, text = data[:_MAC_BYTES], data[_MAC_BYTES:]
    if not hmac.compare_digest(mac, _mac(secret, key, text).encode()):
        raise RefusedValue(
            f"the value under {mine} "
            + ("was not signed with this run's secret: a process outside the job posted it, or that rank runs with "
               "another $PYTEST_LLMLOAD_RUN_SECRET" if secret else
               "carries no signature a rank makes: a process outside the job posted it, or that rank runs with a "
               "$PYTEST_LLMLOAD_RUN_SECRET this one lacks")
            + " (every rank must inherit the same one from the launcher); refused unread.")
    try:
        value = _untagged(json.loads(text))
    except (ValueError, RecursionError, _NotPlain):  # (a JSON error is a ValueError; so is a 5,000-digit int)
        raise RefusedValue(f"rank {rank} posted {key} = {_shown(text)}, which is not plain data as pytest-llmload "
                           "writes it (JSON of " + PLAIN_DATA + "); refused.") from None
    if not shape.fits(value):
        raise RefusedValue(f"rank {rank} posted {key} = {_shown(value)}, not {shape.what}; refused.")
    return value


def _mac(secret: bytes, key: str, text: bytes) -> str:
    import hashlib
    import hmac

    # The key's length first: no (key, value) pair signs as another with the boundary moved.
    return hmac.new(secret, f"{len(key)}:{key}".encode() + text, hashlib.sha256).hexdigest()


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class _NotPlain(Exception):
    """(what is not plain data, by its type's name)"""


def _tagged(value: Any) -> Any:
    """``value`` as JSON holds it: the types JSON lacks as a one-key object naming them."""
    import base64

    kind = type(value)
    if value is None or kind in (bool, int, float, str):
        return value
    if kind is list:
        return [_tagged(item) for item in value]
    if kind is dict:
        return {"dict": [[_tagged(k), _tagged(v)] for k, v in value.items()]}
    if kind in (tuple, set, frozenset):
        return {kind.__name__: [_tagged(item) for item in value]}
    if kind is bytes:
        return {"bytes": base64.b64encode(value).decode()}
    raise _NotPlain(a_type(value) + ("" if kind.__module__ == "builtins" else f" (from {kind.__module__})"))


def _untagged(value: Any) -> Any:
    """What :func:`_tagged` made, back; :class:`_NotPlain` for anything it would not have made."""
    import base64
    import binascii

    if value is None or type(value) in (bool, int, float, str):
        return value
    if type(value) is list:
        return [_untagged(item) for item in value]
    if type(value) is not dict or len(value) != 1 or next(iter(value)) not in _TAGS:
        raise _NotPlain(value)
    (kind, items), = value.items()
    try:
        if kind == "bytes":
            return base64.b64decode(items, validate=True)
        if type(items) is not list:
            raise _NotPlain(value)
        if kind == "dict":
            return {_untagged(k): _untagged(v) for k, v in items}
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](_untagged(item) for item in items)
    except (TypeError, ValueError, binascii.Error):  # an unhashable key or member, a pair that is not one
        raise _NotPlain(value) from None


# ---------------------------------------------------------------------------------------------------------
# Stores
# ---------------------------------------------------------------------------------------------------------


def every_interface(host: str) -> bool:
    """Whether a socket bound to ``host`` listens on every interface of this machine: ``0.0.0.0``, ``::``, ``""``,
    ``*`` and their other spellings (``0``, ``[::]``, ``0:0::0``)."""
    import ipaddress
    import socket

    text = host.strip().removeprefix("[").removesuffix("]")
    if text in ("", "*"):
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(text).is_unspecified
    try:
        return socket.inet_aton(text) == bytes(4)  # (the C library's spellings: "0", "0.0", "0x0")
    except OSError:
        return False


def listening_socket(world_size: int, *, host: str = "127.0.0.1", port: int = 0, every_interface_allowed=False):
    """A socket bound to ``port`` on ``host`` and listening, with no thread serving it yet: clients' connections
    wait in its backlog until :func:`bound_store` takes it over. A ``host`` that means every interface is refused
    (``ValueError``) unless ``every_interface_allowed``: the user asked for it."""
    import socket

    if every_interface(host) and not every_interface_allowed:
        raise ValueError(f"a store on {host!r} would listen on every interface of this machine; pass an address "
                         "the ranks reach it at (or ask for every interface: --llmload-bind-all-interfaces)")
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
                listener=None, every_interface_allowed: bool = False):
    """A ``TCPStore`` server on ``port`` (0: one the OS picks), listening on ``host`` only (the loopback interface by
    default; a launched job's stores: the launcher's own address), or on ``listener`` (:func:`listening_socket`),
    which it takes over. The store owns the listening socket (it closes it when it is deleted). ``multi_tenant``: a
    process group this process makes with env:// on the same port shares the server, as torch's own multi-tenant
    store does."""
    import torch.distributed as dist

    if listener is None:
        listener = listening_socket(world_size, host=host, port=port, every_interface_allowed=every_interface_allowed)
    try:
        store = dist.TCPStore(host, listener.getsockname()[1], world_size, is_master=True, wait_for_workers=False,
                              timeout=timeout, master_listen_fd=listener.fileno(), multi_tenant=multi_tenant)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # (the store closes the descriptor: this object must not close it again)
    return store
