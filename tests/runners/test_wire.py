"""What crosses a process boundary (pytest_llmload.runners.wire): from a socket between ranks plain data only, and
stores bound where only the run's ranks reach them (issue 36: a pickle posted to the launcher's store by another
process ran in rank 0); from a child of this process, its answer with its exception as itself."""

import datetime
import os
import pickle
import socket
import time

import pytest

from pytest_llmload.runners import wire
from pytest_llmload.runners.launcher import Launch, Meeting

pytestmark = pytest.mark.timeout(60)


class Payload:
    """What an attacker posts: unpickling it runs ``os.system``."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_plain_data_goes_and_comes_back_as_it_was():
    value = {"outcome": "failed", "text": "x", "agreed": False, "ranks": [0, 1], "pair": (1, 2.5), "none": None,
             "bytes": b"\x00", "set": {3}, "error": ValueError("bad")}
    back = wire.loads(wire.dumps(value))
    assert {k: v for k, v in back.items() if k != "error"} == {k: v for k, v in value.items() if k != "error"}
    assert type(back["error"]) is ValueError and back["error"].args == ("bad",)


def test_a_pickle_that_runs_code_is_refused_before_any_of_it_runs(tmp_path):
    marker = tmp_path / "ran"
    data = pickle.dumps(Payload(f"touch {marker}"))
    with pytest.raises(wire.UnsafeValue, match=r"rank 1's value under 'k' refers to posix.system, which is not "
                                               r"plain data"):
        wire.loads(data, what="rank 1's value under 'k'")
    assert not marker.exists()
    with pytest.raises(wire.UnsafeValue, match="a value to send refers to posix.system"):
        wire.dumps(Payload("true"))


def test_an_exception_crosses_from_a_child_as_itself_and_never_from_a_socket():
    import threading

    from pytest_llmload.loader.seam import LoaderModelError

    # The seam's errors (an __init__ that takes more than the message): rebuilt from the message and what pickles.
    error = LoaderModelError("the model misbehaves")
    error.detail, error.lock = {"rank": 1}, threading.Lock()
    error.add_note("a note")
    back = wire.loads(wire.exception_bytes(error), trusted=True)
    assert type(back) is LoaderModelError and str(back) == "the model misbehaves" and back.args == error.args
    assert back.detail == {"rank": 1} and not hasattr(back, "lock") and back.__notes__ == ["a note"]
    # pytest's outcomes claim the module builtins: found where they live.
    skip = wire.loads(wire.exception_bytes(pytest.skip.Exception("not here", _use_item_location=True)), trusted=True)
    assert type(skip) is pytest.skip.Exception and skip.msg == "not here" and skip._use_item_location is True
    # An exception that does not pickle does not travel (the child's answer then carries its text only).
    unpicklable = ValueError("x")
    unpicklable.lock = threading.Lock()
    assert wire.exception_bytes(unpicklable) is None
    # A child's answer names classes: from a socket it is refused, before any of it runs.
    with pytest.raises(wire.UnsafeValue, match="refers to pytest_llmload.runners.wire"):
        wire.loads(wire.dumps(wire.Answer("raised", exception=wire.exception_bytes(error)), trusted=True))
    with pytest.raises(wire.UnsafeValue, match=r"refers to pytest_llmload.runners.wire._rebuilt"):
        wire.loads(wire.exception_bytes(error))


def test_a_childs_records_are_read_up_to_one_cut_short(tmp_path):
    path = tmp_path / "logs"
    with open(path, "wb") as f:
        wire.write_record(f, {"msg": "first"})
        wire.write_record(f, {"msg": "second"})
        f.write(wire.dumps({"msg": "cut short by a kill"}, trusted=True)[:-3])
    with open(path, "rb") as f:
        assert list(wire.read_records(f)) == [{"msg": "first"}, {"msg": "second"}]


class FakeStore:
    """The store interface a Meeting uses, as a dict anyone can write (as anyone who reaches the port can)."""

    def __init__(self):
        self.values: dict = {}

    def set(self, key, value):
        self.values[key] = value

    def get(self, key):
        return self.values[key]

    def add(self, key, amount):
        self.values[key] = self.values.get(key, 0) + amount
        return self.values[key]

    def check(self, keys):
        return all(key in self.values for key in keys)


def test_the_meeting_reads_what_another_process_posted_as_data_only(tmp_path):
    store = FakeStore()
    meeting = Meeting(Launch("srun", 0, 2, 0, "127.0.0.1", 29500, False), store=store)
    marker = tmp_path / "ran"
    store.set("collected/1", pickle.dumps(Payload(f"touch {marker}")))  # a hostile process posts for rank 1
    with pytest.raises(wire.UnsafeValue, match="rank 1's value under 'collected'"):
        meeting.read("collected", 1)
    assert not marker.exists()
    meeting.post("collected", ["test_a", "test_b"])
    assert meeting.read("collected", 0) == ["test_a", "test_b"]


def test_a_store_for_one_machines_ranks_listens_on_loopback_only():
    import torch.distributed as dist

    store = wire.bound_store(2, datetime.timedelta(seconds=10))
    try:
        client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert store.get("k") == b"v"
        address = _an_address_that_is_not_loopback()
        if address is None:
            pytest.skip("this machine has no address beside loopback to try the store's port from")
        with pytest.raises(OSError):
            socket.create_connection((address, store.port), timeout=2).close()
    finally:
        del store


def test_a_client_that_connects_before_the_store_takes_the_socket_over_is_served():
    # (a launched job's rank 0 forks its child between the two: launched_env.LaunchedEnv._start)
    import threading

    import torch.distributed as dist

    listener = wire.listening_socket(2)
    port, answers = listener.getsockname()[1], []

    def client():
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
        answers.append(store.get("k"))

    connecting = threading.Thread(target=client)
    connecting.start()
    time.sleep(0.3)  # (the client is waiting in the socket's backlog)
    store = wire.bound_store(2, datetime.timedelta(seconds=10), listener=listener)
    try:
        store.set("k", "v")
        connecting.join(10)
        assert answers == [b"v"] and store.port == port
    finally:
        del store


def _an_address_that_is_not_loopback():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))  # no packet is sent: the kernel picks the outgoing interface
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_a_launched_jobs_keys_live_under_its_secret_where_it_exports_one():
    """A process that reaches the launcher's store but does not know $PYTEST_LLMLOAD_RUN_SECRET cannot name a key the
    ranks read (issue 36: the per-run secret every rank presents)."""
    import torch.distributed as dist

    from pytest_llmload.runners.launcher import meeting_prefix

    assert meeting_prefix({}) == "llmload"
    prefix = meeting_prefix({"PYTEST_LLMLOAD_RUN_SECRET": "s3cret"})
    assert prefix.startswith("llmload/") and len(prefix) > len("llmload/") + 16 and "s3cret" not in prefix
    server = wire.bound_store(2, datetime.timedelta(seconds=10))
    launch = Launch("srun", 0, 2, 0, "127.0.0.1", server.port, True)  # (the store hosted here, as an agent's)
    meeting = Meeting(launch, store=dist.PrefixStore(prefix, dist.TCPStore(
        "127.0.0.1", server.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))))
    meeting.post("collected", ["test_a"])
    outsider = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=datetime.timedelta(seconds=10))
    assert not outsider.check(["llmload/collected/0"]) and outsider.check([f"{prefix}/collected/0"])
    outsider.set("llmload/collected/1", pickle.dumps(["forged"]))  # where a job without a secret would read it
    assert not meeting.store.check(["collected/1"])
