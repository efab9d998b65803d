"""zero3-device-map: any ``device_map`` passed to ``from_pretrained`` while DeepSpeed ZeRO-3 is active.

When a stage-3 DeepSpeed config is alive in the process (``transformers.integrations.HfDeepSpeedConfig``: the
Trainer makes one from ``TrainingArguments(deepspeed=...)``, accelerate's ``DeepSpeedPlugin`` when the
``Accelerator`` is created), ``is_deepspeed_zero3_enabled()`` is true and ``from_pretrained`` builds the model
under ``deepspeed.zero.Init``, which partitions every parameter over the ranks as it is created. A
``device_map`` says where whole modules go, which contradicts that, so transformers refuses any non-None
``device_map`` before reading a weight (``check_and_set_device_map`` in ``transformers/integrations/accelerate.py``,
transformers 5.x; inline in ``PreTrainedModel.from_pretrained`` in ``transformers/modeling_utils.py``, same text,
on transformers 4.56)::

    ValueError: DeepSpeed Zero-3 is not compatible with passing a `device_map`.

Older 4.x releases raised the same refusal as ``DeepSpeed Zero-3 is not compatible with `low_cpu_mem_usage=True`
or with passing a `device_map`.`` (a ``device_map`` turned ``low_cpu_mem_usage`` on; 5.x ignores that argument);
the signature matches both texts.
Seen in huggingface/peft#306 (``device_map={'': 0}`` under an accelerate ZeRO-3 config), huggingface/accelerate#2543
(accelerate ZeRO-3 with ``zero3_init_flag``), hiyouga/LlamaFactory#199 and #3949, QwenLM/Qwen#833 (the
fine-tuning script's ``device_map`` under ``--deepspeed`` ZeRO-3), shibing624/MedicalGPT#477 (the 5.x text).

It is what write-up 004's fix becomes under ZeRO-3: ``device_map={"": LOCAL_RANK}`` (the whole model on the
rank's device) is right under DDP and ZeRO-0/1/2, where every rank holds the whole model, and is refused under
ZeRO-3. The fix: under ZeRO-3 pass no ``device_map`` at all (DeepSpeed places the partitions itself); decide it
from the run (``LoadRequest.zero_stage == 3``, or ``transformers.integrations.is_deepspeed_zero3_enabled()``,
which also covers a script that does not know its stage), never from the device alone. The reference loader
passes no ``device_map`` under ``deepspeed=True`` at all, on CPU and on GPU.

The check runs on ranks of a real process group (:func:`pytest_llmload.runners.ranks.run_ranks`, 2 gloo ranks on
CPU with ``DS_ACCELERATOR=cpu``): each rank creates its ``Accelerator`` with a ZeRO-3 ``DeepSpeedPlugin`` first,
as a training script does, then loads ``LoadRequest(checkpoint, purpose="train", deepspeed=True, zero_stage=3)``
through the loader, then prepares the model with accelerate and takes one AdamW step::

    from pytest_llmload.failures import zero3_device_map

    @pytest.mark.timeout(120)
    def test_my_loader_loads_under_zero3(llmload_checkpoint, tmp_path):
        zero3_device_map.check_zero3_load(my_loader, llmload_checkpoint, tmp_path)

The HfDeepSpeedConfig lives only in the ranks (forked children): nothing of ZeRO-3 stays in the test process.
"""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pytest_llmload.checks.base import Check, KnownFailure, not_exercised
from pytest_llmload.failures.distributed_device_map import (
    DEEPSPEED_CONFIG,
    LEARNING_RATE,
    judge_step,
    step_and_probe,
)
from pytest_llmload.checks import contract
from pytest_llmload.loader.seam import LoaderError, LoaderModelError
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.checks.ground_truth import train_optimizer
from pytest_llmload.runners import preload, ranks
from pytest_llmload.runners.ranks import RankResult
from pytest_llmload.system.tracebacks import is_library, module_of

Loader = Callable[[LoadRequest], Any]

