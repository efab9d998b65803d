"""fp16-unscale: a float16 load trained under fp16 mixed precision fails in ``GradScaler.unscale_`` with
``ValueError: Attempting to unscale FP16 gradients.`` (huggingface/transformers#23165 and others, see
:mod:`pytest_llmload.failures.fp16_unscale`).

Reproduced on CPU with torch 2.13's ``torch.amp.GradScaler("cpu")``, which raises the reports' text word for
word. Trainer itself cannot be the reproduction here: with ``fp16=True`` on CPU, accelerate 1.15 creates no
scaler and the float16 weights train without one (shown below), so the check runs Trainer's GPU step by hand.
"""

from __future__ import annotations

import pytest

from fixtures import tiny_llama
from fixtures.loaders import before_fp16_unscale
from pytest_llmload import LoadRequest, call_loader
from pytest_llmload import failures as catalog
from pytest_llmload.failures import fp16_unscale
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as reference_loader
from pytest_llmload.fixes.training_scripts import upcast_trainable_parameters

pytestmark = pytest.mark.timeout(120)

UNSCALE = "Attempting to unscale FP16 gradients."
CHECK = fp16_unscale.check_fp16_train_request_keeps_fp32_master_weights


def fp16_train_request(checkpoint, lora: bool) -> LoadRequest:
    return LoadRequest(checkpoint, purpose="train", dtype="float16", lora=lora)


