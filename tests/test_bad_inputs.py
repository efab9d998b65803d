"""Every input the plugin reads, given a wrong value, ends in a sentence: options, ini keys, environment variables,
markers and fixture arguments.

Each case is a run of its own (a fresh pytest process, a one-test file) that must end with a sentence naming the
value and where it came from, and with the exit code pytest gives that kind of mistake: ``ExitCode.USAGE_ERROR``
(4; the main job exits with it too) for the run's configuration (an option, an ini key, an environment
variable), a test error or failure (1) for a marker or a fixture argument, which belong to one test. Never an
INTERNALERROR, never a raw traceback.
"""

import json
import re
import textwrap
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

import pytest_llmload
from fixtures import warm_runs

pytestmark = pytest.mark.timeout(240)

USAGE, TEST = int(pytest.ExitCode.USAGE_ERROR), int(pytest.ExitCode.TESTS_FAILED)

PLAIN = "def test_plain():\n    pass\n"
USES_LOADER = "def test_uses_loader(llmload_loader):\n    pass\n"
USES_HOOK = "def test_uses_hook(llmload_check_options):\n    pass\n"
NEEDS_DEEPSPEED = """
import pytest

@pytest.mark.llmload_deepspeed
def test_needs_deepspeed():
    pass

def test_plain():
    pass
"""
# Loader (and training-args hook) modules that fail while being imported, each in its own way.
BROKEN_MODULES = {
    "raises_at_import": "raise RuntimeError('no CUDA driver on this runner')\n\ndef load(request):\n    pass\n",
    "syntax_error": "def load(request)\n    pass\n",
    "exits_at_import": "import sys\nsys.exit(3)\n\ndef load(request):\n    pass\n",
    "not_callable": "load = 42\n",
}
XDIST = ("-p", "xdist", "-n", "2")
# A runner profile and a model config a user wrote, each with one thing wrong.
PROFILE = {"devices": 2, "device_memory": "80GiB", "host_memory": "256GiB", "disk": "1TB"}
LLAMA_8B = {key: value for key, value in json.loads(
    (Path(pytest_llmload.__file__).parent / "placement" / "architectures" / "llama-3-8b.json").read_text()).items()
    if not key.startswith("_")}


def profile_without(field: str, **change) -> str:
    return json.dumps({key: value for key, value in {**PROFILE, **change}.items() if key != field})


def config_with(**change) -> str:
    return json.dumps({**LLAMA_8B, **change})


def marked(marker: str) -> str:
    return f"import pytest\n\n@pytest.mark.{marker}\ndef test_marked():\n    pass\n"


def fixture_call(fixture: str, call: str) -> str:
    return f"def test_calls_{fixture}({fixture}):\n    {call}\n"


class Case(NamedTuple):
    id: str
    given: str  # how the value is given: option, ini, env, marker or fixture argument
    exit: int
    sentence: str  # a regex the run's output must match
    test: str = USES_LOADER
    args: tuple = ()
    ini: str = ""  # lines under [pytest]
    env: Optional[dict] = None
    summary: Optional[str] = None  # a regex for pytest's last line, where the outcome matters
    files: tuple = ()  # (path, text) written in the run's directory: a profile, a config.json

    @property
    def own_process(self) -> bool:
        # xdist starts processes anyway; DeepSpeed reads DS_ACCELERATOR once, at its import, which an earlier
        # test of the same process may have done.
        return "-n" in self.args or "DS_ACCELERATOR" in (self.env or {})

    @property
    def new_interpreter(self) -> bool:
        # DeepSpeed imported by this process (an earlier test) would be a forked run's too: a new interpreter reads
        # DS_ACCELERATOR at its own import. An xdist controller can be forked: its workers are new interpreters.
        return "DS_ACCELERATOR" in (self.env or {})


