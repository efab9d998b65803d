"""The main job's own answers about the package: ``--print-constraints`` (the stack this release was tested with, for a
user's constraints file, shipped inside the package) and ``--help``'s table of which extra serves which check; neither
starts pytest, and a run's parent still imports no check."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_llmload
from pytest_llmload.config import distribution
from pytest_llmload.failures import REGISTRY
from pytest_llmload.main_job.cli import run

ROOT = Path(__file__).resolve().parents[2]
NEWEST = ROOT / "constraints" / "newest.txt"


def _pins(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_shipped_constraints_are_a_copy_of_the_newest_stack():
    shipped = distribution.TESTED_CONSTRAINTS
    assert shipped.parent == Path(pytest_llmload.__file__).parent / "configs"  # package data: in the wheel
    assert shipped.read_bytes() == NEWEST.read_bytes(), (
        "pytest_llmload/configs/tested-constraints.txt is not constraints/newest.txt: after changing the newest "
        "stack, run: cp constraints/newest.txt pytest_llmload/configs/tested-constraints.txt")


def test_print_constraints_prints_the_tested_pins_as_a_constraints_file():
    out = io.StringIO()
    assert run(["--print-constraints"], out=out) == 0
    text = out.getvalue()
    assert _pins(text) == _pins(NEWEST.read_text()) and "torch==2.13.0" in _pins(text)
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][^\s]*", pin) for pin in _pins(text)), text
    first = text.splitlines()[0]
    assert first.startswith(f"# The stack pytest-llmload {pytest_llmload.__version__} was tested with"), first
    assert "pip install -c constraints.txt" in text


def test_print_constraints_works_outside_a_clone_and_imports_no_check(tmp_path):
    # From a directory with no constraints/ beside it, as in a user's repo; the parent imports no check.
    code = ("import runpy, sys, json\n"
            "sys.argv = ['llmload', '--print-constraints']\n"
            "try:\n    runpy.run_module('pytest_llmload', run_name='__main__', alter_sys=True)\n"
            "except SystemExit as stop:\n"
            "    sys.stderr.write(json.dumps({'code': stop.code, 'modules': sorted(sys.modules)}))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": ""})
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report["code"] == 0, done.stderr
    assert _pins(done.stdout) == _pins(NEWEST.read_text())
    checks = [m for m in report["modules"] if m.startswith(("pytest_llmload.failures", "pytest_llmload.plugin",
                                                            "torch", "transformers"))]
    assert checks == []


def test_constraints_cpu_still_pins_the_newest_stack_in_a_clone():
    # pip reads a nested -c relative to the file that names it.
    nested = [line.split(None, 1)[1] for line in (ROOT / "constraints-cpu.txt").read_text().splitlines()
              if line.startswith("-c ")]
    assert [(ROOT / path).resolve() for path in nested] == [NEWEST]


def test_help_ends_with_the_extras_table_in_the_terminals_width():
    done = subprocess.run([sys.executable, "-m", "pytest_llmload", "--help"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "COLUMNS": "100"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(len(line) for line in lines) <= 100, [line for line in lines if len(line) > 100]
    table = done.stdout[done.stdout.index("Extras: "):]
    assert table.rstrip("\n") == distribution.extras_table(REGISTRY, width=98)
    for check in REGISTRY:
        for extra in check.extras:
            assert re.search(rf"^  {extra} ", table, re.M) and check.name in table
    assert "--print-constraints" in done.stdout


def test_the_readme_ci_sample_takes_its_constraints_from_print_constraints():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    sample = readme[readme.index("# .github/workflows/loader-checks.yml"):]
    sample = sample[:sample.index("```")]
    assert "python -m pytest_llmload --print-constraints > constraints.txt" in readme
    assert "pip install -c constraints.txt" in sample and "pytest-llmload[" in sample
    assert ".whl" not in sample  # installed from the index, not a committed wheel


@pytest.mark.parametrize("home", ["README.md", "docs/getting-started.md"])
def test_the_docs_extras_tables_are_current(home):
    from fixtures.docs_hooks import docs_hooks

    hooks = docs_hooks()
    assert home in hooks.EXTRAS_HOMES
    text = (ROOT / home).read_text(encoding="utf-8")
    assert hooks.with_extras_table(text) == text, f"{home}'s extras table is not the checks': run python docs/hooks.py"
