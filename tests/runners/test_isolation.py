"""Isolated execution (:mod:`pytest_llmload.runners.isolation`, the ``llmload_isolated`` marker, ``Check(isolated=True)``):
a call or a test body runs in a child forked from the test process; what it changes dies with it; a hang
fails at the deadline with the child's stacks, a death with its signal, an exception with the child's report;
nothing is left behind."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from fixtures.processes import gone
from fixtures import xdist_run as xdist_run_suite
from pytest_llmload import failures as catalog
from pytest_llmload.runners import children, isolation
from pytest_llmload.reports import known_failures as known_failure_report
from pytest_llmload.failures import BY_ID
from pytest_llmload.checks.base import Check
from pytest_llmload.runners.isolation import ChildError, ChildTraceback, IsolationFailed, run_isolated

pytestmark = pytest.mark.timeout(60)

PROBE = xdist_run_suite.ISOLATION_PROBE  # (the shared xdist run sets it in its isolated tests too)


def _restore_absent_probe(monkeypatch) -> None:
    """Have monkeypatch remove PROBE at teardown (delenv of an absent variable records nothing)."""
    monkeypatch.setenv(PROBE, "")
    monkeypatch.delenv(PROBE)


# --- the runner --------------------------------------------------------------------------------------------


def change_process_state() -> int:
    os.environ[PROBE] = "set in the child"
    socket.socket.connect = None  # a patch left in place would break every later test
    return os.getpid()


def test_an_isolated_call_returns_its_value_and_leaves_this_process_as_it_was(tmp_path):
    connect = socket.socket.connect
    pid = run_isolated(change_process_state, timeout=30, tmp_root=tmp_path)
    assert pid != os.getpid() and gone(pid)
    assert PROBE not in os.environ and socket.socket.connect is connect
    assert list(tmp_path.iterdir()) == [] and multiprocessing.active_children() == []


def test_the_same_call_in_process_does_change_it(monkeypatch):
    # What the test above rules out, shown to happen without isolation (and undone by monkeypatch).
    _restore_absent_probe(monkeypatch)
    monkeypatch.setattr(socket.socket, "connect", socket.socket.connect)
    assert change_process_state() == os.getpid()
    assert os.environ[PROBE] == "set in the child" and socket.socket.connect is None


def fail_with_assert(value):
    assert value == 2, "the child's own message"


def test_an_exception_in_the_child_is_raised_here_with_the_childs_traceback():
    with pytest.raises(AssertionError, match="the child's own message\nassert 1 == 2") as excinfo:
        run_isolated(fail_with_assert, (1,), timeout=30)
    cause = excinfo.value.__cause__
    assert isinstance(cause, ChildTraceback)
    assert "in fail_with_assert" in str(cause) and "assert value == 2" in str(cause)


class HoldsALock(Exception):
    def __init__(self):
        super().__init__("cannot travel")
        self.lock = threading.Lock()


def raise_unpicklable():
    raise HoldsALock()


def test_an_exception_that_does_not_pickle_comes_back_as_child_error():
    with pytest.raises(ChildError, match="^HoldsALock: cannot travel$") as excinfo:
        run_isolated(raise_unpicklable, timeout=30)
    assert "in raise_unpicklable" in str(excinfo.value.__cause__)


def raise_a_seam_error():
    from pytest_llmload.loader.seam import LoaderModelError

    error = LoaderModelError("the model cannot train here")
    error.rank, error.lock = 1, threading.Lock()
    raise error


def test_the_seams_errors_come_back_as_themselves_less_what_does_not_pickle():
    # (An __init__ that takes more than the message, and an attribute that does not pickle: runners.wire.Portable.)
    from pytest_llmload.loader.seam import LoaderModelError

    with pytest.raises(LoaderModelError, match="^the model cannot train here$") as excinfo:
        run_isolated(raise_a_seam_error, timeout=30)
    assert excinfo.value.rank == 1 and not hasattr(excinfo.value, "lock")
    assert "in raise_a_seam_error" in str(excinfo.value.__cause__)


def chatty() -> int:
    print("to stdout, from the child")
    print("to stderr, from the child", file=sys.stderr)
    return 1


def test_the_childs_output_is_written_to_the_callers_streams(capsys):
    assert run_isolated(chatty, timeout=30) == 1
    out, err = capsys.readouterr()
    assert out == "to stdout, from the child\n" and "to stderr, from the child" in err


class Unpicklable:
    def __reduce__(self):
        raise TypeError("not picklable")

    def __repr__(self):
        return "<Unpicklable>"


def logs_and_returns():
    log = logging.getLogger("some.loader")
    log.info("placing %d layers on %s", 4, "cpu")
    log.warning("offload folder %s is on tmpfs", "/tmp/x", extra={"budget": Unpicklable()})
    try:
        1 / 0
    except ZeroDivisionError:
        log.exception("estimate failed")
    logging.getLogger("quiet.lib").debug("below the level: never made")
    return 1


@pytest.mark.parametrize("start", ["fork", "forkserver"])
def test_the_childs_log_records_reach_this_processs_handlers(caplog, start):
    caplog.set_level(logging.INFO)
    assert run_isolated(logs_and_returns, timeout=50, start=start) == 1
    records = [r for r in caplog.records if r.name == "some.loader"]
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("INFO", "placing 4 layers on cpu"),
        ("WARNING", "offload folder /tmp/x is on tmpfs"),
        ("ERROR", "estimate failed"),
    ]
    assert {r.process for r in records} != {os.getpid()} and {r.llmload_child for r in records} == {"isolated call"}
    assert records[1].budget == "<Unpicklable>"
    assert "ZeroDivisionError: division by zero" in records[2].exc_text
    assert "quiet.lib" not in {r.name for r in caplog.records}


def logs_then_hangs():
    logging.getLogger("some.loader").warning("reading shard 3 of 5")
    threading.Event().wait()


def test_a_hung_child_still_hands_back_what_it_logged(caplog):
    with pytest.raises(IsolationFailed, match="deadline of 1 s exceeded"):
        run_isolated(logs_then_hangs, timeout=1)
    assert [r.getMessage() for r in caplog.records if r.name == "some.loader"] == ["reading shard 3 of 5"]


def blocked_in_a_named_frame(pid_file):
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    threading.Event().wait()


def test_a_hang_fails_at_the_deadline_with_the_childs_stacks(tmp_path):
    runs, pid_file = tmp_path / "runs", tmp_path / "pid"
    runs.mkdir()
    started = time.monotonic()
    with pytest.raises(IsolationFailed) as excinfo:
        run_isolated(blocked_in_a_named_frame, (str(pid_file),), timeout=1, label="the probe", tmp_root=runs)
    assert time.monotonic() - started < 1 + 4  # deadline + stack collection + reaping
    message = str(excinfo.value)
    assert message.startswith("the probe did not return: deadline of 1 s exceeded; its child (pid ")
    assert "thread stacks of the child at the deadline" in message and "in blocked_in_a_named_frame" in message
    assert "in _bootstrap" not in message  # the frames inherited from the test process are cut
    assert excinfo.value.outcome.status == "hung"
    assert gone(int(pid_file.read_text())) and list(runs.iterdir()) == []


def die(how: str):
    if how == "exit":
        os._exit(3)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    import ctypes

    ctypes.string_at(0)


@pytest.mark.parametrize(("how", "described"), [
    ("exit", "exit code 3, before it returned a result"),
    ("kill", "killed by SIGKILL (exit code -9)"),
    ("segfault", "killed by SIGSEGV (exit code -11)"),
])
def test_a_child_that_dies_fails_with_its_exit_code_or_signal(tmp_path, how, described):
    with pytest.raises(IsolationFailed) as excinfo:
        run_isolated(die, (how,), timeout=30, label="the probe", tmp_root=tmp_path)
    message = str(excinfo.value)
    assert message.startswith(f"the probe: its child (pid {excinfo.value.outcome.pid}) died: {described}")
    if how == "segfault":
        assert "Fatal Python error: Segmentation fault" in message and "in die" in message
    assert gone(excinfo.value.outcome.pid) and list(tmp_path.iterdir()) == []


@pytest.mark.timeout(20)
def test_the_deadline_ends_before_pytest_timeouts_alarm(monkeypatch):
    room = 20 - isolation.DEADLINE_MARGIN_S
    assert isolation.effective_timeout(None) <= room
    assert isolation.effective_timeout(600) <= room
    assert isolation.effective_timeout(5) == 5
    monkeypatch.setattr(isolation, "outer_deadline_left", lambda: None)  # no alarm: the values as given
    assert isolation.effective_timeout(None) == isolation.DEFAULT_TIMEOUT_S
    assert isolation.effective_timeout(600) == 600


def test_misuse_is_refused_with_the_value():
    with pytest.raises(ValueError, match="timeout=0; expected a positive, finite number of seconds"):
        run_isolated(os.getpid, timeout=0)
    with pytest.raises(ValueError, match="start_method='thread'"):
        run_isolated(os.getpid, start="thread")


def test_a_process_that_initialised_cuda_is_never_forked(monkeypatch):
    assert children.start_method() == "fork"
    monkeypatch.setattr(children, "cuda_initialised", lambda: True)
    assert children.start_method() == "forkserver"
    assert children.start_for() == children.Start("forkserver", "cuda")  # (its children are a GPU process's)
    with pytest.raises(RuntimeError, match="this process has initialised CUDA"):
        children.start_method("fork")


_prepared_at = None


def note_the_time() -> None:
    global _prepared_at
    _prepared_at = time.monotonic()


def prepared_at() -> float:
    return _prepared_at


def test_children_started_together_run_only_once_every_fork_is_done(monkeypatch, tmp_path):
    # (ranks: none may connect to a rendezvous while this process still forks; see ranks.run_rank_groups)
    forked = []
    forking = children.forking_quietly

    @contextlib.contextmanager
    def recording():
        with forking():
            yield
        forked.append(time.monotonic())
        time.sleep(0.2)  # (a slow fork: without the barrier the first child prepares before the last fork)

    monkeypatch.setattr(children, "forking_quietly", recording)
    specs = [children.ChildSpec(f"child {i}", prepared_at, prepare=note_the_time) for i in range(3)]
    outcomes = children.run_children(specs, 30, tmp_root=tmp_path, start_together=True)
    assert len(forked) == 3 and min(o.value for o in outcomes) > max(forked)


def test_once_forked_runs_after_every_fork_and_before_any_child_prepares(tmp_path):
    # (a launched job's rank 0 starts its store's serving thread there: see launched_env.LaunchedEnv._start)
    called = []

    def once_forked():
        time.sleep(0.2)  # (without the barrier a child would prepare meanwhile)
        called.append(time.monotonic())

    specs = [children.ChildSpec(f"child {i}", prepared_at, prepare=note_the_time) for i in range(2)]
    outcomes = children.run_children(specs, 30, tmp_root=tmp_path, once_forked=once_forked)
    assert len(called) == 1 and min(o.value for o in outcomes) > called[0]


def test_a_failure_in_once_forked_leaves_no_child(tmp_path):
    import multiprocessing

    def once_forked():
        raise RuntimeError("the others did not come")

    specs = [children.ChildSpec("child", os.getpid, prepare=note_the_time)]
    with pytest.raises(RuntimeError, match="the others did not come"):
        children.run_children(specs, 30, tmp_root=tmp_path, once_forked=once_forked)
    assert list(tmp_path.iterdir()) == []  # its temporary directory removed
    assert [p for p in multiprocessing.active_children() if p.name.startswith("llmload-")] == []


def test_a_forkserver_child_works_too():
    # How a child starts where this process has initialised CUDA: the function and its results go by pickle.
    assert run_isolated(os.getpid, start="forkserver", timeout=50) != os.getpid()
    with pytest.raises(AssertionError, match="the child's own message"):
        run_isolated(fail_with_assert, (1,), start="forkserver", timeout=50)


CTRL_C_SCRIPT = """
import faulthandler, os, signal, sys, time
faulthandler.register(signal.SIGUSR1)  # the test asks for the stacks of a script that did not stop
# A pytest started as a background job of a non-interactive shell inherits SIGINT ignored (POSIX), and so
# would this script; the user's terminal gives a foreground pytest Python's handler.
signal.signal(signal.SIGINT, signal.default_int_handler)
from pytest_llmload.runners.ranks import run_ranks
from pytest_llmload.runners.isolation import run_isolated

