"""Runner profiles, full-size architectures and predictions (pytest_llmload.prediction; issue 26).

Where a prediction could drift from what the libraries would do, it is compared with them: with a real load where
this machine can be the runner (map for map), and with accelerate's own planner given the profile's memory."""

import json
from pathlib import Path

import pytest

from fixtures import warm_runs
from fixtures.loaders import before_dp_dtype, before_meta_backward
from pytest_llmload.placement import architectures, planner, profiles
from pytest_llmload.placement.planned import machine_of
from pytest_llmload.placement.simulated_devices import simulated
from pytest_llmload.prediction import predict
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as reference

pytestmark = [pytest.mark.llmload_deepspeed, pytest.mark.timeout(300)]

# Public parameter counts (the model cards): what each shipped config must build to.
PUBLIC_SIZE_B = {"llama-3-8b": 8.03, "llama-3-70b": 70.55, "qwen2.5-7b": 7.62, "qwen2.5-72b": 72.71,
                 "mistral-7b": 7.24, "mixtral-8x7b": 46.70, "gemma-2-9b": 9.24, "phi-3-mini": 3.82}


# --- profiles and architectures --------------------------------------------------------------------------------


def test_the_shipped_profiles_cover_the_runners_people_have_and_say_where_each_figure_comes_from():
    names = profiles.shipped_names()
    assert {"cpu-only", "1x24GB-RTX4090", "1xH100-80GB", "2xH100-80GB", "4xH100-80GB", "8xH100-80GB",
            "8xA100-80GB", "8xH200-141GB"} <= set(names)
    for name in names:
        profile = profiles.load_profile(name)
        data = json.loads(Path(profile.source).read_text())
        assert set(data["sources"]) >= {"host_memory", "disk"} | ({"device_memory"} if profile.devices else set())
        assert profile.max_memory["cpu"] == profile.host_memory
        assert [k for k in profile.max_memory if k != "cpu"] == list(range(profile.devices))


def test_a_profile_of_ones_own_is_a_json_file(tmp_path):
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"devices": 2, "device_memory": "40GiB", "host_memory": "256GiB", "disk": "1TB"}))
    profile = profiles.load_profile(str(mine))
    assert (profile.name, profile.devices, profile.device_memory) == ("mine", 2, 40 * 2**30)


