"""quantized-cast: a loader that loads in 4-bit/8-bit and then casts the model (``model.half()``,
``model.to(dtype)``) gets transformers' refusal. Reproduced on CPU with bitsandbytes' CPU backend (4-bit nf4 and
8-bit), then the check of :mod:`pytest_llmload.failures.quantized_cast` shown to fail on the "before" loader (and
on one that swallows the error), to pass on the reference loader and on loaders that avoid the cast in other
ways, and to skip on a loader that ignores the quantization request.

transformers 4.46 refuses 4-bit on CPU (it wants intel_extension_for_pytorch): the tests that load skip there
with transformers' own refusal in the reason.
"""

from __future__ import annotations

import importlib.util
import logging
import re

import pytest

from fixtures.loaders import before_quantized_cast, downstream_fixed
from pytest_llmload import LoadRequest, failures
from pytest_llmload.failures import quantized_cast
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as reference_loader
from pytest_llmload.loader.transformers_compat import dtype_kwarg

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                       reason="quantized-cast loads in 4-bit/8-bit: needs bitsandbytes"),
]

# transformers' refusals, as 5.23 words them (4.5x names `torch_dtype` at the end of the first one).
CANNOT_CAST = ("You cannot cast a bitsandbytes model in a new `dtype`. Make sure to load the model using "
               "`from_pretrained` using the desired `dtype` by passing the correct")
HALF_REFUSED = ("`.half()` is not supported for quantized model. Please use the model as it is, since the model has "
                "already been casted to the correct `dtype`.")
NON_QUANTIZED = 11  # the tiny Llama's weights outside its 28 linear layers: embeddings, 9 norms, the head
QUANTIZED = 28  # 4 layers x 7 projections; the head is left unquantized by transformers


def _require_quantization_here(quantization: str = "4bit") -> None:
    from pytest_llmload.failures.dp_dtype import four_bit_refusal

    refusal = four_bit_refusal()
    if refusal is not None:
        pytest.skip(f"quantized-cast loads in {quantization}: {refusal}")
    if quantization == "8bit":
        why = quantized_cast.eight_bit_refusal("cpu")
        if why is not None:
            pytest.skip(f"quantized-cast loads in 8-bit: {why}")


def _dtype_without_dtype_kwarg(quantization: str) -> str:
    """The dtype the installed transformers gives a bitsandbytes model's non-quantized weights when
    ``from_pretrained`` gets no dtype: probed from its bitsandbytes quantizer. transformers 4.x forces float16
    there (``update_dtype``, ``update_torch_dtype`` before 4.56: "Overriding dtype=None with `dtype=torch.float16`
    due to requirements of `bitsandbytes`"); 5.x leaves it alone, so the weights keep the checkpoint's float32."""
    from transformers import BitsAndBytesConfig
    from transformers.quantizers.auto import AutoHfQuantizer

    config = BitsAndBytesConfig(load_in_4bit=True) if quantization == "4bit" else BitsAndBytesConfig(load_in_8bit=True)
    quantizer = AutoHfQuantizer.from_config(config)
    update = getattr(quantizer, "update_dtype", None) or quantizer.update_torch_dtype
    forced = update(None)
    return "float32" if forced is None else str(forced).removeprefix("torch.")


