"""The plugin's vocabulary: every option, ini key and marker, with its help text, and every ``PYTEST_LLMLOAD_*``
environment variable the package sets or reads.

pytest imports the plugin on every run of every repo that installs it, most of which never use it. So the plugin
imports only this module and its fixtures at start-up (plain strings, no imports), and the code that reads a
name imports it from here: one definition each, and nothing else compiled or executed until a run needs it.

One naming rule: every option, ini key, marker and fixture starts with ``llmload`` (``--llmload-...``,
``llmload_...``), except the names the docs promise as this plugin's vocabulary (the fixtures ``gpu_model``,
``lora_model``, ``distributed_env``; the markers ``needs_gpus`` and ``gpu``) and ``limit_torch_memory``, named after
pytest-memray's ``limit_memory``.
"""

from typing import NamedTuple


class Setting(NamedTuple):
    """One setting, declared once: the option ``--llmload-<key with dashes>`` and the ini key ``llmload_<key>``
    (pytest-timeout's pairing), the same help, one type. The option wins over the ini key; :mod:`pytest_llmload.config.settings`
    registers and reads every one."""

    key: str
    kind: str  # text | path | bool | lines | seconds | fraction | gpus | count: how it is parsed (settings.PARSERS)
    help: str
    metavar: str = ""
    default: object = None
    aliases: tuple = ()  # older spellings of the option, still accepted
    env: str = ""  # an environment variable read between the option and the ini key

    @property
    def option(self) -> str:
        return "--llmload-" + self.key.replace("_", "-")

    @property
    def ini(self) -> str:
        return "llmload_" + self.key

    @property
    def dest(self) -> str:
        return "llmload_" + self.key


# --- environment variables: each one's name, who sets it and who reads it -------------------------------------
# The loader under test, set by the user; read by loader.seam (between --llmload-loader and the ini key).
LOADER_ENV = "PYTEST_LLMLOAD_LOADER"
# Set by the main job for its pytest child, and by that child for its xdist workers: the pid to die with; read by
# runners.lifeline (and plugin.configuration, which ties such a run to it).
PARENT_ENV = "PYTEST_LLMLOAD_PARENT_PID"
# Set by the main job for its pytest child: the temp dir to remove if the main job dies first; read (and removed from
# the environment) by runners.lifeline.
PARENT_WORKDIR_ENV = "PYTEST_LLMLOAD_PARENT_WORKDIR"
# Set by the user for a launched job (exported before srun/mpirun/torchrun): a secret every rank shares; every value
# the ranks post to the launcher's store is signed with it (runners.launcher, runners.wire), so a process that reaches
# the port but does not know it cannot post a value they take.
RUN_SECRET_ENV = "PYTEST_LLMLOAD_RUN_SECRET"
# Set by a rank's pytest (plugin.launched_run) for what it starts; read by runners.launcher: a pytest run from its
# tests (pytester) sees the launcher's variables too, but is no rank of the job, and runs plain.
RANK_OF_ENV = "PYTEST_LLMLOAD_RANK_OF"
# Set (to anything) by the user, or this repo's conftest: the forkserver preloads torch only, not the Hugging Face
# stack and DeepSpeed; read by runners.warm_server.
COLD_FORKSERVER_ENV = "PYTEST_LLMLOAD_COLD_FORKSERVER"
# Set by plugin.xdist_gpus in each xdist worker that got GPUs: its list and the run's count of them; read by
# system.gpus for the skip reason of a test that needs more than the worker holds.
WORKER_GPUS_ENV = "PYTEST_LLMLOAD_WORKER_GPUS"
GPUS_TOTAL_ENV = "PYTEST_LLMLOAD_GPUS_TOTAL"
# Test seam, never set in real use: the comma-separated UUIDs of the machine's GPUs, read by system.gpus in place of
# `nvidia-smi -L` (xdist's controller) and of torch's count, so that the assignment and the skips can be tested on a
# CPU machine.
FAKE_GPUS_ENV = "PYTEST_LLMLOAD_FAKE_GPUS"
# Test seam: the name of a check whose code should crash right after its load, read by checks.contract in every
# process a check runs in (isolated children, ranks), to prove that a check's own crash is an error row, never a
# verdict.
INJECT_CRASH_ENV = "PYTEST_LLMLOAD_INJECT_CHECK_CRASH"

