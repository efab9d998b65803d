"""The plugin's vocabulary: every option, ini key and marker, with its help text, and the environment variables
it reads at start-up.

pytest imports the plugin on every run of every repo that installs it, most of which never use it. So the plugin
imports only this module and its fixtures at start-up (plain strings, no imports), and the code that reads a
name imports it from here: one definition each, and nothing else compiled or executed until a run needs it.

One naming rule: every option, ini key, marker and fixture starts with ``llmload`` (``--llmload-...``,
``llmload_...``), except the names the README promises as this plugin's vocabulary (the fixtures ``gpu_model``,
``lora_model``, ``distributed_env``; the markers ``needs_gpus`` and ``gpu``) and ``limit_torch_memory``, named after
pytest-memray's ``limit_memory``.
"""

# --- the loader under test (pytest_llmload.loading) ------------------------------------------------------
LOADER_ENV = "PYTEST_LLMLOAD_LOADER"
LOADER_INI = "llmload_loader"
LOADER_OPTION = "--llmload-loader"
LOADER_HELP = (
    "the loader under test, as 'module:function' (a callable taking a pytest_llmload.LoadRequest and "
    f"returning a model or (model, tokenizer)). Precedence: {LOADER_OPTION}, ${LOADER_ENV}, ini '{LOADER_INI}'. "
    "Default: the built-in reference loader."
)
HOOK_ATTRIBUTE = "llmload_training_args_hook"
HOOK_INI = "llmload_training_args_hook"
HOOK_OPTION = "--llmload-training-args-hook"
HOOK_HELP = (
    "your training script's hook, as 'module:function', called as hook(training_args, model) between "
    "TrainingArguments and Trainer(...) (pytest_llmload.trainer_guard:prepare_training_args_for_placed_model is one). "
    f"The Trainer check runs Trainer as transformers ships it, with this hook. Precedence: {HOOK_OPTION}, ini "
    f"'{HOOK_INI}', the loader function's attribute {HOOK_ATTRIBUTE}; default: none (stock Trainer)."
)
# How the repo trains, declared once each by a loader attribute, an ini key and an option of the same name (the
# option as --llmload-trains-...): what a training check's keyword is called, and the help. A check that takes the
# keyword skips "not exercised" when its scenario is not how the repo trains.
TRAINING_DECLARATIONS = {
    "trains_without_trainer": (
        "this repo's training never hands the model to transformers.Trainer (a custom loop, accelerate, FSDP or "
        "DeepSpeed scripts): the Trainer check (dp-dtype) skips 'not exercised'."
    ),
    "trains_under_deepspeed": (
        "this repo trains only under DeepSpeed (its engine keeps float32 master weights for fp16 and runs one process "
        "per GPU): the fp16 GradScaler check (fp16-unscale) and the Trainer check (dp-dtype) skip 'not exercised'."
    ),
}


def declaration_names(keyword: str) -> tuple[str, str, str]:
    """``(attribute, ini key, option)`` of a training declaration: ``llmload_<keyword>`` for the first two."""
    return f"llmload_{keyword}", f"llmload_{keyword}", "--llmload-" + keyword.replace("_", "-")


def declaration_help(keyword: str) -> str:
    attribute, ini, option = declaration_names(keyword)
    return (f"declare that {TRAINING_DECLARATIONS[keyword]} Precedence: {option}, ini '{ini}' (true/false), the loader "
            f"function's attribute {attribute} = True.")


PURPOSES_ATTRIBUTE = "llmload_purposes"
PURPOSES_INI = "llmload_loader_purposes"
PURPOSES_HELP = (
    "what the loader under test is for, one per line: inference and/or train (default: both). Checks of the "
    "other purpose skip, saying so. A loader function can say the same with an attribute: "
    "load.llmload_purposes = ('inference',)."
)

