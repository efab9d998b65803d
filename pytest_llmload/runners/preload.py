"""What the checks' children and ranks import, imported once in the process that forks them.

What a forked child imports dies with it, and the next check would pay for it again: the Hugging Face modules
(:data:`HF_PRELOAD`), DeepSpeed's (:data:`DEEPSPEED_PRELOAD`) and peft are imported here first, by a check before
its children or ranks fork (:meth:`pytest_llmload.checks.base.Check.__call__`), and by
``distributed_env(deepspeed=True)``.

This module imports nothing heavy at import time.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

# The module lists, and DeepSpeed's quiet import, are the warm forkserver's too (one floor down).
from pytest_llmload.runners.warm_server import (  # noqa: F401  (part of this API)
    DEEPSPEED_PRELOAD,
    HF_PRELOAD,
    quiet_deepspeed_import,
)


def preload(modules: Sequence[str]) -> None:
    """Import ``modules`` here, before forking, so that no rank pays for them; a missing one is skipped. DeepSpeed's
    import is quiet (:func:`quiet_deepspeed_import`: at collection its log lines would read as the run's)."""
    for name in modules:
        if name in sys.modules:
            continue
        quiet = quiet_deepspeed_import() if name.partition(".")[0] == "deepspeed" else contextlib.nullcontext()
        with contextlib.suppress(ImportError), quiet:
            importlib.import_module(name)


def model_module(checkpoint) -> tuple[str, ...]:
    """The transformers modeling module of the checkpoint's architecture, imported lazily otherwise."""
    try:
        model_type = json.loads((Path(checkpoint) / "config.json").read_text())["model_type"]
    except (OSError, ValueError, KeyError):
        return ()
    return (f"transformers.models.{model_type}.modeling_{model_type}",)


def preload_for_isolated_checks(checkpoint: "os.PathLike[str] | str | None" = None, *, peft: bool = True) -> None:
    """Import here, before an isolated check or a check's ranks fork, what the checks import: what a child imports
    dies with it, and the next check would pay for it again (1.5 s a check for peft and its dependencies, measured;
    the distributed check's ranks import part of it too: the check took 1.35-1.42 s with only the Hugging Face
    modules preloaded, 0.51-0.64 s with peft). With ``checkpoint``, its model's modeling module too.

    peft (``peft=True``: a check that uses adapters) and bitsandbytes only where no GPU is visible: bitsandbytes'
    import reads the devices' compute capability and so initialises CUDA, and a process that has initialised CUDA
    can no longer fork. A run of inference checks alone never imports them (about 2.5 s of CPU). Older peft (0.17)
    imports bitsandbytes only when it first wraps a model: in every child, 0.5-0.9 s each, had it not been here.
    """
    from pytest_llmload.system import gpus

    modules = HF_PRELOAD + (model_module(checkpoint) if checkpoint is not None else ())
    if peft and gpus.visible_gpu_count() == 0:
        modules += ("peft", "bitsandbytes")
    preload(modules)
    if "peft" in sys.modules:
        answer_peft_type_checks()


def answer_peft_type_checks() -> None:
    """Ask peft's ``isinstance(module, BaseTunerLayer)`` here, once: peft asks it of every module of a model it
    wraps, and the first negative answer in a process walks every subclass of that ABC (~0.3 s). Asked before
    forking, every child inherits the answers (ABCs cache them) instead of walking again."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from torch import nn

    for module in (nn.Dropout, nn.Identity, nn.Linear, nn.Embedding, nn.Module):
        issubclass(module, BaseTunerLayer)
