"""What the loader under test would do on a runner profile with a full-size architecture: each scenario runs the
loader as it would run there, stops it at ``from_pretrained`` (nothing is loaded or allocated), plans the placement
with transformers' own code (:mod:`pytest_llmload.placement.planned`), estimates memory
(:mod:`pytest_llmload.fixes.training_memory`) and names the known failure the runner would hit, or OOM with the
figures. Every row is a prediction and says what was simulated. The scenarios are the functions declared with
``@_scenario``; the known failure each predicts is named by the failure's own module (``predicted_by``).

What the loader sees, as on each rank of that runner: the request in the profile's sizes (``max_memory`` the
profile's capacities, ``gpu_count`` its GPUs, ``device`` ``cuda:<rank>``), the launcher's environment for the
distributed scenarios, DeepSpeed ZeRO-3 enabled for the ZeRO-3 one, and ``torch.cuda`` reporting the profile's
GPUs (``is_available``, ``device_count``, ``mem_get_info``, ``get_device_properties``) while the loader runs.
"""

from __future__ import annotations

import contextlib
import os
import time
import types
from unittest import mock
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from pytest_llmload.placement import architectures, planned, planner
from pytest_llmload.placement.profiles import RunnerProfile
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.system.sizes import format_bytes

PREDICTION_PREFIX = "predict_"
DEFAULT_DTYPE = "bfloat16"  # what runs on these runners use; --llmload-dtype changes it


class PredictedFailure(AssertionError):
    """A scenario predicts that the runner would hit ``failure`` (a catalog id, or ``"OOM"``)."""

    def __init__(self, failure: str, message: str) -> None:
        super().__init__(message)
        self.failure = failure

    def __reduce__(self):  # crosses a process boundary (an isolated child) as itself
        return PredictedFailure, (self.failure, str(self))


class DevicePrediction(NamedTuple):
    device: str
    modules: int
    weights: int  # bytes of weights placed there
    peak: int  # the scenario's predicted peak there (load, or a training step)
    capacity: Optional[int]  # None: disk, unbounded here


class Prediction(NamedTuple):
    scenario: str
    runner: str
    model: str
    placement: dict  # {module: device}, from the loader's own from_pretrained arguments
    devices: tuple[DevicePrediction, ...]
    asked: dict  # the placement arguments the loader passed (device_map, max_memory, quantization)
    simulated: tuple[str, ...]
    failure: Optional[str] = None
    reason: str = ""
    seconds: float = 0.0

    def summary(self) -> str:
        """One line: the verdict's reason, then each device's peak against its capacity."""
        def peak(d: DevicePrediction) -> str:
            return f"{d.device} {format_bytes(d.peak)}" + (f" of {format_bytes(d.capacity)}" if d.capacity else "")

        if len(self.devices) > 2:
            fullest = max(self.devices, key=lambda d: d.peak / (d.capacity or float("inf")))
            return f"{self.reason} [{len(self.devices)} devices, the fullest {peak(fullest)}]"
        per_device = "; ".join(peak(d) for d in self.devices)
        return self.reason + (f" [{per_device}]" if per_device else "")

    def table(self) -> str:
        """Per device: the modules, the weights, the predicted peak against the capacity."""
        lines = [f"on {self.runner} with {self.model}, would hit {self.failure}: {self.reason}" if self.failure
                 else f"on {self.runner} with {self.model}, nothing known: {self.reason}"]
        for d in self.devices:
            cap = "unbounded" if d.capacity is None else format_bytes(d.capacity)
            over = "  OVER" if d.capacity is not None and d.peak > d.capacity else ""
            lines.append(f"  {d.device:>6}: {d.modules:>4} modules, weights {format_bytes(d.weights):>10}, peak "
                         f"{format_bytes(d.peak):>10} of {cap}{over}")
        lines += [f"  simulated: {note}" for note in self.simulated]
        return "\n".join(lines)


class _Intercepted(BaseException):
    """Raised in place of loading: a BaseException so that a loader's ``except Exception`` does not swallow it."""


