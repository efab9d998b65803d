"""Write-up 001 (inference-stall): generate() on an offloaded model looks like a hang.

There is no loader bug to catch, so no check: what is tested is that the before setup really streams offloaded
weights during generate, and that a deadline hit inside generate is named as this failure (not as 000's load
"hang"), with the phase that was running.
"""

import pytest

from fixtures.loaders import before_inference_stall
from pytest_llmload import LoadRequest, call_loader
from pytest_llmload.checks.ground_truth import offload_budget

pytestmark = pytest.mark.timeout(120)


def test_the_before_setup_generates_through_offloaded_weights(llmload_checkpoint, tmp_path):
    import torch

    request = LoadRequest(llmload_checkpoint, max_memory=offload_budget(llmload_checkpoint),
                          offload_folder=tmp_path / "offload")
    model = call_loader(before_inference_stall.load, request).model
    assert {"cpu", "disk"} <= set(map(str, model.hf_device_map.values())), model.hf_device_map
    loads = []
    for module in model.modules():  # accelerate's hook reads a disk-offloaded weight back at every forward
        hook = getattr(module, "_hf_hook", None)
        if getattr(hook, "offload", False):
            module.register_forward_pre_hook(lambda *_: loads.append(1))
    model.generate(input_ids=torch.tensor([[2, 3, 4]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert len(loads) >= 3 * 2, "every new token should stream the offloaded layers again"
    assert before_inference_stall.MAX_NEW_TOKENS == 2000


def test_a_deadline_hit_inside_generate_names_inference_stall(pytester, llmload_checkpoint, request):
    pytester.syspathinsert(request.config.rootpath)
    pytester.makepyfile(f"""
        import time
        import pytest
        import torch
        from fixtures.loaders import before_inference_stall
        from pytest_llmload import LoadRequest, call_loader
        from pytest_llmload.instruments.phases import phase
        from pytest_llmload.checks.ground_truth import offload_budget

        @pytest.mark.timeout(2, method="signal")  # (the load takes ~0.3 s: the deadline passes in generate)
        def test_generate_stalls(tmp_path):
            ckpt = {str(llmload_checkpoint)!r}
            model = call_loader(before_inference_stall.load, LoadRequest(
                ckpt, max_memory=offload_budget(ckpt), offload_folder=tmp_path)).model
            # each token streams offloaded weights; on a 70B model that is seconds a token, here a sleep
            model.model.layers[-1].register_forward_pre_hook(lambda *_: time.sleep(0.5))
            with phase("generate", max_new_tokens=before_inference_stall.MAX_NEW_TOKENS):
                model.generate(input_ids=torch.tensor([[2, 3, 4]]), do_sample=False,
                               max_new_tokens=before_inference_stall.MAX_NEW_TOKENS)
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["[[]inference-stall[]] generate() appears to hang on an offloaded model",
                                 "*- llmload: phases -*",
                                 ">  generate (max_new_tokens=2000) * raised Failed: Timeout (>2.0s) from pytest-timeout*"])
    assert "[offload-hang]" not in result.stdout.str()