@pytest.mark.parametrize(("value", "said"), [
    ("8xH100", "is neither a shipped runner profile"),
    ("{bad}", "cannot be read"),
    ('{"devices": -1, "host_memory": "1GiB"}', "devices=-1 is not a count of GPUs"),
    ('{"devices": 1, "device_memory": "lots", "host_memory": "1GiB"}', "device_memory 'lots' is not a size"),
    # Hostile files (issue 36): refused before anything is allocated for them, as usage errors, never a traceback.
    ('{"devices": 100000000, "device_memory": "80GiB", "host_memory": "1GiB"}', "more GPUs than one runner holds"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
    ('{"devices": 1, "pad": "' + "x" * (2 << 20) + '"}', "more than the 1.0 MiB such a file ever needs"),
    ("[1, 2]", "holds a JSON list, not an object"),
], ids=["unknown", "not-json", "negative-devices", "bad-size", "1e8-devices", "nested", "2MiB", "list"])
def test_a_bad_profile_says_what_and_where(tmp_path, value, said):
    if value.startswith(("{", "[")):
        path = tmp_path / "bad.json"
        path.write_text(value)
        value = str(path)
    with pytest.raises(profiles.ProfileError, match=said):
        profiles.load_profile(value)


@pytest.fixture(scope="module")
def empty_bf16_model():
    """``empty_bf16_model(name)``: the shipped architecture's empty (meta) bfloat16 model, built once per test process
    and module (0.1-0.3 s each; the prediction table asks for each one seven times). The tests only read it."""
    import torch

    built = {}

    def build(name: str):
        if name not in built:
            built[name] = architectures.empty_model(architectures.load_config(name), torch.bfloat16)
        return built[name]

    return build


@pytest.mark.parametrize("name", sorted(PUBLIC_SIZE_B))
def test_each_shipped_architecture_builds_empty_at_its_public_size(name, empty_bf16_model):
    model = empty_bf16_model(name)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert architectures.parameter_count(model) / 1e9 == pytest.approx(PUBLIC_SIZE_B[name], rel=0.01)


@pytest.mark.parametrize(("change", "said"), [
    ({"hidden_size": 10**9}, r"hidden_size=1000000000 is not a size a model has"),
    ({"num_hidden_layers": 10**6, "hidden_size": 10**5}, r"about .* parameters, more than the 1e\+13"),
    ({"vocab_size": "big"}, "vocab_size='big' is not a size"),
])
def test_a_config_of_no_real_model_is_refused_before_anything_is_built(tmp_path, change, said):
    config = {**architectures.load_config("llama-3-8b"), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(architectures.ArchitectureError, match=said):
        architectures.load_config(tmp_path)


def test_an_unknown_model_says_what_to_pass():
    with pytest.raises(architectures.ArchitectureError, match="neither a shipped architecture"):
        architectures.load_config("llama-9-1t")


# --- the predicted placement against the libraries ----------------------------------------------------------------


def _accelerate_direct(model, profile, dtype) -> dict:
    """What accelerate's own planner gives when handed the profile's max_memory directly (on the profile's
    simulated GPUs: accelerate < 1.15 resolves each GPU key with torch.device, which needs an accelerator)."""
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    no_split = model._no_split_modules
    with simulated(machine_of(profile)):
        balanced = get_balanced_memory(model, max_memory=dict(profile.max_memory), no_split_module_classes=no_split,
                                       dtype=dtype)
    planned = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split, dtype=dtype)
    return {name: str(where) for name, where in planned.items()}


def _from_pretrained_direct(model, profile, dtype) -> dict:
    """The planner from_pretrained itself uses, handed the profile's max_memory directly: transformers' own copy of
    accelerate's functions from 5.x (``transformers.integrations.accelerate``), accelerate's before."""
    try:
        from transformers.integrations.accelerate import get_balanced_memory, infer_auto_device_map
    except ImportError:
        return _accelerate_direct(model, profile, dtype)
    no_split = model._no_split_modules
    balanced = get_balanced_memory(model, max_memory=profile.max_memory, no_split_module_classes=no_split)
    planned = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split)
    return {name: str(where) for name, where in planned.items()}


TABLE = [pytest.param(arch, runner, id=f"{arch}@{runner}") for arch in sorted(PUBLIC_SIZE_B)
         for runner in ("1x24GB-RTX4090", "1xH100-80GB", "2xH100-80GB", "4xH100-80GB", "8xH100-80GB",
                        "8xA100-80GB", "8xH200-141GB")]


@pytest.mark.parametrize(("arch", "runner"), TABLE)
def test_the_prediction_through_the_loader_equals_the_planner_given_the_profiles_memory(arch, runner, tmp_path,
                                                                                         empty_bf16_model):
    """The reference loader's inference load on the runner (device_map="auto" under the runner's max_memory), as
    predicted through its intercepted from_pretrained, against from_pretrained's planner called directly."""
    import torch

    profile, config = profiles.load_profile(runner), architectures.load_config(arch)
    prediction = predict.predict_inference_load(reference, profile, config, arch, tmp_path)
    model = empty_bf16_model(arch)  # the planners only read it
    assert prediction.placement == _from_pretrained_direct(model, profile, torch.bfloat16)


def test_where_transformers_5_and_accelerate_plan_differently_it_is_transformers_that_loads():
    """transformers 5 plans with its own copy of accelerate's functions; for Llama-3-8B on 8 GPUs they disagree on
    5.23 (5.17 plans it alike). from_pretrained uses transformers' (the CPU map-for-map test shows it), so that is
    what is predicted."""
    import torch
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers < 5 plans with accelerate's own functions")
    profile = profiles.load_profile("8xH100-80GB")
    model = architectures.empty_model(architectures.load_config("llama-3-8b"), torch.bfloat16)
    predicted = planner.plan(model, "auto", profile.max_memory, dtype=torch.bfloat16)
    assert predicted == _from_pretrained_direct(model, profile, torch.bfloat16)
    if predicted == _accelerate_direct(model, profile, torch.bfloat16):  # (5.17 plans it alike; 5.23 does not)
        pytest.skip(f"transformers {transformers.__version__} and accelerate plan Llama-3-8B on 8 GPUs alike")


