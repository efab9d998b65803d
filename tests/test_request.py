"""LoadRequest: immutable, normalised, and clear about bad values."""

import types

import pytest

from pytest_llmload import LoadRequest


def test_is_frozen_and_normalised(tmp_path):
    request = LoadRequest(tmp_path, dtype="bf16", max_memory={0: "1GiB", "cpu": "2GiB"}, offload_folder=tmp_path / "off")
    assert request.model_path == str(tmp_path) and request.offload_folder == str(tmp_path / "off")
    assert request.dtype == "bfloat16"
    assert isinstance(request.max_memory, types.MappingProxyType)
    assert request.max_memory_dict == {0: "1GiB", "cpu": "2GiB"}
    with pytest.raises(AttributeError):
        request.purpose = "train"
    with pytest.raises(TypeError):
        request.max_memory["cpu"] = "9GiB"


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