def _from_pretrained_intercepted(calls: list, stand_in: Optional[Callable[[dict], Any]] = None):
    """``from_pretrained`` records its arguments and stops the loader there: nothing is read or allocated. With
    ``stand_in``, it returns ``stand_in(kwargs)`` instead (an empty model placed as planned), so that what the loader
    does after loading can be seen."""
    from transformers import PreTrainedModel

    def stop(klass, *args, **kwargs):
        calls.append({"class": klass.__name__, **kwargs})
        if stand_in is not None:
            return stand_in(kwargs)
        raise _Intercepted()

    return mock.patch.object(PreTrainedModel, "from_pretrained", classmethod(stop))


# What a loader may do to the model after loading, recorded on the stand-in instead of done (method: what it asks).
_MOVES_AND_CASTS = ("to", "cuda", "cpu", "half", "float", "bfloat16")


@contextlib.contextmanager
def _after_loading_recorded(seen: list):
    """Moves, casts, adapters and test generations the loader applies to the stand-in, recorded (and skipped: the
    stand-in is on meta). peft's ``PeftModel.from_pretrained`` and ``load_adapter`` return the model as it is."""
    import torch
    from transformers import PreTrainedModel
    from transformers.generation import GenerationMixin

    def recorder(name):
        def record(self, *args, **kwargs):
            dtype = next((a for a in (*args, kwargs.get("dtype")) if isinstance(a, torch.dtype)), None)
            seen.append((name, dtype, args, kwargs))
            return self
        return record

    def warm_up(self, *args, **kwargs):  # a loader's test generation: recorded, as on the runner it would run
        seen.append(("generate", None, args, kwargs))
        return kwargs.get("input_ids", args[0] if args else None)

    def adapter(klass, model, *args, **kwargs):
        seen.append(("PeftModel.from_pretrained", None, args, kwargs))
        return model

    with contextlib.ExitStack() as patches:
        for name in (*_MOVES_AND_CASTS, "load_adapter"):
            patches.enter_context(mock.patch.object(PreTrainedModel, name, recorder(name), create=True))
        patches.enter_context(mock.patch.object(GenerationMixin, "generate", warm_up))
        with contextlib.suppress(ImportError):
            from peft import PeftModel

            patches.enter_context(mock.patch.object(PeftModel, "from_pretrained", classmethod(adapter)))
        yield


def _cuda_reports(profile: RunnerProfile):
    """``torch.cuda`` answers as the runner's would: its GPUs, their total memory, all of it free."""
    import torch

    props = types.SimpleNamespace(total_memory=profile.device_memory, name=profile.device or "GPU", major=9, minor=0,
                                  multi_processor_count=132)
    return mock.patch.multiple(
        torch.cuda, is_available=lambda: profile.devices > 0, device_count=lambda: profile.devices,
        mem_get_info=lambda device=None: (profile.device_memory, profile.device_memory),
        get_device_properties=lambda device=None: props, get_device_name=lambda device=None: props.name)


