"""Every regression check against the loader under test (the ``llmload_loader`` fixture)."""

from pytest_llmload.config import settings
from pytest_llmload.plugin.parametrize import check_params, parse_expected_failures
from pytest_llmload.config.stash_keys import checks_key


def pytest_generate_tests(metafunc):
    if "check" in metafunc.fixturenames:
        given = settings.given(metafunc.config, "expected_failed_checks")
        expected = parse_expected_failures(*given) if given else {}
        checks = metafunc.config.stash.get(checks_key, None)  # with the `checks` setting's, where it is given
        metafunc.parametrize("check", check_params(checks=checks, expected_failed_checks=expected))


def test_loader_check(check, llmload_loader, llmload_checkpoint, tmp_path, llmload_check_options):
    check(llmload_loader, llmload_checkpoint, tmp_path, **llmload_check_options)
