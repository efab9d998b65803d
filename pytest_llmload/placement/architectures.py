"""Real architectures at full size, without weights: the public ``config.json`` of each shipped model, or any local
``config.json``, built on the meta device (``init_empty_weights``): nothing is downloaded, nothing allocated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

SHIPPED = Path(__file__).parent / "architectures"
DEFAULT = "llama-3-8b"  # the predictions' architecture where --model (or the ini key) names none


class ArchitectureError(ValueError):
    """A model name that is not shipped, or a config that cannot be read; the message says what to do."""


def shipped_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def load_config(name_or_path: Union[str, Path], *, source: str = "--model", build: bool = False) -> dict:
    """The config of a shipped architecture by name (``llama-3-70b``), or of a local ``config.json`` (or the
    directory holding one); keys starting with ``_`` (the shipped ones' source notes) are left out.

    Its sizes are checked (:func:`_check_sizes`) before anything is built; with ``build``, the model is built empty
    too, as every prediction will build it, so that a value transformers refuses is the run's usage error, naming the
    file and the field (:class:`ArchitectureError`), and not an error on every row."""
    text = str(name_or_path)
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    elif not text.endswith(".json"):
        path = SHIPPED / f"{text}.json"
    if not path.is_file():
        raise ArchitectureError(f"{source} {text!r} is neither a shipped architecture ({', '.join(shipped_names())}) "
                                "nor a config.json (or a directory holding one); pass one of those.")
    from pytest_llmload.placement.profiles import read_small_json

    try:
        config = read_small_json(path)
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError("it has no model_type")
        _check_sizes(config)
    except (OSError, ValueError) as exc:
        raise ArchitectureError(f"{source} {text!r}: {path} is not a transformers config ({exc}).") from None
    fields = {k: v for k, v in config.items() if not k.startswith("_")}
    if build:
        _check_builds(fields, f"{source} {text!r}: {path}")
    return fields


# The largest architecture a prediction plans (about 10 trillion parameters: far beyond any published model), the
# largest of the sizes a model's buffers are made from (rotary tables, masks), and the most layers and experts
# (the deepest published decoders have under 200 layers; the most experts, Kimi K2's, 61 x 384 = 23,424): checked
# before anything is built, each module of which takes time even on meta.
MAX_PARAMETERS = 10**13
MAX_DIMENSION = 10**8
MAX_LAYERS = 1000
MAX_EXPERT_MODULES = 2**15
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "max_position_embeddings",
          "num_attention_heads", "num_key_value_heads", "moe_intermediate_size", "head_dim", *_EXPERTS)


def _check_sizes(config: dict) -> None:
    """``ValueError`` for a config whose sizes no real model has: each size a whole number from 1 to
    :data:`MAX_DIMENSION`, heads that divide as attention needs, at most :data:`MAX_LAYERS` layers and
    :data:`MAX_EXPERT_MODULES` experts in all, and the parameters a decoder of those sizes holds (embeddings,
    attention, MLP per expert) below :data:`MAX_PARAMETERS`."""
    sizes = {}
    for key in _SIZES:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIMENSION:
            raise ValueError(f"{key}={value!r} is not a size a model has (a whole number from 1 to "
                             f"{MAX_DIMENSION:,})")
        sizes[key] = value
    hidden, layers = sizes.get("hidden_size", 0), sizes.get("num_hidden_layers", 0)
    heads, kv_heads = sizes.get("num_attention_heads"), sizes.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads} (each "
                         "key/value head serves a whole group of attention heads)")
    if heads and hidden and "head_dim" not in sizes and hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads}, and no head_dim "
                         "says otherwise")
    experts = max([1] + [sizes[key] for key in _EXPERTS if key in sizes])
    mlp = sizes.get("moe_intermediate_size") or sizes.get("intermediate_size", 4 * hidden)
    estimate = 2 * sizes.get("vocab_size", 0) * hidden + layers * (4 * hidden * hidden + 3 * hidden * mlp * experts)
    if estimate > MAX_PARAMETERS:
        raise ValueError(f"its sizes make about {estimate:.3g} parameters, more than the {MAX_PARAMETERS:.0e} a "
                         "prediction plans")
    if layers > MAX_LAYERS:
        raise ValueError(f"num_hidden_layers={layers} is more layers than any model has (at most {MAX_LAYERS:,} "
                         "here)")
    if layers * experts > MAX_EXPERT_MODULES:
        raise ValueError(f"num_hidden_layers={layers} with {experts} experts each is {layers * experts:,} experts, "
                         f"more than any model has (at most {MAX_EXPERT_MODULES:,} here)")


def _check_builds(config: dict, where: str) -> None:
    """:class:`ArchitectureError` where the installed transformers cannot build ``config``'s model empty: the
    user's config, named with the field the refusal points at where one can be found."""
    from importlib import metadata

    import torch
    from transformers import CONFIG_MAPPING

    version = f"transformers {metadata.version('transformers')}"
    model_type = config["model_type"]
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ArchitectureError(f"{where}: model_type={model_type!r} is not an architecture {version} knows; a "
                                "newer transformers may know it, or the field is misspelt.")
    try:
        empty_model(config, torch.bfloat16)
    except Exception as exc:  # whatever transformers raises about the config is the config's to fix
        fields = _fields_named(exc, config)
        named = f" (the field{'s' if len(fields) > 1 else ''} {', '.join(fields)})" if fields else ""
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [""]
        cut = next((n for n, line in enumerate(lines) if not line.endswith(":")), len(lines) - 1)
        message = " ".join(lines[:cut + 1])  # the first line, and the cause where it ends in a colon
        message = message if len(message) <= 300 else message[:299] + "\u2026"
        raise ArchitectureError(f"{where}: {version} cannot build a model from this config{named}: "
                                f"{type(exc).__name__}: {message}. Fix the config, or pass another.") from None


def _fields_named(exc: BaseException, config: dict) -> list[str]:
    """``key=value`` for each field of ``config`` (nested ones dotted) that ``exc`` names: its value is the
    exception's argument (a ``KeyError`` for an unknown activation), or the key or the text value is quoted in it."""
    text = str(exc)
    found = []

    def visit(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                visit(f"{prefix}.{key}" if prefix else str(key), inner)
            return
        key = prefix.rpartition(".")[2]
        quoted = isinstance(value, str) and value and (value in exc.args or repr(value) in text)
        if quoted or f"'{key}'" in text or f"`{key}`" in text:
            found.append(f"{prefix}={value!r}")

    visit("", config)
    return found


def empty_model(config: dict, dtype: Any, *, quantizer: Any = None, device_map: Any = None) -> Any:
    """The model of ``config`` built on meta in ``dtype`` (tied weights tied, as from_pretrained leaves them), its
    layers replaced by the quantizer's own where ``quantizer`` (a transformers ``HfQuantizer``) is given.

    Every tensor is made on meta, buffers and the quantizer's layers included (a placement counts their bytes, not
    where they are): made on the host first and then moved, as ``init_empty_weights`` does with weights, each
    weight below glibc's mmap threshold would take its place in the heap, and the models kept for planning would
    leave it fragmented: 9.6 GiB of address space for the 8 shipped architectures on transformers 4.56, 19 GiB with
    their 4-bit builds (under 1 GiB made on meta), past which the process can no longer fork its checks' children."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from pytest_llmload.loader.transformers_compat import quantize_empty_model

    fields = dict(config)
    with torch.device("meta"), init_empty_weights(include_buffers=True):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=dtype)
        model.tie_weights()
        if quantizer is not None:
            quantize_empty_model(model, quantizer, dtype, device_map)
    return model


# The header-only weights file, and the index that names it: sharded, so that from_pretrained goes as far as placing
# the model without opening the file (a single model.safetensors is opened first, and refused for its missing data).
SHARD = "model-00001-of-00001.safetensors"
INDEX = "model.safetensors.index.json"


def write_checkpoint_dir(config: dict, dest: Path, model: Any = None) -> Path:
    """A directory a loader can be pointed at: the config, a locally built tokenizer and, for ``model`` (built
    empty), a safetensors header naming every weight with no data after it (what the memory estimates and budget
    checks read) and the index of a sharded checkpoint naming that file. Nothing can load weights from it: the
    loader's ``from_pretrained`` is intercepted first, or stopped once it has placed the model (the planner's
    test takes from_pretrained's own map so)."""
    from pytest_llmload.loader.tiny_models import build_tokenizer, save_tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    vocab = min(int(config.get("vocab_size", 512)), 512)
    save_tokenizer(build_tokenizer(vocab), dest, vocab)  # with the slow classes' files (4.x's LlamaTokenizer)
    if model is not None:
        total = _write_header_only_safetensors(model, dest / SHARD)
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: SHARD for name, _ in model.named_parameters()}}
        (dest / INDEX).write_text(json.dumps(index), encoding="utf-8")
    return dest


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint8": "U8", "int8": "I8"}


def _write_header_only_safetensors(model: Any, path: Path) -> int:
    """Writes the header; returns the bytes of data it names (none of which follow it)."""
    import struct

    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES.get(str(p.dtype).removeprefix("torch."), "F32"),
                        "shape": list(p.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)
    return offset


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def describe(config: dict, name: Optional[str] = None) -> str:
    layers = config.get("num_hidden_layers", "?")
    return f"{name or config.get('model_type')} ({config.get('model_type')}, {layers} layers)"
