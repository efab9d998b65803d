"""Tiny weights for a model a command names: the real architecture's config found offline (a local folder's
``config.json``, a shipped architecture by its hub id, or the run's ``--model ID=CONFIG`` mapping), shrunk to a few
layers of a small width with the same module structure and dtype, and built once into a cache shared by runs.

The cache key is the real config, the shrunk one and the installed transformers' version: the same model named
twice, by two ranks or two runs, loads the same checkpoint, built by whichever process came first (built aside, then
renamed); beside it, its parameter count and the real model's (:func:`scaled_budget` scales a ``max_memory`` by
them).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from pytest_llmload.loader import tiny_models
from pytest_llmload.placement import architectures

CACHE_VARIABLE = "PYTEST_LLMLOAD_TINY_CACHE"
# The suffixes of a fine-tuned release of a shipped base model: the same architecture (only the chat template and the
# special tokens differ, which tiny weights do not keep anyway).
SAME_ARCHITECTURE_SUFFIXES = ("-Instruct", "-instruct", "-Chat", "-chat", "-hf", "-it")
# The sizes a tiny model takes (the shipped tiny llama's), each only where the real config has the field.
TINY_SIZES = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 64, "sliding_window": 64}
# Fields derived from the layer count, which the config rebuilds at its new size.
PER_LAYER_FIELDS = ("layer_types", "max_window_layers")
TOKENIZER_VOCABULARY = 320  # the tokenizer trained here (loader.tiny_models), and the tiny model's embeddings
MAX_POSITIONS = 4096
SIZES_FILE = "llmload-sizes.json"  # beside a tiny checkpoint: its parameters and the real model's


class UnmappedModel(OSError):
    """A model name this run cannot find a config for offline; the message names the call and the mapping to give.
    An ``OSError``, as transformers' own for a model it cannot find: a script that handles that one handles this."""


def cache_root() -> Path:
    explicit = os.environ.get(CACHE_VARIABLE)
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pytest-llmload" / "tiny-checkpoints"


def shipped_hub_ids() -> dict[str, str]:
    """``{hub id: shipped architecture}``, read from each shipped config's ``_source``."""
    ids = {}
    for name in architectures.shipped_names():
        source = json.loads((architectures.SHIPPED / f"{name}.json").read_text()).get("_source", "")
        ids[source.removesuffix(" config.json")] = name
    return ids


def real_config(name_or_path: str, mapping: dict[str, str], call: str) -> dict:
    """The full-size config ``name_or_path`` names: the mapping the run was given, a local folder's ``config.json``,
    or a shipped architecture by its hub id (or a fine-tuned release of one). ``call`` says where the name came from
    for the error (:class:`UnmappedModel`)."""
    given = mapping.get(name_or_path)
    if given is not None:
        return architectures.load_config(given, source=f"--model {name_or_path}=")
    if (Path(name_or_path) / "config.json").is_file():
        return architectures.load_config(name_or_path, source=call)
    ids = shipped_hub_ids()
    base = next((name_or_path.removesuffix(s) for s in SAME_ARCHITECTURE_SUFFIXES if name_or_path.endswith(s)), None)
    for candidate in (name_or_path, base):
        if candidate in ids:
            return architectures.load_config(ids[candidate])
    raise UnmappedModel(
        f"{call} names {name_or_path!r}, which pytest-llmload run cannot find offline: it is neither a local folder "
        f"with a config.json nor a shipped architecture's hub id ({', '.join(sorted(ids))}); map it to one with "
        f"--model {name_or_path}=llama-3-8b (a shipped name, --list-models lists them) or "
        f"--model {name_or_path}=path/to/config.json.")


def shrunk(config: dict) -> dict:
    """``config`` at tiny size: the same model type, architecture, dtype and tying, a few layers of a small width."""
    tiny = {key: value for key, value in config.items() if key not in PER_LAYER_FIELDS and not key.startswith("_")}
    for key, size in TINY_SIZES.items():
        if isinstance(tiny.get(key), int):
            tiny[key] = min(tiny[key], size)
    tiny["vocab_size"] = TOKENIZER_VOCABULARY
    tiny["bos_token_id"], tiny["eos_token_id"] = 0, 1  # the tokenizer's (loader.tiny_models)
    tiny.pop("pad_token_id", None)
    if isinstance(tiny.get("max_position_embeddings"), int):
        tiny["max_position_embeddings"] = min(tiny["max_position_embeddings"], MAX_POSITIONS)
    return tiny