# --- (a) the failure, reproduced with its own error text --------------------------------------------------


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_fp16_step_on_the_before_loaders_model_raises_the_reports_error(llmload_checkpoint, lora):
    import torch

    model = call_loader(before_fp16_unscale.load, fp16_train_request(llmload_checkpoint, lora)).model
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert len(trainable) == (tiny_llama.LORA_WEIGHTS if lora else tiny_llama.PARAMETERS)
    assert {p.dtype for p in trainable} == {torch.float16}
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    scaler = torch.amp.GradScaler("cpu")
    ids = torch.randint(2, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(input_ids=ids, labels=ids).loss
    scaler.scale(loss).backward()  # forward and backward run: the error comes at the optimizer step
    with pytest.raises(ValueError) as excinfo:
        scaler.unscale_(optimizer)
    assert str(excinfo.value) == UNSCALE
    assert excinfo.traceback[-1].name == "_unscale_grads_"  # torch/amp/grad_scaler.py, as in the reports


def test_peft_casts_float16_adapters_to_float32_unless_told_not_to(llmload_checkpoint):
    """Why LoRA meets the failure only with autocast_adapter_dtype=False or model.half() (huggingface/peft#1706)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def lora_dtypes(**kwargs):
        base = AutoModelForCausalLM.from_pretrained(llmload_checkpoint, dtype=torch.float16, local_files_only=True)
        model = get_peft_model(base, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]), **kwargs)
        return model, {p.dtype for p in model.parameters() if p.requires_grad}

    assert lora_dtypes()[1] == {torch.float32}
    assert lora_dtypes(autocast_adapter_dtype=False)[1] == {torch.float16}
    model, _ = lora_dtypes()
    assert {p.dtype for p in model.half().parameters() if p.requires_grad} == {torch.float16}


def test_trainer_fp16_on_cpu_creates_no_scaler_and_trains_float16_weights_silently(llmload_checkpoint, tmp_path):
    """Why the check runs the step by hand: on CPU, Trainer(fp16=True) never reaches GradScaler."""
    import torch
    from transformers import Trainer, TrainingArguments

    model = call_loader(before_fp16_unscale.load, fp16_train_request(llmload_checkpoint, lora=False)).model
    rows = torch.randint(2, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=str(tmp_path), fp16=True, use_cpu=True, max_steps=1,
                             per_device_train_batch_size=2, report_to=[], save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    assert trainer.accelerator.mixed_precision == "fp16" and trainer.accelerator.scaler is None
    trainer.train()  # no error: float16 weights updated in float16, no loss scaling at all
    assert {p.dtype for p in model.parameters()} == {torch.float16}


# --- (b) the check fails on the before-loader, naming the mechanism ------------------------------------------


def test_check_fails_on_the_before_loader_with_the_figures(llmload_checkpoint, tmp_path):
    with pytest.raises(AssertionError) as excinfo:
        CHECK(before_fp16_unscale.load, llmload_checkpoint, tmp_path)
    message = str(excinfo.value)
    assert message.startswith("2 of 2 float16 train requests cannot take an fp16 mixed-precision step")
    n, lora = tiny_llama.PARAMETERS, tiny_llama.LORA_WEIGHTS
    assert "[dtype=float16, lora=False; parameters by dtype {'float16': 39}]" in message
    assert f"{n} of {n} trainable parameters are float16 (" in message
    assert f"{lora} of {lora} trainable parameters are float16 (" in message
    assert f"GradScaler.unscale_ raised ValueError: {UNSCALE} ({n} float16 gradients, on cpu)" in message
    assert f"GradScaler.unscale_ raised ValueError: {UNSCALE} ({lora} float16 gradients, on cpu)" in message
    assert "upcast_trainable_parameters" in message


def halves_after_peft(request):
    """LoRA with peft's default float32 adapters, then model.half(): the adapters are float16 again."""
    model, tokenizer = reference_loader(request)
    return model.half(), tokenizer


def upcasts_only_lora(request):
    """Full fine-tune left in float16: the LoRA path is right (peft's float32 adapters), the other is not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pytest_llmload.loader.transformers_compat import dtype_kwarg

    model = AutoModelForCausalLM.from_pretrained(request.model_path, local_files_only=True,
                                                 **dtype_kwarg(request.torch_dtype))
    if request.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    return model, AutoTokenizer.from_pretrained(request.model_path, local_files_only=True)


@pytest.mark.parametrize(("loader", "expected"), [
    (halves_after_peft, [f"[dtype=float16, lora=True; parameters by dtype {{'float16': {tiny_llama.PARAMETERS + tiny_llama.LORA_WEIGHTS}}}]",
                         f"{tiny_llama.LORA_WEIGHTS} of {tiny_llama.LORA_WEIGHTS} trainable parameters are float16"]),
    (upcasts_only_lora, ["1 of 2 float16 train requests", "[dtype=float16, lora=False;",
                         f"GradScaler.unscale_ raised ValueError: {UNSCALE}"]),
], ids=lambda v: v.__name__ if callable(v) else "")
def test_check_fails_wherever_a_trainable_parameter_is_float16(loader, expected, llmload_checkpoint, tmp_path):
    with pytest.raises(AssertionError) as excinfo:
        CHECK(loader, llmload_checkpoint, tmp_path)
    for text in expected:
        assert text in str(excinfo.value)
    if loader is upcasts_only_lora:
        assert "lora=True" not in str(excinfo.value)  # peft's default float32 adapters pass


# --- (c) the reference loader, and the fix it needs ---------------------------------------------------------


def test_check_passes_on_the_reference_loader(llmload_checkpoint, tmp_path):
    CHECK(reference_loader, llmload_checkpoint, tmp_path)


def test_reference_loaders_lora_path_passes(llmload_checkpoint, tmp_path):
    CHECK(reference_loader, llmload_checkpoint, tmp_path, variants=(True,))


def reference_with_the_fix(request):
    """The reference loader with the wiring it needs: upcast what will be trained."""
    model, tokenizer = reference_loader(request)
    if request.purpose == "train":
        upcast_trainable_parameters(model)
    return model, tokenizer


def test_check_passes_on_the_reference_loader_with_the_fix(llmload_checkpoint, tmp_path):
    CHECK(reference_with_the_fix, llmload_checkpoint, tmp_path)


def test_upcast_keeps_frozen_weights_float16_and_tied_weights_tied(llmload_checkpoint):
    import torch

    model = call_loader(before_fp16_unscale.load, fp16_train_request(llmload_checkpoint, lora=True)).model
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    names = upcast_trainable_parameters(model)
    assert len(names) == tiny_llama.LORA_WEIGHTS and all("lora_" in n for n in names)
    params = dict(model.named_parameters())
    assert {params[n].dtype for n in names} == {torch.float32}
    assert {params[n].dtype for n in frozen} == {torch.float16}
    assert upcast_trainable_parameters(model) == []  # idempotent

    full = call_loader(before_fp16_unscale.load, fp16_train_request(llmload_checkpoint, lora=False)).model
    full.lm_head.weight = full.model.embed_tokens.weight  # tie them, as tie_word_embeddings does
    before = full.lm_head.weight
    upcast_trainable_parameters(full)
    assert full.lm_head.weight is full.model.embed_tokens.weight is before
    assert before.dtype == torch.float32


# --- (d) correct loaders written another way ---------------------------------------------------------------


def loads_float32_and_relies_on_autocast(request):
    """Ignore float16 for training: load float32, let autocast compute in float16 (Trainer's fp16 design)."""
    if request.purpose == "train":
        request = request.replace(dtype="float32")
    return reference_loader(request)


def upcasts_the_whole_model_for_full_fine_tune(request):
    """Full fine-tune: model.float() after loading; LoRA: peft's default float32 adapters over a float16 base."""
    model, tokenizer = reference_loader(request)
    if request.purpose == "train" and not request.lora:
        model = model.float()
    return model, tokenizer


@pytest.mark.parametrize("loader", [loads_float32_and_relies_on_autocast, upcasts_the_whole_model_for_full_fine_tune],
                         ids=lambda f: f.__name__)
def test_check_passes_on_loaders_that_keep_fp32_master_weights_another_way(loader, llmload_checkpoint, tmp_path):
    CHECK(loader, llmload_checkpoint, tmp_path)


# --- (e) the check skips when there is nothing to train ----------------------------------------------------


def returns_a_frozen_model(request):
    model, tokenizer = loads_float32_and_relies_on_autocast(request)
    model.requires_grad_(False)
    return model, tokenizer


def freezes_the_full_fine_tune(request):
    model, tokenizer = loads_float32_and_relies_on_autocast(request)
    if not request.lora:
        model.requires_grad_(False)
    return model, tokenizer


def test_check_skips_when_the_loader_returns_nothing_trainable(llmload_checkpoint, tmp_path):
    with pytest.raises(pytest.skip.Exception) as excinfo:
        CHECK(returns_a_frozen_model, llmload_checkpoint, tmp_path)
    reason = str(excinfo.value)
    assert reason.startswith("not exercised: check_fp16_train_request_keeps_fp32_master_weights: the loader "
                             "returned a model with no trainable parameter")  # --strict counts it (issue 25, 9)
    assert f"dtype=float16, lora=False: none of its {tiny_llama.PARAMETERS} parameters requires grad" in reason
    assert "an fp16 mixed-precision step was not exercised" in reason


def test_check_judges_what_trained_and_notes_an_untrainable_variant(llmload_checkpoint, tmp_path):
    """A frozen base without LoRA is nothing to judge; the LoRA request that trains is judged (issue 35: as the
    train check does). Only when nothing trains does the check skip."""
    from pytest_llmload.config.stash_keys import collecting_notes

    with collecting_notes() as notes:
        CHECK(freezes_the_full_fine_tune, llmload_checkpoint, tmp_path)
    assert notes == ["1 of 2 float16 train requests got a model with no trainable parameter (a frozen base): nothing "
                     "to judge there"], notes
    with pytest.raises(pytest.skip.Exception, match="dtype=float16, lora=False: none of its"):
        fp16_unscale.check_fp16_train_request_keeps_fp32_master_weights(
            freezes_the_full_fine_tune, llmload_checkpoint, tmp_path, variants=(False,))


def test_a_loaders_own_error_propagates_as_it_is(llmload_checkpoint, tmp_path):
    def broken(request):
        raise OSError("no such checkpoint shard")

    with pytest.raises(Exception) as excinfo:
        CHECK(broken, llmload_checkpoint, tmp_path)
    assert not isinstance(excinfo.value, AssertionError)
    assert "no such checkpoint shard" in str(excinfo.value)


# --- (f) the known-failure report names it; signatures do not cross ----------------------------------------


@pytest.fixture
def catalog_with_fp16_unscale():
    """The catalog, which lists this failure (pytest_llmload.failures.MODULES)."""
    assert fp16_unscale.FAILURE in catalog.CATALOG
    return catalog


def test_a_real_unscale_error_is_named_in_the_report(pytester, llmload_checkpoint, request, catalog_with_fp16_unscale):
    pytester.syspathinsert(request.config.rootpath)
    pytester.makepyfile(f"""
        import torch
        from fixtures.loaders import before_fp16_unscale
        from pytest_llmload import LoadRequest

        def test_fp16_mixed_precision_step():
            model, _ = before_fp16_unscale.load(LoadRequest({str(llmload_checkpoint)!r}, purpose="train",
                                                            dtype="float16"))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            scaler = torch.amp.GradScaler("cpu")
            ids = torch.tensor([[2, 3, 4, 5]])
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
    """)
    result = pytester.runpytest()  # in-process: sees the catalog above
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        f"*ValueError: {UNSCALE}",
        "*- llmload: known failure -*",
        "[[]fp16-unscale[]] float16 trainable weights under fp16 mixed precision*",
        "  write-up:   huggingface/transformers#23165, *",
        "  root cause: The model was loaded with torch_dtype=float16*",
        "*llmload: failures matching known failures: fp16-unscale (1)*",
    ])
    for other in catalog.CATALOG:
        if other is not fp16_unscale.FAILURE:
            assert f"[{other.id}]" not in result.stdout.str()


