"""zero3-device-map: a device_map under DeepSpeed ZeRO-3 (huggingface/peft#306, huggingface/accelerate#2543, ...).

The refusal reproduced in this process with a live stage-3 ``HfDeepSpeedConfig`` (removed again after each test,
and checked gone); then the check, on 2 gloo ranks with an accelerate ZeRO-3 plugin: it fails on the
before-loader (write-up 004's ``{"": LOCAL_RANK}``), passes on the reference loader and on a loader that asks
transformers whether ZeRO-3 is on, and skips a loader that builds the model outside ZeRO-3's ``zero.Init``.
"""

from __future__ import annotations

import gc
import os
import re

import pytest

from fixtures.loaders import before_zero3_device_map
from pytest_llmload import LoadRequest, call_loader
from pytest_llmload import failures as catalog
from pytest_llmload.failures import zero3_device_map as check
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as reference_loader
from pytest_llmload.fixes.reference_loader import placement_kwargs

pytestmark = [pytest.mark.timeout(120), pytest.mark.llmload_deepspeed]

ZERO3_ERROR = "DeepSpeed Zero-3 is not compatible with passing a `device_map`."
# transformers 4.x's text of the same refusal (huggingface/peft#306, huggingface/accelerate#2543).
ZERO3_ERROR_4X = "DeepSpeed Zero-3 is not compatible with `low_cpu_mem_usage=True` or with passing a `device_map`."


@pytest.fixture
def hf_deepspeed_config():
    """``make(stage)``: a live HfDeepSpeedConfig, as Trainer/accelerate keep one; gone again after the test."""
    pytest.importorskip("deepspeed")
    from transformers.integrations import HfDeepSpeedConfig, is_deepspeed_zero3_enabled
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    assert not is_deepspeed_zero3_enabled(), "a ZeRO-3 config leaked into this process before the test"
    alive = []

    def make(stage: int):
        config = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage}})
        alive.append(config)
        return config

    yield make
    unset_hf_deepspeed_config()
    alive.clear()
    gc.collect()
    assert not is_deepspeed_zero3_enabled()