@pytest.mark.parametrize("strategy", planner.STRATEGIES)
def test_on_a_cpu_runner_the_predicted_map_is_the_real_loads_map(strategy, llmload_checkpoint, tmp_path):
    """This machine can be a CPU runner whose budget forces offload to disk: predicted and real, map for map."""
    import torch
    from transformers import AutoModelForCausalLM

    from pytest_llmload.checks.ground_truth import offload_budget

    budget = offload_budget(llmload_checkpoint)  # half the weights: the rest goes to disk
    model = architectures.empty_model(architectures.load_config(llmload_checkpoint), torch.float32)
    predicted = planner.plan(model, strategy, dict(budget), dtype=torch.float32)
    real = AutoModelForCausalLM.from_pretrained(llmload_checkpoint, device_map=strategy, max_memory=dict(budget),
                                                offload_folder=tmp_path / "offload", dtype=torch.float32,
                                                local_files_only=True)
    assert predicted == {name: str(where) for name, where in real.hf_device_map.items()}
    assert "disk" in predicted.values()


# --- the write-ups' own situations, predicted -----------------------------------------------------------------


def write_up_004(request):
    """core/model_utils.py before its fix, as write-up 004 prints it: device_map="auto" whatever the environment
    says. (fixtures/loaders/before_distributed_device_map.py adds a budget so that the map spreads on a CPU-only
    machine; on a runner with GPUs the write-up's own line spreads by itself.)"""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(request.model_path, device_map="auto", dtype=request.torch_dtype,
                                                trust_remote_code=True)


def test_write_up_004s_loader_on_two_gpus_under_deepspeed_predicts_its_refusal(tmp_path):
    profile, config = profiles.load_profile("2xH100-80GB"), architectures.load_config("llama-3-8b")
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_launcher_deepspeed(write_up_004, profile, config, "llama-3-8b", tmp_path)
    assert caught.value.failure == "distributed-device-map"
    assert "You can't train a model that has been loaded with `device_map='auto'` in any distributed mode" \
        in str(caught.value)
    assert "rank 0 of 2 under torchrun's environment" in str(caught.value)


def test_write_up_002s_loader_on_a_24gb_card_with_a_7b_model_predicts_the_meta_backward(tmp_path):
    profile, config = profiles.load_profile("1x24GB-RTX4090"), architectures.load_config("qwen2.5-7b")
    budget = {0: "14GB", "cpu": "50GB"}  # the write-up's own max_memory
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_train_load(before_meta_backward.load, profile, config, "qwen2.5-7b", tmp_path,
                                   max_memory=budget)
    assert caught.value.failure == "meta-backward" and "offloaded" in str(caught.value)


def test_the_reference_loader_refuses_that_budget_instead(tmp_path):
    profile, config = profiles.load_profile("1x24GB-RTX4090"), architectures.load_config("qwen2.5-7b")
    prediction = predict.predict_train_load(reference, profile, config, "qwen2.5-7b", tmp_path,
                                            max_memory={0: "14GB", "cpu": "50GB"})
    assert prediction.failure is None and "refuses the train load" in prediction.reason


def test_write_up_003s_4bit_loader_on_two_gpus_predicts_trainers_n_gpu_decision(llmload_checkpoint, tmp_path):
    from pytest_llmload.failures.dp_dtype import four_bit_refusal

    if four_bit_refusal() is not None:
        pytest.skip(four_bit_refusal())
    profile, config = profiles.load_profile("2xH100-80GB"), architectures.load_config("llama-3-8b")
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_trainer(before_dp_dtype.load, profile, config, "llama-3-8b", tmp_path, llmload_checkpoint)
    assert caught.value.failure == "dp-dtype" and "n_gpu=2" in str(caught.value)
    # What Trainer does on this stack (issue 46): 4.x wraps the 4-bit model in DataParallel; 5.x only counts the GPUs.
    from importlib import metadata

    on_4x = metadata.version("transformers").startswith("4.")
    said = (", Trainer wraps the loader's 4-bit model in nn.DataParallel (n_gpu=2" if on_4x else
            ", Trainer does not wrap a 4-bit model in nn.DataParallel, but counts n_gpu=2: each step takes 2x the "
            "per-device batch")
    assert f"on transformers {metadata.version('transformers')}{said}" in str(caught.value)
    assert "seed 003" not in str(caught.value) and caught.value.prediction["failure"] == "dp-dtype"


