"""needs_gpus / gpu markers, tested as a user meets them: through a pytest run (pytester)."""

import pytest

pytestmark = pytest.mark.timeout(120)

MARKED = """
import pytest

@pytest.mark.needs_gpus(2)
def test_two_gpus():
    pass

@pytest.mark.needs_gpus(1)
class TestOnOneGpu:
    def test_method(self):
        pass

def test_uses_gpu_fixture(gpu_model):
    pass

def test_cpu():
    pass
"""


def test_needs_gpus_skips_with_counts_and_visible_set(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    pytester.makepyfile(MARKED)
    result = pytester.runpytest("-rs", "-k", "two_gpus")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED*test_needs_gpus_skips_with_counts_and_visible_set.py:3: "
                                 "needs 2 GPUs, 0 visible (CUDA_VISIBLE_DEVICES=0)"])


def test_needs_gpus_reason_says_when_visible_set_is_unset(pytester, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pytester.makepyfile(MARKED)
    result = pytester.runpytest("-rs", "-k", "TestOnOneGpu")
    result.stdout.fnmatch_lines(["*needs 1 GPU, 0 visible (CUDA_VISIBLE_DEVICES unset)"])


def test_gpu_marker_selects_exactly_the_gpu_tests(pytester):
    pytester.makepyfile(MARKED)
    gpu = pytester.runpytest("-m", "gpu", "--collect-only", "-q")
    gpu.stdout.fnmatch_lines(["*::test_two_gpus", "*::TestOnOneGpu::test_method", "*::test_uses_gpu_fixture",
                              "3/4 tests collected (1 deselected)*"])
    cpu = pytester.runpytest("-m", "not gpu", "--collect-only", "-q")
    cpu.stdout.fnmatch_lines(["*::test_cpu", "1/4 tests collected (3 deselected)*"])


def test_extra_gpu_fixtures_from_ini_are_marked_gpu(pytester):
    pytester.makeini("[pytest]\nllmload_gpu_fixtures = my_cuda_thing\n")
    pytester.makeconftest("import pytest\n@pytest.fixture\ndef my_cuda_thing():\n    return 1\n")
    pytester.makepyfile("def test_a(my_cuda_thing): pass\ndef test_b(): pass\n")
    result = pytester.runpytest("-m", "gpu", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["*::test_a", "1/2 tests collected (1 deselected)*"])


@pytest.mark.parametrize(
    ("written", "why"),
    [
        ('"two"', "got 'two'"),
        ("0", "got 0"),
        ("-1", "got -1"),
        ("True", "got True"),
        ("2.0", "got 2.0"),
        ("n=2, x=1", "needs_gpus() got an unexpected keyword argument 'x'"),
        ("", "needs_gpus() missing 1 required positional argument: 'n'"),
        ("1, 2", "needs_gpus() takes 1 positional argument but 2 were given"),
    ],
)
def test_invalid_needs_gpus_is_an_error_of_that_test(pytester, written, why):
    pytester.makepyfile(f"""
        import pytest

        @pytest.mark.needs_gpus({written})
        def test_misused():
            pass

        def test_untouched():
            pass
    """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, errors=1)
    shown = written.replace('"', "'")
    result.stdout.fnmatch_lines([
        f"*::test_misused: @pytest.mark.needs_gpus({shown}) is invalid*{why}*"
        "expected one positive int, the number of GPUs the test needs, e.g. @pytest.mark.needs_gpus(2)."
    ])


def test_bare_marker_without_call_is_an_error(pytester):
    pytester.makepyfile("import pytest\n@pytest.mark.needs_gpus\ndef test_x(): pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*test_x: @pytest.mark.needs_gpus() is invalid (needs_gpus() missing 1*"])


def test_needs_gpus_on_class_and_function_must_agree(pytester):
    # pytest's rule, the closest marker wins, would silently drop the class's stricter needs_gpus(2).
    pytester.makepyfile("""
        import pytest

        @pytest.mark.needs_gpus(2)
        class TestOnTwo:
            @pytest.mark.needs_gpus(1)
            def test_disagrees(self):
                pass

            @pytest.mark.needs_gpus(2)
            def test_repeats(self):
                pass
    """)
    result = pytester.runpytest("-rs")
    result.assert_outcomes(errors=1, skipped=1)
    result.stdout.fnmatch_lines(["*::TestOnTwo::test_disagrees: @pytest.mark.needs_gpus(1) on test_disagrees and "
                                 "@pytest.mark.needs_gpus(2) on TestOnTwo disagree; keep one, the number of GPUs the "
                                 "test needs.", "SKIPPED*needs 2 GPUs, 0 visible*"])


