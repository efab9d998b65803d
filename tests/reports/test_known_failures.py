"""Known failures are named in the failure report, from the real errors (produced here, not typed in)."""

import pytest

from pytest_llmload import failures as catalog

pytestmark = pytest.mark.timeout(120)


def test_catalog_has_every_write_up_and_cites_the_field_reports_of_the_rest():
    import re

    seeds = {f.write_up for f in catalog.CATALOG if f.write_up.startswith("seeds/")}
    assert seeds == {
        f"seeds/{name}" for name in (
            "000_90648e437c1c073a.txt", "001_8385e6bc387e2557.txt", "002_3bbec781721991d8.txt",
            "003_b296b1821f4bec50.txt", "004_e47582475487edd3.txt")
    }
    for failure in catalog.CATALOG:
        assert failure.signatures and failure.root_cause and failure.fix and failure.occurs, failure.id
        if not failure.write_up.startswith("seeds/"):  # taken from issue trackers: repository and number
            assert re.fullmatch(r"[\w.-]+/[\w.-]+#\d+(, [\w.-]+/[\w.-]+#\d+)*(.*)?", failure.write_up), failure.write_up


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

        @pytest.mark.timeout(1.5, method="signal")  # (the load reaches the shards in ~0.1 s)
        def test_load_blocks(monkeypatch):
            def blocked_shard_open(*args, **kwargs):
                threading.Event().wait()  # a shard read that never returns
            # modeling_utils opens every shard through its own safe_open reference
            monkeypatch.setattr(transformers.modeling_utils, "safe_open", blocked_shard_open)
            AutoModelForCausalLM.from_pretrained({str(llmload_checkpoint)!r})
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*Timeout (>1.5s) from pytest-timeout*", "[[]offload-hang[]] *"])
    assert "[inference-stall]" not in result.stdout.str()


def test_unrelated_failure_gets_no_section(pytester):
    pytester.makepyfile("def test_plain():\n    assert 1 == 2\n")
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    assert "known failure" not in result.stdout.str()


def test_meta_backward_from_a_real_offloaded_lora_model_names_meta_backward(pytester, llmload_checkpoint, request):
    # The write-up 002 setup, for real: device_map="auto" with a budget that offloads, LoRA, backward.
    pytester.syspathinsert(request.config.rootpath)
    pytester.makepyfile(f"""
        from fixtures.loaders import before_meta_backward
        from pytest_llmload import LoadRequest
        from pytest_llmload.checks.ground_truth import offload_budget

        def test_train_offloaded(tmp_path):
            ckpt = {str(llmload_checkpoint)!r}
            model, tokenizer = before_meta_backward.load(LoadRequest(
                ckpt, purpose="train", lora=True, max_memory=offload_budget(ckpt), offload_folder=tmp_path))
            batch = tokenizer(["hello world"], return_tensors="pt")
            model(**batch, labels=batch["input_ids"]).loss.backward()
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "E * Function MmBackward0 returned an invalid gradient at index 1 - expected device meta but got cpu*",
        "*- llmload: known failure -*",
        "[[]meta-backward[]] backward through a model with offloaded (meta) parameters",
        "  write-up:   seeds/002_3bbec781721991d8.txt",
    ])


@pytest.mark.llmload_deepspeed
def test_distributed_device_map_from_real_ranks_names_distributed_device_map(pytester, llmload_checkpoint, request):
    # Write-up 004, for real: two gloo ranks, accelerate in MULTI_CPU mode, the always-device_map loader.
    pytester.syspathinsert(request.config.rootpath)
    pytester.makepyfile(f"""
        from fixtures.loaders import before_distributed_device_map
        from pytest_llmload.failures.distributed_device_map import check_distributed_train_step

        def test_prepare_on_two_ranks(tmp_path):
            check_distributed_train_step(before_distributed_device_map.load, {str(llmload_checkpoint)!r}, tmp_path,
                                         modes=("ddp",))
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*You can't train a model that has been loaded with `device_map='auto'` in any distributed mode*",
        "[[]distributed-device-map[]] device_map='auto' under DeepSpeed or another distributed launcher",
    ])
