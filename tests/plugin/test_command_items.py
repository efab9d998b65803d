"""The repo's own commands from pytest: ``llmload_commands`` as test items (``llmload-command::NAME``) and the
``llmload_run`` fixture, each run through ``python -m pytest_llmload run``, on commands that import no stack."""

import shlex
import shutil
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from pytest_llmload.plugin.command_items import CommandResult, named_commands
from pytest_llmload.reports.row import Row

COMMANDS = Path(__file__).resolve().parents[2] / "fixtures" / "commands"
COMMANDS_INI = """
    [pytest]
    llmload_commands =
        quiet: python -c "print(1)"
        crash: python -c "raise ValueError('boom')"
        absent: no-such-program-llmload train.py
        gpu: serve: python -c "print(2)"
"""


def test_named_commands_pass_fail_and_skip_with_the_rows_text_and_the_fixture_returns_rows(pytester, monkeypatch,
                                                                                          tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a failed item keeps its outputs: here, not in /tmp
    pytester.makeini(COMMANDS_INI)
    pytester.makepyfile(test_run=textwrap.dedent("""
        def test_the_fixture(llmload_run):
            result = llmload_run('python -c "print(1)"', steps=1)
            assert result.command_row.verdict == "passed", result.command_row
            assert result.row("fp16-unscale").verdict == "not exercised"
            assert result.row("watch_fp16_unscale") is result.row("fp16-unscale")
            assert not result.exercised and not result.failed
            result.assert_no_known_failure()

        def test_the_fixtures_failure(llmload_run):
            llmload_run(["python", "-c", "raise ValueError('boom')"]).assert_no_known_failure()
    """))
    result = pytester.runpytest("-rs", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=3, skipped=2)
    result.stdout.fnmatch_lines([
        "*python -c 'raise ValueError('\"'\"'boom'\"'\"')'*1 row(s) failed",
        "E * ERROR command: the command crashed at a library's code*ValueError: boom",
        "*__ llmload-command::crash __*",
        "ERROR command: the command crashed at a library's code*ValueError: boom",
        "its output and outputs: *",
        "*__ llmload-command::absent __*",
        "no-such-program-llmload train.py was not run: llmload run: error: the command 'no-such-program-llmload' is "
        "not found*",
        "SKIPPED [[]1[]] tox.ini:*: quiet ran (finished (0 optimizer step(s)) in 1 process(es)*) but reached no known failure's "
        "mechanism: meta-backward: no optimizer step ran; *",
        "SKIPPED [[]1[]] tox.ini:*: marked gpu: needs 1 GPU*",
    ])
    assert "Traceback" not in result.stdout.str()


def test_gpu_commands_are_marked_and_only_a_run_of_the_whole_project_collects_commands(pytester):
    pytester.makeini(COMMANDS_INI)
    pytester.makepyfile(test_plain="def test_plain(): pass")
    gpu = pytester.runpytest("-m", "gpu", "--collect-only", "-q")
    gpu.stdout.fnmatch_lines(["llmload-command::serve", "1/5 tests collected (4 deselected)*"])
    chosen = pytester.runpytest("-k", "crash or plain", "--collect-only", "-q")
    chosen.stdout.fnmatch_lines(["test_plain.py::test_plain", "llmload-command::crash", "2/5 tests collected*"])
    one_file = pytester.runpytest("test_plain.py", "--collect-only", "-q")
    one_file.stdout.fnmatch_lines(["test_plain.py::test_plain", "1 test collected*"])
    by_option = pytester.runpytest(  # (the option wins over the ini's list)
        "--llmload-commands", "eval: python eval.py", "-k", "eval", "--collect-only", "-q")
    by_option.stdout.fnmatch_lines(["llmload-command::eval", "1/2 tests collected*"])


def test_a_model_mapping_that_is_not_id_equals_config_is_a_usage_error(pytester):
    pytester.makeini(COMMANDS_INI + "    llmload_command_models = my-org/my-model\n")
    result = pytester.runpytest("--collect-only", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini 'llmload_command_models': 'my-org/my-model' is not ID=CONFIG; write e.g.*"])


@pytest.mark.parametrize("line, said", [
    ("train python train.py", "'train python train.py' is not 'NAME: COMMAND'"),
    ("train:", "'train:' is not 'NAME: COMMAND'"),
    ("gpu: python serve.py", "'gpu: python serve.py' is not 'NAME: COMMAND'"),
    ("train: python -c 'print(1)", "the command does not split as a shell would"),
])
def test_a_bad_command_line_is_a_usage_error_naming_it(line, said):
    with pytest.raises(pytest.UsageError, match="ini 'llmload_commands': ") as raised:
        named_commands([line], "ini 'llmload_commands'")
    assert said in str(raised.value)


def test_a_name_given_twice_is_a_usage_error_and_gpu_is_a_prefix():
    with pytest.raises(pytest.UsageError, match="the name 'train' is given twice"):
        named_commands(["train: python a.py", "gpu: train: python b.py"], "ini 'llmload_commands'")
    (serve,) = named_commands(["gpu: serve: python serve.py --port 0"], "ini 'llmload_commands'")
    assert (serve.name, serve.argv, serve.gpu) == ("serve", ("python", "serve.py", "--port", "0"), True)


def test_the_failure_text_is_the_failed_rows_with_their_fixes():
    rows = (Row("watch_fp16_unscale", "failed", guards="fp16-unscale", failure="fp16-unscale",
                sentence="fp16-unscale caught at train.py:29 in main", fix="load in float32"),
            Row("watch_dp_dtype", "not exercised", guards="dp-dtype", sentence="not exercised: dp-dtype: no Trainer"))
    result = CommandResult(("python", "train.py"), 1, Row("command", "passed"), rows)
    with pytest.raises(AssertionError) as raised:
        result.assert_no_known_failure()
    assert str(raised.value).splitlines() == [
        "python train.py: 1 row(s) failed", "FAILED watch_fp16_unscale: fp16-unscale caught at train.py:29 in main",
        "    fix (fp16-unscale): load in float32"]
    with pytest.raises(KeyError, match="its rows: command, fp16-unscale, dp-dtype"):
        result.row("offload-hang")


def test_a_real_commands_known_failure_fails_its_item_at_the_repos_line_with_the_fix(pytester, monkeypatch, tmp_path):
    # fixtures/commands/fp16_repo: float16 weights under a GradScaler, fp16-unscale at train.py:29 (one real run).
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PYTEST_LLMLOAD_TINY_CACHE", str(tmp_path / "tiny-checkpoints"))
    shutil.copytree(COMMANDS / "fp16_repo", pytester.path, dirs_exist_ok=True)
    python = shlex.quote(sys.executable)  # (this stack's, whichever python is first on PATH)
    pytester.makeini(f"[pytest]\nllmload_commands = before: {python} train.py --config configs/before.json\n"
                     "llmload_command_steps = 1\n")
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*__ llmload-command::before __*",
        "*python* train.py --config configs/before.json",
        "FAILED watch_fp16_unscale: fp16-unscale caught at train.py:29 in main*",
        "    fix (fp16-unscale): *",
    ])