def sleep_forever(pid_dir):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    time.sleep(3600)

if __name__ == "__main__":
    pid_dir, runs, runner = sys.argv[1:]
    if runner == "ranks":
        run_ranks(sleep_forever, 2, args=(pid_dir,), timeout=600, tmp_root=runs)
    else:
        run_isolated(sleep_forever, (pid_dir,), timeout=600, tmp_root=runs)
"""


@pytest.mark.parametrize(("runner", "children"), [("isolated", 1), ("ranks", 2)])
def test_ctrl_c_kills_the_children_and_removes_the_temp_dir(tmp_path, runner, children):
    pid_dir, runs = tmp_path / "pids", tmp_path / "runs"
    pid_dir.mkdir()
    runs.mkdir()
    script = tmp_path / "interrupted.py"
    script.write_text(CTRL_C_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(script), str(pid_dir), str(runs), runner], env=env,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 40
        while len(list(pid_dir.iterdir())) < children and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        pids = [int(p.name) for p in pid_dir.iterdir()]
        assert len(pids) == children, proc.stderr.read() if proc.poll() is not None else "children did not start"
        assert len(list(runs.iterdir())) == 1  # the run's temp dir exists while it runs
        proc.send_signal(signal.SIGINT)
        try:
            _, stderr = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            proc.kill()
            pytest.fail(f"the script did not stop on SIGINT; its stderr and stacks:\n{proc.communicate()[1]}")
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in stderr, stderr
    alive = [pid for pid in pids if not gone(pid)]
    assert not alive, f"children {alive} outlived the interrupted script; its stderr:\n{stderr}"
    assert list(runs.iterdir()) == [], stderr


# --- Check(isolated=True) ----------------------------------------------------------------------------------


def noop_loader(request):
    return None


def check_sets_env_and_fails(loader, checkpoint, workdir):
    """Guards nothing: changes the environment, then fails naming the loader and its own pid."""
    os.environ[PROBE] = "leaked"
    raise AssertionError(f"loader {loader.name} failed in pid {os.getpid()}")


def check_blocks(loader, checkpoint, workdir):
    """Guards nothing: never returns."""
    threading.Event().wait()


def test_an_isolated_check_fails_with_the_childs_error_and_changes_nothing(tmp_path):
    check = Check(check_sets_env_and_fails, failure=BY_ID["offload-hang"], isolated=True, timeout=30)
    with pytest.raises(AssertionError, match=r"loader .*noop_loader failed in pid \d+") as excinfo:
        check(noop_loader, tmp_path, tmp_path)
    assert f"pid {os.getpid()}" not in str(excinfo.value)
    assert PROBE not in os.environ
    assert "in check_sets_env_and_fails" in str(excinfo.value.__cause__)
    # the child rendered it as pytest would: the check's source line and the error
    assert "raise AssertionError(" in excinfo.value.llmload_child_report


def test_the_same_check_not_isolated_leaks_its_change(tmp_path, monkeypatch):
    _restore_absent_probe(monkeypatch)
    check = Check(check_sets_env_and_fails, failure=BY_ID["offload-hang"], timeout=30)
    with pytest.raises(AssertionError, match=f"failed in pid {os.getpid()}$"):
        check(noop_loader, tmp_path, tmp_path)
    assert os.environ[PROBE] == "leaked"


def test_an_isolated_check_that_hangs_fails_at_its_timeout_with_the_stacks(tmp_path):
    check = Check(check_blocks, failure=BY_ID["offload-hang"], isolated=True, timeout=1)
    with pytest.raises(IsolationFailed, match=r"(?s)^check_blocks did not return: deadline of 1 s exceeded.*"
                                              r"in check_blocks"):
        check(noop_loader, tmp_path, tmp_path)


def check_meta_backward(loader, checkpoint, workdir):
    """Guards meta-backward: fails with the autograd error of write-up 002."""
    raise RuntimeError("Function MmBackward0 returned an invalid gradient at index 1 - expected device meta but got cpu")


def test_the_known_failure_is_named_from_a_childs_error(tmp_path):
    check = Check(check_meta_backward, failure=BY_ID["meta-backward"], isolated=True, timeout=30)
    with pytest.raises(RuntimeError) as excinfo:
        check(noop_loader, tmp_path, tmp_path)
    text = known_failure_report.failure_text(excinfo)
    assert "in check_meta_backward" in text  # the child's frames reach the catalog
    assert [failure.id for failure in catalog.match(text)] == ["meta-backward"]


def test_the_checks_that_patch_process_state_or_can_hang_are_isolated():
    from pytest_llmload.failures import REGISTRY

    # every check that calls the loader in this process runs isolated
    assert {check.name for check in REGISTRY if not check.isolated} == {"check_distributed_train_step",
                                                                        "check_zero3_load"}
    # the distributed checks fork their own ranks from this process, with their own deadline
    assert all(check.world_size > 1 for check in REGISTRY if not check.isolated)


@pytest.mark.parametrize(("gpus_visible", "peft_preloaded"), [(0, True), (1, False)])
def test_isolated_checks_preload_the_stack_but_never_what_initialises_cuda(monkeypatch, tmp_path, gpus_visible,
                                                                           peft_preloaded):
    # What a child imports dies with it. peft imports bitsandbytes, which initialises CUDA where a GPU is visible.
    from pytest_llmload.system import gpus
    from pytest_llmload.runners import preload
    from pytest_llmload.failures import preload_for_isolated_checks

    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    asked = []
    monkeypatch.setattr(preload, "preload", asked.extend)
    monkeypatch.setattr(gpus, "visible_gpu_count", lambda: gpus_visible)
    preload_for_isolated_checks(tmp_path)
    assert set(preload.HF_PRELOAD) <= set(asked)
    assert "transformers.models.qwen2.modeling_qwen2" in asked
    assert ("peft" in asked) is peft_preloaded
    assert ("bitsandbytes" in asked) is peft_preloaded  # older peft imports it lazily: in every child otherwise


# --- the marker --------------------------------------------------------------------------------------------

ISOLATED_TESTS = """
    import ctypes, os, socket, threading
    import pytest

    @pytest.mark.llmload_isolated(timeout=20)
    def test_changes_process_state():
        os.environ["{probe}"] = "leaked"
        socket.socket.connect = None
        print("stdout of the child")

    def test_sees_a_clean_process():
        assert "{probe}" not in os.environ and socket.socket.connect is not None

    @pytest.mark.llmload_isolated(timeout=20)
    def test_assertion():
        import logging
        logging.getLogger("my.loader").warning("loaded %d layers", 4)
        loaded = {{"layers": 4}}
        assert loaded["layers"] == 5

    @pytest.mark.llmload_isolated(timeout=1)
    def test_hangs():
        threading.Event().wait()

    @pytest.mark.llmload_isolated(timeout=20)
    def test_segfaults():
        ctypes.string_at(0)

    @pytest.mark.llmload_isolated
    def test_skips():
        pytest.skip("skipped in the child")

    @pytest.mark.xfail(raises=ValueError, strict=True)
    @pytest.mark.llmload_isolated
    def test_expected_failure():
        raise ValueError("known")

    def all_reduce():
        import torch, torch.distributed as dist
        t = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(t)
        return t.item()

    @pytest.mark.llmload_isolated(timeout=30)
    def test_ranks_from_an_isolated_test(distributed_env):
        assert distributed_env.run(all_reduce, world_size=2, backend="gloo", timeout=20) == [3.0, 3.0]

    def test_after_all_that():
        pass
