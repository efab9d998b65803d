"""dp-dtype (write-up 003): Trainer wraps a model already placed by ``device_map`` in ``nn.DataParallel``.

The write-up's stage-2 model (a bf16 checkpoint reloaded in 4-bit, ``device_map="balanced"``, LoRA) failed
under a 2-GPU Trainer with ``expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16``;
the tell was the step count halving. Its fix: ``training_args._n_gpu = 1``
(:func:`pytest_llmload.trainer_guard.prepare_training_args_for_placed_model`).

The check, a model loaded for training handed to a stock ``transformers.Trainer`` that sees more than one GPU,
runs on CPU.
The check runs on CPU. "More than one GPU" is set where Trainer reads it, ``TrainingArguments.n_gpu``
(see :func:`pytest_llmload.trainer_guard.observe_trainer`); everything after that is Trainer's own code.
A training script's fix goes in ``prepare_args(args, model)``, called between the two, where the
write-up put ``training_args._n_gpu = 1``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

from pytest_llmload.failures.base import Check, KnownFailure, not_exercised
from pytest_llmload.failures import contract
from pytest_llmload.loading import LoaderModelError
from pytest_llmload.request import LoadRequest
from pytest_llmload.scenarios import where_loaded

logger = logging.getLogger(__name__)

FAILURE = KnownFailure(
    id="dp-dtype",
    title="nn.DataParallel wrapped around a model already placed with device_map",
    write_up="seeds/003_b296b1821f4bec50.txt",
    signatures=(
        r"mat1 and mat2 (?:to |must )?have the same dtype",
        r"expected scalar type (?:Float|BFloat16|Half) but found (?:Float|BFloat16|Half)",
    ),
    root_cause=(
        "Trainer saw n_gpu > 1 and wrapped a device_map-placed (4-bit, LoRA) model in nn.DataParallel; its "
        "replicas run in worker threads and float activations reach a bf16 lm_head. The tell: the number of "
        "steps halves (136 -> 68)."
    ),
    fix=(
        "Do not let Trainer data-parallelise a placed model: set training_args._n_gpu = 1 when hf_device_map "
        "spreads the model (pytest_llmload.fixes.prepare_training_args_for_placed_model does this), or launch one process per GPU instead; name "
        "that hook to the check (--llmload-training-args-hook), or declare llmload_trains_without_trainer where "
        "the repo never trains with transformers.Trainer."
    ),
    occurs="2+ GPUs; transformers Trainer up to 4.57 wraps 4-bit models, later versions skip 4-bit.",
    tell=r"data_parallel|parallel_apply",
    without_tell=(
        "no DataParallel frame in the traceback: the same dtype symptom, so look for another float/bf16 mix "
        "(autocast off, a module left in float32)."
    ),
)

STAGE1_SHARDS = 4
# The first step's loss may differ a little from the model's own (dropout, bf16 rounding); a Trainer that
# counts n_gpu devices it does not use scales it by n_gpu.
LOSS_RATIO_TOLERANCE = 0.25


def _is_4bit(model: Any) -> bool:
    """bitsandbytes 4-bit layers in the model (through a peft wrapper too)."""
    return any(type(module).__name__ == "Linear4bit" for module in model.modules())


def write_stage1_checkpoint(checkpoint: Path, dest: Path) -> Path:
    """Write-up 003's stage 1: the full model saved in bf16 as sharded safetensors, with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).to(torch.bfloat16)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(dest, max_shard_size=total_bytes // STAGE1_SHARDS + 1, safe_serialization=True)
    AutoTokenizer.from_pretrained(checkpoint, local_files_only=True).save_pretrained(dest)
    return dest


def _upstream_reading(obs) -> str:
    """Which of the known upstream behaviours the observation is."""
    quantized = any("bit" in r or "quantized" in r for r in obs.placement.reasons)
    if obs.is_model_parallel:
        return "Trainer saw the placement in hf_device_map and set n_gpu to 1 itself"
    if obs.data_parallel:
        if quantized:
            return "this transformers wraps quantized (4-bit) models in nn.DataParallel (its _wrap_model skips 8-bit only)"
        return "this transformers wraps the model in nn.DataParallel: hf_device_map names no second accelerator"
    if obs.n_gpu > 1 and quantized:
        return (
            "this transformers skips nn.DataParallel for 4-bit/8-bit models but still counts n_gpu: the batch, "
            "the step count and the loss scale follow n_gpu"
        )
    return "Trainer did not treat the run as data-parallel"


def four_bit_refusal() -> Optional[str]:
    """Why bitsandbytes 4-bit cannot load on this machine with the installed transformers, or ``None``.

    transformers 4.46 accepts 4-bit on CPU only with intel_extension_for_pytorch, which has no build for
    the torch of this matrix; transformers 4.56 with bitsandbytes 0.47 and later load it on CPU
    (docs/version_matrix.md). The text is transformers' own refusal."""
    from importlib import metadata

    from transformers.integrations import validate_bnb_backend_availability

    try:
        validate_bnb_backend_availability(raise_exception=True)
    except RuntimeError as refusal:
        return (f"transformers {metadata.version('transformers')} with bitsandbytes {metadata.version('bitsandbytes')} "
                f"refuses 4-bit on this machine ({str(refusal).split('. ')[0]}); needs 1 GPU")
    return None


