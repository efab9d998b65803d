"""distributed-device-map (write-up 004): ``device_map`` spread on every rank of a DeepSpeed/DDP job.

Here: the check that a model loaded by one rank of a distributed job is trainable by it. The write-up's fix rule
(:func:`is_distributed`, :func:`device_map_for_rank`) lives in :mod:`pytest_llmload.fixes.training_scripts`, for training scripts.

The write-up's loader always passed ``device_map="auto"``; under DeepSpeed, ``accelerator.prepare()`` then
raised ``You can't train a model that has been loaded with `device_map='auto'` in any distributed mode``.
accelerate raises it (``Accelerator.prepare`` and ``prepare_model``) for any ``nn.Module`` for which
``Accelerator.verify_device_map`` is true, i.e. some submodule has an ``hf_device_map`` with more than one
entry, whenever ``distributed_type`` is not ``NO`` and ``ACCELERATE_BYPASS_DEVICE_MAP`` is not ``true``.

The check is ``check_<name>(loader, checkpoint, workdir, *, ...)`` like the others: ``loader`` takes a
:class:`~pytest_llmload.LoadRequest`, ``checkpoint`` is a local tiny checkpoint (``llmload_checkpoint``),
``workdir`` an empty scratch directory (``tmp_path``); it returns ``None`` or raises ``AssertionError`` with
the figures::

    from pytest_llmload.failures import distributed_device_map

    @pytest.mark.timeout(120)
    def test_my_loader_trains_on_every_rank(llmload_checkpoint, tmp_path):
        distributed_device_map.check_distributed_train_step(my_loader, llmload_checkpoint, tmp_path)

Each rank loads ``LoadRequest(checkpoint, purpose="train", deepspeed=<mode is DeepSpeed>)`` under a launcher's
environment, prepares model and optimizer, and takes one AdamW step on a batch of its own. "The same loss on every
rank" is measured on a probe batch shared by all ranks, before the step and after it: equal after the step means
the gradients were all-reduced and the ranks still hold the same weights; different from before, that it trained.

On a CPU-only machine ``device_map="auto"`` alone does not spread a model (there is one device), so there the
check catches loaders that spread it anyway (a memory budget, an explicit map); on a multi-GPU runner,
``backend="nccl"``, it also catches a bare ``"auto"``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, Optional

from pytest_llmload.checks.base import Check, KnownFailure, not_exercised
from pytest_llmload.checks import contract
from pytest_llmload.fixes.training_scripts import local_rank
from pytest_llmload.loader.seam import LoaderModelError
from pytest_llmload.instruments.probes import spy_classmethod
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.checks.ground_truth import train_optimizer
from pytest_llmload.runners import preload, ranks
from pytest_llmload.runners.ranks import RankResult

Loader = Callable[[LoadRequest], Any]

FAILURE = KnownFailure(
    id="distributed-device-map",
    order=5,
    title="device_map='auto' under DeepSpeed or another distributed launcher",
    write_up="seeds/004_e47582475487edd3.txt",
    signatures=(
        r"You can't train a model that has been loaded with `?device_map='auto'`? in any distributed mode",
        r"You can't train a model that has been loaded in 8-bit or 4-bit precision on multiple devices in any "
        r"distributed mode",
    ),
    root_cause=(
        "Each rank loaded the model with device_map='auto', which spreads it over several devices "
        "(hf_device_map has more than one entry). accelerate refuses to prepare such a model for DeepSpeed or "
        "DDP, which place and replicate the model themselves."
    ),
    fix=(
        "When WORLD_SIZE/RANK/LOCAL_RANK (or a DeepSpeed flag) say the process is one rank of a job, load "
        "without device_map, or pin the whole model to the rank's device (device_map={'': local_rank}; "
        "pytest_llmload.fixes.training_scripts.device_map_for_rank gives it)."
    ),
    script_fix=(
        "When WORLD_SIZE/RANK/LOCAL_RANK (or a DeepSpeed flag) say the process is one rank of a job, load without "
        "device_map, or pin the whole model to the rank's device (device_map={'': int(os.environ['LOCAL_RANK'])})."
    ),
    occurs="accelerate >= 0.20 with DistributedType DEEPSPEED, MULTI_GPU or MULTI_CPU; CPU (gloo) and GPU.",
)


# ---------------------------------------------------------------------------------------------------------
# Is this process one rank of a distributed job? (write-up 004)
# ---------------------------------------------------------------------------------------------------------

# (the rule itself lives in pytest_llmload.fixes.training_scripts, which a training script can import without pytest)


# "ddp-budget": DDP again, with a max_memory in the request that cannot hold the model (a loader that honours it
# with a device_map spreads the model on every rank; refusing it is fine).
MODES = ("deepspeed", "ddp", "ddp-budget")
# On a CPU runner "auto" has one device to use: the placement each rank asked from_pretrained for is also planned,
# with accelerate's own planner on an empty-weights copy, for a runner with this many GPUs of this size.
SIMULATED_GPUS = 2
SIMULATED_GPU_BYTES = 80 * 2**30
# DeepSpeed ZeRO-2 with the torch optimizer accelerate is given (hence "untested optimizer"); the micro batch
# size is the batch of the step below, since no dataloader goes through prepare().
BATCH = 2
SEQUENCE = 16
DEEPSPEED_CONFIG = {
    "train_micro_batch_size_per_gpu": BATCH,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 2**31 - 1,
}
LEARNING_RATE = 1e-2
# Ranks run the same float32 code on the same weights; after an all-reduced step they must agree closely.
REL_TOL = 1e-5


def check_distributed_train_step(
    loader: Loader,
    checkpoint: os.PathLike | str,
    workdir: os.PathLike | str,
    *,
    backend: str = "gloo",
    world_size: int = 2,
    modes: Sequence[str] = MODES,
    timeout: float = 120.0,
) -> None:
    """Seed 004: on 2 ranks a train load prepares under DeepSpeed ZeRO-2 and DDP (also with a budget), and trains.

    Each rank loads ``LoadRequest(purpose="train", deepspeed=<mode>, gpu_count=2)``, prepares with accelerate and
    takes a step; equal losses on every rank after it. The placement each rank passed to ``from_pretrained``
    (``device_map``, ``max_memory``) is also planned with accelerate's own planner for a runner with 2 GPUs: a
    placement that would spread the model there (``"auto"``, ``"balanced"``, a multi-device map) fails with the
    planned map and accelerate's own error. A loader that pins each rank to its accelerator index
    (``{"": LOCAL_RANK}``) loads on the cpu on a runner without accelerators, and the row says so
    (:mod:`pytest_llmload.loader.cuda_pins`). Needs deepspeed."""
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise ValueError(f"{CHECK.name}(modes={tuple(modes)!r}): choose from {MODES}.")
    missing = CHECK.missing_extra_reason() if "deepspeed" in modes else None
    if missing is not None:  # (the record's skip, for a caller of this function itself)
        import pytest

        pytest.skip(f"{missing} for mode 'deepspeed'; pass modes=('ddp',) to check without it")
    preload.preload(
        (preload.DEEPSPEED_PRELOAD if "deepspeed" in modes else preload.HF_PRELOAD) + preload.model_module(checkpoint)
    )
    problems, unexercised = [], []
    groups = [ranks.RankGroup(_load_prepare_and_step,
                              (loader, os.fspath(checkpoint), os.fspath(workdir), mode, backend)) for mode in modes]
    # Each mode has its own process group, all at once: each rank's set-up (CUDA and NCCL, 1.3 s on the H200; the
    # rendezvous on CPU) overlaps the others'. Measured: 0.60 -> 0.50 s a check with gloo on 2 cores, 8 runs each.
    results_by_mode = ranks.run_rank_groups(groups, world_size, backend=backend, timeout=timeout,
                                            gpus_hidden=backend == "gloo")  # (gloo: a runner without GPUs, simulated)
    for mode, results in zip(modes, results_by_mode):  # every mode is judged: a loader may pin without a budget
        if isinstance(results, ranks.DistributedRunFailed):
            raise results
        skipped = [result.reason for result in results if result.kind == "skip"]
        if skipped:
            unexercised.append(f"{skipped[0]} [mode {mode}]")
            continue
        if all(result.kind == "refusal" for result in results):
            continue  # the budget cannot hold the model, and the loader said so: not this failure
        problems += [f"{mode}: {problem}" for problem in _judge(results)]
    if not problems and len(unexercised) == len(modes):
        not_exercised(CHECK.name, "; ".join(unexercised), "a distributed train load")
    if problems:
        raise AssertionError(
            f"write-up 004: the loader's model does not train on every rank of a {world_size}-rank {backend} group "
            f"({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n  " + "\n  ".join(problems)
            + "\nLoad without device_map (or with the whole model on the rank's device) when WORLD_SIZE, RANK or "
            "LOCAL_RANK say the process is one rank of a distributed job."
        )


def _judge(results: list[RankResult]) -> list[str]:
    problems = []
    for rank, result in enumerate(results):
        if result.kind == "error":  # accelerator.prepare() raised
            entries, planned = result.data["device_map"], result.data.get("planned")
            if planned:
                where = (f"it passed {result.data['placement']} to from_pretrained, which on a runner with "
                         f"{SIMULATED_GPUS} GPUs places the model as {planned} (accelerate's planner)")
            else:
                where = (f"hf_device_map has {len(entries)} entries: {entries}" if entries
                         else "the model has no hf_device_map")
            problems.append(f"rank {rank}: accelerator.prepare() raised {result.reason} ({where})")
    if problems:
        return problems
    return judge_step([result.data for result in results], after="the loss after the step (weights out of sync)")


def judge_step(results: list[dict], *, after: str) -> list[str]:
    """What :func:`step_and_probe` on every rank says: finite losses, the same probe loss on every rank before and
    after the step (``after`` names the second in the message), and a step that changed it."""
    problems = []
    for rank, result in enumerate(results):
        bad = {k: v for k, v in result.items() if "loss" in k and isinstance(v, float) and not math.isfinite(v)}
        if bad:  # numbers the check cannot trust: no verdict on the failure
            raise LoaderModelError(f"the probe step produced non-finite losses on rank {rank} ({bad}): the check "
                                   f"cannot judge whether the ranks stayed in sync")
    first = results[0]
    for key, what in (("probe_loss_before", "the loss before the step"), ("probe_loss_after", after)):
        values = [result[key] for result in results]
        if not all(math.isclose(v, values[0], rel_tol=REL_TOL) for v in values):
            problems.append(f"{what} differs between ranks: {values}")
    if math.isclose(first["probe_loss_after"], first["probe_loss_before"], rel_tol=1e-7):
        problems.append(f"the step did not change the loss ({first['probe_loss_before']}): nothing trained")
    return problems


def step_and_probe(accelerator, model, optimizer, rank: int) -> dict:
    """One AdamW step on a batch of this rank's own, between two losses on a probe batch shared by all ranks:
    equal probe losses after the step show that the gradients were all-reduced and the weights stayed in sync."""
    import torch

    vocab = accelerator.unwrap_model(model).config.vocab_size
    probe = torch.randint(2, vocab, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(0))
    batch = torch.randint(2, vocab, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(1 + rank))
    probe, batch = probe.to(accelerator.device), batch.to(accelerator.device)
    with torch.no_grad():
        before = model(input_ids=probe, labels=probe).loss.item()
    loss = model(input_ids=batch, labels=batch).loss
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    with torch.no_grad():
        after = model(input_ids=probe, labels=probe).loss.item()
    return {"probe_loss_before": before, "step_loss": loss.item(), "probe_loss_after": after}


def _load_prepare_and_step(loader: Loader, checkpoint: str, workdir: str, mode: str, backend: str) -> RankResult:
    """On one rank: load through ``loader``, prepare with accelerate, one step; the losses, or prepare's error.

    The step's batch differs per rank and the probe batch is the same on all: equal probe losses after the
    step show that the gradients were all-reduced and the ranks still hold the same weights.
    """
    import pytest
    import torch
    import torch.distributed as dist
    from transformers import PreTrainedModel

    from pytest_llmload.loader.seam import LoaderError
    from pytest_llmload.checks.ground_truth import offload_budget, refusal_problem

    rank = dist.get_rank()
    device = f"cuda:{local_rank(os.environ)}" if backend == "nccl" else "cpu"
    request = LoadRequest(
        checkpoint, purpose="train", device=device, deepspeed=mode == "deepspeed",
        offload_folder=Path(workdir) / f"offload-{mode}-rank{rank}",
        max_memory=offload_budget(checkpoint, device) if mode == "ddp-budget" else None,
        gpu_count=torch.cuda.device_count() if backend == "nccl" else SIMULATED_GPUS,
    )
    calls: list = []
    try:
        with spy_classmethod(PreTrainedModel, "from_pretrained", calls):
            # (a rank pinned to its accelerator index, on a runner without one, loads on the cpu: loader.cuda_pins)
            model, request = contract.load(loader, request, check=CHECK.name).model_and_request
    except LoaderError as exc:
        if mode == "ddp-budget" and refusal_problem(exc.original) is None:
            return RankResult.refusal(str(exc.original))
        raise
    except pytest.skip.Exception as exc:  # a pin that cannot run here (loader.cuda_pins): this rank is not exercised
        return RankResult.skip(str(exc).removeprefix("the loader "))  # (the row's sentence names the loader)
    return _prepare_and_step(model, calls, checkpoint, request, mode, backend, rank)


def _prepare_and_step(model, calls: list, checkpoint: str, request: LoadRequest, mode: str, backend: str,
                      rank: int) -> RankResult:
    """Prepare the rank's model with accelerate as the mode's training script does, and take a step."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    asked = _placement(calls)
    device_map = {name: str(where) for name, where in (getattr(model, "hf_device_map", None) or {}).items()}
    planned = None
    if backend != "nccl" and len(set(device_map.values())) <= 1 and calls:
        planned = _plan_on_gpus(checkpoint, asked, request)
        if planned is not None and len(set(planned.values())) > 1:
            # What accelerate would see on that runner: its own check decides, with its own message.
            model.hf_device_map = planned
        else:
            planned = None
    if mode == "deepspeed":
        from accelerate.utils import DeepSpeedPlugin

        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(DEEPSPEED_CONFIG)))
        expected = DistributedType.DEEPSPEED
    else:
        accelerator = Accelerator(cpu=backend == "gloo")
        expected = DistributedType.MULTI_CPU if backend == "gloo" else DistributedType.MULTI_GPU
    if accelerator.distributed_type != expected:  # the harness is wrong, not the loader
        raise RuntimeError(f"accelerate chose {accelerator.distributed_type}, expected {expected} on rank {rank}")
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:  # a frozen base: DDP and DeepSpeed refuse to prepare it whatever its placement
        return RankResult.skip("returned a model with no trainable parameter (a frozen base): nothing for a "
                               "distributed job to prepare and train")
    optimizer = train_optimizer(trainable, LEARNING_RATE)
    try:
        model, optimizer = accelerator.prepare(model, optimizer)
    except Exception as exc:  # noqa: BLE001 - whatever prepare() refuses is the finding
        return RankResult.error(f"{type(exc).__name__}: {exc}", device_map=device_map, planned=planned,
                                placement={k: (v if isinstance(v, (str, int)) else dict(v)) for k, v in asked.items()})

    return RankResult.ok(device_map=device_map, distributed_type=str(accelerator.distributed_type),
                         **step_and_probe(accelerator, model, optimizer, rank))


