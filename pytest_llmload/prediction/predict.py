"""What the loader under test would do on a runner profile with a full-size architecture: each scenario runs the
loader as it would run there, stops it at ``from_pretrained`` (nothing is loaded or allocated), plans the placement
with transformers' own code (:mod:`pytest_llmload.placement.planned`), estimates memory
(:mod:`pytest_llmload.fixes.training_memory`) and names the known failure the runner would hit, or OOM with the
figures. Every row is a prediction and says what was simulated. The scenarios are the functions declared with
``@_scenario``, each naming the known failure it predicts by its id (the catalog, a layer below, names none).

What the loader sees, as on each rank of that runner: the request in the profile's sizes (``max_memory`` the
profile's capacities, or under a launcher each rank's own budget; ``gpu_count`` its GPUs, ``device``
``cuda:<rank>``, the dtype one the loader declares), the launcher's environment for the distributed scenarios,
DeepSpeed ZeRO-3 enabled for the ZeRO-3 one (``from_pretrained`` refuses a ``device_map`` there, to the loader, as
transformers does), and ``torch.cuda`` answering as the runner's while the loader runs
(:func:`~pytest_llmload.prediction.simulated_machine.cuda_as_on`).

A failure is predicted only where its mechanism is, and the row names the loader's line that reaches it: offloaded
modules are those a ``device_map`` with an accelerator in it sends to cpu or disk
(:func:`~pytest_llmload.prediction.interception.offloaded`), never a model loaded whole on the host.

This module holds the scenarios; what a prediction says is :mod:`~pytest_llmload.prediction.records`, how the
loader's calls are seen without loading is :mod:`~pytest_llmload.prediction.interception`, and the runner it runs on
is :mod:`~pytest_llmload.prediction.simulated_machine`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from pytest_llmload.placement import architectures, planned, planner
from pytest_llmload.placement.profiles import RunnerProfile
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.system.sizes import format_bytes
from pytest_llmload.system.words import a
from pytest_llmload.prediction.interception import CASTS, Event, MOVES, offloaded
from pytest_llmload.prediction.records import DEFAULT_DTYPE, DevicePrediction, PredictedFailure, Prediction, bare_record
from pytest_llmload.prediction.simulated_machine import StandIn, device_shares, launcher_env, run_loader


def predict_placement(scenario: str, loader: Callable, request: LoadRequest, profile: RunnerProfile,
                      config: dict, model_name: str, *, env: Optional[dict] = None, zero3: bool = False,
                      simulated: tuple[str, ...] = (), training: bool = False, to_the_end: bool = False) -> Prediction:
    """One rank's load on ``profile``: where each module goes, bytes and peaks per device. ``to_the_end``: the loader
    gets the :class:`StandIn` and runs on, so that what it does with the model it got counts (a loader that checks
    the placement after loading and refuses it, naming the budget, raises here)."""
    from pytest_llmload.fixes.training_memory import estimate_training_memory, model_tensors

    start = time.perf_counter()
    ran_on = {"stand_in": StandIn(config, request, profile), "after": []} if to_the_end else {}
    call = run_loader(loader, request, profile, env=env, zero3=zero3, **ran_on)
    notes = (f"torch.cuda reports {profile.devices} GPU(s) of {format_bytes(profile.device_memory)}"
             if profile.devices else "torch.cuda reports no GPU",) + simulated + (
        ("the loader ran to its end on an empty stand-in placed as planned",) if to_the_end else ())
    if call.kwargs is None:
        return Prediction(scenario, profile.name, model_name, {}, (), {}, notes, None,
                          "the loader never called from_pretrained: nothing to predict", time.perf_counter() - start)
    kwargs = call.kwargs
    dispatch = getattr(ran_on.get("stand_in"), "dispatch", None)
    if dispatch is not None:  # the loader placed the model itself after loading: that placement is the row's
        call = dispatch._replace(kwargs={**kwargs, **dispatch.kwargs})
        kwargs = call.kwargs
    asked = {key: kwargs.get(key) for key in ("device_map", "max_memory", "quantization_config", "offload_state_dict")
             if kwargs.get(key)}
    zero3 = None if call.refusal is None else (
        f"from_pretrained(device_map={kwargs.get('device_map')!r}) at {call.at} under ZeRO-3: transformers raises "
        f"{call.refusal!r}, and the loader lets it through")
    try:
        if call.model is not None:  # accelerate placed the loader's own model: its map, on that model
            model, device_map, dtype = call.model, kwargs["device_map"], kwargs["dtype"]
            quantizer = getattr(model, "hf_quantizer", None)
        else:
            model, device_map, quantizer, dtype = planned.place(config, kwargs, request, profile)
    except planned.PlacementRefused as refused:
        if zero3 is not None:  # from_pretrained's first check refuses it before any placement is tried
            return Prediction(scenario, profile.name, model_name, {}, (), asked, notes, "zero3-device-map", zero3,
                              time.perf_counter() - start, call.at)
        raise PredictedFailure("OOM", f"on {profile.name}, from_pretrained would refuse the placement: "
                               f"{type(refused.refusal).__name__}: {refused.refusal}") from None
    step = estimate_training_memory(request, tensors=model_tensors(model)) if training else None
    moved = _moved_whole_to(request, profile, kwargs, device_map)
    # (a model moved whole to its GPU trains there: the host holds its weights only while it loads)
    devices = device_shares(model, device_map, profile, dtype=dtype, quantizer=quantizer,
                            step=None if moved else step)
    prediction = Prediction(scenario, profile.name, model_name, device_map, devices, asked, notes,
                            seconds=time.perf_counter() - start, at=call.at)
    if zero3 is not None:  # (the map it asked for, which from_pretrained refuses before placing anything)
        return prediction._replace(failure="zero3-device-map", reason=zero3)
    oom = _over_capacity(prediction, "a training step" if training and not moved else "the load")
    if oom.failure is not None:
        return oom
    if moved is not None:
        gpu = device_shares(model, {"": moved}, profile, dtype=dtype, quantizer=quantizer, step=step)
        return _over_capacity(prediction._replace(
            placement={"": moved}, devices=gpu, simulated=prediction.simulated + (
                f"no device_map: from_pretrained loads the model whole on the host, then Trainer (its "
                f"_move_model_to_device), DDP or the training script moves it whole to this rank's {moved}",),
            reason=f"no device_map: loaded whole on the host, then moved whole to {moved} to be trained; nothing is "
                   "offloaded"), f"the model moved whole to {moved} (from_pretrained at {call.at}, no device_map)"
                                  + (", with a training step," if step is not None else ""))
    if kwargs.get("device_map") is None:
        return prediction._replace(reason="no device_map: from_pretrained loads the model whole on the host (cpu), "
                                   "where the script, DDP or DeepSpeed moves it whole; nothing is offloaded")
    where = ", ".join(d.device for d in devices) if len(devices) <= 2 else f"{len(devices)} devices"
    return prediction._replace(reason=f"{len(device_map)} map entr{'y' if len(device_map) == 1 else 'ies'} over "
                               f"{where}")


def _moved_whole_to(request: LoadRequest, profile: RunnerProfile, kwargs: dict, device_map: dict) -> Optional[str]:
    """The GPU a train load's model goes to whole, where from_pretrained leaves it whole on the host (no
    ``device_map``) on a runner with GPUs: the rank's own (``request.device``), where Trainer's
    ``_move_model_to_device``, DDP (``DistributedDataParallel(model.to(rank))``) or the training script moves it
    before the first step. ``None`` elsewhere: an inference load (what the script does after loading is
    ``predict_moved_after_loading``'s to see), a map of the loader's own, a CPU runner, or DeepSpeed, whose engine
    places the model by its ZeRO stage (:func:`_deepspeed_states`)."""
    if (request.purpose != "train" or request.deepspeed or not profile.devices or kwargs.get("device_map") is not None
            or device_map != {"": "cpu"}):
        return None
    return request.device


def _over_capacity(prediction: Prediction, what: str) -> Prediction:
    """``prediction`` as an OOM where ``what`` (the load, a training step) needs more on a device than it has."""
    over = [d for d in prediction.devices if d.capacity is not None and d.peak > d.capacity]
    if not over:
        return prediction
    return prediction._replace(failure="OOM", reason=f"{what} needs {format_bytes(over[0].peak)} on {over[0].device}, "
                               f"which has {format_bytes(over[0].capacity)}")


def model_dir(config: dict, workdir: Path) -> Path:
    """The directory the loader is pointed at (written once per workdir): config, tokenizer, the weights' header."""
    dest = Path(workdir) / "model"
    if not (dest / "config.json").is_file():
        import torch

        architectures.write_checkpoint_dir(config, dest, planned.empty(config, getattr(torch, DEFAULT_DTYPE)))
        # as a checkpoint ships it (loaders read it: GenerationConfig.from_pretrained(path))
        ids = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id") if key in config}
        (dest / "generation_config.json").write_text(json.dumps(ids), encoding="utf-8")
    return dest


def adapter_dir(config: dict, workdir: Path) -> Path:
    """A trained LoRA adapter as peft saves one, for the base in :func:`model_dir` (``base_model_name_or_path``
    names it, as loaders that serve an adapter read it), on the first linear layer of its first block; without its
    weights, which the stand-in's peft does not read."""
    dest = Path(workdir) / "adapter"
    if not (dest / "adapter_config.json").is_file():
        import torch

        model = planned.empty(config, getattr(torch, DEFAULT_DTYPE))
        target = next(name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                      if isinstance(module, torch.nn.Linear) and ".0." in name)
        dest.mkdir(parents=True, exist_ok=True)
        (dest / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "target_modules": [target],
            "base_model_name_or_path": str(model_dir(config, workdir))}), encoding="utf-8")
    return dest