def _no_launcher_env(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def _train_request(checkpoint, **fields):
    return LoadRequest(checkpoint, purpose="train", deepspeed=True, zero_stage=3, **fields)


# --- the failure, reproduced -------------------------------------------------------------------------------


@pytest.mark.parametrize("device_map", [{"": 0}, {"": "cpu"}, "cpu", "auto"], ids=["local-rank", "cpu-map", "cpu", "auto"])
def test_from_pretrained_refuses_any_device_map_under_zero3(hf_deepspeed_config, llmload_checkpoint, device_map):
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    hf_deepspeed_config(3)
    assert is_deepspeed_zero3_enabled()
    with pytest.raises(ValueError) as excinfo:
        AutoModelForCausalLM.from_pretrained(llmload_checkpoint, device_map=device_map, local_files_only=True)
    assert str(excinfo.value) == ZERO3_ERROR
    assert check.device_map_in_traceback(excinfo.value) == repr(device_map)


def test_the_before_loader_is_refused_under_zero3_and_loads_under_zero2(
    hf_deepspeed_config, llmload_checkpoint, monkeypatch
):
    # Write-up 004's fix is right under ZeRO-2 (every rank holds the whole model) and refused under ZeRO-3.
    _no_launcher_env(monkeypatch)
    config = hf_deepspeed_config(2)
    model = call_loader(before_zero3_device_map.load, LoadRequest(llmload_checkpoint, purpose="train",
                                                                   deepspeed=True, zero_stage=2)).model
    assert {str(p.device) for p in model.parameters()} == {"cpu"}
    del config
    hf_deepspeed_config(3)
    with pytest.raises(ValueError) as excinfo:
        before_zero3_device_map.load(_train_request(llmload_checkpoint))
    assert str(excinfo.value) == ZERO3_ERROR
    assert check.device_map_in_traceback(excinfo.value) == "{'': 'cpu'}"
    # Through the loader seam too: the refusal is found inside whatever call_loader wraps it in.
    with pytest.raises(Exception) as excinfo:
        call_loader(before_zero3_device_map.load, _train_request(llmload_checkpoint))
    assert str(check.zero3_refusal(excinfo.value)) == ZERO3_ERROR


def test_the_before_loader_is_write_up_004s_correct_fix(llmload_checkpoint, tmp_path):
    # The same loader trains under accelerate DeepSpeed ZeRO-2 and DDP on 2 ranks: only the stage makes it wrong.
    from pytest_llmload.failures import distributed_device_map

    distributed_device_map.check_distributed_train_step(before_zero3_device_map.load, llmload_checkpoint, tmp_path)


def test_both_texts_of_the_refusal_match_the_signature():
    assert check.FAILURE.matches(f"ValueError: {ZERO3_ERROR}")
    assert check.FAILURE.matches(f"ValueError: {ZERO3_ERROR_4X}")


def test_the_installed_transformers_still_has_the_refusal():
    # The text the signature and the tests rely on, where transformers raises it: check_and_set_device_map in
    # integrations/accelerate.py (5.x), inline in PreTrainedModel.from_pretrained where that helper does not exist
    # yet (4.56 raises the same text there; older 4.x added "`low_cpu_mem_usage=True` or with").
    import inspect

    from transformers.integrations import accelerate as hf_accelerate

    where = getattr(hf_accelerate, "check_and_set_device_map", None)
    if where is None:
        from transformers import PreTrainedModel

        where = PreTrainedModel.from_pretrained
    assert f'raise ValueError("{ZERO3_ERROR}")' in inspect.getsource(where)


# --- the check -------------------------------------------------------------------------------------------


def test_check_fails_on_the_before_loader(llmload_checkpoint, tmp_path):
    with pytest.raises(AssertionError) as excinfo:
        check.check_zero3_load(before_zero3_device_map.load, llmload_checkpoint, tmp_path)
    message = str(excinfo.value)
    assert message.startswith(
        "zero3-device-map: under DeepSpeed ZeRO-3 (an accelerate DeepSpeedPlugin with zero_optimization.stage=3, "
        "is_deepspeed_zero3_enabled() True before the load) the loader passed a device_map to from_pretrained on "
        "2 of 2 ranks (gloo, device='cpu'), and transformers refused it:"
    )
    for rank in (0, 1):
        assert (f"rank {rank}: from_pretrained(device_map={{'': 'cpu'}}) raised ValueError: {ZERO3_ERROR}"
                in message)
    assert not isinstance(excinfo.value, check.LoaderFailedOnRank)


def test_check_passes_on_the_reference_loader(llmload_checkpoint, tmp_path):
    check.check_zero3_load(reference_loader, llmload_checkpoint, tmp_path)


def load_asking_transformers(request):
    """Another style: keep write-up 004's ``{"": LOCAL_RANK}`` for DDP and ZeRO-0/1/2, and drop the device_map
    when transformers itself says ZeRO-3 is on (the request's deepspeed/zero_stage fields are not read)."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    kwargs = {} if is_deepspeed_zero3_enabled() else {"device_map": {"": request.device}}
    return AutoModelForCausalLM.from_pretrained(request.model_path, local_files_only=True, **kwargs)


def test_check_passes_on_a_loader_that_asks_transformers(llmload_checkpoint, tmp_path):
    check.check_zero3_load(load_asking_transformers, llmload_checkpoint, tmp_path)


def load_outside_zero3(request):
    """Builds the model with ZeRO-3 switched off for the load (the HF config unset, then put back): the model is
    whole on every rank, and from_pretrained never saw ZeRO-3."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        return AutoModelForCausalLM.from_pretrained(request.model_path, local_files_only=True,
                                                    device_map={"": request.device})
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def test_check_skips_a_loader_that_loads_outside_zero3(llmload_checkpoint, tmp_path):
    with pytest.raises(pytest.skip.Exception) as excinfo:
        check.check_zero3_load(load_outside_zero3, llmload_checkpoint, tmp_path)
    assert re.fullmatch(
        r"not exercised: check_zero3_load: the loader built the model outside ZeRO-3's zero.Init \(rank 0: none of "
        r"its \d+ parameters has a ds_id; is_deepspeed_zero3_enabled\(\) was True after the load\); "
        r"from_pretrained's device_map decision under ZeRO-3 was not exercised",
        str(excinfo.value.msg),
    ), excinfo.value.msg


