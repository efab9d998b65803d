"""Coverage of the children (:mod:`pytest_llmload.runners.child_coverage`): under pytest-cov, the lines a
downstream module runs in an isolated child (forked, or started by the forkserver) or in a distributed rank
count in the report, as if they had run in the test process; no data file is left behind, and a run without
coverage neither imports coverage nor changes."""

from __future__ import annotations

import re

import pytest

from fixtures import warm_runs

pytest.importorskip("pytest_cov")

pytestmark = pytest.mark.timeout(120)

# The downstream module measured: each function runs only in a child, never in the test process.
DOWNSTREAM = '''def in_isolated_test(n):
    total = 0
    for i in range(n):
        total += i
    return total


def in_forkserver_child(n):
    squares = [i * i for i in range(n)]
    return sum(squares)


def in_rank():
    import torch.distributed as dist
    rank = dist.get_rank()
    return rank
'''

TESTS = '''
import sys

import pytest

import downstream
from pytest_llmload.runners.isolation import run_isolated


@pytest.mark.llmload_isolated(timeout=60)
def test_isolated():
    assert downstream.in_isolated_test(4) == 6


def test_forkserver():
    assert run_isolated(downstream.in_forkserver_child, (3,), start="forkserver", timeout=60) == 5


def test_ranks(distributed_env):
    assert distributed_env.run(downstream.in_rank, world_size=2) == [0, 1]


def coverage_imported():
    return "coverage" in sys.modules


def test_coverage_import():
    # For the run without --cov: whether coverage was imported here, in a forked child, in a forkserver child.
    print("coverage imported:", coverage_imported(), run_isolated(coverage_imported, timeout=60),
          run_isolated(coverage_imported, start="forkserver", timeout=60))
'''

# The lines each child runs, by function (the first line of each is its `def`, run at import in the test process).
CHILD_LINES = {"in_isolated_test": {2, 3, 4, 5}, "in_forkserver_child": {9, 10}, "in_rank": {14, 15, 16}}


@pytest.fixture
def downstream_run(pytester):
    """``run(*args)``: the run forked from this process (fixtures/warm_runs.py), where what it measures is the subject;
    ``run(*args, new_interpreter=True)``: a new interpreter, where what it imports is."""
    pytester.makepyfile(downstream=DOWNSTREAM, test_downstream=TESTS)

    def run(*args, new_interpreter=False):
        args = ("-p", "no:cacheprovider", "-s", *args)  # -s: test_coverage_import's line
        return pytester.runpytest_subprocess(*args) if new_interpreter else warm_runs.runpytest(pytester, *args)

    return run


def _missing(result) -> tuple[int, set[int]]:
    """The percent covered and the missing lines of ``downstream.py`` in pytest-cov's term-missing report."""
    match = re.search(r"^downstream\.py\s+\d+\s+\d+\s+(\d+)%[ \t]*(.*)$", result.stdout.str(), re.MULTILINE)
    assert match, result.stdout.str()
    missing = set()
    for part in filter(None, (p.strip() for p in match.group(2).split(","))):
        first, _, last = part.partition("-")
        missing.update(range(int(first), int(last or first) + 1))
    return int(match.group(1)), missing


@pytest.mark.parametrize("test, function", [
    ("test_isolated", "in_isolated_test"),  # (a) a child forked from the test process
    ("test_forkserver", "in_forkserver_child"),  # (b) a child the forkserver started
    ("test_ranks", "in_rank"),  # (c) two gloo ranks, forked
])
def test_the_lines_a_child_runs_are_counted(downstream_run, pytester, test, function):
    result = downstream_run("-k", test, "--cov=downstream", "--cov-report=term-missing")
    result.assert_outcomes(passed=1)
    _, missing = _missing(result)
    assert not missing & CHILD_LINES[function], result.stdout.str()
    assert missing == set().union(*(lines for name, lines in CHILD_LINES.items() if name != function))
    # pytest-cov combined the children's data files into its own, and deleted them.
    assert sorted(p.name for p in pytester.path.glob(".coverage*")) == [".coverage"]


def test_all_three_together(downstream_run, pytester):
    result = downstream_run("--cov=downstream", "--cov-report=term-missing")
    result.assert_outcomes(passed=4)
    assert _missing(result) == (100, set())
    assert sorted(p.name for p in pytester.path.glob(".coverage*")) == [".coverage"]


def test_a_run_without_coverage_is_unchanged(downstream_run, pytester):
    result = downstream_run(new_interpreter=True)  # pytest-cov loaded, as where it is installed, but not measuring
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*coverage imported: False False False*"])
    assert list(pytester.path.glob(".coverage*")) == []

