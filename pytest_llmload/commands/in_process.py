"""What runs inside every Python process of a command under ``pytest-llmload run``: started by the bootstrap
(:mod:`.bootstrap`) where :data:`RUN_DIR_VARIABLE` names the run's folder, idle otherwise.

It changes nothing until the command imports what it wraps (a hook on the import of each module named in
:data:`AFTER_IMPORT`): every ``from_pretrained`` of a model, config, tokenizer or generation config gets the tiny
checkpoint of the same architecture (:mod:`.tiny_weights`); a Trainer stops after the run's optimizer steps with its
outputs in the run's folder, a plain or accelerate loop ends its process after as many ``optimizer.step()`` calls;
``generate`` makes a few new tokens; saved models go to the run's folder. It records what the known failures'
mechanisms need (:class:`Findings`: each load's placement, the steps, the scalers' unscales, Trainer's GPU count,
the distributed environment, generate calls, the crash and where it happened in the repo) into one JSON file per
process, which the parent reads (:mod:`.rows`). On SIGUSR1 it writes every thread's stack (the run's deadline).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

RUN_DIR_VARIABLE = "PYTEST_LLMLOAD_RUN_DIR"
SETTINGS_FILE = "settings.json"
STACK_SIGNAL = signal.SIGUSR1
GENERATE_TOKENS = 4  # the most new tokens a generate call makes in a bounded run
# The environment a launcher sets on each rank: the process is one of a distributed job.
DISTRIBUTED_VARIABLES = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


class Findings:
    """What this process did, as the parent reads it: written whole at exit (and at a crash, before the exit)."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / f"process-{os.getpid()}.json"
        self.record: dict[str, Any] = {
            "pid": os.getpid(), "argv": list(sys.argv), "outcome": "finished", "steps": 0, "unscales": 0,
            "generates": 0, "loads": [], "trainers": [], "redirected": [], "saved": [], "crash": None,
            "watch_errors": [], "adapters": [],
            "distributed": {name: os.environ[name] for name in DISTRIBUTED_VARIABLES if name in os.environ},
            "started": time.time()}

    def write(self) -> None:
        self.record["ended"] = time.time()
        self.path.write_text(json.dumps(self.record, default=str))


