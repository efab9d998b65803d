"""Every regression check against the loader under test (the ``llmload_loader`` fixture)."""

from pytest_llmload.conformance import check_params, parse_expected_failures
from pytest_llmload.surface import EXPECTED_FAILURES_INI as EXPECTED_INI


def pytest_generate_tests(metafunc):
    if "check" in metafunc.fixturenames:
        expected = parse_expected_failures(metafunc.config.getini(EXPECTED_INI), f"ini '{EXPECTED_INI}'")
        metafunc.parametrize("check", check_params(expected_failed_checks=expected))


def test_loader_check(check, llmload_loader, llmload_checkpoint, tmp_path, llmload_check_options):
    check(llmload_loader, llmload_checkpoint, tmp_path, **llmload_check_options)
