"""Properties of offloading the tiny model, where hypothesis finds what a few examples would miss:

- any split of the model's modules between cpu and disk gives the logits of the model in memory;
- any train request through the reference loader yields a model with nothing on meta and nothing offloaded
  (or is refused before loading, when and only when the estimate exceeds the budget).
"""

from __future__ import annotations

import tempfile

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from pytest_llmload import LoadRequest, call_loader
from pytest_llmload.checks import ground_truth
from pytest_llmload.fixes.training_memory import TrainingBudgetError, budget_for_device, checkpoint_tensors, estimate_training_memory
from pytest_llmload.loader.seam import LoaderError
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as reference_loader

MODULES = ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3",
           "model.norm", "model.rotary_emb", "lm_head")
FEW = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def whole_logits(llmload_checkpoint):
    import torch

    model = ground_truth.plain_model(llmload_checkpoint, "cpu")
    ids = ground_truth.input_ids(model, "cpu")
    with torch.no_grad():
        return ids, model(input_ids=ids).logits


@pytest.mark.timeout(120)
@FEW
@given(split=st.lists(st.sampled_from(["cpu", "disk"]), min_size=len(MODULES), max_size=len(MODULES)))
@example(split=["disk"] * len(MODULES))
def test_any_cpu_disk_split_gives_the_logits_of_the_model_in_memory(split, llmload_checkpoint, whole_logits):
    import torch
    from transformers import AutoModelForCausalLM

    ids, want = whole_logits
    device_map = dict(zip(MODULES, split))
    if set(split) == {"disk"} and _dispatch_refuses_all_disk():
        # accelerate's dispatch_model refuses an all-disk map up to 1.10 at least (seen: 1.0.1, 1.10.1); 1.15 loads it.
        with tempfile.TemporaryDirectory() as offload_folder, \
                pytest.raises(ValueError, match="offload the whole model to the disk"):
            AutoModelForCausalLM.from_pretrained(llmload_checkpoint, device_map=device_map,
                                                 offload_folder=offload_folder, local_files_only=True)
        return
    with tempfile.TemporaryDirectory() as offload_folder:
        model = AutoModelForCausalLM.from_pretrained(llmload_checkpoint, device_map=device_map,
                                                     offload_folder=offload_folder, local_files_only=True)
        on_meta = sum(p.device.type == "meta" for p in model.parameters())
        # rotary_emb holds buffers only; every other module on disk leaves its parameters on meta
        assert (on_meta > 0) == any(d == "disk" for m, d in device_map.items() if m != "model.rotary_emb")
        with torch.no_grad():
            got = model(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1.3e-6, atol=1e-5)


def _dispatch_refuses_all_disk() -> bool:
    """What the installed accelerate's own source says: does ``dispatch_model`` refuse an all-disk map?"""
    import inspect

    from accelerate import big_modeling

    return "offload the whole model to the disk" in inspect.getsource(big_modeling.dispatch_model)


def _budgets(total: int):
    return st.one_of(
        st.none(),
        st.integers(min_value=1, max_value=40 * total).map(lambda n: {"cpu": n}),
        st.integers(min_value=1, max_value=40).map(lambda mb: {"cpu": f"{mb}MB"}),
    )


@pytest.mark.timeout(120)
@FEW
@given(data=st.data())
def test_any_train_request_through_the_reference_loader_has_nothing_on_meta(data, llmload_checkpoint,
                                                                          tmp_path_factory):
    total = sum(t.nbytes for t in checkpoint_tensors(llmload_checkpoint))
    request = LoadRequest(
        llmload_checkpoint, purpose="train",
        dtype=data.draw(st.sampled_from(["float32", "bfloat16"]), label="dtype"),
        lora=data.draw(st.booleans(), label="lora"),
        gradient_checkpointing=data.draw(st.booleans(), label="gradient_checkpointing"),
        max_memory=data.draw(_budgets(total), label="max_memory"),
        offload_folder=tmp_path_factory.mktemp("offload"),
    )
    fits = request.max_memory is None or estimate_training_memory(request).total <= budget_for_device(
        request.max_memory, "cpu")
    try:
        model = call_loader(reference_loader, request).model
    except LoaderError as exc:
        assert isinstance(exc.original, TrainingBudgetError), exc
        event("refused before loading")
        assert not fits
        return
    event("loaded whole")
    assert fits
    assert ground_truth.placement_problems(model, "cpu") == []
    assert ground_truth.train_step_problems(model, "cpu") == []