def real_error_texts() -> dict[str, str]:
    """Errors the other catalog entries are about: torch's own where this machine can raise them."""
    import traceback

    import torch

    def text_of(action):
        try:
            action()
        except (NotImplementedError, RuntimeError) as exc:
            return "".join(traceback.format_exception(exc))
        raise AssertionError("no error")

    return {
        "meta-backward": text_of(lambda: torch.empty(2, device="meta").to("cpu")),
        "meta-backward/grad": ("RuntimeError: Function MmBackward0 returned an invalid gradient at index 1 - "
                               "expected device meta but got cpu"),
        "dp-dtype": text_of(lambda: torch.nn.Linear(4, 4).to(torch.bfloat16)(torch.randn(2, 4))),
        "offload-hang": "Failed: Timeout (>3.0s) from pytest-timeout.\n  in from_pretrained",
        "distributed-device-map": ("ValueError: You can't train a model that has been loaded with "
                                   "`device_map='auto'` in any distributed mode."),
    }


def test_signatures_do_not_cross_with_the_other_catalog_entries():
    import traceback

    import torch

    m = torch.nn.Linear(4, 4).half()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(m(torch.randn(2, 4).half()).float().sum()).backward()
    try:
        scaler.unscale_(opt)
    except ValueError as exc:
        ours = "".join(traceback.format_exception(exc))
    assert fp16_unscale.FAILURE.matches(ours)
    others = [f for f in catalog.CATALOG if f.id != fp16_unscale.FAILURE.id]
    assert [f.id for f in others if f.matches(ours)] == []
    for label, text in real_error_texts().items():
        assert not fp16_unscale.FAILURE.matches(text), label


