"""LoadRequest: immutable, normalised, and clear about bad values."""

import copy
import pickle

import pytest

from pytest_llmload import LoadRequest


def test_is_frozen_and_normalised(tmp_path):
    request = LoadRequest(tmp_path, dtype="bf16", max_memory={0: "1GiB", "cpu": "2GiB"}, offload_folder=tmp_path / "off")
    assert request.model_path == str(tmp_path) and request.offload_folder == str(tmp_path / "off")
    assert request.dtype == "bfloat16"
    assert type(request.max_memory) is dict and request.max_memory == {0: "1GiB", "cpu": "2GiB"}
    assert request.max_memory_dict == {0: "1GiB", "cpu": "2GiB"}
    with pytest.raises(AttributeError):
        request.purpose = "train"


def test_max_memory_is_a_plain_value_each_request_owns(tmp_path):
    """A loader passes ``max_memory=request.max_memory`` to from_pretrained, which deep-copies it (issue 15:
    a mappingproxy here failed two checks with 'cannot pickle')."""
    budget = {0: "1GiB", "cpu": "2GiB"}
    request = LoadRequest(tmp_path, max_memory=budget)
    budget["cpu"] = "9GiB"
    assert request.max_memory == {0: "1GiB", "cpu": "2GiB"}
    assert copy.deepcopy(request.max_memory) == request.max_memory
    assert pickle.loads(pickle.dumps(request)) == request


def test_zero_stage_is_deepspeeds(tmp_path):
    assert LoadRequest(tmp_path, deepspeed=True, zero_stage=3).zero_stage == 3
    with pytest.raises(ValueError, match="zero_stage=3 needs deepspeed=True"):
        LoadRequest(tmp_path, zero_stage=3)
    with pytest.raises(ValueError, match="zero_stage=4; expected None, 0, 1, 2 or 3"):
        LoadRequest(tmp_path, deepspeed=True, zero_stage=4)


@pytest.mark.timeout(60)
def test_a_loader_passes_the_budget_to_from_pretrained_as_it_is(llmload_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    from pytest_llmload.checks.ground_truth import offload_budget
    from pytest_llmload.loader.transformers_compat import dtype_kwarg

    request = LoadRequest(llmload_checkpoint, max_memory=offload_budget(llmload_checkpoint),
                          offload_folder=tmp_path / "offload")
    model = AutoModelForCausalLM.from_pretrained(request.model_path, device_map="auto", max_memory=request.max_memory,
                                                 offload_folder=request.offload_folder,
                                                 **dtype_kwarg(request.torch_dtype))
    assert "disk" in set(model.hf_device_map.values())


def test_replace_makes_a_new_request():
    base = LoadRequest("/ckpt")
    train = base.replace(purpose="train", lora=True)
    assert (base.purpose, base.lora) == ("inference", False)
    assert (train.purpose, train.lora) == ("train", True)


def test_torch_dtype_accepts_torch_dtypes():
    torch = pytest.importorskip("torch")
    assert LoadRequest("/ckpt", dtype=torch.float16).torch_dtype is torch.float16


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"purpose": "training"}, ValueError, "LoadRequest.purpose='training'; expected 'inference' or 'train'."),
        ({"quantization": "4-bit"}, ValueError, "LoadRequest.quantization='4-bit'; expected None, '4bit' or '8bit'."),
        ({"dtype": "int8"}, ValueError, "LoadRequest.dtype='int8' is not supported; use one of float32, float16, bfloat16."),
        ({"max_memory": "10GiB"}, TypeError, "LoadRequest.max_memory='10GiB' must be a mapping*"),
        ({"lora": "yes"}, TypeError, "LoadRequest.lora='yes' must be True or False."),
    ],
)
def test_bad_values_say_what_was_given_and_what_is_expected(fields, error, message):
    import fnmatch

    with pytest.raises(error) as info:
        LoadRequest("/ckpt", **fields)
    assert fnmatch.fnmatchcase(str(info.value), message), str(info.value)