"""


def test_isolated_tests_pass_fail_hang_and_die_on_their_own(pytester):
    pytester.makepyfile(test_isolated=textwrap.dedent(ISOLATED_TESTS.format(probe=PROBE)))
    started = time.monotonic()
    result = pytester.runpytest("-rA", "-p", "no:cacheprovider")
    assert time.monotonic() - started < 30
    result.assert_outcomes(passed=4, failed=3, skipped=1, xfailed=1)
    result.stdout.fnmatch_lines([
        "*_ test_assertion _*",
        "AssertionError: assert 4 == 5  (raised in an isolated child, pid *)",
        "    def test_assertion():",
        ">       assert loaded[[]\"layers\"[]] == 5",
        "E       assert 4 == 5",
        "test_isolated.py:*: AssertionError",
        "*- Captured log call -*",
        "WARNING  my.loader:test_isolated.py:* loaded 4 layers",
        "*_ test_hangs _*",
        "isolated test test_hangs did not return: deadline of 1 s exceeded; its child (pid *) was killed.",
        "thread stacks of the child at the deadline (most recent call first):",
        '*File "*test_isolated.py", line * in test_hangs',
        "*_ test_segfaults _*",
        "isolated test test_segfaults: its child (pid *) died: killed by SIGSEGV (exit code -11)",
        "*Fatal Python error: Segmentation fault",
    ])
    result.stdout.fnmatch_lines(["*stdout of the child*", "SKIPPED [[]1[]] test_isolated.py:*: skipped in the child"])
    assert PROBE not in os.environ


def test_without_the_marker_the_change_leaks_into_the_next_test(pytester, monkeypatch):
    _restore_absent_probe(monkeypatch)  # the in-process run leaks it into this process too
    source = textwrap.dedent(ISOLATED_TESTS.format(probe=PROBE)).split("\n\ndef test_sees_a_clean_process")[0]
    source += textwrap.dedent(f"""

        def test_sees_a_clean_process():
            assert "{PROBE}" not in os.environ
    """)
    pytester.makepyfile(test_leaks=source.replace("@pytest.mark.llmload_isolated(timeout=20)\n", ""))
    monkeypatch.setattr(socket.socket, "connect", socket.socket.connect)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["FAILED *::test_sees_a_clean_process*"])


@pytest.mark.parametrize(("written", "why"), [
    ("5", " (llmload_isolated() takes 0 positional arguments but 1 was given)"),
    ("deadline=3", " (llmload_isolated() got an unexpected keyword argument 'deadline')"),
    ("timeout=0", ": timeout=0"),
    ("timeout='30'", ": timeout='30'"),
])
def test_a_bad_marker_is_an_error_of_that_test(pytester, written, why):
    pytester.makepyfile(f"import pytest\n\n@pytest.mark.llmload_isolated({written})\ndef test_x():\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*test_x: @pytest.mark.llmload_isolated({written}) is invalid{why}*; expected "
                                 "@pytest.mark.llmload_isolated or @pytest.mark.llmload_isolated(timeout=*"])
    assert "During handling" not in result.stdout.str()


def test_an_isolated_test_is_refused_where_cuda_is_initialised(pytester, monkeypatch):
    monkeypatch.setattr(children, "cuda_initialised", lambda: True)
    pytester.makepyfile("import pytest\n\n@pytest.mark.llmload_isolated\ndef test_x():\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_x: @pytest.mark.llmload_isolated cannot run here: this process has "
                                 "initialised CUDA, and a child forked from it cannot use CUDA*"])


def test_known_failures_raised_in_a_child_are_named(pytester, llmload_checkpoint):
    pytester.makepyfile(f"""
        import threading
        import pytest
        import transformers.modeling_utils
        from transformers import AutoModelForCausalLM

        @pytest.mark.llmload_isolated(timeout=30)
        def test_lm_head_gets_float_activations():
            import torch
            lm_head = torch.nn.Linear(8, 8).to(torch.bfloat16)
            lm_head(torch.randn(2, 8))

        @pytest.mark.llmload_isolated(timeout=2)
        def test_load_blocks(monkeypatch):
            def blocked_shard_open(*args, **kwargs):
                threading.Event().wait()  # a shard read that never returns
            monkeypatch.setattr(transformers.modeling_utils, "safe_open", blocked_shard_open)
            AutoModelForCausalLM.from_pretrained({str(llmload_checkpoint)!r})
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "*- llmload: known failure -*",
        "[[]dp-dtype[]] nn.DataParallel wrapped around a model already placed with device_map",
        "*- llmload: known failure -*",
        "[[]offload-hang[]] from_pretrained never returns after the shards load*",
    ])
    result.stdout.fnmatch_lines(["llmload: failures matching known failures: *dp-dtype (1)*"])
    result.stdout.fnmatch_lines(["llmload: failures matching known failures: *offload-hang (1)*"])