@contextlib.contextmanager
def _zero3_enabled():
    """DeepSpeed ZeRO-3 as transformers sees it (``is_deepspeed_zero3_enabled()``), as accelerate sets it up."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    config = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    try:
        yield config
    finally:
        unset_hf_deepspeed_config()


def launcher_env(rank: int, world_size: int) -> dict:
    """What torchrun sets in rank ``rank`` of ``world_size`` on one node."""
    return {"WORLD_SIZE": world_size, "RANK": rank, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world_size,
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}


def _preload_outside_the_simulation() -> None:
    """Import what loaders import (peft, which imports bitsandbytes) before ``torch.cuda`` is made to report the
    runner's GPUs: bitsandbytes picks its CUDA backend at import when CUDA looks available, and that fails on a
    machine without it. Where GPUs are visible the report is the machine's own, and nothing is imported early (an
    import that initialises CUDA here would stop the isolated checks from forking)."""
    from pytest_llmload.system import gpus

    if gpus.visible_gpu_count() == 0:
        for module in ("peft", "bitsandbytes"):
            with contextlib.suppress(ImportError):
                __import__(module)


class Call(NamedTuple):
    """What the loader passed to ``from_pretrained`` (``None``: it never called it)."""

    kwargs: Optional[dict]


def run_loader(loader: Callable, request: LoadRequest, profile: RunnerProfile, *, env: Optional[dict] = None,
               zero3: bool = False, stand_in: Optional[Callable[[dict], Any]] = None,
               after: Optional[list] = None) -> Call:
    """Run ``loader(request)`` as on the runner, stopped at ``from_pretrained`` (or, with ``stand_in``, given that
    model and run to its end, what it does after loading recorded in ``after``); the loader's own error propagates
    as :class:`~pytest_llmload.loader.seam.LoaderError`."""
    from pytest_llmload.loader.seam import LoaderError

    _preload_outside_the_simulation()
    calls: list = []
    context = _zero3_enabled() if zero3 else contextlib.nullcontext()
    recorded = _after_loading_recorded(after) if after is not None else contextlib.nullcontext()
    environment = mock.patch.dict(os.environ, {key: str(value) for key, value in (env or {}).items()})
    with environment, context, _cuda_reports(profile), _from_pretrained_intercepted(calls, stand_in), \
            recorded:
        try:
            loader(request)
        except _Intercepted:
            pass
        except planned.PlacementRefused as refused:
            raise PredictedFailure("OOM", f"on {profile.name}, from_pretrained would refuse the placement: "
                                   f"{type(refused.refusal).__name__}: {refused.refusal}") from None
        except LoaderError:
            raise
        except Exception as exc:
            raise LoaderError(exc, getattr(loader, "__qualname__", repr(loader)), request) from exc
    return Call(calls[0] if calls else None)


def _capacity(profile: RunnerProfile, device: str) -> Optional[int]:
    if device == "disk":
        return profile.disk
    if device == "cpu":
        return profile.host_memory
    return profile.device_memory


def _device_name(where: str) -> str:
    return f"cuda:{where}" if where.isdigit() else where


def predict_placement(scenario: str, loader: Callable, request: LoadRequest, profile: RunnerProfile,
                      config: dict, model_name: str, *, env: Optional[dict] = None, zero3: bool = False,
                      simulated: tuple[str, ...] = (), training: bool = False) -> Prediction:
    """One rank's load on ``profile``: where each module goes, bytes and peaks per device."""
    from pytest_llmload.fixes.training_memory import estimate_training_memory, model_tensors

    start = time.perf_counter()
    call = run_loader(loader, request, profile, env=env, zero3=zero3)
    notes = (f"torch.cuda reports {profile.devices} GPU(s) of {format_bytes(profile.device_memory)}"
             if profile.devices else "torch.cuda reports no GPU",) + simulated
    if call.kwargs is None:
        return Prediction(scenario, profile.name, model_name, {}, (), {}, notes, None,
                          "the loader never called from_pretrained: nothing to predict", time.perf_counter() - start)
    kwargs = call.kwargs
    asked = {key: kwargs.get(key) for key in ("device_map", "max_memory", "quantization_config", "offload_state_dict")
             if kwargs.get(key)}
    refusal = None
    if zero3:
        from pytest_llmload.loader.transformers_compat import zero3_device_map_refusal

        refusal = zero3_device_map_refusal(kwargs.get("device_map"))
    try:
        model, device_map, quantizer, dtype = planned.place(config, kwargs, request, profile)
    except planned.PlacementRefused as refused:
        raise PredictedFailure("OOM", f"on {profile.name}, from_pretrained would refuse the placement: "
                               f"{type(refused.refusal).__name__}: {refused.refusal}") from None
    shares = planner.shares(model, device_map, dtype=dtype, hf_quantizer=quantizer)
    total_weights = sum(share.bytes for share in shares.values()) or 1
    step = None
    if training:
        step = estimate_training_memory(request, tensors=model_tensors(model))
    devices = []
    for where, share in shares.items():
        extra = 0 if step is None else int((step.total - step["weights"]) * share.bytes / total_weights)
        devices.append(DevicePrediction(_device_name(where), len(share.modules), share.bytes, share.bytes + extra,
                                        _capacity(profile, where)))
    prediction = Prediction(scenario, profile.name, model_name, device_map, tuple(devices), asked, notes,
                            seconds=time.perf_counter() - start)
    if refusal is not None:
        return prediction._replace(failure="zero3-device-map", reason=f"from_pretrained(device_map="
                                   f"{kwargs.get('device_map')!r}) under ZeRO-3: transformers raises {refusal!r}")
    over = [d for d in devices if d.capacity is not None and d.peak > d.capacity]
    if over:
        d = over[0]
        what = "a training step" if training else "the load"
        return prediction._replace(failure="OOM", reason=f"{what} needs {format_bytes(d.peak)} on {d.device}, which "
                                   f"has {format_bytes(d.capacity)}")
    where = ", ".join(d.device for d in devices) if len(devices) <= 2 else f"{len(devices)} devices"
    return prediction._replace(reason=f"{len(device_map)} map entr{'y' if len(device_map) == 1 else 'ies'} over "
                               f"{where}")


