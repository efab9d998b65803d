"""``run``'s rows from the findings its processes write (``process-*.json``, as :mod:`pytest_llmload.commands.
in_process` writes them), judged in this process with no command run: which crash the command's row names, what a
watch needs before it passes, a load that raised, the fixes in the repo's terms, every row's time; and what the
bootstrap does in a command's process (a load recorded before it runs, DeepSpeed's op never built)."""

import ast
import re
import sys
import types
from pathlib import Path

import pytest

from pytest_llmload.commands import in_process
from pytest_llmload.commands.command import CommandRun
from pytest_llmload.commands.rows import Facts, command_row, failure_rows, rows_of
from pytest_llmload.failures import CATALOG
from pytest_llmload.loader.faults import DEVICE_FIX


def process(pid, started, *, distributed=None, loads=(), crash=None, steps=0):
    """One process's findings, with the keys the bootstrap writes."""
    return {"pid": pid, "argv": ["train.py"], "outcome": "crashed" if crash else "finished", "steps": steps,
            "unscales": 0, "generates": 0, "loads": list(loads), "trainers": [], "redirected": [], "saved": [],
            "crash": crash, "watch_errors": [], "adapters": [], "distributed": distributed or {},
            "started": started, "ended": started + 1}


def crash(kind, message, *repo_frames, fault=None):
    return {"type": kind, "message": message, "text": f"Traceback ...\n{kind}: {message}\n",
            "repo_frames": list(repo_frames), "fault": fault}


def load(where, **fields):
    return {"where": where, "device_map": None, "max_memory": None, "places": ["cpu"], "offloaded": False,
            "quantized": False, "zero3": False, "distributed": False, "raised": None, "weight_writes": 0,
            "weight_writes_shown": [], "gpus_budgeted_absent": [], **fields}


def ran(tmp_path, *processes, returncode=1, seconds=31.4):
    return CommandRun(["torchrun", "--nproc_per_node=2", "train.py"], returncode, seconds, 9.0, 600.0,
                      list(processes), {}, tmp_path, tmp_path / "command.log", [], [])


def row(rows, failure_id):
    return next(r for r in rows if r.guards == failure_id)


RANK = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
UNUSED = "Some specified arguments are not used by the HfArgumentParser: ['--evaluation_strategy']"


def test_the_ranks_crash_in_the_repo_is_named_not_the_launchers_report_of_it(tmp_path):
    # torchrun started first (pid 10000 sorts before 9001 as a file name), its bin script once taken for the repo's
    launcher = process(10000, 100.0, crash=crash("ChildFailedError", "train.py FAILED",
                                                 ".venv/bin/torchrun:6 in <module>"))
    ranks = [process(pid, 101.0, distributed={**RANK, "RANK": str(pid - 9001)},
                     crash=crash("ValueError", UNUSED, "train.py:130 in train")) for pid in (9001, 9002)]
    the_row = command_row(ran(tmp_path, launcher, *ranks), Facts(ran(tmp_path, launcher, *ranks)))
    assert the_row.sentence.startswith("the command crashed at train.py:130 in train: ValueError: Some specified")


def test_a_package_on_pythonpath_outside_the_repo_is_not_the_repos_code(tmp_path, monkeypatch):
    repo, extras = tmp_path / "repo", tmp_path / "extras"
    monkeypatch.chdir(repo.mkdir() or repo)
    monkeypatch.setenv("PYTHONPATH", f"{extras}:{repo / 'src'}:{tmp_path}")  # (the last one holds the repo)
    assert not in_process.is_repo_file(str(extras / "trl" / "trainer" / "sft_trainer.py"))  # pip install --target
    assert in_process.is_repo_file(str(repo / "src" / "project" / "data.py"))
    assert in_process.is_repo_file(str(repo / "train.py"))
    assert not in_process.is_repo_file(str(Path(sys.prefix) / "bin" / "deepspeed"))


def test_distributed_device_map_is_not_exercised_where_the_ranks_crashed_before_loading(tmp_path):
    ranks = [process(pid, 101.0, distributed=RANK, crash=crash("ValueError", UNUSED, "train.py:130 in train"))
             for pid in (9001, 9002)]
    watched = row(failure_rows(ran(tmp_path, *ranks), Facts(ran(tmp_path, *ranks))), "distributed-device-map")
    assert watched.verdict == "not exercised"
    assert "2 distributed process(es) placed no model (the command crashed at train.py:130 in train before any " \
           "from_pretrained call)" in watched.sentence
    loaded = [process(9001, 101.0, distributed=RANK, loads=[load("train.py:132", distributed=True)])]
    watched = row(failure_rows(ran(tmp_path, *loaded, returncode=0), Facts(ran(tmp_path, *loaded))),
                  "distributed-device-map")
    assert watched.verdict == "passed" and "1 load(s) in 1 distributed process(es) without a device_map" in \
        watched.notes[0]


def test_dp_dtype_passes_only_where_trainer_trained_on_the_gpus_it_saw(tmp_path):
    trainer = {"where": "train.py:150", "class": "Trainer", "n_gpu": 2, "model_parallel": False, "fp16": False,
               "output_dir": "out"}
    for steps, verdict in ((0, "not exercised"), (2, "passed")):
        built = [process(9001, 1.0, steps=steps)]
        built[0]["trainers"] = [trainer]
        assert row(failure_rows(ran(tmp_path, *built), Facts(ran(tmp_path, *built))), "dp-dtype").verdict == verdict


