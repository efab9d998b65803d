"""Choosing the loader under test, and what a user sees when the choice is wrong."""

import os

import pytest

from fixtures import warm_runs
from pytest_llmload.system import gpus  # noqa: F401  (the skipif conditions read it)
from pytest_llmload import LoadRequest, call_loader
from pytest_llmload.fixes.reference_loader import REFERENCE
from pytest_llmload.loader.seam import LoaderContractError, LoaderSpecError

pytestmark = pytest.mark.timeout(120)

LOADERS = """
def loader_a(request):
    raise AssertionError("not called in these tests")

def loader_b(request):
    raise AssertionError("not called in these tests")

not_callable = 42
"""


@pytest.fixture
def loaders(pytester, monkeypatch):
    pytester.makepyfile(my_loaders=LOADERS)
    monkeypatch.syspath_prepend(pytester.path)
    monkeypatch.delenv("PYTEST_LLMLOAD_LOADER", raising=False)
    pytester.makepyfile(
        "from pytest_llmload.loader.seam import as_loader_under_test\n"
        "def test_uses_loader(llmload_loader):\n"
        "    loader = as_loader_under_test(llmload_loader)\n"
        "    print('LOADER', loader.name, loader.source)\n"
    )
    return pytester


def test_default_is_the_reference_loader(loaders):
    result = loaders.runpytest("-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([f"llmload: loader {REFERENCE.spec} (from built-in default); *",
                                 f"*LOADER {REFERENCE.spec} built-in default"])


# The precedence, as every reader sees it: tests/config/test_configuration.py.


def test_conftest_fixture_override_wins(loaders):
    loaders.makeconftest("""
        import pytest
        from my_loaders import loader_b

        @pytest.fixture(scope="session")
        def llmload_loader():
            return loader_b
    """)
    result = loaders.runpytest("-s", "--llmload-loader", "my_loaders:loader_a")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*LOADER my_loaders:loader_b fixture"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("my_loaders", "loader spec 'my_loaders' from --llmload-loader is not of the form 'module:function'*"),
        ("nope_missing_pkg:load", "loader spec 'nope_missing_pkg:load' from --llmload-loader: module "
                                  "'nope_missing_pkg' does not import (ModuleNotFoundError: *)*"),
        ("my_loaders:absent", "loader spec 'my_loaders:absent' from --llmload-loader: module 'my_loaders' "
                              "has no attribute 'absent'. Name the function that takes a LoadRequest."),
        ("my_loaders:not_callable", "loader spec 'my_loaders:not_callable' from --llmload-loader names an int, "
                                    "not a callable.*"),
    ],
    ids=["malformed", "does-not-import", "no-such-attribute", "not-callable"],
)
def test_bad_spec_is_one_usage_error(loaders, spec, message):
    result = loaders.runpytest("--llmload-loader", spec)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])


def test_bad_spec_from_env_names_the_env_var(loaders, monkeypatch):
    monkeypatch.setenv("PYTEST_LLMLOAD_LOADER", "my_loaders:absent")
    result = loaders.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: loader spec 'my_loaders:absent' from $PYTEST_LLMLOAD_LOADER: *"])


def test_bad_spec_is_not_imported_when_no_test_uses_a_loader(loaders, monkeypatch):
    monkeypatch.setenv("PYTEST_LLMLOAD_LOADER", "nope_missing_pkg:load")
    for existing in loaders.path.glob("test_*.py"):
        existing.unlink()
    loaders.makepyfile(test_plain="def test_plain():\n    pass\n")
    loaders.runpytest().assert_outcomes(passed=1)


def test_bad_spec_under_xdist_is_a_usage_error_not_a_crash(loaders):
    # The controller forked from this process (fixtures/warm_runs.py): what it decides before any worker starts.
    result = warm_runs.runpytest(loaders, "-n", "2", "--llmload-loader", "nope_missing_pkg:load")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: loader spec 'nope_missing_pkg:load' from --llmload-loader: *"])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


