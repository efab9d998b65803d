"""Diagnostics in the report, as a user meets them (pytester): the phase table of a failing or timed-out test,
progress lines while a phase runs long, where an offloaded model is, and the session summary."""

from __future__ import annotations

import pytest

from fixtures import tiny_llama, warm_runs

PHASE_HANGS = """
import threading
import pytest
from pytest_llmload.instruments.phases import phase

@pytest.mark.timeout({timeout}, method="{method}")
def test_stuck():
    with phase("load", "shard 3 of 5"):
        pass
    with phase("generate", max_new_tokens=512):
        threading.Event().wait()  # a generate() that never returns
"""


@pytest.mark.timeout(60)
def test_a_deadline_hit_shows_the_phase_table_and_the_phase_that_was_running(pytester):
    pytester.makepyfile(PHASE_HANGS.format(timeout=0.5, method="signal"))
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*Failed: Timeout (>0.5s) from pytest-timeout*",
        "*- llmload: phases -*",
        "the test failed in phase 'generate (max_new_tokens=512)', * s in: Failed: Timeout (>0.5s) from "
        "pytest-timeout.",
        "   phase * seconds * RSS before -> after (peak)",
        "   load (shard 3 of 5) * * MiB -> * MiB (* MiB)",
        ">  generate (max_new_tokens=512) * * MiB -> * MiB (* MiB) * raised Failed: Timeout (>0.5s) from "
        "pytest-timeout.",
    ])


@pytest.mark.timeout(60)
def test_a_passing_test_shows_its_phases_only_when_asked(pytester):
    pytester.makepyfile("""
        from pytest_llmload.instruments.phases import phase

        def test_quick():
            with phase("decode"):
                pass
    """)
    quiet = pytester.runpytest()
    quiet.assert_outcomes(passed=1)
    assert "llmload: phases" not in quiet.stdout.str()
    asked = pytester.runpytest("-rP")
    asked.stdout.fnmatch_lines(["*- llmload: phases -*", "   phase * seconds * RSS before -> after (peak)",
                                "   decode * * MiB -> * MiB (* MiB)"])


PROGRESS = """
from pytest_llmload.instruments.phases import phase

def test_long():
    with phase("generate", max_new_tokens=512) as p:
        # The phase lasts exactly until two progress lines are out: no sleep.
        assert p.progressed.wait(60)
        p.progressed.clear()
        assert p.progressed.wait(60)
"""


@pytest.mark.timeout(120)
def test_a_long_phase_prints_progress_lines_at_the_configured_interval(pytester):
    pytester.makepyfile(test_long=PROGRESS)
    # Its own process, forked from this one (fixtures/warm_runs.py): the lines go to the run's own stderr.
    result = warm_runs.runpytest(pytester, "-o", "llmload_phase_progress_seconds=0.05")
    result.assert_outcomes(passed=1)
    result.stderr.fnmatch_lines([
        "llmload: test_long.py::test_long: phase 'generate (max_new_tokens=512)' running for 0.* s; RSS * MiB",
        "llmload: test_long.py::test_long: phase 'generate (max_new_tokens=512)' running for 0.* s; RSS * MiB",
    ])


@pytest.mark.timeout(120)
def test_the_option_wins_over_the_ini_key_and_zero_turns_progress_off(pytester):
    pytester.makepyfile(test_off="""
        from pytest_llmload.instruments.heartbeat import heartbeat
        from pytest_llmload.instruments.phases import phase

        def test_off():
            with phase("generate"):
                assert heartbeat()._due == {}  # nothing scheduled: no line will come
    """)
    result = warm_runs.runpytest(pytester, "-o", "llmload_phase_progress_seconds=0.05", "--llmload-phase-progress", "0")
    result.assert_outcomes(passed=1)
    assert "running for" not in result.stderr.str()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("args", "message"), [
    (["-o", "llmload_phase_progress_seconds=soon"],
     "ERROR: ini 'llmload_phase_progress_seconds'='soon' is not a number of seconds (0 or more); give e.g. "
     "--llmload-phase-progress-seconds 30.0."),
    (["--llmload-phase-progress", "-1"],
     "ERROR: --llmload-phase-progress-seconds='-1' is not a number of seconds (0 or more); give e.g. "
     "--llmload-phase-progress-seconds 30.0."),
    (["-o", "llmload_near_deadline=80%"],
     "ERROR: ini 'llmload_near_deadline'='80%' is not a fraction between 0 and 1; give e.g. "
     "--llmload-near-deadline 0.8."),
])
def test_bad_settings_are_usage_errors_naming_the_value_and_where_it_came_from(pytester, args, message):
    pytester.makepyfile("def test_one(): pass\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


@pytest.mark.timeout(120)
def test_under_the_thread_method_the_table_is_printed_before_the_process_ends(pytester):
    # pytest-timeout's thread method dumps stacks and ends the process: no report, so no section. The process is
    # forked from this one (fixtures/warm_runs.py); the table comes half way into the 1 s deadline.
    pytester.makepyfile(PHASE_HANGS.format(timeout=1, method="thread"))
    result = warm_runs.runpytest(pytester, "--llmload-phase-progress", "0")
    assert result.ret != 0
    result.stderr.fnmatch_lines([
        "llmload: test_under_the_thread_method_*.py::test_stuck is 0.5 s into its 1 s pytest-timeout (method thread: the process "
        "ends without a report); phases so far:",
        "   phase * seconds * RSS before -> after (peak)",
        "   load (shard 3 of 5) * * MiB -> * MiB (* MiB)",
        ">  generate (max_new_tokens=512) *+ * MiB -> ... * running",
    ])
    result.stdout.fnmatch_lines(["*Timeout*"])


@pytest.mark.parametrize(("timeout", "printed_after"), [(300, 285), (2, 1.5), (0.6, 0.3)])
def test_the_thread_method_table_comes_5_percent_or_half_a_second_early_but_never_before_half_way(timeout, printed_after):
    from pytest_llmload.reports.sections import thread_method_warning_after

    assert thread_method_warning_after(timeout) == pytest.approx(printed_after)


WHERE = """
from pytest_llmload.checks.ground_truth import offload_budget

def test_offloaded(llmload_load, llmload_checkpoint, tmp_path):
    model, _ = llmload_load(max_memory=offload_budget(llmload_checkpoint), offload_folder=tmp_path / "offload")
    assert not hasattr(model, "hf_device_map"), "spread over devices"

def test_whole(llmload_load):
    model, _ = llmload_load()
    assert model is None
"""


@pytest.mark.timeout(120)
def test_a_failing_test_says_where_its_offloaded_model_is(pytester):
    pytester.makepyfile(test_where=WHERE)
    result = pytester.runpytest("-k", "offloaded")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*- llmload: where the models are -*",
        "LlamaForCausalLM from */llama-float32-seed0, loaded in * s",
        "  hf_device_map: cpu 2 (model.embed_tokens, model.layers.0), disk 6 (model.layers.1, model.layers.2, "
        "model.layers.3, +3 more)",
        f"  modules with weights: cpu {tiny_llama.PARAMETERS - tiny_llama.OFFLOADED}, meta {tiny_llama.OFFLOADED}",
        f"  parameters on meta: {tiny_llama.OFFLOADED} of {tiny_llama.PARAMETERS} (model.layers.1.self_attn.q_proj.weight, "
        "model.layers.1.self_attn.k_proj.weight, model.layers.1.self_attn.v_proj.weight, +26 more)",
        # 30 hooked modules from transformers 4.56 / accelerate 1.10 on; 33 on transformers 4.46 / accelerate 1.0.1
        "  offloaded by accelerate: 29 weights, 513.8 KiB to disk (folder */offload); hooks on 3[03] modules",
        "  dtypes: cpu float32 (10 params, 224.5 KiB); meta float32 (29 params, 513.8 KiB)",
    ])