def _quantized_model(checkpoint, quantization: str):
    """The report's load: quantization_config and no dtype, whole on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
              if quantization == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
    return AutoModelForCausalLM.from_pretrained(checkpoint, quantization_config=config, device_map={"": "cpu"},
                                                local_files_only=True)


# --- (a) the failure itself --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quantization", "cast", "expected"),
    [
        ("4bit", "half", HALF_REFUSED),
        ("4bit", "to_float16", CANNOT_CAST),
        ("4bit", "to_dtype_bfloat16", CANNOT_CAST),
        ("8bit", "half", HALF_REFUSED),
        ("8bit", "to_float16", CANNOT_CAST),
    ],
)
def test_casting_a_quantized_model_raises_transformers_refusal(llmload_checkpoint, quantization, cast, expected):
    import torch

    _require_quantization_here(quantization)
    model = _quantized_model(llmload_checkpoint, quantization)
    loaded_in = _dtype_without_dtype_kwarg(quantization)  # float32 (the checkpoint's) on 5.x, float16 on 4.x
    assert {str(p.dtype) for p in model.parameters() if p.is_floating_point()} == {f"torch.{loaded_in}"}
    do = {"half": lambda: model.half(), "to_float16": lambda: model.to(torch.float16),
          "to_dtype_bfloat16": lambda: model.to(dtype=torch.bfloat16)}[cast]
    with pytest.raises(ValueError) as excinfo:
        do()
    assert str(excinfo.value).startswith(expected), str(excinfo.value)
    assert quantized_cast.FAILURE.matches(str(excinfo.value))
    # The model is untouched: still quantized, its other weights still in the dtype it was loaded in.
    quantized, _ = quantized_cast.quantized_layers(model, quantization)
    assert len(quantized) == QUANTIZED
    assert {str(p.dtype) for p in model.parameters() if p.is_floating_point()} == {f"torch.{loaded_in}"}


def test_the_before_loader_raises_it_from_its_own_cast(llmload_checkpoint):
    _require_quantization_here()
    request = LoadRequest(llmload_checkpoint, dtype="float16", quantization="4bit")
    with pytest.raises(ValueError, match=re.escape(HALF_REFUSED)) as excinfo:
        before_quantized_cast.load(request)
    assert excinfo.traceback[-2].frame.code.name == "load"  # the loader's line called model.half()


# --- (b) the check fails on the before-loader, naming the cast -----------------------------------------------


def test_check_fails_on_the_before_loader(llmload_checkpoint, tmp_path):
    _require_quantization_here()
    with pytest.raises(AssertionError) as excinfo:
        quantized_cast.check_quantized_request_keeps_dtype(before_quantized_cast.load, llmload_checkpoint, tmp_path)
    message = str(excinfo.value)
    print(message)
    expected_requests = 3 if quantized_cast.eight_bit_refusal("cpu") is None else 2
    assert message.startswith(f"{expected_requests} of {expected_requests} quantized requests failed (quantized-cast")
    half = "the loader cast the {} model after loading: `model = model.half()  # cast all params to float16 for inference` (before_quantized_cast.py:"
    assert f"[4bit, float16] {half.format('4bit')}" in message
    assert f"raised ValueError: {HALF_REFUSED}" in message
    assert ("[4bit, bfloat16] the loader cast the 4bit model after loading: `model = model.to(dtype=request.torch_dtype)` "
            "(before_quantized_cast.py:") in message
    assert f"raised ValueError: {CANNOT_CAST}" in message
    if expected_requests == 3:
        assert f"[8bit, float16] {half.format('8bit')}" in message


def swallows_the_cast_error(request):
    """axolotl-ai-cloud/axolotl#2511's workaround: try the cast, log the ValueError, go on with the model as it is."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
              if request.quantization == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
    model = AutoModelForCausalLM.from_pretrained(request.model_path, quantization_config=config,
                                                 device_map={"": request.device}, local_files_only=True)
    try:
        model.to(dtype=request.torch_dtype)
    except ValueError as error:
        logging.getLogger(__name__).warning("Failed to convert model to dtype %s: %s", request.dtype, error)
    return model


def test_check_fails_when_the_cast_error_is_swallowed(llmload_checkpoint, tmp_path):
    _require_quantization_here()
    with pytest.raises(AssertionError) as excinfo:
        quantized_cast.check_quantized_request_keeps_dtype(swallows_the_cast_error, llmload_checkpoint, tmp_path,
                                                           variants=(("4bit", "float16"), ("4bit", "bfloat16")))
    message = str(excinfo.value)
    print(message)
    # The mechanism is seen where it happens: the spy on the model's casts records transformers' refusal even
    # though the loader caught it (whatever dtype the other weights kept).
    assert message.startswith("2 of 2 quantized requests failed")
    for dtype in ("float16", "bfloat16"):
        assert f"[4bit, {dtype}] the loader cast the 4bit model after loading and swallowed transformers' refusal: " \
            in message