# --- verdicts (pytest_llmload.plugin, pytest_llmload.conformance) -----------------------------------------
STRICT_INI = "llmload_strict"
STRICT_HELP = (
    "count a check that could not judge the loader (skipped 'not exercised: ...', e.g. nothing was offloaded, "
    "the 4-bit request was ignored) as a failure. Precedence: --llmload-strict, then the ini key."
)
EXPECTED_FAILURES_INI = "llmload_expected_failed_checks"
EXPECTED_FAILURES_HELP = (
    "known gaps of the configured loader, one 'check_name: reason' a line: the shipped suite "
    "(pytest --pyargs pytest_llmload.suite) runs them as strict xfails."
)
PROGRESS_FILE_HELP = "append one JSON line per test outcome to PATH (used by 'python -m pytest_llmload')."

# --- predictions for runners this machine is not (pytest_llmload.prediction) ------------------------------
RUNNER_OPTION = "--llmload-runner"
RUNNER_INI = "llmload_runner"
RUNNER_HELP = (
    "predict the checks' scenarios on these runner profiles (comma-separated: shipped names like 8xH100-80GB, or "
    "paths to profile .json files): the rows say what the loader would do there, marked PREDICTED. "
    f"Precedence: {RUNNER_OPTION}, then the ini key."
)
MODEL_OPTION = "--llmload-model"
MODEL_INI = "llmload_model"
MODEL_HELP = (
    "the architecture the predictions load, at full size without weights: a shipped name (llama-3-70b, ...) or a "
    f"local config.json. Default llama-3-8b. Precedence: {MODEL_OPTION}, then the ini key."
)

# --- markers (pytest_llmload.markers, runners.isolated_marker, diagnostics.memory_limit) -------------------
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

# --- diagnostics (pytest_llmload.diagnostics.report) ------------------------------------------------------
PHASE_PROGRESS_INI = "llmload_phase_progress_seconds"
PHASE_PROGRESS_OPTION = "--llmload-phase-progress"
PHASE_PROGRESS_HELP = (
    "seconds between progress lines (to stderr) while one phase of a test (load, generate, ...) runs long; "
    "0 turns them off. Default 30. Precedence: --llmload-phase-progress, then the ini key."
)
NEAR_DEADLINE_INI = "llmload_near_deadline"
NEAR_DEADLINE_HELP = (
    "the fraction of its deadline (pytest-timeout, or a check's own) above which the session summary lists a "
    "test or check as close to it. Default 0.8."
)

REQUIRE_GPUS_OPTION = "--llmload-require-gpus"
REQUIRE_GPUS_INI = "llmload_require_gpus"
REQUIRE_GPUS_HELP = (
    "fail the run, instead of skipping every GPU test, when it selects GPU tests and sees no GPU (a GPU runner "
    f"whose driver or CUDA_VISIBLE_DEVICES is broken). Precedence: {REQUIRE_GPUS_OPTION}, then the ini key (true/false)."
)
# What a bare install lacks: the checks need the Hugging Face stack, an extra of this package.
STACK_EXTRA_HINT = "pip install 'pytest-llmload[all]' (or [hf] without bitsandbytes and DeepSpeed)"

# --- hangs (pytest_llmload.hung_loader) -------------------------------------------------------------------
WAIT_OPTION = "--llmload-wait-after-hang"
WAIT_HELP = (
    "after the loader under test hangs (a deadline passes inside its call), run every later test that uses it "
    "to its own deadline too; by default they fail at once, naming the hang."
)

# --- GPUs per xdist worker (pytest_llmload.runners.xdist_gpus) --------------------------------------------
GPUS_PER_WORKER_OPTION = "--llmload-gpus-per-worker"
GPUS_PER_WORKER_INI = "llmload_gpus_per_worker"
GPUS_PER_WORKER_HELP = (
    "under pytest -n N on a machine with GPUs: how many GPUs each xdist worker holds (its own "
    "CUDA_VISIBLE_DEVICES; default: the visible GPUs divided by N), or 'off' to let every worker see every GPU. "
    "Precedence: the option, then the ini key."
)

# --- set by the main job for its pytest child (pytest_llmload.runners.lifeline) ---------------------------
PARENT_ENV = "PYTEST_LLMLOAD_PARENT_PID"  # the pid to die with
PARENT_WORKDIR_ENV = "PYTEST_LLMLOAD_PARENT_WORKDIR"  # the temp dir to remove if it dies first
