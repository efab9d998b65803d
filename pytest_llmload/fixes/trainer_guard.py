"""Keep ``transformers.Trainer`` from treating a placed model as data-parallel (write-up 003).

When one process sees several GPUs, ``TrainingArguments.n_gpu`` is the GPU count and ``Trainer`` treats
the run as data-parallel: it wraps the model in ``torch.nn.DataParallel`` (unless it is quantized in a way
the installed version skips) and multiplies the batch by ``n_gpu``. Trainer resets ``n_gpu`` to 1 only when
the model's ``hf_device_map`` names more than one accelerator. A model placed in a way it does not see, a
bitsandbytes model included, is replicated or fed ``n_gpu`` times the batch: write-up 003's step count
halved (136 to 68) and its first step failed with ``expected mat1 and mat2 to have the same dtype``.
The write-up's fix is ``training_args._n_gpu = 1``; :func:`prepare_training_args_for_placed_model` applies
it when, and only when, the model is placed, and says why in a log warning.

Call it after building the arguments and before building the trainer (trl's ``SFTTrainer`` refuses
``n_gpu > 1`` in its ``__init__``, so afterwards is too late there)::

    >>> import tempfile, torch
    >>> from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TrainingArguments
    >>> from pytest_llmload.loader.tiny_models import build_tiny_checkpoint
    >>> from pytest_llmload.fixes.trainer_guard import prepare_training_args_for_placed_model
    >>> tmp = tempfile.TemporaryDirectory()
    >>> ckpt = build_tiny_checkpoint(tmp.name + "/llama", dtype="bfloat16")
    >>> model = AutoModelForCausalLM.from_pretrained(ckpt, device_map="balanced", quantization_config=
    ...     BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16))
    >>> args = TrainingArguments(output_dir=tmp.name + "/out", use_cpu=True, report_to=[])
    >>> args._n_gpu = 2  # what TrainingArguments computes where 2 GPUs are visible
    >>> prepare_training_args_for_placed_model(args, model)
    True
    >>> args.n_gpu, args.train_batch_size == args.per_device_train_batch_size
    (1, True)
    >>> tmp.cleanup()

:func:`observe_trainer` hands a model to a stock ``Trainer`` with ``n_gpu`` and the device set as a machine with
more GPUs would set them, lets Trainer's own ``__init__`` and ``_wrap_model`` decide (model parallel, ``n_gpu``,
``nn.DataParallel``), runs one training step on the cpu with what it decided, and reports it; the check in
:mod:`pytest_llmload.failures.dp_dtype` is built on it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from typing import Any, Callable, Optional
from unittest import mock

logger = logging.getLogger(__name__)

WRITE_UP = "write-up 003"
DTYPE_ERROR_MARKERS = ("same dtype", "mat1 and mat2")


@dataclasses.dataclass(frozen=True)
class Placement:
    """Whether a model's weights were placed for it (so it must not be replicated), and why."""

    reasons: tuple[str, ...]
    devices: tuple[str, ...]

    @property
    def placed(self) -> bool:
        return bool(self.reasons)

    def __str__(self) -> str:
        return "; ".join(self.reasons) if self.reasons else "not placed (one device, not quantized, no hooks)"


def base_model(model: Any) -> Any:
    """The model under ``nn.DataParallel``/DDP ``.module`` and peft's ``PeftModel`` wrappers."""
    for _ in range(8):  # wrappers nest a few levels at most
        inner = getattr(model, "module", None)
        if inner is not None and type(model).__name__ in ("DataParallel", "DistributedDataParallel"):
            model = inner
            continue
        get_base = getattr(model, "get_base_model", None)
        if callable(get_base) and get_base() is not model:
            model = get_base()
            continue
        break
    return model


def _device_name(device: Any) -> str:
    # hf_device_map values are ints (accelerator indices), "cpu", "disk", "cuda:1" or torch.device.
    return f"cuda:{device}" if isinstance(device, int) else str(device)


