"""quantized-cast: casting a bitsandbytes-quantized model to a dtype after ``from_pretrained`` loaded it.

A loader asks for a 4-bit or 8-bit model and then casts it the way it casts a full-precision one:
``model = model.half()`` "for inference" (hiyouga/LlamaFactory#5, on an 8-bit model; ``self.module.half()`` in
DeepSpeed's engine, deepspeedai/DeepSpeed#3719; InternLM/xtuner#342), ``model.to(dtype=cfg.torch_dtype)`` after a
merge (axolotl-ai-cloud/axolotl#2511), ``text_encoder.to(device=..., dtype=...)`` (huggingface/diffusers#11570), or
``.to(device)`` in transformers versions that refused any ``.to`` on a quantized model
(OpenRLHF/OpenRLHF#403, DeepSpeed's ``self.module.to(self.device)``). transformers refuses (it added the guard in
huggingface/transformers#20409): ``ValueError: You cannot cast a bitsandbytes model in a new `dtype`. Make sure to
load the model using `from_pretrained` using the desired `dtype` ...`` or ``ValueError: `.half()` is not
supported for quantized model ...`` (``for `4-bit` or `8-bit` models`` in the older reports); transformers 4.56
refuses any ``.to`` of an 8-bit model (``ValueError: `.to` is not supported for `8-bit` bitsandbytes models``).
Each is known here by the frame that raised it (:func:`refusing_frame`), not by its words.

The fix: give the dtype to ``from_pretrained`` (``dtype=``, ``torch_dtype=`` before transformers 4.56) and, for
4-bit, ``bnb_4bit_compute_dtype`` in the ``BitsAndBytesConfig``; never cast the loaded model. Swallowing the
error (axolotl#2511 logs it and goes on) leaves the non-quantized weights in the checkpoint's dtype.

The check asks for a 4-bit model in float16 and in bfloat16 and an 8-bit one in float16 (8-bit only where
bitsandbytes runs it on the device) and wants a model whose linear layers really are bitsandbytes ones, whose
other weights have the requested dtype (for 4-bit, a compute dtype of the requested dtype also does), and that
runs a forward. It runs on CPU with bitsandbytes' CPU backend (bitsandbytes >= 0.47 with a transformers that
accepts it; 4.46 refuses 4-bit on CPU, and the check skips there)::

    from pytest_llmload.failures import quantized_cast

    @pytest.mark.timeout(120)
    def test_my_loader_loads_quantized_in_the_requested_dtype(llmload_checkpoint, tmp_path):
        quantized_cast.check_quantized_request_keeps_dtype(my_loader, llmload_checkpoint, tmp_path)
"""

from __future__ import annotations

import contextlib
import functools
import logging
from unittest import mock
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_llmload.checks.base import Check, KnownFailure, not_exercised
from pytest_llmload.checks import contract
from pytest_llmload.loader.seam import LoaderError, LoaderModelError
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.system import tracebacks

logger = logging.getLogger(__name__)

Loader = Callable[[LoadRequest], Any]

# The texts of transformers' refusals to cast (or, in some transformers/bitsandbytes pairs, to move) a quantized
# model, every wording of the stacks in the version matrix and of the reports: what a report's text is matched by
# (a child's output, a pasted log). In the check's own process a refusal is known by what raised it
# (:func:`refusing_frame`), whatever its words.
CAST_REFUSALS = (
    r"You cannot cast a (?:bitsandbytes|GPTQ) model in a new `?dtype`?",
    r"Casting a Quark quantized model to a new `?dtype`? is not supported",
    r"`?\.(?:half|float)\(\)`? is not supported for (?:quantized model|`?4-bit`? or `?8-bit`? models)",
    # "4-bit or 8-bit" before transformers 4.3x; "`8-bit` bitsandbytes models" in 4.56
    r"`?\.to`? is not supported for `?(?:4-bit`? or `?)?8-bit`? (?:bitsandbytes )?models",
    r"Calling `?(?:cuda|to)\(\)`? is not supported for `?[48]-bit`? quantized models",
    r"if you want to move a 8-bit model across devices using `?to\(\)`?",  # 5.x with bitsandbytes < 0.48
)