@pytest.mark.timeout(120)
def test_isolated_tests_under_xdist(xdist_run):
    # The shared run (fixtures/xdist_run.py): its controller forked from this process, its workers xdist's own new
    # interpreters, whose isolated tests fork from them.
    assert xdist_run.outcomes("test_isolated") == {"passed": 6, "failed": 1}
    xdist_run.result.stdout.fnmatch_lines(["*isolated test test_hangs did not return: deadline of 1 s exceeded*"])
    (hung,) = [int(p.name) for p in (xdist_run.path / xdist_run_suite.PIDS).iterdir()]
    assert gone(hung)


def _freeze_count_in_child():
    import gc

    return gc.get_freeze_count()


@pytest.mark.parametrize("frozen_by_caller", [False, True])
def test_a_forked_child_starts_with_this_heap_frozen_and_the_callers_freeze_is_kept(frozen_by_caller):
    """The heap a forked child inherits is out of its garbage collections (each would copy the pages it touches);
    this process thaws what it froze for the fork, and leaves a freeze of its caller's as it was."""
    import gc

    if frozen_by_caller:
        gc.freeze()
    else:  # (a freeze this test process holds from elsewhere, a plugin's or the interpreter's, is not the subject)
        gc.unfreeze()
    try:
        (outcome,) = children.run_children([children.ChildSpec("probe", _freeze_count_in_child)], timeout=60)
        assert outcome.value > 10_000, outcome.describe()  # this process's objects, frozen for the child
        assert (gc.get_freeze_count() > 0) == frozen_by_caller
    finally:
        gc.unfreeze()


