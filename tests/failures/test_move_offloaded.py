"""move-offloaded: ``.to(device)`` / ``.cuda()`` / ``.cpu()`` on a model that ``device_map`` offloaded.

Reproduced here on CPU with the tiny Llama: half the weights on cpu, the rest on disk (29 of 39 parameters on
meta), then the move the field reports make (mlfoundations/rtfm#19's ``.to(device)``, mlcommons/inference#1751's
``.to(memory_format=torch.channels_last)``, 01-ai/Yi#302's ``deepspeed.initialize``). The tests show the
error text, the check of :mod:`pytest_llmload.failures.move_offloaded` failing on the before loader with the
figures, passing on loaders that do not move the offloaded model, and skipping on one that loaded it whole.
"""

from __future__ import annotations

import os
import re
import textwrap

import pytest

from fixtures import tiny_llama
from fixtures.loaders import before_move_offloaded
from pytest_llmload import failures as catalog
from pytest_llmload.failures import move_offloaded
from pytest_llmload.instruments.recorder import recording
from pytest_llmload.loader.seam import LoaderError
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as reference_loader
from pytest_llmload.checks.ground_truth import offload_budget

pytestmark = pytest.mark.timeout(120)

REFUSAL = "You can't move a model that has some modules offloaded to cpu or disk."


def offloaded_model(checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, device_map="auto", max_memory=offload_budget(checkpoint),
                                                offload_folder=tmp_path / "offload")


# --- (a) the failure itself, with its own text -------------------------------------------------------------


@pytest.mark.parametrize("move", ["to-device", "to-dtype", "to-memory-format", "cuda"])
def test_moving_an_offloaded_model_raises_accelerates_refusal(move, llmload_checkpoint, tmp_path):
    import torch

    model = offloaded_model(llmload_checkpoint, tmp_path)
    assert sum(p.device.type == "meta" for p in model.parameters()) == tiny_llama.OFFLOADED
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}
    calls = {"to-device": lambda: model.to("cpu"), "to-dtype": lambda: model.to(torch.float32),
             "to-memory-format": lambda: model.to(memory_format=torch.channels_last), "cuda": model.cuda}
    with pytest.raises(RuntimeError) as excinfo:  # .cuda() is refused before CUDA is looked for: CPU-only too
        calls[move]()
    assert str(excinfo.value) == REFUSAL
    assert excinfo.traceback[-1].frame.f_globals["__name__"] == "accelerate.big_modeling"


def test_cpu_on_an_offloaded_model_fails_inside_torch_with_a_meta_copy_error(llmload_checkpoint, tmp_path):
    """``.cpu()`` is not wrapped by accelerate: torch fails to copy the meta parameters. Torch says the same of any
    meta copy, so no catalog entry claims that text by itself (the check names it from the traceback instead)."""
    model = offloaded_model(llmload_checkpoint, tmp_path)
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor; no data!") as excinfo:
        model.cpu()
    text = "".join(excinfo.exconly())
    assert not move_offloaded.FAILURE.matches(text)
    assert not catalog.BY_ID["meta-backward"].matches(text)  # its signature is the backward's own text
    move = move_offloaded.find_move(excinfo.value)
    assert move is not None and move.call == ".cpu()" and move.state.meta == tiny_llama.OFFLOADED


# --- (b) the check fails on the before loader, and on the other moves of the reports ---------------------


