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


def load_config(name_or_path: Union[str, Path], *, source: str = "--model") -> dict:
    """The config of a shipped architecture by name (``llama-3-70b``), or of a local ``config.json`` (or the
    directory holding one); keys starting with ``_`` (the shipped ones' source notes) are left out."""
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
    return {k: v for k, v in config.items() if not k.startswith("_")}


# The largest architecture a prediction plans (about 10 trillion parameters: far beyond any published model) and the
# largest of the sizes a model's buffers are made from (rotary tables, masks), checked before anything is built.
MAX_PARAMETERS = 10**13
MAX_DIMENSION = 10**8
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "max_position_embeddings",
          "num_attention_heads", "num_key_value_heads", "num_local_experts", "moe_intermediate_size", "head_dim")


def _check_sizes(config: dict) -> None:
    """``ValueError`` for a config whose sizes no real model has: each size below :data:`MAX_DIMENSION`, and the
    parameters a decoder of those sizes holds (embeddings, attention, MLP per expert) below :data:`MAX_PARAMETERS`."""
    sizes = {}
    for key in _SIZES:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_DIMENSION:
            raise ValueError(f"{key}={value!r} is not a size a model has (a whole number up to {MAX_DIMENSION:,})")
        sizes[key] = value
    hidden, layers = sizes.get("hidden_size", 0), sizes.get("num_hidden_layers", 0)
    mlp = sizes.get("moe_intermediate_size") or sizes.get("intermediate_size", 4 * hidden)
    experts = max(1, sizes.get("num_local_experts", 1))
    estimate = 2 * sizes.get("vocab_size", 0) * hidden + layers * (4 * hidden * hidden + 3 * hidden * mlp * experts)
    if estimate > MAX_PARAMETERS:
        raise ValueError(f"its sizes make about {estimate:.3g} parameters, more than the {MAX_PARAMETERS:.0e} a "
                         "prediction plans")


def empty_model(config: dict, dtype: Any, *, quantizer: Any = None, device_map: Any = None) -> Any:
    """The model of ``config`` built on meta in ``dtype`` (tied weights tied, as from_pretrained leaves them), its
    layers replaced by the quantizer's own where ``quantizer`` (a transformers ``HfQuantizer``) is given."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from pytest_llmload.loader.transformers_compat import quantize_empty_model

    fields = dict(config)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields), dtype=dtype)
    model.tie_weights()
    if quantizer is not None:
        quantize_empty_model(model, quantizer, dtype, device_map)
    return model


def write_checkpoint_dir(config: dict, dest: Path, model: Any = None) -> Path:
    """A directory a loader can be pointed at: the config, a locally built tokenizer and, for ``model`` (built
    empty), a safetensors header naming every weight with no data after it (what the memory estimates and budget
    checks read). Nothing can load weights from it: the loader's ``from_pretrained`` is intercepted first."""
    from pytest_llmload.loader.tiny_models import build_tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
    build_tokenizer(min(int(config.get("vocab_size", 512)), 512)).save_pretrained(dest)
    if model is not None:
        _write_header_only_safetensors(model, dest / "model.safetensors")
    return dest


_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "uint8": "U8", "int8": "I8"}


def _write_header_only_safetensors(model: Any, path: Path) -> None:
    import struct

    header, offset = {}, 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES.get(str(p.dtype).removeprefix("torch."), "F32"),
                        "shape": list(p.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)


def parameter_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters())


def describe(config: dict, name: Optional[str] = None) -> str:
    layers = config.get("num_hidden_layers", "?")
    return f"{name or config.get('model_type')} ({config.get('model_type')}, {layers} layers)"
