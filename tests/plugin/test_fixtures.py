"""The plugin's fixtures: tiny checkpoints, the loader seam, lora_model, gpu_model, offline mode."""

import json
import socket

import pytest

from pytest_llmload import LoadRequest
from pytest_llmload.system.offline import NetworkAccessBlocked, network_guard
from pytest_llmload.loader.tiny_models import ARCHS, shard_files

pytestmark = pytest.mark.timeout(180)


def test_checkpoint_is_sharded_safetensors_with_a_local_tokenizer(llmload_checkpoint):
    shards = shard_files(llmload_checkpoint)
    assert len(shards) >= 3, [s.name for s in shards]
    index = json.loads((llmload_checkpoint / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert (llmload_checkpoint / "tokenizer.json").is_file()
    assert not list(llmload_checkpoint.glob("*.bin")), "weights must be safetensors, not pickles"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tiny_arch_loads_and_generates_through_the_reference_loader(llmload_checkpoint_factory, llmload_loader, arch):
    import torch

    model, tokenizer = llmload_loader(LoadRequest(llmload_checkpoint_factory(arch)))
    assert model.config.model_type == arch
    batch = tokenizer(["hello world"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, batch["input_ids"].shape[1] + 4)


def test_same_seed_same_weights_other_seed_other_weights(llmload_checkpoint_factory, tmp_path):
    from safetensors.torch import load_file

    from pytest_llmload.loader.tiny_models import build_tiny_checkpoint

    again = build_tiny_checkpoint(tmp_path / "again", "llama", seed=0)
    other = build_tiny_checkpoint(tmp_path / "other", "llama", seed=1)
    first = load_file(shard_files(llmload_checkpoint_factory("llama"))[0])
    name = next(iter(first))
    assert load_file(shard_files(again)[0])[name].equal(first[name])
    assert not load_file(shard_files(other)[0])[name].equal(first[name])


def test_checkpoint_tokenizer_has_no_pad_token_but_the_reference_loader_sets_one(llmload_tokenizer, llmload_load):
    assert llmload_tokenizer.pad_token_id is None  # as write-up 000's checkpoint
    model, tokenizer = llmload_load()
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.eos_token_id


def test_lora_model_trains_only_adapters_and_every_one_gets_a_gradient(lora_model, llmload_tokenizer):
    import torch

    trainable = {n: p for n, p in lora_model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable), sorted(trainable)[:5]
    batch = llmload_tokenizer(["the quick brown fox"], return_tensors="pt")
    batch = {k: v.to(lora_model.device) for k, v in batch.items()}
    lora_model(**batch, labels=batch["input_ids"]).loss.backward()
    missing = [n for n, p in trainable.items() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"{len(missing)} of {len(trainable)} adapter weights got no finite gradient: {missing[:3]}"


def test_gpu_model_is_on_cuda(gpu_model):
    assert {p.device.type for p in gpu_model.parameters()} == {"cuda"}


def test_gpu_tests_skip_on_a_cpu_runner_before_anything_heavy_is_imported(pytester, monkeypatch):
    # `pytest -m gpu` on a runner without GPUs: a test using gpu_model, a needs_gpus test and a GPU check skip
    # at setup, before their fixtures build a checkpoint (which imports torch and transformers).
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    pytester.makeconftest("""
        import sys

        def pytest_sessionfinish(session):
            print("heavy imported:", sorted(m for m in ("torch", "transformers") if m in sys.modules))
    """)
    pytester.makepyfile("""
        import pytest
        from pytest_llmload.plugin.parametrize import check_params
        from pytest_llmload.failures import REGISTRY

        def test_on_gpu(gpu_model):
            pass

        @pytest.mark.needs_gpus(1)
        def test_needs_a_gpu(llmload_checkpoint):
            pass

        @pytest.mark.parametrize("check", check_params(checks=[c for c in REGISTRY if c.needs_gpus][:1]))
        def test_gpu_check(check, llmload_loader, llmload_checkpoint, tmp_path):
            check(llmload_loader, llmload_checkpoint, tmp_path)
    """)
    result = pytester.runpytest_subprocess("-m", "gpu", "-s", "-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines(["*heavy imported: []", "*gpu_model needs 1 GPU, 0 visible*"])


def test_network_guard_names_who_tried_and_lets_loopback_through():
    def reach_the_hub():
        socket.create_connection(("203.0.113.7", 443), timeout=1)

    with network_guard():
        with pytest.raises(NetworkAccessBlocked, match=r"to \('203\.0\.113\.7', 443\) from reach_the_hub \(.*test_fixtures\.py:\d+\)"):
            reach_the_hub()
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen()
        socket.create_connection(server.getsockname(), timeout=1).close()
        server.close()


def test_llmload_fixtures_run_offline(pytester):
    pytester.makepyfile("""
        import os, socket
        import huggingface_hub.constants

        def test_offline(llmload_checkpoint):
            assert os.environ["HF_HUB_OFFLINE"] == "1"
            assert huggingface_hub.constants.HF_HUB_OFFLINE is True
            socket.create_connection(("huggingface.co", 443), timeout=1)
    """)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*NetworkAccessBlocked: pytest-llmload blocked a network connection to "
                                 "('huggingface.co', 443) from test_offline (*): llmload fixtures and checks run "
                                 "offline (HF_HUB_OFFLINE=1)*"])


def test_a_hub_id_fails_offline_with_the_blocked_or_offline_error(llmload_loader):
    with pytest.raises(Exception) as info:
        llmload_loader(LoadRequest("some-org/some-model-that-would-download"))
    assert "offline" in str(info.value).lower() or "local" in str(info.value).lower(), str(info.value)


def test_fixtures_are_documented(pytester):
    result = pytester.runpytest("--fixtures")
    for name in ("llmload_checkpoint", "llmload_checkpoint_factory", "llmload_loader", "llmload_load", "gpu_model",
                 "lora_model", "distributed_env", "llmload_offline", "llmload_device", "llmload_tokenizer"):
        result.stdout.fnmatch_lines([f"{name}*", "    *"])


def test_the_tiny_llamas_numbers_are_what_the_tests_expect(llmload_checkpoint, tmp_path):
    """fixtures/tiny_llama.py declares them once; here they are measured."""
    from fixtures import tiny_llama
    from fixtures.loaders import before_meta_backward
    from pytest_llmload import LoadRequest, call_loader
    from pytest_llmload.fixes.training_memory import checkpoint_tensors
    from pytest_llmload.checks.ground_truth import offload_budget

    tensors = checkpoint_tensors(llmload_checkpoint)
    assert (len(tensors), sum(t.nbytes for t in tensors)) == (tiny_llama.PARAMETERS, tiny_llama.WEIGHT_BYTES)
    assert offload_budget(llmload_checkpoint) == {"cpu": tiny_llama.HALF_BUDGET}
    model = call_loader(before_meta_backward.load, LoadRequest(
        llmload_checkpoint, purpose="train", lora=True, max_memory={"cpu": tiny_llama.HALF_BUDGET},
        offload_folder=tmp_path / "offload")).model
    params = dict(model.named_parameters())
    lora = [name for name in params if "lora_" in name]
    on_meta = [name for name, p in params.items() if p.device.type == "meta"]
    assert len(lora) == tiny_llama.LORA_WEIGHTS
    assert len(on_meta) == tiny_llama.OFFLOADED + tiny_llama.LORA_WEIGHTS_ON_META
