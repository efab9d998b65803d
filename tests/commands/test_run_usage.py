"""``python -m pytest_llmload run``'s misuse and its machinery, on commands that import no stack (each well under a
second): usage errors before anything starts, an unmapped hub id's sentence, the tiny config, a hang's deadline with
every process's stack and nothing left running, a repo's own sitecustomize kept, an exit without a traceback."""

import io
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pytest_llmload.commands import cli, tiny_weights
from pytest_llmload.commands.command import CommandRun, run_command
from pytest_llmload.commands.in_process import is_repo_file
from pytest_llmload.commands.rows import Facts, _placements, command_row, failure_rows


def usage(capsys, *argv):
    code = cli.main(list(argv), out=io.StringIO())
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    ((), "no command to run; give it after '--'"),
    (("--",), "no command to run; give it after '--'"),
    (("--steps", "0", "--", "python", "x.py"), "--steps 0: give 1 or more optimizer steps"),
    (("--deadline", "-1", "--", "python", "x.py"), "--deadline -1: give a number of seconds above 0"),
    (("--model", "Qwen/Qwen2-0.5B", "--", "python", "x.py"), "--model 'Qwen/Qwen2-0.5B' is not ID=CONFIG"),
    (("--model", "Qwen/Qwen2-0.5B=qwen9", "--", "python", "x.py"), "is neither a shipped architecture"),
    (("--", "no-such-program-llmload", "train.py"), "the command 'no-such-program-llmload' is not found"),
    (("--json", "/no-such-dir-llmload/run.json", "--", "python", "x.py"), "the directory '/no-such-dir-llmload' does "
                                                                           "not exist"),
])
def test_a_command_line_that_cannot_run_is_a_usage_error_before_anything_starts(capsys, tmp_path, monkeypatch, argv,
                                                                                said):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    code, err = usage(capsys, *argv)
    assert code == 4
    assert err.startswith("llmload run: error: ") and said in err
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_an_unknown_hub_id_names_the_call_and_how_to_map_it():
    with pytest.raises(tiny_weights.UnmappedModel) as raised:
        tiny_weights.real_config("my-org/my-model-1b", {}, "AutoModelForCausalLM.from_pretrained('my-org/my-model-1b') "
                                 "at train.py:12")
    said = str(raised.value)
    assert said.startswith("AutoModelForCausalLM.from_pretrained('my-org/my-model-1b') at train.py:12 names "
                           "'my-org/my-model-1b', which pytest-llmload run cannot find offline")
    assert "--model my-org/my-model-1b=llama-3-8b" in said and "meta-llama/Meta-Llama-3-8B" in said


def test_hub_ids_of_shipped_architectures_and_their_fine_tuned_releases_need_no_mapping():
    assert tiny_weights.real_config("Qwen/Qwen2.5-7B-Instruct", {}, "call")["hidden_size"] == 3584
    assert tiny_weights.real_config("my/qwen", {"my/qwen": "qwen2.5-72b"}, "call")["num_hidden_layers"] == 80


def test_the_tiny_config_keeps_the_architecture_and_shrinks_its_sizes():
    real = tiny_weights.real_config("mistralai/Mixtral-8x7B-v0.1", {}, "call")
    tiny = tiny_weights.shrunk({**real, "layer_types": ["full_attention"] * 32, "pad_token_id": 0})
    kept = ("model_type", "architectures", "torch_dtype", "tie_word_embeddings", "hidden_act")
    assert {key: tiny[key] for key in kept} == {key: real[key] for key in kept}
    assert (tiny["num_hidden_layers"], tiny["hidden_size"], tiny["num_local_experts"], tiny["vocab_size"]) == (
        2, 64, 4, tiny_weights.TOKENIZER_VOCABULARY)
    assert "layer_types" not in tiny and "pad_token_id" not in tiny


def ended(pid, within=10.0):
    """Whether process ``pid`` is gone (or a zombie) within ``within`` seconds (a SIGKILL lands asynchronously)."""
    until = time.monotonic() + within
    while time.monotonic() < until:
        try:
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


def script(tmp_path, text):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_hang_ends_every_process_at_the_deadline_with_each_stack(tmp_path):
    job = script(tmp_path, """\
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
        def wait_for_the_data():
            time.sleep(60)
        wait_for_the_data()
        """)
    # (the deadline leaves both interpreters time to start on a busy machine)
    ran = run_command([sys.executable, str(job)], tmp_path / "run", steps=2, deadline=3, models={})
    assert ran.hung and len(ran.stacks) == 2  # the script's, and its child's (in a session of its own)
    assert all(ended(pid) for pid in ran.stacks)
    row = command_row(ran, Facts(ran))
    assert (row.verdict, row.cause) == ("error", "hang")
    assert "did not end within its 3 s deadline: stuck at " in row.sentence
    assert "job.py:4 in wait_for_the_data" in row.sentence
    assert "stack at the 3 s deadline" in ran.log.read_text()


