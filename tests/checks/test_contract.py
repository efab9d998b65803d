"""The contract layer (pytest_llmload.checks.contract) and the verdicts (reports.verdict): every registered check
loads through the contract, a loader that did not honour the request is an error row with the contract sentence,
and a crash in a check's own code is an error that says so, never a known failure."""

import os
import sys

import pytest

from pytest_llmload.failures import REGISTRY
from pytest_llmload.checks import contract
from pytest_llmload.reports import verdict
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as reference
from pytest_llmload.loader.request import LoadRequest

CPU_CHECKS = [pytest.param(check, id=check.name) for check in REGISTRY if not check.needs_gpus]

pytestmark = [pytest.mark.llmload_deepspeed, pytest.mark.timeout(240)]


def _verdict_of(check, loader, checkpoint, workdir):
    """Run ``check`` and return its verdict (``None``: it passed or skipped)."""
    try:
        check(loader, checkpoint, workdir)
    except BaseException as exc:  # noqa: BLE001 - whatever the check raised is what is judged
        return verdict.of_exception(exc, check.failure)
    return None


def whole(request):
    """The reference loader with the budget dropped: it returns a model for every check's request (the reference
    loader itself refuses an adapter on an offloading budget, and then no check would see a model)."""
    return reference(request.replace(max_memory=None))


def loads_nothing(request):
    """A loader that breaks the contract whatever the check asks (and under ZeRO-3 too): a model built on meta."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(request.model_path))
    return model, AutoTokenizer.from_pretrained(request.model_path)


def shrinks_the_vocabulary(request):
    """A loader that loads as asked, then drops rows of the embeddings (under ZeRO-3 too, where a model built on
    meta cannot even be partitioned: that is the loader's own error there)."""
    model, tokenizer = reference(request)
    model.resize_token_embeddings(model.config.vocab_size - 4)
    return model, tokenizer


BREACHES = {"check_zero3_load": (shrinks_the_vocabulary, "rows for a checkpoint of")}


@pytest.mark.parametrize("check", CPU_CHECKS)
def test_every_check_goes_through_the_contract(check, llmload_checkpoint, tmp_path):
    loader, said = BREACHES.get(check.name, (loads_nothing, "every parameter on the meta device"))
    got = _verdict_of(check, loader, llmload_checkpoint, tmp_path)
    assert got is not None and (got.kind, got.failure, got.cause) == ("error", None, "contract"), got
    assert said in got.sentence, got.sentence


@pytest.mark.parametrize("check", CPU_CHECKS)
def test_a_crash_in_the_checks_own_code_is_an_error_never_a_verdict(check, llmload_checkpoint, tmp_path,
                                                                     monkeypatch):
    monkeypatch.setenv(contract.INJECT_CRASH_ENV, check.name)  # children and ranks inherit it
    got = _verdict_of(check, whole, llmload_checkpoint, tmp_path)
    assert got is not None and (got.kind, got.failure, got.cause) == ("error", None, "check"), got
    assert got.sentence.startswith("the check itself broke") and "IndexError" in got.sentence, got.sentence
    assert "contract.py" in got.sentence and "please report it" in got.sentence, got.sentence


# --- the contract's premises, one by one ---------------------------------------------------------------------


def _gap(model, request):
    with pytest.raises(contract.ContractGap) as caught:
        contract.verify(model, request, check="check_x")
    return caught.value.sentence


def test_every_parameter_on_meta_is_nothing_loaded(llmload_checkpoint):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llmload_checkpoint))
    assert "every parameter on the meta device" in _gap(empty, LoadRequest(llmload_checkpoint))


def float16_whatever_is_asked(request):
    """A loader of one dtype (a vision-language project's LLM, write-up 002's script): float16, with the budget."""
    import torch
    from transformers import AutoModelForCausalLM

    calls.append(request)
    return AutoModelForCausalLM.from_pretrained(
        request.model_path, torch_dtype=torch.float16, local_files_only=True, max_memory=request.max_memory_dict,
        device_map="auto" if request.max_memory else {"": request.device}, offload_folder=request.offload_folder)


calls: list = []