FAILURE = KnownFailure(
    id="quantized-cast",
    order=8,
    title="a bitsandbytes-quantized model cast to another dtype after loading",
    write_up=("hiyouga/LlamaFactory#5, deepspeedai/DeepSpeed#3719, InternLM/xtuner#342, axolotl-ai-cloud/axolotl#2511, "
              "huggingface/diffusers#11570, OpenRLHF/OpenRLHF#403"),
    # The last: this check's own report, which names no error where the loader swallowed the refusal.
    signatures=CAST_REFUSALS + (r"quantized requests failed \(quantized-cast",),
    root_cause=(
        "The loader asked from_pretrained for a bitsandbytes 4-bit/8-bit model and then cast it (.half(), "
        ".to(dtype), .float(); .to(device)/.cuda() in older transformers) as it would a full-precision model. "
        "transformers refuses any dtype cast of a quantized model: its packed weights cannot be cast, and the "
        "dtype of the other weights and of the 4-bit compute is fixed when the model is built."
    ),
    fix=(
        "Pass the dtype to from_pretrained (dtype=, torch_dtype= before transformers 4.56) together with "
        "quantization_config, and bnb_4bit_compute_dtype=<dtype> for 4-bit; never cast the loaded model "
        "(drop the .half()/.to(dtype)); move it with device_map={'': device}, not .to()/.cuda()."
    ),
    occurs=("any device, any transformers since the guard (huggingface/transformers#20409, 2022); reported on GPUs "
            "(8-bit and 4-bit); reproduced on CPU with transformers 5.23 and bitsandbytes 0.50 (4-bit and 8-bit) and "
            "with transformers 4.56 and bitsandbytes 0.47 (same texts, and a refusal of any .to() of an 8-bit model; 4.x "
            "loads the other weights in float16 without dtype=, so a swallowed cast leaves a float16 request right "
            "and a bfloat16 one float16)."),
)

# (quantization, dtype): the requests the check makes. 8-bit in bfloat16 is left out: bitsandbytes' int8 matmul
# casts bfloat16 inputs to float16 (and warns once a layer), so float16 is the dtype 8-bit models are run in.
VARIANTS = (("4bit", "float16"), ("4bit", "bfloat16"), ("8bit", "float16"))

_CASTS = ("to", "half", "float", "cuda", "bfloat16", "type")


def refusing_frame(exc: BaseException) -> int | None:
    """The index in ``tracebacks.frames(exc)`` of the ``PreTrainedModel`` cast method (``to``, ``half``, ``float``,
    ``cuda``, ...) of transformers' ``modeling_utils`` that refused, where ``exc`` is such a refusal: a
    ``ValueError`` raised in that method, or in transformers code it called (a quantizer's), whatever its wording
    (4.56 words the 8-bit ``.to`` refusal unlike 5.x). ``None`` for anything else, a ``ValueError`` of the loader's
    own code included."""
    if not isinstance(exc, ValueError):
        return None
    frames = tracebacks.frames(exc)
    for index in range(len(frames) - 1, -1, -1):  # from where it was raised, outwards
        frame = frames[index]
        if not tracebacks.is_library(frame.module, ("transformers",)):
            return None  # raised in (or passed through) code that is not transformers'
        if frame.name in _CASTS and frame.module == "transformers.modeling_utils":
            return index
    return None


def is_cast_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is transformers' refusal to cast (or, in some versions, move) a quantized model, known by the
    frame that raised it (:func:`refusing_frame`)."""
    return refusing_frame(exc) is not None


def _cast_call_site(exc: BaseException) -> str:
    """The call that cast the quantized model, and where: the frame that called transformers' ``to``/``half``/...

    The loader's own line (```model = model.half()` (before_quantized_cast.py:44, in load)``), or a library's
    where one casts the model for the script (DeepSpeed's engine: ``self.module.half()``)."""
    frames = tracebacks.frames(exc)
    index = refusing_frame(exc)
    below = [f for f in frames[:index or 0] if f.filename != __file__]  # not our spy
    caller = below[-1] if below else (frames[-1] if frames else None)
    if caller is None:
        return "(unknown)"
    line = f"`{caller.line}` " if below else ""
    return f"{line}({Path(caller.filename).name}:{caller.lineno}, in {caller.name})"


def _inside_from_pretrained(exc: BaseException) -> bool:
    """Whether the refusal was raised under ``from_pretrained`` (the library moving the model), not after it."""
    return any(frame.name == "from_pretrained" and tracebacks.is_library(frame.module, ("transformers",))
               for frame in tracebacks.frames(exc))


def eight_bit_refusal(device: str = "cpu") -> str | None:
    """Why bitsandbytes cannot run an 8-bit linear layer on ``device``, or ``None`` where it can.

    A 8x8 ``bnb.nn.Linear8bitLt`` is quantized by moving it to ``device`` and run once in float16; bitsandbytes
    0.50 does both on CPU."""
    import torch

    try:
        import bitsandbytes as bnb

        layer = bnb.nn.Linear8bitLt(8, 8, bias=False, has_fp16_weights=False).to(device)
        if layer.weight.dtype != torch.int8:
            return f"bitsandbytes left the 8-bit layer's weight {layer.weight.dtype} on {device} (not quantized)"
        layer(torch.ones(2, 8, dtype=torch.float16, device=device))
    except Exception as exc:  # noqa: BLE001 -- any failure means: no 8-bit here
        return f"bitsandbytes cannot run an 8-bit layer on {device} ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def quantized_layers(model, quantization: str) -> tuple[list[str], list[str]]:
    """The names of the linear layers that are bitsandbytes ``Linear4bit`` (4bit) or ``Linear8bitLt`` (8bit), and
    of those that are plain ``torch.nn.Linear``."""
    import bitsandbytes as bnb
    import torch

    kind = bnb.nn.Linear4bit if quantization == "4bit" else bnb.nn.Linear8bitLt
    quantized, plain = [], []
    for name, module in model.named_modules():
        if isinstance(module, kind):
            quantized.append(name)
        elif isinstance(module, torch.nn.Linear) and not isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)):
            plain.append(name)
    return quantized, plain