# --- the scenarios: one row each, naming the known failure it predicts ------------------------------------------


class Scenario(NamedTuple):
    """A prediction row: ``function(loader, runner, config, model_name, workdir, checkpoint)`` returns the
    :class:`Prediction` or raises :class:`PredictedFailure`; ``failure`` the catalog entry it guards against."""

    function: Callable[..., Prediction]
    failure: Any
    needs_gpus: int = 0
    purpose: str = "inference"  # what the scenario asks the loader for; a loader declared for the other one skips it

    @property
    def name(self) -> str:
        return self.function.__name__

    def inapplicable_reason(self, loader: Any) -> Optional[str]:
        """Why this scenario does not apply to ``loader`` (a :class:`~pytest_llmload.loader.seam.LoaderUnderTest`),
        as :meth:`~pytest_llmload.checks.base.Check.inapplicable_reason` decides it for a check: the loader is
        declared for another purpose, the repo declared every check of the failure not applicable, or it declared
        that it never trains the way the scenario runs (only under DeepSpeed: no DDP launch). ``None``: it applies.
        (Trainer's declarations are the Trainer check's own, which the Trainer scenario runs.)"""
        from pytest_llmload.checks.base import DECLARED_NOT_APPLICABLE
        from pytest_llmload.failures import REGISTRY

        purposes = getattr(loader, "purposes", None)
        if purposes is not None and self.purpose not in purposes:
            return (f"{self.name}: loader {loader.name} is declared for {' and '.join(purposes)} only; this "
                    f"scenario runs {a(self.purpose)} load")
        declared = getattr(loader, "not_applicable_reason", lambda name: None)
        reasons = [declared(check.name) for check in REGISTRY if check.failure.id == self.failure.id
                   and not check.name.endswith("_cuda")]
        if reasons and all(reasons):
            return (f"{DECLARED_NOT_APPLICABLE}{self.name}: {reasons[0]} (declared for loader {loader.name}, for "
                    f"every check of {self.failure.id})")
        if self.name == "predict_launcher_ddp" and _declares(loader, "trains_under_deepspeed"):
            return (f"{DECLARED_NOT_APPLICABLE}{self.name}: loader {loader.name} is declared to train only under "
                    "DeepSpeed (llmload_trains_under_deepspeed): a DDP launch is not how it trains")
        return None

    @property
    def summary(self) -> str:
        return " ".join((self.function.__doc__ or "").strip().split("\n\n")[0].split())


