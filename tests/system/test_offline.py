"""Offline mode: on for the tests that use an llmload fixture, while they run; and what the guard refuses.

No test here reaches the network: the guard refuses before anything is sent, and the checks that the guard is
gone use numeric addresses, which need no DNS.
"""

import _socket
import socket
import sys

import pytest

from fixtures.xdist_run import ORDERED  # two llmload tests, each followed by a plain one
from pytest_llmload.system import offline
from pytest_llmload.system.offline import NetworkAccessBlocked, hub_offline, network_guard

pytestmark = pytest.mark.timeout(180)

FAKE = ("10.255.255.1", 9)  # a private address: refused by the guard before a packet could leave

@pytest.fixture
def online_environment(monkeypatch):
    for name in offline.OFFLINE_ENV:
        monkeypatch.delenv(name, raising=False)
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_offline_only_while_llmload_tests_run(pytester, online_environment):
    pytester.makepyfile(test_ordered=ORDERED)
    pytester.runpytest("-p", "no:randomly").assert_outcomes(passed=4)
    assert not offline.guard_active()


def test_offline_only_while_llmload_tests_run_under_xdist(xdist_run):
    # The shared run (fixtures/xdist_run.py), on a machine without the hub's offline variables: two files of ORDERED
    # under --dist loadfile: each file's tests run in order on one worker, and each worker has an llmload test first.
    assert (xdist_run.outcomes("test_a_offline"), xdist_run.outcomes("test_b_offline")) == ({"passed": 4},) * 2


@pytest.mark.parametrize("reach", [
    pytest.param(lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", FAKE), id="udp-sendto"),
    pytest.param(lambda: socket.gethostbyname("huggingface.co"), id="gethostbyname"),
    pytest.param(lambda: socket.gethostbyname_ex("huggingface.co"), id="gethostbyname_ex"),
    pytest.param(lambda: socket.gethostbyaddr(FAKE[0]), id="gethostbyaddr"),
    pytest.param(lambda: _socket.socket.connect(socket.socket(), FAKE), id="_socket-connect"),
    pytest.param(lambda: socket.socket().connect_ex(FAKE), id="connect_ex"),
    pytest.param(lambda: socket.create_connection(("huggingface.co", 443)), id="create_connection"),
    pytest.param(lambda: socket.getnameinfo(FAKE, 0), id="getnameinfo"),  # (issue 36: it went through)
])
def test_guard_refuses_every_way_out_naming_the_caller(reach):
    attempts = []
    with network_guard(record=attempts):
        with pytest.raises(NetworkAccessBlocked, match=r"blocked .* from <lambda> \(.*test_offline\.py:\d+\)"):
            reach()
    assert len(attempts) == 1 and "from <lambda>" in attempts[0], attempts
    assert not offline.guard_active()


def test_guard_lets_loopback_through_and_nests():
    outer, inner = [], []
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    with network_guard(record=outer):
        with network_guard(record=inner):
            socket.create_connection(server.getsockname(), timeout=5).close()
            with pytest.raises(NetworkAccessBlocked):
                socket.gethostbyname("10.0.0.1")
        assert offline.guard_active()  # the outer one is still entered
        with pytest.raises(NetworkAccessBlocked):
            socket.gethostbyname("10.0.0.2")
    server.close()
    assert not offline.guard_active()
    assert (len(outer), len(inner)) == (2, 1), (outer, inner)


def test_a_forked_childs_refused_attempt_is_counted_where_the_guard_was_entered():
    """Before (issue 49, point 8): the child appended to its own copy of the list, and the check saw nothing."""
    import os

    attempts = []
    with network_guard(record=attempts):
        for host in ("10.0.0.3", "10.0.0.4"):
            child = os.fork()
            if child == 0:  # the loader's own process, swallowing the refusal
                try:
                    socket.gethostbyname(host)
                except NetworkAccessBlocked:
                    pass
                os._exit(0)
            assert os.waitpid(child, 0)[1] == 0
    assert len(attempts) == 2 and all("gethostbyname" in a and "from " in a for a in attempts), attempts
    assert [a.split()[1] for a in attempts] == ["'10.0.0.3'", "'10.0.0.4'"]


def test_hub_constant_of_a_module_imported_under_the_guard_is_restored(monkeypatch, online_environment):
    # huggingface_hub first imported while offline reads HF_HUB_OFFLINE=1 into its constant: afterwards the
    # constant must say what the restored environment says, not stay offline.
    monkeypatch.delitem(sys.modules, "huggingface_hub.constants")
    imported_meanwhile = type(sys)("huggingface_hub.constants")
    with hub_offline():
        imported_meanwhile.HF_HUB_OFFLINE = True
        sys.modules["huggingface_hub.constants"] = imported_meanwhile
    assert imported_meanwhile.HF_HUB_OFFLINE is False


def test_the_loader_module_is_imported_offline_at_collection(pytester, online_environment):
    """Code a loader module runs when it is imported (at collection) ran outside the guard (issue 36)."""
    pytester.makepyfile(reaching="""
        import socket

        try:
            socket.getaddrinfo("huggingface.co", 443)
            REACHED = "reached"
        except OSError as exc:
            REACHED = type(exc).__name__

        def load(request):
            return None
    """)
    pytester.makepyfile(test_it="""
        def test_it(llmload_loader):
            import reaching
            assert reaching.REACHED == "NetworkAccessBlocked", reaching.REACHED
    """)
    pytester.syspathinsert()
    pytester.runpytest("--llmload-loader", "reaching:load", "-p", "no:cacheprovider").assert_outcomes(passed=1)