def test_a_70b_on_eight_gpus_with_the_reference_loader(tmp_path):
    profile, config = profiles.load_profile("8xH100-80GB"), architectures.load_config("llama-3-70b")
    inference = predict.predict_inference_load(reference, profile, config, "llama-3-70b", tmp_path)
    assert {d.device for d in inference.devices} == {f"cuda:{i}" for i in range(8)}
    assert sum(d.weights for d in inference.devices) == pytest.approx(70.55e9 * 2, rel=0.01)
    # Full fine-tune of 70B under ZeRO-3 on one node, no offload: DeepSpeed's own estimate is over 80 GB a GPU.
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_zero3(reference, profile, config, "llama-3-70b", tmp_path)
    assert caught.value.failure == "OOM" and "estimate_zero3_model_states_mem_needs" in str(caught.value)


# --- which failure each scenario predicts ---------------------------------------------------------------------------


def test_each_scenario_predicts_the_failure_it_names_in_the_order_predict_defines_them():
    from pytest_llmload.failures import BY_ID, CATALOG

    rows = [(scenario.name, scenario.failure.id, scenario.needs_gpus) for scenario in predict.scenarios()]
    assert rows == [("predict_inference_load", "offload-hang", 0), ("predict_train_load", "meta-backward", 0),
                    ("predict_trainer", "dp-dtype", 2), ("predict_launcher_ddp", "distributed-device-map", 2),
                    ("predict_launcher_deepspeed", "distributed-device-map", 2), ("predict_zero3", "zero3-device-map", 1),
                    ("predict_moved_after_loading", "move-offloaded", 0),
                    ("predict_adapter_on_offloaded", "adapter-on-offloaded", 0),
                    ("predict_quantized_cast", "quantized-cast", 0)]
    assert all(scenario.failure is BY_ID[scenario.failure.id] for scenario in predict.scenarios())
    # The prediction names its failure; the catalog, a layer below, names no prediction.
    assert not any(hasattr(failure, "predicted_by") for failure in CATALOG)


def test_a_scenario_that_predicts_a_failure_the_catalog_lacks_is_an_error_naming_it(monkeypatch):
    from pytest_llmload import failures

    monkeypatch.setattr(failures, "BY_ID", {k: v for k, v in failures.BY_ID.items() if k != "quantized-cast"})
    with pytest.raises(LookupError, match=r"scenarios predict failures the catalog lacks: "
                                          r"\{'predict_quantized_cast': 'quantized-cast'\}"):
        predict.scenarios()


# --- the plugin surface -------------------------------------------------------------------------------------------


def test_predictions_run_only_for_a_named_runner_and_are_marked(pytester):
    pytester.makeini("[pytest]\nllmload_runner = 1x24GB-RTX4090\nllmload_model = phi-3-mini\n")
    # Each run in its own process, forked from this one (fixtures/warm_runs.py): no new interpreter's imports.
    result = warm_runs.runpytest(pytester, "--pyargs", "pytest_llmload.suite", "-k", "predict_inference_load",
                                 "-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*test_prediction?predict_inference_load@1x24GB-RTX4090?*"])
    plain = warm_runs.runpytest(pytester, "--pyargs", "pytest_llmload.suite", "-k", "predict", "-p",
                                "no:cacheprovider", "-o", "llmload_runner=")
    plain.assert_outcomes()  # not collected at all without a runner


