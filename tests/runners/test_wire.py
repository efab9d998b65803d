"""What crosses a process boundary (pytest_llmload.runners.wire): between ranks, through a store's socket, plain data
in JSON, bounded, of its key's shape and signed with the run's secret (issue 36: a pickle posted to the launcher's
store by another process ran in rank 0; issue 49: a 61-byte pickle built a 3 GB list, ``session-end/1 = "x"`` was an
INTERNALERROR, the secret kept nobody out, ``MASTER_ADDR=0.0.0.0`` bound every interface); from a child of this
process, its answer with its exception as itself. The stores' attackers here are real ``TCPStore`` clients."""

import datetime
import os
import pickle
import socket
import time
import tracemalloc

import pytest

from fixtures import warm_runs
from pytest_llmload.runners import wire
from pytest_llmload.runners.launcher import EXIT_STATUS, MEETING_PREFIX, Launch, Meeting

pytestmark = pytest.mark.timeout(60)

ANY = wire.Shape("anything plain", lambda value: True, 1 << 20)
SECRET = "a secret of this job"


class Payload:
    """What an attacker posts: unpickling it runs ``os.system``."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class Builds:
    """A pickle that calls a harmless-looking constructor with the poster's arguments (issue 49)."""

    def __init__(self, constructor, *args):
        self.constructor, self.args = constructor, args

    def __reduce__(self):
        return self.constructor, self.args


def test_plain_data_goes_and_comes_back_as_it_was():
    value = {"outcome": "failed", "text": "x", "agreed": False, "ranks": [0, 1], "pair": (1, 2.5), "none": None,
             "bytes": b"\x00", "set": {3}, "frozen": frozenset({4}), 5: {"nested": [(6,)]},
             "tagged": {"tuple": [1]}}  # (a dict that looks like a tag comes back a dict)
    sealed = wire.seal("k/1", value, b"s", ANY)
    assert b"\n" not in sealed and sealed[64:].startswith(b'{"dict":')  # JSON after the MAC, nothing pickled
    back = wire.unseal("k/1", sealed, b"s", ANY, 1)
    assert back == value and type(back["pair"]) is tuple and type(back["frozen"]) is frozenset


@pytest.mark.parametrize(("value", "message"), [
    (ValueError("bad"), "holds a ValueError, which is not plain data"),  # (exceptions cross as their text)
    (Payload("true"), r"holds a Payload \(from .*test_wire\), which is not plain data"),
    (bytearray(3), "holds a bytearray"),
    ("x" * 100, "is 102 bytes of JSON, over the 64 a value there may take"),
    ("x", "is 'x', not an exit status"),
], ids=["exception", "class", "bytearray", "too-large", "wrong-shape"])
def test_a_rank_never_posts_what_is_not_plain_data_of_its_keys_shape(value, message):
    with pytest.raises(wire.NotPlainData, match=message):
        wire.seal("session-end/0", value, b"s", EXIT_STATUS)


def test_an_exception_crosses_from_a_child_as_itself():
    import threading

    from pytest_llmload.loader.seam import LoaderModelError

    # The seam's errors (an __init__ that takes more than the message): rebuilt from the message and what pickles.
    error = LoaderModelError("the model misbehaves")
    error.detail, error.lock = {"rank": 1}, threading.Lock()
    error.add_note("a note")
    back = wire.loads(wire.exception_bytes(error))
    assert type(back) is LoaderModelError and str(back) == "the model misbehaves" and back.args == error.args
    assert back.detail == {"rank": 1} and not hasattr(back, "lock") and back.__notes__ == ["a note"]
    # pytest's outcomes claim the module builtins: found where they live.
    skip = wire.loads(wire.exception_bytes(pytest.skip.Exception("not here", _use_item_location=True)))
    assert type(skip) is pytest.skip.Exception and skip.msg == "not here" and skip._use_item_location is True
    # An exception that does not pickle does not travel (the child's answer then carries its text only).
    unpicklable = ValueError("x")
    unpicklable.lock = threading.Lock()
    assert wire.exception_bytes(unpicklable) is None


def test_a_childs_records_are_read_up_to_one_cut_short(tmp_path):
    path = tmp_path / "logs"
    with open(path, "wb") as f:
        wire.write_record(f, {"msg": "first"})
        wire.write_record(f, {"msg": "second"})
        f.write(wire.dumps({"msg": "cut short by a kill"})[:-3])
    with open(path, "rb") as f:
        assert list(wire.read_records(f)) == [{"msg": "first"}, {"msg": "second"}]