@pytest.mark.timeout(120)
def test_a_model_loaded_whole_is_summarised_as_such(pytester):
    # The counterpart: the same summary for a model with nothing offloaded says so.
    pytester.makepyfile(test_where=WHERE)
    result = pytester.runpytest("-k", "whole")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*- llmload: where the models are -*",
        "LlamaForCausalLM from */llama-float32-seed0, loaded in * s",
        f"  modules with weights: cpu {tiny_llama.PARAMETERS}",
        f"  parameters on meta: none of {tiny_llama.PARAMETERS}",
        f"  dtypes: cpu float32 ({tiny_llama.PARAMETERS} params, 738.2 KiB)",
    ])
    out = result.stdout.str()
    assert "offloaded by accelerate" not in out
    # transformers 4.x records a one-device map ({"": "cpu"}) in hf_device_map; 5.x records none.
    from importlib import metadata

    from packaging.version import Version

    one_device = ["  hf_device_map: cpu 1 (<whole model>)"] if Version(metadata.version("transformers")).major < 5 else []
    assert [line for line in out.splitlines() if "hf_device_map" in line] == one_device


@pytest.mark.timeout(180)
def test_the_session_summary_under_xdist_lists_loads_peaks_and_checks_near_their_deadline(xdist_run):
    # The shared run (fixtures/xdist_run.py), its module test_summary: two loads, one offloaded, and two checks'
    # deadlines, one close to it; no other module of that run loads a model.
    assert xdist_run.outcomes("test_summary") == {"passed": 4}
    result = xdist_run.result
    result.stdout.fnmatch_lines([
        "*= llmload diagnostics =*",
        "models loaded: 2 in 2 tests, * s in all (median * s, slowest 2):",
        "     * s  LlamaForCausalLM from llama-float32-seed0 on *  test_summary.py::test_loads*",
        "     * s  LlamaForCausalLM from llama-float32-seed0 on *  test_summary.py::test_loads*",
        "peak memory: process RSS * MiB (test_summary.py::test_loads*, phase 'load (llama-float32-seed0 for "
        "inference on cpu*)')",
        "near or past their deadline (over 80% of it):",
        "  27.00 s of 30 s (90%)  test_summary.py::test_check_close_to_its_deadline  (check deadline: a forward "
        "pass of the offloaded model)",
    ])
    out = result.stdout.str()
    assert "on cpu+disk  test_summary.py::test_loads_offloaded" in out
    assert "on cpu  test_summary.py::test_loads\n" in out
    assert "test_check_well_within_its_deadline" not in out


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("near", "listed"), [("0", True), ("1", False)])
def test_a_test_near_its_pytest_timeout_is_listed(pytester, near, listed):
    pytester.makepyfile("""
        import pytest
        from pytest_llmload.instruments.phases import phase

        @pytest.mark.timeout(30)
        def test_timed():
            with phase("decode"):
                pass
    """)
    result = pytester.runpytest("-o", f"llmload_near_deadline={near}")
    result.assert_outcomes(passed=1)
    line = "  * s of 30 s (*%)  test_a_test_near_its_pytest_timeout_is_listed.py::test_timed  (pytest-timeout)"
    if listed:
        result.stdout.fnmatch_lines(["near or past their deadline (over 0% of it):", line])
    else:
        assert "near or past their deadline" not in result.stdout.str()


@pytest.mark.timeout(60)
def test_a_run_with_no_phase_and_no_model_has_no_summary(pytester):
    pytester.makepyfile("def test_plain():\n    assert 1 == 2\n")
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    assert "llmload diagnostics" not in result.stdout.str()
    assert "llmload: phases" not in result.stdout.str()
