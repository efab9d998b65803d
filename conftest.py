"""This repo's own test configuration. The plugin itself is loaded through its pytest11 entry point."""

import contextlib
import importlib
import importlib.util
import os

import pytest

from pytest_llmload.plugin.gates import SUB_PLUGINS
from pytest_llmload.system.gpus import physical_devices, visible_devices
from pytest_llmload.runners.warm_server import DEEPSPEED_PRELOAD

# The suite's models are tiny: a second OpenMP thread buys nothing, while on a shared 2-core runner (or under
# pytest -n 2) idle OpenMP workers spin on oversubscribed cores: measured here, the offload tests took 27.5 s
# of CPU with torch's default threads and 9.9 s with one. Set before anything imports torch; the caller's
# value wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The tests that start forkserver children test isolation, not the server's warmth: a cold server (torch alone) starts
# in ~1 s, a warm one imports the whole stack (~12 s) in every xdist worker. tests/runners/test_warm_server.py
# tests the warm one. Only where no GPU is visible: on a GPU runner (pytest -m gpu -n 4) each _cuda check's child
# would import the whole stack itself (issue 40). Read without torch (nvidia-smi or the driver's entries).
if not visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), physical_devices()):
    os.environ.setdefault("PYTEST_LLMLOAD_COLD_FORKSERVER", "1")

# browser_page: a headless Chromium (fixtures/browser.py); xdist_run: one pytest -n 2 run several tests read
# (fixtures/xdist_run.py)
pytest_plugins = ["pytester", "fixtures.browser", "fixtures.xdist_run"]

# In-process pytester runs restore sys.modules afterwards, and torch cannot be imported twice in one
# process (the second import crashes). Importing the stack before the snapshot keeps it loaded.
_HEAVY_STACK = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "accelerate",
    "peft",
    "safetensors.torch",
    "tokenizers",
    # Imported by the inner run's plugins (hypothesis', anyio's). Outside the snapshot, every in-process run
    # would import them again, and rewrite their asserts again: ~500 modules, ~1.5 s a run where bytecode is
    # not cached (PYTHONDONTWRITEBYTECODE=1).
    "hypothesis",
    "hypothesis.extra",
    # Installs an audit hook the first time a guard is entered; a hook cannot be removed, so a copy imported
    # afresh by every in-process run would leave one idle hook behind per run.
    "pytest_llmload.system.offline",
    # Imported by the plugin when a run first needs them. Imported first inside an in-process run, they would
    # leave sys.modules at its end while their package kept the attribute: a later run's `from package import
    # module` would get that copy, which sys.modules (and pytest_terminal_summary's lookup there) no longer knows.
    *SUB_PLUGINS,
    "pytest_llmload.reports.known_failures",
    "pytest_llmload.failures",
)
# Imported only where their package is installed (package -> modules): anyio's pytest plugin comes with newer
# huggingface_hub, not the older stacks. DeepSpeed's preload, because it imports torch._inductor and torch._dynamo's
# debugging backends, which register themselves by name in a registry imported before the snapshot: imported first
# inside an in-process run and dropped at its end, a later import in this process fails ("duplicate name: eager").
# bitsandbytes too: it registers its torch ops at import (older peft imports it lazily, inside a run).
_OPTIONAL = {"anyio": ("anyio",), "deepspeed": DEEPSPEED_PRELOAD, "bitsandbytes": ("bitsandbytes",)}


# Hypothesis' pytest plugin imports all of hypothesis at the end of every run: ~0.9 s of CPU in each pytest
# process this suite starts (subprocess runs, their xdist workers, torchrun ranks), and no inner run uses it.
INNER_RUN_ADDOPTS = "-p no:hypothesispytest"


