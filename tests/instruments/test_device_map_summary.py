"""The placement summary on its own, for the two shapes of write-up 002: weights on meta with nothing to load
them, and LoRA over an offloaded model (names behind peft's prefix)."""

from __future__ import annotations

import pytest

from fixtures import tiny_llama

from pytest_llmload import LoadRequest
from pytest_llmload.checks.ground_truth import offload_budget
from pytest_llmload.instruments.device_map_summary import placement_lines

pytestmark = pytest.mark.timeout(120)


def test_meta_weights_without_an_offloading_hook_are_called_out(llmload_checkpoint):
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(llmload_checkpoint))
    assert placement_lines(model) == [
        f"modules with weights: meta {tiny_llama.PARAMETERS}",
        f"parameters on meta: {tiny_llama.PARAMETERS} of {tiny_llama.PARAMETERS} (model.embed_tokens.weight, model.layers.0.self_attn.q_proj.weight, "
        "model.layers.0.self_attn.k_proj.weight, +36 more)",
        f"not materialised: {tiny_llama.PARAMETERS} weights, 738.2 KiB to an unknown place; no accelerate hook loads them (they cannot "
        "run or train)",
        f"dtypes: meta float32 ({tiny_llama.PARAMETERS} params, 738.2 KiB)",
    ]


def test_lora_over_an_offloaded_model_is_traced_to_its_tier_through_peft_names(llmload_checkpoint, llmload_loader,
                                                                                 tmp_path):
    from peft import LoraConfig, get_peft_model

    request = LoadRequest(llmload_checkpoint, max_memory=offload_budget(llmload_checkpoint),
                          offload_folder=tmp_path / "offload")
    model = get_peft_model(llmload_loader(request).model,
                           LoraConfig(r=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    names = [name for name, _ in model.named_parameters()]
    assert names[0].startswith("base_model.model.")  # not the keys of hf_device_map
    lines = placement_lines(model)
    offloaded = next(line for line in lines if line.startswith("offloaded by accelerate"))
    assert " to disk (folder " in offloaded and "unknown place" not in offloaded, lines
    assert lines[0].startswith("hf_device_map: cpu 2 (model.embed_tokens, model.layers.0), disk 6"), lines


def test_an_object_without_parameters_has_no_summary():
    assert placement_lines(object()) == []