def placement_of(model: Any) -> Placement:
    """Why ``model`` (or the model under its peft/DataParallel wrappers) must not be replicated.

    Placed means any of: spread by a ``device_map`` over more than one device (``hf_device_map``), loaded
    quantized (DataParallel cannot replicate bitsandbytes weights; transformers >= 5 skips 4-bit itself,
    4.57 does not), or carrying accelerate's dispatch hooks (a spread whose ``hf_device_map`` was lost).
    """
    base = base_model(model)
    reasons = []
    device_map = getattr(base, "hf_device_map", None) or {}
    devices = tuple(sorted({_device_name(d) for d in device_map.values()}))
    if len(devices) > 1:
        reasons.append(f"spread by device_map over {', '.join(devices)}")
    if getattr(base, "is_loaded_in_4bit", False):
        reasons.append("loaded in 4-bit (bitsandbytes)")
    elif getattr(base, "is_loaded_in_8bit", False):
        reasons.append("loaded in 8-bit (bitsandbytes)")
    elif getattr(base, "quantization_method", None) is not None:
        method = base.quantization_method
        reasons.append(f"quantized ({getattr(method, 'value', method)})")
    if len(devices) <= 1 and hasattr(base, "modules"):
        if any(hasattr(m, "_hf_hook") for m in base.modules()):
            reasons.append("has accelerate dispatch hooks")
    return Placement(tuple(reasons), devices)


def prepare_training_args_for_placed_model(args: Any, model: Any) -> bool:
    """Set ``args._n_gpu = 1`` when ``args.n_gpu > 1`` and ``model`` is placed; returns whether it did.

    The model keeps its placement: only Trainer's data parallelism (``nn.DataParallel``, batch times
    ``n_gpu``) is turned off. An unplaced model on one device is left to Trainer, which may replicate it.
    """
    n_gpu = args.n_gpu
    if n_gpu <= 1:
        return False
    placement = placement_of(model)
    if not placement.placed:
        return False
    args._n_gpu = 1
    logger.warning(
        "pytest_llmload.fixes.trainer_guard: the model is %s, so TrainingArguments.n_gpu is set from %d to 1: "
        "Trainer must not wrap it in nn.DataParallel nor multiply the batch by %d (%s).",
        placement,
        n_gpu,
        n_gpu,
        WRITE_UP,
    )
    return True


def guard_trainer(trainer: Any) -> bool:
    """:func:`prepare_training_args_for_placed_model` for a ``Trainer`` that is already built; call it
    before ``trainer.train()``. Also resets the batch size Trainer cached from ``n_gpu`` in ``__init__``."""
    changed = prepare_training_args_for_placed_model(trainer.args, trainer.model)
    if changed:
        trainer._train_batch_size = trainer.args.train_batch_size
    return changed


@dataclasses.dataclass(frozen=True)
class TrainerObservation:
    """What a stock ``Trainer`` did with a model when told it had ``simulated_n_gpu`` GPUs."""

    transformers_version: str
    simulated_n_gpu: Optional[int]
    placement: Placement
    is_model_parallel: bool  # Trainer's own reading of hf_device_map (on the simulated machine, where simulated)
    n_gpu: int  # args.n_gpu as training used it
    wrapper: Optional[str]  # "DataParallel" when Trainer wrapped the model
    per_device_batch: int
    train_batch_size: int
    first_step_loss: Optional[float]
    first_step_grad_norm: Optional[float]
    reference_loss: Optional[float]  # the model's own loss on the same rows, outside Trainer
    lm_head_calls: tuple[tuple[str, str, bool], ...]  # (input dtype, weight dtype, autocast on)
    error: Optional[str]
    # The hf_device_map Trainer read when it decided (None: the model had none), and the device it was deciding for
    # ("cuda:0" on a simulated machine, where TrainingArguments would have put this process).
    device_map: Optional[dict] = None
    decided_on: Optional[str] = None

    @property
    def data_parallel(self) -> bool:
        return self.wrapper == "DataParallel"

    @property
    def dtype_error(self) -> bool:
        return self.error is not None and any(m in self.error for m in DTYPE_ERROR_MARKERS)

    @property
    def dtype_mismatches(self) -> tuple[tuple[str, str, bool], ...]:
        return tuple(c for c in self.lm_head_calls if c[0] != c[1] and not c[2])

    @property
    def loss_ratio(self) -> Optional[float]:
        if not self.first_step_loss or not self.reference_loss:
            return None
        return self.first_step_loss / self.reference_loss

    def describe(self) -> str:
        """One line: the upstream behaviour seen, with the figures."""
        n = "machine's" if self.simulated_n_gpu is None else f"simulated {self.simulated_n_gpu}"
        read = ""
        if self.decided_on is not None:
            seen = "no hf_device_map" if not self.device_map else f"hf_device_map on {_devices_of(self.device_map)}"
            read = f", Trainer deciding for {self.decided_on} with {seen}"
        parts = [
            f"transformers {self.transformers_version}, n_gpu {n}{read}: model {self.placement}",
            f"Trainer.is_model_parallel={self.is_model_parallel}, n_gpu used={self.n_gpu}",
            "wrapped in nn.DataParallel" if self.data_parallel else "not wrapped",
            f"batch {self.per_device_batch} per device -> {self.train_batch_size} per step",
        ]
        if self.loss_ratio is not None:
            parts.append(
                f"first-step loss {self.first_step_loss:.4f} vs the model's own {self.reference_loss:.4f} "
                f"(x{self.loss_ratio:.3f})"
            )
        if self.first_step_grad_norm is not None:
            parts.append(f"grad norm {self.first_step_grad_norm:.4g}")
        if self.error:
            parts.append(f"first step raised {self.error}")
        return "; ".join(parts)


