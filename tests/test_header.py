"""The report header: loader and its source, the stack's versions, the GPUs."""

from importlib import metadata

import pytest

pytestmark = pytest.mark.timeout(120)


def test_header_shows_versions_and_gpus(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile("def test_x(): pass\n")
    result = pytester.runpytest()
    versions = ", ".join(f"{name} {metadata.version(name)}" for name in ("torch", "transformers", "accelerate", "peft"))
    result.stdout.fnmatch_lines([
        "llmload: loader pytest_llmload.reference_loader:load_model_and_tokenizer (from built-in default)",
        f"llmload: {versions}*",
        "llmload: GPUs 0 visible (CUDA_VISIBLE_DEVICES=)",
    ])
