"""The transformers API differences this package bridges, each in one place.

- the dtype keyword: ``dtype=`` from transformers 4.56, ``torch_dtype=`` before (5.x warns on the old one)
- gradient checkpointing: ``activation_checkpointing_enable`` where transformers has it (5.x, which announces
  that ``gradient_checkpointing_enable`` will be removed in v6), ``gradient_checkpointing_enable`` before
"""

from __future__ import annotations

from typing import Any, Optional


def dtype_kwarg(torch_dtype: Any) -> dict:
    """``{"dtype": torch_dtype}`` for ``from_pretrained`` on transformers >= 4.56, else ``{"torch_dtype": ...}``."""
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"
    return {key: torch_dtype}


def enable_gradient_checkpointing(model: Any, *, use_reentrant: Optional[bool] = None) -> None:
    """Turn on gradient (activation) checkpointing through the installed transformers' current name."""
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

