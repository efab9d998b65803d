"""The conformance checks, in one place.

Each check is a plain function ``check_<name>(loader, checkpoint, workdir)`` that raises ``AssertionError``
with the figures when the loader reproduces a known failure; its docstring's first line says which failure
it guards against and what it needs. ``REGISTRY`` lists them as :class:`~pytest_llmload.conformance.Check`
records (the failure's catalog id, GPUs, ranks, transformers range), in the order the main job runs them.
Families: ``offload`` (write-ups 000 and 002), ``trainer`` (003), ``distributed`` (004).
"""

from __future__ import annotations

import functools
import os

from pytest_llmload.checks import distributed, offload, trainer
from pytest_llmload.conformance import Check
from pytest_llmload.trainer_guard import prepare_training_args_for_placed_model


def _with_training_script_fix(check):
    # Write-up 003's fix lives in the training script, not the loader: the check gives the loader's model
    # to a 2-GPU Trainer whose arguments went through the fix, as a training script using this package does.
    # Without it, stock Trainer fails every 4-bit model (tests/regression/test_dataparallel_dtype.py).
    variant = functools.partial(check, prepare_args=prepare_training_args_for_placed_model)
    variant.__doc__ = check.__doc__
    return variant


REGISTRY: tuple[Check, ...] = (
    *offload.CHECKS,
    # Isolated: Trainer leaves accelerate's process-wide AcceleratorState behind (class-level singletons that
    # later tests and forked ranks inherit) and reseeds the global RNGs; the 4-bit load runs bitsandbytes'
    # native code.
    Check(_with_training_script_fix(trainer.check_trainer_does_not_wrap_placed_model),
          failure="dp-dtype", label="check_trainer_does_not_wrap_placed_model", timeout=180, isolated=True),
    # Not isolated: its work already runs in ranks it forks (deadline, stacks, exit codes included), and the
    # DeepSpeed stack it imports here first (seconds) is what makes those ranks cheap; in a child it would be
    # imported again on every call.
    Check(distributed.check_distributed_train_step, failure="distributed-device-map", world_size=2, timeout=180),
)



def preload_for_isolated_checks(checkpoint: "os.PathLike[str] | str") -> None:
    """Import here, before an isolated check forks, what the checks import: what a child imports dies with it,
    and the next check would pay for it again (1.5 s a check for peft and its dependencies, measured).

    peft only where no GPU is visible: it imports bitsandbytes, whose import reads the devices' compute
    capability and so initialises CUDA, and a process that has initialised CUDA can no longer fork.
    """
    from pytest_llmload import distributed as runner
    from pytest_llmload import gpus

    modules = runner.HF_PRELOAD + distributed._model_module(checkpoint)
    if gpus.visible_gpu_count() == 0:
        modules += ("peft",)
    runner.preload(modules)


__all__ = ["REGISTRY", "distributed", "offload", "preload_for_isolated_checks", "trainer"]
