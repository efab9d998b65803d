"""This repo's own test configuration. The plugin itself is loaded through its pytest11 entry point."""

import importlib
import importlib.util
import os

import pytest

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
)
# Imported only where installed: anyio's pytest plugin comes with newer huggingface_hub, not the older stacks.
_OPTIONAL = ("anyio",)


@pytest.fixture(autouse=True)
def _heavy_stack_outside_pytester_snapshot(request):
    # Autouse fixtures are set up before the test's own function-scoped fixtures, so this runs before
    # pytester takes its snapshot of sys.modules.
    if "pytester" in request.fixturenames:
        for name in _HEAVY_STACK:
            importlib.import_module(name)
        for name in _OPTIONAL:
            if importlib.util.find_spec(name) is not None:
                importlib.import_module(name)