def test_a_loader_of_one_dtype_is_asked_again_in_it_with_its_budget_resized(llmload_checkpoint, tmp_path):
    from pytest_llmload.config.stash_keys import collecting_notes
    from pytest_llmload.checks.ground_truth import offload_budget
    from pytest_llmload.instruments.device_map_summary import offloaded_parts

    calls.clear()
    contract._ANSWERED_DTYPE.clear()
    with collecting_notes() as notes:
        budget = offload_budget(llmload_checkpoint)  # half of the float32 weights: all of the float16 ones
        asked = LoadRequest(llmload_checkpoint, max_memory=budget, offload_folder=tmp_path / "offload")
        loaded = contract.load(float16_whatever_is_asked, asked, check="check_x")
        assert loaded.request == asked.replace(dtype="float16", max_memory={"cpu": budget["cpu"] // 2})
        assert offloaded_parts(loaded.model), "the resized budget offloads the float16 model as the check meant"
        assert [c.dtype for c in calls] == ["float32", "float16"]
        model, tokenizer = loaded  # unpacks as a LoadResult
        contract.load(float16_whatever_is_asked, asked, check="check_x")  # asked in float16 at once, now
        assert [c.dtype for c in calls] == ["float32", "float16", "float16"]
    assert notes == ["judged in float16, the dtype its weights came in when asked float32 (max_memory budgets sized "
                     "for float16)"]


def test_a_declared_dtype_is_asked_at_once_and_a_train_request_may_get_float32(llmload_checkpoint):
    from pytest_llmload.loader.seam import as_loader_under_test

    def declared(request):
        return float16_whatever_is_asked(request)

    declared.llmload_dtypes = ("fp16",)
    calls.clear()
    loaded = contract.load(as_loader_under_test(declared), LoadRequest(llmload_checkpoint), check="check_x")
    assert [c.dtype for c in calls] == ["float16"] and loaded.request.dtype == "float16"
    fp32 = contract.load(reference, LoadRequest(llmload_checkpoint, purpose="train", dtype="bfloat16"), check="c")
    assert fp32.request.dtype == "bfloat16", "float32 master weights answer a train request as asked"


def test_budgets_are_resized_by_the_weights_size_in_the_dtype(llmload_checkpoint):
    request = LoadRequest(llmload_checkpoint, max_memory={0: "1GiB", "cpu": 1000})
    assert contract.in_dtype(request, "bfloat16").max_memory == {0: 2**29, "cpu": 500}
    assert contract.in_dtype(request.replace(dtype="float16"), "float32").max_memory == {0: 2**31, "cpu": 2000}
    assert contract.in_dtype(request, "float32") is request


def test_a_distributed_or_deepspeed_train_request_may_get_the_model_whole_on_the_cpu(llmload_checkpoint, monkeypatch):
    # The training set-up (deepspeed.initialize, accelerate.prepare, Trainer) moves it to the rank's device; loading
    # without device_map there is write-up 004's fix. Elsewhere a cuda request answered on the cpu stays a gap.
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    model = reference(LoadRequest(llmload_checkpoint))[0]
    contract.verify(model, LoadRequest(llmload_checkpoint, purpose="train", device="cuda:0", deepspeed=True),
                    check="check_x")
    assert _gap(model, LoadRequest(llmload_checkpoint, purpose="train", device="cuda:0")) == \
        "the loader returned the model whole on cpu for a device='cuda:0' request"
    assert _gap(model, LoadRequest(llmload_checkpoint, device="cuda:0", deepspeed=True)) == \
        "the loader returned the model whole on cpu for a device='cuda:0' request"
    monkeypatch.setenv("WORLD_SIZE", "2")
    contract.verify(model, LoadRequest(llmload_checkpoint, purpose="train", device="cuda:0"), check="check_x")


def test_a_grown_vocabulary_is_fine_and_compared_on_the_checkpoints_rows_a_shrunk_one_is_a_gap(llmload_checkpoint):
    import torch

    model = reference(LoadRequest(llmload_checkpoint))[0]
    vocab = model.config.vocab_size
    model.resize_token_embeddings(vocab + 8)
    facts = contract.verify(model, LoadRequest(llmload_checkpoint), check="check_x")
    assert (facts.vocab, facts.checkpoint_vocab) == (vocab + 8, vocab)
    logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert contract.checkpoint_logits(logits, LoadRequest(llmload_checkpoint)).shape[-1] == vocab
    model.resize_token_embeddings(vocab - 4)
    assert _gap(model, LoadRequest(llmload_checkpoint)) == \
        f"the loader returned a vocabulary of {vocab - 4} rows for a checkpoint of {vocab}"


def test_a_quantized_model_for_an_unquantized_request_is_a_gap(llmload_checkpoint):
    from pytest_llmload.failures.dp_dtype import four_bit_refusal

    if four_bit_refusal() is not None:
        pytest.skip(four_bit_refusal())
    model = reference(LoadRequest(llmload_checkpoint, quantization="4bit", dtype="bfloat16"))[0]
    assert "quantized model" in _gap(model, LoadRequest(llmload_checkpoint, dtype="bfloat16"))


# --- hostile loaders: what the loader did, no failure id ---------------------------------------------------------


def exits(request):
    os._exit(0)


def exits_politely(request):
    sys.exit(3)


def closes_stdout(request):
    model = reference(request)
    sys.stdout.close()
    return model


@pytest.mark.parametrize("name", ["check_offload_inference", "check_adapter_on_offloaded_base"])
@pytest.mark.parametrize(("loader", "said"), [
    (exits, "tried to end its process with os._exit(0)"),
    (exits_politely, "tried to end its process with sys.exit(3)"),
])
def test_a_loader_that_exits_is_an_error_saying_so(name, loader, said, llmload_checkpoint, tmp_path):
    # (the adapter check reads a refusal of its budget from the loader's error text, which an exit's message, naming
    # the request's max_memory, must never pass for)
    (check,) = [c for c in REGISTRY if c.name == name]  # isolated: the exit is in a child
    got = _verdict_of(check, loader, llmload_checkpoint, tmp_path)
    assert got is not None and (got.kind, got.failure, got.cause) == ("error", None, "contract"), got
    assert said in got.sentence, got


def forks_a_worker(request):
    """A loader that starts a worker process (a tokenizer pool, a download helper) which ends as fork children do."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return reference(request)


def test_a_child_the_loader_forks_may_end_with_os_exit(llmload_checkpoint, tmp_path):
    (check,) = [c for c in REGISTRY if c.name == "check_pad_token_set_offline"]
    assert _verdict_of(check, forks_a_worker, llmload_checkpoint, tmp_path) is None


# --- premises per check: what a check's mechanism needs, and only that ------------------------------------------


def frozen_float16(request):
    """A vision-language project's LLM: float16 whatever is asked, every base weight frozen, whole on the device."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(request.model_path, torch_dtype=torch.float16,
                                                 local_files_only=True)
    model.requires_grad_(False)
    return model


@pytest.mark.parametrize("name", ["check_train_request_trains", "check_zero3_load", "check_distributed_train_step"])
def test_a_frozen_base_is_not_exercised_by_a_train_check_never_an_error(name, llmload_checkpoint, tmp_path):
    (check,) = [c for c in REGISTRY if c.name == name]
    with pytest.raises(pytest.skip.Exception, match="not exercised: .*no trainable parameter"):
        check(frozen_float16, llmload_checkpoint, tmp_path)


# --- verdicts from exceptions alone --------------------------------------------------------------------------------


def test_an_error_row_keeps_every_line_of_its_reason_and_names_a_known_failure_it_is():
    from pytest_llmload.failures import BY_ID
    from pytest_llmload.loader.seam import LoaderError

    error = LoaderError(ImportError("\n  No module named 'flash_attn': pip install flash-attn"), "l", LoadRequest("/x"))
    judged = verdict.of_exception(error, BY_ID["meta-backward"])
    assert judged.sentence.startswith("loader error: ImportError:") and "pip install flash-attn" in judged.sentence
    moved = LoaderError(RuntimeError("You can't move a model that has some modules offloaded to cpu or disk."), "l",
                        LoadRequest("/x"))
    judged = verdict.of_exception(moved, BY_ID["offload-hang"])
    assert (judged.kind, judged.failure, judged.cause) == ("error", None, "loader")
    assert "the same bug as check_offloaded_model_not_moved: move-offloaded" in judged.sentence, judged.sentence
    # raised on a rank: judged there (its row comes back with its answer), and said once
    from pytest_llmload.checks.judgement import judged_in_child
    from pytest_llmload.runners.isolation import ChildOutcome

    outcome = ChildOutcome(0, "rank 0")
    ranks_check = next(c for c in REGISTRY if c.failure.id == "distributed-device-map")
    outcome.status, outcome.row = "raised", judged_in_child(ranks_check, moved)
    ranks_failed = RuntimeError("1 of 2 ranks failed")
    ranks_failed.outcomes = [outcome]
    judged = verdict.of_exception(ranks_failed, BY_ID["distributed-device-map"])
    assert judged.cause == "loader" and judged.sentence.count("the same bug as") == 1, judged.sentence


def test_a_loader_that_closes_stdout_is_an_error_saying_so(llmload_checkpoint, tmp_path):
    (check,) = [c for c in REGISTRY if c.name == "check_pad_token_set_offline"]
    got = _verdict_of(check, closes_stdout, llmload_checkpoint, tmp_path)
    assert (got.kind, got.failure, got.cause) == ("error", None, "contract") and "closed sys.stdout" in got.sentence


def test_verdicts_come_from_the_exception_not_from_the_report_text():
    from pytest_llmload.failures import BY_ID
    from pytest_llmload.loader.seam import LoaderError
    from pytest_llmload.instruments.probes import DeadlineExceeded

    hang, meta = BY_ID["offload-hang"], BY_ID["meta-backward"]
    judged = verdict.of_exception(AssertionError("the offloaded weights got no gradient"), meta)
    assert (judged.kind, judged.failure) == ("failed", "meta-backward")
    error = LoaderError(ValueError("You can't train a model that has been loaded with `device_map='auto'`"), "l",
                        LoadRequest("/tmp/x"))
    assert verdict.of_exception(error, meta)[:3] == ("error", None, "loader")  # a signature in it names nothing
    in_loader = DeadlineExceeded('did not return: deadline of 5 s exceeded\n  File "x/seam.py", line 3, in call_loader')
    assert verdict.of_exception(in_loader, hang)[:2] == ("failed", "offload-hang")
    assert verdict.of_exception(in_loader, meta)[:3] == ("error", None, "hang")
    assert verdict.of_exception(pytest.skip.Exception("not exercised: x"), meta) is None


def test_ranks_that_raise_at_once_are_no_hang():
    from pytest_llmload.plugin.loader_hang import hang_in_loader
    from pytest_llmload.runners.isolation import ChildOutcome
    from pytest_llmload.runners.ranks import DistributedRunFailed

    outcomes = []
    for index in range(2):
        outcome = ChildOutcome(index, f"rank {index}")
        outcome.status, outcome.exception = "raised", RuntimeError("boom")
        outcome.traceback = 'File "pytest_llmload/loader/seam.py", line 1, in call_loader'
        outcomes.append(outcome)
    failed = DistributedRunFailed("2 of 2 ranks failed (gloo, deadline 120 s); first: rank 0 raised RuntimeError\n"
                                  'File "pytest_llmload/loader/seam.py", line 1, in call_loader', outcomes)
    assert hang_in_loader(failed, "check_distributed_train_step") is None


def leaves_meta_and_bf16_behind(request):
    """A model builder that sets torch's defaults for its own construction and never puts them back."""
    import torch

    model = reference(request)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("meta")
    return model


def test_torch_defaults_a_loader_leaves_behind_are_named_as_the_loaders_and_put_back(llmload_checkpoint, tmp_path):
    """Before (issue 36): the check's own code then built its tensors on meta and the row called itself 'a bug in
    pytest-llmload'. Now the check judges, and its row names the loader as the one that changed the defaults."""
    from pytest_llmload.config.stash_keys import collecting_notes

    (check,) = [c for c in REGISTRY if c.name == "check_pad_token_set_offline"]
    with collecting_notes() as notes:
        assert _verdict_of(check, leaves_meta_and_bf16_behind, llmload_checkpoint, tmp_path) is None
    assert any("left torch.set_default_dtype(torch.bfloat16) and torch.set_default_device('meta') behind" in note
               for note in notes), notes
