"""Frames and deadline texts (pytest_llmload.system.tracebacks): each text written here reads back here, the loader
frame is the one call_loader prints, and the frames are classified as the checks' messages need."""

import faulthandler
import sys
import traceback

import pytest

from pytest_llmload.instruments import probes
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.loader.seam import call_loader
from pytest_llmload.system import tracebacks

SITE = "/venv/lib/python3.11/site-packages"


# --- deadline texts ----------------------------------------------------------------------------------------


def test_the_deadline_texts_are_the_ones_the_reports_and_tests_read():
    assert tracebacks.did_not_return("the probe", 1) == "the probe did not return: deadline of 1 s exceeded"
    assert tracebacks.ran_late("a forward", 6.2, 5) == "a forward took 6.20 s: deadline of 5 s exceeded."
    assert tracebacks.deadline_text(1.5, of=False) == "deadline 1.5 s"


@pytest.mark.parametrize("seconds", [0.2, 0.5, 1, 1.5, 30, 120, 3600])
def test_each_deadline_text_reads_back_its_seconds(seconds):
    for text in (tracebacks.did_not_return("importing the loader's module 'm'", seconds),
                 tracebacks.ran_late("x", seconds * 2, seconds) + "\nStacks of every thread: ...",
                 f"2 of 2 ranks failed (gloo, {tracebacks.deadline_text(seconds, of=False)}); first: rank 0 was ...",
                 f"Timeout (>{float(seconds)}s) from pytest-timeout."):
        assert tracebacks.deadline_seconds(text) == seconds, text
    assert tracebacks.deadline_seconds("the loader raised: ValueError: no deadline here") is None


def test_a_deadline_passed_here_is_probes_own_or_pytest_timeouts():
    assert probes.DeadlineExceeded.__name__ == tracebacks.DEADLINE_EXCEEDED
    assert tracebacks.is_passed_deadline(probes.DeadlineExceeded(tracebacks.did_not_return("x", 1)))
    with pytest.raises(pytest.fail.Exception) as failed:
        pytest.fail("Timeout (>0.2s) from pytest-timeout.")
    assert tracebacks.is_passed_deadline(failed.value)
    assert not tracebacks.is_passed_deadline(AssertionError("deadline of 1 s exceeded, in the check's own words"))


# --- the loader frame --------------------------------------------------------------------------------------


def _loader_that_raises(request):
    raise ValueError("the loader's own error")


def test_an_exception_raised_in_the_loader_passes_through_the_loader_frame():
    with pytest.raises(Exception) as raised:
        call_loader(_loader_that_raises, LoadRequest("/nowhere/model"))
    assert tracebacks.in_loader_call(tracebacks.exception_text(raised.value))
    try:
        raise ValueError("raised outside any loader")
    except ValueError as exc:
        assert not tracebacks.in_loader_call(tracebacks.exception_text(exc))


def test_a_faulthandler_dump_taken_in_the_loader_shows_the_loader_frame(tmp_path):
    dump = tmp_path / "stacks"

    def loader_that_dumps(request):
        with open(dump, "w") as f:
            faulthandler.dump_traceback(f, all_threads=False)
        raise ValueError("dumped")

    with pytest.raises(Exception):
        call_loader(loader_that_dumps, LoadRequest("/nowhere/model"))
    text = dump.read_text()
    assert " in call_loader" in text and ", in call_loader" not in text  # faulthandler's own format
    assert tracebacks.in_loader_call(text)


def test_the_adapter_failures_tell_is_written_as_before():
    from pytest_llmload.failures.adapter_on_offloaded import FAILURE

    assert FAILURE.tell == (r"(?:peft_model\.py\", line \d+, in _update_offload"
                            r"|big_modeling\.py\", line \d+, in dispatch_model)")


# --- whose frame -------------------------------------------------------------------------------------------


def test_a_library_frame_is_known_by_its_module_live_or_printed():
    printed = traceback.FrameSummary(f"{SITE}/peft/tuners/lora/model.py", 10, "inject", lookup_line=False)
    assert tracebacks.module_of(printed) == "peft.tuners.lora.model"
    assert tracebacks.is_library(tracebacks.module_of(printed))
    assert not tracebacks.is_library(tracebacks.module_of(printed), ("torch",))
    mine = traceback.FrameSummary("/home/me/repo/loading.py", 3, "load", lookup_line=False)
    assert tracebacks.module_of(mine) == "" and not tracebacks.is_library("")
    assert tracebacks.module_of(sys._getframe()) == __name__
    assert tracebacks.is_library("torch.nn.modules.module") and not tracebacks.is_library("torchvision.ops")


def test_frames_are_those_python_prints_with_their_modules():
    try:
        int("not a number")
    except ValueError as exc:
        printed = traceback.extract_tb(exc.__traceback__)
        frames = tracebacks.frames(exc)
    assert [(f.name, f.filename, f.lineno, f.line) for f in frames] == \
        [(f.name, f.filename, f.lineno, f.line) for f in printed]
    assert frames[-1].module == __name__


def test_installed_code_is_a_librarys_or_pythons_own():
    assert tracebacks.is_installed(f"{SITE}/transformers/modeling_utils.py")
    assert tracebacks.is_installed("/usr/lib/python3.11/json/decoder.py")
    assert not tracebacks.is_installed("/home/me/repo/loading.py")
    assert tracebacks.is_frozen("<frozen os>") and not tracebacks.is_importing("<frozen os>")
    assert tracebacks.is_importing("<frozen importlib._bootstrap>")


def test_the_culprit_is_the_first_frame_past_the_plumbing():
    namespace: dict = {}
    exec(compile("def plumbing(callback):\n    return callback()\n", "/usr/lib/python3.11/socket.py", "exec"),
         namespace)

    def reaches_out():
        return namespace["plumbing"](lambda: tracebacks.culprit(sys._getframe(1), tracebacks.NETWORK_PLUMBING))

    found = reaches_out()
    assert found.f_code.co_name == "reaches_out"
    assert tracebacks.where(found) == f"reaches_out ({__file__}:{found.f_lineno})"
    assert tracebacks.culprit(None, tracebacks.WAITING_PLUMBING) is None


def test_our_innermost_frame_is_named_by_its_place_in_the_package():
    text = ('  File "/x/site-packages/torch/nn/modules/module.py", line 9, in forward\n'
            '  File "/work/pytest_llmload/checks/contract.py", line 12, in load\n'
            '  File "/work/pytest_llmload/failures/dp_dtype.py", line 40, in check_dp\n'
            '  File "/x/site-packages/transformers/trainer.py", line 7, in train\n')
    assert tracebacks.innermost_own_frame(text) == "check_dp (failures/dp_dtype.py:40)"
    assert tracebacks.innermost_own_frame('  File "/x/site-packages/torch/nn/modules/module.py", line 9') == ""


def test_a_forked_childs_dump_keeps_its_own_frames():
    dump = ("Thread 0x1 (most recent call first):\n"
            '  File "/work/loading.py", line 3 in load\n'
            '  File "/work/pytest_llmload/runners/children.py", line 40 in _child_main\n'
            '  File "/venv/site-packages/_pytest/main.py", line 9 in main\n')
    assert tracebacks.up_to(dump, "_child_main") == "\n".join(dump.splitlines()[:3])