def model_dir(config: dict, workdir: Path) -> Path:
    """The directory the loader is pointed at (written once per workdir): config, tokenizer, the weights' header."""
    dest = Path(workdir) / "model"
    if not (dest / "config.json").is_file():
        import torch

        architectures.write_checkpoint_dir(config, dest, planned.empty(config, getattr(torch, DEFAULT_DTYPE)))
    return dest


# --- the scenarios: one row each; the known failure each predicts is the catalog's to say -------------------------


class Scenario(NamedTuple):
    """A prediction row: ``function(loader, runner, config, model_name, workdir, checkpoint)`` returns the
    :class:`Prediction` or raises :class:`PredictedFailure`; ``failure`` the catalog entry it guards against."""

    function: Callable[..., Prediction]
    failure: Any
    needs_gpus: int = 0

    @property
    def name(self) -> str:
        return self.function.__name__

    @property
    def summary(self) -> str:
        return " ".join((self.function.__doc__ or "").strip().split("\n\n")[0].split())


# name -> (function, GPUs a runner needs for it), in the order the functions are defined below: the rows' order.
_SCENARIOS: dict[str, tuple[Callable[..., Prediction], int]] = {}


def _scenario(needs_gpus: int = 0) -> Callable:
    """Declares the function below a scenario (a runner with fewer than ``needs_gpus`` GPUs skips it). Which known
    failure it predicts, the failure's module says (``KnownFailure.predicted_by``): :func:`scenarios` pairs them."""

    def declare(function: Callable[..., Prediction]) -> Callable[..., Prediction]:
        _SCENARIOS[function.__name__] = (function, needs_gpus)
        return function

    return declare


def scenarios() -> tuple[Scenario, ...]:
    """Every scenario, in the order this module defines them, with the catalog entry that names it."""
    from pytest_llmload.failures import CATALOG

    failure_of = {name: failure for failure in CATALOG for name in failure.predicted_by}
    unknown = sorted(set(failure_of) - set(_SCENARIOS))
    unclaimed = sorted(set(_SCENARIOS) - set(failure_of))
    if unknown or unclaimed:
        raise LookupError(f"the catalog and {__name__} disagree: predicted_by names {unknown or 'nothing'} that is "
                          f"no scenario here; scenarios no failure's predicted_by names: {unclaimed or 'none'}")
    return tuple(Scenario(function, failure_of[name], needs_gpus)
                 for name, (function, needs_gpus) in _SCENARIOS.items())


def _request(model_path: Path, profile: RunnerProfile, rank: int = 0, **fields) -> LoadRequest:
    device = f"cuda:{rank}" if profile.devices else "cpu"
    return LoadRequest(model_path, dtype=fields.pop("dtype", DEFAULT_DTYPE), device=device,
                       gpu_count=profile.devices, **fields)


def _offloaded(prediction: Prediction, profile: RunnerProfile) -> list[str]:
    tiers = ("cpu", "disk") if profile.devices else ("disk",)
    return [name for name, where in prediction.placement.items() if where in tiers]


def _predicts(prediction: Prediction, failure: str, reason: str) -> None:
    """Raise the prediction that the runner would hit ``failure``, for ``reason``."""
    raise PredictedFailure(failure, prediction._replace(failure=failure, reason=reason).table())


def _raise_if(prediction: Prediction) -> Prediction:
    if prediction.failure is not None:
        raise PredictedFailure(prediction.failure, prediction.table())
    return prediction