class _Run:
    """The run's settings (written by the parent) and this process's findings."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        self.settings = json.loads((run_dir / SETTINGS_FILE).read_text())
        self.findings = Findings(run_dir)
        self.output_dir = Path(self.settings["output_dir"])
        self.in_trainer = 0  # Trainer.train calls under way: their steps are bounded by max_steps


RUN: Optional[_Run] = None


def start() -> None:
    """Install the hooks where the environment names a run; nothing otherwise (a process outside a run)."""
    global RUN
    run_dir = os.environ.get(RUN_DIR_VARIABLE)
    if not run_dir or RUN is not None:
        return
    RUN = _Run(Path(run_dir))
    (RUN.dir / f"pid-{os.getpid()}").touch()  # the parent ends every process of the run at its deadline
    stacks = open(RUN.dir / f"stacks-{os.getpid()}.txt", "w")  # (open for the process's life: faulthandler's file)
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    sys.excepthook = functools.partial(_record_crash, sys.excepthook)
    atexit.register(RUN.findings.write)
    sys.meta_path.insert(0, _AfterImport())


# --- the command's crash, where it happened in the repo ---------------------------------------------------

def is_repo_file(filename: str) -> bool:
    """A file of the repo's code: not a library's, Python's, an environment's scripts (a launcher's ``bin/torchrun``),
    a package on a ``PYTHONPATH`` entry outside the repo (one installed with ``pip install --target``) or this
    package's, and a file (not ``<string>``, ``<frozen ...>``)."""
    from pytest_llmload.system import tracebacks

    if filename.startswith("<") or tracebacks.is_installed(filename) or tracebacks.is_ours(filename):
        return False
    path = os.path.abspath(filename)
    if path.startswith(tuple(prefix + os.sep for prefix in {sys.prefix, sys.exec_prefix, sys.base_prefix})):
        return False
    repo = os.path.abspath(RUN.settings.get("repo", ".") if RUN is not None else ".") + os.sep
    outside_repo = [os.path.abspath(entry) + os.sep for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                    if entry and not (os.path.abspath(entry) + os.sep).startswith(repo)]
    return path.startswith(repo) or not path.startswith(tuple(outside_repo))


def _repo_frames(exc: BaseException) -> list[str]:
    """``path:line in function`` of the frames in the repo's code."""
    return [f"{os.path.relpath(f.filename)}:{f.lineno} in {f.name}" for f in traceback.extract_tb(exc.__traceback__)
            if is_repo_file(f.filename)]


def _record_crash(previous: Callable, kind: type, exc: BaseException, tb: Any) -> None:
    try:
        from pytest_llmload.loader import faults

        diagnosis = faults.diagnose(exc)
        RUN.findings.record.update(outcome="crashed", crash={
            "type": kind.__name__, "message": str(exc), "text": "".join(traceback.format_exception(kind, exc, tb)),
            "repo_frames": _repo_frames(exc), "fault": diagnosis and diagnosis._asdict()})
        RUN.findings.write()
    finally:  # (the command's own traceback is printed whatever happened here)
        previous(kind, exc, tb)


# --- wrapping what the command imports, when it imports it ------------------------------------------------

class _PatchedLoader(importlib.abc.Loader):
    """A module's own loader, then the patch: the module is whole before anything of it is wrapped."""

    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        module.__loader__ = self._loader  # (its source and resources are read through its own loader)
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = AFTER_IMPORT.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchedLoader(spec.loader, patch)
        return spec


def _first_argument(args: tuple, kwargs: dict, keyword: str) -> tuple[Any, tuple, dict]:
    """The model name a from_pretrained call got (positionally or by keyword), and the call's other arguments."""
    if args:
        return args[0], args[1:], kwargs
    kwargs = dict(kwargs)
    return kwargs.pop(keyword, None), args, kwargs


def _callers_line() -> str:
    """``path:line`` of the repo's innermost frame that is calling now: where a from_pretrained call is written."""
    frame = sys._getframe(1)
    while frame is not None:
        if is_repo_file(frame.f_code.co_filename):
            return f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "the command"


def _ours(path: Any) -> bool:
    """A checkpoint this run made or built: loaded as it is."""
    from pytest_llmload.commands import tiny_weights

    try:
        resolved = Path(path).resolve()
    except (TypeError, OSError):
        return False
    return any(resolved.is_relative_to(root.resolve()) for root in (tiny_weights.cache_root(), RUN.dir,
                                                                       RUN.output_dir))


def _tiny(name_or_path: Any, what: str) -> Any:
    """The tiny checkpoint for the model a ``what.from_pretrained(name_or_path)`` call names."""
    from pytest_llmload.commands import tiny_weights

    if not isinstance(name_or_path, (str, os.PathLike)) or _ours(name_or_path):
        return name_or_path
    saved = _saved_here(name_or_path)
    if saved is not None:
        return saved
    call = f"{what}.from_pretrained({str(name_or_path)!r}) at {_callers_line()}"
    config = tiny_weights.real_config(str(name_or_path), RUN.settings["models"], call)
    tiny = tiny_weights.tiny_checkpoint(config)
    RUN.findings.record["redirected"].append({"call": call, "to": str(tiny)})
    return tiny


def _redirect(cls: Any, keyword: str = "pretrained_model_name_or_path", around: Optional[Callable] = None) -> None:
    """``cls.from_pretrained`` given the tiny checkpoint for the model it names; ``around(load, tiny, kwargs)``, where
    given, makes the call (``load(kwargs)``) and sees what it returned."""
    original = cls.__dict__["from_pretrained"].__func__
    if getattr(original, "_llmload_redirected", False):
        return

    @functools.wraps(original)
    def from_pretrained(klass, *args, **kwargs):
        name, rest, kwargs = _first_argument(args, kwargs, keyword)
        tiny = _tiny(name, klass.__name__)
        if around is None:
            return original(klass, tiny, *rest, **kwargs)
        return around(lambda given: original(klass, tiny, *rest, **given), tiny, kwargs)

    from_pretrained._llmload_redirected = True
    setattr(cls, "from_pretrained", classmethod(from_pretrained))


def _load_model(load: Callable[[dict], Any], tiny: Any, kwargs: dict) -> Any:
    """A model's load, as the real one would go on this runner: under a ``max_memory``, the tiny model placed module by
    module as from_pretrained places the real one (else that budget scaled to the tiny weights), its
    ``offload_folder`` in the run's folder; the weight data
    it writes outside that folder recorded (offload-hang's mechanism, :func:`~pytest_llmload.failures.offload_hang.
    weight_writes`), and what placement it asked for and got (the placement failures' rows)."""
    from pytest_llmload.commands import tiny_weights
    from pytest_llmload.instruments.probes import record_writes

    given = dict(kwargs)
    if isinstance(kwargs.get("max_memory"), dict) and isinstance(tiny, (str, os.PathLike)) and (
            Path(tiny) / tiny_weights.SIZES_FILE).is_file():
        planned = tiny_weights.planned_placement(tiny, kwargs.get("device_map"), kwargs["max_memory"],
                                                 kwargs.get("torch_dtype", kwargs.get("dtype")))
        if planned is not None:  # the real model's placement, module by module
            given["device_map"] = planned
            given.pop("max_memory")
        else:  # (a GPU this runner lacks in the real placement: the budget in proportion)
            given["max_memory"] = tiny_weights.scaled_budget(kwargs["max_memory"], tiny)
    if kwargs.get("offload_folder") is not None and not _ours(kwargs["offload_folder"]):
        given["offload_folder"] = str(_in_output_dir(kwargs["offload_folder"]))
    load_record = _load_call(kwargs)  # (recorded before the call: a load that raises is one the run made)
    RUN.findings.record["loads"].append(load_record)
    with record_writes() as writes, _recorded_if_raised(load_record):
        model = load(given)
    try:
        _record_placement(load_record, model, given, writes)
    except Exception as exc:  # (a fault of the watch never breaks the command: its row says what was not watched)
        RUN.findings.record["watch_errors"].append(f"the load at {_callers_line()}: {type(exc).__name__}: {exc}")
    return model


@contextlib.contextmanager
def _recorded_if_raised(call_record: dict):
    """A call the script made, marked ``raised`` (its exception's first line) where it raised: its mechanism was not
    reached, and the rows say so instead of what it would have done."""
    try:
        yield
    except BaseException as exc:
        call_record["raised"] = f"{type(exc).__name__}: {next(iter(str(exc).strip().splitlines()), '')}"
        raise


def _load_call(kwargs: dict) -> dict:
    """A from_pretrained call as the script makes it, before it runs: its line, what it asks for, the state it runs
    in (ZeRO-3 on or off, a distributed process); what it placed is filled in when it returns."""
    return {
        "where": _callers_line(), "device_map": None if kwargs.get("device_map") is None else str(kwargs["device_map"]),
        "max_memory": None if kwargs.get("max_memory") is None else str(kwargs["max_memory"]), "places": [],
        "offloaded": False, "quantized": kwargs.get("quantization_config") is not None,
        "zero3": _zero3_enabled(), "distributed": bool(RUN.findings.record["distributed"]), "raised": None,
        "weight_writes": 0, "weight_writes_shown": [], "gpus_budgeted_absent": _gpus_absent(kwargs.get("max_memory"))}


def _record_placement(load_record: dict, model: Any, given: dict, writes: list) -> None:
    from pytest_llmload.failures.offload_hang import weight_writes

    device_map = getattr(model, "hf_device_map", None) or {}
    offloaded = _offloaded(model)
    counted, _ = weight_writes(writes, given.get("offload_folder") or RUN.dir / "no-offload-folder", RUN.dir,
                               offloaded=offloaded)
    load_record.update(places=sorted({str(place) for place in device_map.values()}), offloaded=offloaded,
                       weight_writes=len(counted),
                       weight_writes_shown=[f"{w.event} {w.path} (by {w.by})" for w in counted[:3]])


def _gpus_absent(max_memory: Any) -> list[str]:
    """The GPUs a ``max_memory`` budgets that this runner lacks (from_pretrained leaves them out of the placement)."""
    if not isinstance(max_memory, dict):
        return []
    import torch

    return [str(key) for key in max_memory if isinstance(key, int) and key >= torch.cuda.device_count()]


def _zero3_enabled() -> bool:
    module = sys.modules.get("transformers.integrations.deepspeed")
    return bool(module is not None and module.is_deepspeed_zero3_enabled())


def _patch_modeling_utils(module) -> None:
    _redirect(module.PreTrainedModel, around=_load_model)
    _redirect_saves(module.PreTrainedModel)


def _patch_auto_factory(module) -> None:
    _redirect(module._BaseAutoModelClass)  # (the model class's own from_pretrained records the load)


def _patch_configuration(module) -> None:
    _redirect(getattr(module, "PreTrainedConfig", None) or module.PretrainedConfig)


def _patch_auto_config(module) -> None:
    _redirect(module.AutoConfig)


def _patch_tokenizer_base(module) -> None:
    _redirect(module.PreTrainedTokenizerBase)
    _redirect_saves(module.PreTrainedTokenizerBase)


def _patch_auto_tokenizer(module) -> None:
    _redirect(module.AutoTokenizer)


def _patch_generation_config(module) -> None:
    _redirect(module.GenerationConfig, keyword="pretrained_model_name")


def _patch_peft_model(module) -> None:
    """``PeftModel.from_pretrained(model, adapter)`` (and so ``AutoPeftModel*``, which loads the base through the
    redirected transformers): a tiny adapter of the same kind, rank and targets for the tiny base."""
    original = module.PeftModel.__dict__["from_pretrained"].__func__

    @functools.wraps(original)
    def from_pretrained(klass, model, model_id, *args, **kwargs):
        from pytest_llmload.commands import tiny_weights

        if isinstance(model_id, (str, os.PathLike)) and not _ours(model_id):
            call = f"{klass.__name__}.from_pretrained(model, {str(model_id)!r}) at {_callers_line()}"
            model_id = tiny_weights.tiny_adapter(str(model_id), model, call)
            RUN.findings.record["redirected"].append({"call": call, "to": str(model_id)})
        adapter = {"where": _callers_line(), "on_offloaded": _offloaded(model), "raised": None}
        RUN.findings.record["adapters"].append(adapter)
        with _recorded_if_raised(adapter):
            return original(klass, model, model_id, *args, **kwargs)

    module.PeftModel.from_pretrained = classmethod(from_pretrained)


def _offloaded(model: Any) -> bool:
    places = {str(place) for place in (getattr(model, "hf_device_map", None) or {}).values()}
    return "disk" in places or any(p.device.type == "meta" for p in model.parameters())


# --- a bounded run -----------------------------------------------------------------------------------------

def _in_output_dir(path: Any) -> Path:
    """Where a path the command writes to goes in this run: under the run's output folder, its name kept."""
    path = Path(path)
    return RUN.output_dir / (path.relative_to(path.anchor) if path.is_absolute() else path)


def _saved_here(path: Any) -> Optional[Path]:
    """Where this run saved what the command now loads back from ``path`` (a checkpoint it wrote), else None."""
    moved = _in_output_dir(path)
    return moved if moved.exists() else None


def _redirect_saves(cls: Any) -> None:
    """``save_pretrained(path)``: into the run's output folder, nothing written into the repo."""
    original = cls.save_pretrained

    @functools.wraps(original)
    def save_pretrained(self, save_directory, *args, **kwargs):
        if not _ours(save_directory):
            save_directory = _in_output_dir(save_directory)
            RUN.findings.record["saved"].append(str(save_directory))
        return original(self, save_directory, *args, **kwargs)

    cls.save_pretrained = save_pretrained


def _patch_trainer(module) -> None:
    """Trainer (and the TRL trainers built on it): ``max_steps`` the run's, outputs and checkpoints in the run's
    folder, no logging integration; its GPU count and whether it treats the model as placed, for dp-dtype's row."""
    trainer = module.Trainer
    init, train, save_model = trainer.__init__, trainer.train, trainer.save_model

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        given = kwargs.get("args", args[1] if len(args) > 1 else None)
        if given is not None:  # (before Trainer reads them: its callbacks come from report_to, it makes output_dir)
            given.report_to = []
            given.output_dir = str(_in_output_dir(given.output_dir or "trainer_output"))
        init(self, *args, **kwargs)
        self.args.max_steps = RUN.settings["steps"]
        if not _ours(self.args.output_dir):
            self.args.output_dir = str(_in_output_dir(self.args.output_dir))
        self.args.save_strategy = "no"
        self.args.push_to_hub = False
        RUN.findings.record["trainers"].append({
            "where": _callers_line(), "class": type(self).__name__, "n_gpu": self.args.n_gpu,
            "model_parallel": bool(getattr(self, "is_model_parallel", False)),
            "fp16": bool(self.args.fp16), "output_dir": self.args.output_dir})

    @functools.wraps(train)
    def bounded_train(self, *args, **kwargs):
        RUN.in_trainer += 1
        try:
            return train(self, *args, **kwargs)
        finally:
            RUN.in_trainer -= 1

    @functools.wraps(save_model)
    def save_model_here(self, output_dir=None, *args, **kwargs):
        if output_dir is not None and not _ours(output_dir):
            output_dir = str(_in_output_dir(output_dir))
        return save_model(self, output_dir, *args, **kwargs)

    trainer.__init__, trainer.train, trainer.save_model = __init__, bounded_train, save_model_here


def _patch_generation(module) -> None:
    generate = module.GenerationMixin.generate

    @functools.wraps(generate)
    def bounded_generate(self, *args, **kwargs):
        kwargs["max_new_tokens"] = min(kwargs.get("max_new_tokens") or GENERATE_TOKENS, GENERATE_TOKENS)
        kwargs.pop("max_length", None)
        RUN.findings.record["generates"] += 1
        return generate(self, *args, **kwargs)

    module.GenerationMixin.generate = bounded_generate


class Bounded(SystemExit):
    """The run's optimizer steps are done: the process ends here, with exit status 0."""


def _after_step(optimizer, args, kwargs) -> None:
    RUN.findings.record["steps"] += 1
    if not RUN.in_trainer and RUN.findings.record["steps"] >= RUN.settings["steps"]:
        RUN.findings.record["outcome"] = "bounded"
        raise Bounded(0)


def _patch_optimizer(module) -> None:
    module.register_optimizer_step_post_hook(_after_step)


def _patch_grad_scaler(module) -> None:
    unscale = module.GradScaler.unscale_

    @functools.wraps(unscale)
    def counted_unscale(self, optimizer):
        if self.is_enabled():
            RUN.findings.record["unscales"] += 1
        return unscale(self, optimizer)

    module.GradScaler.unscale_ = counted_unscale


def _patch_deepspeed_comm(module) -> None:
    """DeepSpeed's shared-memory op, never built: the plugin's own ranks' way (its build costs 80-210 s of CPU on every
    command where another environment's build replaced it; collectives run through torch.distributed without it)."""
    from pytest_llmload.runners.ranks import disable_deepspeed_shm_op

    disable_deepspeed_shm_op()


# Module -> what is wrapped in it once it is imported (whichever the command imports first: each is wrapped once).
AFTER_IMPORT: dict[str, Callable[[Any], None]] = {
    "transformers.modeling_utils": _patch_modeling_utils,
    "transformers.models.auto.auto_factory": _patch_auto_factory,
    "transformers.configuration_utils": _patch_configuration,
    "transformers.models.auto.configuration_auto": _patch_auto_config,
    "transformers.tokenization_utils_base": _patch_tokenizer_base,
    "transformers.models.auto.tokenization_auto": _patch_auto_tokenizer,
    "transformers.generation.configuration_utils": _patch_generation_config,
    "transformers.generation.utils": _patch_generation,
    "transformers.trainer": _patch_trainer,
    "torch.optim.optimizer": _patch_optimizer,
    "torch.amp.grad_scaler": _patch_grad_scaler,
    "peft.peft_model": _patch_peft_model,
    "deepspeed.comm.torch": _patch_deepspeed_comm,
}