def _devices_of(device_map: dict) -> str:
    """``cuda:0 (2 modules), cuda:1 (6 modules)``: where a device map sends the modules."""
    counts: dict[str, int] = {}
    for where in device_map.values():
        counts[_device_name(where)] = counts.get(_device_name(where), 0) + 1
    return ", ".join(f"{d} ({n} module{'s' if n > 1 else ''})" for d, n in sorted(counts.items()))


@contextlib.contextmanager
def _device_reads_as(args: Any, device: Any):
    """``args.device`` reads ``device`` (what ``TrainingArguments`` computes where CUDA is visible: ``cuda:0``)
    while Trainer decides; every other ``TrainingArguments`` keeps its own."""
    original = getattr(type(args), "device")  # the property itself

    def device_of(self):
        return device if self is args else original.__get__(self, type(self))

    with mock.patch.object(type(args), "device", property(device_of)):
        yield


@dataclasses.dataclass(frozen=True)
class TrainerDecision:
    """What a stock ``Trainer`` decided for a model, in its own ``__init__`` and ``_wrap_model``."""

    is_model_parallel: bool
    n_gpu: int  # args.n_gpu after Trainer's __init__ (1 where it saw model parallelism)
    wraps: bool  # _wrap_model returned nn.DataParallel
    train_batch_size: int
    device_map: Optional[dict]  # the hf_device_map Trainer read


def trainer_decision(model: Any, args: Any, *, device: Optional[str] = None,
                     prepare_args: Optional[Callable[[Any, Any], Any]] = None) -> TrainerDecision:
    """Build a stock ``Trainer`` for ``model`` with ``args`` (after ``prepare_args(args, model)``, the training
    script's hook) and ask its own code what it does: ``__init__`` reads the model's placement (``hf_device_map``,
    and up to 4.57 ``is_parallelizable``/``model_parallel``), sets ``is_model_parallel`` and resets ``n_gpu`` to 1
    for it; ``_wrap_model`` wraps in ``nn.DataParallel`` or not (up to 4.57 every model but 8-bit ones, from 5.x
    not 4-bit ones either). Nothing is trained. ``args.n_gpu`` keeps what Trainer set.

    ``device``: the device ``args.device`` reads while Trainer decides, for a machine this one is not (``cuda:0``:
    what ``TrainingArguments`` computes where GPUs are visible, and what Trainer compares a one-device
    ``hf_device_map`` with); Trainer's move of the model to that device is skipped (the weights stay put)."""
    import torch
    from transformers import Trainer

    with contextlib.ExitStack() as simulated:
        if device is not None:
            simulated.enter_context(_device_reads_as(args, torch.device(device)))
            simulated.enter_context(mock.patch.object(Trainer, "_move_model_to_device",
                                                      lambda self, model, device: None))
        if prepare_args is not None:
            prepare_args(args, model)
        trainer = Trainer(model=model, args=args)
        wrapped = trainer._wrap_model(trainer.model_wrapped, training=True)
    device_map = getattr(model, "hf_device_map", None)
    return TrainerDecision(
        is_model_parallel=bool(trainer.is_model_parallel), n_gpu=args.n_gpu,
        wraps=type(wrapped).__name__ == "DataParallel", train_batch_size=trainer._train_batch_size,
        device_map=None if device_map is None else {str(k): str(v) for k, v in dict(device_map).items()})


def _rows(vocab_size: int, rows: int, seq_len: int):
    import torch

    # Identical rows: any batch Trainer draws has the same per-token loss as one row, so the loss it
    # reports can be compared with the model's own.
    ids = (torch.arange(seq_len) * 7 + 3) % vocab_size
    row = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return rows

        def __getitem__(self, i: int) -> dict:
            return {k: v.clone() for k, v in row.items()}

    return Rows(), row