# --- (c) the reference loader passes ------------------------------------------------------------------------


def test_check_passes_on_the_reference_loader(llmload_checkpoint, tmp_path, caplog):
    _require_quantization_here()
    caplog.set_level(logging.INFO, logger="pytest_llmload")
    quantized_cast.check_quantized_request_keeps_dtype(reference_loader, llmload_checkpoint, tmp_path)
    assert not [r for r in caplog.records if "not exercised" in r.getMessage() or "accepted" in r.getMessage()]


# --- (d) other ways to avoid the cast pass ------------------------------------------------------------------


def torch_dtype_keyword(request):
    """The dtype given to from_pretrained with the pre-4.56 keyword, ``torch_dtype=``, and 4-bit computing in it."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_compute_dtype=request.dtype)
              if request.quantization == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
    return AutoModelForCausalLM.from_pretrained(request.model_path, quantization_config=config,
                                                torch_dtype=request.torch_dtype, device_map={"": request.device},
                                                local_files_only=True)


def casts_only_the_unquantized_parameters(request):
    """No model-level cast: the floating-point parameters are cast one by one after loading, the packed
    4-bit/8-bit ones left alone (bitsandbytes-foundation/bitsandbytes#650's loop, to the requested dtype)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
              if request.quantization == "4bit" else BitsAndBytesConfig(load_in_8bit=True))
    model = AutoModelForCausalLM.from_pretrained(request.model_path, quantization_config=config,
                                                 device_map={"": request.device}, local_files_only=True)
    for param in model.parameters():
        if param.is_floating_point():
            param.data = param.data.to(request.torch_dtype)
    return model


@pytest.mark.parametrize("loader", [torch_dtype_keyword, casts_only_the_unquantized_parameters],
                         ids=lambda f: f.__name__)
def test_check_passes_on_loaders_that_do_not_cast_the_model(loader, llmload_checkpoint, tmp_path):
    _require_quantization_here()
    quantized_cast.check_quantized_request_keeps_dtype(loader, llmload_checkpoint, tmp_path)


