"""This repo's own test configuration. The plugin itself is loaded through its pytest11 entry point."""

import importlib
import importlib.util
import os

import pytest

from pytest_llmload.plugin import SUB_PLUGINS

# The suite's models are tiny: a second OpenMP thread buys nothing, while on a shared 2-core runner (or under
# pytest -n 2) idle OpenMP workers spin on oversubscribed cores: measured here, the offload tests took 27.5 s
# of CPU with torch's default threads and 9.9 s with one. Set before anything imports torch; the caller's
# value wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

pytest_plugins = ["pytester"]

# In-process pytester runs restore sys.modules afterwards, and torch cannot be imported twice in one
# process (the second import crashes). Importing the stack before the snapshot keeps it loaded.
_HEAVY_STACK = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "accelerate",
    "peft",
    "safetensors.torch",
    "tokenizers",
    # Imported by the inner run's plugins (hypothesis', anyio's). Outside the snapshot, every in-process run
    # would import them again, and rewrite their asserts again: ~500 modules, ~1.5 s a run where bytecode is
    # not cached (PYTHONDONTWRITEBYTECODE=1).
    "hypothesis",
    "hypothesis.extra",
    # Installs an audit hook the first time a guard is entered; a hook cannot be removed, so a copy imported
    # afresh by every in-process run would leave one idle hook behind per run.
    "pytest_llmload.offline",
    # Imported by the plugin when a run first needs them. Imported first inside an in-process run, they would
    # leave sys.modules at its end while their package kept the attribute: a later run's `from package import
    # module` would get that copy, which sys.modules (and pytest_terminal_summary's lookup there) no longer knows.
    *SUB_PLUGINS,
    "pytest_llmload.diagnostics.known_failures",
    "pytest_llmload.failures",
)
# Imported only where installed: anyio's pytest plugin comes with newer huggingface_hub, not the older stacks.
_OPTIONAL = ("anyio",)


# Hypothesis' pytest plugin imports all of hypothesis at the end of every run: ~0.9 s of CPU in each pytest
# process this suite starts (subprocess runs, their xdist workers, torchrun ranks), and no inner run uses it.
INNER_RUN_ADDOPTS = "-p no:hypothesispytest"


@pytest.fixture(autouse=True)
def _heavy_stack_outside_pytester_snapshot(request, monkeypatch):
    # Autouse fixtures are set up before the test's own function-scoped fixtures, so this runs before
    # pytester takes its snapshot of sys.modules.
    if "pytester" in request.fixturenames:
        for name in _HEAVY_STACK:
            importlib.import_module(name)
        for name in _OPTIONAL:
            if importlib.util.find_spec(name) is not None:
                importlib.import_module(name)
        request.getfixturevalue("pytester")  # it clears PYTEST_ADDOPTS when it starts: set it after
        monkeypatch.setenv("PYTEST_ADDOPTS", INNER_RUN_ADDOPTS)


# The tests that start interpreters of their own (seconds each, most of this suite's time) run first: xdist hands
# tests out in collection order, one worker at a time, so these spread over the workers instead of leaving one
# worker to finish a long one alone at the end. Whole files move, so module-scoped fixtures are still built once.
STARTS_INTERPRETERS_FIRST = (
    "tests/runners/test_launcher.py",
    "tests/test_main_job.py",
    "tests/runners/test_xdist_gpus.py",
)


def pytest_collection_modifyitems(items):
    def rank(item):
        path = item.nodeid.partition("::")[0]
        return STARTS_INTERPRETERS_FIRST.index(path) if path in STARTS_INTERPRETERS_FIRST else len(
            STARTS_INTERPRETERS_FIRST)

    items.sort(key=rank)