def _placement(calls: list) -> dict:
    """The placement arguments (``device_map``, ``max_memory``) of the first recorded ``from_pretrained`` call."""
    kwargs = calls[0][3] if calls else {}
    return {key: kwargs[key] for key in ("device_map", "max_memory") if kwargs.get(key) is not None}


def _plan_on_gpus(checkpoint: str, placement: dict, request: LoadRequest) -> Optional[dict]:
    """Where ``from_pretrained(device_map=..., max_memory=...)`` would put the model on a runner with
    :data:`SIMULATED_GPUS` GPUs, by transformers' own planner on an empty-weights copy
    (:mod:`pytest_llmload.placement.planner`); ``None`` when the placement does not spread (no device_map, one
    device) or cannot be planned here."""
    from pytest_llmload.placement import architectures, planner

    device_map = placement.get("device_map")
    if device_map is None:
        return None
    if isinstance(device_map, dict):
        return {name: str(where) for name, where in device_map.items()}
    if not isinstance(device_map, str) or device_map not in planner.STRATEGIES:
        return None  # a single device ("cpu", "cuda:0", ...)
    try:
        empty = architectures.empty_model(architectures.load_config(checkpoint), request.torch_dtype)
        budget = placement.get("max_memory")
        gpus = {i: SIMULATED_GPU_BYTES for i in range(SIMULATED_GPUS)}
        max_memory = {**gpus, "cpu": 2**40} if budget is None else {**gpus, **budget} if not any(
            isinstance(k, int) for k in budget) else dict(budget)
        return planner.plan(empty, device_map, max_memory, dtype=request.torch_dtype)
    except Exception:  # noqa: BLE001 - a placement accelerate cannot plan here: no verdict from planning
        return None


# Not isolated: its work already runs in ranks it forks (deadline, stacks, exit codes included), and the
# DeepSpeed stack it imports here first (seconds) is what makes those ranks cheap; in a child it would be
# imported again on every call.
CHECK = Check(check_distributed_train_step, failure=FAILURE, world_size=2, timeout=180, purpose="train",
              extras=("deepspeed",))  # (its default modes include DeepSpeed ZeRO-2)
CHECKS = (CHECK,)
