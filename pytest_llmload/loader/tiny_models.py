"""Tiny real checkpoints, built locally: configs shipped in this package, a tokenizer trained here.

A checkpoint is what a real one is: ``config.json``, several safetensors shards with an index,
``generation_config.json`` and a tokenizer every tokenizer class can load: the fast one (``tokenizer.json``), its
byte-level BPE as ``vocab.json`` + ``merges.txt`` (the slow GPT-2/Qwen2 classes) and a SentencePiece
``tokenizer.model`` (the slow ``LlamaTokenizer``, which on transformers 4.x is the sentencepiece one). Nothing comes
from a hub. The tokenizer has no pad token, like the checkpoints of write-up 000, so a loader's pad-token handling
is exercised.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
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


def build_sentencepiece_model(vocab_size: int) -> bytes:
    """A SentencePiece BPE model (a serialized ``ModelProto``, the bytes of a ``tokenizer.model``) trained on the
    same built-in corpus, laid out as Llama's: byte fallback (``<0x00>``..``<0xFF>``), digits split, no
    normalization. Its special ids are the fast tokenizer's: bos 0, eos 1 (the tiny configs' ``bos_token_id``,
    ``eos_token_id``), then its ``<unk>`` at 2 (the fast tokenizer has none). At most ``vocab_size`` pieces, so
    every id it gives is an embedding row; ``vocab_size`` must be at least 310 (the 3 specials, 256 bytes and the
    corpus's characters; sentencepiece refuses fewer). The same bytes every run (one thread; sentencepiece 0.2.0,
    0.2.1 and 0.2.3 alike), in about 10 ms."""
    import io
    import warnings

    with warnings.catch_warnings():  # sentencepiece 0.2.1's SWIG types: "builtin type SwigPyPacked has no __module__"
        warnings.filterwarnings("ignore", "builtin type .*Swig", DeprecationWarning)
        import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_CORPUS), model_writer=model, model_type="bpe", vocab_size=vocab_size,
        hard_vocab_limit=False,  # the corpus is small: fewer pieces than asked rather than an error
        bos_id=0, eos_id=1, unk_id=2, pad_id=-1, bos_piece=BOS, eos_piece=EOS, unk_piece="<unk>",
        byte_fallback=True, split_digits=True, character_coverage=1.0, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", add_dummy_prefix=True, remove_extra_whitespaces=False,
        num_threads=1, minloglevel=2,
    )
    return model.getvalue()


def save_tokenizer(tokenizer, dest: os.PathLike | str, vocab_size: int) -> None:
    """Save ``tokenizer`` (from ``build_tokenizer``) to ``dest`` with the files of the slow tokenizer classes beside
    it: ``vocab.json`` + ``merges.txt`` (its own BPE, same ids) and ``tokenizer.model`` (``build_sentencepiece_model``),
    the latter only where sentencepiece is installed (the ``hf`` extra installs it; without it transformers 4.x's
    ``LlamaTokenizer`` refuses with its own error naming sentencepiece, and the fast tokenizer is unaffected)."""
    dest = Path(dest)
    tokenizer.save_pretrained(dest)
    tokenizer.backend_tokenizer.model.save(str(dest))  # vocab.json, merges.txt
    try:
        model = build_sentencepiece_model(vocab_size)
    except ImportError:
        return
    (dest / "tokenizer.model").write_bytes(model)


# Every tokenizer file a tiny checkpoint has (``save_tokenizer``); ``copy_tokenizer`` carries them all.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt")


def copy_tokenizer(checkpoint: os.PathLike | str, dest: os.PathLike | str) -> Path:
    """Copy a tiny checkpoint's tokenizer files to ``dest`` (a derived checkpoint, an adapter folder), byte for byte.

    ``AutoTokenizer.from_pretrained(checkpoint).save_pretrained(dest)`` writes only the fast tokenizer's files: the
    slow classes' ``tokenizer.model``, ``vocab.json`` and ``merges.txt`` would be lost, and transformers 4.x's
    ``LlamaTokenizer`` then fails in sentencepiece with a bare ``TypeError: not a string``. Returns ``dest``."""
    import shutil

    src, dest = Path(checkpoint), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)
    return dest


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
    from pytest_llmload.loader.request import DTYPES

    _check_tokenizers_can_write(Path(dest))
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
    save_tokenizer(tokenizer, dest, raw["vocab_size"])
    return dest


class CheckpointPathError(ValueError):
    """A tiny checkpoint's folder that the tokenizers library would write elsewhere, or not at all."""


def _check_tokenizers_can_write(dest: Path) -> None:
    """tokenizers (Rust) takes a path as UTF-8 text, and Python gives it the file name as the locale decoded it:
    under ``LANG=C`` with Python's UTF-8 mode off, or a Latin-1 locale, a non-ASCII folder is then a
    ``UnicodeEncodeError`` deep in ``save_pretrained``, or a file written under another name. Loading the
    tokenizer from there fails the same way, so the fix is the process's locale, said here once."""
    text = str(dest)
    with contextlib.suppress(UnicodeEncodeError):  # (a name Python could not decode holds surrogates: no UTF-8)
        if text.encode("utf-8") == os.fsencode(text):
            return
    shown = ascii(os.fsencode(text).decode("utf-8", "replace"))  # (in ASCII: this process's output may be no more)
    locale = next((f"{name}={os.environ[name]}" for name in ("LC_ALL", "LC_CTYPE", "LANG") if os.environ.get(name)),
                  "no LANG")
    raise CheckpointPathError(
        f"the tiny checkpoint's folder {shown} is not UTF-8 text in this process: its locale ({locale}) makes "
        f"Python read file names as {sys.getfilesystemencoding()!r}, and the tokenizers library takes paths only as "
        "UTF-8, so no tokenizer can be saved or loaded there; run with PYTHONUTF8=1 (or LC_ALL=C.UTF-8), or give "
        "pytest a temp dir in ASCII (TMPDIR, or --basetemp).")


def shard_files(checkpoint: os.PathLike | str) -> list[Path]:
    """The safetensors shards of a checkpoint directory, in order."""
    return sorted(Path(checkpoint).glob("*.safetensors"))