@pytest.mark.parametrize(
    ("returned", "described"),
    [
        ("None", "returned None (type NoneType)"),
        ("'a string'", "returned 'a string' (type str)"),
        ("(1, 2, 3)", "returned a 3-tuple (1, 2, 3) (type tuple)"),
        ("{'model': 1}", "returned {'model': 1} (type dict)"),
    ],
)
def test_loader_returning_the_wrong_thing(pytester, returned, described):
    pytester.makeconftest(f"""
        import pytest

        def wrong(request):
            return {returned}

        @pytest.fixture(scope="session")
        def llmload_loader():
            return wrong
    """)
    pytester.makepyfile("def test_load(llmload_load):\n    llmload_load()\n")
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        f"E *LoaderContractError: loader conftest:wrong {described} for a purpose='inference' request of *; a loader must "
        "return a torch.nn.Module (a transformers model) or a (model, tokenizer) tuple."
    ])


def test_overridden_fixture_that_is_not_callable(pytester):
    pytester.makeconftest("import pytest\n@pytest.fixture(scope='session')\ndef llmload_loader():\n    return 'nope'\n")
    pytester.makepyfile("def test_load(llmload_load):\n    llmload_load()\n")
    result = pytester.runpytest()
    result.stdout.fnmatch_lines(["*LoaderSpecError: the loader from fixture is a str ('nope'), not a callable; "
                                 "the llmload_loader fixture must return a function*"])


def test_a_repo_declares_checks_not_applicable_and_their_rows_skip_saying_why(pytester):
    """A declared inapplicability is a skip that shows the declaration and its reason, and keeps CI green (issue
    35); a name that is no check is an error naming it, never a silent pass."""
    pytester.makepyfile(served="""
        from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

        def load(request):
            return load_model_and_tokenizer(request)

        load.llmload_not_applicable = {"check_pad_token_set_offline": "our server sets the pad token itself"}
    """)
    pytester.makeini("[pytest]\nllmload_loader = served:load\n"
                     "llmload_not_applicable = check_load_writes_only_offload_folder: we never offload\n")
    result = warm_runs.runpytest(pytester, "--pyargs", "pytest_llmload.suite", "-k",
                                 "pad_token_set_offline or writes_only", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=2)  # the ini key's and the attribute's, together
    result.stdout.fnmatch_lines(["*declared not applicable: check_load_writes_only_offload_folder: we never offload*",
                                 "*declared not applicable: check_pad_token_set_offline: our server sets the pad *"])
    pytester.makeini("[pytest]\nllmload_loader = served:load\nllmload_not_applicable = check_pad_token: typo\n")
    result = warm_runs.runpytest(pytester, "--pyargs", "pytest_llmload.suite", "-k", "pad_token_set_offline",
                                 "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*loader served:load declares ?'check_pad_token'? not applicable, which are not "
                                 "checks; the checks are: *"])


def test_a_loader_declares_its_dtypes_by_attribute_or_ini(pytester):
    from pytest_llmload.loader.seam import as_loader_under_test

    def bf16(request):
        return None

    bf16.llmload_dtypes = ("bf16",)
    assert as_loader_under_test(bf16).dtypes == ("bfloat16",)
    bf16.llmload_dtypes = ("int4",)
    with pytest.raises(LoaderSpecError, match=r"bf16.llmload_dtypes = \('int4',\) is not a list of dtypes; use "
                                              r"float32, float16, bfloat16"):
        as_loader_under_test(bf16)
    pytester.makeini("[pytest]\nllmload_loader_dtypes = float16\n")
    pytester.makepyfile("def test_dtypes(llmload_loader):\n    assert llmload_loader.dtypes == ('float16',)\n")
    pytester.runpytest().assert_outcomes(passed=1)
    result = pytester.runpytest("--llmload-loader-dtypes=fp8")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--llmload-loader-dtypes = *fp8* is not a list of dtypes*"])


