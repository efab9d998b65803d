"""How this repo's own tests run: the inner loop's `slow` list (conftest.py) names tests that exist (a rename would
otherwise drop a slow test into the inner loop unnoticed), and they run with llmload_strict."""

from pathlib import Path

import conftest

ROOT = Path(__file__).parent.parent


def test_every_slow_file_and_test_named_exists():
    for path in (*conftest.SLOW_FILES, *conftest.SLOW_TESTS):
        assert (ROOT / path).is_file(), path
    for path, names in conftest.SLOW_TESTS.items():
        text = (ROOT / path).read_text()
        missing = [name for name in names if f"def {name.partition('[')[0]}(" not in text]  # (a case: name[id])
        assert not missing, f"{path}: {missing}"


def test_this_repos_tests_run_strict(pytestconfig):
    # tox.ini's [pytest]: a check that stops judging fails the build instead of turning its test into a skip.
    from pytest_llmload.config import settings

    assert settings.value(pytestconfig, "strict") is True
