"""The reference loader: every fix from the write-ups, applied. It is the default loader under test.

- 000 (offload hang): never ``offload_state_dict``; set the pad token directly instead of a second
  ``GenerationConfig.from_pretrained``; local files only.
- 002 (meta-tensor backward): a model that will be trained is never offloaded; it is loaded whole on one
  device, and a budget that cannot hold it for training is refused before loading.
- 004 (device_map under DeepSpeed): no ``device_map`` spread when the process is one rank of a
  distributed job.
- Taken from the field (``pytest_llmload/failures/``): no ``device_map`` at all under ZeRO-3
  (zero3-device-map); the dtype passed to ``from_pretrained``, never cast after a quantized load
  (quantized-cast); trainable weights kept in float32 for fp16 mixed precision (fp16-unscale); a trained
  adapter never put on an offloaded base (adapter-on-offloaded).

Example::

    from pytest_llmload import LoadRequest
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer
    model, tokenizer = load_model_and_tokenizer(LoadRequest("/path/to/ckpt", purpose="train", lora=True))
"""

from __future__ import annotations

import os
from typing import Any

from pytest_llmload.fixes.training_scripts import is_distributed, local_rank
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.loader.seam import REFERENCE_SOURCE, LoaderChoice
from pytest_llmload.loader.transformers_compat import dtype_kwarg, enable_gradient_checkpointing

LORA_TARGETS = ("q_proj", "v_proj")


def _quantization_kwarg(request: LoadRequest) -> dict:
    if request.quantization is None:
        return {}
    from transformers import BitsAndBytesConfig

    if request.quantization == "4bit":
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=request.torch_dtype
        )
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": config}


def _zero3_enabled() -> bool:
    """Whether a DeepSpeed ZeRO-3 config is alive in this process (transformers' own test, where it is loaded)."""
    import sys

    integrations = sys.modules.get("transformers.integrations.deepspeed")
    return bool(integrations is not None and integrations.is_deepspeed_zero3_enabled())


def placement_kwargs(request: LoadRequest) -> dict:
    """Where the weights go: the one decision every write-up is about."""
    # zero3-device-map: with a ZeRO-3 config alive (Trainer or accelerate made it), any device_map is refused,
    # even 004's {"": local_rank}; DeepSpeed places the weights itself.
    deepspeed = request.deepspeed or _zero3_enabled()
    distributed = is_distributed(os.environ, deepspeed=deepspeed)
    if request.purpose == "train" and not deepspeed:
        # 002: a model to be trained is never spread over cpu/disk/meta, so a budget that cannot hold it for
        # training is refused here, before from_pretrained reads a weight. A DDP rank holds the whole model
        # too; under DeepSpeed, ZeRO partitions gradients and optimizer state, so this estimate would be high.
        from pytest_llmload.fixes.training_memory import check_training_budget

        check_training_budget(request)
    if distributed:
        # 004: one rank of a distributed job loads the whole model itself, never spread by a device_map
        # (accelerate refuses to prepare a model whose hf_device_map has several entries in any distributed
        # mode). On CPU, and under DeepSpeed (which places and partitions the weights), no device_map at
        # all; on GPU the whole model goes to this rank's own device.
        if request.device.startswith("cuda") and not deepspeed:
            return {"device_map": {"": f"cuda:{local_rank(os.environ)}"}}
        return {}
    if request.purpose == "train":
        return {"device_map": {"": request.device}}
    if request.max_memory is not None:
        # 000: let accelerate spread an inference load over the budget, offloading to the folder we were
        # given, and nothing else (no offload_state_dict temporary round-trip).
        kwargs: dict[str, Any] = {"device_map": "auto", "max_memory": request.max_memory_dict}
        if request.offload_folder is not None:
            kwargs["offload_folder"] = request.offload_folder
        return kwargs
    return {"device_map": {"": request.device}}


def _apply_lora(model, request: LoadRequest):
    from peft import LoraConfig, get_peft_model

    if request.quantization is not None:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=request.gradient_checkpointing
        )
    config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM"
    )
    return get_peft_model(model, config)


def _set_pad_token(model, tokenizer) -> None:
    """000, fix 3: set pad_token_id directly on tokenizer and model; no second from_pretrained."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id


def load_model_and_tokenizer(request: LoadRequest):
    """Load ``request.model_path`` as the write-ups' fixed loaders would; returns ``(model, tokenizer)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    placement = placement_kwargs(request)
    if request.adapter_path is not None:
        # adapter-on-offloaded: an adapter is never put on an offloaded base (peft re-dispatches it without the
        # budget); load whole where the budget allows, else refuse before loading.
        from pytest_llmload.fixes.adapters import adapter_placement_kwargs

        placement = adapter_placement_kwargs(request, placement)
    model = AutoModelForCausalLM.from_pretrained(
        request.model_path,
        local_files_only=True,
        **dtype_kwarg(request.torch_dtype),
        **_quantization_kwarg(request),
        **placement,
    )
    tokenizer = AutoTokenizer.from_pretrained(request.model_path, local_files_only=True)
    _set_pad_token(model, tokenizer)

    if request.gradient_checkpointing:
        # Non-reentrant checkpointing gives frozen-base LoRA models their gradients without the
        # enable_input_require_grads() workaround.
        enable_gradient_checkpointing(model, use_reentrant=False)
        model.config.use_cache = False
    if request.adapter_path is not None:
        from pytest_llmload.fixes.adapters import put_adapter

        model = put_adapter(model, request)
    elif request.lora:
        model = _apply_lora(model, request)
    if request.purpose == "train":
        # fp16-unscale: under fp16 mixed precision the trainable weights must be float32 master weights
        from pytest_llmload.fixes.training_scripts import upcast_trainable_parameters

        upcast_trainable_parameters(model)
    model.train(request.purpose == "train")
    return model, tokenizer


# The loader a run checks where it names none (the seam, a layer below, knows it only by its source).
REFERENCE = LoaderChoice(f"{__name__}:{load_model_and_tokenizer.__name__}", REFERENCE_SOURCE)


def chosen_loader(config) -> LoaderChoice:
    """The loader the plugin chose at configure; the reference loader where the run configured nothing (the
    plugin then never imported the seam to choose)."""
    from pytest_llmload.config.stash_keys import configuration_key

    configuration = config.stash.get(configuration_key, None)
    return getattr(configuration, "loader", None) or REFERENCE


# Write-up 003's fix lives in the training script, not the loader: the training script that goes with this loader
# calls this package's guard between TrainingArguments and Trainer, and the Trainer check does the same.
load_model_and_tokenizer.llmload_training_args_hook = (
    "pytest_llmload.fixes.trainer_guard:prepare_training_args_for_placed_model")