def test_a_loader_declares_what_it_is_for_by_attribute_or_ini(pytester):
    from pytest_llmload.loader.seam import as_loader_under_test

    def evaluate(request):
        return None

    evaluate.llmload_purposes = ("inference",)
    assert as_loader_under_test(evaluate).purposes == ("inference",)
    evaluate.llmload_purposes = ("inference", "serving")
    with pytest.raises(LoaderSpecError, match=r"evaluate.llmload_purposes = \('inference', 'serving'\) is not a "
                                              r"list of purposes; use 'inference' and/or 'train'"):
        as_loader_under_test(evaluate)
    pytester.makeini("[pytest]\nllmload_loader_purposes = inference\n")
    pytester.makepyfile("def test_purposes(llmload_loader):\n    assert llmload_loader.purposes == ('inference',)\n")
    pytester.runpytest().assert_outcomes(passed=1)


@pytest.mark.timeout(60)
def test_a_loader_that_sets_up_accelerate_is_judged_and_the_state_is_reset_for_the_check(llmload_checkpoint):
    """An evaluation harness that makes its own Accelerator() is correct for how its users run it (issue 35): the
    load goes on, the row says what happened, and the check's own set-up starts from the environment."""
    from pytest_llmload.runners.isolation import run_isolated

    def makes_its_own_accelerator(request):
        from accelerate import Accelerator

        from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

        Accelerator(cpu=True)
        return load_model_and_tokenizer(request)

    def load_it():
        from accelerate.state import AcceleratorState

        from pytest_llmload.config.stash_keys import check_notes

        # Imported, not set up: what a test process has. An earlier test in this worker may have set it up, and a
        # forked child inherits that; what matters is what the loader itself sets up.
        AcceleratorState._reset_state(reset_partial_state=True)
        notes: list = []
        check_notes.set(notes)
        call_loader(makes_its_own_accelerator, LoadRequest(llmload_checkpoint))
        return notes, bool(AcceleratorState._shared_state)

    notes, state_left = run_isolated(load_it, (), timeout=50, label="accelerate state")  # the state dies with the child
    assert not state_left, "the loader's accelerate state is reset after the load"
    assert len(notes) == 1 and "made its own Accelerator() while loading" in notes[0], notes


def leaves_its_set_up_behind(request):
    """A loader that sets up what a training script's process holds (accelerate's state, torch's defaults, launcher
    variables) and then leaves by the way its request names: returned, raised, or exited."""
    import sys

    import torch
    from accelerate import Accelerator

    Accelerator(cpu=True)
    torch.set_default_dtype(torch.bfloat16)
    os.environ.update(LOCAL_RANK="3", ACCELERATE_USE_DEEPSPEED="true")
    os.environ.pop("LLMLOAD_TEST_SET_BEFORE", None)
    way_out = request.purpose
    if way_out == "train":
        raise ValueError("the harness wants GPU 3")
    if str(request.model_path) == "exit":
        sys.exit(2)
    return torch.nn.Linear(2, 2)


def state_after_each_way_out() -> dict:
    """In a child: what is left after each way out of :func:`leaves_its_set_up_behind`."""
    import torch
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from pytest_llmload.config.stash_keys import collecting_notes

    left = {}
    for way_out, request in (("returned", LoadRequest("returned")), ("raised", LoadRequest("raised", purpose="train")),
                             ("exited", LoadRequest("exit"))):
        for state in (AcceleratorState, GradientState):  # a test process imports accelerate; none set up
            state._reset_state()
        PartialState._reset_state()
        os.environ["LLMLOAD_TEST_SET_BEFORE"] = "kept"
        with collecting_notes() as notes:
            try:
                call_loader(leaves_its_set_up_behind, request, loader_name="harness")
                raised = None
            except Exception as exc:  # noqa: BLE001 - what the row would show
                raised = f"{type(exc).__name__}: {exc}"
        left[way_out] = {
            "raised": raised, "notes": notes,
            "accelerate": [s.__name__ for s in (AcceleratorState, PartialState, GradientState) if s._shared_state],
            "dtype": str(torch.get_default_dtype()),
            "environment": {k: os.environ.get(k) for k in ("LOCAL_RANK", "ACCELERATE_USE_DEEPSPEED",
                                                           "LLMLOAD_TEST_SET_BEFORE")},
        }
    return left