def load_broken(request):
    raise KeyError("the loader's own bug")


def test_a_loaders_own_error_is_not_this_failure(llmload_checkpoint, tmp_path):
    with pytest.raises(check.LoaderFailedOnRank, match=r"KeyError: \"the loader's own bug\"") as excinfo:
        check.check_zero3_load(load_broken, llmload_checkpoint, tmp_path)
    assert not isinstance(excinfo.value, AssertionError)


def test_the_model_the_check_judges_is_partitioned_by_zero3(llmload_checkpoint, tmp_path):
    # The premise, seen from a rank: the reference loader's model comes out of zero.Init, every parameter
    # partitioned (ds_id set, the rank's own tensor empty, its shard half of ds_numel on 2 ranks).
    def load_and_measure(checkpoint):
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin

        Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(check.ZERO3_CONFIG)))
        model = call_loader(reference_loader, _train_request(checkpoint)).model
        params = list(model.parameters())
        return (sum(hasattr(p, "ds_id") for p in params), len(params), sum(p.numel() for p in params),
                sum(p.ds_numel for p in params), sum(p.ds_tensor.numel() for p in params))

    from pytest_llmload.runners import preload, ranks

    preload.preload(preload.DEEPSPEED_PRELOAD)
    results = ranks.run_ranks(load_and_measure, 2, args=(os.fspath(llmload_checkpoint),), timeout=120)
    assert results[0] == results[1]
    with_id, count, local, total, shard = results[0]
    assert with_id == count and local == 0 and total > 0 and shard * 2 >= total


# --- the reference loader's decision ---------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("environ", [{}, {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}], ids=["bare", "rank"])
def test_reference_loader_passes_no_device_map_under_zero3(monkeypatch, device, environ):
    # On cuda:0 too (the check's GPU setup): no device_map under deepspeed=True, whatever the stage.
    _no_launcher_env(monkeypatch)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert placement_kwargs(_train_request("/nowhere", device=device)) == {}


# --- the known-failure report ----------------------------------------------------------------------------


def test_a_real_refusal_is_named_zero3_device_map(pytester, llmload_checkpoint, request, monkeypatch):
    assert check.FAILURE in catalog.CATALOG
    pytester.syspathinsert(request.config.rootpath)
    pytester.makepyfile(f"""
        from transformers.integrations import HfDeepSpeedConfig
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config
        from fixtures.loaders import before_zero3_device_map
        from pytest_llmload import LoadRequest

        def test_load_under_zero3():
            config = HfDeepSpeedConfig({{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": 3}}}})
            try:
                before_zero3_device_map.load(LoadRequest({str(llmload_checkpoint)!r}, purpose="train",
                                                         deepspeed=True, zero_stage=3))
            finally:
                unset_hf_deepspeed_config()
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "E * ValueError: DeepSpeed Zero-3 is not compatible with passing a `device_map`.",
        "*- llmload: known failure -*",
        "[[]zero3-device-map[]] a device_map passed to from_pretrained under DeepSpeed ZeRO-3",
        "  write-up:   huggingface/peft#306, *",
    ])
    for other in catalog.CATALOG:
        if other is not check.FAILURE:
            assert f"[{other.id}]" not in result.stdout.str()


def test_no_overlap_with_the_other_catalog_entries():
    others = [failure for failure in catalog.CATALOG if failure.id != check.FAILURE.id]
    for text in (ZERO3_ERROR, ZERO3_ERROR_4X):
        assert [failure.id for failure in others if failure.matches(f"ValueError: {text}")] == []
    # Their errors (each signature's own text, regex syntax dropped) are not ours.
    for failure in others:
        for pattern in failure.signatures:
            text = re.sub(r"\(\?:([^)|]*)[^)]*\)\??|[\\?`]", r"\1", pattern)
            assert not check.FAILURE.matches(text), (failure.id, text)
