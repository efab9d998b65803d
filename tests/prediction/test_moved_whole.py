"""A model moved whole onto a device it does not fit is a predicted OOM there, on every path that moves it (issue 46,
point 6): Trainer's or DDP's move of a model loaded with no ``device_map``, DeepSpeed's engine (ZeRO-2 keeps a full
copy of the weights on every GPU, ZeRO-3 a partition), a loader's own ``.to()``. The sizes are exact: the bytes
from_pretrained's planner counts for the model in the planned dtype, its parameters' to the byte.

Phi-3-mini (7.6 GB in bfloat16) on a runner of 2 GPUs of 4 GiB stands for a 70B model on 80 GB cards: the same
mechanism, at a size that builds in a fraction of a second."""

import inspect
import json

import pytest

from pytest_llmload.placement import architectures, planner, profiles
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
    """The model's bytes in bfloat16 as from_pretrained's planner counts them (its parameters, and its buffers as
    each stack counts them: the rotary inv_freq, 96 to 384 bytes), on a model built here."""
    import torch

    config = architectures.load_config(MODEL)
    model = architectures.empty_model(config, torch.bfloat16)
    counted = planner.shares(model, {"": "cpu"}, dtype=torch.bfloat16)["cpu"].bytes
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    assert parameters <= counted <= parameters + sum(b.numel() * 4 for b in model.buffers())
    return config, counted


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


# --- a placement made after loading (accelerate's dispatch_model, load_checkpoint_and_dispatch) ---------------------


def load_and_serve(request):
    """A served model as some servers place it: loaded whole on the host, then dispatched over the GPUs."""
    from accelerate import dispatch_model, infer_auto_device_map

    model = load_whole(request)
    device_map = infer_auto_device_map(model, max_memory=request.max_memory,
                                       no_split_module_classes=model._no_split_modules)
    return dispatch_model(model, device_map=device_map)


def build_and_dispatch(request):
    """Built empty, then accelerate loads the checkpoint into it and places it (its "auto": balanced over the GPUs)."""
    from accelerate import init_empty_weights, load_checkpoint_and_dispatch
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(request.model_path),
                                                 dtype=request.torch_dtype)
    return load_checkpoint_and_dispatch(model, str(request.model_path), device_map="auto", dtype=request.torch_dtype,
                                        no_split_module_classes=model._no_split_modules)


def _accelerates_own(profile, max_memory, *, balanced: bool) -> dict:
    """The map accelerate makes for the model on the runner, its functions called directly."""
    import torch
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    from pytest_llmload.placement.planned import machine_of
    from pytest_llmload.placement.simulated_devices import simulated

    model = architectures.empty_model(architectures.load_config(MODEL), torch.bfloat16)
    no_split = model._no_split_modules
    with simulated(machine_of(profile)):
        if balanced:
            max_memory = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split,
                                             dtype=torch.bfloat16)
        placed = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split,
                                       dtype=torch.bfloat16)
    return {name: str(where) for name, where in placed.items()}


@pytest.mark.parametrize(("loader", "balanced"), [(load_and_serve, False), (build_and_dispatch, True)])
def test_a_placement_made_after_loading_is_planned_as_from_pretrained_s_is(loader, balanced, model_bytes, tmp_path):
    config, weights = model_bytes
    profile = profiles.load_profile("2xH100-80GB")
    prediction = predict.predict_inference_load(loader, profile, config, MODEL, tmp_path)
    expected = _accelerates_own(profile, None if balanced else profile.max_memory, balanced=balanced)
    assert prediction.placement == expected and any(where == "0" for where in expected.values())
    assert sum(d.weights for d in prediction.devices) == weights
    lines, first = inspect.getsourcelines(loader)  # the loader's own line that placed it
    placed_at = first + next(n for n, line in enumerate(lines) if line.lstrip().startswith("return "))
    assert prediction.at.endswith(f"test_moved_whole.py:{placed_at}")