@pytest.mark.timeout(60)
def test_state_a_loader_leaves_is_put_back_on_every_way_out():
    """Issue 46 (2): the state was reset only when the loader returned; a loader that made its own Accelerator() and
    then raised left it to the check's retry, which crashed ("accelerate chose NO, expected DEEPSPEED")."""
    from pytest_llmload.runners.isolation import run_isolated

    left = run_isolated(state_after_each_way_out, (), timeout=50, label="state left")  # dies with the child
    assert left["raised"]["raised"].startswith("LoaderError: loader error: ValueError: the harness wants GPU 3")
    assert left["exited"]["raised"].startswith("LoaderContractError: loader harness tried to end its process "
                                               "with sys.exit(2)")
    for way_out, after in left.items():
        assert (after["accelerate"], after["dtype"]) == ([], "torch.float32"), (way_out, after)
        assert after["environment"] == {"LOCAL_RANK": None, "ACCELERATE_USE_DEEPSPEED": None,
                                        "LLMLOAD_TEST_SET_BEFORE": "kept"}, (way_out, after)
        assert any("made its own Accelerator()" in note for note in after["notes"]), (way_out, after)
        assert any("changed the environment variables ACCELERATE_USE_DEEPSPEED, LLMLOAD_TEST_SET_BEFORE, LOCAL_RANK "
                   "while loading; put back" in note for note in after["notes"]), (way_out, after)


def test_junit_xml_carries_the_loader_the_failure_guarded_and_the_verdict_of_each_check(pytester):
    """CI dashboards group JUnit rows by these properties (issue 27)."""
    import xml.etree.ElementTree as ET

    pytester.makepyfile("""
        from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks
        from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

        @parametrize_with_loader_checks([load_model_and_tokenizer])
        def test_loader(loader, check, llmload_checkpoint, tmp_path):
            check(loader, llmload_checkpoint, tmp_path)
    """)
    result = warm_runs.runpytest(pytester, "-k", "pad_token and not cuda", "--junitxml=out.xml", "-p",
                                 "no:cacheprovider")
    result.assert_outcomes(passed=1)
    (case,) = ET.parse(pytester.path / "out.xml").getroot().iter("testcase")
    props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["llmload_loader"] == "pytest_llmload.fixes.reference_loader:load_model_and_tokenizer"
    assert (props["llmload_guards"], props["llmload_verdict"]) == ("offload-hang", "passed")