def test_check_fails_on_the_before_loader_naming_the_call_and_the_device_map(llmload_checkpoint, tmp_path):
    with pytest.raises(AssertionError) as excinfo:
        move_offloaded.check_offloaded_model_not_moved(before_move_offloaded.load, llmload_checkpoint, tmp_path)
    message = str(excinfo.value)
    assert re.search(
        rf"^move-offloaded: the loader moved a model with {tiny_llama.OFFLOADED} of {tiny_llama.PARAMETERS} "
        r"parameters offloaded: \.to\('cpu'\) at \S*before_move_offloaded\.py:\d+ in load "
        r"\(`model = AutoModelForCausalLM\.from_pretrained\(.*\)\.to\(device\)`\) raised RuntimeError: "
        + re.escape(REFUSAL), message), message
    assert (f"{tiny_llama.OFFLOADED} of {tiny_llama.PARAMETERS} parameters on meta (offloaded), 30 modules behind "
            "an offloading accelerate hook, hf_device_map={'model.embed_tokens': 'cpu', 'model.layers.0': 'cpu', "
            "'model.layers.1': 'disk'") in message
    assert f"max_memory={{'cpu': {tiny_llama.HALF_BUDGET}}}" in message
    assert move_offloaded.FAILURE.matches(message)


def test_a_failing_check_records_the_moved_model_for_the_report(llmload_checkpoint, tmp_path):
    # No model comes back to the seam when the loader's own .to() raises: the one in the traceback is recorded, so
    # the HTML report's card and the failure section can say where it was.
    with recording() as record, pytest.raises(AssertionError):
        move_offloaded.check_offloaded_model_not_moved(before_move_offloaded.load, llmload_checkpoint, tmp_path)
    (loaded,) = record.models
    assert {str(v) for v in loaded.device_map.values()} == {"cpu", "disk"}
    assert loaded.source == str(llmload_checkpoint)


def casts_after_load(request):
    """Loads offloaded, then casts: ``.to(dtype)`` is refused as well as a device."""
    model, tokenizer = reference_loader(request)
    return model.to(request.torch_dtype), tokenizer


def channels_last(request):
    """mlcommons/inference#1751 (SUT.load_model): ``self.model.to(memory_format=torch.channels_last)``."""
    import torch

    model, tokenizer = reference_loader(request)
    return model.to(memory_format=torch.channels_last), tokenizer


def moves_with_cpu(request):
    """``.cpu()`` instead of ``.to(device)``: not wrapped by accelerate, fails inside torch."""
    model, tokenizer = reference_loader(request)
    return model.cpu(), tokenizer


def adapter_then_to(request):
    """A PEFT model around the offloaded base (hiyouga/LlamaFactory#2732 deployed a LoRA model), then ``.to``:
    the wrapper's ``.to`` is torch's own, which fails on the meta parameters."""
    from peft import LoraConfig, get_peft_model

    model, tokenizer = reference_loader(request)
    model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return model.to(request.device), tokenizer


@pytest.mark.parametrize(("loader", "call", "error"), [
    (casts_after_load, r"\.to\(torch\.float32\)", re.escape(f"RuntimeError: {REFUSAL}")),
    (channels_last, r"\.to\(memory_format=torch\.channels_last\)", re.escape(f"RuntimeError: {REFUSAL}")),
    (moves_with_cpu, r"\.cpu\(\)", r"NotImplementedError from torch \(a meta parameter has no data to copy\)"),
    (adapter_then_to, r"\.to\('cpu'\)", r"NotImplementedError from torch \(a meta parameter has no data to copy\)"),
], ids=lambda v: v.__name__ if callable(v) else "")
def test_check_fails_on_every_move_of_the_offloaded_model(loader, call, error, llmload_checkpoint, tmp_path):
    with pytest.raises(AssertionError) as excinfo:
        move_offloaded.check_offloaded_model_not_moved(loader, llmload_checkpoint, tmp_path)
    message = str(excinfo.value)
    on_meta = tiny_llama.OFFLOADED + (tiny_llama.LORA_WEIGHTS_ON_META if loader is adapter_then_to else 0)
    assert re.search(rf"moved a model with {on_meta} of \d+ parameters offloaded: {call} at "
                     rf"\S*test_move_offloaded\.py:\d+ in {loader.__name__} \(`.*`\) raised {error}", message), message
    assert "'model.layers.1': 'disk'" in message
    assert move_offloaded.FAILURE.matches(message)
    assert "Cannot copy out of meta tensor" not in message  # meta-backward's signature stays out of the verdict
    assert [f.id for f in catalog.CATALOG if f.matches(message) and f.id != "move-offloaded"] == []


