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


# A repo's own loader, gated with parametrize_with_loader_checks and no ini key (issue 39).
DOWNSTREAM = {
    "myrepo_loading": "def load(request):\n    return None\n",
    "test_gate": (
        "from pytest_llmload.checks.base import Check\n"
        "from pytest_llmload.failures import BY_ID\n"
        "from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks\n"
        "from myrepo_loading import load\n\n"
        "def check_passes(loader, checkpoint, workdir):\n"
        "    '''Passes.'''\n\n"
        "@parametrize_with_loader_checks([load], checks=[Check(check_passes, failure=BY_ID['dp-dtype'])])\n"
        "def test_loader(loader, check, tmp_path):\n"
        "    check(loader, tmp_path, tmp_path)\n"),
}


def test_the_header_names_the_loader_the_checks_run_not_the_reference_one(pytester, monkeypatch):
    """Before (issue 39): ``llmload: loader pytest_llmload.fixes.reference_loader:... (from built-in default)`` while
    every check ran the repo's loader."""
    monkeypatch.delenv("PYTEST_LLMLOAD_LOADER", raising=False)
    pytester.makepyfile(**DOWNSTREAM)
    monkeypatch.syspath_prepend(pytester.path)
    result = pytester.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=1)
    (header,) = [line for line in result.stdout.lines if line.startswith("llmload:")]
    assert header.startswith("llmload: loader myrepo_loading:load (from parametrize_with_loader_checks); "), header


def test_the_header_is_there_under_xdist(xdist_run):
    """Before (issue 39): ``pytest -n 2`` printed no llmload line (the controller collects nothing; the workers'
    output is not shown). The controller prints it from the workers' test ids. The shared run (fixtures/xdist_run.py):
    its module test_gate gates a repo's own loader (mychecks.load) with parametrize_with_loader_checks, no ini key."""
    assert xdist_run.outcomes("test_gate") == {"passed": 1, "failed": 3}
    result = xdist_run.result
    (header,) = [line for line in result.stdout.lines if line.startswith("llmload:")]
    # (the ids name the loader by its short id: mod.function)
    assert header.startswith("llmload: loader mychecks.load (from parametrize_with_loader_checks); "), header
    lines = result.stdout.lines
    assert lines.index(header) < next(i for i, line in enumerate(lines) if "passed" in line)
