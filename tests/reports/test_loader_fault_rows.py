"""A loader's own fault is an error row that says what to change: the cause in one sentence in the row's
``sentence`` (``--json``'s ``reason``) and the fix as code in its ``fix``, in every reader of the row (the verdict,
the row record, JUnit's message, the HTML report, the main job's ``--json`` and table).

Before (issue 46): these rows had ``fix: null`` and an empty ``reason`` in ``--json`` (the text only in ``detail``),
and JUnit's message was the exception's first line.
"""

import dataclasses
import json
import xml.etree.ElementTree as ET

from importlib import metadata

import pytest
from packaging.version import Version

from fixtures import warm_runs
from fixtures.loaders import fault_cuda_current_device, fault_pad_token, fault_reentrant_checkpointing
from pytest_llmload.failures import BY_ID
from pytest_llmload.loader.faults import DEVICE_FIX, PAD_TOKEN_FIX
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.loader.seam import LoaderModelError, as_loader_under_test, call_loader
from pytest_llmload.checks.base import Check
from pytest_llmload.reports import verdict
from pytest_llmload.reports.verdict import row_of
from pytest_llmload.runners import wire
from pytest_llmload.runners.isolation import ChildError
from pytest_llmload.system.gpus import visible_gpu_count

pytestmark = pytest.mark.timeout(180)
# (torch where a test uses it: every run of this repo imports this file at collection, `pytest -m gpu` too)
needs_no_cuda = pytest.mark.skipif(visible_gpu_count() > 0, reason="a CUDA pin is honoured on this machine")
FAILURE = BY_ID["offload-hang"]
TRANSFORMERS_5 = Version(metadata.version("transformers")).major >= 5


