"""parametrize_with_loader_checks: ids, strict xfails for known gaps, GPU marks, version skips."""

import pytest

pytestmark = pytest.mark.timeout(120)

CHECKS = """
from pytest_llmload.failures import BY_ID
from pytest_llmload.checks.base import Check

def check_returns_a_model(loader, checkpoint, workdir):
    '''Guards a made-up failure: the loader must return a model.'''
    assert loader.function.__name__ != "broken_loader", "broken_loader returns no model"

def check_on_gpu(loader, checkpoint, workdir):
    '''Needs a GPU.'''

def check_old_transformers(loader, checkpoint, workdir):
    '''Only on transformers that no longer exist.'''

CHECKS = [
    Check(check_returns_a_model, failure=BY_ID["meta-backward"]),
    Check(check_on_gpu, failure=BY_ID["dp-dtype"], needs_gpus=2),
    Check(check_old_transformers, failure=BY_ID["offload-hang"], transformers="<1.0"),
]

def good_loader(request):
    return None

def broken_loader(request):
    return None
"""


@pytest.fixture
def downstream(pytester, monkeypatch):
    pytester.makepyfile(mychecks=CHECKS)
    monkeypatch.syspath_prepend(pytester.path)
    return pytester


def test_ids_work_with_k_and_gpu_checks_are_marked(downstream):
    downstream.makepyfile("""
        from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks
        from mychecks import CHECKS, good_loader, broken_loader

        @parametrize_with_loader_checks([good_loader, "mychecks:broken_loader"], checks=CHECKS)
        def test_loader(loader, check, tmp_path):
            check(loader, tmp_path, tmp_path)
    """)
    listed = downstream.runpytest("--collect-only", "-q")
    listed.stdout.fnmatch_lines([
        "*::test_loader[[]mychecks.good_loader-check_returns_a_model[]]",
        "*::test_loader[[]mychecks.good_loader-check_on_gpu[]]",
        "*::test_loader[[]mychecks.good_loader-check_old_transformers[]]",
        "*::test_loader[[]mychecks.broken_loader-check_returns_a_model[]]",
    ])
    gpu_only = downstream.runpytest("-m", "gpu", "--collect-only", "-q")
    gpu_only.stdout.fnmatch_lines(["*good_loader-check_on_gpu*", "*broken_loader-check_on_gpu*",
                                   "2/6 tests collected (4 deselected)*"])
    result = downstream.runpytest("-rfs", "-k", "check_returns_a_model or check_on_gpu or check_old")
    result.assert_outcomes(passed=1, failed=1, skipped=4)
    for line in ("*needs 2 GPUs, 0 visible*",
                 "*check_old_transformers: transformers * does not have offload-hang; the check applies to transformers<1.0",
                 "E       AssertionError: broken_loader returns no model", "FAILED *broken_loader-check_returns_a_model*"):
        result.stdout.fnmatch_lines([line])


def test_expected_failed_checks_are_strict_xfails(downstream):
    downstream.makepyfile("""
        from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks
        from mychecks import CHECKS, good_loader, broken_loader

        @parametrize_with_loader_checks(
            [good_loader, broken_loader], checks=CHECKS[:1],
            expected_failed_checks=lambda loader: {"check_returns_a_model": "gap #12"} if "broken" in loader.name else {},
        )
        def test_loader(loader, check, tmp_path):
            check(loader, tmp_path, tmp_path)

        @parametrize_with_loader_checks([good_loader], checks=CHECKS[:1],
                                        expected_failed_checks={"check_returns_a_model": "stale entry"})
        def test_fixed_gap_is_reported(loader, check, tmp_path):
            check(loader, tmp_path, tmp_path)
    """)
    result = downstream.runpytest("-rfx")
    result.assert_outcomes(passed=1, xfailed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_fixed_gap_is_reported[[]mychecks.good_loader-check_returns_a_model[]]*",
                                 "[[]XPASS(strict)[]] stale entry"])
    result.stdout.fnmatch_lines(["XFAIL *broken_loader-check_returns_a_model* - gap #12"])


def test_expected_failure_naming_no_check_is_an_error(downstream):
    downstream.makepyfile("""
        from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks
        from mychecks import CHECKS, good_loader

        @parametrize_with_loader_checks([good_loader], checks=CHECKS, expected_failed_checks={"check_typo": "x"})
        def test_loader(loader, check, tmp_path):
            pass
    """)
    result = downstream.runpytest()
    result.stdout.fnmatch_lines(["*ValueError: expected_failed_checks for loader *good_loader names [[]'check_typo'[]], "
                                 "which are not checks; the checks are: check_returns_a_model, check_on_gpu, *"])
