"""Known failures are named in the failure report, from the real errors (produced here, not typed in)."""

import pytest

from pytest_llmload import catalog

pytestmark = pytest.mark.timeout(120)


def test_catalog_has_every_write_up_with_its_parts():
    assert {f.write_up for f in catalog.CATALOG} == {
        f"seeds/{name}" for name in (
            "000_90648e437c1c073a.txt", "001_8385e6bc387e2557.txt", "002_3bbec781721991d8.txt",
            "003_b296b1821f4bec50.txt", "004_e47582475487edd3.txt")
    }
    for failure in catalog.CATALOG:
        assert failure.signatures and failure.root_cause and failure.fix and failure.occurs, failure.id


def test_dtype_mismatch_from_a_real_bf16_linear_names_dp_dtype(pytester):
    pytester.makepyfile("""
        import torch

        def test_lm_head_gets_float_activations():
            lm_head = torch.nn.Linear(8, 8).to(torch.bfloat16)
            lm_head(torch.randn(2, 8))  # float32 activations, as in DataParallel's worker threads
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*- llmload: known failure -*",
        "[[]dp-dtype[]] nn.DataParallel wrapped around a model already placed with device_map",
        "  write-up:   seeds/003_b296b1821f4bec50.txt",
        "  root cause: Trainer saw n_gpu > 1*",
        "  fix:        Do not let Trainer data-parallelise a placed model*",
        "  evidence:   no DataParallel frame in the traceback*",
        "*llmload: failures matching known failures: dp-dtype (1)*",
    ])


def test_deadline_hit_inside_from_pretrained_names_offload_hang(pytester, llmload_checkpoint):
    pytester.makepyfile(f"""
        import threading
        import pytest
        import transformers.modeling_utils
        from transformers import AutoModelForCausalLM

        @pytest.mark.timeout(3, method="signal")
        def test_load_blocks(monkeypatch):
            def blocked_shard_open(*args, **kwargs):
                threading.Event().wait()  # a shard read that never returns
            # modeling_utils opens every shard through its own safe_open reference
            monkeypatch.setattr(transformers.modeling_utils, "safe_open", blocked_shard_open)
            AutoModelForCausalLM.from_pretrained({str(llmload_checkpoint)!r})
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Timeout (>3.0s) from pytest-timeout*", "[[]offload-hang[]] *"])
    assert "[inference-stall]" not in result.stdout.str()


def test_unrelated_failure_gets_no_section(pytester):
    pytester.makepyfile("def test_plain():\n    assert 1 == 2\n")
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    assert "known failure" not in result.stdout.str()
