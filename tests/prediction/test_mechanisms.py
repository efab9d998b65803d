"""A failure is predicted only where its mechanism is (issue 38, point 2): offload is what a device map with an
accelerator in it sends to cpu or disk, never a model whole on the host; the ZeRO-3 refusal inside the simulated
set-up; each launcher rank with its budget; the repo's declarations honoured; peft's and torch.cuda's answers as
on the runner. Every predicted failure names the loader's line that reaches it."""

import importlib
import os
import sys

import pytest

from fixtures import warm_runs
from pytest_llmload.loader.seam import LoaderChoice, as_loader_under_test, import_loader
from pytest_llmload.placement import architectures, planner, profiles
from pytest_llmload.prediction import interception, predict, simulated_machine

pytestmark = [pytest.mark.llmload_deepspeed, pytest.mark.timeout(300)]

GPU_RUNNERS = ("1x24GB-RTX4090", "2xH100-80GB", "8xH100-80GB")


def _runner(name: str):
    return profiles.load_profile(name)


def _model(name: str) -> dict:
    return architectures.load_config(name)


def _corpus(name: str):
    """A corpus loader as the plugin takes it, with what it declares (fixtures/corpus/)."""
    spec = f"fixtures.corpus.{name}:load"
    return as_loader_under_test(import_loader(LoaderChoice(spec, "fixtures/corpus")), name=spec)


def _line_of(module, text: str) -> str:
    """``path:line`` of the first line of ``module`` holding ``text``, as rows name it."""
    path = os.path.relpath(module.__file__)
    with open(module.__file__, encoding="utf-8") as source:
        number = next(i for i, line in enumerate(source, 1) if text in line)
    return f"{path}:{number}"


# --- loaders written the way the failures' fixes tell repos to write them -----------------------------------------


def whole_on_the_host(request):
    """The usual DDP/DeepSpeed training load (write-up 004's fix): no device_map at all, the model whole on the host;
    the training script (or the engine) moves it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(request.model_path, dtype=request.torch_dtype)


def whole_on_the_host_then_moved(request):
    """Loaded whole on the host, then moved whole to the request's device: no offload to refuse."""
    model = whole_on_the_host(request)
    return model.to(request.device)  # the move


def adapter_merged_and_dispatched(request):
    """The adapter fix's line (pytest_llmload/fixes/adapters.py): the base whole on the host, the adapter put on it,
    merged, and the merged model dispatched under the budget."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from pytest_llmload.fixes.adapters import merge_and_dispatch

    base = AutoModelForCausalLM.from_pretrained(request.model_path, dtype=request.torch_dtype, device_map={"": "cpu"})
    if request.adapter_path is None:
        return base
    return merge_and_dispatch(PeftModel.from_pretrained(base, request.adapter_path), request.max_memory_dict,
                              request.offload_folder)


SEEN_BY_THE_LOADER: list = []


def asks_torch_cuda(request):
    """A launcher script's own device logic: torch.cuda's answers decide where the rank's model goes."""
    import torch
    from transformers import AutoModelForCausalLM

    if "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    with torch.cuda.device(torch.cuda.current_device()):
        SEEN_BY_THE_LOADER.append({
            "available": torch.cuda.is_available(), "count": torch.cuda.device_count(),
            "current": torch.cuda.current_device(), "name": torch.cuda.get_device_name(),
            "free": torch.cuda.mem_get_info()[0], "capability": torch.cuda.get_device_capability(),
            "allocated": torch.cuda.memory_allocated()})
    return AutoModelForCausalLM.from_pretrained(request.model_path, dtype=request.torch_dtype,
                                                device_map={"": torch.cuda.current_device()})


def places_by_its_budget(request):
    """Spreads the model by ``device_map="auto"`` over the budget it is given, else loads it whole on the host."""
    from transformers import AutoModelForCausalLM

    placement = {"device_map": "auto", "max_memory": request.max_memory_dict} if request.max_memory is not None else {}
    return AutoModelForCausalLM.from_pretrained(request.model_path, dtype=request.torch_dtype, **placement)