@_scenario()
def predict_inference_load(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts offload-hang (000) or OOM: an inference load under the runner's memory, and where it offloads."""
    from importlib import metadata

    from packaging.version import Version

    request = _request(model_dir(config, workdir), profile, purpose="inference", max_memory=profile.max_memory,
                       offload_folder=Path(workdir) / "offload")
    prediction = predict_placement("predict_inference_load", loader, request, profile, config, model_name)
    honours = Version(metadata.version("transformers")).release < (4, 57)
    if (prediction.failure is None and _offloaded(prediction, profile) and honours
            and prediction.asked.get("offload_state_dict", False)):
        prediction = prediction._replace(failure="offload-hang", reason="offload_state_dict=True with a placement "
                                         "that offloads, on a transformers that honours it: every cpu-bound weight "
                                         "round-trips through the system temp dir, silently")
    return _raise_if(prediction)


@_scenario()
def predict_train_load(loader, profile, config, model_name, workdir, checkpoint=None, *,
                       max_memory: Optional[dict] = None) -> Prediction:
    """Predicts meta-backward (002) or OOM: a LoRA train load with gradient checkpointing under the runner's memory.

    ``max_memory``: the budget the run gives the loader (default: the runner's capacities)."""
    from pytest_llmload.loader.seam import LoaderError
    from pytest_llmload.checks.ground_truth import refusal_problem

    request = _request(model_dir(config, workdir), profile, purpose="train", lora=True, gradient_checkpointing=True,
                       max_memory=profile.max_memory if max_memory is None else max_memory,
                       offload_folder=Path(workdir) / "offload")
    try:
        prediction = predict_placement("predict_train_load", loader, request, profile, config, model_name,
                                       training=True)
    except LoaderError as exc:
        if refusal_problem(exc.original) is not None:
            raise
        return Prediction("predict_train_load", profile.name, model_name, {}, (), {}, (), None,
                          "the loader refuses the train load before loading, naming the budget (write-up 002's "
                          f"fix): {type(exc.original).__name__}")
    offloaded = _offloaded(prediction, profile)
    if offloaded and prediction.failure is None:
        prediction = prediction._replace(failure="meta-backward", reason=(
            f"the model that will be trained is offloaded: {len(offloaded)} module(s) on cpu/disk, e.g. "
            f"{offloaded[:3]}; backward through them raises 'expected device meta' or trains nothing"))
    return _raise_if(prediction)


@_scenario(needs_gpus=2)
def predict_trainer(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts dp-dtype (003): Trainer's n_gpu and wrap decision for the loader's 4-bit LoRA model on the runner's GPUs."""
    from pytest_llmload.failures import dp_dtype

    start = time.perf_counter()
    note = (f"Trainer's own decision for n_gpu={profile.devices}, made on the tiny checkpoint (it depends on the "
            "GPU count and the model's placement and quantization, not its size)")
    try:
        dp_dtype.CHECK(loader, checkpoint, Path(workdir) / "trainer", simulated_n_gpu=profile.devices)
    except AssertionError as exc:
        failure = dp_dtype.FAILURE.id
        raise PredictedFailure(failure, f"on {profile.name} with {model_name}, would hit {failure}: "
                               f"{str(exc).splitlines()[0]}\n  simulated: {note}") from None
    return Prediction("predict_trainer", profile.name, model_name, {}, (), {}, (note,), None,
                      f"Trainer keeps n_gpu=1 for the loader's model on {profile.devices} GPUs",
                      time.perf_counter() - start)


def _launched(scenario: str, profile, config, model_name, workdir, loader, *, deepspeed: bool, zero3: bool = False):
    """Every rank of a one-node launcher job: the first rank whose placement the runner would refuse, else rank 0's."""
    world = max(profile.devices, 1)
    first = None
    for rank in range(world):
        request = _request(model_dir(config, workdir), profile, rank=rank, purpose="train", deepspeed=deepspeed,
                           zero_stage=3 if zero3 else (2 if deepspeed else None))
        prediction = predict_placement(
            scenario, loader, request, profile, config, model_name, env=launcher_env(rank, world), zero3=zero3,
            simulated=(f"rank {rank} of {world} under torchrun's environment"
                       + (", DeepSpeed ZeRO-3 enabled" if zero3 else ""),))
        if deepspeed and prediction.placement == {"": "cpu"} and prediction.failure is None:
            prediction = _deepspeed_states(prediction, profile, config, request, zero3=zero3, rank=rank)
        first = first or prediction
        if prediction.failure is None and not zero3 and planner.spreads(prediction.placement):
            prediction = prediction._replace(failure="distributed-device-map", reason=(
                f"rank {rank}'s map spans {sorted(set(prediction.placement.values()))}: accelerate refuses it in "
                "any distributed mode ('You can't train a model that has been loaded with `device_map='auto'` in "
                "any distributed mode')"))
        if prediction.failure is not None:
            return _raise_if(prediction)
    return first


def _deepspeed_states(prediction: Prediction, profile, config: dict, request: LoadRequest, *, zero3: bool,
                      rank: int) -> Prediction:
    """No device_map under DeepSpeed: the engine places the model. Its memory per GPU from DeepSpeed's own estimator
    of model states (a full fine-tune, no offload), against the runner's GPU."""
    if not profile.devices:
        return prediction
    model = planned.first_built_for(config)
    total = sum(p.numel() for p in model.parameters())
    if zero3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

        no_split = set(getattr(model, "_no_split_modules", None) or [])
        largest = max((sum(p.numel() for p in m.parameters()) for m in model.modules() if type(m).__name__ in no_split),
                      default=total)
        _, gpu, _ = estimate_zero3_model_states_mem_needs(total, largest, num_gpus_per_node=profile.devices,
                                                          cpu_offload=False, cpu_offload_params=False)
        how = "estimate_zero3_model_states_mem_needs"
    else:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

        _, gpu = estimate_zero2_model_states_mem_needs(total, num_gpus_per_node=profile.devices, cpu_offload=False)
        how = "estimate_zero2_model_states_mem_needs"
    device = DevicePrediction(f"cuda:{rank}", 1, 2 * total // (profile.devices if zero3 else 1), int(gpu),
                              profile.device_memory)
    prediction = prediction._replace(devices=(device,), placement={"": f"cuda:{rank}"}, simulated=(
        prediction.simulated + (f"DeepSpeed places the model (no device_map): its model states per GPU by "
                                f"DeepSpeed's own {how} ({total / 1e9:.1f} B parameters, full fine-tune, no offload)",)),
        reason=f"DeepSpeed places the model: {format_bytes(gpu)} of model states per GPU ({how})")
    if gpu > profile.device_memory:
        return prediction._replace(failure="OOM", reason=f"DeepSpeed's model states need {format_bytes(gpu)} on "
                                   f"each GPU, which has {format_bytes(profile.device_memory)}")
    return prediction


@_scenario(needs_gpus=2)
def predict_launcher_ddp(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts distributed-device-map (004): a train load on every rank of a torchrun job over the runner's GPUs."""
    return _launched("predict_launcher_ddp", profile, config, model_name, workdir, loader, deepspeed=False)


@_scenario(needs_gpus=2)
def predict_launcher_deepspeed(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts distributed-device-map (004): a train load on every rank of a DeepSpeed (ZeRO-2) job, write-up 004's."""
    return _launched("predict_launcher_deepspeed", profile, config, model_name, workdir, loader, deepspeed=True)


@_scenario(needs_gpus=1)
def predict_zero3(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts zero3-device-map: a train load on every rank under DeepSpeed ZeRO-3 passes no device_map."""
    return _launched("predict_zero3", profile, config, model_name, workdir, loader, deepspeed=True, zero3=True)


def _after_loading(scenario: str, loader, profile, config, model_name, workdir, **fields):
    """An inference load run to its end on a stand-in placed as planned: the prediction, what the loader did to the
    model after loading, and whether the planned map offloads."""
    from pytest_llmload.loader.seam import LoaderError
    from pytest_llmload.checks.ground_truth import refusal_problem

    start = time.perf_counter()
    request = _request(model_dir(config, workdir), profile, purpose="inference", max_memory=profile.max_memory,
                       offload_folder=Path(workdir) / "offload", **fields)
    planned_map: dict = {}

    def stand_in(kwargs):
        model, device_map, quantizer, _ = planned.place(config, kwargs, request, profile)
        planned_map.update(device_map)
        fresh = architectures.empty_model(config, planned.dtype_of(kwargs, request))
        fresh.hf_device_map = dict(device_map)
        if quantizer is not None:
            fresh.hf_quantizer, fresh.is_loaded_in_4bit = quantizer, request.quantization == "4bit"
        return fresh

    after: list = []
    try:
        call = run_loader(loader, request, profile, stand_in=stand_in, after=after)
    except LoaderError as exc:
        if refusal_problem(exc.original) is not None:
            raise
        refused = Prediction(scenario, profile.name, model_name, planned_map, (), {}, (), None,
                             f"the loader refuses, naming the budget: {type(exc.original).__name__}")
        return refused, [], []
    notes = ("the loader ran to its end on an empty stand-in placed as planned; its moves, casts and adapter loads "
             "recorded, not done",)
    prediction = Prediction(scenario, profile.name, model_name, planned_map, (), {} if call.kwargs is None else {
        k: call.kwargs.get(k) for k in ("device_map", "max_memory", "quantization_config") if call.kwargs.get(k)},
        notes, seconds=time.perf_counter() - start)
    tiers = ("cpu", "disk") if profile.devices else ("disk",)
    offloads = [name for name, where in planned_map.items() if where in tiers]
    return prediction, after, offloads


@_scenario()
def predict_moved_after_loading(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts move-offloaded: the loader moves or casts a model the runner's placement offloads."""
    prediction, after, offloads = _after_loading("predict_moved_after_loading", loader, profile, config, model_name,
                                                 workdir)
    if prediction.reason:  # the loader refused the budget: no model to move
        return prediction
    moves = [name for name, *_ in after if name in _MOVES_AND_CASTS]
    if moves and offloads:
        _predicts(prediction, "move-offloaded", f"the placement offloads {len(offloads)} module(s) (e.g. "
                  f"{offloads[:2]}) and the loader then calls .{moves[0]}() on the model: accelerate refuses a move "
                  "while parameters are on meta")
    return prediction._replace(reason=f"{'offloads' if offloads else 'no offload'}; after loading: "
                               f"{', '.join('.' + m + '()' for m in moves) or 'no move or cast'}")


@_scenario()
def predict_adapter_on_offloaded(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts adapter-on-offloaded: the loader puts a trained adapter on a base the runner's placement offloads."""
    adapter = Path(workdir) / "adapter"
    adapter.mkdir(parents=True, exist_ok=True)
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}')
    prediction, after, offloads = _after_loading("predict_adapter_on_offloaded", loader, profile, config, model_name,
                                                 workdir, adapter_path=adapter)
    if prediction.reason:  # the loader refused the budget: no adapter met an offloaded base
        return prediction
    adapters = [name for name, *_ in after if name in ("PeftModel.from_pretrained", "load_adapter")]
    if adapters and offloads:
        _predicts(prediction, "adapter-on-offloaded", f"the placement offloads {len(offloads)} module(s) and the "
                  f"loader then calls {adapters[0]}: peft re-dispatches the base without its budget, and the adapter "
                  "meets weights on meta")
    return prediction._replace(reason=f"{'offloads' if offloads else 'no offload'}; adapter: "
                               f"{adapters[0] if adapters else 'not loaded by the loader'}")


@_scenario()
def predict_quantized_cast(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts quantized-cast: the loader casts a 4-bit model after loading (transformers refuses any dtype cast)."""
    prediction, after, _ = _after_loading("predict_quantized_cast", loader, profile, config, model_name, workdir,
                                          quantization="4bit", dtype="float16")
    if prediction.reason:
        return prediction
    casts = [name for name, dtype, *_ in after if name in ("half", "float", "bfloat16") or dtype is not None]
    quantized = "quantization_config" in prediction.asked
    if casts and quantized:
        _predicts(prediction, "quantized-cast", f"the loader asks for a 4-bit model, then calls .{casts[0]}() with a "
                  "dtype on it: transformers refuses any dtype cast of a bitsandbytes model")
    return prediction._replace(reason=f"{'4-bit' if quantized else 'not quantized (the request was ignored)'}; "
                               f"casts after loading: {', '.join(casts) or 'none'}")