def check_trainer_does_not_wrap_placed_model(
    loader: Callable[[LoadRequest], Any],
    checkpoint: Path,
    workdir: Path,
    *,
    prepare_args: Optional[Callable[[Any, Any], Any]] = None,
    simulated_n_gpu: int = 2,
    trains_without_trainer: bool = False,
    trains_under_deepspeed: bool = False,
) -> None:
    """Seed 003: a train/4-bit/LoRA model from a local bf16 (stage-1) checkpoint, given to a stock Trainer with 2 GPUs, is not wrapped in nn.DataParallel and its first step runs with consistent dtypes; needs bitsandbytes 4-bit (its CPU backend will do)."""
    from pytest_llmload.trainer_guard import observe_trainer

    if trains_without_trainer or trains_under_deepspeed:
        how = ("to train without transformers.Trainer (llmload_trains_without_trainer)" if trains_without_trainer
               else "to train only under DeepSpeed, one process per GPU (llmload_trains_under_deepspeed)")
        not_exercised("check_trainer_does_not_wrap_placed_model", f"is declared {how}", "Trainer's wrap decision")
    refusal = four_bit_refusal()
    if refusal is not None:
        import pytest

        pytest.skip(f"write-up 003's model is 4-bit: {refusal}")
    workdir = Path(workdir)
    stage1 = workdir / "stage1"
    if stage1.exists():
        shutil.rmtree(stage1)
    write_stage1_checkpoint(Path(checkpoint), stage1)

    request = LoadRequest(stage1, purpose="train", dtype="bfloat16", device="cpu", quantization="4bit", lora=True,
                          gpu_count=simulated_n_gpu)
    model = contract.load(loader, request, check="check_trainer_does_not_wrap_placed_model").model
    if not _is_4bit(model):
        # DataParallel over a plain, unplaced model is ordinary and works: not this failure's scenario.
        not_exercised("check_trainer_does_not_wrap_placed_model", f"ignored the 4-bit request: it returned an "
                      f"unquantized model, {where_loaded(model)}", "a placed 4-bit model handed to Trainer")
    obs = observe_trainer(model, workdir / "trainer", simulated_n_gpu=simulated_n_gpu, prepare_args=prepare_args)
    reading = _upstream_reading(obs)
    logger.info("seed 003: %s -- %s", obs.describe(), reading)

    problems, others = [], []
    if obs.data_parallel:
        problems.append("Trainer wrapped the model in nn.DataParallel")
    if obs.n_gpu > 1 or obs.train_batch_size != obs.per_device_batch:
        unused = "" if obs.data_parallel else " for a model it does not replicate"
        problems.append(
            f"Trainer counts n_gpu={obs.n_gpu}{unused}: {obs.per_device_batch} rows per device became "
            f"{obs.train_batch_size} per step, so the step count divides by {obs.n_gpu} (the write-up's 136 -> 68)"
        )
    if obs.dtype_error or obs.dtype_mismatches:
        problems.append(
            f"the first step mixed dtypes at the lm_head: {obs.error or obs.dtype_mismatches}"
        )
    # Not this failure's mechanism: the loader's model cannot train under Trainer for another reason.
    elif obs.error:
        others.append(f"the first step failed: {obs.error}")
    elif obs.first_step_loss is None:
        others.append("the first step logged no loss")
    elif obs.first_step_grad_norm is not None and not obs.first_step_grad_norm > 0:
        others.append(f"the first step's gradient norm is {obs.first_step_grad_norm}: nothing was trained")
    ratio = obs.loss_ratio
    # Under nn.DataParallel on CPU the module runs unsplit, so its loss figure means nothing off CPU.
    if not obs.data_parallel and ratio is not None and abs(ratio - 1) > LOSS_RATIO_TOLERANCE:
        problems.append(f"the first step's loss is x{ratio:.3f} the model's own loss on the same rows")
    if others and not problems:
        raise LoaderModelError(f"the loader's 4-bit model does not train under a stock Trainer, for a reason that is "
                               f"not write-up 003's ({'; '.join(others)}).\n{obs.describe()}")
    problems += others
    if problems:
        hint = (
            "" if prepare_args is not None else
            " This judges a stock Trainer (no training-args hook was given). Fix it in the training script: call "
            "pytest_llmload.trainer_guard.prepare_training_args_for_placed_model(args, model) before building the "
            "Trainer (write-up 003: training_args._n_gpu = 1) and name that hook (--llmload-training-args-hook, the "
            "ini key or the loader's llmload_training_args_hook); or, where the repo never trains with "
            "transformers.Trainer, declare llmload_trains_without_trainer."
        )
        raise AssertionError(
            f"seed 003 (DataParallel over a placed model): {'; '.join(problems)}.\n"
            f"Upstream behaviour seen: {reading}.\n{obs.describe()}.{hint}"
        )


# Isolated: Trainer leaves accelerate's process-wide AcceleratorState behind (class-level singletons that later
# tests and forked ranks inherit) and reseeds the global RNGs; the 4-bit load runs bitsandbytes' native code.
CHECKS = (
    # Trainer as transformers ships it; a training script's own fix comes in as `prepare_args` (the
    # llmload_training_args_hook option, ini key or loader attribute), as it does in the script.
    Check(check_trainer_does_not_wrap_placed_model, failure=FAILURE, timeout=180, purpose="train", isolated=True),
)
