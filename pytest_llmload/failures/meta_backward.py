"""meta-backward (write-up 002): training a model whose layers ``device_map`` offloaded to cpu/disk.

The write-up loaded with ``device_map="auto"`` and ``max_memory={0: "14GB", "cpu": "50GB"}`` to fit a 7B model
for LoRA training; backward then raised ``Function MmBackward0 returned an invalid gradient at index 1 -
expected device meta but got cuda:0``. Its fix: load whole on one device, no offload, budget the memory.

The check, like every check, is ``check_<name>(loader, checkpoint, workdir, *, ...)``: ``loader`` takes a
:class:`~pytest_llmload.LoadRequest`; ``checkpoint`` is a local tiny checkpoint (``llmload_checkpoint``);
``workdir`` an empty scratch directory (``tmp_path``). It returns ``None`` or raises ``AssertionError`` with the
figures::

    from pytest_llmload.failures import meta_backward

    @pytest.mark.timeout(60)
    def test_my_loader_trains(llmload_checkpoint, tmp_path):
        meta_backward.check_train_request_trains(my_loader, llmload_checkpoint, tmp_path)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pytest_llmload.checks.base import Check, KnownFailure, not_exercised
from pytest_llmload.checks import contract
from pytest_llmload.loader.seam import LoaderError, LoaderModelError
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.checks.ground_truth import offload_budget, placement_problems, refusal_problem, train_step_problems

Loader = Callable[[LoadRequest], Any]
# The gradient autograd cannot put on an offloaded (meta) weight: what a train step on an offloaded model raises.
_META_GRADIENT = "expected device meta"

FAILURE = KnownFailure(
    id="meta-backward",
    order=1,
    title="backward through a model with offloaded (meta) parameters",
    write_up="seeds/002_3bbec781721991d8.txt",
    signatures=(
        r"returned an invalid gradient at index \d+ - expected device meta but got",
        r"Tensor on device meta is not on the expected device",
    ),
    root_cause=(
        "device_map with a max_memory budget offloaded some layers to cpu/disk, so their parameters live on "
        "the meta device and are only materialised inside forward hooks. Autograd then meets gradients for "
        "meta tensors (LoRA weights created on meta, or offloaded weights), which it cannot accumulate."
    ),
    fix=(
        "Never offload a model you train: load it whole on one device (device_map={'': device} or None), use "
        "gradient checkpointing, LoRA, 4-bit or a smaller batch to fit, and refuse a budget that cannot hold it."
    ),
    occurs="transformers 4.x-5.x with accelerate offload; any device (cuda:0 on GPU, cpu on CPU).",
)


TRAIN_VARIANTS = tuple((budget, lora, gc) for budget in ("offloading", None) for lora in (False, True)
                       for gc in (False, True))


def check_train_request_trains(loader: Loader, checkpoint, workdir, *, device: str = "cpu",
                               variants=TRAIN_VARIANTS) -> None:
    """Guards 002 (meta-backward): a train request gives a model that trains, nothing on meta, or a clear early refusal.

    With or without LoRA and gradient checkpointing, under a ``max_memory`` that would offload part of the
    model and under none, the loader either refuses (offloading budget only: its error names the memory
    budget, and is not raised from inside the loading libraries) or returns a model with no
    parameter on meta or offloaded whose trainable parameters all get a finite gradient on a real device
    after one forward and backward. ``variants`` are ``(budget, lora, gradient_checkpointing)`` triples, budget
    ``"offloading"`` or ``None`` (default: all eight). Needs peft for the LoRA variants."""

    failures, others, outcomes = [], [], []
    for budget, lora, gc in variants:
        request = LoadRequest(
            checkpoint, purpose="train", device=device, lora=lora, gradient_checkpointing=gc,
            max_memory=offload_budget(checkpoint, device) if budget else None,
            offload_folder=Path(workdir) / f"offload-train-{len(outcomes)}",
        )
        try:
            model, request = contract.load(loader, request, check=CHECK.name).model_and_request
        except LoaderError as exc:
            # Refusing a budget that cannot hold the model for training is write-up 002's fix; any other error
            # is the loader's own, reported as such (an error, not this failure).
            if budget and refusal_problem(exc.original) is None:
                outcomes.append("refused")
                continue
            raise
        label = (f"{'max_memory=' + str(request.max_memory) if budget else 'no max_memory'}, lora={lora}, "
                 f"gradient_checkpointing={gc}" + (f", {request.dtype}" if request.dtype != "float32" else ""))
        if not any(p.requires_grad for p in model.parameters()):  # a frozen base: there is nothing to train
            outcomes.append("frozen")
            del model
            continue
        placed, stepped = placement_problems(model, device), train_step_problems(model, device)
        problems = placed + stepped
        if placed or any(_META_GRADIENT in problem for problem in stepped):  # the mechanism: offloaded weights
            failures.append(f"[{label}]\n    " + "\n    ".join(problems))
        elif problems:  # whole on the device, yet it cannot train: the loader's own problem, not this failure
            others.append(f"[{label}]\n    " + "\n    ".join(problems))
        outcomes.append("trained" if not problems else "cannot train")
        del model
    frozen = outcomes.count("frozen")
    if not failures and not others and frozen and frozen + outcomes.count("refused") == len(outcomes):
        not_exercised(CHECK.name, f"returned a model with no trainable parameter for {frozen} of "
                      f"{len(outcomes)} train requests (a frozen base; the others refused the budget)",
                      "a train step")
    if frozen:
        contract.note(f"{frozen} of {len(outcomes)} train requests got a model with no trainable parameter (a "
                      "frozen base): nothing to judge there")
    if not failures and others:
        raise LoaderModelError(
            f"the loader's model, loaded whole with nothing offloaded, cannot train ({len(others)} of "
            f"{len(outcomes)} train requests; not write-up 002's failure):\n  " + "\n  ".join(others))
    if failures:
        failures += [f"(also, not 002's) {other}" for other in others]
        counts = {o: outcomes.count(o) for o in ("trained", "refused", "cannot train", "frozen")}
        raise AssertionError(
            f"{len(failures)} of {len(outcomes)} train requests failed (write-up 002: a model that will be "
            f"trained must not be offloaded); outcomes {counts}:\n  " + "\n  ".join(failures)
        )


# Isolated: the check patches from_pretrained while the loader runs, and a child can be killed at its deadline.
CHECK = Check(check_train_request_trains, failure=FAILURE, purpose="train", isolated=True)
CHECKS = (CHECK, CHECK.on_gpu())
