"""The fixes the checks recommend, for training scripts to import: this module imports neither pytest nor hypothesis
nor the plugin (only the standard library; torch where a function needs it), so production code can use it.

- :func:`prepare_training_args_for_placed_model`: write-up 003's Trainer guard (:mod:`pytest_llmload.fixes.trainer_guard`).
- :func:`upcast_trainable_parameters`: float32 master weights for a float16 load trained under fp16 (fp16-unscale).
- :func:`is_distributed`, :func:`local_rank`, :func:`device_map_for_rank`: write-up 004's rank-pinning rule
  (distributed-device-map): one rank of a distributed job pins the whole model to its own device.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Optional

from pytest_llmload.fixes.trainer_guard import prepare_training_args_for_placed_model  # noqa: F401  (the guard's home)

DISTRIBUTED_ENV_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")
_INT_RE = re.compile(r"-?[0-9]+")


def _env_int(environ: Mapping[str, str], name: str, *, minimum: int) -> Optional[int]:
    """``environ[name]`` as an int, ``None`` when unset; a ValueError naming the variable otherwise."""
    raw = environ.get(name)
    if raw is None:
        return None
    if not isinstance(raw, str) or not _INT_RE.fullmatch(raw.strip()):
        raise ValueError(
            f"environment variable {name}={raw!r} is not an integer; a launcher sets it to a number "
            f"(torchrun, deepspeed and accelerate all do). Unset it or give it a number."
        )
    value = int(raw.strip())
    if value < minimum:
        raise ValueError(f"environment variable {name}={raw!r} is out of range: it must be at least {minimum}.")
    return value


def is_distributed(environ: Mapping[str, str], deepspeed: bool = False) -> bool:
    """Whether a process with this environment is one rank of a distributed job (the rule of write-up 004).

    True when ``deepspeed`` is set, when ``WORLD_SIZE`` is not 1, or when ``RANK`` or ``LOCAL_RANK`` is set
    (so ``WORLD_SIZE=1 RANK=0``, what ``torchrun --nproc-per-node 1`` gives, is distributed: accelerate
    treats it as such too). ``LOCAL_RANK=-1`` and ``RANK=-1`` mean "not distributed", the convention of
    ``TrainingArguments.local_rank`` and of accelerate's own check. A value that is empty or not a number
    raises ``ValueError`` naming the variable and the value, rather than a crash deep inside torch::

        >>> is_distributed({"WORLD_SIZE": "2"})
        True
        >>> is_distributed({"LOCAL_RANK": "-1"})
        False
        >>> is_distributed({"RANK": ""})
        Traceback (most recent call last):
        ...
        ValueError: environment variable RANK='' is not an integer; ...
    """
    if not isinstance(deepspeed, bool):
        raise TypeError(f"is_distributed(deepspeed={deepspeed!r}): expected True or False.")
    # Parse every variable first, so an odd value is reported even when another variable decides.
    world_size = _env_int(environ, "WORLD_SIZE", minimum=1)
    rank = _env_int(environ, "RANK", minimum=-1)
    local_rank = _env_int(environ, "LOCAL_RANK", minimum=-1)
    if deepspeed:
        return True
    if world_size is not None and world_size != 1:
        return True
    return any(value is not None and value != -1 for value in (rank, local_rank))


def local_rank(environ: Mapping[str, str]) -> int:
    """This rank's index on its machine (``LOCAL_RANK``, else 0): which GPU a rank pins its model to."""
    value = _env_int(environ, "LOCAL_RANK", minimum=-1)
    return 0 if value is None or value < 0 else value


def upcast_trainable_parameters(model, dtype=None) -> list[str]:
    """Cast every trainable float16 parameter of ``model`` to float32 in place; returns their names.

    The fix for a float16 load that will be trained under fp16 mixed precision: the trainable parameters
    become float32 master weights and the frozen ones stay float16. Parameters keep their identity (only
    ``.data`` changes), so tied weights stay tied and an optimizer built before still holds them. ``dtype``:
    the dtypes to upcast (default: float16 only; bfloat16 training needs no GradScaler). Example::

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16)
        model = get_peft_model(model, config, autocast_adapter_dtype=False)  # or a full fine-tune
        upcast_trainable_parameters(model)
    """
    import torch

    dtypes = (torch.float16,) if dtype is None else tuple(dtype)
    upcast, seen = [], set()
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype in dtypes and id(param) not in seen:
            seen.add(id(param))
            param.data = param.data.to(torch.float32)
            upcast.append(name)
    return upcast


def device_map_for_rank(environ: Mapping[str, str], *, deepspeed: bool = False, device: str = "cuda",
                        default: Any = "auto") -> Any:
    """The ``device_map`` to load with: ``default`` in a single process; in one rank of a distributed job
    (:func:`is_distributed`), the whole model on the rank's own device (``{"": "cuda:<LOCAL_RANK>"}``), since DDP
    and DeepSpeed place and replicate the model themselves. Under DeepSpeed ZeRO-3, load with no ``device_map`` at
    all (zero3-device-map)::

        model = AutoModelForCausalLM.from_pretrained(path, device_map=device_map_for_rank(os.environ))
    """
    if is_distributed(environ, deepspeed=deepspeed):
        return {"": f"{device}:{local_rank(environ)}" if device != "cpu" else "cpu"}
    return default
