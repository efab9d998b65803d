"""The loader contract: what a loader under test is asked to load.

A loader is any callable ``loader(request: LoadRequest)`` that returns a model or a ``(model, tokenizer)``
pair. Keeping the request immutable means one request can be handed to several loaders (the faulty one
from a write-up and the fixed one) and compared.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, Literal, Optional, Union

Purpose = Literal["inference", "train"]
Quantization = Optional[Literal["4bit", "8bit"]]

PURPOSES = ("inference", "train")
QUANTIZATIONS = (None, "4bit", "8bit")
DTYPES = ("float32", "float16", "bfloat16")


def _dtype_name(dtype: Any) -> str:
    """Accept ``"bfloat16"``, ``"bf16"`` or ``torch.bfloat16`` without importing torch."""
    name = str(dtype).removeprefix("torch.")
    name = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}.get(
        name, name
    )
    if name not in DTYPES:
        raise ValueError(f"LoadRequest.dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}.")
    return name


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """What to load, and for what.

    ``max_memory`` is the budget the loader must respect, in ``from_pretrained``'s own format
    (``{0: "10GiB", "cpu": "20GiB"}``), a plain ``dict`` (each request has its own copy), so it can be passed
    to ``from_pretrained`` as it is; ``None`` means no budget. ``zero_stage`` is the DeepSpeed ZeRO stage the
    run uses (with ``deepspeed=True``; ``None`` when unknown). Example::

        >>> from pytest_llmload import LoadRequest
        >>> r = LoadRequest("/tmp/ckpt", purpose="train", lora=True)
        >>> r.replace(gradient_checkpointing=True).gradient_checkpointing
        True
    """

    model_path: Union[str, os.PathLike]
    purpose: Purpose = "inference"
    dtype: str = "float32"
    device: str = "cpu"
    max_memory: Optional[dict[Union[int, str], Union[int, str]]] = dataclasses.field(default=None, hash=False)
    offload_folder: Optional[Union[str, os.PathLike]] = None
    quantization: Quantization = None
    lora: bool = False
    # A trained PEFT adapter (a directory peft saved) to put on the model; None: no adapter to load.
    adapter_path: Optional[Union[str, os.PathLike]] = None
    gradient_checkpointing: bool = False
    # The training script runs under DeepSpeed (the write-up 004's explicit flag), and with which ZeRO stage.
    deepspeed: bool = False
    zero_stage: Optional[int] = None
    # How many GPUs the run assumes (a loader that reads torch.cuda.device_count() reads this instead; the Trainer
    # check simulates 2 on CPU). None: the machine's own count.
    gpu_count: Optional[int] = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise through the back door, once
        set_(self, "model_path", os.fspath(self.model_path))
        for path_field in ("offload_folder", "adapter_path"):
            if getattr(self, path_field) is not None:
                set_(self, path_field, os.fspath(getattr(self, path_field)))
        if self.purpose not in PURPOSES:
            raise ValueError(f"LoadRequest.purpose={self.purpose!r}; expected 'inference' or 'train'.")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"LoadRequest.quantization={self.quantization!r}; expected None, '4bit' or '8bit'.")
        set_(self, "dtype", _dtype_name(self.dtype))
        if self.max_memory is not None:
            if not isinstance(self.max_memory, Mapping):
                raise TypeError(
                    f"LoadRequest.max_memory={self.max_memory!r} must be a mapping like "
                    "{0: '10GiB', 'cpu': '20GiB'} (from_pretrained's format)."
                )
            set_(self, "max_memory", dict(self.max_memory))  # plain: from_pretrained deep-copies it
        for flag in ("lora", "gradient_checkpointing", "deepspeed"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"LoadRequest.{flag}={getattr(self, flag)!r} must be True or False.")
        if self.gpu_count is not None and (isinstance(self.gpu_count, bool) or not isinstance(self.gpu_count, int)
                                           or self.gpu_count < 0):
            raise ValueError(f"LoadRequest.gpu_count={self.gpu_count!r}; expected None or a count of GPUs (0, 1, 2, ...).")
        if self.zero_stage is not None:
            if isinstance(self.zero_stage, bool) or self.zero_stage not in (0, 1, 2, 3):
                raise ValueError(f"LoadRequest.zero_stage={self.zero_stage!r}; expected None, 0, 1, 2 or 3.")
            if not self.deepspeed:
                raise ValueError(f"LoadRequest.zero_stage={self.zero_stage!r} needs deepspeed=True: the ZeRO stage "
                                 "is DeepSpeed's.")

    @property
    def torch_dtype(self):
        """The ``torch.dtype`` for :attr:`dtype` (imports torch)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def max_memory_dict(self) -> Optional[dict]:
        """A plain ``dict`` copy of the budget, as ``from_pretrained`` wants it."""
        return None if self.max_memory is None else dict(self.max_memory)

    def replace(self, **changes: Any) -> "LoadRequest":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)