@pytest.fixture
def in_a_run(tmp_path, monkeypatch):
    """This process as one of a command's, under ZeRO-3."""
    (tmp_path / in_process.SETTINGS_FILE).write_text('{"steps": 2, "models": {}, "output_dir": "%s", "repo": "%s"}'
                                                     % (tmp_path / "outputs", Path.cwd()))
    monkeypatch.setattr(in_process, "RUN", in_process._Run(tmp_path))
    zero3 = types.SimpleNamespace(is_deepspeed_zero3_enabled=lambda: True)
    monkeypatch.setitem(sys.modules, "transformers.integrations.deepspeed", zero3)
    return in_process.RUN


def test_a_load_that_raises_is_recorded_with_the_state_it_ran_in(in_a_run, tmp_path):
    def raising_inside_zero_init(given):
        raise ValueError("train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size 2 != 4")

    with pytest.raises(ValueError):
        in_process._load_model(raising_inside_zero_init, "tiny", {"torch_dtype": "auto"})
    [recorded] = in_a_run.findings.record["loads"]
    assert recorded["zero3"] and recorded["where"].startswith("tests/commands/test_run_rows.py:")
    assert recorded["raised"].startswith("ValueError: train_batch_size is not equal")
    processes = [process(9001, 1.0, loads=[recorded], crash=crash("ValueError", "...", recorded["where"] + " in x"))]
    watched = row(failure_rows(ran(tmp_path, *processes), Facts(ran(tmp_path, *processes))), "zero3-device-map")
    assert watched.verdict == "not exercised"
    assert "ZeRO-3 was on at 1 from_pretrained call(s), which raised before placing the model" in watched.sentence


def test_an_adapter_that_raises_on_an_offloaded_base_is_recorded_and_not_watched_as_loaded(in_a_run, tmp_path):
    class PeftModel:
        @classmethod
        def from_pretrained(cls, model, model_id, **kwargs):
            raise KeyError("base_model.model.model.layers.1.self_attn.q_proj.base_layer.weight")

    in_process._patch_peft_model(types.SimpleNamespace(PeftModel=PeftModel))
    offloaded_base = types.SimpleNamespace(hf_device_map={"model.layers.1": "disk"}, parameters=lambda: [])
    with pytest.raises(KeyError):
        PeftModel.from_pretrained(offloaded_base, str(in_a_run.dir / "adapter"))
    processes = [process(9001, 1.0, crash=crash("KeyError", "...", "serve.py:18 in load"))]
    processes[0]["adapters"] = in_a_run.findings.record["adapters"]
    watched = row(failure_rows(ran(tmp_path, *processes), Facts(ran(tmp_path, *processes))), "adapter-on-offloaded")
    assert watched.verdict == "not exercised" and "raised before it loaded (KeyError: " in watched.sentence


def test_the_bootstrap_never_builds_deepspeeds_shared_memory_op(monkeypatch):
    comm_torch = types.SimpleNamespace(build_shm_op=lambda: "g++ for minutes")
    monkeypatch.setitem(sys.modules, "deepspeed.comm.torch", comm_torch)
    in_process.AFTER_IMPORT["deepspeed.comm.torch"](comm_torch)
    assert comm_torch.build_shm_op() is None


PLUGIN_NAMES = re.compile(r"pytest_llmload|LoadRequest|llmload_|--llmload|\._n_gpu|may_move")


@pytest.mark.parametrize("failure", CATALOG, ids=lambda failure: failure.id)
def test_the_fix_run_prints_names_nothing_of_the_plugin(failure):
    assert not PLUGIN_NAMES.search(failure.script_fix or failure.fix)


def test_a_caught_failures_fix_is_the_change_at_the_repos_line(tmp_path):
    crashed = [process(9001, 1.0, crash=crash("ValueError", "Attempting to unscale FP16 gradients.",
                                              "train.py:88 in train_loop"))]
    caught = row(failure_rows(ran(tmp_path, *crashed), Facts(ran(tmp_path, *crashed))), "fp16-unscale")
    assert caught.verdict == "failed" and caught.fix.startswith("at train.py:88 in train_loop: Keep the trainable")
    assert not PLUGIN_NAMES.search(caught.fix)


def test_a_budget_naming_a_gpu_the_runner_lacks_is_the_fix_not_a_device_pin(tmp_path):
    # write-up 002's --before: device_map="auto", max_memory={0: "14GB", "cpu": "50GB"} at train_baseline.py:20
    budget = load("train_baseline.py:20", device_map="auto", max_memory="{0: '14GB', 'cpu': '50GB'}", places=[],
                  raised="RuntimeError: Cannot access accelerator device when none is available.",
                  gpus_budgeted_absent=["0"])
    fault = {"fault": "device pin", "cause": "the loader pins the model to a CUDA device by index", "fix": DEVICE_FIX}
    crashed = [process(9001, 1.0, loads=[budget], crash=crash(
        "RuntimeError", "Cannot access accelerator device when none is available.", "train_baseline.py:59 in main",
        "train_baseline.py:20 in load_model", fault=fault))]
    the_row = command_row(ran(tmp_path, *crashed), Facts(ran(tmp_path, *crashed)))
    assert "max_memory={0: '14GB', 'cpu': '50GB'} at train_baseline.py:20 budgets GPU 0, which this runner lacks" \
        in the_row.sentence
    assert the_row.fix.startswith("at train_baseline.py:20: give max_memory only the GPUs the runner has")
    assert "current_device" not in the_row.fix


def test_every_row_has_the_time_it_watched(tmp_path):
    rows = rows_of(ran(tmp_path, process(9001, 1.0), returncode=0, seconds=12.345))
    assert {r.seconds for r in rows} == {12.35}


def test_run_imports_no_private_name_of_another_module():
    package = Path(in_process.__file__).parent
    private = [f"{path.name}: {node.module}.{alias.name}" for path in package.glob("*.py")
               for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)
               for alias in node.names if alias.name.startswith("_")]
    assert private == []