def raised(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def load_with_the_cuda_fault(loader, checkpoint, workdir):
    call_loader(fault_cuda_current_device.load, LoadRequest(checkpoint))


@needs_no_cuda
def test_a_loader_fault_is_an_error_verdict_with_its_fix_also_when_it_did_not_pickle(llmload_checkpoint, tmp_path,
                                                                                     monkeypatch):
    error = raised(lambda: call_loader(fault_cuda_current_device.load, LoadRequest(llmload_checkpoint)))
    judged = verdict.of_exception(error, FAILURE)
    assert (judged.kind, judged.failure, judged.cause, judged.fix) == ("error", None, "loader", DEVICE_FIX)
    assert "\n  cause: the loader pins the model to a CUDA device" in judged.sentence
    # Raised in an isolated check's child, it came back as its text only: the child judged it, as itself.
    monkeypatch.setattr(wire, "exception_bytes", lambda exc: None)
    check = Check(load_with_the_cuda_fault, FAILURE, isolated=True, timeout=60)
    unpickled = raised(lambda: check(fault_cuda_current_device.load, llmload_checkpoint, tmp_path))
    assert isinstance(unpickled, ChildError)
    row = row_of(check, raised=unpickled)
    assert (row.verdict, row.cause, row.fix, row.sentence) == ("error", "loader", DEVICE_FIX, judged.sentence)


def test_a_loader_error_that_is_no_known_fault_has_no_fix_and_its_whole_reason():
    def load(request):
        raise ValueError("the repo's own config has no 'model_name'")

    judged = verdict.of_exception(raised(lambda: call_loader(load, LoadRequest("/nowhere"))), FAILURE)
    assert (judged.cause, judged.fix) == ("loader", None) and "no 'model_name'" in judged.sentence


def test_the_models_index_error_in_a_checks_forward_is_the_loaders_pad_token_not_a_bug_of_the_check():
    import torch

    embeddings = torch.nn.Embedding(8, 2)
    judged = verdict.of_exception(raised(lambda: embeddings(torch.tensor([[8]]))), FAILURE)
    assert (judged.kind, judged.cause, judged.fix) == ("error", "model", PAD_TOKEN_FIX), judged
    assert "pytest-llmload" not in judged.sentence  # (before: "the check itself broke (a bug in pytest-llmload ...")


def test_the_pad_token_checks_model_error_carries_its_fix(llmload_checkpoint, tmp_path):
    from pytest_llmload.failures.offload_hang import check_pad_token_set_offline

    error = raised(lambda: check_pad_token_set_offline(as_loader_under_test(fault_pad_token.load), llmload_checkpoint,
                                                       tmp_path))
    assert isinstance(error, LoaderModelError) and error.fix == PAD_TOKEN_FIX, error
    assert verdict.of_exception(error, FAILURE).fix == PAD_TOKEN_FIX


def test_a_lora_model_checkpointed_reentrantly_cannot_train_and_its_row_says_enable_input_require_grads(
        llmload_checkpoint, tmp_path):
    """The fault is transformers 4.x's (reentrant by default there); transformers 5 with its peft trains it."""
    from pytest_llmload.failures.meta_backward import check_train_request_trains

    loader = as_loader_under_test(fault_reentrant_checkpointing.load)
    if TRANSFORMERS_5:
        check_train_request_trains(loader, llmload_checkpoint, tmp_path, variants=[(None, True, True)])
        return
    error = raised(lambda: check_train_request_trains(loader, llmload_checkpoint, tmp_path,
                                                      variants=[(None, True, True)]))
    judged = verdict.of_exception(error, BY_ID["meta-backward"])
    assert (judged.kind, judged.cause) == ("error", "model"), judged
    assert judged.fix.startswith("model.enable_input_require_grads()  # after loading"), judged
    assert "cause: the loss has no gradient path to a trainable weight" in judged.sentence


def test_a_failed_verdict_carries_its_known_failures_fix():
    judged = verdict.of_exception(raised(lambda: exec("assert False, 'observed'")), FAILURE)
    assert (judged.kind, judged.fix) == ("failed", FAILURE.fix)


# A repo's own checks (in this process): the loader's error, the model's pad token, a known failure observed.
FILES = {
    "faultchecks": (
        "import torch\n"
        "from pytest_llmload import LoadRequest\n"
        "from pytest_llmload.checks.base import Check\n"
        "from pytest_llmload.failures import BY_ID\n\n"
        "def check_loads(loader, checkpoint, workdir):\n"
        "    '''Loads.'''\n"
        "    loader(LoadRequest(checkpoint))\n\n"
        "def check_embeds_its_pad_token(loader, checkpoint, workdir):\n"
        "    '''Embeds a padded batch.'''\n"
        "    torch.nn.Embedding(8, 2)(torch.tensor([[1, 8]]))\n\n"
        "def check_sees_its_failure(loader, checkpoint, workdir):\n"
        "    '''Sees the mechanism.'''\n"
        "    assert False, 'the mechanism, observed'\n\n"
        "CHECKS = [Check(check_loads, failure=BY_ID['offload-hang']),\n"
        "          Check(check_embeds_its_pad_token, failure=BY_ID['offload-hang']),\n"
        "          Check(check_sees_its_failure, failure=BY_ID['meta-backward'])]\n"),
    "test_gate": (
        "from fixtures.loaders.fault_cuda_current_device import load\n"
        "from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks\n"
        "from faultchecks import CHECKS\n\n"
        "@parametrize_with_loader_checks([load], checks=CHECKS)\n"
        "def test_loader(loader, check, tmp_path):\n"
        "    check(loader, tmp_path, tmp_path)\n"),
}


@needs_no_cuda
def test_junit_carries_the_finding_and_the_fix_of_each_row(pytester, monkeypatch):
    pytester.makepyfile(**FILES)
    monkeypatch.syspath_prepend(pytester.path)
    result = pytester.runpytest("-p", "no:randomly", "--junitxml", "out.xml")
    result.assert_outcomes(failed=3)
    cases = {case.get("name").rpartition("-")[2].rstrip("]"): case
             for case in ET.parse(pytester.path / "out.xml").getroot().iter("testcase")}
    expected = {"check_loads": ("error", DEVICE_FIX), "check_embeds_its_pad_token": ("error", PAD_TOKEN_FIX),
                "check_sees_its_failure": ("failure", BY_ID["meta-backward"].fix)}
    for name, (tag, fix) in expected.items():
        (element,) = [child for child in cases[name] if child.tag in ("failure", "error")]
        row = json.loads({p.get("name"): p.get("value") for p in cases[name].iter("property")}["llmload_row"])
        assert (element.tag, row["fix"]) == (tag, fix), name
        message = element.get("message")
        # the finding, then the fix: never the exception's line of this plugin's source
        assert message.endswith(f"\nfix: {fix}") and message.partition("\n")[0] in row["sentence"], message


def test_the_html_report_shows_a_loader_faults_fix(pytestconfig):
    import html

    from pytest_llmload.reports.html_report import render_html
    from pytest_llmload.reports.row import Row

    row = Row("check_loads", "error", guards="offload-hang", cause="loader", fix=DEVICE_FIX, seconds=0.1,
              sentence=f"loader error: AssertionError: Torch not compiled with CUDA enabled\n  fix: {DEVICE_FIX}")
    report_row = {"nodeid": "test_gate.py::test_loader[check_loads]", "row": row, "record": None, "known": ""}
    own = {**report_row, "nodeid": "test_gate.py::test_loader[own_thing]",
           "row": dataclasses.replace(row, check="own_thing")}
    text = render_html(pytestconfig, [report_row, own], 0.0, 1.0)
    assert f"fix (the loader):</span> <code>{html.escape(DEVICE_FIX)}</code>" in text
    assert 'data-check="own_thing"' in text, "a row is named by its check's own name, as its Row says"


@needs_no_cuda
def test_the_main_jobs_json_and_table_say_the_fault_of_a_loader_run_in_an_isolated_child(tmp_path):
    """End to end: the check's child raised the loader's error; the parent's row has its reason and fix."""
    run = warm_runs.main_job("--loader", "fixtures.loaders.fault_cuda_current_device:load", "-k",
                             "train_request_trains and not cuda", "--json", str(tmp_path / "out.json"),
                             env={**warm_runs.os.environ, "COLUMNS": "1000", "TMPDIR": str(tmp_path)})
    assert run.returncode == 1, run.stdout + run.stderr
    (record,) = json.loads((tmp_path / "out.json").read_text())["results"]
    assert (record["outcome"], record["cause"], record["fix"]) == ("error", "loader", DEVICE_FIX), record
    assert record["sentence"].startswith("loader error: AssertionError: Torch not compiled with CUDA enabled")
    assert "\n  cause: the loader pins the model to a CUDA device" in record["sentence"]
    assert f"fix: {DEVICE_FIX}" in run.stdout, run.stdout