# --- the reports' own setup, on a GPU runner --------------------------------------------------------------


@pytest.mark.needs_gpus(1)
@pytest.mark.timeout(180)
def test_gpu_trainer_fp16_raises_the_reports_error_and_the_check_on_cuda(llmload_checkpoint, tmp_path):
    import torch
    from transformers import Trainer, TrainingArguments

    model = call_loader(before_fp16_unscale.load, fp16_train_request(llmload_checkpoint, lora=True).replace(
        device="cuda:0")).model
    rows = torch.randint(2, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), fp16=True, max_steps=1, max_grad_norm=1.0,
                             per_device_train_batch_size=2, report_to=[], save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows])
    with pytest.raises(ValueError) as excinfo:
        trainer.train()
    assert str(excinfo.value) == UNSCALE
    with pytest.raises(AssertionError, match="on cuda:0"):
        CHECK(before_fp16_unscale.load, llmload_checkpoint, tmp_path / "before", device="cuda:0")
    CHECK(reference_with_the_fix, llmload_checkpoint, tmp_path / "fixed", device="cuda:0")


def test_a_repo_that_trains_only_under_deepspeed_says_so_and_the_check_is_not_exercised(llmload_checkpoint, tmp_path):
    """DeepSpeed's fp16 optimizer keeps its own float32 master weights: no torch GradScaler ever sees a float16
    parameter (OpenRLHF's case in the corpus)."""
    from pytest_llmload.failures import REGISTRY
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

    def under_deepspeed(request):
        return load_model_and_tokenizer(request)

    under_deepspeed.llmload_trains_under_deepspeed = True
    (check,) = [c for c in REGISTRY if c.name == "check_fp16_train_request_keeps_fp32_master_weights"]
    with pytest.raises(pytest.skip.Exception, match=r"not exercised: .*declared to train only under DeepSpeed"):
        check(under_deepspeed, llmload_checkpoint, tmp_path)


# --- (g) judged only where a GradScaler would unscale the gradients (issue 46) -------------------------------


def _registered_check():
    from pytest_llmload.failures import REGISTRY

    (check,) = [c for c in REGISTRY if c.name == "check_fp16_train_request_keeps_fp32_master_weights"]
    return check


def test_a_repo_that_declares_half_precision_without_a_scaler_is_not_exercised(llmload_checkpoint, tmp_path):
    """The issue's false alarm: a float16 full fine-tune whose training turns mixed precision off was FAILED."""
    from pytest_llmload.config.vocabulary import SETTING

    setting = SETTING["trains_fp16_without_scaler"]
    assert (setting.ini, setting.option) == (fp16_unscale.WITHOUT_SCALER, "--llmload-trains-fp16-without-scaler")

    def pure_half(request):
        return before_fp16_unscale.load(request)

    pure_half.llmload_trains_fp16_without_scaler = True
    with pytest.raises(pytest.skip.Exception, match=r"not exercised: .*declared to train half precision without a "
                                                    r"GradScaler \(llmload_trains_fp16_without_scaler\)"):
        _registered_check()(pure_half, llmload_checkpoint, tmp_path)