def test_a_runner_that_is_not_a_profile_is_a_usage_error(pytester):
    # Its own process, forked from this one (fixtures/warm_runs.py): what the run decides, not its interpreter.
    result = warm_runs.runpytest(pytester, "--llmload-runner", "8xH100", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--llmload-runner '8xH100' is neither a shipped runner profile*"])


def test_the_main_job_lists_runners_and_models_and_refuses_a_bad_one(capsys):
    from pytest_llmload.main_job import cli, process

    assert cli.run(["--list-runners"]) == process.EXIT_OK
    assert "8xH100-80GB: 8 x NVIDIA H100 80GB HBM3 (79.6 GiB each)" in capsys.readouterr().out
    assert cli.run(["--list-models"]) == process.EXIT_OK
    assert "llama-3-70b (llama, 80 layers)" in capsys.readouterr().out
    assert cli.run(["--runner", "8xH100"]) == process.EXIT_USAGE
    assert "--runner '8xH100' is neither a shipped runner profile" in capsys.readouterr().err
    assert cli.run(["--model", "llama-3-70b"]) == process.EXIT_USAGE
    assert "add --runner" in capsys.readouterr().err


@pytest.mark.parametrize(("scenario", "failure", "model"), [
    ("predict_moved_after_loading", "move-offloaded", "llama-3-70b"),
    ("predict_adapter_on_offloaded", "adapter-on-offloaded", "llama-3-70b"),
    ("predict_quantized_cast", "quantized-cast", "llama-3-8b"),
])
def test_what_a_before_loader_does_after_loading_is_predicted_on_a_runner_that_offloads(scenario, failure, model,
                                                                                        tmp_path):
    """A 70B model on a 24 GB card offloads; the before-loaders then move it or put an adapter on it. The 4-bit one
    loads whole on the card, then casts it: an 8B (a 4-bit 70B is 34 GiB, an OOM at the load, before any cast)."""
    import importlib

    module = importlib.import_module(f"fixtures.loaders.before_{failure.replace('-', '_')}")
    profile, config = profiles.load_profile("1x24GB-RTX4090"), architectures.load_config(model)
    with pytest.raises(predict.PredictedFailure) as caught:
        getattr(predict, scenario)(module.load, profile, config, model, tmp_path)
    assert caught.value.failure == failure, str(caught.value)


def test_the_reference_loader_does_nothing_after_loading_that_the_runner_would_refuse(tmp_path):
    profile, config = profiles.load_profile("1x24GB-RTX4090"), architectures.load_config("llama-3-70b")
    moved = predict.predict_moved_after_loading(reference, profile, config, "llama-3-70b", tmp_path / "m")
    assert moved.failure is None and "no move or cast" in moved.reason
    adapter = predict.predict_adapter_on_offloaded(reference, profile, config, "llama-3-70b", tmp_path / "a")
    assert adapter.failure is None and "refuses the inference load, naming the budget" in adapter.reason
    # 4-bit 70B does not fit 24 GB: transformers' own check of the planned map refuses it there (not a cast).
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_quantized_cast(reference, profile, config, "llama-3-70b", tmp_path / "q")
    assert caught.value.failure == "OOM" and "Some modules are dispatched on the CPU or the disk" in str(caught.value)
    assert predict.predict_quantized_cast(reference, profile, architectures.load_config("llama-3-8b"), "llama-3-8b",
                                          tmp_path / "q8").failure is None


def test_a_transformers_too_old_for_the_planner_is_one_usage_error(pytester, monkeypatch):
    # The lowest declared stack (transformers 4.46) lacks the placement helper the predictions run.
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "4.46.3" if name == "transformers" else real(name))
    pytester.makepyfile("def test_one(): pass\n")
    result = pytester.runpytest("--llmload-runner", "8xH100-80GB")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--llmload-runner '8xH100-80GB': the predictions need transformers >= 4.56*"
                                 "this environment has 4.46.3*"])


def test_an_empty_runner_setting_reads_as_unset(pytester):
    # (`--llmload-runner=$RUNNER` with RUNNER unset in a CI file: no predictions, and no empty prediction module)
    result = pytester.runpytest("--pyargs", "pytest_llmload.suite", "--collect-only", "-q", "--llmload-runner=")
    assert result.ret == pytest.ExitCode.OK
    assert "test_predictions" not in result.stdout.str()