# --- a launched job's store, attacked by a process that reaches its port --------------------------------------


@pytest.fixture
def job_store():
    """A launched job's store as torchrun's agent hosts it (here, on loopback), rank 0's meeting on it, and a
    client of it that is no rank: ``(server, meeting, outsider)``; the job's secret is :data:`SECRET`."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=10)
    server = wire.bound_store(2, timeout)
    client = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=timeout)
    meeting = Meeting(Launch("torchrun", 0, 2, 0, "127.0.0.1", server.port, True),
                      store=dist.PrefixStore(MEETING_PREFIX, client), secret=SECRET.encode())
    outsider = dist.TCPStore("127.0.0.1", server.port, 2, is_master=False, timeout=timeout)
    yield server, meeting, outsider
    del meeting, outsider, client, server


@pytest.mark.parametrize("payload", [
    pickle.dumps(Builds(list, range(40_000_000))),  # issue 49: 61 bytes, a 40-million-item list (3.0 GB)
    pickle.dumps(Builds(bytearray, 2_900_000_000)),  # a zero-filled 2.9 GB bytearray
    pickle.dumps(Payload("touch ran")),  # issue 36: code
], ids=["list", "bytearray", "os-system"])
def test_a_pickle_posted_to_the_store_is_refused_unread_at_no_cost(job_store, payload, tmp_path, monkeypatch):
    server, meeting, outsider = job_store
    monkeypatch.chdir(tmp_path)
    outsider.set(f"{MEETING_PREFIX}/collected/1", payload)  # where rank 1's tests are read
    tracemalloc.start()
    try:
        with pytest.raises(pytest.exit.Exception, match=r"the value under rank 1's key 'collected/1' was not signed "
                                                        r"with this run's secret: a process outside the job"):
            meeting.read("collected", 1, ANY)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(payload) < 100 and peak < 1 << 20, (len(payload), peak)  # (before: 3 GB)
    assert not (tmp_path / "ran").exists()


def test_a_value_from_outside_the_job_is_refused_where_it_has_a_secret(job_store):
    """Issue 49: torch's TCPStore lists its keys to any client, so their names hide nothing: an outsider who copies
    the job's keys still cannot sign a value; a rank's own value, signed, is read back."""
    server, meeting, outsider = job_store
    meeting.post("collected", ["test_a"], ANY)
    assert f"{MEETING_PREFIX}/collected/0" in outsider.list_keys()  # (what an outsider sees)
    forged = wire.seal("session-end/1", 7, b"", EXIT_STATUS)  # as a rank without the secret signs
    outsider.set(f"{MEETING_PREFIX}/session-end/1", forged)
    outsider.add(f"{MEETING_PREFIX}/session-end/count", 1)
    with pytest.raises(pytest.exit.Exception) as refused:
        meeting._stop_if_a_peer_ended()  # before: "rank 1 ended its session (exit status 7)", and rank 0 stopped
    assert str(refused.value).startswith(
        "the value under rank 1's key 'session-end/1' was not signed with this run's secret: a process outside the "
        "job posted it, or that rank runs with another $PYTEST_LLMLOAD_RUN_SECRET")
    assert refused.value.returncode == pytest.ExitCode.INTERRUPTED and "Rank 0 stops this run" in str(refused.value)
    # A value signed elsewhere is refused under another key too (the MAC covers the key): no copy across keys.
    outsider.set(f"{MEETING_PREFIX}/collected/1", outsider.get(f"{MEETING_PREFIX}/collected/0"))
    with pytest.raises(pytest.exit.Exception, match="rank 1's key 'collected/1' was not signed"):
        meeting.read("collected", 1, ANY)
    assert meeting.read("collected", 0, ANY) == ["test_a"]


def test_a_count_raised_from_outside_the_job_is_no_rank_ending(job_store):
    server, meeting, outsider = job_store
    outsider.add(f"{MEETING_PREFIX}/session-end/count", 5)  # (counts are not signed: they only pace the waits)
    meeting._stop_if_a_peer_ended()  # before: max() of no exit status, a ValueError


def test_without_a_secret_values_are_checked_but_anyone_can_sign_them(job_store):
    """What docs/reliability.md says of a job that exports no $PYTEST_LLMLOAD_RUN_SECRET: every value is still plain
    data of its key's shape, bounded, but a process that reaches the store can post one that reads as a rank's."""
    server, meeting, outsider = job_store
    meeting.secret = b""
    outsider.set(f"{MEETING_PREFIX}/session-end/1", wire.seal("session-end/1", 7, b"", EXIT_STATUS))
    assert meeting.read("session-end", 1, EXIT_STATUS) == 7  # (taken for rank 1's)
    outsider.set(f"{MEETING_PREFIX}/session-end/1", wire.seal("session-end/1", "x", b"", ANY))
    with pytest.raises(pytest.exit.Exception, match=r"rank 1 posted session-end/1 = 'x', not an exit status \(an "
                                                    r"integer\); refused\. Rank 0 stops this run: .* this job exports "
                                                    r"no \$PYTEST_LLMLOAD_RUN_SECRET"):
        meeting.read("session-end", 1, EXIT_STATUS)
    outsider.set(f"{MEETING_PREFIX}/session-end/1", b"0" * 64 + pickle.dumps(7))
    with pytest.raises(pytest.exit.Exception, match="rank 1's key 'session-end/1' carries no signature a rank makes"):
        meeting.read("session-end", 1, EXIT_STATUS)


@pytest.mark.parametrize(("text", "message"), [
    (b'{"list": [1]}', "rank 1 posted k/1 = b'{\"list\": \\[1\\]}', which is not plain data"),  # a tag never written
    (b"[" * 50_000 + b"]" * 50_000, "which is not plain data"),  # nested past any recursion limit
    (b"9" * 5000, "which is not plain data"),  # an int past Python's digit limit
    (b'{"dict": [[[1], 2]]}', "which is not plain data"),  # an unhashable key
    (b'{"set": [{"dict": []}]}', "which is not plain data"),  # an unhashable member
], ids=["unknown-tag", "deep", "long-int", "list-key", "dict-member"])
def test_signed_json_that_pytest_llmload_never_writes_is_refused(text, message):
    sealed = wire._mac(b"s", "k/1", text).encode() + text  # (a rank of another version, or a bug: signed, wrong)
    with pytest.raises(wire.RefusedValue, match=message):
        wire.unseal("k/1", sealed, b"s", ANY, 1)


def test_a_value_over_its_keys_bound_is_refused_unread():
    sealed = wire.seal("k/1", "x" * 1000, b"s", ANY)
    with pytest.raises(wire.RefusedValue, match=r"the value under rank 1's key 'k/1' is 1,066 bytes, over the 64 a "
                                                r"value there may take; refused unread"):
        wire.unseal("k/1", sealed, b"s", EXIT_STATUS, 1)


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


# --- the same, end to end: rank 0's pytest, forked from this process, meeting at a store hosted here ---------------


@pytest.fixture
def rank_0_of_2(job_store, pytester, monkeypatch):
    """A pytest run that is rank 0 of a torchrun job of 2 whose agent store is ``job_store``'s (rank 1 posted its
    tests already: none that use distributed_env); ``(run, outsider)``: ``run(*args)`` runs it, forked from here."""
    server, meeting, outsider = job_store
    rank_1 = Meeting(Launch("torchrun", 1, 2, 1, "127.0.0.1", server.port, True), store=meeting.store,
                     secret=SECRET.encode())
    from pytest_llmload.plugin.launched_run import COLLECTED, TEST_IDS

    rank_1.post(COLLECTED, [], TEST_IDS)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(server.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "PYTEST_LLMLOAD_RUN_SECRET": SECRET}.items():
        monkeypatch.setenv(name, value)
    pytester.makepyfile("def test_on_rank_0_only(): pass\n")
    return (lambda *args: warm_runs.runpytest(pytester, "-p", "no:cacheprovider", *args)), outsider


def test_a_value_of_the_wrong_shape_stops_the_run_with_a_sentence_never_an_internal_error(rank_0_of_2):
    """Issue 49: ``session-end/1 = "x"`` ended rank 0 in INTERNALERROR (``int(s)``). (An outsider's value, refused
    the same way before its shape is read: test_a_value_from_outside_the_job_is_refused_where_it_has_a_secret.)"""
    run, outsider = rank_0_of_2
    outsider.set(f"{MEETING_PREFIX}/session-end/1", wire.seal("session-end/1", "x", SECRET.encode(), ANY))
    result = run()
    assert result.ret == pytest.ExitCode.INTERRUPTED, result.stdout.str() + result.stderr.str()
    result.stderr.fnmatch_lines([
        "Exit: rank 1 posted session-end/1 = 'x', not an exit status (an integer); refused. Rank 0 stops this run: a "
        "value between the ranks is plain data of its key's shape, signed with this run's $PYTEST_LLMLOAD_RUN_SECRET "
        "(docs/reliability.md)."])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["*values between the ranks signed with $PYTEST_LLMLOAD_RUN_SECRET", "*.py . *"])


def test_without_a_secret_the_header_says_values_are_not_signed_and_an_outsiders_is_taken(rank_0_of_2,
                                                                                          monkeypatch):
    run, outsider = rank_0_of_2
    monkeypatch.delenv("PYTEST_LLMLOAD_RUN_SECRET")
    outsider.set(f"{MEETING_PREFIX}/collected/1", wire.seal("collected/1", [], b"", ANY))  # (rank 1 had the secret)
    outsider.set(f"{MEETING_PREFIX}/session-end/1", wire.seal("session-end/1", 7, b"", EXIT_STATUS))
    outsider.set(f"{MEETING_PREFIX}/report-written/1", wire.seal("report-written/1", True, b"", ANY))
    result = run()
    result.stdout.fnmatch_lines([
        "*values between the ranks not signed (no $PYTEST_LLMLOAD_RUN_SECRET: any process that reaches "
        "MASTER_ADDR:MASTER_PORT can post one)", "*llmload: exit status by rank: rank 0 0, rank 1 7; every rank "
        "exits with 7*"])
    assert result.ret == 7  # (as documented: without a secret, an outsider's well-formed value is a rank's)


def test_master_addr_on_every_interface_is_refused_unless_asked_for(rank_0_of_2, monkeypatch):
    run, outsider = rank_0_of_2
    monkeypatch.setenv("MASTER_ADDR", "0.0.0.0")  # (its other spellings: every_interface, below)
    result = run()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: MASTER_ADDR='0.0.0.0' in the environment means every interface of this "
                                 "machine: the stores rank 0 hosts for the torchrun job would listen there, *"
                                 "or pass --llmload-bind-all-interfaces (ini llmload_bind_all_interfaces = true) *"])


@pytest.mark.parametrize("asked", [("--llmload-bind-all-interfaces",), ("-o", "llmload_bind_all_interfaces=true")],
                         ids=["option", "ini"])
def test_master_addr_on_every_interface_is_taken_when_asked_for(rank_0_of_2, monkeypatch, asked):
    run, outsider = rank_0_of_2
    monkeypatch.setenv("MASTER_ADDR", "0.0.0.0")  # (the agent store is this test's, on loopback: 0.0.0.0 reaches it)
    for key, value in (("session-end/1", 0), ("report-written/1", True)):  # (rank 1, ending as rank 0 does)
        outsider.set(f"{MEETING_PREFIX}/{key}", wire.seal(key, value, SECRET.encode(), ANY))
    result = run(*asked)
    assert result.ret == 0, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["*MASTER_ADDR=0.0.0.0*", "*1 passed*"])


def test_a_store_never_listens_on_every_interface_unless_asked_for():
    with pytest.raises(ValueError, match="a store on '0.0.0.0' would listen on every interface of this machine"):
        wire.listening_socket(2, host="0.0.0.0")
    wire.listening_socket(2, host="0.0.0.0", every_interface_allowed=True).close()
    assert [wire.every_interface(host) for host in ("0.0.0.0", "::", "", "*", "0", "[::]", "0x0", "::0")] == [True] * 8
    assert not any(wire.every_interface(host) for host in ("127.0.0.1", "::1", "node0", "10.1.2.3"))


def test_a_launched_ranks_judged_row_crosses_the_store_and_comes_back_as_it_was():
    """A rank under torchrun/srun judges what it raised with its check's judge, as a forked rank does, and its row
    reaches the check's process through the store (its outcome's shape holds it): the process picks the most telling
    rank's row without judging it again."""
    from pytest_llmload.plugin.launched_env import RESULT, _outcomes, _portable
    from pytest_llmload.runners.children import ChildOutcome

    sent = ChildOutcome(1, "rank 1")
    sent.status, sent.error, sent.exitcode, sent.pid = "raised", "AssertionError: spread", None, 7
    sent.row = {"verdict": "failed", "failure": "distributed-device-map", "cause": "mechanism",
                "sentence": "device_map spread the model under DDP", "fix": "device_map={'': local_rank}"}
    posted = wire.unseal("r/result/1", wire.seal("r/result/1", _portable(sent), b"s", RESULT), b"s", RESULT, 1)
    (received,) = _outcomes({0: posted}, 1, 1.0)
    assert received.row == sent.row and received.status == "raised"
    with pytest.raises(wire.NotPlainData):
        wire.seal("r/result/1", {**_portable(sent), "row": "failed"}, b"s", RESULT)
