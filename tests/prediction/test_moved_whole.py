"""A model moved whole onto a device it does not fit is a predicted OOM there, on every path that moves it (issue 46,
point 6): Trainer's or DDP's move of a model loaded with no ``device_map``, DeepSpeed's engine (ZeRO-2 keeps a full
copy of the weights on every GPU, ZeRO-3 a partition), a loader's own ``.to()``. The sizes are the model's own
bytes, counted here by transformers (``get_memory_footprint`` of the same config built empty), not by the planner.

Phi-3-mini (7.6 GB in bfloat16) on a runner of 2 GPUs of 4 GiB stands for a 70B model on 80 GB cards: the same
mechanism, at a size that builds in a fraction of a second."""

import json

import pytest

from pytest_llmload.placement import architectures, profiles
from pytest_llmload.prediction import predict

pytestmark = [pytest.mark.llmload_deepspeed, pytest.mark.timeout(300)]

MODEL = "phi-3-mini"


def load_whole(request):
    """A train load as DDP and Trainer scripts write it: no device_map, the model loaded whole on the host."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(request.model_path, dtype=request.torch_dtype)


def load_whole_and_move(request):
    """The same, moved to its device by the loader itself."""
    return load_whole(request).to(request.device)


@pytest.fixture(scope="module")
def small_cards(tmp_path_factory):
    """2 GPUs of 4 GiB, a host that holds the model: only the GPU is too small."""
    path = tmp_path_factory.mktemp("profile") / "2x4GiB.json"
    path.write_text(json.dumps({"devices": 2, "device_memory": "4GiB", "host_memory": "64GiB", "disk": "100GiB"}))
    return profiles.load_profile(path)


@pytest.fixture(scope="module")
def model_bytes():
    """The model's bytes in bfloat16, as transformers itself counts them (not the planner's count)."""
    import torch

    config = architectures.load_config(MODEL)
    return config, architectures.empty_model(config, torch.bfloat16).get_memory_footprint()


@pytest.mark.parametrize("scenario", ["predict_train_load", "predict_launcher_ddp"])
def test_a_model_trained_without_a_device_map_is_moved_whole_to_its_gpu_and_does_not_fit(scenario, small_cards,
                                                                                         model_bytes, tmp_path):
    config, weights = model_bytes
    with pytest.raises(predict.PredictedFailure) as caught:
        getattr(predict, scenario)(load_whole, small_cards, config, MODEL, tmp_path)
    assert caught.value.failure == "OOM"
    assert "moved whole to cuda:0" in str(caught.value) and "no device_map" in str(caught.value)
    (device,) = caught.value.prediction["devices"]
    assert (device["device"], device["weights"], device["capacity"]) == ("cuda:0", weights, 4 * 2**30)
    assert device["peak"] >= weights and caught.value.prediction["device_map"] == {"": "cuda:0"}


def test_a_model_that_fits_its_gpu_is_predicted_there_with_its_exact_weights(model_bytes, tmp_path):
    config, weights = model_bytes
    prediction = predict.predict_launcher_ddp(load_whole, profiles.load_profile("2xH100-80GB"), config, MODEL,
                                              tmp_path)
    assert prediction.failure is None and prediction.placement == {"": "cuda:0"}
    assert [(d.device, d.weights) for d in prediction.devices] == [("cuda:0", weights)]
    assert "moved whole to cuda:0" in prediction.reason


def test_deepspeed_zero2_keeps_a_full_copy_of_the_weights_on_each_gpu(small_cards, model_bytes, tmp_path):
    config, weights = model_bytes
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_launcher_deepspeed(load_whole, small_cards, config, MODEL, tmp_path)
    assert caught.value.failure == "OOM" and "a full copy of the weights on each GPU" in str(caught.value)
    assert caught.value.prediction["devices"][0]["weights"] == weights


def test_the_loaders_own_move_of_the_whole_model_to_a_gpu_it_does_not_fit(small_cards, model_bytes, tmp_path):
    config, weights = model_bytes
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_moved_after_loading(load_whole_and_move, small_cards, config, MODEL, tmp_path)
    assert caught.value.failure == "OOM" and "moves the whole model" in str(caught.value)
    assert sum(d["weights"] for d in caught.value.prediction["devices"]) == weights


def test_an_inference_load_without_a_device_map_stays_on_the_host(small_cards, model_bytes, tmp_path):
    # (what the script does after loading is predict_moved_after_loading's: no move seen, no move predicted)
    config, weights = model_bytes
    prediction = predict.predict_inference_load(load_whole, small_cards, config, MODEL, tmp_path)
    assert prediction.failure is None and prediction.placement == {"": "cpu"}
