"""Issue 46, point 5: a row whose verdict rests on an assumption (a note that starts ``assumed: ``, any check's) is
listed under the table, with what settles it, by pytest's terminal summary and by the main job; and
``--llmload-strict`` / ``--fail-not-exercised`` count it as not judged (exit 1), naming it.

The check here is a repo's own (``--llmload-checks``), which loads nothing: the subject is what the plugin and the main
job do with its row. dp-dtype's own assumption is tested in tests/failures/test_dp_dtype.py."""

import json

import pytest

from fixtures import warm_runs

pytestmark = pytest.mark.timeout(300)

ASSUMED = ("assumed: this repo never scales float16 gradients (nothing declares it). Settle it: declare "
           "`load.llmload_scales_fp16 = True` or `load.llmload_never_scales_fp16 = True`")
OWN_CHECKS = f'''
from pytest_llmload import Check, KnownFailure, contract

FAILURE = KnownFailure(id="scaled-fp16", title="float16 gradients unscaled", write_up="myrepo#7", signatures=(),
                       root_cause="-", fix="-", occurs="-")


def check_judged_on_a_default(loader, checkpoint, workdir):
    """Passes on what it assumed."""
    contract.note("judged in float16")
    contract.note({ASSUMED!r})


def check_judged_on_what_it_saw(loader, checkpoint, workdir):
    """Passes on what it saw."""
    contract.note("observed: a GradScaler")


CHECKS = [Check(check_judged_on_a_default, FAILURE, timeout=60), Check(check_judged_on_what_it_saw, FAILURE, timeout=60)]
'''
SUITE = ("--pyargs", "pytest_llmload.suite", "-p", "no:cacheprovider", "-p", "no:randomly", "--llmload-checks",
         "myrepo_checks:CHECKS", "-k", "judged_on")


@pytest.fixture
def repo(pytester, monkeypatch):
    pytester.makepyfile(myrepo_checks=OWN_CHECKS)
    monkeypatch.syspath_prepend(pytester.path)
    return pytester


def test_pytest_lists_the_assumption_and_strict_counts_its_row_as_not_judged(repo):
    result = repo.runpytest(*SUITE)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "llmload: 1 row rests on an assumption, not on what the repo declares or its code shows (--llmload-strict "
        "counts it as not judged); each says what settles it:",
        f"  check_judged_on_a_default (scaled-fp16): {ASSUMED}"])
    assert "check_judged_on_what_it_saw (scaled-fp16):" not in result.stdout.str()
    strict = repo.runpytest(*SUITE, "--llmload-strict")
    strict.assert_outcomes(passed=1, failed=1)
    strict.stdout.fnmatch_lines([
        f"*llmload strict: a verdict that rests on an assumption is not judged here: {ASSUMED}*",
        "*(--llmload-strict: counted as not judged)*"])


def test_the_main_job_lists_it_under_the_table_and_fail_not_exercised_fails_the_run(repo):
    env = {**warm_runs.new_tmpdir(repo.path), "PYTHONPATH": str(repo.path), "COLUMNS": "1000"}
    args = ("--checks", "myrepo_checks:CHECKS", "-k", "judged_on", "--json", str(repo.path / "run.json"))
    run = warm_runs.main_job(*args, cwd=repo.path, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    under_the_table = run.stdout[run.stdout.index("check_judged_on_what_it_saw "):]
    assert ("llmload: 1 row rests on an assumption, not on what the repo declares or its code shows "
            "(--fail-not-exercised counts it as not judged); each says what settles it:\n"
            f"  check_judged_on_a_default (scaled-fp16): {ASSUMED}\n") in under_the_table, run.stdout
    records = {r["check"]: r for r in json.loads((repo.path / "run.json").read_text())["results"]}
    assert records["check_judged_on_a_default"]["assumptions"] == [ASSUMED]
    assert records["check_judged_on_what_it_saw"]["assumptions"] == []
    strict = warm_runs.main_job(*args, "--fail-not-exercised", cwd=repo.path, env=env)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert (f"FAILED check_judged_on_a_default: llmload strict: a verdict that rests on an assumption is not judged "
            f"here: {ASSUMED}") in strict.stdout, strict.stdout
    assert "(--fail-not-exercised: counted as not judged)" in strict.stdout, strict.stdout