def test_a_shorter_timeout_than_a_checks_own_deadline_wins(pytester):
    """A check's own timeout marker would override --timeout; the shorter one is what the run asked for."""
    pytester.makepyfile("""
        import time
        from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks

        def slow(request):
            time.sleep(90)

        @parametrize_with_loader_checks([slow])
        def test_loader(loader, check, llmload_checkpoint, tmp_path):
            check(loader, llmload_checkpoint, tmp_path)
    """)
    # Forked from this process (fixtures/warm_runs.py): the run's own pytest-timeout alarm, not this test's. 6 s
    # covers the setup (the checkpoint, ~1 s) and leaves the check a deadline of its own (what the alarm leaves,
    # less the room for the child's stacks: 1 s at the least), which must end it first.
    result = warm_runs.runpytest(pytester, "-k", "pad_token and not cuda", "--timeout=6", "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert result.duration < 60, result.duration  # not the check's own 120 s, nor the loader's 90 s
    result.stdout.fnmatch_lines(["*did not return: deadline of * s exceeded*"])  # the check's deadline, shortened


def test_a_conftest_reads_each_checks_result_through_the_plugins_hook(pytester):
    """pytest_llmload_check_result (pytest_llmload.plugin.hookspecs): a repo's dashboard or its own gate reads every row."""
    pytester.makeconftest("""
        import json

        def pytest_llmload_check_result(item, check, result):
            with open("results.jsonl", "a") as out:
                out.write(json.dumps(result) + "\\n")
    """)
    pytester.makepyfile("""
        from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks
        from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer

        def bf16_always(request):
            return load_model_and_tokenizer(request.replace(dtype="bfloat16"))

        def shrinks(request):
            model, tokenizer = load_model_and_tokenizer(request)
            model.resize_token_embeddings(model.config.vocab_size - 4)
            return model, tokenizer

        @parametrize_with_loader_checks([load_model_and_tokenizer, bf16_always, shrinks])
        def test_loader(loader, check, llmload_checkpoint, tmp_path):
            check(loader, llmload_checkpoint, tmp_path)
    """)
    result = warm_runs.runpytest(pytester, "-k", "pad_token and not cuda", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    import json

    rows = [json.loads(line) for line in (pytester.path / "results.jsonl").read_text().splitlines()]
    assert [row["verdict"] for row in rows] == ["passed", "passed", "error"], rows
    assert {row["guards"] for row in rows} == {"offload-hang"} and all(row["failure"] is None for row in rows)
    assert rows[1]["note"].startswith("judged in bfloat16, the dtype its weights came in when asked float32"), rows[1]
    assert rows[2]["cause"] == "contract" and "rows for a checkpoint of" in rows[2]["sentence"]
    assert "make the loader honour LoadRequest.model_path" in rows[2]["sentence"], "the field to honour, named"
    # the loader each row really ran (parametrize_with_loader_checks'), not the configured one
    assert [row["loader"].rpartition(":")[2] for row in rows] == ["load_model_and_tokenizer", "bf16_always", "shrinks"]


def test_a_loader_module_that_imports_too_long_is_a_usage_error_with_progress_meanwhile(pytester):
    """Before (issue 36): a module that took 200 s to import gave 202 s of silence and no deadline."""
    pytester.makepyfile(slow_module="""
        import time

        time.sleep(30)

        def load(request):
            return None
    """)
    pytester.makepyfile(test_it="def test_it(llmload_loader):\n    pass\n")
    pytester.syspathinsert()
    result = pytester.runpytest("--llmload-loader", "slow_module:load", "--llmload-import-timeout", "1.5",
                                "--llmload-phase-progress-seconds", "0.5", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.duration < 20, result.duration
    result.stderr.fnmatch_lines(["*still importing the loader's module 'slow_module' (*s)*",
                                 "*importing the loader's module 'slow_module' (--llmload-loader) did not return: "
                                 "deadline of 1.5 s exceeded, blocked in <module> (*slow_module.py:*)*",
                                 "*Make importing 'slow_module' quick*"])


@pytest.mark.timeout(120)
def test_a_harness_that_makes_its_own_accelerator_and_pins_a_rank_is_judged_not_a_crash_of_the_check(
        llmload_checkpoint, tmp_path):
    """Issue 46 (2), as found: the harness's Accelerator() outlived its failed pinned load on a CPU runner, and the
    distributed check's own Accelerator inherited it: "accelerate chose NO", an error of the check itself."""
    from fixtures.loaders import own_accelerator_raises
    from pytest_llmload.config.stash_keys import collecting_notes
    from pytest_llmload.failures.distributed_device_map import CHECK
    from pytest_llmload.reports import verdict

    with collecting_notes() as notes:
        try:
            CHECK.function(own_accelerator_raises.load, llmload_checkpoint, tmp_path, modes=("ddp",))
            row = None
        except Exception as exc:  # noqa: BLE001 - judged as the plugin judges a row
            row = verdict.of_exception(exc, CHECK.failure)
    assert row is None, row  # passed: a rank pin puts the whole model on one device, which accelerate prepares
    assert any("loaded on the cpu" in note or "ran on cpu" in note for note in notes), notes


# --- a CUDA pin on a runner without CUDA (issue 46, 4): loader/cuda_pins.py ----------------------------------

PINS = "fixtures/loaders/pins_cuda.py"
needs_no_gpu = pytest.mark.skipif("gpus.visible_gpu_count() > 0", reason="on a GPU runner a pin loads where it says")


def line_of(function, text: str) -> int:
    """The line of ``text`` in ``function``'s source file (the sample loaders' pins, wherever edits move them)."""
    import inspect

    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


@needs_no_gpu
@pytest.mark.parametrize(("loader", "pinned_by"), [("load", "device_map={'': 0}"), ("load_then_cuda", ".cuda()"),
                                                   ("load_then_to_cuda", ".to(device(type='cuda'))")])
def test_a_cuda_pin_runs_on_the_cpu_of_a_runner_without_cuda_and_the_row_says_so(llmload_checkpoint, loader,
                                                                                 pinned_by):
    """Before: every check's row was the loader's error (``Torch not compiled with CUDA enabled``), a red build on a
    runner that lacks the device the loader's users have."""
    from fixtures.loaders import pins_cuda
    from pytest_llmload.config.stash_keys import collecting_notes

    function = getattr(pins_cuda, loader)
    line = line_of(pins_cuda._load, "from_pretrained(") if loader == "load" else line_of(function, "return model.")
    with collecting_notes() as notes:
        model, _ = call_loader(function, LoadRequest(llmload_checkpoint))
    assert {str(p.device) for p in model.parameters()} == {"cpu"}
    assert notes == [f"ran on cpu: the loader pins cuda:0 ({PINS}:{line}: {pinned_by}), a device this runner lacks; "
                     "a GPU runner (`pytest -m gpu`) judges it there"], notes
    import torch

    assert torch.nn.Module.to.__module__ == "torch.nn.modules.module", "the mapping ends with the loader call"


@needs_no_gpu
@pytest.mark.parametrize(("loader", "devices", "asked"), [
    ("spreads", "cuda:0, cuda:1", "device_map={'model.embed_tokens': 0, "),
    ("budgets_gpus", "cuda:0", "device_map='auto', max_memory={0: '20GiB', 'cpu': '60GiB'}")])
def test_a_placement_over_gpus_skips_naming_its_line_and_the_gpu_runner(llmload_checkpoint, loader, devices, asked):
    """Mapping must not change what a check observes: where the parts of a spread map, or of a budget per GPU, land
    is the offload and distributed checks' mechanism, so such a placement is not run on the cpu."""
    from fixtures.loaders import pins_cuda

    with pytest.raises(pytest.skip.Exception) as skipped:
        call_loader(getattr(pins_cuda, loader), LoadRequest(llmload_checkpoint))
    reason = str(skipped.value)
    assert reason.startswith(f"the loader places the model on {devices} "
                             f"({PINS}:{line_of(pins_cuda._load, 'from_pretrained(')}: {asked}"), reason
    assert reason.endswith("(where each part lands, by each device's budget, is what the check observes): "
                           "a GPU runner (`pytest -m gpu`) judges it"), reason


@needs_no_gpu
def test_cuda_used_beyond_a_pin_is_the_loaders_error_at_its_line(llmload_checkpoint):
    from fixtures.loaders import pins_cuda
    from pytest_llmload.loader.seam import LoaderError

    with pytest.raises(LoaderError) as raised:
        call_loader(pins_cuda.warms_up_on_cuda, LoadRequest(llmload_checkpoint))
    assert f"{PINS}:{line_of(pins_cuda.warms_up_on_cuda, 'device=')})" in str(raised.value)


@needs_no_gpu
@pytest.mark.timeout(60)
def test_a_mapped_pin_leaves_the_check_observing_what_the_gpu_would(llmload_checkpoint, tmp_path):
    """{"": 0} puts the whole model on one device whatever max_memory says, on the GPU as on the cpu: the offload
    check's scenario does not happen either way, a "not exercised" skip, neither an error nor a failure."""
    from fixtures.loaders import pins_cuda
    from pytest_llmload.config.stash_keys import collecting_notes
    from pytest_llmload.failures.offload_hang import OFFLOAD_INFERENCE

    with collecting_notes() as notes, pytest.raises(pytest.skip.Exception, match="not exercised"):
        OFFLOAD_INFERENCE(pins_cuda.load, llmload_checkpoint, tmp_path)
    assert any(note.startswith("ran on cpu: the loader pins cuda:0") for note in notes), notes


@needs_no_gpu
def test_a_cuda_pin_is_a_row_that_says_it_ran_on_the_cpu_and_a_spread_one_skips(pytester, request):
    """The rows a repo's CI reads (the plugin's hook, as --json and JUnit): not a red build for a device it lacks."""
    import json

    pytester.makeconftest("""
        import json

        def pytest_llmload_check_result(item, check, result):
            with open("results.jsonl", "a") as out:
                out.write(json.dumps(result) + "\\n")
    """)
    pytester.makepyfile("""
        from fixtures.loaders import pins_cuda
        from pytest_llmload.plugin.parametrize import parametrize_with_loader_checks

        @parametrize_with_loader_checks([pins_cuda.load, pins_cuda.spreads])
        def test_loader(loader, check, llmload_checkpoint, tmp_path):
            check(loader, llmload_checkpoint, tmp_path)
    """)
    pytester.syspathinsert(request.config.rootpath)  # fixtures.loaders
    result = warm_runs.runpytest(pytester, "-k", "pad_token", "-p", "no:cacheprovider")  # (no _cuda variant)
    result.assert_outcomes(passed=1, skipped=1)
    rows = {row["loader"].rpartition(":")[2]: row for row in map(json.loads, (pytester.path / "results.jsonl")
                                                                 .read_text().splitlines())}
    assert rows["load"]["verdict"] == "passed" and rows["load"]["note"].startswith(
        f"ran on cpu: the loader pins cuda:0 ({request.config.rootpath / PINS}:"), rows["load"]  # (outside its cwd)
    assert rows["spreads"]["verdict"] == "skipped", rows["spreads"]
    assert "the loader places the model on cuda:0, cuda:1" in json.dumps(rows["spreads"]), rows["spreads"]
    assert "a GPU runner (`pytest -m gpu`) judges it" in json.dumps(rows["spreads"]), rows["spreads"]


def test_a_model_whose_getattr_raises_is_the_models_fault_naming_the_attribute():
    """Issue 49, point 7: the recorder's read of hf_device_map raised the model's KeyError from the plugin's frames,
    reported as a bug in pytest-llmload; now the loader's model error, which the judging names as the model's."""
    import torch

    from pytest_llmload.instruments.recorder import MODEL_ATTRIBUTE_FIX, recording
    from pytest_llmload.loader.seam import LoaderModelError

    class ConfigBacked(torch.nn.Module):  # an attribute lookup through a dict, raising its KeyError
        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                return {"hidden_size": 8}[name]

    with recording(), pytest.raises(LoaderModelError) as raised:
        call_loader(lambda request: ConfigBacked(), LoadRequest("hostile"), loader_name="harness")
    assert str(raised.value).startswith(
        "loader harness returned a model that fails when read: the loader's model (ConfigBacked) raised KeyError: "
        "'hf_device_map' when pytest-llmload read its attribute 'hf_device_map'; a model's __getattr__ must raise "
        "AttributeError for a name it does not have"), raised.value
    assert raised.value.fix == MODEL_ATTRIBUTE_FIX