HOOK_ATTRIBUTE = "llmload_training_args_hook"
PURPOSES_ATTRIBUTE = "llmload_purposes"
DTYPES_ATTRIBUTE = "llmload_dtypes"
NOT_APPLICABLE_ATTRIBUTE = "llmload_not_applicable"
# How the repo trains, declared by a loader attribute, an ini key and an option of the same name (the option as
# --llmload-trains-...): what a training check's keyword is called, and the help. A check that takes the keyword
# skips "not exercised" when its scenario is not how the repo trains.
TRAINING_DECLARATIONS = {
    "trains_with_trainer": (
        "this repo's training hands the model to transformers.Trainer (or a subclass: trl's SFTTrainer, "
        "Seq2SeqTrainer) with no training-args hook: the Trainer check (dp-dtype) judges a stock Trainer and can fail; "
        "without this, a hook, or a Trainer class its loader's modules import, it only says what it assumed."
    ),
    "trains_without_trainer": (
        "this repo's training never hands the model to transformers.Trainer (a custom loop, accelerate, FSDP or "
        "DeepSpeed scripts): the Trainer check (dp-dtype) skips 'not exercised'."
    ),
    "trains_under_deepspeed": (
        "this repo trains only under DeepSpeed (its engine keeps float32 master weights for fp16 and runs one process "
        "per GPU): the fp16 GradScaler check (fp16-unscale) and the Trainer check (dp-dtype) skip 'not exercised'."
    ),
    "trains_fp16_without_scaler": (
        "this repo trains half-precision weights without a GradScaler (a pure float16 trainer: mixed precision, "
        "Trainer's fp16 and accelerate's 'fp16', turned off for half-precision weights): a float16 trainable weight "
        "is then how it trains, and the fp16 GradScaler check (fp16-unscale) skips 'not exercised'."
    ),
}


