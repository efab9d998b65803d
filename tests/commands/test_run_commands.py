"""``python -m pytest_llmload run -- COMMAND...`` on real commands, written as public repos write them
(``fixtures/commands/``), each run once for the module (a run costs its interpreters: 7-17 s CPU): a Trainer script
bounded to its optimizer steps, a plain loop whose float16 weights the GradScaler refuses (fp16-unscale) and its fixed
twin, and an ``accelerate launch`` loop on 2 ranks with write-up 004's ``device_map="auto"``."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from pytest_llmload.commands import cli

pytestmark = pytest.mark.timeout(300)
COMMANDS = Path(__file__).resolve().parents[2] / "fixtures" / "commands"


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-checkpoints")


class Ran:
    def __init__(self, code, text, document, repo, files_before):
        self.code, self.text, self.document, self.repo, self.files_before = code, text, document, repo, files_before
        self.rows = {row["check"]: row for row in document["results"]}

    def files_now(self):
        return sorted(str(p.relative_to(self.repo)) for p in self.repo.rglob("*"))


def run(project, tmp_path_factory, tiny_cache, *command, steps=None, options=()):
    """The command run from a copy of ``project`` (nothing of it may change), through the CLI in this process."""
    import io

    repo = tmp_path_factory.mktemp(project)
    shutil.copytree(COMMANDS / project, repo, dirs_exist_ok=True)
    before = sorted(str(p.relative_to(repo)) for p in repo.rglob("*"))
    report = repo.parent / f"{project}.json"
    out = io.StringIO()
    options = ["--cache-dir", str(tiny_cache), "--json", str(report), *options] + (
        ["--steps", str(steps)] if steps else [])
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(repo)
        patch.setenv("COLUMNS", "1000")
        code = cli.main([*options, "--", *command], out=out)
    return Ran(code, out.getvalue(), json.loads(report.read_text()), repo, before)


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory, tiny_cache):
    return run("trainer_repo", tmp_path_factory, tiny_cache, sys.executable, "train.py", "--config", "configs/ci.json")


@pytest.fixture(scope="module")
def fp16_before(tmp_path_factory, tiny_cache):
    return run("fp16_repo", tmp_path_factory, tiny_cache, sys.executable, "train.py", "--config",
               "configs/before.json")


@pytest.fixture(scope="module")
def fp16_fixed(tmp_path_factory, tiny_cache):
    return run("fp16_repo", tmp_path_factory, tiny_cache, sys.executable, "train.py", "--config",
               "configs/fixed.json", steps=3)


@pytest.fixture(scope="module")
def write_up_000(tmp_path_factory, tiny_cache):
    return run("writeup_000", tmp_path_factory, tiny_cache, sys.executable, "run_experiment.py", "--config",
               "configs/local_test.json", options=("--model", "meta-llama/Llama-3.3-70B-Instruct=llama-3-70b"))


@pytest.fixture(scope="module")
def adapter_serving(tmp_path_factory, tiny_cache):
    return run("adapter_repo", tmp_path_factory, tiny_cache, sys.executable, "serve.py", "--adapter",
               "adapters/support-lora")


@pytest.fixture(scope="module")
def accelerate_run(tmp_path_factory, tiny_cache):
    launcher = Path(sys.executable).with_name("accelerate")
    if not launcher.exists():
        pytest.skip(f"accelerate's launcher is not installed beside {sys.executable}")
    return run("accelerate_repo", tmp_path_factory, tiny_cache, str(launcher), "launch", "--multi_gpu",
               "--num_processes", "2", "train_loop.py")


def test_a_trainer_script_on_a_hub_id_stops_after_its_steps_on_tiny_weights(trainer_run, tiny_cache):
    assert trainer_run.code == 0, trainer_run.text
    command = trainer_run.rows["command"]
    assert command["verdict"] == "passed"
    assert "stopped after 2 optimizer step(s) in 1 process(es); 1 model load(s) on tiny weights" in command["note"]
    assert any(p.name.startswith("llama-") for p in tiny_cache.iterdir())  # Meta-Llama-3-8B's architecture


def test_a_trainer_script_writes_nothing_into_the_repo(trainer_run):
    # (its TrainingArguments' output_dir, trainer.save_model and tokenizer.save_pretrained went to the run's folder)
    assert trainer_run.files_now() == trainer_run.files_before


def test_each_known_failure_has_a_row_saying_what_the_run_reached(trainer_run):
    from pytest_llmload.failures import CATALOG

    assert [row["guards"] for row in trainer_run.document["results"][1:]] == [f.id for f in CATALOG]
    dp_dtype = trainer_run.rows["watch_dp_dtype"]
    assert dp_dtype["verdict"] == "not exercised"
    assert "Trainer at train.py:38 saw 0 GPU(s)" in dp_dtype["sentence"]
    assert "not reachable on this runner" in dp_dtype["sentence"]
    assert "offload-hang" in trainer_run.text and "watch_meta_backward" in trainer_run.text


def test_the_known_failure_is_caught_at_the_repos_line_with_its_fix(fp16_before):
    assert fp16_before.code == 1, fp16_before.text
    row = fp16_before.rows["watch_fp16_unscale"]
    assert row["verdict"] == "failed" and row["failure"] == "fp16-unscale"
    assert row["sentence"] == "fp16-unscale caught at train.py:29 in main: Attempting to unscale FP16 gradients."
    assert row["fix"].startswith("at train.py:29 in main: Keep the trainable parameters in float32")
    command = fp16_before.rows["command"]
    assert command["verdict"] == "error"
    assert "crashed at train.py:29 in main: ValueError: Attempting to unscale FP16 gradients." in command["sentence"]
    assert "the known failure fp16-unscale" in command["sentence"]
    assert "FAILED watch_fp16_unscale" in fp16_before.text


def test_the_fixed_twin_passes_with_what_was_watched(fp16_fixed):
    assert fp16_fixed.code == 0, fp16_fixed.text
    assert fp16_fixed.rows["watch_fp16_unscale"]["verdict"] == "passed"
    assert fp16_fixed.rows["watch_fp16_unscale"]["note"] == "watched: a GradScaler unscaled gradients 3 time(s)"
    assert "stopped after 3 optimizer step(s)" in fp16_fixed.rows["command"]["note"]
    assert fp16_fixed.files_now() == fp16_fixed.files_before  # (its model.save_pretrained went to the run's folder)


def test_every_rank_of_an_accelerate_launch_is_covered(accelerate_run):
    assert accelerate_run.code == 0, accelerate_run.text
    # the launcher and its 2 ranks, each with the bootstrap; each rank loaded the model on tiny weights
    assert "stopped after 2 optimizer step(s) in 3 process(es); 2 model load(s)" in accelerate_run.rows["command"]["note"]
    row = accelerate_run.rows["watch_distributed_device_map"]
    assert row["verdict"] == "not exercised"
    assert "device_map=auto at train_loop.py:15 placed the model on one device here" in row["sentence"]
    assert accelerate_run.files_now() == accelerate_run.files_before


def test_write_up_000s_script_as_printed_round_trips_its_weights_where_transformers_honours_offload_state_dict(
        write_up_000):
    from importlib.metadata import version

    from packaging.version import Version

    row = write_up_000.rows["watch_offload_hang"]
    # its {"cpu": "120GB"} budget scaled to the tiny weights: what a 70B model in float16 offloads, the tiny one does
    assert "run_experiment.py:34: cpu, disk" in (row["note"] or "") + row["sentence"] + json.dumps(
        write_up_000.rows["watch_move_offloaded"])
    if Version(version("transformers")) < Version("4.57"):
        assert write_up_000.code == 1, write_up_000.text
        assert row["verdict"] == "failed"
        assert row["sentence"].startswith("offload-hang caught at run_experiment.py:34: from_pretrained wrote ")
        assert "outside its offload folder, a silent temporary round-trip of the weights" in row["sentence"]
    else:  # (transformers >= 4.57 drops offload_state_dict: no round-trip)
        assert write_up_000.code == 0, write_up_000.text
        assert row["verdict"] == "passed" and "wrote no weight data outside their offload folder" in row["note"]
    assert write_up_000.rows["watch_inference_stall"]["note"] == (
        "watched: generate ran 1 time(s), 4 new tokens at most, and returned")
    assert write_up_000.files_now() == write_up_000.files_before  # (its "./offload" went to the run's folder)


def test_an_adapter_on_an_offloaded_base_is_caught_at_the_repos_line(adapter_serving, tiny_cache):
    # the adapter folder holds only its adapter_config.json: a tiny adapter of its rank and targets stands in
    assert adapter_serving.code == 1, adapter_serving.text
    row = adapter_serving.rows["watch_adapter_on_offloaded"]
    assert row["verdict"] == "failed" and row["failure"] == "adapter-on-offloaded"
    # (peft 0.21 copies meta weights; peft 0.17 fails on a module name in _update_offload)
    assert row["sentence"].startswith("adapter-on-offloaded caught at serve.py:18 in load: ")
    assert row["fix"].startswith("at serve.py:18 in load: Do not put an adapter on an offloaded base")
    command = adapter_serving.rows["command"]
    assert "the known failure adapter-on-offloaded" in command["sentence"]
    assert any(p.name.startswith("adapter-lora-") for p in tiny_cache.iterdir())
    # what the library wrote into the repo while it failed is named, and left there
    new = [path for path in set(adapter_serving.files_now()) - set(adapter_serving.files_before)
           if (adapter_serving.repo / path).is_file()]
    if new:  # (peft 0.21 stages the offloaded shard again under a path relative to the working directory)
        assert f"it wrote {len(new)} file(s) into its working directory all the same (left there)" in command["note"]


def test_a_tiny_checkpoint_is_whole_whatever_the_rank_and_built_outside_zero3(tmp_path, monkeypatch):
    import weakref

    from pytest_llmload.commands import tiny_weights

    deepspeed = pytest.importorskip("transformers.integrations.deepspeed")

    class Zero3:  # what transformers holds while a ZeRO-3 config is alive (Trainer's, accelerate's)
        def is_zero3(self):
            return True

    alive = Zero3()
    monkeypatch.setattr(deepspeed, "_hf_deepspeed_config_weak_ref", weakref.ref(alive))
    try:
        from transformers.distributed import mixin
    except ImportError:  # (transformers 4.x's save_pretrained writes on every rank)
        mixin = None
    if mixin is not None:  # rank 1 of an initialized process group
        monkeypatch.setattr(mixin, "_is_torch_distributed_initialized", lambda: True)
        monkeypatch.setattr(mixin, "_get_torch_distributed_rank", lambda: 1)
    built = tiny_weights.tiny_checkpoint(tiny_weights.real_config("Qwen/Qwen2.5-7B", {}, "call"), tmp_path)
    assert {"config.json", "model.safetensors", tiny_weights.SIZES_FILE} <= {p.name for p in built.iterdir()}
    assert deepspeed._hf_deepspeed_config_weak_ref() is alive  # (ZeRO-3 on again for the command)


def test_a_budget_places_the_tiny_model_as_from_pretrained_places_the_real_one(tiny_cache):
    import torch

    from pytest_llmload.commands import tiny_weights

    tiny = tiny_weights.tiny_checkpoint(tiny_weights.real_config("Qwen/Qwen2.5-7B-Instruct", {}, "call"), tiny_cache)
    # 7.6 billion float32 parameters (30 GB) under 10 GiB of host memory: the embeddings and 6 of the 28 layers on
    # the cpu, the rest on disk; the tiny model's 2 layers stand at depths 7 and 21, both on disk
    placed = tiny_weights.planned_placement(tiny, "auto", {"cpu": "10GiB"}, torch.float32)
    assert placed["model.embed_tokens"] == "cpu" and placed["lm_head"] == "disk"
    assert (placed["model.layers.0"], placed["model.layers.1"]) == ("disk", "disk")
    placed = tiny_weights.planned_placement(tiny, "auto", {"cpu": "20GiB"}, torch.float32)  # (depth 7 on the cpu now)
    assert (placed["model.layers.0"], placed["model.layers.1"]) == ("cpu", "disk")
