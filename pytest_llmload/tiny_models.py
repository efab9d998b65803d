"""Tiny real checkpoints, built locally: configs shipped in this package, a tokenizer trained here.

A checkpoint is what a real one is: ``config.json``, several safetensors shards with an index,
``generation_config.json`` and a fast tokenizer. Nothing comes from a hub. The tokenizer has no pad token,
like the checkpoints of write-up 000, so a loader's pad-token handling is exercised.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

ARCHS = ("llama", "qwen2")
BOS, EOS = "<|bos|>", "<|eos|>"
DEFAULT_SHARDS = 4

# A few sentences to train the byte-level BPE on: the tokenizer only needs to be real, not good.
_CORPUS = [
    "The model was loaded with device_map auto and a max_memory budget.",
    "Some parameters are on the meta device because they were offloaded to the cpu.",
    "Loading checkpoint shards: the offload folder holds what did not fit.",
    "Gradient checkpointing saves activation memory during the backward pass.",
    "A LoRA adapter trains a few weights while the base model stays frozen.",
    "You can't train a model that has been loaded with device_map auto in any distributed mode.",
    "expected mat1 and mat2 to have the same dtype",
    "hello world, the quick brown fox jumps over the lazy dog 0123456789",
]


def config_dict(arch: str) -> dict:
    """The shipped config of a tiny architecture (``llama`` or ``qwen2``)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {', '.join(ARCHS)}.")
    text = resources.files("pytest_llmload").joinpath(f"configs/{arch}.json").read_text()
    return json.loads(text)


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on a built-in corpus, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    # The inputs of a causal LM, as Llama's and Qwen2's tokenizers declare them. transformers < 5 defaults
    # to ["input_ids", "token_type_ids", "attention_mask"], and generate(**tokenizer(...)) then refuses
    # the token_type_ids the model does not take.
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   model_input_names=["input_ids", "attention_mask"])


def build_tiny_checkpoint(
    dest: os.PathLike | str,
    arch: str = "llama",
    *,
    dtype: str = "float32",
    seed: int = 0,
    shards: int = DEFAULT_SHARDS,
) -> Path:
    """Build a tiny model from its shipped config with a fixed seed and save it sharded to ``dest``.

    Returns ``dest``. The same ``(arch, dtype, seed)`` gives the same weights, bit for bit::

        path = build_tiny_checkpoint(tmp_path / "llama")
        model = AutoModelForCausalLM.from_pretrained(path)
    """
    from pytest_llmload.request import DTYPES

    raw = config_dict(arch)
    if dtype not in DTYPES:  # before torch's own AttributeError
        raise ValueError(f"tiny checkpoint dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}.")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dest = Path(dest)
    config = AutoConfig.for_model(**raw)
    tokenizer = build_tokenizer(raw["vocab_size"])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.eval()
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # A shard limit just under total/shards yields `shards` (or one more) files, as a real sharded checkpoint.
    max_shard_size = max(1, total_bytes // shards + 1)
    model.save_pretrained(dest, max_shard_size=max_shard_size, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return dest


def shard_files(checkpoint: os.PathLike | str) -> list[Path]:
    """The safetensors shards of a checkpoint directory, in order."""
    return sorted(Path(checkpoint).glob("*.safetensors"))