SETTINGS = (
    # --- the loader under test (pytest_llmload.loader.seam)
    Setting("loader", "text", metavar="MODULE:FUNCTION", env=LOADER_ENV, help=(
        "the loader under test, as 'module:function' (a callable taking a pytest_llmload.LoadRequest and "
        f"returning a model or (model, tokenizer)); between the option and the ini key, ${LOADER_ENV}. "
        "Default: the built-in reference loader.")),
    Setting("training_args_hook", "text", metavar="MODULE:FUNCTION", help=(
        "your training script's hook, as 'module:function', called as hook(training_args, model) between "
        "TrainingArguments and Trainer(...) (pytest-llmload's fixes ship one: prepare_training_args_for_placed_model). "
        f"The Trainer check runs Trainer as transformers ships it, with this hook. After the ini key, the loader "
        f"function's attribute {HOOK_ATTRIBUTE}; default: none (stock Trainer).")),
    *(Setting(keyword, "bool", help=(f"declare that {text} After the ini key, the loader function's attribute "
                                      f"llmload_{keyword} = True."))
      for keyword, text in TRAINING_DECLARATIONS.items()),
    Setting("loader_purposes", "lines", metavar="PURPOSE", help=(
        "what the loader under test is for: inference and/or train (default: both; the option may be repeated, "
        "the ini key takes one a line). Checks of the other purpose skip, saying so. After the ini key, the loader "
        f"function's attribute: load.{PURPOSES_ATTRIBUTE} = ('inference',).")),
    Setting("loader_dtypes", "lines", metavar="DTYPE", help=(
        "the dtypes the loader under test loads (float32, float16, bfloat16; the option may be repeated, the ini key "
        "takes one a line): every check asks in one of them, its budgets sized for it. Default: observed, a loader "
        "that returns weights in another dtype than asked is asked again in the dtype its weights have. After the "
        f"ini key, the loader function's attribute: load.{DTYPES_ATTRIBUTE} = ('bfloat16',).")),
    Setting("not_applicable", "lines", metavar="'CHECK: REASON'", help=(
        "checks that do not apply to this repo, one 'check_name: reason' each (the option may be repeated, the ini "
        "key takes one a line): each skips, showing the declaration and its reason, and does not fail the run. "
        f"After the ini key, the loader function's attribute: load.{NOT_APPLICABLE_ATTRIBUTE} = "
        "{'check_offload_inference': 'we never offload'}.")),
    # --- verdicts (pytest_llmload.plugin.check_row, pytest_llmload.plugin.parametrize)
    Setting("strict", "bool", help=(
        "count a check that could not judge the loader (skipped 'not exercised: ...', e.g. nothing was offloaded, "
        "the 4-bit request was ignored) as a failure.")),
    Setting("expected_failed_checks", "lines", metavar="'CHECK: REASON'", help=(
        "known gaps of the configured loader, one 'check_name: reason' each (the option may be repeated, the ini "
        "key takes one a line): the shipped suite (pytest --pyargs pytest_llmload.suite) runs them as strict "
        "xfails.")),
    Setting("checks", "lines", metavar="MODULE:ATTRIBUTE", help=(
        "more checks to run beside the built-in ones: 'module:attribute' naming a pytest_llmload.Check or a list "
        "of them (the option may be repeated, the ini key takes one a line). Packages can also publish checks "
        "through the entry-point group 'pytest_llmload.checks'.")),
    Setting("progress", "path", metavar="PATH",
            help="append one JSON line per test outcome to PATH (used by 'python -m pytest_llmload')."),
    # --- predictions for runners this machine is not (pytest_llmload.prediction)
    Setting("runner", "text", metavar="PROFILE[,PROFILE]", help=(
        "predict the checks' scenarios on these runner profiles (comma-separated: shipped names like 8xH100-80GB, "
        "or paths to profile .json files): the rows say what the loader would do there, marked PREDICTED.")),
    Setting("model", "text", metavar="NAME|CONFIG", help=(
        "the architecture the predictions load, at full size without weights: a shipped name (llama-3-70b, ...) "
        "or a local config.json. Default llama-3-8b.")),
    Setting("gate_runners", "lines", metavar="RUNNER[:MODEL]", help=(
        "the runner/model pairs whose PREDICTED rows fail the run (RUNNER as --llmload-runner names it, MODEL as "
        "--llmload-model does, none: every model; several a line, or the option repeated): a PREDICTED row on any "
        "other pair is reported and the run exits 0. Default: every pair fails the run.")),
    Setting("expected_predictions", "lines", metavar="'SCENARIO[@RUNNER]: REASON'", help=(
        "predicted rows this repo expects, one 'predict_zero3@8xH100-80GB: reason' each (no @RUNNER: on every "
        "runner; the option may be repeated, the ini key takes one a line): each is an xfail while it is predicted, "
        "and an xpass once it is not (strict, failing the run, on a pair llmload_gate_runners gates on).")),
    # --- GPUs (pytest_llmload.plugin.markers, pytest_llmload.plugin.xdist_gpus)
    Setting("gpu_fixtures", "lines", metavar="FIXTURE", help=(
        "extra fixture names that need a GPU: tests using them are marked 'gpu' (default: gpu_model; the option may "
        "be repeated, the ini key takes one a line).")),
    Setting("require_gpus", "bool", help=(
        "fail the run, instead of skipping every GPU test, when it selects GPU tests and sees no GPU (a GPU runner "
        "whose driver or CUDA_VISIBLE_DEVICES is broken).")),
    Setting("gpus_per_worker", "gpus", metavar="K|off", help=(
        "under pytest -n N on a machine with GPUs: how many GPUs each xdist worker holds (its own "
        "CUDA_VISIBLE_DEVICES; default: the visible GPUs divided by N, and where there are fewer GPUs than workers, "
        "the workers share them, a test that may fill one running alone), or 'off' to let every worker see every "
        "GPU.")),
    # --- diagnostics (pytest_llmload.reports.sections)
    Setting("phase_progress_seconds", "seconds", metavar="SECONDS", default=30.0,
            aliases=("--llmload-phase-progress",), help=(
                "seconds between progress lines (to stderr) while one phase of a test (load, generate, ...) runs "
                "long; 0 turns them off. Default 30.")),
    Setting("near_deadline", "fraction", metavar="FRACTION", default=0.8, help=(
        "the fraction of its deadline (pytest-timeout, or a check's own) above which the session summary lists a "
        "test or check as close to it. Default 0.8.")),
    Setting("html", "path", metavar="PATH", help=(
        "write a self-contained HTML report to PATH: each check's verdict, and for each check that placed a model, "
        "its device map and its memory per phase, drawn (needs matplotlib: pip install 'pytest-llmload[report]'). "
        "With pytest-html installed, the same pictures go into its report as extras.")),
    Setting("import_timeout", "seconds", metavar="SECONDS", default=300.0, help=(
        "seconds the loader's module may take to import (at collection, offline); past it the run ends with a usage "
        "error naming the line it was blocked in, with every thread's stack. A progress line is printed every "
        "llmload_phase_progress_seconds meanwhile. Default 300.")),
    # --- the run stopped early (pytest_llmload.plugin.interruption)
    Setting("run_deadline", "seconds", metavar="SECONDS", help=(
        "seconds the whole run may take; past them it stops as on Ctrl-C (the check running is ended), JUnit XML "
        "and the HTML report are written with the rows finished so far and marked interrupted, and pytest exits 2. "
        "Default: none (0 too).")),
    # --- the repo's own commands from pytest (pytest_llmload.plugin.command_items)
    Setting("commands", "lines", metavar="'NAME: COMMAND'", help=(
        "the repo's own commands, one 'NAME: COMMAND' each (the option may be repeated, the ini key takes one a "
        "line), each a test item llmload-command::NAME, run by 'python -m pytest_llmload run' in the rootdir on a "
        "run of the whole project; 'gpu: NAME: COMMAND' marks it gpu (pytest -m gpu).")),
    Setting("command_steps", "count", metavar="N", default=2, help=(
        "optimizer steps before a command's training stops (llmload_commands, the llmload_run fixture). Default 2.")),
    Setting("command_deadline", "seconds", metavar="SECONDS", default=600.0, help=(
        "a command's whole deadline (llmload_commands, the llmload_run fixture). Default 600.")),
    Setting("command_models", "lines", metavar="ID=CONFIG", help=(
        "the architecture of a model a command names that pytest-llmload does not ship, one 'ID=CONFIG' each (a "
        "shipped name or a config.json; the option may be repeated, the ini key takes one a line), as run's "
        "--model.")),
    # --- hangs (pytest_llmload.plugin.loader_hang)
    Setting("wait_after_hang", "bool", help=(
        "after the loader under test hangs (a deadline passes inside its call), run every later test that uses it "
        "to its own deadline too; by default they fail at once, naming the hang.")),
    # --- pytest under torchrun/srun/mpirun (pytest_llmload.plugin.launched_run)
    Setting("bind_all_interfaces", "bool", help=(
        "under a launcher, let the stores rank 0 hosts for the job listen on every interface when MASTER_ADDR says "
        "so (0.0.0.0, ::); by default such a MASTER_ADDR is a usage error, so that only the networks the job "
        "names reach them.")),
)
SETTING = {setting.key: setting for setting in SETTINGS}