def compute_dtype_only(request):
    """4-bit with the dtype given only as ``bnb_4bit_compute_dtype``: on transformers 5 the other weights stay in
    the checkpoint's float32, the 4-bit matmuls run in the requested dtype."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=request.torch_dtype)
    return AutoModelForCausalLM.from_pretrained(request.model_path, quantization_config=config,
                                                device_map={"": request.device}, local_files_only=True)


def test_check_accepts_a_4bit_compute_dtype_as_the_requested_dtype(llmload_checkpoint, tmp_path, caplog):
    _require_quantization_here()
    caplog.set_level(logging.INFO, logger="pytest_llmload")
    quantized_cast.check_quantized_request_keeps_dtype(compute_dtype_only, llmload_checkpoint, tmp_path,
                                                       variants=(("4bit", "float16"), ("4bit", "bfloat16")))
    accepted = [r.getMessage() for r in caplog.records if "accepted" in r.getMessage()]
    # Which dtype the other weights get without dtype= is the installed transformers' default: float32 from the
    # checkpoint on 5.x (both requests accepted on the compute dtype), float16 forced by the bitsandbytes quantizer
    # on 4.x (the float16 request needs no acceptance, so bfloat16 only).
    loaded_in = _dtype_without_dtype_kwarg("4bit")
    expected = len([dtype for dtype in ("float16", "bfloat16") if dtype != loaded_in])
    assert len(accepted) == expected and all("every Linear4bit computes in" in line for line in accepted), accepted


def test_check_passes_on_the_downstream_loader_and_says_8bit_was_not_exercised(llmload_checkpoint, tmp_path, caplog):
    _require_quantization_here("8bit")
    caplog.set_level(logging.INFO, logger="pytest_llmload")
    quantized_cast.check_quantized_request_keeps_dtype(downstream_fixed.load, llmload_checkpoint, tmp_path)
    (line,) = [r.getMessage() for r in caplog.records if "not exercised" in r.getMessage()]
    assert line.endswith("[8bit, float16] returned no bitsandbytes Linear8bitLt layer "
                         f"({QUANTIZED + 1} plain torch.nn.Linear): it ignored the 8bit request"), line


# --- (e) the check skips when the loader does not load quantized --------------------------------------------


def ignores_quantization(request):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(request.model_path, device_map={"": request.device},
                                                local_files_only=True, **dtype_kwarg(request.torch_dtype))


def test_check_skips_when_the_loader_ignores_the_quantization_request(llmload_checkpoint, tmp_path):
    _require_quantization_here()
    with pytest.raises(pytest.skip.Exception) as excinfo:
        quantized_cast.check_quantized_request_keeps_dtype(ignores_quantization, llmload_checkpoint, tmp_path)
    reason = str(excinfo.value)
    assert reason.startswith("not exercised: check_quantized_request_keeps_dtype: the loader [4bit, float16] ")
    assert (f"[4bit, float16] returned no bitsandbytes Linear4bit layer ({QUANTIZED + 1} plain "
            "torch.nn.Linear): it ignored the 4bit request") in reason


def test_an_unrelated_loader_error_propagates_as_itself(llmload_checkpoint, tmp_path):
    from pytest_llmload.loader.seam import LoaderError

    def broken(request):
        raise ValueError("no such model type")

    _require_quantization_here()
    with pytest.raises(LoaderError, match="no such model type"):
        quantized_cast.check_quantized_request_keeps_dtype(broken, llmload_checkpoint, tmp_path)


def test_registered_check_runs_isolated_and_fails_on_the_before_loader(llmload_checkpoint, tmp_path):
    _require_quantization_here()
    (check,) = quantized_cast.CHECKS
    assert check.isolated and check.failure is quantized_cast.FAILURE and check.needs_gpus == 0
    with pytest.raises(AssertionError) as excinfo:  # the child's AssertionError, re-raised in the test process
        check(before_quantized_cast.load, llmload_checkpoint, tmp_path)
    assert "quantized requests failed (quantized-cast" in str(excinfo.value)
    assert "model = model.half()" in str(excinfo.value)


# --- (f) the known-failure report names it, and its signatures are its own ----------------------------------


@pytest.fixture
def bnb_before_pytester_snapshot(request):
    """bitsandbytes registers torch ops when imported: import it (and transformers' modules for it) before pytester
    snapshots sys.modules, so the in-process run does not import it a second time."""
    for name in ("bitsandbytes", "transformers.integrations.bitsandbytes", "transformers.quantizers.auto"):
        importlib.import_module(name)
    return request.getfixturevalue("pytester")


def test_known_failure_section_names_quantized_cast(bnb_before_pytester_snapshot, llmload_checkpoint, request,
                                                    monkeypatch):
    _require_quantization_here()
    pytester = bnb_before_pytester_snapshot
    assert failures.BY_ID["quantized-cast"] is quantized_cast.FAILURE
    pytester.syspathinsert(request.config.rootpath)
    pytester.makepyfile(f"""
        from fixtures.loaders import before_quantized_cast
        from pytest_llmload import LoadRequest

        def test_load_4bit_in_float16():
            before_quantized_cast.load(LoadRequest({str(llmload_checkpoint)!r}, dtype="float16", quantization="4bit"))
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "E * ValueError: `.half()` is not supported for quantized model.*",
        "*- llmload: known failure -*",
        "[[]quantized-cast[]] a bitsandbytes-quantized model cast to another dtype after loading",
        "  write-up:   hiyouga/LlamaFactory#5, deepspeedai/DeepSpeed#3719, *",
        "*llmload: failures matching known failures: quantized-cast (1)*",
    ])