# transformers >= 5 (integrations/accelerate.py, check_and_set_device_map), transformers 4.56 (the same text, raised
# in modeling_utils.from_pretrained) and older 4.x (modeling_utils.from_pretrained, with "`low_cpu_mem_usage=True`
# or with", when device_map or low_cpu_mem_usage=True was given).
ERROR_RE = (r"DeepSpeed Zero-3 is not compatible with (?:`?low_cpu_mem_usage=True`? or with )?passing a "
            r"`?device_map`?")

FAILURE = KnownFailure(
    id="zero3-device-map",
    order=9,
    title="a device_map passed to from_pretrained under DeepSpeed ZeRO-3",
    write_up=("huggingface/peft#306, huggingface/accelerate#2543, hiyouga/LlamaFactory#199, "
              "hiyouga/LlamaFactory#3949, QwenLM/Qwen#833, shibing624/MedicalGPT#477"),
    signatures=(ERROR_RE,),
    root_cause=(
        "A stage-3 DeepSpeed config was alive (HfDeepSpeedConfig, made by Trainer or accelerate's DeepSpeedPlugin), "
        "so from_pretrained builds the model under deepspeed.zero.Init, partitioned over the ranks; it refuses any "
        "device_map, even {'': LOCAL_RANK}, write-up 004's fix for DDP and ZeRO-0/1/2."
    ),
    fix=(
        "Under ZeRO-3 pass no device_map (and no low_cpu_mem_usage on transformers 4.x): decide from the run's "
        "stage (transformers.integrations.is_deepspeed_zero3_enabled(), or LoadRequest.zero_stage == 3); keep "
        "{'': LOCAL_RANK} for DDP and ZeRO-0/1/2 only."
    ),
    script_fix=(
        "Under ZeRO-3 pass no device_map (and no low_cpu_mem_usage on transformers 4.x): decide from "
        "transformers.integrations.is_deepspeed_zero3_enabled(), which is true only once the TrainingArguments (or "
        "HfDeepSpeedConfig) with the ZeRO-3 config exist, so build them before the model; keep {'': LOCAL_RANK} for "
        "DDP and ZeRO-0/1/2 only."
    ),
    occurs=("transformers >= 4.2x with DeepSpeed ZeRO-3 (Trainer --deepspeed, accelerate DeepSpeedPlugin with "
            "zero3_init_flag); CPU (DS_ACCELERATOR=cpu, gloo) and GPU; reproduced on transformers 5.23, "
            "accelerate 1.15, deepspeed 0.19.8."),
)


# Write-up 004's DeepSpeed step (the same batch, step and tolerance), at ZeRO stage 3.
ZERO3_CONFIG = {**DEEPSPEED_CONFIG, "zero_optimization": {"stage": 3}}


class LoaderFailedOnRank(LoaderModelError):
    """The loader (or the model it returned) failed on a rank for a reason other than ZeRO-3's device_map refusal."""