def _declares(loader: Any, keyword: str) -> bool:
    """Whether the run declares ``keyword`` (a :data:`~pytest_llmload.config.vocabulary.TRAINING_DECLARATIONS`
    one) for the loader: the configuration's, else the loader function's attribute, as a check reads it."""
    from pytest_llmload.config.stash_keys import configured

    return configured.get().declares(keyword, loader)


# name -> (function, the id of the failure it predicts, GPUs a runner needs for it, purpose), in the order the
# functions are defined below: the rows'.
_SCENARIOS: dict[str, tuple[Callable[..., Prediction], str, int, str]] = {}


def _scenario(predicts: str, needs_gpus: int = 0, purpose: str = "inference") -> Callable:
    """Declares the function below a scenario that predicts the known failure whose id is ``predicts`` (a runner
    with fewer than ``needs_gpus`` GPUs skips it; a loader declared for another ``purpose`` skips it)."""

    def declare(function: Callable[..., Prediction]) -> Callable[..., Prediction]:
        _SCENARIOS[function.__name__] = (function, predicts, needs_gpus, purpose)
        return function

    return declare


def scenarios() -> tuple[Scenario, ...]:
    """Every scenario, in the order this module defines them, with the catalog entry of the failure it predicts."""
    from pytest_llmload.failures import BY_ID

    unknown = {name: failure_id for name, (_, failure_id, *_) in _SCENARIOS.items() if failure_id not in BY_ID}
    if unknown:
        raise LookupError(f"{__name__}: scenarios predict failures the catalog lacks: {unknown} (its ids: "
                          f"{sorted(BY_ID)})")
    return tuple(Scenario(function, BY_ID[failure_id], needs_gpus, purpose)
                 for function, failure_id, needs_gpus, purpose in _SCENARIOS.values())