def _notes_a_row():
    from pytest_llmload.config.stash_keys import add_note

    add_note("simulated: said in the child")
    raise pytest.skip.Exception("not exercised: x")


def test_what_a_child_says_about_its_row_comes_back_with_its_answer():
    """A check's note (contract.note: how it judged) is made where the check runs; the row is written here."""
    from pytest_llmload.config.stash_keys import collecting_notes

    with collecting_notes() as notes:
        with pytest.raises(pytest.skip.Exception):
            run_isolated(_notes_a_row, (), timeout=30, label="notes")
    assert notes == ["simulated: said in the child"]


def _leaves_a_daemon_behind(marker: str):
    """What a loader that starts a helper does: a child in a new session, and a double-forked daemon that ignores
    SIGTERM (init would inherit it without a subreaper)."""
    subprocess.Popen(["sleep", marker], start_new_session=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.execvp("sleep", ["sleep", marker + "1"])
        os._exit(0)
    os.wait()
    return "loaded"


def _running(marker: str) -> list[str]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                    if marker.encode() in cmdline.read():
                        found.append(entry)
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER and /proc are Linux's")
def test_every_process_the_code_under_test_starts_is_gone_when_it_ends():
    """Before (issue 36): a loader's setsid daemon outlived the job, one per loader call."""
    from pytest_llmload.config.stash_keys import collecting_notes

    marker = f"{3000 + os.getpid() % 1000}.{time.time_ns() % 10**6}"
    with collecting_notes() as notes:
        assert run_isolated(_leaves_a_daemon_behind, (marker,), timeout=30, label="daemons") == "loaded"
    deadline = time.monotonic() + 5
    while _running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _running(marker) == []
    assert len(notes) == 1 and notes[0].startswith("2 process(es) the code under test started were still running"), \
        notes
    assert f"sleep {marker}" in notes[0]


def _leaves_a_daemon_behind_and_hangs(marker: str):
    _leaves_a_daemon_behind(marker)
    time.sleep(600)


def _raises_once_the_daemons_run(marker: str):
    while len(_running(marker)) < 2:
        time.sleep(0.01)
    raise RuntimeError("the other child's daemons run")


def _interrupted(outcomes):
    raise KeyboardInterrupt  # (what Ctrl-C or the main job's SIGTERM raises in this process)


def _gone(marker: str) -> list[str]:
    deadline = time.monotonic() + 5
    while _running(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _running(marker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_hung_childs_daemons_in_sessions_of_their_own_end_with_it_at_its_deadline():
    """Before (issue 49 point 6): at a deadline only the child's process group was killed, and a daemon in a session
    of its own (which ignores SIGTERM) outlived the job."""
    marker = f"{4000 + os.getpid() % 1000}.{time.time_ns() % 10**6}"
    with pytest.raises(IsolationFailed, match="deadline of 1 s exceeded"):
        run_isolated(_leaves_a_daemon_behind_and_hangs, (marker,), timeout=1, label="daemons")
    assert _gone(marker) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_an_interrupted_runs_daemons_in_sessions_of_their_own_end_with_its_children():
    """Before (issue 49 point 6): on Ctrl-C or the job's SIGTERM only the children's process groups were killed."""
    marker = f"{5000 + os.getpid() % 1000}.{time.time_ns() % 10**6}"
    specs = [children.ChildSpec("daemons", _leaves_a_daemon_behind_and_hangs, (marker,)),
             children.ChildSpec("raises", _raises_once_the_daemons_run, (marker,))]
    with pytest.raises(KeyboardInterrupt):
        children.run_children(specs, 60, on_failure=_interrupted)
    assert _gone(marker) == []


def _leaves_a_daemon_behind_and_dies(marker: str):
    _leaves_a_daemon_behind(marker)
    os._exit(3)  # (a crash: no answer, nothing of its own cleanup runs)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER and /proc are Linux's")
def test_a_child_that_dies_leaves_no_daemon_behind():
    """Before (issue 49 point 6): a child that crashed left its daemons to init, outside every group and tree."""
    marker = f"{6000 + os.getpid() % 1000}.{time.time_ns() % 10**6}"
    (outcome,) = children.run_children([children.ChildSpec("dies", _leaves_a_daemon_behind_and_dies, (marker,))], 60)
    assert (outcome.status, outcome.exitcode) == ("died", 3)
    assert _gone(marker) == []
