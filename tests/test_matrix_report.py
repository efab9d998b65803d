"""The matrix report (.ci/matrix_report.py) that CI's closing line and docs/version_matrix.md come from: fed
the JUnit XML of a real pytest run with every outcome."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

REPORT = pathlib.Path(__file__).resolve().parents[1] / ".ci" / "matrix_report.py"


@pytest.fixture(scope="module")
def matrix_report():
    spec = importlib.util.spec_from_file_location("matrix_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def junit(pytester):
    pytester.mkdir("tests")
    pytester.mkpydir("tests/failures")
    pytester.path.joinpath("tests", "failures", "test_writeup.py").write_text(
        "import pytest\n"
        "def test_fix_holds(): pass\n"
        "def test_broken(): assert False, 'the fix regressed'\n"
        "@pytest.mark.skip(reason='needs 2 GPUs, 0 visible')\n"
        "def test_on_gpus(): pass\n"
        "@pytest.mark.xfail(reason='transformers 5.23 ignores offload_state_dict', strict=True)\n"
        "def test_before_loader(): assert False\n"
    )
    path = pytester.path / "junit.xml"
    pytester.runpytest("tests", f"--junitxml={path}", "-p", "no:llmload").assert_outcomes(
        passed=1, failed=1, skipped=1, xfailed=1)
    return path


def test_counts_per_env_and_the_summed_ci_line(matrix_report, junit, capsys):
    assert matrix_report.main([f"newest={junit}", f"hf-4.56={junit}"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "newest: 4 tests: 1 passed, 1 failed, 1 skipped, 1 xfailed",
        "hf-4.56: 4 tests: 1 passed, 1 failed, 1 skipped, 1 xfailed",
        "ci: 2 passed, 2 failed, 4 skipped",
    ]


def test_the_regression_table_gives_each_outcome_with_its_reason(matrix_report, junit, capsys):
    matrix_report.main(["--regressions", f"py={junit}"])
    out = capsys.readouterr().out
    assert "1 of 4 regression tests passed in every env; the others:" in out
    assert "test_fix_holds" not in out
    assert "| `test_writeup::test_on_gpus` | skipped: needs 2 GPUs, 0 visible |" in out
    assert "| `test_writeup::test_before_loader` | xfailed: transformers 5.23 ignores offload_state_dict |" in out
    assert "| `test_writeup::test_broken` | failed: AssertionError: the fix regressed" in out


def test_a_missing_file_is_named_and_counts_as_nothing(matrix_report, tmp_path, capsys):
    matrix_report.main([f"hf-4.56={tmp_path / 'absent.xml'}"])
    out = capsys.readouterr().out
    assert f"hf-4.56: no readable JUnit XML at {tmp_path / 'absent.xml'}" in out
    assert out.splitlines()[-1] == "ci: 0 passed, 0 failed, 0 skipped"
