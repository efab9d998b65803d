"""The limit_torch_memory marker, as a user meets it (pytester): over the limit fails with the figures, under
it passes, a bad limit errors naming the value, and it skips where it cannot measure."""

from __future__ import annotations

import pytest

from pytest_llmload.system.sizes import parse_size

pytestmark = pytest.mark.timeout(120)

ALLOCATES = """
import pytest
import torch

@pytest.mark.limit_torch_memory({limit!r})
def test_allocates():
    first = torch.ones(1_000_000)  # 4 MB
    del first
    second = torch.ones(1_000_000)  # freed memory reused: the peak stays near 4 MB
    assert second.sum() == 1_000_000
"""


def test_a_test_over_its_limit_fails_with_the_figures(pytester):
    pytester.makepyfile(ALLOCATES.format(limit="3 MB"))
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "limit_torch_memory: the test's peak torch allocation on cpu was 3.8 MiB (4,0*,* B), over its limit of "
        "'3 MB' (3,000,000 B) by *. Measured: torch's CPU allocator, profiler memory events.",
    ])


def test_the_same_test_under_its_limit_passes_and_reports_its_peak(pytester):
    pytester.makepyfile(ALLOCATES.format(limit="5 MB"))
    result = pytester.runpytest("-rP")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*- llmload: torch memory -*",
                                 "peak cpu 3.8 MiB (limit 5 MB); torch's CPU allocator, profiler memory events",
                                 "*torch allocation under limit_torch_memory 3.8 MiB on cpu*"])


def test_a_lora_training_step_of_the_tiny_model_is_measured(pytester):
    # What the marker is for: a budget on a real step. The tiny model's forward and backward at 2 x 128
    # tokens need about 4 MiB (lora_model loads during setup, outside the measured call); 1 MB fails, 16 MB passes.
    pytester.makepyfile("""
        import pytest
        import torch

        @pytest.mark.parametrize("limit", [pytest.param(limit, marks=pytest.mark.limit_torch_memory(limit))
                                           for limit in ("1 MB", "16 MB")])
        def test_step(limit, lora_model):
            ids = torch.randint(2, 320, (2, 128))
            lora_model(input_ids=ids, labels=ids).loss.backward()
    """)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*limit_torch_memory: the test's peak torch allocation on cpu was * MiB (* B), "
                                 "over its limit of '1 MB' (1,000,000 B)*"])


@pytest.mark.parametrize(("args", "why"), [
    ("'lots'", "'lots' is not a size"),
    ("'24 parsecs'", "'24 parsecs' is not a size (unknown unit 'parsecs')"),
    ("0", "0 is not a positive size"),
    ("True", "True is a bool, not a size"),
    ("'24 MB', device='tpu'", "device='tpu' is neither 'cuda' nor 'cpu'"),
])
def test_a_bad_limit_errors_the_test_with_a_sentence_naming_the_value(pytester, args, why):
    pytester.makepyfile(f"import pytest\n\n@pytest.mark.limit_torch_memory({args})\ndef test_x():\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    written = args.replace('"', "'")
    result.stdout.fnmatch_lines([
        f"test_a_bad_limit_*.py::test_x: @pytest.mark.limit_torch_memory({written}) is invalid: {why}; expected a "
        "size such as '24 MB' (powers of 1000), '1.5 GiB' (powers of 1024) or a positive int of bytes*"])
    assert "During handling" not in result.stdout.str()


@pytest.mark.parametrize(("args", "why"), [
    ("", "missing 1 required positional argument: 'limit'"),
    ("'1 MB', '2 MB'", "takes 1 positional argument but 2 were given"),
    ("limit='1 MB'", "got some positional-only arguments passed as keyword arguments: 'limit'"),
])
def test_a_wrong_marker_call_is_rejected_by_python_itself(pytester, args, why):
    pytester.makepyfile(f"import pytest\n\n@pytest.mark.limit_torch_memory({args})\ndef test_x():\n    pass\n")
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*@pytest.mark.limit_torch_memory(*) is invalid (limit_torch_memory() {why})*"])


def test_a_gpu_limit_skips_without_a_gpu_saying_so(pytester, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makepyfile("""
        import pytest

        @pytest.mark.limit_torch_memory("24 MB", device="cuda")
        def test_on_gpu():
            pass
    """)
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["SKIPPED *: limit_torch_memory: measuring GPU memory needs 1 GPU, 0 visible "
                                 "(CUDA_VISIBLE_DEVICES=)"])


def test_the_marker_is_registered_for_strict_runs(pytester):
    pytester.makeini("[pytest]\nstrict = true\n")
    pytester.makepyfile("import pytest\n\n@pytest.mark.limit_torch_memory('1 GB')\ndef test_x():\n    pass\n")
    pytester.runpytest().assert_outcomes(passed=1)
    pytester.runpytest("--markers").stdout.fnmatch_lines(["@pytest.mark.limit_torch_memory(limit, *, device=None):*"])


@pytest.mark.needs_gpus(1)
def test_a_gpu_test_over_its_limit_fails_with_each_devices_peak(pytester):
    pytester.makepyfile("""
        import pytest
        import torch

        @pytest.mark.limit_torch_memory("4 MB")
        def test_on_gpu():
            # 16 MiB exactly: the CUDA caching allocator rounds a large block up to 2 MiB (16,000,000 B asked
            # for reads 16,777,216 B on an H100), and the figures below are what torch reports.
            block = torch.ones(4 * 2**20, device="cuda:0")
            del block
    """)
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*limit_torch_memory: the test's peak torch allocation on cuda:0 was 16.0 MiB "
                                 "(16,777,216 B), over its limit of '4 MB' (4,000,000 B)*torch.cuda.max_memory_allocated*"])


@pytest.mark.parametrize(("written", "nbytes"), [
    ("24 MB", 24_000_000), ("24MB", 24_000_000), ("24 mb", 3_000_000), ("24Mb", 3_000_000), ("2TB", 2 * 10**12), ("1.5 GiB", 3 * 2**29),
    ("512KiB", 512 * 1024), ("100 B", 100), (4096, 4096), ("2", 2),
])
def test_sizes(written, nbytes):
    assert parse_size(written, positive=True) == nbytes
