"""Where the model would go, as each prediction row carries it (issue 38): the map (module -> device), the modules and
bytes per device against its capacity, the modules and bytes of each of gpu, cpu and disk; said the same in the
failure's text, pytest's terminal, the progress file and JUnit XML. (The main job's table and --json:
tests/main_job/test_main_job.py; the HTML report: tests/reports/test_html_report.py.)"""

import json
import xml.etree.ElementTree as ET

import pytest

from fixtures import warm_runs
from fixtures.loaders import before_move_offloaded
from pytest_llmload.placement.picture import placement_lines, placement_tiers, where_the_model_goes
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as reference
from pytest_llmload.placement import architectures, profiles
from pytest_llmload.prediction import predict

pytestmark = [pytest.mark.llmload_deepspeed, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def seventy_b_on_a_24gb_card(tmp_path_factory):
    """The reference loader's inference load of Llama-3-70B on one 24 GB card: it spreads over gpu, cpu and disk."""
    profile, config = profiles.load_profile("1x24GB-RTX4090"), architectures.load_config("llama-3-70b")
    return predict.predict_inference_load(reference, profile, config, "llama-3-70b", tmp_path_factory.mktemp("70b"))


def test_the_record_has_the_whole_map_and_each_devices_bytes_against_its_capacity(seventy_b_on_a_24gb_card):
    prediction = seventy_b_on_a_24gb_card
    record = json.loads(json.dumps(prediction.record()))  # (plain data: what a row carries)
    assert record["device_map"] == {name: f"cuda:{where}" if where.isdigit() else where
                                    for name, where in prediction.placement.items()}
    devices = {d["device"]: d for d in record["devices"]}
    assert list(devices) == ["cuda:0", "cpu", "disk"]  # accelerators first
    profile = profiles.load_profile("1x24GB-RTX4090")
    assert [devices[d]["capacity"] for d in devices] == [profile.device_memory, profile.host_memory, profile.disk]
    assert {d: (devices[d]["modules"], devices[d]["tier"]) for d in devices} == {
        d: (list(record["device_map"].values()).count(d), "gpu" if d == "cuda:0" else d) for d in devices}
    assert sum(d["weights"] for d in record["devices"]) == pytest.approx(70.55e9 * 2, rel=0.01)
    for tier in ("gpu", "cpu", "disk"):  # each tier: the devices of it, summed
        assert record["tiers"][tier] == {"modules": devices["cuda:0" if tier == "gpu" else tier]["modules"],
                                         "bytes": devices["cuda:0" if tier == "gpu" else tier]["weights"],
                                         "devices": 1}
    # the modules each device holds, the layers as ranges: every layer named once, in order
    assert record["placement"]["cuda:0"].startswith("model.embed_tokens, model.layers.0-")
    assert record["placement"]["disk"].endswith("-79, model.norm, model.rotary_emb, lm_head")
    layers = [name for name in record["device_map"] if name.startswith("model.layers.")]
    assert layers == [f"model.layers.{n}" for n in range(80)]


def test_the_summary_says_what_goes_to_each_of_gpu_cpu_and_disk(seventy_b_on_a_24gb_card):
    """Before: '84 map entries over 3 devices [3 devices, the fullest cpu ...]' never said that 33 went to disk."""
    record = seventy_b_on_a_24gb_card.record()
    tiers = record["tiers"]
    said = seventy_b_on_a_24gb_card.summary()
    for tier in ("gpu", "cpu", "disk"):
        assert f"{tier} {tiers[tier]['modules']} modules, " in said, said
    assert "(1 device)" in said and "the fullest " in said
    lines = placement_lines(record)
    assert [line.split()[0].rstrip(":") for line in lines] == ["cuda:0", "cpu", "disk"]
    assert all(f" of {size}" in line for line, size in zip(lines, ("23.7 GiB", "64.0 GiB", "1024.0 GiB")))
    assert lines[0].endswith(record["placement"]["cuda:0"])


def test_a_predicted_failure_carries_the_record_and_its_text_the_devices(tmp_path):
    profile, config = profiles.load_profile("2xH100-80GB"), architectures.load_config("llama-3-70b")
    with pytest.raises(predict.PredictedFailure) as caught:
        predict.predict_launcher_ddp(before_move_offloaded.load, profile, config, "llama-3-70b", tmp_path)
    predicted = caught.value
    assert predicted.prediction is not None and predicted.prediction["failure"] == predicted.failure
    assert predicted.prediction["devices"], predicted.prediction
    text = str(predicted)
    assert placement_tiers(predicted.prediction) in text
    assert all(line in text for line in placement_lines(predicted.prediction))
    import pickle

    assert pickle.loads(pickle.dumps(predicted)).prediction == predicted.prediction  # (across a process boundary)


def test_the_after_loading_predictions_carry_their_devices_sizes_too(tmp_path):
    """Before: the three after-loading rows had the map but no bytes on any device."""
    profile, config = profiles.load_profile("1x24GB-RTX4090"), architectures.load_config("llama-3-8b")
    prediction = predict.predict_moved_after_loading(reference, profile, config, "llama-3-8b", tmp_path)
    assert prediction.devices and all(d.weights > 0 and d.capacity for d in prediction.devices)
    assert set(prediction.record()["placement"]) == {d.device for d in prediction.devices}


def test_rows_whose_devices_read_the_same_share_their_lines(seventy_b_on_a_24gb_card):
    record = seventy_b_on_a_24gb_card.record()
    other = {**record, "runner": "another"}
    lines = where_the_model_goes([("a@1x24", record), ("b@1x24", record), ("c@other", other),
                                  ("d@none", {**record, "devices": []})], "--json")
    assert lines[:2] == ["", "where the model would go (every map entry: --json):"]
    assert lines[2] == f"a@1x24, b@1x24: {placement_tiers(record)}"
    assert lines.count(f"c@other: {placement_tiers(record)}") == 1 and not any("d@none" in line for line in lines)
    assert len(lines) == 2 + 2 * (1 + len(record["devices"]))


def test_the_row_of_each_prediction_carries_it_to_the_progress_file_junit_and_the_terminal(pytester):
    """What every reporter reads (the row), for a passing prediction and a predicted failure."""
    pytester.makeini("[pytest]\nllmload_runner = 2xH100-80GB\nllmload_model = llama-3-70b\n")
    result = warm_runs.runpytest(pytester, "--pyargs", "pytest_llmload.suite", "-k",
                                 "predict_inference_load or predict_launcher_ddp", "-p", "no:cacheprovider",
                                 "--llmload-loader", "fixtures.loaders.before_move_offloaded:load",
                                 "--llmload-progress", "progress.jsonl", "--junitxml", "out.xml")
    result.assert_outcomes(passed=1, failed=1)
    progress = {r["row"]["check"]: r["row"] for r in map(json.loads,
                                                         (pytester.path / "progress.jsonl").read_text().splitlines())
                if r.get("event") == "result"}
    passed, failed = progress["predict_inference_load@2xH100-80GB"], progress["predict_launcher_ddp@2xH100-80GB"]
    assert (passed["outcome"], failed["outcome"]) == ("passed", "predicted")
    assert set(passed["prediction"]["placement"]) == {"cuda:0", "cuda:1"}
    assert len(passed["prediction"]["device_map"]) == 84 and failed["prediction"]["failure"] == failed["failure"]
    junit = {case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
             for case in ET.parse(pytester.path / "out.xml").getroot().iter("testcase")}
    rows = [json.loads(properties["llmload_row"]) for properties in junit.values()]
    assert sorted(row["prediction"]["scenario"] for row in rows) == ["predict_inference_load", "predict_launcher_ddp"]
    # (rank 0 of the launcher gets the inference load's map: the two rows share their lines)
    result.stdout.fnmatch_lines(["*where the model would go (every map entry: each row's llmload_row property):",
                                 "predict_inference_load@2xH100-80GB, predict_launcher_ddp@2xH100-80GB: "
                                 f"{placement_tiers(passed['prediction'])}",
                                 "  cuda:0: * of 79.6 GiB  model.embed_tokens, model.layers.0-*",
                                 "  cuda:1: * of 79.6 GiB  model.layers.*, lm_head"])
