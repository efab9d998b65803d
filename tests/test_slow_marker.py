"""The inner loop's `slow` list (conftest.py) names tests that exist: a rename would otherwise drop a slow test into
the inner loop unnoticed."""

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