def check_zero3_load(
    loader: Loader,
    checkpoint: os.PathLike | str,
    workdir: os.PathLike | str,
    *,
    device: str = "cpu",
    world_size: int | None = None,
    timeout: float = 120.0,
) -> None:
    """Guards zero3-device-map: on 2 ranks under an accelerate ZeRO-3 plugin a train load passes no device_map and trains."""
    from pytest_llmload.system import gpus

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if world_size is None:
        world_size = 2 if backend == "gloo" else max(1, min(2, gpus.visible_gpu_count()))
    missing = CHECK.missing_extra_reason()  # (the record's skip, for a caller of this function itself)
    if missing is not None:
        import pytest

        pytest.skip(missing)
    preload.preload(preload.DEEPSPEED_PRELOAD + preload.model_module(checkpoint))
    # GPU ranks start from a clean forkserver and import DeepSpeed themselves: they must pick its CUDA
    # accelerator even when the test process was told DS_ACCELERATOR=cpu.
    # CPU ranks get LOCAL_SIZE, as DeepSpeed's own launcher sets it: ZeRO-3 asks the CPU accelerator for its device
    # count, which DeepSpeed < 0.16 otherwise reads from `numactl --hardware` (FileNotFoundError where it is absent).
    env = {"DS_ACCELERATOR": "cuda"} if backend == "nccl" else {"LOCAL_SIZE": str(world_size)}
    # A rank that raised, hung or died: reports.verdict judges what it raised (the refusal is a result, not a raise).
    results = ranks.run_ranks(
        _load_under_zero3, world_size, args=(loader, os.fspath(checkpoint), os.fspath(workdir), device, backend),
        backend=backend, timeout=timeout, env=env, gpus_hidden=backend == "gloo",  # (a runner without GPUs)
    )

    refused = [(rank, r) for rank, r in enumerate(results) if r.kind == "refusal"]
    if refused:
        lines = [f"rank {rank}: from_pretrained(device_map={r.data['device_map']}) raised ValueError: {r.reason}"
                 for rank, r in refused]
        raise AssertionError(
            f"zero3-device-map: under DeepSpeed ZeRO-3 (an accelerate DeepSpeedPlugin with zero_optimization.stage=3, "
            f"is_deepspeed_zero3_enabled() True before the load) the loader passed a device_map to from_pretrained "
            f"on {len(refused)} of {world_size} ranks ({backend}, device={device!r}), and transformers refused it:\n  "
            + "\n  ".join(lines)
            + "\nUnder ZeRO-3 load with no device_map at all (DeepSpeed partitions the weights over the ranks); "
            "device_map={'': LOCAL_RANK} is the fix for DDP and ZeRO-0/1/2 only. Decide it from "
            "transformers.integrations.is_deepspeed_zero3_enabled() or LoadRequest.zero_stage == 3."
        )
    errors = [(rank, r.reason) for rank, r in enumerate(results) if r.kind == "error"]
    if errors:
        raise LoaderFailedOnRank(
            f"{CHECK.name}: the loader raised under ZeRO-3, not the device_map refusal (not zero3-device-map):\n"
            + "\n".join(f"----- rank {rank}\n{text}" for rank, text in errors)
        )
    measured = [r.data for r in results]
    unpartitioned = [(rank, r) for rank, r in enumerate(measured) if r["ds_params"] == 0]
    if unpartitioned:
        rank, r = unpartitioned[0]
        not_exercised(CHECK.name, f"built the model outside ZeRO-3's zero.Init (rank {rank}: none of its "
                      f"{r['params']} parameters has a ds_id; is_deepspeed_zero3_enabled() was {r['zero3_after']} "
                      "after the load)", "from_pretrained's device_map decision under ZeRO-3")
    frozen = [rank for rank, r in enumerate(measured) if r.get("trainable") == 0]
    if frozen:
        not_exercised(CHECK.name, f"returned a model with no trainable parameter under ZeRO-3 (ranks "
                      f"{frozen}; it loaded without a device_map, as ZeRO-3 needs)", "a ZeRO-3 train step")
    problems = judge_step(measured, after="the loss after the step")
    if problems:
        raise LoaderFailedOnRank(
            f"{CHECK.name}: the model loaded under ZeRO-3 without a device_map but did not train (not "
            "zero3-device-map):\n  " + "\n  ".join(problems)
        )


