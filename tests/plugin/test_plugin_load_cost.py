"""A run that uses no llmload fixture must not import the heavy stack (checked in a fresh interpreter), nor any
sub-plugin: each is registered as a light gate, and switched on by its flag where a run needs it."""

import pytest

pytestmark = pytest.mark.timeout(180)

HEAVY = ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "deepspeed")

# Modules of the plugin itself that a run using none of its fixtures, markers or checks never needs.
DEFERRED = ("pytest_llmload.runners.isolation", "pytest_llmload.failures", "pytest_llmload.system.offline", "pytest_llmload.reports.progress",
            "pickle")

# What the probe sees must be this plugin's doing: other installed plugins import pickle themselves (pytest-html,
# and on a GPU machine's image pytest-benchmark or jaxtyping's), so the runs load this plugin alone.
ONLY_THIS_PLUGIN = "PYTEST_DISABLE_PLUGIN_AUTOLOAD"  # (set to 1; the runs name it: -p llmload)

PROBE = f"""
import sys

def pytest_unconfigure(config):
    print("HEAVY IMPORTED:", sorted(m for m in {HEAVY!r} if m in sys.modules))
    print("DEFERRED IMPORTED:", sorted(m for m in {DEFERRED!r} if m in sys.modules))
"""


def test_plain_run_with_plugin_imports_nothing_heavy(pytester, monkeypatch):
    monkeypatch.setenv(ONLY_THIS_PLUGIN, "1")
    pytester.makeconftest(PROBE)
    pytester.makepyfile("import pytest\n\n@pytest.mark.needs_gpus(1)\ndef test_gpu(): pass\n\ndef test_plain(): pass\n")
    result = pytester.runpytest_subprocess("-p", "llmload")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["llmload: loader *", "HEAVY IMPORTED: []", "DEFERRED IMPORTED: []"])
    # Another project's run gets no warning from the plugin: five PytestAssertRewriteWarnings on every run (the
    # sub-plugins, once named in pytest_plugins) failed pytest-xdist's own TestWarnings tests.
    assert "warning" not in result.stdout.str().lower(), result.stdout.str()


def test_the_probe_sees_torch_when_a_fixture_needs_it(pytester):
    # The same probe must be able to fail: a run that uses a fixture does import the stack.
    pytester.makeconftest(PROBE)
    pytester.makepyfile("def test_ckpt(llmload_checkpoint): pass\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["HEAVY IMPORTED: [[]*'torch'*'transformers'*[]]",
                                 "DEFERRED IMPORTED: [[]*'pytest_llmload.system.offline'*[]]"])


PACKAGE_PROBE = """
import sys

def pytest_unconfigure(config):
    print("PACKAGE IMPORTED:", sorted(m for m in sys.modules if m.split(".")[0] == "pytest_llmload"))
"""


@pytest.mark.parametrize(("args", "header"), [(("-q",), []), ((), [])], ids=["quiet", "not quiet: no header either"])
def test_a_run_that_never_uses_the_plugin_imports_only_its_vocabulary_and_fixtures(pytester, monkeypatch, args,
                                                                                     header):
    # (keys: the stash keys the fixtures read, one floor below them; hookspecs: the hooks it declares, as
    # pytest_addhooks must at start-up; settings: the one reader of the settings, which every run asks whether the
    # plugin is configured; the header line is printed, and its module
    # imported, only where a run configures or uses the plugin.) Nothing of the plugin's work is compiled or run in such a
    # run: each sub-plugin is registered as a light gate (plugin.gates.Gate, one of the hooks modules), which
    # imports its module only once the run's flag for it is set. The header (not shown under -q) imports what it reads.
    monkeypatch.setenv(ONLY_THIS_PLUGIN, "1")
    pytester.makeconftest(PACKAGE_PROBE)
    pytester.makepyfile("def test_plain(): pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "llmload", *args)
    result.assert_outcomes(passed=1)
    expected = sorted({"pytest_llmload", "pytest_llmload.config", "pytest_llmload.plugin", "pytest_llmload.plugin.fixtures", "pytest_llmload.plugin.hookspecs", "pytest_llmload.config.stash_keys",
                       "pytest_llmload.plugin.hooks", "pytest_llmload.plugin.gates", "pytest_llmload.plugin.configuration",
                       "pytest_llmload.plugin.collection", "pytest_llmload.plugin.check_row", "pytest_llmload.config.settings", "pytest_llmload.config.vocabulary",
                       *(f"pytest_llmload.{name}" for name in header)})
    result.stdout.fnmatch_lines([f"PACKAGE IMPORTED: {expected}".replace("[", "[[]")])


REGISTERED_PROBE = """
def pytest_unconfigure(config):
    names = [name for name, _ in config.pluginmanager.list_name_plugin() if name.startswith("pytest_llmload.")]
    print("SUB-PLUGINS:", sorted(name for name in names if not name.endswith(" (gate)")))
    print("GATES:", len([name for name in names if name.endswith(" (gate)")]))
"""


@pytest.mark.parametrize(("test", "args", "outcome", "switched_on"), [
    ("def test_plain(): pass\n", (), "passed", ()),
    ("import pytest\n\n@pytest.mark.needs_gpus(99)\ndef test_gpu(): pass\n", (), "skipped", ("in use",)),
    ("def test_plain(): pass\n", ("--llmload-wait-after-hang",), "passed", ("in use",)),
], ids=["unused", "used after collection", "configured"])
def test_each_sub_plugin_has_one_gate_and_is_switched_on_by_its_flag(pytester, test, args, outcome, switched_on):
    """Every sub-plugin's gate is registered once, in every run; a sub-plugin is registered (its module imported) only
    where its flag is set: one flag for what every use of the plugin needs (xdist's and a launcher's are the subject
    of tests/plugin/test_xdist_gpus.py and the launcher's tests)."""
    from pytest_llmload.plugin.gates import SUB_PLUGINS, in_use_key

    flags = {{"in use": in_use_key}[name] for name in switched_on}
    pytester.makeconftest(REGISTERED_PROBE)
    pytester.makepyfile(test)
    result = pytester.runpytest("-p", "no:cacheprovider", *args)
    result.assert_outcomes(**{outcome: 1})
    expected = sorted(module for module, flag in SUB_PLUGINS.items() if flag in flags)
    result.stdout.fnmatch_lines([f"SUB-PLUGINS: {expected}".replace("[", "[[]"), f"GATES: {len(SUB_PLUGINS)}"])


def test_this_repos_gpu_tests_where_no_gpu_is_visible_import_no_stack():
    """``pytest -m gpu`` on a runner without GPUs skips every test, and collecting this repo's tests to learn which
    those are must not import the stack (issue 18's goal, 3 s; issue 47: a test file importing torch at its top had
    made it 6.7 s)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    probe = ("import sys, pytest\n"
             "code = pytest.main(['-m', 'gpu', '-q', '-p', 'no:cacheprovider'])\n"
             f"print('HEAVY IMPORTED:', sorted(m for m in {HEAVY!r} if m in sys.modules), 'EXIT:', int(code))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[2], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert "HEAVY IMPORTED: [] EXIT: 0" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
