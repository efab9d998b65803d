"""The report header: one line with the loader and its source, the stack's versions, the GPUs."""

from importlib import metadata

import pytest

from pytest_llmload.reports.header import STACK

pytestmark = pytest.mark.timeout(120)


def installed(name):
    try:
        return f"{name} {metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return None


def test_header_is_one_line_with_loader_versions_and_gpus(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile("def test_x(): pass\n")
    result = pytester.runpytest("--llmload-strict")  # a run that configures the plugin
    versions = ", ".join(filter(None, map(installed, STACK)))
    header = [line for line in result.stdout.lines if line.startswith("llmload:")]
    assert header == [
        "llmload: loader pytest_llmload.fixes.reference_loader:load_model_and_tokenizer (from built-in default); "
        f"{versions}; GPUs 0 visible (CUDA_VISIBLE_DEVICES=)"
    ], "one header line, not one per fact"


def test_a_run_that_never_uses_the_plugin_prints_no_header(pytester):
    pytester.makepyfile("def test_x(): pass\n")
    result = pytester.runpytest()
    assert not [line for line in result.stdout.lines if line.startswith("llmload:")]


def test_a_run_that_uses_the_plugin_without_configuring_it_gets_the_line_after_collection(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile("import pytest\n\n@pytest.mark.needs_gpus(1)\ndef test_gpu(): pass\n")
    result = pytester.runpytest()
    lines = result.stdout.lines
    (at,) = [i for i, line in enumerate(lines) if line.startswith("llmload: loader ")]
    assert at > next(i for i, line in enumerate(lines) if line.startswith("collected "))
