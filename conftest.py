"""This repo's own test configuration. The plugin itself is loaded through its pytest11 entry point."""

import importlib

import pytest

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
    "anyio",
)


@pytest.fixture(autouse=True)
def _heavy_stack_outside_pytester_snapshot(request):
    # Autouse fixtures are set up before the test's own function-scoped fixtures, so this runs before
    # pytester takes its snapshot of sys.modules.
    if "pytester" in request.fixturenames:
        for name in _HEAVY_STACK:
            importlib.import_module(name)