@pytest.fixture(autouse=True)
def _heavy_stack_outside_pytester_snapshot(request, monkeypatch):
    # Autouse fixtures are set up before the test's own function-scoped fixtures, so this runs before
    # pytester takes its snapshot of sys.modules.
    if "pytester" in request.fixturenames:
        for name in _HEAVY_STACK:
            importlib.import_module(name)
        for package, names in _OPTIONAL.items():
            if importlib.util.find_spec(package) is not None:
                for name in names:
                    with contextlib.suppress(ImportError):  # a module an older release lacks (DeepSpeed's muon)
                        importlib.import_module(name)
        request.getfixturevalue("pytester")  # it clears PYTEST_ADDOPTS when it starts: set it after
        monkeypatch.setenv("PYTEST_ADDOPTS", INNER_RUN_ADDOPTS)


# The tests that start interpreters of their own (seconds each, most of this suite's time) run first: xdist hands
# tests out in collection order, one worker at a time, so these spread over the workers instead of leaving one
# worker to finish a long one alone at the end. Whole files move, so module-scoped fixtures are still built once.
STARTS_INTERPRETERS_FIRST = (
    "tests/runners/test_launcher.py",
    "tests/main_job/test_main_job.py",
    "tests/plugin/test_xdist_gpus.py",
)