def zero3_refusal(exc: BaseException) -> BaseException | None:
    """The ``ValueError`` of ZeRO-3's device_map refusal in ``exc`` or in what it wraps (``call_loader``'s
    ``LoaderError.original``, ``__cause__``, ``__context__``); ``None`` when there is none."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, ValueError) and re.search(ERROR_RE, str(current)):
            return current
        pending += [getattr(current, "original", None), current.__cause__, current.__context__]
    return None


def device_map_in_traceback(exc: BaseException) -> str:
    """The ``device_map`` the caller gave ``from_pretrained``, read from the frames of ``exc``'s traceback.

    Outermost first, the frames of ``transformers`` modules: a ``kwargs`` dict holding ``device_map`` (the
    auto-class ``from_pretrained``; on 4.x also the dtype-restoring ``_wrapper`` around the model class's) or a
    ``from_pretrained`` frame's own ``device_map`` local. The outermost one holds the argument as passed: on
    transformers 4.56 the innermost ``from_pretrained`` frame has already turned ``"cpu"`` into
    ``{"": torch.device("cpu")}`` when it raises (5.x does that in ``check_and_set_device_map``, leaving the
    caller's frame alone). Failing those, any frame's ``device_map`` local. ``"?"`` when no frame has one.
    """
    frames = [frame for frame, _ in traceback.walk_tb(exc.__traceback__)]
    for frame in frames:
        if not is_library(module_of(frame), ("transformers",)):
            continue
        kwargs = frame.f_locals.get("kwargs")
        if isinstance(kwargs, dict) and kwargs.get("device_map") is not None:
            return repr(kwargs["device_map"])
        if frame.f_code.co_name == "from_pretrained" and frame.f_locals.get("device_map") is not None:
            return repr(frame.f_locals["device_map"])
    for frame in reversed(frames):
        if frame.f_locals.get("device_map") is not None:
            return repr(frame.f_locals["device_map"])
    return "?"


def _load_under_zero3(loader: Loader, checkpoint: str, workdir: str, device: str, backend: str) -> RankResult:
    """On one rank: ZeRO-3 set up as accelerate does, the loader's train load, prepare and one step."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DistributedType
    from transformers.integrations import is_deepspeed_zero3_enabled

    rank = dist.get_rank()
    # The Accelerator first, as a training script makes it: its DeepSpeedPlugin keeps the HfDeepSpeedConfig
    # alive (transformers holds it only by a weak reference) for as long as the accelerator state lives.
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(ZERO3_CONFIG)))
    if accelerator.distributed_type != DistributedType.DEEPSPEED or not is_deepspeed_zero3_enabled():
        raise RuntimeError(  # the harness is wrong, not the loader
            f"rank {rank}: accelerate chose {accelerator.distributed_type}, is_deepspeed_zero3_enabled()="
            f"{is_deepspeed_zero3_enabled()}: ZeRO-3 is not set up"
        )
    request = LoadRequest(checkpoint, purpose="train", device=device, deepspeed=True, zero_stage=3,
                          offload_folder=Path(workdir) / f"offload-zero3-rank{rank}")
    try:
        model = contract.load(loader, request, check=CHECK.name).model
    except Exception as exc:  # noqa: BLE001 - judged here: the refusal, or the loader's own error
        refusal = zero3_refusal(exc)
        if refusal is not None:
            return RankResult.refusal(str(refusal), device_map=device_map_in_traceback(refusal))
        if not isinstance(exc, LoaderError):
            raise  # a contract gap, or the check's own crash: reports.verdict judges what the rank raised
        return RankResult.error(traceback.format_exc())

    params = list(model.parameters())
    found = {
        "params": len(params),
        "ds_params": sum(hasattr(p, "ds_id") for p in params),
        "ds_numel": sum(getattr(p, "ds_numel", 0) for p in params),
        "zero3_after": is_deepspeed_zero3_enabled(),
    }
    trainable = [p for p in params if p.requires_grad]
    if found["ds_params"] == 0 or not trainable:  # (a frozen base: nothing for a step to train)
        return RankResult.ok(**found, trainable=len(trainable))
    optimizer = train_optimizer(trainable, LEARNING_RATE)
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
        losses = step_and_probe(accelerator, model, optimizer, rank)
    except Exception:  # noqa: BLE001 - the model did not train: reported, not judged as this failure
        return RankResult.error("the loaded model failed in prepare() or the step:\n" + traceback.format_exc())
    return RankResult.ok(**found, **losses)


# Not isolated: the ZeRO-3 config lives only in the ranks it forks (deadline, stacks, exit codes included), and
# the DeepSpeed stack it preloads here is what makes those ranks cheap.
CHECK = Check(check_zero3_load, failure=FAILURE, world_size=2, timeout=180, purpose="train", extras=("deepspeed",))
CHECKS = (CHECK,)