def retries_without_the_map(request):
    """Catches transformers' ZeRO-3 refusal of a device_map and loads again without one."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(request.model_path, device_map={"": request.device})
    except ValueError as refusal:
        assert "ZeRO-3" in str(refusal) or "Zero-3" in str(refusal)
        return AutoModelForCausalLM.from_pretrained(request.model_path)


ASKED_DTYPES: list = []


def only_float16(request):
    ASKED_DTYPES.append(request.dtype)
    return whole_on_the_host(request)


only_float16.llmload_dtypes = ("float16",)


def trains_only_under_deepspeed(request):
    return whole_on_the_host(request)


trains_only_under_deepspeed.llmload_trains_under_deepspeed = True


def never_quantized(request):
    return whole_on_the_host(request)


never_quantized.llmload_not_applicable = {"check_quantized_request_keeps_dtype": "we never quantize"}


# --- false alarms --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("runner", GPU_RUNNERS)
def test_a_model_whole_on_the_host_is_not_offloaded(runner, tmp_path):
    """No device_map: from_pretrained loads the model whole on the cpu. That is no offload: no meta-backward for the
    train load, no move-offloaded when the loader then moves it whole (issue 38: both were predicted on every GPU
    profile, "1 module on cpu/disk, e.g. ['']")."""
    profile, config = _runner(runner), _model("llama-3-8b")
    train = predict.predict_train_load(whole_on_the_host, profile, config, "llama-3-8b", tmp_path / "t")
    # (to be trained, it is then moved whole to its GPU, where it fits: issue 46)
    assert train.failure is None and train.placement == {"": "cuda:0"}
    assert "no device_map: loaded whole on the host, then moved whole to cuda:0 to be trained" in train.reason
    moved = predict.predict_moved_after_loading(whole_on_the_host_then_moved, profile, config, "llama-3-8b",
                                                tmp_path / "m")
    assert moved.failure is None and "no offload" in moved.reason
    assert f".to('cuda:0') at {_line_of(sys.modules[__name__], 'return model.to(request.device)  # the move')}" \
        in moved.reason


@pytest.mark.parametrize("name", ["alignment_handbook_sft", "deepspeed_chat_hf_model", "lmflow_hf_decoder",
                                  "open_instruct_finetune"])
def test_corpus_training_loads_without_a_device_map_are_not_predicted_meta_backward(name, tmp_path):
    profile, config = _runner("2xH100-80GB"), _model("llama-3-8b")
    prediction = predict.predict_train_load(_corpus(name), profile, config, "llama-3-8b", tmp_path)
    assert prediction.failure is None and prediction.placement == {"": "cuda:0"}  # (moved whole to its GPU)


def test_offload_is_a_map_with_an_accelerator_sending_modules_to_cpu_or_disk():
    assert interception.offloaded({"": "cpu"}) == []
    assert interception.offloaded({"a": "cpu", "b": "disk"}) == ["b"]  # a cpu runner: the cpu computes, disk is offload
    assert interception.offloaded({"a": 0, "b": "cpu", "c": "disk"}) == ["b", "c"]
    assert interception.offloaded({"a": "cuda:0", "b": "cuda:1"}) == []


def test_a_model_moved_whole_to_a_gpu_too_small_is_an_oom_at_the_move(tmp_path):
    profile, config = _runner("1xH100-80GB"), _model("llama-3-70b")  # 131 GiB: the host holds it, the GPU does not
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_moved_after_loading(whole_on_the_host_then_moved, profile, config, "llama-3-70b", tmp_path)
    assert caught.value.failure == "OOM"
    assert "the loader moves the whole model" in str(caught.value)
    assert _line_of(sys.modules[__name__], "return model.to(request.device)  # the move") in str(caught.value)


# --- peft and torch.cuda as on the runner ----------------------------------------------------------------------------


@pytest.mark.parametrize("runner", ["1x24GB-RTX4090", "8xH100-80GB"])
def test_the_adapter_fix_line_runs_on_peft_s_own_objects(runner, tmp_path):
    """Base whole on the host, PeftModel.from_pretrained, merge_and_unload, dispatch: peft's own PeftModel on the
    empty weights, so merge_and_unload is there (issue 38: "'LlamaForCausalLM' object has no attribute
    'merge_and_unload'")."""
    profile, config = _runner(runner), _model("llama-3-8b")
    prediction = predict.predict_adapter_on_offloaded(adapter_merged_and_dispatched, profile, config, "llama-3-8b",
                                                      tmp_path)
    assert prediction.failure is None
    assert "PeftModel.from_pretrained at" in prediction.reason and "dispatch_model at" in prediction.reason


@pytest.mark.parametrize("name", ["llava_builder", "bigcode_eval_main"])
def test_corpus_loaders_that_merge_an_adapter_are_predicted(name, tmp_path):
    profile, config = _runner("8xH100-80GB"), _model("llama-3-8b")
    prediction = predict.predict_adapter_on_offloaded(_corpus(name), profile, config, "llama-3-8b", tmp_path)
    assert prediction.failure is None and "PeftModel.from_pretrained at fixtures/corpus/" in prediction.reason


def test_the_loader_s_torch_cuda_questions_are_answered_as_on_each_rank(tmp_path):
    profile, config = _runner("2xH100-80GB"), _model("llama-3-8b")
    SEEN_BY_THE_LOADER.clear()
    prediction = predict.predict_launcher_ddp(asks_torch_cuda, profile, config, "llama-3-8b", tmp_path)
    assert prediction.failure is None and prediction.placement == {"": "0"}
    assert {seen["current"] for seen in SEEN_BY_THE_LOADER} == {0, 1}  # each rank set its own device
    assert all(seen == {**seen, "available": True, "count": 2, "name": "NVIDIA H100 80GB HBM3",
                        "free": profile.device_memory, "capability": (9, 0), "allocated": 0}
               for seen in SEEN_BY_THE_LOADER)


def test_a_gpu_the_runner_does_not_have_raises_as_cuda_does(tmp_path):
    import torch

    def asks_for_gpu_3(request):
        torch.cuda.set_device(3)

    own = (torch.cuda.device_count(), torch.cuda.is_available())
    with pytest.raises(Exception, match="invalid device ordinal 3"):
        simulated_machine.run_loader(asks_for_gpu_3, predict.LoadRequest(tmp_path), _runner("2xH100-80GB"))
    assert (torch.cuda.device_count(), torch.cuda.is_available()) == own  # this machine's own, afterwards


# --- misses --------------------------------------------------------------------------------------------------------


def test_a_device_map_under_zero3_is_refused_inside_the_zero3_set_up(tmp_path):
    """The ZeRO-3 refusal was checked after the simulated set-up was switched off, so a loader passing a device_map
    under ZeRO-3 was predicted to pass (issue 38); transformers raises it from from_pretrained, to the loader."""
    from fixtures.loaders import before_zero3_device_map

    profile, config = _runner("2xH100-80GB"), _model("llama-3-8b")
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_zero3(before_zero3_device_map.load, profile, config, "llama-3-8b", tmp_path)
    assert caught.value.failure == "zero3-device-map"
    assert "Zero-3 is not compatible with passing a `device_map`" in str(caught.value)
    assert _line_of(before_zero3_device_map, "model = AutoModelForCausalLM.from_pretrained(") in str(caught.value)


def test_a_loader_that_catches_the_zero3_refusal_and_loads_again_is_judged_by_its_retry(tmp_path):
    profile, config = _runner("8xH100-80GB"), _model("llama-3-8b")
    prediction = predict.predict_zero3(retries_without_the_map, profile, config, "llama-3-8b", tmp_path)
    assert prediction.failure is None and "DeepSpeed places the model" in prediction.reason


def test_each_launcher_rank_gets_its_own_budget():
    assert predict.rank_budget(_runner("2xH100-80GB"), 1, 2) == {1: 81559 * 2**20, "cpu": 468 * 10**9 // 2}


def test_write_up_004_for_a_loader_that_places_by_its_budget(tmp_path):
    """With no budget it loads whole on the host, and DDP moves a 70B model whole to the rank's 80 GB GPU: an OOM
    there (issue 46; before, the row checked the host only). With its rank's budget, "auto" spreads it over its GPU
    and the host: accelerate refuses that under the launcher. Never tried before issue 38 (no rank had a budget)."""
    profile, config = _runner("2xH100-80GB"), _model("llama-3-70b")
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_launcher_ddp(places_by_its_budget, profile, config, "llama-3-70b", tmp_path)
    assert caught.value.failure == "OOM" and "the model moved whole to cuda:0" in str(caught.value)
    request = predict._request(predict.model_dir(config, tmp_path), profile, places_by_its_budget, purpose="train",
                               max_memory=predict.rank_budget(profile, 0, 2))
    spread = predict.predict_placement("predict_launcher_ddp", places_by_its_budget, request, profile, config,
                                       "llama-3-70b", env=simulated_machine.launcher_env(0, 2))
    assert planner.spreads(spread.placement)  # (what accelerate refuses in any distributed mode)
    fits = predict.predict_launcher_ddp(places_by_its_budget, profile, _model("llama-3-8b"), "llama-3-8b",
                                        tmp_path / "8b")
    assert fits.failure is None


# --- declarations ----------------------------------------------------------------------------------------------------


def test_an_inference_only_loader_skips_the_training_scenarios_saying_why():
    loader = _corpus("lm_eval_hflm")
    reasons = {scenario.name: scenario.inapplicable_reason(loader) for scenario in predict.scenarios()}
    trained = {name for name, reason in reasons.items() if reason is not None}
    assert trained == {"predict_train_load", "predict_trainer", "predict_launcher_ddp", "predict_launcher_deepspeed",
                       "predict_zero3"}
    assert reasons["predict_zero3"] == ("predict_zero3: loader fixtures.corpus.lm_eval_hflm:load is declared for "
                                        "inference only; this scenario runs a train load")


def test_declared_dtypes_not_applicable_checks_and_deepspeed_only_training_are_honoured(tmp_path):
    by_name = {scenario.name: scenario for scenario in predict.scenarios()}
    ASKED_DTYPES.clear()
    predict.predict_train_load(as_loader_under_test(only_float16), _runner("1xH100-80GB"), _model("llama-3-8b"),
                               "llama-3-8b", tmp_path)
    assert ASKED_DTYPES == ["float16"]
    skipped = by_name["predict_quantized_cast"].inapplicable_reason(as_loader_under_test(never_quantized))
    assert skipped.startswith("declared not applicable: predict_quantized_cast: we never quantize")
    ddp = by_name["predict_launcher_ddp"].inapplicable_reason(as_loader_under_test(trains_only_under_deepspeed))
    assert "declared to train only under DeepSpeed" in ddp
    assert by_name["predict_launcher_deepspeed"].inapplicable_reason(
        as_loader_under_test(trains_only_under_deepspeed)) is None


def test_the_suite_skips_a_scenario_the_loader_is_not_declared_for(pytester):
    pytester.makeini("[pytest]\nllmload_runner = 2xH100-80GB\nllmload_model = llama-3-8b\n"
                     "llmload_loader = fixtures.corpus.lm_eval_hflm:load\n")
    pytester.syspathinsert(str(warm_runs.REPO))
    result = warm_runs.runpytest(pytester, "--pyargs", "pytest_llmload.suite", "-k", "predict_zero3", "-p",
                                 "no:cacheprovider", "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*predict_zero3: loader fixtures.corpus.lm_eval_hflm:load is declared for inference "
                                 "only*"])


# --- the write-ups' before-loaders, each with its own failure on the runner it describes --------------------------

# failure id: (scenario, runner, model, the budget the write-up gives, if any). Write-up 004's fixture sizes its own
# budget from the checkpoint's files when the request has none (header-only here): the rank's budget is what
# spreads a 70B model there, as "auto" alone spreads the write-up's model (test_predict.py's write_up_004).
ON_THEIR_RUNNERS = {
    "meta-backward": ("predict_train_load", "1x24GB-RTX4090", "qwen2.5-7b", {0: "14GB", "cpu": "50GB"}),
    "offload-hang": ("predict_inference_load", "1x24GB-RTX4090", "llama-3-70b", None),
    "dp-dtype": ("predict_trainer", "2xH100-80GB", "llama-3-8b", None),
    "distributed-device-map": ("predict_launcher_deepspeed", "2xH100-80GB", "llama-3-70b", None),
    "move-offloaded": ("predict_moved_after_loading", "1x24GB-RTX4090", "llama-3-70b", None),
    "adapter-on-offloaded": ("predict_adapter_on_offloaded", "1x24GB-RTX4090", "llama-3-70b", None),
    "quantized-cast": ("predict_quantized_cast", "1x24GB-RTX4090", "llama-3-8b", None),
    "zero3-device-map": ("predict_zero3", "2xH100-80GB", "llama-3-8b", None),
}


@pytest.mark.parametrize("failure", sorted({scenario.failure.id for scenario in predict.scenarios()}))
def test_each_before_loader_is_predicted_with_its_own_failure(failure, llmload_checkpoint, tmp_path):
    """Every failure a scenario predicts (a new one needs its row in ON_THEIR_RUNNERS)."""
    from importlib import metadata

    from packaging.version import Version

    scenario, runner, model, budget = ON_THEIR_RUNNERS[failure]
    if failure == "offload-hang" and Version(metadata.version("transformers")).release >= (4, 57):
        pytest.skip("transformers >= 4.57 ignores offload_state_dict: offload-hang cannot happen there")
    if failure == "dp-dtype":
        from pytest_llmload.failures.dp_dtype import four_bit_refusal

        if four_bit_refusal() is not None:
            pytest.skip(four_bit_refusal())
    module = importlib.import_module(f"fixtures.loaders.before_{failure.replace('-', '_')}")
    extra = {} if budget is None else {"max_memory": budget}
    with pytest.raises(predict.PredictedFailure) as caught:
        getattr(predict, scenario)(module.load, _runner(runner), _model(model), model, tmp_path, llmload_checkpoint,
                                   **extra)
    assert caught.value.failure == failure, str(caught.value)
    if failure != "dp-dtype":  # (Trainer's decision, made on the tiny checkpoint, names Trainer's frame)
        assert f"at {os.path.relpath(module.__file__)}:" in str(caught.value)


# --- the correct loaders ----------------------------------------------------------------------------------------------

CORRECT = ("pytest_llmload.fixes.reference_loader:load_model_and_tokenizer", "fixtures.corpus.readme_newcomer_qlora:load",
           "fixtures.loaders.downstream_fixed:load")


@pytest.mark.parametrize("spec", CORRECT)
def test_a_correct_loader_exits_0_with_runner(spec, tmp_path):
    """The reference loader, the README newcomer's and write-up 004's fix, on a runner where the model fits every
    scenario: every prediction passes, and the main job exits 0. Run outside this repo, as a user's repo without
    llmload_strict runs it: the newcomer's loader does not declare how it trains, so its Trainer row rests on an
    assumption, which this repo's strict ini fails (tests/main_job/test_assumptions.py)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(warm_runs.REPO),
                                                                     os.environ.get("PYTHONPATH"))))}
    run = warm_runs.main_job("--loader", spec, "--runner", "8xH100-80GB", "-k", "predict", cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("PREDICTED") >= 8 and "FAILED" not in run.stdout, run.stdout


@pytest.mark.parametrize("spec", CORRECT)
def test_a_correct_loader_is_predicted_no_known_failure(spec, tmp_path):
    """On the GPU runners, with a model that fits and one that does not: no known failure predicted for a correct
    loader; the only verdicts left are OOMs, the model's size against the runner's, the same for every loader. (The
    README newcomer's loader, which refuses to train a model that its budget offloads, was predicted meta-backward
    for Llama-3-70B on a 24 GB card: it was stopped at from_pretrained, before its own check.)"""
    loader = as_loader_under_test(import_loader(LoaderChoice(spec, "tests")), name=spec)
    predicted = []
    for runner in ("1x24GB-RTX4090", "2xH100-80GB"):
        for model in ("llama-3-8b", "llama-3-70b"):
            for scenario in predict.scenarios():
                if (scenario.name == "predict_trainer" or _runner(runner).devices < scenario.needs_gpus
                        or scenario.inapplicable_reason(loader) is not None):
                    continue  # (the Trainer scenario: tests/prediction/test_predict.py, on the tiny checkpoint)
                try:
                    scenario.function(loader, _runner(runner), _model(model), model, tmp_path / model)
                except predict.PredictedFailure as failure:
                    if failure.failure != "OOM":
                        predicted.append(f"{scenario.name}@{runner} with {model}: {failure}")
    assert predicted == []
