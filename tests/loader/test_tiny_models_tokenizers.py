"""The tiny checkpoints' tokenizer files: every tokenizer class loads them offline, the slow ones included
(transformers 4.x's sentencepiece ``LlamaTokenizer``, the BPE ``Qwen2Tokenizer``), with ids inside the
checkpoint's vocabulary and the fast tokenizer's bos/eos."""

import json

import pytest
from packaging.version import Version

from pytest_llmload.loader.tiny_models import BOS, EOS, TOKENIZER_FILES, build_sentencepiece_model, config_dict, copy_tokenizer

pytestmark = pytest.mark.timeout(180)

TEXT = "The model was loaded with device_map auto, 42 layers on the cpu: Ünïcode 日本語 too."


def _transformers_major() -> int:
    import transformers

    return Version(transformers.__version__).major


def _fast(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _assert_consistent(tokenizer, fast, path):
    vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
    ids = tokenizer(TEXT)["input_ids"]
    assert ids and all(0 <= i < vocab_size for i in ids), (type(tokenizer).__name__, ids)
    assert (tokenizer.bos_token, tokenizer.eos_token) == (BOS, EOS)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (fast.bos_token_id, fast.eos_token_id) == (0, 1)
    assert tokenizer.pad_token_id is None or type(tokenizer).__name__.startswith("Qwen2")  # Qwen2's class default
    return ids


def test_the_checkpoint_ships_the_files_of_every_tokenizer_class(llmload_checkpoint_factory):
    for arch in ("llama", "qwen2"):
        path = llmload_checkpoint_factory(arch)
        names = {p.name for p in path.iterdir()}
        assert {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt"} <= names
        assert names & set(TOKENIZER_FILES) == {n for n in TOKENIZER_FILES if (path / n).is_file()}


def test_copy_tokenizer_carries_the_slow_tokenizers_files(llmload_checkpoint, tmp_path):
    # A derived checkpoint (a stage-1 save, an adapter folder) keeps what AutoTokenizer.save_pretrained would drop.
    from transformers import LlamaTokenizer

    dest = copy_tokenizer(llmload_checkpoint, tmp_path / "derived")
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt"):
        assert (dest / name).read_bytes() == (llmload_checkpoint / name).read_bytes()
    copied = LlamaTokenizer.from_pretrained(dest, local_files_only=True)
    original = LlamaTokenizer.from_pretrained(llmload_checkpoint, local_files_only=True)
    assert copied(TEXT)["input_ids"] == original(TEXT)["input_ids"]


@pytest.mark.parametrize("kwargs", [{}, {"legacy": False}], ids=["default", "legacy-false"])
def test_slow_llama_tokenizer_loads_the_tiny_checkpoint_offline(llmload_checkpoint, kwargs):
    # On transformers 4.x LlamaTokenizer is the sentencepiece one: it needs tokenizer.model (and protobuf for
    # legacy=False), and round-trips the text. On 5.x it is tokenizers-backed: it takes tokenizer.json's byte-level
    # vocabulary under Llama's own Metaspace pre-tokenizer, which loads and encodes but drops spaces on decode.
    from transformers import LlamaTokenizer

    tokenizer = LlamaTokenizer.from_pretrained(llmload_checkpoint, local_files_only=True, **kwargs)
    ids = _assert_consistent(tokenizer, _fast(llmload_checkpoint), llmload_checkpoint)
    if _transformers_major() < 5:
        assert type(tokenizer).__name__ == "LlamaTokenizer" and len(tokenizer) <= tokenizer.vocab_size
        assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT


def test_slow_to_fast_conversion_of_the_llama_tokenizer_loads(llmload_checkpoint):
    from transformers import LlamaTokenizerFast

    tokenizer = LlamaTokenizerFast.from_pretrained(llmload_checkpoint, from_slow=True, local_files_only=True)
    _assert_consistent(tokenizer, _fast(llmload_checkpoint), llmload_checkpoint)


@pytest.mark.parametrize("kwargs", [{}, {"tokenizer_type": "llama"}], ids=["config", "tokenizer-type-llama"])
def test_auto_tokenizer_use_fast_false_loads_the_tiny_checkpoint(llmload_checkpoint, kwargs):
    # The plain call follows tokenizer_config.json's class (the fast one, which has no slow twin); qlora's
    # tokenizer_type="llama" asks for LlamaTokenizer, the sentencepiece one on 4.x (5.x has no such type).
    from transformers import AutoTokenizer

    if kwargs and _transformers_major() >= 5:
        pytest.skip("transformers 5 has no tokenizer_type 'llama' (its slow tokenizer classes are gone)")
    tokenizer = AutoTokenizer.from_pretrained(llmload_checkpoint, use_fast=False, local_files_only=True, **kwargs)
    _assert_consistent(tokenizer, _fast(llmload_checkpoint), llmload_checkpoint)


def test_slow_qwen2_tokenizer_loads_the_tiny_checkpoint_with_the_fast_ids(llmload_checkpoint_factory):
    from transformers import Qwen2Tokenizer

    path = llmload_checkpoint_factory("qwen2")
    tokenizer = Qwen2Tokenizer.from_pretrained(path, local_files_only=True)
    fast = _fast(path)
    _assert_consistent(tokenizer, fast, path)
    words = "the quick brown fox jumps over the lazy dog"  # no digits: Qwen2 splits them one by one, ByteLevel not
    assert tokenizer(words)["input_ids"] == fast(words)["input_ids"]


def test_the_sentencepiece_model_is_deterministic_and_inside_the_vocabulary(llmload_checkpoint):
    import sentencepiece as spm

    vocab_size = config_dict("llama")["vocab_size"]
    model = build_sentencepiece_model(vocab_size)
    assert model == build_sentencepiece_model(vocab_size) == (llmload_checkpoint / "tokenizer.model").read_bytes()
    sp = spm.SentencePieceProcessor(model_proto=model)
    assert sp.get_piece_size() <= vocab_size
    assert (sp.bos_id(), sp.eos_id(), sp.id_to_piece(0), sp.id_to_piece(1)) == (0, 1, BOS, EOS)
    assert sp.unk_id() == 2 and sp.pad_id() == -1
    assert sp.decode(sp.encode(TEXT)) == TEXT  # byte fallback: nothing is unknown