def test_the_repos_own_sitecustomize_keeps_working(tmp_path, monkeypatch):
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['REPO_SITE'] = 'ran'\n")
    monkeypatch.setenv("PYTHONPATH", str(own))
    job = script(tmp_path, "import os, sys\nprint('repo site:', os.environ.get('REPO_SITE'))\n")
    ran = run_command([sys.executable, str(job)], tmp_path / "run", steps=2, deadline=30, models={})
    assert "repo site: ran" in ran.log.read_text()
    assert len(ran.processes) == 1 and ran.processes[0]["outcome"] == "finished"  # (ours ran too)


def test_an_exit_without_a_traceback_is_the_commands_error(tmp_path):
    job = script(tmp_path, "import sys\nsys.exit(3)\n")
    ran = run_command([sys.executable, str(job)], tmp_path / "run", steps=2, deadline=30, models={})
    row = command_row(ran, Facts(ran))
    assert (row.verdict, row.cause) == ("error", "died")
    assert row.sentence.startswith("the command exited 3 without a Python traceback; its output: ")


def test_a_sigterm_ends_the_run_and_every_process_of_the_command(tmp_path):
    started = tmp_path / "started"
    job = script(tmp_path, f"""\
        import os, time
        open({str(started)!r}, "w").write(str(os.getpid()))
        time.sleep(60)
        """)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    parent = subprocess.Popen([sys.executable, "-m", "pytest_llmload", "run", "--", sys.executable, str(job)],
                              stderr=subprocess.PIPE, text=True, env=env)
    until = time.monotonic() + 30
    while not (started.exists() and started.read_text()) and time.monotonic() < until:
        time.sleep(0.05)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 143
    assert "llmload run: stopped by SIGTERM; every process of the command was ended" in parent.stderr.read()
    pid = int(started.read_text())
    assert ended(pid)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("llmload-run-")] == []  # nothing left behind


def test_a_placement_says_which_budgeted_gpus_this_runner_lacks():
    load = {"where": "train_baseline.py:20", "places": ["cpu"], "gpus_budgeted_absent": ["0"]}
    assert _placements([load]) == "train_baseline.py:20: cpu (its max_memory budgets GPU 0, which this runner lacks)"


def test_a_launchers_script_in_the_environment_is_not_the_repos_code():
    assert not is_repo_file(os.path.join(sys.prefix, "bin", "torchrun"))
    assert not is_repo_file("<string>")
    assert is_repo_file("/home/me/repo/train.py")


def test_a_hang_in_the_runs_own_tiny_build_is_not_offload_hang(tmp_path):
    ran = CommandRun(["python", "train.py"], None, 60.0, 1.0, 60.0, [], {}, tmp_path, tmp_path / "log", [], [])
    build = ('  File "/x/site-packages/transformers/modeling_utils.py", line 5 in from_pretrained\n'
             '  File "/x/pytest_llmload/commands/tiny_weights.py", line 137 in _build\n')
    load = '  File "/x/site-packages/transformers/modeling_utils.py", line 5 in from_pretrained\n'
    for stack, caught in ((build, False), (load, True)):
        ran.stacks = {1: stack}
        row = next(row for row in failure_rows(ran, Facts(ran)) if row.guards == "offload-hang")
        assert (row.verdict == "failed") is caught
    ran.stacks = {1: build}
    assert "in pytest-llmload run's own tiny build: a fault of the run" in command_row(ran, Facts(ran)).sentence


def test_the_tiny_layers_go_where_the_real_layers_at_their_depth_go():
    real = {"model.embed_tokens": "cpu", **{f"model.layers.{i}": "cpu" if i < 20 else "disk" for i in range(32)},
            "model.norm": "disk", "lm_head": "disk"}
    assert tiny_weights._tiny_map(real, 32, 2) == {"model.embed_tokens": "cpu", "model.norm": "disk",
                                                   "lm_head": "disk", "model.layers.0": "cpu",
                                                   "model.layers.1": "disk"}
    assert tiny_weights._tiny_map({"": "cpu"}, 32, 2) == {"": "cpu"}
