"""fp16-unscale: weights loaded in float16 and trained under fp16 mixed precision; GradScaler refuses their gradients.

Seen in the field (huggingface/transformers#23165, huggingface/peft#341, hiyouga/LlamaFactory#1764,
Vision-CAIR/MiniGPT-4#213, sillsdev/silnlp#292): a model loaded with ``torch_dtype=torch.float16`` and trained,
fully or through LoRA adapters that ended up in float16, with Trainer's ``fp16=True`` or a hand-written
``torch.amp.GradScaler`` loop. The first optimizer step fails inside ``GradScaler.unscale_`` with
``ValueError: Attempting to unscale FP16 gradients.`` (torch/amp/grad_scaler.py, ``_unscale_grads_``, called
with ``allow_fp16=False``). fp16 mixed precision is float32 master weights + float16 compute under autocast:
the scaler multiplies the loss, then divides the gradients back in place, and it refuses float16 gradients
(the gradients of float16 parameters), whose range that round trip would overflow. peft 0.11 and later cast
float16/bfloat16 LoRA adapters to float32 by default (huggingface/peft#1706, ``autocast_adapter_dtype=True``),
so LoRA meets it now only with ``autocast_adapter_dtype=False``, ``model.half()`` after ``get_peft_model`` or
adapters created by hand; a full fine-tune of a float16 load meets it every time.

The fix: keep the trainable parameters in float32. Load in float32 and let autocast compute in float16, or
load in float16 and upcast what will be trained (:func:`upcast_trainable_parameters`; peft's default does
this for adapters). Frozen weights may stay float16.

On CPU, ``torch.amp.GradScaler("cpu")`` (torch 2.13) raises the same text. Trainer does not get there on CPU:
accelerate 1.15 creates no scaler when the device is ``cpu`` (``Accelerator.__init__``: fp16 and
``device.type != "cpu"``), so ``fp16=True`` on CPU trains the float16 weights without a scaler, silently.
The check therefore runs the step Trainer runs on a GPU, by hand: autocast float16, ``scaler.scale(loss)
.backward()``, ``scaler.unscale_(optimizer)`` (Trainer's gradient clipping), ``scaler.step``. It judges only where a
GradScaler would really see the gradients: not where the repo declares it trains half precision without one
(``llmload_trains_fp16_without_scaler``: a pure float16 trainer that turns mixed precision off for half-precision
weights), nor where its training-args hook turns Trainer's fp16 off or accelerate's mixed precision is not fp16
(``ACCELERATE_MIXED_PRECISION``); where nothing says how it trains, it assumes Trainer's fp16 and a failure says
so::

    from pytest_llmload.failures import fp16_unscale

    @pytest.mark.timeout(60)
    def test_my_loader_trains_in_fp16(llmload_checkpoint, tmp_path):
        fp16_unscale.check_fp16_train_request_keeps_fp32_master_weights(my_loader, llmload_checkpoint, tmp_path)
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from pytest_llmload.checks.base import ASSUMED, Check, KnownFailure, not_exercised
from pytest_llmload.checks import contract
from pytest_llmload.config.vocabulary import SETTING
from pytest_llmload.loader.request import LoadRequest

Loader = Callable[[LoadRequest], Any]

UNSCALE_ERROR = "Attempting to unscale FP16 gradients."

FAILURE = KnownFailure(
    id="fp16-unscale",
    order=10,
    title="float16 trainable weights under fp16 mixed precision: GradScaler refuses to unscale their gradients",
    write_up=("huggingface/transformers#23165, huggingface/peft#341, hiyouga/LlamaFactory#1764, "
              "Vision-CAIR/MiniGPT-4#213, sillsdev/silnlp#292; fix in peft: huggingface/peft#1706"),
    signatures=(r"Attempting to unscale FP16 gradients",),
    root_cause=(
        "The model was loaded with torch_dtype=float16 and its trainable parameters (the whole model, or LoRA "
        "adapters created in the base dtype: autocast_adapter_dtype=False, model.half(), peft < 0.11) stayed "
        "float16, so their gradients are float16. fp16 mixed precision (Trainer fp16=True, torch.amp.GradScaler) "
        "expects float32 master weights: GradScaler.unscale_ refuses float16 gradients."
    ),
    fix=(
        "Keep the trainable parameters in float32: load in float32 and let autocast compute in float16, or "
        "upcast the trainable parameters after loading (pytest_llmload.fixes.training_scripts.upcast_trainable_parameters;"
        " for LoRA, keep peft's default autocast_adapter_dtype=True). Or train "
        "in bf16 (bf16=True), which needs no GradScaler. Where the training turns mixed precision off for "
        "half-precision weights (no GradScaler at all), declare llmload_trains_fp16_without_scaler."
    ),
    script_fix=(
        "Keep the trainable parameters in float32: load in float32 and let autocast compute in float16, or upcast the"
        " trainable parameters after loading (p.data = p.data.float() for each p with requires_grad; for LoRA, keep "
        "peft's default autocast_adapter_dtype=True). Or train in bf16 (bf16=True), which needs no GradScaler."
    ),
    occurs=(
        "any torch with GradScaler (torch.cuda.amp and torch.amp); on GPU under Trainer/accelerate fp16, on CPU "
        "with torch.amp.GradScaler('cpu') (torch 2.13 here); LoRA only with peft < 0.11 or "
        "autocast_adapter_dtype=False."
    ),
)

LORA_VARIANTS = (False, True)

# The declaration by which a repo says it trains float16 weights without a GradScaler: vocabulary.TRAINING_DECLARATIONS'
# loader attribute, ini key and option (Check passes it as `trains_fp16_without_scaler`).
WITHOUT_SCALER = SETTING["trains_fp16_without_scaler"].ini
ASSUMED_SCALER = (  # a row that fails on it says so (checks.base.ASSUMED: listed under the tables, with what settles it)
    f"{ASSUMED}this repo trains the float16 weights under fp16 mixed precision, through a GradScaler (Trainer's "
    "fp16=True, accelerate's mixed_precision='fp16'): nothing declares or shows how it trains (declare "
    f"{WITHOUT_SCALER} where its training turns mixed precision off for half-precision weights, or name its "
    "llmload_training_args_hook)")


# accelerate's mixed precision as this run was launched (`accelerate launch --mixed_precision fp16`, a CI variable):
# read when this module is first imported, at collection, because transformers' TrainingArguments(fp16=True/bf16=True)
# writes the same variable into the process afterwards (a Trainer built by an earlier test would decide the row).
LAUNCHED_MIXED_PRECISION = os.environ.get("ACCELERATE_MIXED_PRECISION", "").lower()


def _hook_name(hook: Callable) -> str:
    return f"{getattr(hook, '__module__', '?')}:{getattr(hook, '__qualname__', repr(hook))}"


def scaler_in_training(model: Any, workdir, prepare_args: Callable[[Any, Any], Any] | None) -> tuple[bool | None, str]:
    """Whether the repo's training puts the float16 gradients through a GradScaler, as far as it shows: ``(True |
    False, what shows it)``, or ``(None, "")`` where nothing does.

    The training script's hook (``prepare_args(args, model)``, between ``TrainingArguments`` and ``Trainer``) is
    given arguments with Trainer's ``fp16=True``: one that turns it off (or turns bf16 on) trains without a
    scaler, one that sets it trains with one. Else accelerate's mixed precision setting
    as launched (:data:`LAUNCHED_MIXED_PRECISION`, what ``accelerate launch --mixed_precision`` sets): ``fp16``
    makes a scaler, ``no``/``bf16``/``fp8`` none."""
    if prepare_args is not None:
        from transformers import TrainingArguments

        args = TrainingArguments(output_dir=os.fspath(workdir), report_to=[])
        assigned: set[str] = set()

        class Recorded(type(args)):  # which arguments the hook sets, even to the value they had
            def __setattr__(self, name, value):
                assigned.add(name)
                super().__setattr__(name, value)

        args.fp16 = True  # (set after __post_init__, which refuses fp16 on a CPU-only machine in some versions)
        args.__class__ = Recorded
        prepare_args(args, model)
        args.__class__ = TrainingArguments
        said = f"the training-args hook {_hook_name(prepare_args)} leaves fp16={args.fp16}, bf16={args.bf16}"
        if not args.fp16 or args.bf16:
            return False, f"{said}: Trainer makes no GradScaler"
        if assigned & {"fp16", "bf16"}:
            return True, f"{said}: Trainer's fp16 mixed precision, through a GradScaler"
    mixed = LAUNCHED_MIXED_PRECISION
    if mixed == "fp16":
        return True, "accelerate's mixed precision is fp16 (ACCELERATE_MIXED_PRECISION=fp16): a GradScaler"
    if mixed in ("no", "bf16", "fp8"):
        return False, f"accelerate's mixed precision is {mixed} (ACCELERATE_MIXED_PRECISION={mixed}): no GradScaler"
    return None, ""


def _numel(params: Iterable) -> int:
    return sum(p.numel() for p in params)


def _fp16_step(model, device: str) -> tuple[str | None, int, bool]:
    """One fp16 mixed-precision step as Trainer runs it on a GPU; returns (unscale error, fp16 grads, step skipped)."""
    import torch

    from pytest_llmload.instruments.phases import phase
    from pytest_llmload.checks.ground_truth import input_ids

    device_type = torch.device(device).type
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    scaler = torch.amp.GradScaler(device_type)
    ids = input_ids(model, device, batch=1, length=8)
    model.train()
    with phase("train step", f"fp16 autocast + GradScaler({device_type!r}), batch 1 x {ids.shape[-1]} tokens"):
        with torch.autocast(device_type, dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        fp16_grads = sum(1 for p in trainable if p.grad is not None and p.grad.dtype == torch.float16)
        try:
            scaler.unscale_(optimizer)  # Trainer: before clipping the gradient norm
        except ValueError as exc:
            if UNSCALE_ERROR not in str(exc):
                raise
            return f"{type(exc).__name__}: {exc}", fp16_grads, True
        scale_before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale_before  # an inf/nan gradient: the step was skipped, as designed
    optimizer.zero_grad(set_to_none=True)
    return None, fp16_grads, skipped


def check_fp16_train_request_keeps_fp32_master_weights(loader: Loader, checkpoint, workdir, *, device: str = "cpu",
                                                       variants: Iterable[bool] = LORA_VARIANTS,
                                                       trains_under_deepspeed: bool = False,
                                                       trains_fp16_without_scaler: bool = False,
                                                       prepare_args: Callable[[Any, Any], Any] | None = None) -> None:
    """Guards fp16-unscale: a dtype="float16" train request (+/- LoRA) gives float32 trainable weights; one fp16 GradScaler step runs.

    For each LoRA switch in ``variants`` (default: without and with LoRA), the loader gets
    ``LoadRequest(checkpoint, purpose="train", dtype="float16", device=device, lora=...)``. The returned model
    must have trainable parameters (else the check skips: nothing to train), and one fp16 mixed-precision step must
    run: autocast float16, ``scaler.scale(loss).backward()``, ``scaler.unscale_(optimizer)``,
    ``scaler.step(optimizer)``. The scaler's ``Attempting to unscale FP16 gradients.`` (the gradient of a float16
    trainable parameter) fails it, with the figures (its float16 trainable parameters). Loaders
    that load float32 (autocast computes in float16) or upcast what they train pass. Not exercised where no
    GradScaler would see the gradients: declared (``trains_under_deepspeed``, ``trains_fp16_without_scaler``) or
    shown by the training-args hook ``prepare_args`` or accelerate's setting (:func:`scaler_in_training`); where
    nothing shows it, a failure notes what it assumed. A loader's own error propagates as it is."""
    import torch

    if trains_under_deepspeed:  # DeepSpeed's fp16 optimizer keeps its own float32 master weights: no GradScaler
        not_exercised(CHECK.name, "is declared to train only under "
                      "DeepSpeed (llmload_trains_under_deepspeed)", "a torch GradScaler step")
    if trains_fp16_without_scaler:  # a float16 trainable weight is then how it trains, not this failure
        not_exercised(CHECK.name, f"is declared to train half precision without a GradScaler ({WITHOUT_SCALER}): "
                      "no scaler unscales its float16 gradients", "a torch GradScaler step")
    failures, passed, untrainable = [], [], []
    scaler, shown_by = None, ""
    for lora in variants:
        label = f"dtype=float16, lora={lora}"
        request = LoadRequest(checkpoint, purpose="train", dtype="float16", device=device, lora=lora)
        model = contract.load(loader, request, check=CHECK.name).model
        if scaler is None and not shown_by:
            scaler, shown_by = scaler_in_training(model, workdir, prepare_args)
            if scaler is False:
                not_exercised(CHECK.name, f"trains without a GradScaler: {shown_by}", "a torch GradScaler step")
            shown_by = shown_by or "assumed"
        named = list(model.named_parameters())
        trainable = [(n, p) for n, p in named if p.requires_grad]
        if not trainable:
            untrainable.append(f"{label}: none of its {len(named)} parameters requires grad")
            del model
            continue
        by_dtype: dict[str, int] = {}
        for _, p in named:
            by_dtype[str(p.dtype).removeprefix("torch.")] = by_dtype.get(str(p.dtype).removeprefix("torch."), 0) + 1
        half = [(n, p) for n, p in trainable if p.dtype == torch.float16]
        error, fp16_grads, skipped = _fp16_step(model, device)
        problems = []  # only what the scaler refuses: a float16 weight it never sees a gradient of is not this failure
        if error is not None:
            if half:
                problems.append(
                    f"{len(half)} of {len(trainable)} trainable parameters are float16 ({_numel(p for _, p in half):,} "
                    f"of {_numel(p for _, p in trainable):,} trainable elements), e.g. {[n for n, _ in half[:3]]}: "
                    "no float32 master weights")
            problems.append(f"GradScaler.unscale_ raised {error} ({fp16_grads} float16 gradients, on {device})")
        if problems:
            failures.append(f"[{label}; parameters by dtype {by_dtype}]\n    " + "\n    ".join(problems))
        else:
            passed.append(f"{label}: {len(trainable)} trainable parameters, no float16 gradient unscaled, step "
                          f"{'skipped on inf/nan (scaler backed off)' if skipped else 'taken'}")
        del model
    if shown_by not in ("", "assumed"):
        contract.note(f"observed: {shown_by}")
    if failures:
        if shown_by == "assumed":  # (a loader that passes would pass without a scaler too: nothing rests on it)
            contract.note(ASSUMED_SCALER)
        raise AssertionError(
            f"{len(failures)} of {len(failures) + len(passed) + len(untrainable)} float16 train requests cannot "
            "take an fp16 mixed-precision step (fp16-unscale: GradScaler needs float32 trainable weights; "
            "keep them float32, e.g. pytest_llmload.fixes.training_scripts.upcast_trainable_parameters; where the "
            f"training turns mixed precision off for half-precision weights, declare {WITHOUT_SCALER}):\n  "
            + "\n  ".join(failures))
    if untrainable and not passed:
        not_exercised(CHECK.name, f"returned a model with no trainable "
                      f"parameter ({'; '.join(untrainable)})", "an fp16 mixed-precision step")
    if untrainable:  # judged on the requests that trained, as the train check does (a frozen base without LoRA)
        contract.note(f"{len(untrainable)} of {len(untrainable) + len(passed)} float16 train requests got a model "
                      f"with no trainable parameter (a frozen base): nothing to judge there")


# Isolated, like every check that calls the loader in this process (a hang is killed with the child).
CHECK = Check(check_fp16_train_request_keeps_fp32_master_weights, failure=FAILURE, purpose="train", isolated=True)
CHECKS = (CHECK, CHECK.on_gpu())