CASES = [
    # --- the loader under test: --llmload-loader, $PYTEST_LLMLOAD_LOADER, ini llmload_loader ---------------
    Case("loader-option-malformed", "option", USAGE, r"loader spec 'nocolon' from --llmload-loader is not of the form",
         args=("--llmload-loader", "nocolon")),
    Case("loader-option-empty", "option", USAGE, r"--llmload-loader '' is empty", args=("--llmload-loader=",)),
    Case("loader-env-empty", "env", USAGE, r"\$PYTEST_LLMLOAD_LOADER is set but empty", env={"PYTEST_LLMLOAD_LOADER": " "}),
    Case("loader-env-malformed", "env", USAGE,
         r"loader spec 'my loader' from \$PYTEST_LLMLOAD_LOADER is not of the form",
         env={"PYTEST_LLMLOAD_LOADER": "my loader"}),
    Case("loader-ini-malformed", "ini", USAGE, r"loader spec 'a:b:c' from ini 'llmload_loader' is not of the form",
         ini="llmload_loader = a:b:c"),
    Case("loader-option-missing-module", "option", USAGE, r"module 'nope_missing' does not import",
         args=("--llmload-loader", "nope_missing:load")),
    Case("loader-option-no-attribute", "option", USAGE, r"module 'not_callable' has no attribute 'absent'",
         args=("--llmload-loader", "not_callable:absent")),
    Case("loader-option-not-callable", "option", USAGE,
         r"'not_callable:load' from --llmload-loader names an int, not a callable",
         args=("--llmload-loader", "not_callable:load")),
    Case("loader-option-raises-at-import", "option", USAGE,
         r"loader spec 'raises_at_import:load' from --llmload-loader: importing module 'raises_at_import' raised "
         r"RuntimeError: no CUDA driver on this runner \(\S*raises_at_import\.py:1\)",
         args=("--llmload-loader", "raises_at_import:load")),
    Case("loader-option-syntax-error", "option", USAGE,
         r"importing module 'syntax_error' raised SyntaxError: expected ':' \(\S*syntax_error\.py:1\)",
         args=("--llmload-loader", "syntax_error:load")),
    Case("loader-option-exits-at-import", "option", USAGE,
         r"importing module 'exits_at_import' raised SystemExit: 3 \(\S*exits_at_import\.py:2\)",
         args=("--llmload-loader", "exits_at_import:load")),
    Case("loader-env-raises-at-import", "env", USAGE,
         r"loader spec 'raises_at_import:load' from \$PYTEST_LLMLOAD_LOADER: importing module 'raises_at_import' "
         r"raised",
         env={"PYTEST_LLMLOAD_LOADER": "raises_at_import:load"}),
    Case("loader-ini-syntax-error", "ini", USAGE,
         r"loader spec 'syntax_error:load' from ini 'llmload_loader': importing module 'syntax_error' raised "
         r"SyntaxError",
         ini="llmload_loader = syntax_error:load"),
    Case("loader-option-missing-module-xdist", "option", USAGE, r"module 'nope_missing' does not import",
         args=(*XDIST, "--llmload-loader", "nope_missing:load")),
    Case("loader-option-raises-at-import-xdist", "option", USAGE,
         r"importing module 'raises_at_import' raised RuntimeError: no CUDA driver on this runner",
         args=(*XDIST, "--llmload-loader", "raises_at_import:load")),
    Case("loader-option-syntax-error-xdist", "option", USAGE, r"importing module 'syntax_error' raised SyntaxError",
         args=(*XDIST, "--llmload-loader", "syntax_error:load")),
    Case("loader-env-exits-at-import-xdist", "env", USAGE, r"importing module 'exits_at_import' raised SystemExit: 3",
         args=XDIST, env={"PYTEST_LLMLOAD_LOADER": "exits_at_import:load"}),
    # --- what the loader is for: ini llmload_loader_purposes ------------------------------------------------
    Case("purposes-ini-unknown", "ini", USAGE,
         r"ini 'llmload_loader_purposes' = \['evaluation'\] is not a list of purposes; use 'inference' and/or 'train'",
         ini="llmload_loader_purposes = evaluation"),
    # --- the training script's hook: --llmload-training-args-hook, ini llmload_training_args_hook -------------
    Case("hook-option-malformed", "option", USAGE,
         r"loader spec 'nocolon' from --llmload-training-args-hook is not of the form 'module:function'",
         test=USES_HOOK, args=("--llmload-training-args-hook", "nocolon")),
    Case("hook-option-missing-module", "option", USAGE,
         r"'nope_missing:hook' from --llmload-training-args-hook: module 'nope_missing' does not import",
         test=USES_HOOK, args=("--llmload-training-args-hook", "nope_missing:hook")),
    Case("hook-ini-raises-at-import", "ini", USAGE,
         r"'raises_at_import:load' from ini 'llmload_training_args_hook': importing module 'raises_at_import' raised "
         r"RuntimeError", test=USES_HOOK, ini="llmload_training_args_hook = raises_at_import:load"),
    # --- --llmload-strict / ini llmload_strict ------------------------------------------------------------------
    Case("strict-ini-not-a-bool", "ini", USAGE, r"llmload_strict.*'maybe'", test=PLAIN, ini="llmload_strict = maybe"),
    # --- phase progress: --llmload-phase-progress(-seconds), ini llmload_phase_progress_seconds, llmload_near_deadline -------
    Case("phase-progress-option-word", "option", USAGE,
         r"--llmload-phase-progress-seconds='often' is not a number of seconds", test=PLAIN,
         args=("--llmload-phase-progress", "often")),
    Case("phase-progress-option-negative", "option", USAGE,
         r"--llmload-phase-progress-seconds='-5' is not a number of seconds",
         test=PLAIN, args=("--llmload-phase-progress=-5",)),
    Case("phase-progress-option-nan", "option", USAGE, r"--llmload-phase-progress-seconds='nan' is not",
         test=PLAIN, args=("--llmload-phase-progress", "nan")),
    Case("phase-progress-option-inf", "option", USAGE, r"--llmload-phase-progress-seconds='inf' is not",
         test=PLAIN, args=("--llmload-phase-progress", "inf")),
    Case("phase-progress-ini-word", "ini", USAGE,
         r"ini 'llmload_phase_progress_seconds'='often' is not a number of seconds", test=PLAIN,
         ini="llmload_phase_progress_seconds = often"),
    Case("near-deadline-ini-above-one", "ini", USAGE,
         r"ini 'llmload_near_deadline'='1.5' is not a fraction between 0 and 1", test=PLAIN,
         ini="llmload_near_deadline = 1.5"),
    Case("near-deadline-ini-nan", "ini", USAGE, r"ini 'llmload_near_deadline'='nan' is not a fraction",
         test=PLAIN, ini="llmload_near_deadline = nan"),
    # --- --llmload-progress PATH ----------------------------------------------------------------------------------
    Case("progress-option-missing-directory", "option", USAGE,
         r"--llmload-progress 'no/such/dir/progress.jsonl' cannot be opened for appending \(FileNotFoundError",
         test=PLAIN, args=("--llmload-progress", "no/such/dir/progress.jsonl")),
    Case("progress-option-a-directory", "option", USAGE,
         r"--llmload-progress '\.' cannot be opened for appending \(IsADirectoryError", test=PLAIN,
         args=("--llmload-progress", ".")),
    # --- GPUs per xdist worker: --llmload-gpus-per-worker (read only under -n, where GPUs are: faked here) -------
    Case("gpus-per-worker-option-word", "option", USAGE,
         r"--llmload-gpus-per-worker='two' is neither a positive number of GPUs nor 'off'", test=PLAIN,
         args=(*XDIST, "--llmload-gpus-per-worker=two"), env={"PYTEST_LLMLOAD_FAKE_GPUS": "GPU-a,GPU-b"}),
    # --- the predictions' runner profile and model: --llmload-runner/--llmload-model, ini llmload_runner/_model ---
    # (issue 38: a profile without device_memory planned 0-byte GPUs, without disk 0 B then an OOM, a 100,000-GPU
    # one ran until killed; a config transformers refuses was 'a bug in pytest-llmload' on every row)
    Case("runner-option-no-device-memory", "option", USAGE,
         r"runner profile \S*node\.json \(--llmload-runner 'node\.json'\) cannot be read: device_memory \(the memory "
         r"of each GPU\) is missing", test=PLAIN, args=("--llmload-runner", "node.json"),
         files=(("node.json", profile_without("device_memory")),)),
    Case("runner-ini-no-disk", "ini", USAGE,
         r"runner profile \S*node\.json \(ini 'llmload_runner' 'node\.json'\) cannot be read: disk \(what offload to "
         r"disk may use\) is missing", test=PLAIN, ini="llmload_runner = node.json",
         files=(("node.json", profile_without("disk")),)),
    Case("runner-option-100000-gpus", "option", USAGE,
         r"devices=100000 is more GPUs than one runner holds \(at most 64", test=PLAIN,
         args=("--llmload-runner", "node.json"), files=(("node.json", profile_without("", devices=100_000)),)),
    Case("runner-option-size-without-unit", "option", USAGE,
         r"node\.json.*device_memory 80 \(80 B\) is less than 1\.0 GiB", test=PLAIN,
         args=("--llmload-runner", "node.json"), files=(("node.json", profile_without("", device_memory=80)),)),
    Case("runner-option-misspelt-field", "option", USAGE, r"node\.json.*'disk_size' is not a field of a profile",
         test=PLAIN, args=("--llmload-runner", "node.json"),
         files=(("node.json", profile_without("disk", disk_size="1TB")),)),
    Case("model-option-unknown-activation", "option", USAGE,
         r"--llmload-model 'mine': \S*mine/config\.json: transformers \S+ cannot build a model from this config "
         r"\(the field hidden_act='gelu_fast9'\): KeyError", test=PLAIN,
         args=("--llmload-runner", "1xH100-80GB", "--llmload-model", "mine"),
         files=(("mine/config.json", config_with(hidden_act="gelu_fast9")),)),
    Case("model-ini-no-layers", "ini", USAGE,
         r"ini 'llmload_model' 'mine\.json': mine\.json is not a transformers config \(num_hidden_layers=0 is not a "
         r"size a model has \(a whole number from 1", test=PLAIN,
         ini="llmload_runner = 1xH100-80GB\nllmload_model = mine.json",
         files=(("mine.json", config_with(num_hidden_layers=0)),)),
    Case("model-option-unknown-model-type", "option", USAGE,
         r"mine\.json: model_type='llama9' is not an architecture transformers \S+ knows", test=PLAIN,
         args=("--llmload-runner", "1xH100-80GB", "--llmload-model", "mine.json"),
         files=(("mine.json", config_with(model_type="llama9")),)),
    # --- the shipped suite's known gaps: ini llmload_expected_failed_checks ------------------------------------------
    Case("expected-failures-ini-unknown-check", "ini", USAGE,
         r"ini 'llmload_expected_failed_checks': expected failed checks \['check_that_does_not_exist'\] are not checks",
         test=PLAIN,
         args=("--pyargs", "pytest_llmload.suite", "--collect-only"),
         ini="llmload_expected_failed_checks =\n    check_that_does_not_exist: tracked in #1"),
    Case("expected-failures-ini-no-reason", "ini", USAGE,
         r"ini 'llmload_expected_failed_checks': 'check_zero3_load' is not of the form 'check_name: reason", test=PLAIN,
         args=("--pyargs", "pytest_llmload.suite", "--collect-only"),
         ini="llmload_expected_failed_checks =\n    check_zero3_load"),
    # --- environment variables the plugin (or DeepSpeed, for it) reads ----------------------------------------------
    Case("ds-accelerator-empty", "env", TEST,
         r"DS_ACCELERATOR='' \(from the environment\).*one of \[.*'cpu'.*\]", test=NEEDS_DEEPSPEED,
         env={"DS_ACCELERATOR": ""}, summary=r"1 passed.* 1 error"),
    Case("ds-accelerator-tpu", "env", TEST,
         r"DS_ACCELERATOR='tpu' \(from the environment\).*one of \[.*'cpu'.*\]", test=NEEDS_DEEPSPEED,
         env={"DS_ACCELERATOR": "tpu"}, summary=r"1 passed.* 1 error"),
    Case("cuda-visible-devices-garbage", "env", 0,
         r"needs 1 GPU, 0 visible \(CUDA_VISIBLE_DEVICES=gpu0\)", test=marked("needs_gpus(1)"),
         args=("-rs",), env={"CUDA_VISIBLE_DEVICES": "gpu0"}, summary=r"1 skipped"),
    # --- markers ---------------------------------------------------------------------------------------------------
    Case("needs-gpus-no-argument", "marker", TEST,
         r"@pytest\.mark\.needs_gpus\(\) is invalid \(needs_gpus\(\) missing 1 required positional argument",
         test=marked("needs_gpus")),
    Case("needs-gpus-string", "marker", TEST, r"@pytest\.mark\.needs_gpus\('2'\) is invalid: got '2'",
         test=marked("needs_gpus('2')")),
    Case("needs-gpus-zero", "marker", TEST,
         r"@pytest\.mark\.needs_gpus\(0\) is invalid: got 0", test=marked("needs_gpus(0)")),
    Case("needs-gpus-bool", "marker", TEST,
         r"@pytest\.mark\.needs_gpus\(True\) is invalid", test=marked("needs_gpus(True)")),
    Case("needs-gpus-float", "marker", TEST,
         r"@pytest\.mark\.needs_gpus\(1\.5\) is invalid", test=marked("needs_gpus(1.5)")),
    Case("needs-gpus-two-arguments", "marker", TEST, r"@pytest\.mark\.needs_gpus\(1, 2\) is invalid",
         test=marked("needs_gpus(1, 2)")),
    Case("needs-gpus-unknown-keyword", "marker", TEST,
         r"needs_gpus\(gpus=2\) is invalid \(.*unexpected keyword argument 'gpus'",
         test=marked("needs_gpus(gpus=2)")),
    Case("needs-gpus-class-and-function-disagree", "marker", TEST,
         r"@pytest\.mark\.needs_gpus\(2\) on test_marked and @pytest\.mark\.needs_gpus\(1\) on TestTwoMarks disagree",
         test="import pytest\n\n@pytest.mark.needs_gpus(1)\nclass TestTwoMarks:\n"
              "    @pytest.mark.needs_gpus(2)\n    def test_marked(self):\n        pass\n"),
    Case("gpu-with-an-argument", "marker", TEST,
         r"@pytest\.mark\.gpu\(2\) is invalid.*use @pytest\.mark\.needs_gpus\(n\)", test=marked("gpu(2)")),
    Case("deepspeed-with-an-argument", "marker", TEST, r"@pytest\.mark\.llmload_deepspeed\('zero3'\) is invalid",
         test=marked("llmload_deepspeed('zero3')")),
    Case("isolated-positional", "marker", TEST, r"@pytest\.mark\.llmload_isolated\(30\) is invalid",
         test=marked("llmload_isolated(30)")),
    Case("isolated-timeout-string", "marker", TEST, r"llmload_isolated\(timeout='30'\) is invalid",
         test=marked("llmload_isolated(timeout='30')")),
    Case("isolated-timeout-zero", "marker", TEST,
         r"llmload_isolated\(timeout=0\) is invalid", test=marked("llmload_isolated(timeout=0)")),
    Case("isolated-timeout-nan", "marker", TEST, r"llmload_isolated\(timeout=nan\) is invalid",
         test=marked("llmload_isolated(timeout=float('nan'))")),
    Case("isolated-timeout-inf", "marker", TEST, r"llmload_isolated\(timeout=inf\) is invalid",
         test=marked("llmload_isolated(timeout=float('inf'))")),
    Case("isolated-unknown-keyword", "marker", TEST, r"llmload_isolated\(deadline=30\) is invalid",
         test=marked("llmload_isolated(deadline=30)")),
    Case("memory-limit-no-argument", "marker", TEST, r"@pytest\.mark\.limit_torch_memory\(\) is invalid",
         test=marked("limit_torch_memory")),
    Case("memory-limit-word", "marker", TEST, r"limit_torch_memory\('lots'\) is invalid: 'lots' is not a size",
         test=marked("limit_torch_memory('lots')")),
    Case("memory-limit-unknown-unit", "marker", TEST, r"limit_torch_memory\('24 XB'\) is invalid: .*unknown unit 'XB'",
         test=marked("limit_torch_memory('24 XB')")),
    Case("memory-limit-zero", "marker", TEST, r"limit_torch_memory\(0\) is invalid: 0 is not a positive size",
         test=marked("limit_torch_memory(0)")),
    Case("memory-limit-negative", "marker", TEST, r"limit_torch_memory\(-5\) is invalid: -5 is negative",
         test=marked("limit_torch_memory(-5)")),
    Case("memory-limit-inf", "marker", TEST, r"limit_torch_memory\(inf\) is invalid: inf is not a finite size",
         test=marked("limit_torch_memory(float('inf'))")),
    Case("memory-limit-nan", "marker", TEST, r"limit_torch_memory\(nan\) is invalid: nan is not a finite size",
         test=marked("limit_torch_memory(float('nan'))")),
    Case("memory-limit-bool", "marker", TEST, r"limit_torch_memory\(True\) is invalid: True is a bool, not a size",
         test=marked("limit_torch_memory(True)")),
    Case("memory-limit-device", "marker", TEST, r"device='tpu' is neither 'cuda' nor 'cpu'",
         test=marked("limit_torch_memory('24 MB', device='tpu')")),
    # --- fixture arguments -------------------------------------------------------------------------------------------
    Case("distributed-world-size-zero", "fixture argument", TEST, r"world_size=0; expected a positive int",
         test=fixture_call("distributed_env", "distributed_env.run(print, world_size=0)")),
    Case("distributed-world-size-string", "fixture argument", TEST, r"world_size='2'; expected a positive int",
         test=fixture_call("distributed_env", "distributed_env.run(print, world_size='2')")),
    Case("distributed-timeout-nan", "fixture argument", TEST,
         r"timeout=nan; expected a positive, finite number of seconds",
         test=fixture_call("distributed_env", "distributed_env.run(print, timeout=float('nan'))")),
    Case("distributed-timeout-inf", "fixture argument", TEST,
         r"timeout=inf; expected a positive, finite number of seconds",
         test=fixture_call("distributed_env", "distributed_env.run(print, timeout=float('inf'))")),
    Case("distributed-backend-unknown", "fixture argument", TEST, r"backend='tpu' is not a torch\.distributed backend",
         test=fixture_call("distributed_env", "distributed_env.run(print, backend='tpu')")),
    Case("checkpoint-factory-arch", "fixture argument", TEST,
         r"unknown tiny architecture 'gpt2'; choose one of llama, qwen2",
         test=fixture_call("llmload_checkpoint_factory", "llmload_checkpoint_factory('gpt2')")),
    Case("checkpoint-factory-dtype", "fixture argument", TEST, r"dtype='float13' is not supported; use one of float32",
         test=fixture_call("llmload_checkpoint_factory", "llmload_checkpoint_factory(dtype='float13')")),
]


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_input_ends_in_a_sentence(pytester, monkeypatch, case):
    for name, source in BROKEN_MODULES.items():
        pytester.makepyfile(**{name: source})
    pytester.makepyfile(test_case=textwrap.dedent(case.test))
    for path, text in case.files:
        (pytester.path / path).parent.mkdir(parents=True, exist_ok=True)
        (pytester.path / path).write_text(text)
    if case.ini:
        pytester.makeini("[pytest]\n" + case.ini + "\n")
    monkeypatch.delenv("PYTEST_LLMLOAD_LOADER", raising=False)
    for key, value in (case.env or {}).items():
        monkeypatch.setenv(key, value)
    # In-process where it can be (a fresh interpreter costs ~1 s a case): xdist runs get a process of their own,
    # forked from this one (fixtures/warm_runs.py), DS_ACCELERATOR a new interpreter.
    if case.new_interpreter:
        result = pytester.runpytest_subprocess("-p", "no:cacheprovider", *case.args)
    elif case.own_process:
        result = warm_runs.runpytest(pytester, "-p", "no:cacheprovider", *case.args)
    else:
        result = pytester.runpytest("-p", "no:cacheprovider", *case.args)
    output = result.stdout.str() + "\n" + result.stderr.str()
    assert "INTERNALERROR" not in output and "Traceback" not in output, output
    assert re.search(case.sentence, output, re.DOTALL), output
    assert result.ret == case.exit, output
    if case.summary:
        assert re.search(case.summary, result.stdout.lines[-1]), output


def test_a_bare_install_running_model_tests_is_one_usage_error_naming_the_extra(pytester, monkeypatch):
    """Without the extras, a run whose tests load models stops at collection with one sentence, not an error
    row per test saying No module named 'torch'."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    pytester.makepyfile("def test_a(llmload_checkpoint): pass\ndef test_b(llmload_checkpoint): pass\n")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*2 collected test(s) load models through pytest-llmload (e.g. "
                                 "test_a_bare_install*::test_a), but torch is not installed: pip install "
                                 "'pytest-llmload[[]all]'*"])


def test_the_fixes_a_training_script_imports_pull_in_no_test_framework():
    """The Trainer guard, the fp16 upcast and the rank-pinning rule, imported as production code would: neither
    pytest nor hypothesis comes with them (a real interpreter: what it imports is the subject)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from pytest_llmload.fixes.trainer_guard import prepare_training_args_for_placed_model\n"
            "from pytest_llmload.fixes.training_scripts import upcast_trainable_parameters\n"
            "from pytest_llmload.fixes.training_scripts import is_distributed\n"
            "print(sorted(m for m in ('pytest', '_pytest', 'hypothesis') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