# The other catalog entries' errors, as their own tests produce them.
OTHER_ERRORS = {
    "meta-backward": "Function MmBackward0 returned an invalid gradient at index 1 - expected device meta but got cpu",
    "dp-dtype": "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16",
    "distributed-device-map": ("ValueError: You can't train a model that has been loaded with `device_map='auto'` in "
                               "any distributed mode. Please rerun your script specifying `--num_processes=1`"),
}
# This failure's errors across transformers versions (5.23 here; the older ones from the reports).
OWN_ERRORS = (
    CANNOT_CAST + " `dtype` argument.",
    CANNOT_CAST + " `torch_dtype` argument.",
    HALF_REFUSED,
    ("`.float()` is not supported for quantized model. Please use the model as it is, since the model has already "
     "been casted to the correct `dtype`."),
    # hiyouga/LlamaFactory#5, deepspeedai/DeepSpeed#3719
    ("ValueError: `.half()` is not supported for `4-bit` or `8-bit` models. Please use the model as it is, since the "
     "model has already been casted to the correct `dtype`."),
    # OpenRLHF/OpenRLHF#403
    ("ValueError: `.to` is not supported for `4-bit` or `8-bit` bitsandbytes models. Please use the model as it is, "
     "since the model has already been set to the correct devices and casted to the correct `dtype`."),
    ("Calling `cuda()` is not supported for `8-bit` quantized models.  Please use the model as it is, since the model "
     "has already been set to the correct devices."),
    # the check's own report where the loader swallowed the refusal
    ("AssertionError: 2 of 2 quantized requests failed (quantized-cast: a bitsandbytes model cannot be cast after "
     "loading; ...)"),
)


@pytest.mark.parametrize("text", OWN_ERRORS)
def test_own_errors_match_only_quantized_cast(text):
    others = [f.id for f in failures.CATALOG if f.id != "quantized-cast" and f.matches(text)]
    assert quantized_cast.FAILURE.matches(text) and others == [], others


@pytest.mark.parametrize("failure_id", sorted(OTHER_ERRORS))
def test_other_failures_errors_do_not_match_quantized_cast(failure_id):
    assert failures.BY_ID[failure_id].matches(OTHER_ERRORS[failure_id])
    assert not quantized_cast.FAILURE.matches(OTHER_ERRORS[failure_id])


def test_docstring_first_line_says_what_it_guards():
    summary = quantized_cast.check_quantized_request_keeps_dtype.__doc__.strip().splitlines()[0]
    assert summary.startswith("Guards quantized-cast: ") and len(summary) < 160


# --- (g) a refusal is known by what raised it, in every wording of the stacks --------------------------------


def _refusal_texts_of_the_installed_transformers() -> list[str]:
    """Every text a cast method of the installed ``PreTrainedModel`` (``to``, ``half``, ``float``, ``cuda``) raises
    as a ``ValueError``, read from transformers' own source (an f-string's fields as ``{}``)."""
    import ast
    import inspect
    import textwrap

    from transformers import PreTrainedModel

    texts = []
    for name in ("to", "half", "float", "cuda"):
        # (from the code object: `to` is wrapped with torch's Module.to, whose source getsource would follow)
        source = textwrap.dedent(inspect.getsource(vars(PreTrainedModel)[name].__code__))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args \
                    and getattr(node.exc.func, "id", None) == "ValueError":
                message = node.exc.args[0]
                parts = message.values if isinstance(message, ast.JoinedStr) else [message]
                texts.append("".join(p.value if isinstance(p, ast.Constant) else "{}" for p in parts))
    return texts


def _transformers_major() -> int:
    from importlib import metadata

    return int(metadata.version("transformers").split(".")[0])


def test_every_refusal_the_installed_transformers_words_is_matched_by_the_signatures():
    """Run on each stack: 5.23's 7 texts (no 8-bit `.to` refusal with bitsandbytes >= 0.48) and 4.56's 8 (its
    "`.to` is not supported for `8-bit` bitsandbytes models", and the 4-bit `.to()`/`.cuda()` refusals of
    bitsandbytes < 0.43.2)."""
    texts = _refusal_texts_of_the_installed_transformers()
    assert len(texts) >= 6, texts
    unmatched = [text for text in texts if not quantized_cast.FAILURE.matches(text)]
    assert unmatched == []
    others = {text: [f.id for f in failures.CATALOG if f.id != "quantized-cast" and f.matches(text)] for text in texts}
    assert not any(others.values()), others