def test_keyword_n_is_accepted(pytester):
    pytester.makepyfile("import pytest\n@pytest.mark.needs_gpus(n=3)\ndef test_x(): pass\n")
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs 3 GPUs, 0 visible*"])


def test_markers_are_registered_for_strict_mode(pytester):
    pytester.makeini("[pytest]\naddopts = --strict-markers\n")
    pytester.makepyfile("import pytest\n@pytest.mark.gpu\n@pytest.mark.needs_gpus(1)\ndef test_x(): pass\n")
    pytester.runpytest().assert_outcomes(skipped=1)
    listing = pytester.runpytest("--markers")
    listing.stdout.fnmatch_lines(["@pytest.mark.needs_gpus(n): skip unless at least n CUDA devices*",
                                  "@pytest.mark.gpu: the test needs a GPU*"])


def test_deepspeed_is_imported_after_collection_only_when_a_test_needs_it(pytester):
    pytest.importorskip("deepspeed")
    test = """
        import os, sys, pytest

        @pytest.mark.llmload_deepspeed
        def test_ds():
            assert "deepspeed.comm.torch" in sys.modules  # imported before this test's deadline began
            assert sys.modules["deepspeed.comm.torch"].build_shm_op() is None  # nothing is built

        def test_after_ds():  # DeepSpeed is as it was outside the DeepSpeed test
            assert sys.modules["deepspeed.comm.torch"].build_shm_op.__module__ == "deepspeed.comm.torch"

        def test_plain():
            assert "deepspeed" not in sys.modules
    """
    pytester.makepyfile(test)
    pytester.runpytest_subprocess("-k", "not plain", "-p", "no:cacheprovider").assert_outcomes(passed=2)
    pytester.runpytest_subprocess("-k", "test_plain", "-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_deepspeeds_import_at_collection_prints_nothing(pytester, monkeypatch):
    """Before (issue 39): ``[WARNING] [real_accelerator.py:...] Setting accelerator to CPU. If you have GPU or other
    accelerator, we were unable to detect it.`` among pytest's collection lines (and, with DeepSpeed 0.17, its INFO
    lines and a ``torch.jit.script`` deprecation in the warnings summary): the plugin's import, not the run's."""
    pytest.importorskip("deepspeed")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)  # (what makes DeepSpeed guess, and say so)
    pytester.makepyfile("import pytest\n\n@pytest.mark.llmload_deepspeed\ndef test_ds():\n    pass\n")
    result = pytester.runpytest_subprocess("--collect-only", "-q", "-p", "no:cacheprovider", "-W", "default")
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == 0 and "1 test collected" in output, output
    assert not any(said in output for said in ("[WARNING]", "[INFO]", "accelerator", "warnings summary")), output


def test_deepspeed_is_not_imported_for_tests_that_skip_for_want_of_gpus(pytester):
    # `pytest -m gpu` on a CPU runner: the DeepSpeed tests all skip, so DeepSpeed is not imported.
    pytest.importorskip("deepspeed")
    pytester.makepyfile("""
        import sys, pytest

        @pytest.mark.llmload_deepspeed
        @pytest.mark.needs_gpus(64)
        def test_ds_on_gpus():
            pass

        def test_plain():
            assert "deepspeed" not in sys.modules
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, skipped=1)


def test_a_bare_gpu_marked_test_skips_on_a_runner_without_gpus(pytester, monkeypatch):
    """The README tells CPU runners to run plain pytest: a @pytest.mark.gpu test needs a GPU and skips, saying so."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile("import pytest\n\n@pytest.mark.gpu\ndef test_on_gpu(): assert False\n")
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*marked gpu: needs 1 GPU, 0 visible (CUDA_VISIBLE_DEVICES=)*"])


@pytest.mark.parametrize("how", ["option", "ini"])
def test_require_gpus_fails_a_gpu_run_that_sees_none(pytester, monkeypatch, how):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile("import pytest\n\n@pytest.mark.needs_gpus(1)\ndef test_gpu(): pass\n\ndef test_cpu(): pass\n")
    args = ["-m", "gpu"]
    if how == "option":
        args.append("--llmload-require-gpus")
    else:
        pytester.makeini("[pytest]\nllmload_require_gpus = true\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--llmload-require-gpus: this run selects 1 GPU test(s) but sees no GPU*"])
    assert pytester.runpytest("-m", "not gpu", *args[2:]).ret == pytest.ExitCode.OK  # no GPU test selected: fine