def _key(real: dict, tiny: dict) -> str:
    """The cache's name for a tiny checkpoint: its config, the real one's (whose size scales the budgets), the
    transformers that saves it."""
    import transformers

    text = json.dumps({"real": real, "tiny": tiny, "transformers": transformers.__version__}, sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tiny_checkpoint(config: dict, root: Optional[Path] = None) -> Path:
    """The tiny checkpoint of the architecture ``config`` describes, built here on first use."""
    tiny = shrunk(config)
    root = root or cache_root()
    dest = root / f"{tiny.get('model_type', 'model')}-{_key(config, tiny)}"
    if (dest / SIZES_FILE).is_file():  # (written last: the checkpoint is whole)
        return dest
    return _built_once(root, dest, lambda building: _build(config, tiny, building))


def _built_once(root: Path, dest: Path, build) -> Path:
    """``dest`` in the cache ``root``, made by ``build(folder)`` in a folder of its own, then renamed into place:
    another rank or command building the same checkpoint at the same time never reads a half-written one."""
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
    try:
        build(building)
        try:
            os.rename(building, dest)
        except OSError:  # another process built it first: theirs is the same
            pass
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return dest


def _save(model, dest: Path) -> None:
    """The checkpoint's files, written by this process whatever its rank (transformers' ``save_pretrained`` writes
    only on rank 0 of an initialized process group, and each rank builds its own)."""
    from safetensors.torch import save_model

    model.config.save_pretrained(dest)
    model.generation_config.save_pretrained(dest)
    save_model(model, str(dest / "model.safetensors"), metadata={"format": "pt"})  # (tied weights once)


@contextlib.contextmanager
def _outside_zero3():
    """ZeRO-3 off meanwhile: a checkpoint built here (and the real model counted on meta) is not partitioned by
    DeepSpeed's ``zero.Init``, which transformers wraps every model build in while a ZeRO-3 config is alive (built
    under it, the real model's 7 billion parameters were materialized and partitioned: minutes)."""
    deepspeed = sys.modules.get("transformers.integrations.deepspeed")
    held = getattr(deepspeed, "_hf_deepspeed_config_weak_ref", None)
    if held is not None:
        deepspeed._hf_deepspeed_config_weak_ref = None
    try:
        yield
    finally:
        if held is not None:
            deepspeed._hf_deepspeed_config_weak_ref = held


def _build(real: dict, tiny: dict, dest: Path) -> None:
    with _outside_zero3():
        _build_model(real, tiny, dest)


def _build_model(real: dict, tiny: dict, dest: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = tiny.get("torch_dtype") or tiny.get("dtype") or "float32"
    config = AutoConfig.for_model(**{k: v for k, v in tiny.items() if k not in ("torch_dtype", "dtype")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    _save(model, dest)
    tiny_models.save_tokenizer(tiny_models.build_tokenizer(TOKENIZER_VOCABULARY), dest, TOKENIZER_VOCABULARY)
    real_model = architectures.empty_model(real, getattr(torch, dtype))
    (dest / SIZES_FILE).write_text(json.dumps({"tiny_parameters": architectures.parameter_count(model),
                                               "real_parameters": architectures.parameter_count(real_model),
                                               "real_config": real}))


def scaled_budget(max_memory: dict, checkpoint: Path) -> dict:
    """A ``max_memory`` written for the real model, scaled to the tiny one (each figure times tiny/real parameters),
    so that the tiny model is offloaded as the real one would be under it. A figure that is not a size is left as
    it is (transformers says what is wrong with it, to the script)."""
    from pytest_llmload.system.sizes import parse_size

    sizes = json.loads((Path(checkpoint) / SIZES_FILE).read_text())
    ratio = sizes["tiny_parameters"] / sizes["real_parameters"]
    scaled = {}
    for device, size in max_memory.items():
        try:
            scaled[device] = max(1, int(parse_size(size) * ratio))
        except ValueError:
            scaled[device] = size
    return scaled


def tiny_adapter(name_or_path: str, base_model, call: str, root: Optional[Path] = None) -> Path:
    """A tiny adapter of the same kind, rank and target modules as the adapter folder ``name_or_path`` holds, for
    ``base_model`` (a tiny model), built once into the cache. ``call`` names the call for the error where the folder
    has no ``adapter_config.json`` (a hub adapter: the run is offline)."""
    config_file = Path(name_or_path) / "adapter_config.json"
    if not config_file.is_file():
        raise UnmappedModel(f"{call} names the adapter {name_or_path!r}, which pytest-llmload run cannot find offline: "
                            "it is not a folder holding an adapter_config.json; point the command at the adapter's "
                            "local folder.")
    import transformers

    real = json.loads(config_file.read_text())
    text = json.dumps({"adapter": real, "base": base_model.config.to_dict(), "transformers": transformers.__version__},
                      sort_keys=True, default=str)
    root = root or cache_root()
    dest = root / f"adapter-{real.get('peft_type', 'peft').lower()}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
    if (dest / "adapter_config.json").is_file():
        return dest
    return _built_once(root, dest, lambda building: _build_adapter(name_or_path, base_model.config, building))


def _build_adapter(name_or_path: str, base_config, dest: Path) -> None:
    with _outside_zero3():
        _build_adapter_model(name_or_path, base_config, dest)


def _build_adapter_model(name_or_path: str, base_config, dest: Path) -> None:
    import torch
    from peft import PeftConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = PeftConfig.from_pretrained(name_or_path)  # (its own class: LoraConfig, ...; its rank and targets)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(base_config)
    get_peft_model(base, config).save_pretrained(dest)


_LAYER = re.compile(r"^(?P<stack>.+)\.(?P<index>\d+)$")


def planned_placement(checkpoint: Path, device_map: str, max_memory: dict, dtype: Any) -> Optional[dict]:
    """The tiny model's ``device_map``, module by module as from_pretrained would place the real model under
    ``device_map`` (a strategy) and ``max_memory`` (its own planner, run on the real model built empty): the same
    modules on the cpu and the disk, the tiny model's layers spread in the real layers' proportions. ``None`` where
    the real placement uses a GPU this runner lacks, or the checkpoint keeps no real config."""
    import torch

    from pytest_llmload.placement import planner

    sizes = json.loads((Path(checkpoint) / SIZES_FILE).read_text())
    real = sizes.get("real_config")
    if real is None or device_map not in planner.STRATEGIES:
        return None
    if not isinstance(dtype, torch.dtype):
        dtype = getattr(torch, real.get("torch_dtype") or "float32")
    with _outside_zero3():
        real_map = planner.plan(architectures.empty_model(real, dtype), device_map, max_memory, dtype=dtype)
    if any(where not in ("cpu", "disk") for where in real_map.values()) and torch.cuda.device_count() == 0:
        return None
    return _tiny_map(real_map, real["num_hidden_layers"], json.loads((Path(checkpoint) / "config.json").read_text())[
        "num_hidden_layers"])


def _tiny_map(real_map: dict, real_layers: int, tiny_layers: int) -> dict:
    """``real_map`` for the tiny model: every module that is not a layer as it is; tiny layer ``i`` where the real
    layer at the same depth goes."""
    tiny, stacks = {}, {}
    for name, where in real_map.items():
        layer = _LAYER.match(name)
        if layer and int(layer["index"]) < real_layers:
            stacks.setdefault(layer["stack"], {})[int(layer["index"])] = where
        else:
            tiny[name] = where
    for stack, layers in stacks.items():
        for i in range(tiny_layers):
            depth = min(real_layers - 1, (2 * i + 1) * real_layers // (2 * tiny_layers))
            tiny[f"{stack}.{i}"] = layers.get(depth, layers[min(layers, key=lambda j: abs(j - depth))])
    return tiny
