"""A downstream repo that ships its own known failure and check (pytest_llmload.plugin.check_registry): added through the
``checks`` setting or an installed package's entry point, run by the shipped suite and the main job beside the
built-in checks, judged through the same contract layer, reported with the same verdicts and hook."""

import os
import textwrap
from pathlib import Path

import pytest

from fixtures import warm_runs

pytestmark = pytest.mark.timeout(300)

# The repo's own failure and check, written against the documented API only (pytest_llmload's public names).
OWN_CHECKS = '''
from pytest_llmload import Check, KnownFailure, LoadRequest, contract

FAILURE = KnownFailure(
    id="use-cache-off", title="an inference load with the KV cache switched off", write_up="myrepo#12",
    signatures=(), root_cause="the loader copies its training set-up (use_cache=False) into inference loads",
    fix="set model.config.use_cache = False only for train requests", occurs="myrepo since 2.3")


def check_inference_keeps_the_kv_cache(loader, checkpoint, workdir):
    """Guards myrepo#12 (use-cache-off): an inference load generates with the KV cache on."""
    model = contract.load(loader, LoadRequest(checkpoint, purpose="inference"),
                          check="check_inference_keeps_the_kv_cache").model
    assert model.config.use_cache, "the inference model has config.use_cache=False: every token recomputes the prompt"


CHECKS = [Check(check_inference_keeps_the_kv_cache, FAILURE, timeout=60)]
'''
LOADERS = '''
from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as good


def bad(request):
    model, tokenizer = good(request)
    model.config.use_cache = False  # the training set-up, copied everywhere
    return model, tokenizer
'''
RESULTS_HOOK = '''
def pytest_llmload_check_result(item, check, result):
    if check.name == "check_inference_keeps_the_kv_cache":
        print(f"HOOK {result['verdict']} {result['failure']} {result['guards']}")
'''
SUITE = ("--pyargs", "pytest_llmload.suite", "-p", "no:cacheprovider", "-p", "no:randomly", "-s", "-p", "myrepo_hooks",
         "-k", "kv_cache")


@pytest.fixture
def repo(pytester, monkeypatch):
    # (a plugin, not a conftest: --pyargs runs read no conftest.py of the directory they start in)
    pytester.makepyfile(myrepo_checks=OWN_CHECKS, myrepo_loading=LOADERS, myrepo_hooks=RESULTS_HOOK)
    monkeypatch.syspath_prepend(pytester.path)
    return pytester


def test_the_setting_adds_the_repos_check_to_the_shipped_suite(repo):
    good = repo.runpytest(*SUITE, "--llmload-checks", "myrepo_checks:CHECKS", "--llmload-loader", "myrepo_loading:good")
    good.assert_outcomes(passed=1)
    good.stdout.fnmatch_lines(["*HOOK passed None use-cache-off*"])
    bad = repo.runpytest(*SUITE, "--llmload-checks", "myrepo_checks", "--llmload-loader", "myrepo_loading:bad",
                         "--junitxml", "junit.xml")
    bad.assert_outcomes(failed=1)
    bad.stdout.fnmatch_lines(["*HOOK failed use-cache-off use-cache-off*", "*[[]use-cache-off] an inference load*",
                              "*fix:*set model.config.use_cache = False only for train requests*"])
    junit = (repo.path / "junit.xml").read_text()
    assert 'name="llmload_failure" value="use-cache-off"' in junit


def test_an_installed_packages_entry_point_adds_it_without_configuration(repo):
    info = repo.path / "myrepo-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: myrepo\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pytest_llmload.checks]\nmyrepo = myrepo_checks:CHECKS\n")
    result = repo.runpytest(*SUITE, "--llmload-loader", "myrepo_loading:bad")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*HOOK failed use-cache-off*"])


def test_parametrize_with_loader_checks_takes_the_repos_checks(repo):
    repo.makepyfile(test_own='''
        from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks
        from myrepo_checks import CHECKS

        @parametrize_with_loader_checks(["myrepo_loading:good", "myrepo_loading:bad"], checks=CHECKS,
                                        expected_failed_checks=lambda loader: {
                                            "check_inference_keeps_the_kv_cache": "#12"} if "bad" in loader.name else {})
        def test_loader(loader, check, llmload_checkpoint, tmp_path):
            check(loader, llmload_checkpoint, tmp_path)
    ''')
    repo.runpytest("-p", "no:randomly", "test_own.py").assert_outcomes(passed=1, xfailed=1)


@pytest.mark.parametrize(("spec", "says"), [
    ("myrepo_nothing:CHECKS", "check spec 'myrepo_nothing:CHECKS' from --llmload-checks does not import "
                              "(ModuleNotFoundError*"),
    ("myrepo_checks:MISSING", "*module 'myrepo_checks' has no attribute 'MISSING'*"),
    ("myrepo_loading:bad", "*gives function, not pytest_llmload.Check records*"),
])
def test_a_spec_that_gives_no_checks_is_one_usage_error(repo, spec, says):
    result = repo.runpytest(*SUITE, "--llmload-checks", spec)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{says}"])


def test_the_main_job_runs_and_names_the_repos_failure(repo):
    # The main job's command line, as a user would give it: its pytest forked from this process (fixtures/warm_runs.py)
    # rather than a new interpreter, since the subject is what it prints (tests/main_job/test_main_job.py tests the process).
    # (each sentence on one line; TMPDIR the test's own: the failing run keeps its log there)
    env = {**warm_runs.new_tmpdir(repo.path), "PYTHONPATH": str(repo.path), "COLUMNS": "200"}
    out = warm_runs.main_job("--loader", "myrepo_loading:bad", "--checks", "myrepo_checks:CHECKS", "-k", "kv_cache",
                             cwd=repo.path, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    kept = warm_runs.left_in(env)  # its log, and nothing else, in the test's TMPDIR
    assert len(kept) == 1 and kept == list(Path(env["TMPDIR"]).iterdir()), kept
    assert "use-cache-off (extension)" in out.stdout
    assert "fix (use-cache-off): set model.config.use_cache = False only for train requests" in out.stdout
    listed = warm_runs.main_job("--list", "--checks", "myrepo_checks:CHECKS", cwd=repo.path, env=env)
    assert textwrap.dedent("check_inference_keeps_the_kv_cache") in listed.stdout


def test_the_main_job_stops_at_an_installed_entry_point_that_gives_no_checks(repo):
    # Without --checks the main job reads the installed extensions while its pytest starts: a broken one still
    # ends the run as a usage error, before any check, with that pytest stopped.
    info = repo.path / "broken-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[pytest_llmload.checks]\nbroken = broken_nothing:CHECKS\n")
    env = {**os.environ, "PYTHONPATH": str(repo.path)}
    out = warm_runs.main_job("-k", "pad_token and not cuda", cwd=repo.path, env=env)
    assert (out.returncode, out.stdout) == (4, ""), out.stdout + out.stderr  # (pytest's code for a usage error)
    assert out.stderr.startswith("llmload: error: ") and "broken_nothing" in out.stderr, out.stderr