# The contributor's inner loop is `pytest -m "not slow" -n 2` (docs/performance.md): the tests below take a second or
# more each (a real interpreter, xdist or torchrun run, a deadline waited on purpose, ranks or a Trainer), measured
# from a full run's JUnit durations (or bench_test_command.py --by-file), and parametrized grids whose cells add up to
# seconds (the planner against from_pretrained's own map). CI runs them all. Whole files where nearly every test is
# slow; else by name, or by a parametrized test's full name (`name[id]`) where only some of its cases are slow.
SLOW_FILES = (
    "tests/main_job/test_main_job.py", "tests/test_corpus.py", "tests/test_sample_loaders.py", "tests/runners/test_launcher.py",
    "tests/plugin/test_xdist_gpus.py", "tests/plugin/test_plugin_load_cost.py", "tests/runners/test_child_coverage.py",
    "tests/plugin/test_check_registry.py", "tests/test_downstream_repo.py", "tests/test_readme_adapter.py",
    "tests/plugin/test_loader_hang.py", "tests/runners/test_warm_server.py",
    "tests/test_write_ups_as_written.py", "tests/reports/test_html_report_browser.py",
    "tests/docs/test_docs_render.py", "tests/commands/test_run_commands.py", "tests/prediction/test_simulated_machine.py",
)
SLOW_TESTS = {
    "tests/checks/test_contract.py": ("test_every_check_goes_through_the_contract[check_train_request_trains]",
                                      "test_every_check_goes_through_the_contract[check_trainer_does_not_wrap_placed_model]"),
    "tests/failures/test_adapter_on_offloaded.py": (
        "test_check_passes_on_the_fixed_loader",
        "test_check_fails_on_the_silent_way_naming_the_adapter_weights_on_meta"),
    "tests/failures/test_distributed_device_map.py": (
        "test_check_passes_on_the_reference_loader", "test_every_mode_is_judged_even_when_the_first_cannot_run_here"),
    "tests/failures/test_dp_dtype.py": (
        "test_check_fails_on_the_write_up_setup", "test_check_passes_with_the_fix",
        "test_check_reports_a_first_step_dtype_error", "test_what_a_stock_trainer_does_with_the_write_up_model"),
    "tests/failures/test_inference_stall.py": ("test_a_deadline_hit_inside_generate_names_inference_stall",),
    "tests/failures/test_move_offloaded.py": (
        "test_check_fails_when_deepspeed_initialize_moves_the_offloaded_model",
        "test_check_passes_on_loaders_that_do_not_move_an_offloaded_model"),
    "tests/failures/test_offload_hang.py": (
        "test_a_hung_load_fails_within_its_deadline_naming_the_blocked_frame",
        "test_writes_check_does_not_count_a_compilers_cache"),  # (torch.compile's first call imports inductor: 1.1 s)
    "tests/failures/test_zero3_device_map.py": (
        "test_check_passes_on_a_loader_that_asks_transformers", "test_check_passes_on_the_reference_loader",
        "test_the_before_loader_is_write_up_004s_correct_fix"),
    "tests/runners/test_isolation.py": (
        "test_a_forkserver_child_works_too", "test_a_hang_fails_at_the_deadline_with_the_childs_stacks", "test_a_hung_child_still_hands_back_what_it_logged",
        "test_an_isolated_check_that_hangs_fails_at_its_timeout_with_the_stacks",
        "test_ctrl_c_kills_the_children_and_removes_the_temp_dir",
        "test_isolated_tests_pass_fail_hang_and_die_on_their_own", "test_isolated_tests_under_xdist",
        "test_known_failures_raised_in_a_child_are_named", "test_the_childs_log_records_reach_this_processs_handlers",
        "test_a_hung_childs_daemons_in_sessions_of_their_own_end_with_it_at_its_deadline"),
    "tests/runners/test_ranks.py": (
        "test_forkserver_ranks_work_too", "test_ranks_simulating_a_runner_without_gpus_see_none_on_a_machine_with_gpus",
        "test_a_hanging_rank_fails_the_test_within_its_deadline_with_the_stacks",
        "test_a_hanging_rank_is_killed_at_its_deadline_with_every_ranks_stack"),
    "tests/test_bad_inputs.py": ("test_a_bad_input_ends_in_a_sentence",),
    "tests/reports/test_known_failures.py": ("test_deadline_hit_inside_from_pretrained_names_offload_hang",),
    "tests/instruments/test_device_map_summary.py": (
        "test_lora_over_an_offloaded_model_is_traced_to_its_tier_through_peft_names",),
    "tests/plugin/test_memory_limit.py": ("test_a_gpu_limit_skips_without_a_gpu_saying_so",),
    "tests/reports/test_sections.py": (
        "test_a_deadline_hit_shows_the_phase_table_and_the_phase_that_was_running",
        "test_the_session_summary_under_xdist_lists_loads_peaks_and_checks_near_their_deadline",
        "test_under_the_thread_method_the_table_is_printed_before_the_process_ends"),
    "tests/reports/test_html_report.py": (
        "test_the_report_has_a_row_per_test_and_pictures_of_the_offloaded_model",
        "test_pytest_html_gets_the_same_pictures_as_extras",
        "test_under_xdist_the_workers_records_reach_the_controllers_report",
        "test_a_run_without_the_report_draws_nothing_and_imports_no_matplotlib",
        "test_the_failing_row_comes_first_and_each_picture_is_drawn_once",
        "test_a_prediction_run_draws_a_bar_group_per_prediction_with_its_devices_and_capacities"),
    "tests/test_docs.py": ("test_the_site_builds_with_warnings_as_errors",),
    "tests/failures/test_homes.py": ("test_a_gpu_variant_runs_in_a_forkserver_child_on_cuda_0",
                                     "test_a_12th_failure_is_its_three_files_and_nothing_else"),
    "tests/loader/test_seam.py": ("test_a_shorter_timeout_than_a_checks_own_deadline_wins",
                                  "test_a_loader_module_that_imports_too_long_is_a_usage_error_with_progress_meanwhile",
                                  "test_a_cuda_pin_is_a_row_that_says_it_ran_on_the_cpu_and_a_spread_one_skips"),
    "tests/system/test_offline.py": ("test_offline_only_while_llmload_tests_run_under_xdist",),
    "tests/system/test_gpus.py": ("test_a_test_that_may_fill_a_shared_gpu_holds_it_alone",),
    "tests/prediction/test_mechanisms.py": (
        "test_a_correct_loader_exits_0_with_runner", "test_a_correct_loader_is_predicted_no_known_failure",
        "test_the_suite_skips_a_scenario_the_loader_is_not_declared_for"),
    "tests/prediction/test_planner_exact.py": (
        "test_the_plan_is_from_pretrained_s_own_map", "test_a_4bit_plan_is_from_pretrained_s_own_map_or_its_refusal"),
    "tests/prediction/test_inputs.py": ("test_the_shipped_architectures_build",),
    "tests/prediction/test_gating.py": (
        "test_a_prediction_on_a_pair_the_repo_does_not_gate_on_is_reported_and_exits_0",
        "test_a_prediction_on_a_gated_pair_fails_the_run_as_every_one_does_where_none_is_declared",
        "test_an_expected_prediction_is_an_xfail_with_its_reason_and_one_no_longer_predicted_an_xpass"),
    "tests/prediction/test_moved_whole.py": (
        "test_a_model_trained_without_a_device_map_is_moved_whole_to_its_gpu_and_does_not_fit",),
    "tests/reports/test_pytest_report_files.py": (
        "test_an_error_row_is_an_error_in_junit_xml_and_a_failure_stays_a_failure[xdist]",
        "test_each_row_is_a_record_in_the_report_log_after_its_report[xdist]"),
    "tests/reports/test_header.py": ("test_the_header_is_there_under_xdist",),
    "tests/reports/test_loader_fault_rows.py": (
        "test_junit_carries_the_finding_and_the_fix_of_each_row", "test_the_pad_token_checks_model_error_carries_its_fix",
        "test_the_main_jobs_json_and_table_say_the_fault_of_a_loader_run_in_an_isolated_child",
        "test_a_lora_model_checkpointed_reentrantly_cannot_train_and_its_row_says_enable_input_require_grads"),
    "tests/plugin/test_fixtures.py": ("test_gpu_tests_skip_on_a_cpu_runner_before_anything_heavy_is_imported",),
    "tests/prediction/test_predict.py": (
        "test_a_runner_that_is_not_a_profile_is_a_usage_error",
        "test_the_prediction_through_the_loader_equals_the_planner_given_the_profiles_memory",
        "test_the_reference_loader_does_nothing_after_loading_that_the_runner_would_refuse",
        "test_what_a_before_loader_does_after_loading_is_predicted_on_a_runner_that_offloads"),
    "tests/plugin/test_markers.py": (
        "test_deepspeed_is_imported_after_collection_only_when_a_test_needs_it",
        "test_deepspeed_is_not_imported_for_tests_that_skip_for_want_of_gpus",
        "test_deepspeeds_import_at_collection_prints_nothing"),
    "tests/plugin/test_guarded_import.py": (
        "test_a_slow_loader_import_shows_its_progress_on_the_main_jobs_console_and_ends_at_its_deadline",),
    "tests/checks/test_judgement.py": (
        "test_the_html_report_spools_nothing_and_a_rows_artefacts_carry_what_its_isolated_child_recorded",),
    "tests/commands/test_run_usage.py": (
        "test_a_hang_ends_every_process_at_the_deadline_with_each_stack",
        "test_a_sigterm_ends_the_run_and_every_process_of_the_command"),
    "tests/plugin/test_command_items.py": (
        "test_named_commands_pass_fail_and_skip_with_the_rows_text_and_the_fixture_returns_rows",
        "test_a_real_commands_known_failure_fails_its_item_at_the_repos_line_with_the_fix"),
    "tests/plugin/test_interruption.py": (
        "test_sigterm_writes_junit_with_the_rows_so_far", "test_sighup_writes_the_html_report_with_a_banner",
        "test_run_deadline_stops_the_run_and_writes_the_reports",
        "test_run_deadline_takes_the_stacks_of_the_running_tests_children"),
}


def _mark_slow(items) -> None:
    for item in items:
        path = item.nodeid.partition("::")[0]
        named = SLOW_TESTS.get(path, ())
        if path in SLOW_FILES or getattr(item, "originalname", item.name) in named or item.name in named:
            item.add_marker(pytest.mark.slow)


def pytest_collection_modifyitems(items):
    _mark_slow(items)

    def rank(item):
        path = item.nodeid.partition("::")[0]
        return STARTS_INTERPRETERS_FIRST.index(path) if path in STARTS_INTERPRETERS_FIRST else len(
            STARTS_INTERPRETERS_FIRST)

    items.sort(key=rank)