def moves_8bit_with_to(request):
    """OpenRLHF/OpenRLHF#403's order: load 8-bit on the device, then ``model.to(device)`` as for any model."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    config = (BitsAndBytesConfig(load_in_8bit=True) if request.quantization == "8bit"
              else BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=request.torch_dtype))
    model = AutoModelForCausalLM.from_pretrained(request.model_path, quantization_config=config,
                                                 device_map={"": request.device}, local_files_only=True,
                                                 **dtype_kwarg(request.torch_dtype))
    return model.to(request.device)


@pytest.mark.skipif(_transformers_major() >= 5, reason="transformers 5 moves an 8-bit model with .to() (it refuses "
                    "only with bitsandbytes < 0.48): the 4.56 wording is raised on the hf-4.56 stack")
def test_the_8bit_to_refusal_of_transformers_4_56_is_the_cast_not_a_loader_error(llmload_checkpoint, tmp_path):
    _require_quantization_here("8bit")
    with pytest.raises(ValueError, match=r"^`\.to` is not supported for `8-bit` bitsandbytes models") as excinfo:
        moves_8bit_with_to(LoadRequest(llmload_checkpoint, dtype="float16", quantization="8bit"))
    assert quantized_cast.is_cast_refusal(excinfo.value) and quantized_cast.FAILURE.matches(str(excinfo.value))
    with pytest.raises(AssertionError) as failed:
        quantized_cast.check_quantized_request_keeps_dtype(moves_8bit_with_to, llmload_checkpoint, tmp_path,
                                                           variants=(("8bit", "float16"),))
    assert str(failed.value).startswith("1 of 1 quantized requests failed (quantized-cast")
    assert ("[8bit, float16] the loader cast the 8bit model after loading: `return model.to(request.device)` "
            "(test_quantized_cast.py:") in str(failed.value)
    assert "raised ValueError: `.to` is not supported for `8-bit` bitsandbytes models" in str(failed.value)


@pytest.mark.skipif(_transformers_major() < 5, reason="transformers 4.x refuses any .to() of an 8-bit model: "
                    "test_the_8bit_to_refusal_of_transformers_4_56_is_the_cast_not_a_loader_error covers it there")
def test_the_8bit_move_refusal_of_transformers_5_is_known_by_its_frame(llmload_checkpoint, tmp_path, monkeypatch):
    """5.x refuses ``.to()`` of an 8-bit model only with bitsandbytes < 0.48 (0.50 here: the check passes the loader
    that moves it); with the version check answering "older", transformers' own ``to`` raises its own words."""
    import transformers.modeling_utils as modeling_utils

    _require_quantization_here("8bit")
    quantized_cast.check_quantized_request_keeps_dtype(moves_8bit_with_to, llmload_checkpoint, tmp_path,
                                                       variants=(("8bit", "float16"),))
    model = _quantized_model(llmload_checkpoint, "8bit")
    monkeypatch.setattr(modeling_utils, "is_bitsandbytes_available", lambda *minimum: not minimum)
    with pytest.raises(ValueError, match=r"if you want to move a 8-bit model across devices using to\(\)") as excinfo:
        model.to("cpu")
    assert quantized_cast.is_cast_refusal(excinfo.value) and quantized_cast.FAILURE.matches(str(excinfo.value))


def test_a_loaders_own_error_in_transformers_words_is_not_the_cast(llmload_checkpoint, tmp_path):
    """Known by what raised it: the loader's own ``ValueError`` with the refusal's text is the loader's error."""
    from pytest_llmload.loader.seam import LoaderError

    def says_it_refuses(request):
        raise ValueError(HALF_REFUSED)

    _require_quantization_here()
    with pytest.raises(ValueError) as excinfo:
        says_it_refuses(None)
    assert quantized_cast.FAILURE.matches(str(excinfo.value)) and not quantized_cast.is_cast_refusal(excinfo.value)
    with pytest.raises(LoaderError, match=re.escape(HALF_REFUSED)):
        quantized_cast.check_quantized_request_keeps_dtype(says_it_refuses, llmload_checkpoint, tmp_path,
                                                           variants=(("4bit", "float16"),))