DEEPSPEED_CONFIG = {"train_batch_size": 1, "optimizer": {"type": "SGD", "params": {"lr": 1e-3}}}


def deepspeed_initialize(request):
    """01-ai/Yi#302 (finetune/sft/main.py): the model loaded with ``device_map="auto"``, then handed to
    ``deepspeed.initialize``, whose engine calls ``self.module.to(self.device)``."""
    import deepspeed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request.model_path, device_map="auto",
                                                 max_memory=request.max_memory_dict,
                                                 offload_folder=request.offload_folder)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=DEEPSPEED_CONFIG)
    return engine.module


@pytest.mark.llmload_deepspeed
@pytest.mark.llmload_isolated(timeout=100)  # deepspeed.initialize sets up a process group: it dies with the child
def test_check_fails_when_deepspeed_initialize_moves_the_offloaded_model(llmload_checkpoint, tmp_path):
    pytest.importorskip("deepspeed")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    with pytest.raises(AssertionError) as excinfo:
        move_offloaded.check_offloaded_model_not_moved(deepspeed_initialize, llmload_checkpoint, tmp_path)
    message = str(excinfo.value)
    assert re.search(r"\.to\(device\(type='cpu'\)\) at \S*test_move_offloaded\.py:\d+ in deepspeed_initialize "
                     r"\(`engine, _, _, _ = deepspeed\.initialize\(.*`\), through "
                     r"deepspeed\.runtime\.engine\._configure_distributed_model raised RuntimeError: "
                     + re.escape(REFUSAL), message), message


# --- (c) the reference loader, and (d) loaders that avoid the failure another way -----------------------


def test_check_passes_on_the_reference_loader(llmload_checkpoint, tmp_path):
    move_offloaded.check_offloaded_model_not_moved(reference_loader, llmload_checkpoint, tmp_path)