def test_a_training_args_hook_that_turns_fp16_off_for_half_weights_is_not_exercised(llmload_checkpoint, tmp_path):
    """The loader's own hook (llmload_training_args_hook) is read: fp16=False, bf16=False after it, no scaler."""
    from fixtures.loaders import pure_fp16_trainer

    with pytest.raises(pytest.skip.Exception) as excinfo:
        _registered_check()(pure_fp16_trainer.load, llmload_checkpoint, tmp_path)
    assert ("trains without a GradScaler: the training-args hook fixtures.loaders.pure_fp16_trainer:prepare_args "
            "leaves fp16=False, bf16=False: Trainer makes no GradScaler") in str(excinfo.value)


def keeps_fp16(args, model):
    args.fp16 = True  # the script's TrainingArguments(fp16=True), whatever the weights


@pytest.mark.parametrize(("hook", "environment", "shown_by"), [
    (keeps_fp16, None, "observed: the training-args hook test_fp16_unscale:keeps_fp16 leaves fp16=True, bf16=False: "
                       "Trainer's fp16 mixed precision, through a GradScaler"),
    (None, "fp16", "observed: accelerate's mixed precision is fp16 (ACCELERATE_MIXED_PRECISION=fp16): a GradScaler"),
    (None, None, fp16_unscale.ASSUMED_SCALER),
], ids=["hook-keeps-fp16", "accelerate-fp16", "nothing-said"])
def test_where_a_scaler_unscales_the_before_loader_fails_saying_what_showed_it(hook, environment, shown_by,
                                                                              llmload_checkpoint, tmp_path, monkeypatch):
    from pytest_llmload.config.stash_keys import collecting_notes

    monkeypatch.setattr(fp16_unscale, "LAUNCHED_MIXED_PRECISION", environment or "")
    with collecting_notes() as notes, pytest.raises(AssertionError, match=f"GradScaler.unscale_ raised ValueError: "
                                                                          f"{UNSCALE}"):
        CHECK(before_fp16_unscale.load, llmload_checkpoint, tmp_path, variants=(False,), prepare_args=hook)
    assert notes == [shown_by]
    assert not shown_by.startswith("assumed: ") or shown_by.startswith("assumed: this repo trains the float16 weights")


def test_accelerate_without_fp16_mixed_precision_is_not_exercised(llmload_checkpoint, tmp_path, monkeypatch):
    """Read as the run was launched: transformers' TrainingArguments(bf16=True) writes ACCELERATE_MIXED_PRECISION into
    the process (4.56 does; the Trainer check's own Trainer is one), which must not decide a later row."""
    assert fp16_unscale.LAUNCHED_MIXED_PRECISION == ""  # this suite is not launched by accelerate
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # a Trainer built earlier in this process
    with pytest.raises(AssertionError, match=UNSCALE):
        CHECK(before_fp16_unscale.load, llmload_checkpoint, tmp_path / "left", variants=(False,))
    monkeypatch.setattr(fp16_unscale, "LAUNCHED_MIXED_PRECISION", "bf16")  # as `accelerate launch` sets it
    with pytest.raises(pytest.skip.Exception, match=r"accelerate's mixed precision is bf16 "
                                                    r"\(ACCELERATE_MIXED_PRECISION=bf16\): no GradScaler"):
        CHECK(before_fp16_unscale.load, llmload_checkpoint, tmp_path, variants=(False,))


def test_a_passing_loader_rests_on_no_assumption(llmload_checkpoint, tmp_path, monkeypatch):
    """Float32 trainable weights pass with or without a scaler: the row notes no assumption."""
    from pytest_llmload.config.stash_keys import collecting_notes

    monkeypatch.setattr(fp16_unscale, "LAUNCHED_MIXED_PRECISION", "")
    with collecting_notes() as notes:
        CHECK(reference_with_the_fix, llmload_checkpoint, tmp_path, variants=(False,))
    assert notes == []


def adds_an_unused_float16_weight(request):
    """A float16 trainable parameter no forward uses (a head kept for later): the scaler never sees a gradient of
    it, so nothing refuses; the rule "no float16 trainable weight" is not the failure."""
    import torch

    model, tokenizer = reference_with_the_fix(request)
    if request.purpose == "train":
        model.register_parameter("spare_head", torch.nn.Parameter(torch.zeros(4, dtype=torch.float16)))
    return model, tokenizer


def test_a_float16_weight_the_scaler_never_sees_is_not_the_failure(llmload_checkpoint, tmp_path):
    CHECK(adds_an_unused_float16_weight, llmload_checkpoint, tmp_path, variants=(False,))