def observe_trainer(
    model: Any,
    workdir: "os.PathLike[str] | str",
    *,
    simulated_n_gpu: Optional[int] = 2,
    prepare_args: Optional[Callable[[Any, Any], Any]] = None,
    bf16: bool = True,
    per_device_batch: int = 2,
    seq_len: int = 16,
    after_decision: Optional[Callable[[], None]] = None,
) -> TrainerObservation:
    """Hand ``model`` to a stock ``Trainer`` and run one training step; report what Trainer decided.

    ``simulated_n_gpu`` is written to ``args._n_gpu`` before the Trainer is built: that is the value
    ``TrainingArguments`` computes from ``torch.cuda.device_count()`` where that many GPUs are visible. Trainer's
    decisions are then its own code's (:func:`trainer_decision`), made with ``args.device`` reading ``cuda:0`` as
    on that machine, on the model as given (a caller simulating the machine's placement gives it the
    ``hf_device_map`` from_pretrained would have set there, and restores it in ``after_decision``); the training
    step runs on the cpu with the ``n_gpu`` Trainer kept. ``None`` keeps the machine's count and device, and the
    Trainer that trains decides. ``prepare_args(args, model)`` is the training script's hook between
    ``TrainingArguments`` and ``Trainer``, where write-up 003 put its fix.
    """
    import torch
    import transformers
    from transformers import Trainer, TrainingArguments

    on_gpu = simulated_n_gpu is None and torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=os.fspath(workdir),
        per_device_train_batch_size=per_device_batch,
        max_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=bf16,
        use_cpu=not on_gpu,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    decision = None
    if simulated_n_gpu is not None:
        _ = args.device  # resolve the devices first: that is where n_gpu is computed
        args._n_gpu = simulated_n_gpu
        decision = trainer_decision(model, args, prepare_args=prepare_args,
                                    device="cuda:0" if simulated_n_gpu > 0 else None)
        if after_decision is not None:
            after_decision()
    elif prepare_args is not None:
        prepare_args(args, model)

    vocab_size = base_model(model).config.vocab_size
    dataset, row = _rows(vocab_size, rows=4 * per_device_batch * max(1, args.n_gpu), seq_len=seq_len)
    trainer = Trainer(model=model, args=args, train_dataset=dataset)

    head = model.get_output_embeddings()
    calls: list[tuple[str, str, bool]] = []

    def record(module, inputs):
        x = inputs[0]
        calls.append((str(x.dtype), str(module.weight.dtype), torch.is_autocast_enabled(x.device.type)))

    model.train()  # as Trainer does before its first step (and before the reference forward: see below)
    reference = _reference_loss(model, row, bf16=bf16)
    handle = head.register_forward_pre_hook(record)
    error = None
    try:
        trainer.train()
    except RuntimeError as exc:  # the write-up's failure is a RuntimeError from the first forward
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        handle.remove()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    wrapped = trainer.model_wrapped
    device_map = getattr(model, "hf_device_map", None) if decision is None else decision.device_map
    return TrainerObservation(
        transformers_version=transformers.__version__,
        simulated_n_gpu=simulated_n_gpu,
        placement=placement_of(model),
        is_model_parallel=bool(trainer.is_model_parallel if decision is None else decision.is_model_parallel),
        n_gpu=args.n_gpu,
        wrapper=type(wrapped).__name__ if wrapped is not trainer.model else None,
        per_device_batch=per_device_batch,
        train_batch_size=trainer._train_batch_size,
        first_step_loss=logged[0]["loss"] if logged else None,
        first_step_grad_norm=logged[0].get("grad_norm") if logged else None,
        reference_loss=reference,
        lm_head_calls=tuple(dict.fromkeys(calls)),
        error=error,
        device_map=None if device_map is None else {str(k): str(v) for k, v in dict(device_map).items()},
        decided_on=None if decision is None or simulated_n_gpu == 0 else "cuda:0",
    )


def _reference_loss(model: Any, row: dict, *, bf16: bool) -> Optional[float]:
    """The model's own loss on one row, under the autocast Trainer uses; ``None`` if it does not run."""
    import torch

    device = next(p.device for p in model.parameters())
    batch = {k: v.unsqueeze(0).to(device) for k, v in row.items()}
    # In train mode, as Trainer will run it: on CPU, bitsandbytes 0.50 repacks 4-bit weights on an
    # eval-mode forward, and later training steps then get no gradient through them.
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = float(model(**batch).loss)
    except RuntimeError:  # the step under Trainer shows the same error, with its context
        return None
    return loss if math.isfinite(loss) else None