def moves_only_when_whole(request):
    """The before loader, fixed with :func:`move_offloaded.may_move`: ``.to(device)`` only when nothing is offloaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(request.model_path, device_map="auto",
                                                 max_memory=request.max_memory_dict,
                                                 offload_folder=request.offload_folder, torch_dtype=request.torch_dtype)
    if move_offloaded.may_move(model):
        model = model.to(request.device)
    return model, AutoTokenizer.from_pretrained(request.model_path)


def whole_unless_the_budget_needs_offload(request):
    """Loads whole on the device (and moves it, as the reports' code does) when the budget holds the weights;
    otherwise lets ``device_map="auto"`` offload and uses the model as loaded."""
    from transformers import AutoModelForCausalLM

    from pytest_llmload.fixes.training_memory import checkpoint_tensors

    weights = sum(t.nbytes for t in checkpoint_tensors(request.model_path))
    budget = (request.max_memory_dict or {}).get("cpu" if request.device == "cpu" else
                                                  int(request.device.partition(":")[2] or 0))
    if budget is None or budget >= weights:
        return AutoModelForCausalLM.from_pretrained(request.model_path, torch_dtype=request.torch_dtype).to(request.device)
    return AutoModelForCausalLM.from_pretrained(request.model_path, device_map="auto", max_memory=request.max_memory_dict,
                                                offload_folder=request.offload_folder, torch_dtype=request.torch_dtype)


def keeps_it_where_refused(request):
    """Tries the move and keeps the model as loaded when accelerate refuses (the ComfyUI nodes' fix)."""
    model, tokenizer = reference_loader(request)
    try:
        model = model.to(request.device)
    except RuntimeError as exc:
        if "offloaded" not in str(exc):
            raise
    return model, tokenizer


@pytest.mark.parametrize("loader", [moves_only_when_whole, whole_unless_the_budget_needs_offload,
                                    keeps_it_where_refused], ids=lambda f: f.__name__)
def test_check_passes_on_loaders_that_do_not_move_an_offloaded_model(loader, llmload_checkpoint, tmp_path):
    move_offloaded.check_offloaded_model_not_moved(loader, llmload_checkpoint, tmp_path)


def test_may_move(llmload_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    assert not move_offloaded.may_move(offloaded_model(llmload_checkpoint, tmp_path))
    assert move_offloaded.may_move(AutoModelForCausalLM.from_pretrained(llmload_checkpoint, device_map={"": "cpu"}))
    assert move_offloaded.may_move(AutoModelForCausalLM.from_pretrained(llmload_checkpoint))


# --- (e) skips: nothing was offloaded; the loader's own errors are not this failure --------------------------


def ignores_the_budget(request):
    model, tokenizer = reference_loader(request.replace(max_memory=None))
    return model.to(request.device), tokenizer


@pytest.mark.parametrize(("loader", "fraction"), [(ignores_the_budget, 0.5), (before_move_offloaded.load, 2.0),
                                                  (whole_unless_the_budget_needs_offload, 2.0)],
                         ids=["ignores-the-budget", "before-loader-budget-holds-it", "loads-whole-when-it-fits"])
def test_check_skips_when_nothing_was_offloaded(loader, fraction, llmload_checkpoint, tmp_path):
    with pytest.raises(pytest.skip.Exception) as excinfo:
        move_offloaded.check_offloaded_model_not_moved(loader, llmload_checkpoint, tmp_path, fraction=fraction)
    assert str(excinfo.value).startswith(
        "not exercised: check_offloaded_model_not_moved: the loader loaded the model whole on cpu under max_memory=")
    assert str(excinfo.value).endswith("nothing was offloaded; moving an offloaded model was not exercised")


def broken_loader(request):
    raise FileNotFoundError(f"no config.json in {request.model_path}/typo")


def moves_a_whole_model_built_on_meta(request):
    """An unrelated meta error: a model built on meta (nothing offloaded) and moved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(request.model_path))
    return model.to(request.device)


@pytest.mark.parametrize(("loader", "original"), [(broken_loader, FileNotFoundError),
                                                  (moves_a_whole_model_built_on_meta, NotImplementedError)],
                         ids=lambda v: getattr(v, "__name__", ""))
def test_the_loaders_own_errors_propagate_as_they_are(loader, original, llmload_checkpoint, tmp_path):
    with pytest.raises(LoaderError) as excinfo:
        move_offloaded.check_offloaded_model_not_moved(loader, llmload_checkpoint, tmp_path)
    assert type(excinfo.value.original) is original


# --- (f) the known-failure report, and no overlap with the other catalog entries --------------------------


KNOWN_FAILURE_TESTS = """
    from fixtures.loaders import before_move_offloaded
    from pytest_llmload import LoadRequest
    from pytest_llmload.failures.move_offloaded import check_offloaded_model_not_moved
    from pytest_llmload.checks.ground_truth import offload_budget

    CKPT = {checkpoint!r}

    def test_the_reports_loader(tmp_path):
        before_move_offloaded.load(LoadRequest(CKPT, max_memory=offload_budget(CKPT), offload_folder=tmp_path))

    def test_the_check(tmp_path):
        check_offloaded_model_not_moved(before_move_offloaded.load, CKPT, tmp_path)
"""


def with_this_failure_in_the_catalog(monkeypatch):
    """The catalog the report reads lists this failure (pytest_llmload.failures.MODULES)."""
    assert move_offloaded.FAILURE in catalog.CATALOG


def test_the_report_names_move_offloaded_for_the_real_error(pytester, llmload_checkpoint, request, monkeypatch):
    with_this_failure_in_the_catalog(monkeypatch)
    pytester.syspathinsert(request.config.rootpath)
    pytester.makepyfile(textwrap.dedent(KNOWN_FAILURE_TESTS.format(checkpoint=str(llmload_checkpoint))))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines([
        "E * RuntimeError: You can't move a model that has some modules offloaded to cpu or disk.",
        "*- llmload: known failure -*",
        "[[]move-offloaded[]] moving (.to/.cuda/.cpu) a model that device_map offloaded to cpu or disk",
        "  write-up:   mlfoundations/rtfm#19, 01-ai/Yi#302, mlcommons/inference#1751, hiyouga/LlamaFactory#2732",
    ])
    result.stdout.fnmatch_lines(["llmload: failures matching known failures: move-offloaded (2)*"])
    named = re.findall(r"^\[([a-z0-9-]+)\] ", result.stdout.str(), flags=re.MULTILINE)
    assert named == ["move-offloaded", "move-offloaded"], named


def other_entries_errors(checkpoint, tmp_path) -> dict:
    """Real error texts of the other catalog entries (what their tests produce), one or more each."""
    import inspect
    import traceback

    import accelerate.accelerator
    import torch

    from fixtures.loaders import before_meta_backward
    from pytest_llmload import LoadRequest

    def text_of(call):
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - the text is what is wanted
            return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        raise AssertionError(f"{call} did not raise")

    def backward_through_offloaded_lora():
        model, tokenizer = before_meta_backward.load(LoadRequest(
            checkpoint, purpose="train", lora=True, max_memory=offload_budget(checkpoint), offload_folder=tmp_path))
        batch = tokenizer(["hello world"], return_tensors="pt")
        model(**batch, labels=batch["input_ids"]).loss.backward()

    source = inspect.getsource(accelerate.accelerator)
    ddm = re.search(r"You can't train a model that has been loaded with `device_map='auto'` in any distributed "
                    r"mode\.[^\"]*", source)
    return {
        "meta-backward": [text_of(backward_through_offloaded_lora)],
        "dp-dtype": [text_of(lambda: torch.nn.Linear(8, 8).to(torch.bfloat16)(torch.randn(2, 8)))],
        "distributed-device-map": [f"ValueError: {ddm.group(0)}" if ddm else ""],
        "offload-hang": ["Failed: Timeout (>3.0s) from pytest-timeout.\n  in from_pretrained"],
        "inference-stall": ["Failed: Timeout (>3.0s) from pytest-timeout.\n  in generate"],
    }


def test_signatures_do_not_overlap_with_the_other_catalog_entries(llmload_checkpoint, tmp_path):
    import traceback

    errors = other_entries_errors(llmload_checkpoint, tmp_path / "other")
    assert all(texts and all(texts) for texts in errors.values()), errors
    for failure_id, texts in errors.items():
        for text in texts:
            assert catalog.BY_ID[failure_id].matches(text), (failure_id, text[-300:])
            assert not move_offloaded.FAILURE.matches(text), (failure_id, text[-300:])
    model = offloaded_model(llmload_checkpoint, tmp_path)
    try:
        model.to("cpu")
    except RuntimeError as exc:
        ours = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    assert move_offloaded.FAILURE.matches(ours)
    assert [f.id for f in catalog.CATALOG if f.matches(ours)] == ["move-offloaded"]  # no other entry claims it


# --- on a GPU: the reports' own setup (cuda:0, layers offloaded to cpu) -------------------------------------


@pytest.mark.needs_gpus(1)
def test_check_on_cuda(llmload_checkpoint, tmp_path):
    with pytest.raises(AssertionError, match=r"\.to\('cuda:0'\) at .* raised RuntimeError: " + re.escape(REFUSAL)):
        move_offloaded.check_offloaded_model_not_moved(before_move_offloaded.load, llmload_checkpoint, tmp_path / "b",
                                                       device="cuda:0")
    move_offloaded.check_offloaded_model_not_moved(reference_loader, llmload_checkpoint, tmp_path / "r", device="cuda:0")
