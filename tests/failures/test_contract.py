"""The contract layer (pytest_llmload.failures.contract) and the verdicts (failures.verdict): every registered check
loads through the contract, a loader that did not honour the request is an error row with the contract sentence,
and a crash in a check's own code is an error that says so, never a known failure."""

import os
import sys

import pytest

from pytest_llmload.failures import REGISTRY, contract, verdict
from pytest_llmload.reference_loader import load_model_and_tokenizer as reference
from pytest_llmload.request import LoadRequest

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


def narrows_after_loading(request):
    """A loader that loads as asked, then casts the model to bfloat16 (under ZeRO-3 too, where a model built on
    meta cannot even be partitioned: that is the loader's own error there)."""
    import torch

    model, tokenizer = reference(request)
    return model.to(torch.bfloat16), tokenizer


BREACHES = {"check_zero3_load": (narrows_after_loading, "the loader returned bfloat16 weights for a float32 request")}


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


def test_a_train_request_may_get_float32_master_weights_never_a_narrower_dtype(llmload_checkpoint):
    fp32 = reference(LoadRequest(llmload_checkpoint))[0]
    contract.verify(fp32, LoadRequest(llmload_checkpoint, purpose="train", dtype="bfloat16"), check="check_x")
    assert _gap(fp32, LoadRequest(llmload_checkpoint, dtype="bfloat16")) == \
        "the loader returned float32 weights for a bfloat16 request"
    bf16 = reference(LoadRequest(llmload_checkpoint, dtype="bfloat16"))[0]
    assert _gap(bf16, LoadRequest(llmload_checkpoint, purpose="train")).startswith(
        "the loader returned bfloat16 weights for a float32 request")


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


@pytest.mark.parametrize(("loader", "said"), [
    (exits, "tried to end its process with os._exit(0)"),
    (exits_politely, "tried to end its process with sys.exit(3)"),
])
def test_a_loader_that_exits_is_an_error_saying_so(loader, said, llmload_checkpoint, tmp_path):
    (check,) = [c for c in REGISTRY if c.name == "check_offload_inference"]  # isolated: the exit is in a child
    got = _verdict_of(check, loader, llmload_checkpoint, tmp_path)
    assert (got.kind, got.failure, got.cause) == ("error", None, "contract") and said in got.sentence, got


def test_a_loader_that_closes_stdout_is_an_error_saying_so(llmload_checkpoint, tmp_path):
    (check,) = [c for c in REGISTRY if c.name == "check_pad_token_set_offline"]
    got = _verdict_of(check, closes_stdout, llmload_checkpoint, tmp_path)
    assert (got.kind, got.failure, got.cause) == ("error", None, "contract") and "closed sys.stdout" in got.sentence


# --- verdicts from exceptions alone --------------------------------------------------------------------------------


def test_verdicts_come_from_the_exception_not_from_the_report_text():
    from pytest_llmload.failures import BY_ID
    from pytest_llmload.loading import LoaderError
    from pytest_llmload.probes import DeadlineExceeded

    hang, meta = BY_ID["offload-hang"], BY_ID["meta-backward"]
    judged = verdict.of_exception(AssertionError("the offloaded weights got no gradient"), meta)
    assert (judged.kind, judged.failure) == ("failed", "meta-backward")
    error = LoaderError(ValueError("You can't train a model that has been loaded with `device_map='auto'`"), "l",
                        LoadRequest("/tmp/x"))
    assert verdict.of_exception(error, meta)[:3] == ("error", None, "loader")  # a signature in it names nothing
    in_loader = DeadlineExceeded('did not return: deadline of 5 s exceeded\n  File "x/loading.py", line 3, in call_loader')
    assert verdict.of_exception(in_loader, hang)[:2] == ("failed", "offload-hang")
    assert verdict.of_exception(in_loader, meta)[:3] == ("error", None, "hang")
    assert verdict.of_exception(pytest.skip.Exception("not exercised: x"), meta) is None


def test_ranks_that_raise_at_once_are_no_hang():
    from pytest_llmload.hung_loader import hang_in_loader
    from pytest_llmload.runners.isolation import ChildOutcome
    from pytest_llmload.runners.ranks import DistributedRunFailed

    outcomes = []
    for index in range(2):
        outcome = ChildOutcome(index, f"rank {index}")
        outcome.status, outcome.exception = "raised", RuntimeError("boom")
        outcome.traceback = 'File "pytest_llmload/loading.py", line 1, in call_loader'
        outcomes.append(outcome)
    failed = DistributedRunFailed("2 of 2 ranks failed (gloo, deadline 120 s); first: rank 0 raised RuntimeError\n"
                                  'File "pytest_llmload/loading.py", line 1, in call_loader', outcomes)
    assert hang_in_loader(failed, "check_distributed_train_step") is None