# The names other modules read (derived from the table: one definition each).
LOADER_OPTION, LOADER_INI = SETTING["loader"].option, SETTING["loader"].ini
HOOK_OPTION, HOOK_INI = SETTING["training_args_hook"].option, SETTING["training_args_hook"].ini
PURPOSES_INI = SETTING["loader_purposes"].ini
STRICT_INI = SETTING["strict"].ini
EXPECTED_FAILURES_INI = SETTING["expected_failed_checks"].ini
RUNNER_OPTION, RUNNER_INI = SETTING["runner"].option, SETTING["runner"].ini
MODEL_OPTION, MODEL_INI = SETTING["model"].option, SETTING["model"].ini
GPU_FIXTURES_INI = SETTING["gpu_fixtures"].ini
REQUIRE_GPUS_OPTION = SETTING["require_gpus"].option
GPUS_PER_WORKER_OPTION = SETTING["gpus_per_worker"].option
WAIT_OPTION = SETTING["wait_after_hang"].option
CHECKS_OPTION = SETTING["checks"].option
# What a bare install lacks: the checks need the Hugging Face stack, an extra of this package.
STACK_EXTRA_HINT = "pip install 'pytest-llmload[all]' (or [hf] without bitsandbytes and DeepSpeed)"

# --- markers (pytest_llmload.plugin.markers, plugin.isolated_marker, plugin.memory_limit) -------------------
NEEDS_GPUS_HELP = (
    "needs_gpus(n): skip unless at least n CUDA devices are visible (n a positive int); also marks the test 'gpu'."
)
GPU_HELP = "gpu: the test needs a GPU; set automatically on needs_gpus tests and tests using a GPU fixture. Select with -m gpu."
DEEPSPEED_MARKER = "llmload_deepspeed"
DEEPSPEED_HELP = (
    f"{DEEPSPEED_MARKER}: the test starts DeepSpeed; DeepSpeed is imported after collection, outside any test's "
    "deadline."
)
GPU_FIXTURES_INI = "llmload_gpu_fixtures"
GPU_FIXTURES_HELP = "extra fixture names that need a GPU: tests using them are marked 'gpu' (default: gpu_model)."
ISOLATED_MARKER = "llmload_isolated"
ISOLATED_HELP = (
    f"{ISOLATED_MARKER}(timeout=None): run the test's body in a child forked from the test process (fixtures stay "
    "here); the deadline in seconds is enforced here, with the child's thread stacks (default: pytest-timeout's "
    "less a few seconds, else 120). Process-wide changes (environment, patches, process groups) die with the child."
)
MEMORY_LIMIT_MARKER = "limit_torch_memory"
MEMORY_LIMIT_HELP = (
    f"{MEMORY_LIMIT_MARKER}(limit, *, device=None): fail the test when the peak memory torch allocates during its "
    "call passes limit ('24 MB' = 24*10**6 bytes, '1.5 GiB', or an int of bytes): per GPU where CUDA is "
    "visible (device='cuda'), else torch's CPU allocator (device='cpu', profiler memory events). Skips, "
    "saying why, where it cannot measure."
)
