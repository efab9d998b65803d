"""Runner profiles and model configs as a user writes them (issue 38): every profile field required or defaulted to
a stated value, GPU counts and sizes bounded, and a config transformers refuses named, file and field, as the
user's error (a usage error), never an error row of ours and never an OOM. (The same inputs through pytest and the
main job, as a user meets them: tests/test_bad_inputs.py.)"""

import json

import pytest

from fixtures import warm_runs
from pytest_llmload.placement import architectures, profiles

pytestmark = pytest.mark.timeout(300)

GOOD = {"devices": 2, "device_memory": "80GiB", "host_memory": "256GiB", "disk": "1TB"}


def _written(tmp_path, data, name="runner.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(("change", "said"), [
    ({"device_memory": None}, r"device_memory \(the memory of each GPU\) is missing"),
    ({"disk": None}, r"disk \(what offload to disk may use\) is missing"),
    ({"host_memory": None}, r"host_memory \(what offload to cpu may use\) is missing"),
    ({"devices": None}, r"devices \(the GPUs\) is missing"),
    ({"devices": 100_000}, r"devices=100000 is more GPUs than one runner holds \(at most 64"),
    ({"devices": 65}, r"devices=65 is more GPUs"),
    ({"device_memory": 80}, r"device_memory 80 \(80 B\) is less than 1.0 GiB: .*a number without a unit is bytes"),
    ({"device_memory": "80TB"}, r"device_memory '80TB' \(74505.8 GiB\) is more than the 1 TiB any runner has"),
    ({"host_memory": "0"}, r"host_memory '0' \(0 B\) is less than 1.0 GiB"),
    ({"disk": "2000TB"}, r"disk '2000TB' .* is more than the 1024 TiB any runner has"),
    ({"disk_space": "1TB"}, r"'disk_space' is not a field of a profile \(the fields: name, description, devices"),
    ({"name": 3}, r"name=3 is not a text"),
    ({"sources": "AWS"}, r"sources='AWS' is not an object"),
], ids=["no-device-memory", "no-disk", "no-host-memory", "no-devices", "100000-gpus", "65-gpus", "bytes-no-unit",
        "80TB-gpu", "no-host", "2000TB-disk", "unknown-field", "name-not-text", "sources-not-object"])
def test_a_bad_profile_names_its_file_and_field(tmp_path, change, said):
    """Before: a profile without device_memory planned 0-byte GPUs, without disk 0 B of disk (then an OOM), and a
    100,000-GPU one ran until killed; unknown fields were ignored."""
    data = {key: value for key, value in {**GOOD, **change}.items() if value is not None}
    path = _written(tmp_path, data)
    with pytest.raises(profiles.ProfileError, match=said) as refused:
        profiles.load_profile(path, source="--llmload-runner")
    assert str(refused.value).startswith(f"runner profile {path} (--llmload-runner {path!r}) cannot be read: ")


def test_the_fields_a_profile_may_leave_out_take_their_stated_defaults(tmp_path):
    assert list(profiles.FIELDS) == ["name", "description", "devices", "device", "device_memory", "host_memory",
                                     "disk", "sources"]
    profile = profiles.load_profile(_written(tmp_path, GOOD, "our-node.json"))
    assert profile == profiles.RunnerProfile(name="our-node", devices=2, device_memory=80 * 2**30,
                                             host_memory=256 * 2**30, disk=10**12, description="", device="",
                                             source=str(tmp_path / "our-node.json"))
    cpu_only = profiles.load_profile(_written(tmp_path, {"devices": 0, "host_memory": "24GiB", "disk": 0}))
    assert (cpu_only.device_memory, cpu_only.disk, cpu_only.max_memory) == (0, 0, {"cpu": 24 * 2**30})


def _config(tmp_path, **change) -> str:
    config = {**architectures.load_config("llama-3-8b"), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize(("change", "said"), [
    ({"num_hidden_layers": 0}, r"num_hidden_layers=0 is not a size a model has \(a whole number from 1"),
    ({"hidden_size": 0}, r"hidden_size=0 is not a size a model has"),
    ({"num_key_value_heads": 5}, r"num_attention_heads=32 is not a multiple of num_key_value_heads=5"),
    ({"num_attention_heads": 7, "num_key_value_heads": 7}, r"hidden_size=4096 is not a multiple of "
                                                           r"num_attention_heads=7"),
    ({"num_hidden_layers": 5000, "hidden_size": 64, "intermediate_size": 64, "num_attention_heads": 4,
      "num_key_value_heads": 4}, r"num_hidden_layers=5000 is more layers than any model has"),
    ({"num_hidden_layers": 500, "num_local_experts": 100, "hidden_size": 64, "intermediate_size": 64,
      "num_attention_heads": 4, "num_key_value_heads": 4}, r"50,000 experts, more than any model has"),
], ids=["no-layers", "no-hidden", "kv-heads", "heads-hidden", "5000-layers", "50000-experts"])
def test_a_config_no_model_has_is_refused_before_anything_is_built(tmp_path, change, said):
    """Before: a model with no layers was planned, 0-sized ones divided by zero on every row, and a 5000-layer one
    took minutes to build."""
    with pytest.raises(architectures.ArchitectureError, match=said):
        architectures.load_config(_config(tmp_path, **change))


@pytest.mark.parametrize(("change", "field"), [
    ({"hidden_act": "nope"}, r"\(the field hidden_act='nope'\): KeyError: 'nope'"),
    ({"rope_scaling": {"rope_type": "bogus", "factor": 2.0}}, r"\(the field rope_scaling.rope_type='bogus'\)"),
    ({"torch_dtype": "float99"}, r"\(the field torch_dtype='float99'\): AttributeError"),
    ({"model_type": "llama9"}, r"model_type='llama9' is not an architecture transformers \S+ knows"),
], ids=["activation", "rope-type", "dtype", "model-type"])
def test_a_config_transformers_refuses_names_its_file_and_field(tmp_path, change, field):
    """Before: the model was first built inside each row, and every row said 'a bug in pytest-llmload, please
    report'."""
    directory = _config(tmp_path, **change)
    with pytest.raises(architectures.ArchitectureError, match=field) as refused:
        architectures.load_config(directory, source="--llmload-model", build=True)
    assert str(refused.value).startswith(f"--llmload-model {directory!r}: {tmp_path / 'config.json'}: ")
    assert architectures.load_config(directory)["model_type"] == change.get("model_type", "llama")  # (unbuilt)


def test_the_shipped_architectures_build(tmp_path):
    for name in architectures.shipped_names():
        assert architectures.load_config(name, build=True)["model_type"]


def test_the_main_job_refuses_a_config_transformers_refuses_as_a_usage_error_naming_its_own_option(tmp_path):
    """Through the main job: its pytest refuses the config at configure; no row runs, no row says 'bug'."""
    from pytest_llmload.main_job import process

    directory = _config(tmp_path, hidden_act="nope")
    run = warm_runs.main_job("--runner", "1xH100-80GB", "--model", directory, "-k", "predict_inference_load",
                             cwd=tmp_path)
    assert run.returncode == process.EXIT_USAGE, run.stdout + run.stderr
    assert f"--model {directory!r}: {tmp_path / 'config.json'}: transformers" in run.stderr, run.stderr
    assert "the field hidden_act='nope'" in run.stderr and "please report" not in run.stdout + run.stderr