def _kept_in_float32(model) -> tuple[str, ...]:
    """Module name fragments transformers keeps in float32 whatever the dtype (``_keep_in_fp32_modules``)."""
    base = model
    for attribute in ("base_model", "model"):  # a PeftModel: PeftModel.base_model.model is the transformers model
        if not hasattr(base, "_keep_in_fp32_modules") and hasattr(base, attribute):
            base = getattr(base, attribute)
    names: set[str] = set()
    for attribute in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        names.update(getattr(base, attribute, None) or ())
    return tuple(sorted(names))


@contextlib.contextmanager
def record_cast_refusals(refused: list):
    """Record each refusal transformers raises when a quantized model is cast (``.half()``, ``.to(dtype)``, ...),
    even one the loader catches: the mechanism is the cast, seen where it happens."""
    from transformers import PreTrainedModel

    def spying(original):
        @functools.wraps(original)
        def cast(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            except Exception as exc:
                if is_cast_refusal(exc):
                    refused.append(exc)
                raise
        return cast

    with contextlib.ExitStack() as patches:
        for name in (n for n in _CASTS if n in vars(PreTrainedModel)):
            patches.enter_context(mock.patch.object(PreTrainedModel, name, spying(getattr(PreTrainedModel, name))))
        yield


def dtype_problems(model, quantization: str, dtype: str) -> list[str]:
    """What in ``model`` does not have the requested ``dtype``: its non-quantized floating-point parameters (outside
    the modules transformers keeps in float32), unless, for 4-bit, every ``Linear4bit`` computes in ``dtype``."""
    import bitsandbytes as bnb
    import torch

    wanted = getattr(torch, dtype)
    kept = _kept_in_float32(model)
    packed = (bnb.nn.Params4bit, bnb.nn.Int8Params)
    others = [(name, p) for name, p in model.named_parameters()
              if not isinstance(p, packed) and p.is_floating_point()
              and not any(part in name.split(".") for part in kept)]
    wrong = [(name, p) for name, p in others if p.dtype != wanted]
    if not wrong:
        return []
    seen = sorted({str(p.dtype).removeprefix("torch.") for _, p in wrong})
    problem = (f"{len(wrong)} of {len(others)} non-quantized parameters are {'/'.join(seen)}, not the requested "
               f"{dtype}, e.g. {[name for name, _ in wrong[:2]]}")
    if quantization == "4bit":
        compute = sorted({str(m.compute_dtype).removeprefix("torch.") for m in model.modules()
                          if isinstance(m, bnb.nn.Linear4bit)})
        if compute == [dtype]:
            logger.info("quantized-cast: %s; accepted: every Linear4bit computes in %s (bnb_4bit_compute_dtype)",
                        problem, dtype)
            return []
        problem += f", and the 4-bit layers compute in {'/'.join(compute)} (bnb_4bit_compute_dtype)"
    return [problem + ": the dtype never reached from_pretrained (dtype=, bnb_4bit_compute_dtype)"]


def forward_problems(model, device: str) -> list[str]:
    """One forward on ``device``: what went wrong (an exception, non-finite logits)."""
    import torch

    from pytest_llmload.checks.ground_truth import input_ids

    try:
        with torch.no_grad():
            logits = model(input_ids=input_ids(model, device)).logits
    except Exception as exc:  # noqa: BLE001 -- a forward that fails is the finding
        return [f"the forward raised {type(exc).__name__}: {str(exc)[:300]}"]
    bad = int((~torch.isfinite(logits)).sum())
    return [f"the forward gave {bad} of {logits.numel()} non-finite logits"] if bad else []


def check_quantized_request_keeps_dtype(loader: Loader, checkpoint, workdir, *, device: str = "cpu",
                                        variants=VARIANTS) -> None:
    """Guards quantized-cast: a 4-bit/8-bit request in float16/bfloat16 loads quantized in that dtype, no cast after loading, and runs a forward.

    For each ``(quantization, dtype)`` of ``variants`` (default: 4-bit in float16 and bfloat16, 8-bit in float16),
    an inference request; fails when the loader raises transformers' refusal to cast a quantized model (named
    with the call that cast it), or returns a bitsandbytes model whose non-quantized weights are not in the
    requested dtype (nor, for 4-bit, its compute dtype), or that cannot run a forward. A request the loader
    answers with no bitsandbytes layer is not exercised; the check skips when no request was. Needs bitsandbytes
    (its CPU backend will do) and a transformers that accepts it on the device."""
    import pytest

    from pytest_llmload.failures.dp_dtype import four_bit_refusal

    missing = CHECK.missing_extra_reason()  # (the record's skip, for a caller of this function itself)
    if missing is not None:
        pytest.skip(f"{missing}; no quantized load exercised")
    refusal = four_bit_refusal()
    if refusal is not None:
        pytest.skip(f"{CHECK.name}: {refusal}; no quantized load exercised")
    not_run = []
    if any(q == "8bit" for q, _ in variants):
        why = eight_bit_refusal(device)
        if why is not None:
            not_run.append(f"[8bit] {why}")
            variants = tuple(v for v in variants if v[0] != "8bit")

    failures, others, exercised = [], [], 0
    for quantization, dtype in variants:
        label = f"{quantization}, {dtype}"
        request = LoadRequest(checkpoint, purpose="inference", dtype=dtype, device=device, quantization=quantization,
                              offload_folder=Path(workdir) / f"offload-{quantization}-{dtype}")
        refused: list = []
        try:
            with record_cast_refusals(refused):
                model, request = contract.load(loader, request,
                                               check=CHECK.name).model_and_request
        except contract.ContractGap:
            if not refused:
                raise
            model = None  # the wrong dtype is what the swallowed cast left: the cast is the finding
        except LoaderError as error:
            if not is_cast_refusal(error.original) or _inside_from_pretrained(error.original):
                # The loader's own error; or from_pretrained moving the model itself (accelerate's dispatch_model
                # in some transformers/accelerate pairs, huggingface/transformers#38717): not the loader's cast.
                raise
            exercised += 1
            failures.append(f"[{label}] the loader cast the {quantization} model after loading: "
                            f"{_cast_call_site(error.original)} raised {type(error.original).__name__}: "
                            f"{error.original}")
            continue
        if refused:  # the loader cast the model, transformers refused, and the loader swallowed the refusal
            exercised += 1
            failures.append(f"[{label}] the loader cast the {quantization} model after loading and swallowed "
                            f"transformers' refusal: {_cast_call_site(refused[0])} raised "
                            f"{type(refused[0]).__name__}: {refused[0]}")
            del model
            continue
        quantized, plain = quantized_layers(model, quantization)
        if not quantized:
            layer = "Linear4bit" if quantization == "4bit" else "Linear8bitLt"
            not_run.append(f"[{label}] returned no bitsandbytes {layer} layer ({len(plain)} plain "
                           f"torch.nn.Linear): it ignored the {quantization} request")
            del model
            continue
        exercised += 1
        model.eval()
        # No cast was seen: whatever else is wrong is the loader's own (the contract layer caught the weights'
        # dtype already), not this failure's mechanism.
        # (in the dtype the loader loads: a loader of one dtype is judged in it, and the row says so)
        problems = dtype_problems(model, quantization, request.dtype) + forward_problems(model, device)
        if problems:
            others.append(f"[{label}] {len(quantized)} {quantization} layers, but " + "; ".join(problems))
        del model

    if others and not failures:
        raise LoaderModelError("the loader's quantized model is not usable as asked, with no cast after loading "
                               "(not quantized-cast's mechanism):\n  " + "\n  ".join(others))
    failures += [f"(also, not a cast) {other}" for other in others]
    if failures:
        unexercised = "\n  not exercised: " + "\n  not exercised: ".join(not_run) if not_run else ""
        raise AssertionError(
            f"{len(failures)} of {exercised} quantized requests failed (quantized-cast: a bitsandbytes model cannot "
            "be cast after loading; the dtype goes to from_pretrained as dtype= and bnb_4bit_compute_dtype):\n  "
            + "\n  ".join(failures) + unexercised
        )
    if not exercised:
        not_exercised(CHECK.name, "; ".join(not_run), "a quantized load")
    for line in not_run:
        logger.info("%s: not exercised: %s", CHECK.name, line)


# Isolated: bitsandbytes is imported and run; where a GPU is visible its import initialises CUDA, and a test
# process that has initialised CUDA can no longer fork the other isolated checks (see preload_for_isolated_checks).
CHECK = Check(check_quantized_request_keeps_dtype, failure=FAILURE, isolated=True, extras=("quant",))
CHECKS = (CHECK,)