def _request(model_path: Path, profile: RunnerProfile, loader: Any, rank: int = 0, **fields) -> LoadRequest:
    """What the scenario asks rank ``rank`` of the runner for, in a dtype the loader declares it loads
    (``llmload_dtypes``), as a check asks it."""
    device = f"cuda:{rank}" if profile.devices else "cpu"
    dtype = fields.pop("dtype", DEFAULT_DTYPE)
    declared = getattr(loader, "dtypes", None)
    return LoadRequest(model_path, dtype=declared[0] if declared and dtype not in declared else dtype, device=device,
                       gpu_count=profile.devices, **fields)


def _predicts(prediction: Prediction, failure: str, reason: str) -> None:
    """Raise the prediction that the runner would hit ``failure``, for ``reason``."""
    _raise_if(prediction._replace(failure=failure, reason=reason))


def _raise_if(prediction: Prediction) -> Prediction:
    if prediction.failure is not None:
        raise PredictedFailure(prediction.failure, prediction.table(), prediction.record())
    return prediction


@_scenario("offload-hang")
def predict_inference_load(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts offload-hang (000) or OOM: an inference load under the runner's memory, and where it offloads."""
    from importlib import metadata

    from packaging.version import Version

    request = _request(model_dir(config, workdir), profile, loader, purpose="inference",
                       max_memory=profile.max_memory, offload_folder=Path(workdir) / "offload")
    prediction = predict_placement("predict_inference_load", loader, request, profile, config, model_name)
    if prediction.failure is None and prediction.placement == {"": "cpu"}:  # whole on the host: a served model
        # may be placed after loading (accelerate's dispatch_model), which the row then predicts as from_pretrained's
        placed_after = predict_placement("predict_inference_load", loader, request, profile, config, model_name,
                                         to_the_end=True)
        prediction = placed_after if placed_after.placement != prediction.placement else prediction
    honours = Version(metadata.version("transformers")).release < (4, 57)
    if (prediction.failure is None and offloaded(prediction.placement) and honours
            and prediction.asked.get("offload_state_dict", False)):
        prediction = prediction._replace(failure="offload-hang", reason=(
            f"offload_state_dict=True at {prediction.at} with a placement that offloads, on a transformers that "
            "honours it: every cpu-bound weight round-trips through the system temp dir, silently"))
    return _raise_if(prediction)


def _refused(scenario: str, profile: RunnerProfile, model_name: str, exc: Any, request: LoadRequest, *,
             simulated: tuple = ()) -> Prediction:
    """The row of a loader that refuses the request before loading, naming its budget (write-up 002's fix): no
    failure. ``exc`` a :class:`~pytest_llmload.loader.seam.LoaderError` whose original is such a refusal; any
    other error of the loader is raised again."""
    from pytest_llmload.checks.ground_truth import refusal_problem

    if refusal_problem(exc.original) is not None:
        raise exc
    return Prediction(scenario, profile.name, model_name, {}, (), {}, simulated, None,
                      f"the loader refuses the {request.purpose} load, naming the budget (write-up 002's fix): "
                      f"{type(exc.original).__name__}")


@_scenario("meta-backward", purpose="train")
def predict_train_load(loader, profile, config, model_name, workdir, checkpoint=None, *,
                       max_memory: Optional[dict] = None) -> Prediction:
    """Predicts meta-backward (002) or OOM: a LoRA train load with gradient checkpointing under the runner's memory.

    ``max_memory``: the budget the run gives the loader (default: the runner's capacities)."""
    from pytest_llmload.loader.seam import LoaderError

    request = _request(model_dir(config, workdir), profile, loader, purpose="train", lora=True,
                       gradient_checkpointing=True, max_memory=profile.max_memory if max_memory is None else max_memory,
                       offload_folder=Path(workdir) / "offload")
    try:
        prediction = predict_placement("predict_train_load", loader, request, profile, config, model_name,
                                       training=True)
        if offloaded(prediction.placement) and prediction.failure is None:  # run on: does it check and refuse?
            prediction = predict_placement("predict_train_load", loader, request, profile, config, model_name,
                                           training=True, to_the_end=True)
    except LoaderError as exc:
        return _refused("predict_train_load", profile, model_name, exc, request)
    offloads = offloaded(prediction.placement)
    if offloads and prediction.failure is None:
        prediction = prediction._replace(failure="meta-backward", reason=(
            f"the model that will be trained is offloaded by from_pretrained(device_map="
            f"{prediction.asked.get('device_map')!r}) at {prediction.at}: {len(offloads)} module(s) on cpu/disk, "
            f"e.g. {offloads[:3]}; backward through them raises 'expected device meta' or trains nothing"))
    return _raise_if(prediction)


@_scenario("dp-dtype", needs_gpus=2, purpose="train")
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
        reason = _trainer_on_this_stack(str(exc).splitlines()[0], profile.devices)
        raise PredictedFailure(failure, f"on {profile.name} with {model_name}, would hit {failure}: {reason}\n"
                               f"  simulated: {note}", bare_record("predict_trainer", profile.name, model_name,
                                                                   failure, reason)) from None
    return Prediction("predict_trainer", profile.name, model_name, {}, (), {}, (note,), None,
                      f"Trainer keeps n_gpu=1 for the loader's model on {profile.devices} GPUs",
                      time.perf_counter() - start)


def _trainer_on_this_stack(observed: str, n_gpu: int) -> str:
    """What Trainer does on the installed transformers with the loader's 4-bit model on ``n_gpu`` GPUs, from what the
    Trainer check observed of it (``observed``, its finding's line). transformers 4.x's ``_wrap_model`` wraps any
    model but an 8-bit one in ``nn.DataParallel`` where ``n_gpu > 1``, and the dtype mismatch of write-up 003 follows;
    5.x skips ``nn.DataParallel`` for 4-bit and 8-bit models but still counts every GPU (``TrainingArguments.n_gpu``
    is ``torch.cuda.device_count()`` outside a launcher, and only a map over several GPUs makes Trainer set it to 1)."""
    from importlib import metadata

    version = metadata.version("transformers")
    seen = observed.split("): ", 1)[-1] if observed.startswith("seed ") else observed  # (the check's own heading)
    if "Trainer wrapped the model in nn.DataParallel" in seen:
        return (f"on transformers {version}, Trainer wraps the loader's 4-bit model in nn.DataParallel (n_gpu={n_gpu}: "
                f"its _wrap_model skips only 8-bit models), and on the GPUs the replicas' first step mixes dtypes at "
                f"the lm_head. Seen on the tiny checkpoint: {seen}")
    return (f"on transformers {version}, Trainer does not wrap a 4-bit model in nn.DataParallel, but counts "
            f"n_gpu={n_gpu}: each step takes {n_gpu}x the per-device batch, its loss is scaled by n_gpu, and the steps "
            f"per epoch divide by {n_gpu}. Seen on the tiny checkpoint: {seen}")


def rank_budget(profile: RunnerProfile, rank: int, world: int) -> dict:
    """What one rank of a launcher job on ``profile`` may use, in ``max_memory``'s format: its own GPU (the one
    ``LOCAL_RANK`` names) and its share of the host's memory (every rank loads on the same host)."""
    return {rank: profile.device_memory, "cpu": profile.host_memory // world}


def _launched(scenario: str, profile, config, model_name, workdir, loader, *, deepspeed: bool, zero3: bool = False):
    """Every rank of a one-node launcher job, each asked twice as runs ask it: with no ``max_memory`` (write-up
    004's run) and with the rank's own budget (:func:`rank_budget`, for loaders that place by the budget they are
    given). The first (rank, budget) the runner would refuse, else rank 0's first."""
    from pytest_llmload.loader.seam import LoaderError

    world = max(profile.devices, 1)
    first = None
    for rank in range(world):
        for budget in (None, rank_budget(profile, rank, world)):
            request = _request(model_dir(config, workdir), profile, loader, rank=rank, purpose="train",
                               deepspeed=deepspeed, zero_stage=3 if zero3 else (2 if deepspeed else None),
                               max_memory=budget)
            given = "no max_memory" if budget is None else "its budget max_memory={" + ", ".join(
                f"{key!r}: {format_bytes(value)}" for key, value in budget.items()) + "}"
            simulated = (f"rank {rank} of {world} under torchrun's environment, {given}"
                         + (", DeepSpeed ZeRO-3 enabled" if zero3 else ""),)
            try:
                prediction = predict_placement(scenario, loader, request, profile, config, model_name,
                                               env=launcher_env(rank, world), zero3=zero3, simulated=simulated)
            except LoaderError as exc:
                prediction = _refused(scenario, profile, model_name, exc, request, simulated=simulated)
            if (deepspeed and prediction.placement == {"": "cpu"} and "device_map" not in prediction.asked
                    and prediction.failure is None):
                prediction = _deepspeed_states(prediction, profile, config, request, zero3=zero3, rank=rank)
            first = first or prediction
            if prediction.failure is None and not zero3 and planner.spreads(prediction.placement):
                prediction = prediction._replace(failure="distributed-device-map", reason=(
                    f"from_pretrained(device_map={prediction.asked.get('device_map')!r}) at {prediction.at}: rank "
                    f"{rank}'s map ({given}) spans {sorted(set(prediction.placement.values()))}: accelerate refuses "
                    "it in any distributed mode ('You can't train a model that has been loaded with "
                    "`device_map='auto'` in any distributed mode')"))
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
    # The weights each GPU holds, in the bytes the planner counts for the loaded dtype (from_pretrained's map of the
    # whole model on the host): ZeRO-0/1/2 keep a full copy on every GPU, ZeRO-3 a 1/n partition of them.
    weights = sum(device.weights for device in prediction.devices) // (profile.devices if zero3 else 1)
    device = DevicePrediction(f"cuda:{rank}", 1, weights, max(int(gpu), weights), profile.device_memory)
    prediction = prediction._replace(devices=(device,), placement={"": f"cuda:{rank}"}, simulated=(
        prediction.simulated + (f"DeepSpeed places the model (no device_map): its model states per GPU by "
                                f"DeepSpeed's own {how} ({total / 1e9:.1f} B parameters, full fine-tune, no offload)",)),
        reason=f"DeepSpeed places the model: {format_bytes(gpu)} of model states per GPU ({how})")
    if weights > profile.device_memory:  # whatever is trained (LoRA too): the weights alone do not fit
        share = f"a 1/{profile.devices} partition" if zero3 else "a full copy"
        return prediction._replace(failure="OOM", reason=(
            f"DeepSpeed ZeRO-{3 if zero3 else 2} puts {share} of the weights on each GPU: {format_bytes(weights)} "
            f"on cuda:{rank}, which has {format_bytes(profile.device_memory)}"))
    if gpu > profile.device_memory:
        return prediction._replace(failure="OOM", reason=f"DeepSpeed's model states need {format_bytes(gpu)} on "
                                   f"each GPU, which has {format_bytes(profile.device_memory)}")
    return prediction


@_scenario("distributed-device-map", needs_gpus=2, purpose="train")
def predict_launcher_ddp(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts distributed-device-map (004): a train load on every rank of a torchrun job over the runner's GPUs."""
    return _launched("predict_launcher_ddp", profile, config, model_name, workdir, loader, deepspeed=False)


@_scenario("distributed-device-map", needs_gpus=2, purpose="train")
def predict_launcher_deepspeed(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts distributed-device-map (004): a train load on every rank of a DeepSpeed (ZeRO-2) job, write-up 004's."""
    return _launched("predict_launcher_deepspeed", profile, config, model_name, workdir, loader, deepspeed=True)


@_scenario("zero3-device-map", needs_gpus=1, purpose="train")
def predict_zero3(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts zero3-device-map: a train load on every rank under DeepSpeed ZeRO-3 passes no device_map."""
    return _launched("predict_zero3", profile, config, model_name, workdir, loader, deepspeed=True, zero3=True)


class AfterLoading(NamedTuple):
    """An inference load run to its end on the stand-in: the row so far, what the loader did after loading
    (:class:`Event`), what from_pretrained's map offloads (:func:`offloaded`), whether it was asked for a quantized
    model, and whether the loader refused the budget instead (nothing loaded)."""

    prediction: Prediction
    events: list
    offloads: list
    quantized: bool
    refused: bool = False

    def offloaded_before(self, event: Event) -> str:
        """The start of a finding about ``event``, a call the loader made on what the load offloaded."""
        return (f"from_pretrained(device_map={self.prediction.asked.get('device_map')!r}) at {self.prediction.at} "
                f"offloads {len(event.on_offloaded)} module(s)")

    def reason(self, nothing: str) -> str:
        """The row's reason: whether the load offloads, and what the loader did after it (``nothing``: if nothing)."""
        return f"{'offloads' if self.offloads else 'no offload'}; after loading: {_done(self.events) or nothing}"


def _after_loading(scenario: str, loader, profile, config, model_name, workdir, **fields) -> AfterLoading:
    """An inference load run to its end on the model from_pretrained would return, without weights
    (:class:`StandIn`), what it does after loading recorded (:func:`after_loading_recorded`)."""
    from pytest_llmload.loader.seam import LoaderError

    start = time.perf_counter()
    request = _request(model_dir(config, workdir), profile, loader, purpose="inference",
                       max_memory=profile.max_memory, offload_folder=Path(workdir) / "offload", **fields)
    stand_in = StandIn(config, request, profile)
    after: list = []
    try:
        call = run_loader(loader, request, profile, stand_in=stand_in, after=after)
    except LoaderError as exc:
        refused = _refused(scenario, profile, model_name, exc, request)
        return AfterLoading(refused._replace(placement=stand_in.placement, devices=stand_in.devices), [], [],
                            stand_in.quantized, refused=True)
    notes = ("the loader ran to its end on an empty stand-in placed as planned, peft's own objects on its empty "
             "weights; its moves, casts, dispatches and test generations recorded, not done (stopped where the "
             "runner would raise)",)
    asked = {} if call.kwargs is None else {
        k: call.kwargs.get(k) for k in ("device_map", "max_memory", "quantization_config", "load_in_4bit",
                                        "load_in_8bit") if call.kwargs.get(k)}
    prediction = Prediction(scenario, profile.name, model_name, stand_in.placement, stand_in.devices, asked, notes,
                            seconds=time.perf_counter() - start, at=call.at)
    _raise_if(_over_capacity(prediction, "the load"))  # (the runner stops there: nothing after it runs)
    return AfterLoading(prediction, after, offloaded(stand_in.placement), stand_in.quantized)


def _done(events: list) -> str:
    """What the loader did after loading, in a few words: ``.to('cuda:0') at x.py:12, ...``."""
    def one(event: Event) -> str:
        what = f".{event.name}({event.device!r})" if event.name in MOVES and event.device else (
            f".{event.name}()" if event.name in MOVES or event.name in CASTS else event.name)
        return f"{what} at {event.at}" if event.at else what

    return ", ".join(dict.fromkeys(one(event) for event in events if event.name != "generate"))


@_scenario("move-offloaded")
def predict_moved_after_loading(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts move-offloaded (or OOM): the loader moves a model the runner's placement offloads (or a whole one to
    a GPU that cannot hold it)."""
    loaded = _after_loading("predict_moved_after_loading", loader, profile, config, model_name, workdir)
    prediction = loaded.prediction
    if loaded.refused:  # the loader refused the budget: no model to move
        return prediction
    moves = [event for event in loaded.events if event.name in MOVES]
    offloaded_moves = [event for event in moves if event.on_offloaded]
    if offloaded_moves:
        move = offloaded_moves[0]
        _predicts(prediction._replace(at=move.at), "move-offloaded", (
            f"{loaded.offloaded_before(move)} (e.g. {list(move.on_offloaded[:2])}) and the loader then calls "
            f".{move.name}() on the model at {move.at}: accelerate refuses a move while parameters are on meta"))
    weights = sum(device.weights for device in prediction.devices)
    to_gpu = [event for event in moves if (event.device or "").startswith("cuda")]
    if to_gpu and not loaded.offloads and profile.devices and weights > profile.device_memory:
        move = to_gpu[0]
        _predicts(prediction._replace(at=move.at), "OOM", (
            f"the loader moves the whole model ({format_bytes(weights)} of weights) to {move.device} at {move.at}, "
            f"which has {format_bytes(profile.device_memory)}"))
    return prediction._replace(reason=loaded.reason("no move or cast"))


@_scenario("adapter-on-offloaded")
def predict_adapter_on_offloaded(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts adapter-on-offloaded: the loader puts a trained adapter on a base the runner's placement offloads."""
    loaded = _after_loading("predict_adapter_on_offloaded", loader, profile, config, model_name, workdir,
                            adapter_path=adapter_dir(config, workdir))
    prediction = loaded.prediction
    if loaded.refused:  # the loader refused the budget: no adapter met an offloaded base
        return prediction
    adapters = [event for event in loaded.events if event.name in ("PeftModel.from_pretrained", "load_adapter")]
    on_offloaded = [event for event in adapters if event.on_offloaded]
    if on_offloaded:
        adapter = on_offloaded[0]
        _predicts(prediction._replace(at=adapter.at), "adapter-on-offloaded", (
            f"{loaded.offloaded_before(adapter)} and the loader then calls {adapter.name} at {adapter.at}: peft "
            "re-dispatches the base without its budget, and the adapter meets weights on meta"))
    return prediction._replace(reason=loaded.reason("no adapter loaded"))


@_scenario("quantized-cast")
def predict_quantized_cast(loader, profile, config, model_name, workdir, checkpoint=None) -> Prediction:
    """Predicts quantized-cast: the loader casts a 4-bit model after loading (transformers refuses any dtype cast)."""
    loaded = _after_loading("predict_quantized_cast", loader, profile, config, model_name, workdir,
                            quantization="4bit", dtype="float16")
    prediction = loaded.prediction
    if loaded.refused:
        return prediction
    casts = [event for event in loaded.events if event.dtype is not None]
    if casts and loaded.quantized:
        cast = casts[0]
        _predicts(prediction._replace(at=cast.at), "quantized-cast", (
            f"the loader asks for a 4-bit model at {prediction.at}, then calls .{cast.name}() with a dtype on it at "
            f"{cast.at}: transformers refuses any dtype cast of a bitsandbytes model"))
    return prediction._replace(reason=f"{'4-bit' if loaded.quantized else 'not quantized (the request was ignored)'}"
                               f"; casts after loading: {', '.join(f'.{e.name}() at {e.at}' for e in casts) or 'none'}")
