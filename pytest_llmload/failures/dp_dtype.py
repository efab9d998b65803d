"""dp-dtype (write-up 003): Trainer wraps a model already placed by ``device_map`` in ``nn.DataParallel``.

The write-up's stage-2 model (a bf16 checkpoint reloaded in 4-bit, ``device_map="balanced"``, LoRA) failed
under a 2-GPU Trainer with ``expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16``;
the tell was the step count halving. Its fix: ``training_args._n_gpu = 1``
(:func:`pytest_llmload.fixes.trainer_guard.prepare_training_args_for_placed_model`).

The check, a model loaded for training handed to a stock ``transformers.Trainer`` on a machine with 2 GPUs, runs
on CPU, the machine simulated where Trainer reads it:

- the placement: what the loader passes to ``from_pretrained`` (``device_map``, ``max_memory``) is planned for 2
  GPUs of 80 GiB by the planner the predictions and the distributed check use
  (:func:`pytest_llmload.placement.planned.place`: transformers' own placement, its quantizer's included); where
  that puts modules on the GPUs, the weights load on the cpu and the model carries the planned ``hf_device_map``,
  as from_pretrained sets it there, for whatever the loader does next and for Trainer to read;
- ``TrainingArguments`` as there: ``n_gpu`` 2, ``device`` ``cuda:0``
  (:func:`pytest_llmload.fixes.trainer_guard.trainer_decision`).

Everything after that is Trainer's own code (``__init__``: model parallel or not, ``n_gpu`` reset to 1 for it;
``_wrap_model``: ``nn.DataParallel`` or not), and the training step runs on the cpu with the ``n_gpu`` it kept. A
loader that spreads the model over both GPUs on purpose (``device_map="auto"`` with a per-GPU ``max_memory``,
``"balanced"``) is model parallelism that Trainer sees: it passes. Each row says what was simulated.

A training script's fix goes in ``prepare_args(args, model)``, called between ``TrainingArguments`` and
``Trainer``, where the write-up put ``training_args._n_gpu = 1``. Whether the repo trains with Trainer at all is
declared (a training-args hook; ``llmload_trains_with_trainer``; ``llmload_trains_without_trainer`` or
``llmload_trains_under_deepspeed``, which skip) or observed (a ``transformers.Trainer`` class, trl's ``SFTTrainer``
and a repo's own subclass included, used in the loader's package or the modules it imports, read from their source:
:func:`trainer_use_in_source`). Where neither says it does, the row is never FAILED: a model a stock
Trainer would take wrongly is a skip that says what was assumed and what Trainer would do, and a model it takes
rightly passes, with a note saying nothing was declared.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import logging
import os
import shutil
import sys
import types
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from pytest_llmload.checks.base import ASSUMED, NOT_EXERCISED, Check, KnownFailure, not_exercised
from pytest_llmload.checks import contract
from pytest_llmload.loader.seam import LoaderModelError
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.config.vocabulary import SETTING
from pytest_llmload.loader.tiny_models import copy_tokenizer
from pytest_llmload.checks.ground_truth import where_loaded

logger = logging.getLogger(__name__)

FAILURE = KnownFailure(
    id="dp-dtype",
    order=4,
    title="nn.DataParallel wrapped around a model already placed with device_map",
    write_up="seeds/003_b296b1821f4bec50.txt",
    signatures=(
        r"mat1 and mat2 (?:to |must )?have the same dtype",
        r"expected scalar type (?:Float|BFloat16|Half) but found (?:Float|BFloat16|Half)",
    ),
    root_cause=(
        "Trainer saw n_gpu > 1 and wrapped a device_map-placed (4-bit, LoRA) model in nn.DataParallel; its "
        "replicas run in worker threads and float activations reach a bf16 lm_head. The tell: the number of "
        "optimizer steps halves (the write-up's run on 2 GPUs took 68 steps where one GPU takes 136)."
    ),
    fix=(
        "Do not let Trainer data-parallelise a placed model: set training_args._n_gpu = 1 when the model is placed "
        "(spread by hf_device_map, or quantized: pytest_llmload.fixes.training_scripts.prepare_training_args_for_placed_model does "
        "this), or launch one process per GPU instead; name that hook to the check (--llmload-training-args-hook). "
        "The check judges Trainer where the repo declares it (the hook, llmload_trains_with_trainer) or its code "
        "uses a Trainer class (the loader's package or the modules it imports, read from their source); declare "
        "llmload_trains_without_trainer where the repo never trains with transformers.Trainer."
    ),
    script_fix=(
        "Do not let Trainer data-parallelise a placed model: give the process only the GPUs its device_map uses "
        "(CUDA_VISIBLE_DEVICES=0 for a model on GPU 0), or launch one process per GPU (torchrun --nproc-per-node N) "
        "with the whole model on each rank's device."
    ),
    occurs=("2+ GPUs seen by one process, the model placed where Trainer sees no model parallelism (on one GPU, "
            "or a spread its hf_device_map does not show); Trainer up to 4.57 wraps 4-bit models, later versions "
            "skip 4-bit but still count n_gpu."),
    tell=r"data_parallel|parallel_apply",
    without_tell=(
        "no DataParallel frame in the traceback: the same dtype symptom, so look for another float/bf16 mix "
        "(autocast off, a module left in float32)."
    ),
)

# How a repo says it trains with transformers.Trainer (the write-up's script does): vocabulary.TRAINING_DECLARATIONS'
# attribute, ini key and option (Check passes it as `trains_with_trainer`); the attribute is read here too, for a
# caller of the check function itself.
TRAINS_WITH_TRAINER_ATTRIBUTE = SETTING["trains_with_trainer"].ini
# A row that rests on this says so in a note that starts with checks.base.ASSUMED and names what settles it: the
# summaries under pytest's and the main job's tables list it, and --llmload-strict counts the row as not judged.
ASSUMED_NO_TRAINER = (
    f"{ASSUMED}this repo's training does not hand the model to transformers.Trainer (nothing declares how it trains, "
    "and neither the loader's package nor the modules it imports use a Trainer class). Settle it: declare "
    f"`load.{TRAINS_WITH_TRAINER_ATTRIBUTE} = True` (or name its llmload_training_args_hook) to have it judged, or "
    f"`load.{SETTING['trains_without_trainer'].ini} = True` (or the ini keys, or the options --llmload-trains-with-trainer"
    " / --llmload-trains-without-trainer)")
# Not an assumption the verdict rests on: a stock Trainer takes the model rightly, and without Trainer there is
# nothing to take.
NOT_DECLARED_EITHER_WAY = (
    "not declared: whether this repo trains with transformers.Trainer (llmload_trains_with_trainer, "
    "llmload_training_args_hook, llmload_trains_without_trainer); judged as a stock Trainer would take the model, "
    "it passes, so the verdict holds either way")
# The simulated machine: the distributed check's GPUs (80 GiB each), a host that holds anything.
SIMULATED_GPU_BYTES = 80 * 2**30
SIMULATED_HOST_BYTES = 2**40
STAGE1_SHARDS = 4
# The first step's loss may differ a little from the model's own (dropout, bf16 rounding); a Trainer that
# counts n_gpu devices it does not use scales it by n_gpu.
LOSS_RATIO_TOLERANCE = 0.25


def _is_4bit(model: Any) -> bool:
    """bitsandbytes 4-bit layers in the model (through a peft wrapper too)."""
    return any(type(module).__name__ == "Linear4bit" for module in model.modules())


def write_stage1_checkpoint(checkpoint: Path, dest: Path) -> Path:
    """Write-up 003's stage 1: the full model saved in bf16 as sharded safetensors, with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).to(torch.bfloat16)
    total_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(dest, max_shard_size=total_bytes // STAGE1_SHARDS + 1, safe_serialization=True)
    AutoTokenizer.from_pretrained(checkpoint, local_files_only=True).save_pretrained(dest)
    copy_tokenizer(checkpoint, dest)  # the slow classes' files too, which save_pretrained leaves out
    return dest


def _upstream_reading(obs) -> str:
    """Which of the known upstream behaviours the observation is."""
    quantized = any("bit" in r or "quantized" in r for r in obs.placement.reasons)
    if obs.is_model_parallel:
        return "Trainer saw the placement in hf_device_map and set n_gpu to 1 itself"
    if obs.data_parallel:
        if quantized:
            return "this transformers wraps quantized (4-bit) models in nn.DataParallel (its _wrap_model skips 8-bit only)"
        return "this transformers wraps the model in nn.DataParallel: hf_device_map names no second accelerator"
    if obs.n_gpu > 1 and quantized:
        return (
            "this transformers skips nn.DataParallel for 4-bit/8-bit models but still counts n_gpu: the batch, "
            "the step count and the loss scale follow n_gpu"
        )
    return "Trainer did not treat the run as data-parallel"


def four_bit_refusal() -> Optional[str]:
    """Why bitsandbytes 4-bit cannot load on this machine with the installed transformers, or ``None``.

    transformers 4.46 accepts 4-bit on CPU only with intel_extension_for_pytorch, which has no build for
    the torch of this matrix; transformers 4.56 with bitsandbytes 0.47 and later load it on CPU
    (docs/version_matrix.md). The text is transformers' own refusal."""
    from importlib import metadata

    from transformers.integrations import validate_bnb_backend_availability

    try:
        validate_bnb_backend_availability(raise_exception=True)
    except RuntimeError as refusal:
        return (f"transformers {metadata.version('transformers')} with bitsandbytes {metadata.version('bitsandbytes')} "
                f"refuses 4-bit on this machine ({str(refusal).split('. ')[0]}); needs 1 GPU")
    return None


def trainer_use_observed(function: Any) -> list[str]:
    """Where the loader's repo hands models to ``transformers.Trainer``, as far as its code shows: the Trainer classes
    its modules bind as imported (:func:`_bound_trainer_classes`), then the uses its package's source and the
    modules its module imports make (:func:`trainer_use_in_source`); empty where none is seen."""
    return _bound_trainer_classes(function) + trainer_use_in_source(function)


def _bound_trainer_classes(function: Any) -> list[str]:
    """Trainer classes the loader's own modules bind: ``["mypkg.train.SFTTrainer (trl.trainer.sft_trainer.SFTTrainer,
    a transformers.Trainer)"]``; empty where none does.

    Read from the modules as imported: the loader function's module, and the modules of the same top-level package
    it reaches through its module-level names (modules, functions and classes imported from them), at most 64. A
    class counts where it is ``transformers.Trainer`` or a subclass of it (trl's ``SFTTrainer``,
    ``Seq2SeqTrainer``, a repo's own). This package's own modules are not a repo's."""
    from transformers import Trainer

    start = getattr(function, "__module__", None)
    if not start or start not in sys.modules or start.split(".")[0] == "pytest_llmload":
        return []
    top = start.split(".")[0]
    found, seen, queue = [], set(), [start]
    while queue and len(seen) < 64:
        name = queue.pop(0)
        if name in seen or name not in sys.modules:
            continue
        seen.add(name)
        for attr, value in list(vars(sys.modules[name]).items()):
            if isinstance(value, type):
                try:
                    is_trainer = issubclass(value, Trainer)
                except TypeError:
                    is_trainer = False
                if is_trainer:
                    found.append(f"{name}.{attr} ({value.__module__}.{value.__qualname__}, a transformers.Trainer)")
                    continue
            if isinstance(value, types.ModuleType):
                reached = value.__name__
            elif isinstance(value, (type, types.FunctionType)):
                reached = getattr(value, "__module__", None)
            else:
                continue
            if isinstance(reached, str) and reached.split(".")[0] == top and reached not in seen:
                queue.append(reached)
    return found


# -- Trainer use read from the repo's source (issue 46): a training script beside the loader is never imported --

# Read at most this many files of a package (only those that name "Trainer" are parsed), this many modules the
# loader's module imports (and they import, within the repo), and name this many uses.
PACKAGE_FILES_READ, IMPORTED_MODULES_READ, USES_NAMED = 3000, 64, 8
# The libraries that define Trainer classes: their own code is not a repo's use of them.
TRAINER_LIBRARIES = ("transformers", "trl")


class _Source(NamedTuple):
    """One module of the repo, parsed: its names bound by imports (``{"T": "transformers.Trainer"}``) and its
    classes' bases."""

    module: str
    path: Path
    tree: ast.Module
    imported: dict
    classes: dict


def trainer_use_in_source(function: Any) -> list[str]:
    """Trainer use the loader's repo makes, read from its source with :mod:`ast` (a repo's training script may run
    its training when imported: none is imported here): ``["mypkg/train.py:40 calls transformers.Trainer"]``.

    Read: the loader's own module; its package (the outermost package of regular packages, ``__init__.py`` at
    each level, that holds it: a namespace package or a bare folder may hold unrelated projects, as this project's
    ``fixtures/corpus`` does), every module in it; and the modules its module imports from outside that package
    that are not installed libraries, and theirs in turn. A use is a call, a subclass or any other reference, in
    code, to ``transformers.Trainer`` or a subclass of it (trl's ``SFTTrainer``, ``Seq2SeqTrainer``, the repo's own
    subclasses, followed through its imports); a mention in a string or a comment, a type annotation, an
    ``isinstance`` test or an import alone is none, nor is a ``Trainer`` of another library (Lightning's).

    A Trainer used only to evaluate counts: ``Trainer.evaluate`` and ``predict`` wrap the model as training does
    (``_wrap_model(training=False)``: ``nn.DataParallel`` at ``n_gpu > 1``, transformers 4.56 trainer.py:4590 and
    2081, 5.23 trainer.py:2917 and 2672), so the placed model meets the same wrap."""
    name = getattr(function, "__module__", None)
    module = sys.modules.get(name) if name else None
    file = getattr(module, "__file__", None)
    if module is None or not file or not file.endswith(".py") or name.split(".")[0] == "pytest_llmload":
        return []
    sources: dict[str, _Source] = {}
    package = _outermost_regular_package(name)
    if package is not None and package[0].split(".")[0] not in TRAINER_LIBRARIES:
        for path, dotted in _package_files(*package):
            _read(path, dotted, sources, needs_trainer=True)
    queue, read = [(Path(file), name)], 0
    while queue and read < IMPORTED_MODULES_READ:
        path, dotted = queue.pop(0)
        source = sources.get(dotted) or _read(path, dotted, sources, needs_trainer=False)
        read += 1
        for target in dict.fromkeys(source.imported.values() if source else ()):
            for candidate in (target, target.rpartition(".")[0]):  # (`from pkg import mod` names a module)
                found = _repo_module_file(candidate) if candidate and candidate not in sources else None
                if found is not None and all(candidate != queued for _, queued in queue):
                    queue.append((found, candidate))
                    break
    uses: list[str] = []
    for source in sources.values():
        uses += _trainer_uses(source, sources, package[1].parent if package else Path(file).parent)
    return uses[:USES_NAMED]


def _outermost_regular_package(module: str) -> Optional[tuple[str, Path]]:
    """``(name, folder)`` of the outermost package of the chain of regular packages that ends in ``module``'s own
    package; ``None`` where its package is none or a namespace package."""
    parts, found = module.split("."), None
    for size in range(len(parts) - 1, 0, -1):
        package = sys.modules.get(".".join(parts[:size]))
        init = getattr(package, "__file__", None)
        if not init or Path(init).name != "__init__.py":
            break
        found = (".".join(parts[:size]), Path(init).parent)
    return found


def _package_files(package: str, folder: Path):
    """``(path, module name)`` of the package's ``.py`` files (hidden folders and caches left out)."""
    count = 0
    for where, folders, files in os.walk(folder):
        folders[:] = sorted(f for f in folders if not f.startswith(".") and f != "__pycache__")
        relative = Path(where).relative_to(folder).parts
        for file in sorted(f for f in files if f.endswith(".py")):
            count += 1
            if count > PACKAGE_FILES_READ:
                return
            stem = () if file == "__init__.py" else (file[:-3],)
            yield Path(where, file), ".".join((package, *relative, *stem))


def _repo_module_file(dotted: str) -> Optional[Path]:
    """The source file of module ``dotted`` where it is the repo's (not an installed library's, not Python's), found
    without importing it: from the loaded top-level package's folders, else the import path's finder."""
    from importlib.machinery import PathFinder

    from pytest_llmload.system.tracebacks import is_installed

    top, *rest = dotted.split(".")
    if top in ("pytest_llmload", *TRAINER_LIBRARIES):
        return None
    loaded = sys.modules.get(top)
    if loaded is not None:
        folders, file = list(getattr(loaded, "__path__", None) or ()), getattr(loaded, "__file__", None)
    else:
        spec = PathFinder.find_spec(top)
        if spec is None:
            return None
        folders, file = list(spec.submodule_search_locations or ()), spec.origin
    if rest:
        file = next((str(candidate) for folder in folders for candidate in
                     (Path(folder, *rest).with_suffix(".py"), Path(folder, *rest, "__init__.py"))
                     if candidate.is_file()), None)
    if not file or not file.endswith(".py") or is_installed(file):
        return None
    return Path(file)


def _read(path: Path, module: str, sources: dict, needs_trainer: bool) -> Optional[_Source]:
    """Parse one module of the repo into ``sources``; ``None`` where it cannot be read or parsed (or, with
    ``needs_trainer``, never names "Trainer": no use can be in it)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
        if needs_trainer and "Trainer" not in text:
            return None
        tree = ast.parse(text, filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return None
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    imported, classes = {}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                imported[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else \
                    alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            imported.update({alias.asname or alias.name: f"{base}.{alias.name}" for alias in node.names
                             if alias.name != "*"})
        elif isinstance(node, ast.ClassDef):
            classes[node.name] = node.bases
    sources[module] = _Source(module, path, tree, imported, classes)
    return sources[module]


def _dotted(node: ast.expr, source: _Source) -> Optional[str]:
    """What a name or attribute chain in ``source`` refers to, as a dotted name; ``None`` for anything else."""
    if isinstance(node, ast.Name):
        return source.imported.get(node.id) or (f"{source.module}.{node.id}" if node.id in source.classes else None)
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value, source)
        return f"{base}.{node.attr}" if base else None
    return None


def _trainer_class(dotted: str, sources: dict, seen: tuple = ()) -> Optional[str]:
    """The library Trainer class ``dotted`` is or derives from (``"transformers.trainer.Trainer"``), through the
    repo's classes and imports; ``None`` where it is none."""
    if dotted in seen or len(seen) > 16:
        return None
    module, _, name = dotted.rpartition(".")
    source = sources.get(module)
    if source is not None:
        if name in source.classes:
            return next(filter(None, (_trainer_class(base, sources, (*seen, dotted)) for base in
                                      filter(None, (_dotted(b, source) for b in source.classes[name])))), None)
        target = source.imported.get(name)
        return _trainer_class(target, sources, (*seen, dotted)) if target else None
    if not name.endswith("Trainer") or any(known == module or known.startswith(f"{module}.") for known in sources) \
            or _repo_module_file(module):
        return None  # a library's Trainer class is so named; a module of the repo not read names no Trainer
    return _library_trainer_class(dotted)


@functools.lru_cache(maxsize=256)  # (a library's classes do not change within a process)
def _library_trainer_class(dotted: str) -> Optional[str]:
    """``dotted`` as an installed library names it, where it is ``transformers.Trainer`` or a subclass. Only names
    ending in "Trainer" are looked up (every Trainer class of transformers and trl is so named); a library that
    is not installed here is not imported, except that trl's are taken as what they are (trl's trainers subclass
    transformers.Trainer)."""
    import importlib

    module, _, name = dotted.rpartition(".")
    if not name.endswith("Trainer") or not module:
        return None
    try:
        from transformers import Trainer

        value = getattr(importlib.import_module(module), name)
        return f"{value.__module__}.{value.__qualname__}" if isinstance(value, type) and \
            issubclass(value, Trainer) else None
    except ImportError:
        return f"{dotted} (trl is not installed here; its trainers are transformers.Trainer subclasses)" \
            if module.split(".")[0] == "trl" else None
    except Exception:  # noqa: BLE001 - a library whose import fails otherwise names no Trainer we can see
        return None


def _trainer_uses(source: _Source, sources: dict, root: Path) -> list[str]:
    """Each reference in code of ``source`` to a Trainer class: ``"mypkg/train.py:40 calls transformers.Trainer"``."""
    ignored: set[int] = set()  # annotations and isinstance/issubclass tests: no model is handed to Trainer there
    for node in ast.walk(source.tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            ignored.update(map(id, ast.walk(node.annotation)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns is not None:
            ignored.update(map(id, ast.walk(node.returns)))
        elif isinstance(node, ast.AnnAssign):
            ignored.update(map(id, ast.walk(node.annotation)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("isinstance", "issubclass"):
            ignored.update(id(n) for arg in node.args[1:] for n in ast.walk(arg))
    called = {id(node.func) for node in ast.walk(source.tree) if isinstance(node, ast.Call)}
    try:
        where = source.path.relative_to(root)
    except ValueError:
        where = source.path
    uses = []
    for node in ast.walk(source.tree):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                dotted = _dotted(base, source)
                found = dotted and _trainer_class(dotted, sources)
                if found:
                    uses.append(f"{where}:{node.lineno} defines {node.name}, a subclass of {found}")
                ignored.update(map(id, ast.walk(base)))
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Load) and \
                id(node) not in ignored:
            dotted = _dotted(node, source)
            found = dotted and _trainer_class(dotted, sources)
            if found:
                ignored.update(map(id, ast.walk(node)))  # (the chain's inner names are the same reference)
                uses.append(f"{where}:{node.lineno} {'calls' if id(node) in called else 'refers to'} "
                            f"{ast.unparse(node)} ({found})")
    return uses


class Simulated(NamedTuple):
    """One ``from_pretrained`` call the check placed as on the simulated machine."""

    asked: dict  # device_map / max_memory as the loader passed them
    planned: dict  # {module: "cuda:0" | "cpu" | "disk"}: the hf_device_map from_pretrained would set there
    model: Any  # what from_pretrained returned here (the weights on the cpu), carrying ``planned``
    own_map: Any  # its hf_device_map on this machine (_NONE where it had none)


_NONE = object()


def _accelerator(where: str) -> bool:
    return where not in ("cpu", "disk", "meta")


@contextlib.contextmanager
def placed_as_on_gpus(request: LoadRequest, n_gpu: int, seen: list, problems: list):
    """``from_pretrained`` as on a machine with ``n_gpu`` GPUs of :data:`SIMULATED_GPU_BYTES`: where the loader's
    ``device_map``/``max_memory`` puts modules on the GPUs (the predictions' planner,
    :func:`~pytest_llmload.placement.planned.place`), the weights load on the cpu instead (``device_map={"": "cpu"}``)
    and the model gets the planned ``hf_device_map`` (``cuda:N``). Each such call is appended to ``seen``; a
    placement that cannot be planned here to ``problems`` (and the call runs as the loader made it). A placement
    from_pretrained would refuse there raises its refusal, from the loader's call."""
    from transformers import PreTrainedModel

    from pytest_llmload.placement import architectures, profiles
    from pytest_llmload.placement.planned import PlacementRefused, place

    profile = profiles.RunnerProfile(name=f"{n_gpu} simulated GPUs", devices=n_gpu,
                                     device_memory=SIMULATED_GPU_BYTES, host_memory=SIMULATED_HOST_BYTES,
                                     disk=SIMULATED_HOST_BYTES)
    original = PreTrainedModel.__dict__["from_pretrained"]
    depth = [0]

    def from_pretrained(klass, *args, **kwargs):
        if depth[0] or kwargs.get("device_map") is None:  # no map: loaded whole, moved by Trainer, as there
            return original.__func__(klass, *args, **kwargs)
        depth[0] += 1
        try:
            asked = {key: kwargs[key] for key in ("device_map", "max_memory") if kwargs.get(key) is not None}
            path = args[0] if args else kwargs.get("pretrained_model_name_or_path", request.model_path)
            planned = None
            try:
                config = architectures.load_config(path, source="from_pretrained")
                planned = place(config, kwargs, request, profile)[1]
            except PlacementRefused as refused:
                raise ValueError(f"on {n_gpu} simulated GPUs, from_pretrained would refuse this placement "
                                 f"({asked}): {type(refused.refusal).__name__}: {refused.refusal}") from None
            except Exception as exc:  # noqa: BLE001 - a placement the planner cannot take: judged as loaded here
                problems.append(f"{asked} could not be planned for {n_gpu} GPUs ({type(exc).__name__}: {exc})")
            planned = {name: f"cuda:{where}" if str(where).isdigit() else str(where)
                       for name, where in (planned or {}).items()}
            if not any(_accelerator(where) for where in planned.values()):
                return original.__func__(klass, *args, **kwargs)
            here = {key: value for key, value in kwargs.items() if key != "max_memory"}
            model = original.__func__(klass, *args, **{**here, "device_map": {"": "cpu"}})
            seen.append(Simulated(asked, planned, model, model.__dict__.get("hf_device_map", _NONE)))
            model.hf_device_map = dict(planned)
            return model
        finally:
            depth[0] -= 1

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    try:
        yield
    finally:
        PreTrainedModel.from_pretrained = original


def _own_maps_back(seen: list) -> None:
    """Each simulated model's own ``hf_device_map`` back (this machine's), where the loader left the planned one."""
    for call in seen:
        if call.model.__dict__.get("hf_device_map", _NONE) == call.planned:
            if call.own_map is _NONE:
                del call.model.hf_device_map
            else:
                call.model.hf_device_map = call.own_map


def _where(planned: dict) -> str:
    counts: dict[str, int] = {}
    for where in planned.values():
        counts[where] = counts.get(where, 0) + 1
    return ", ".join(f"{d} ({n} module{'s' if n > 1 else ''})" for d, n in sorted(counts.items()))


def check_trainer_does_not_wrap_placed_model(
    loader: Callable[[LoadRequest], Any],
    checkpoint: Path,
    workdir: Path,
    *,
    prepare_args: Optional[Callable[[Any, Any], Any]] = None,
    simulated_n_gpu: int = 2,
    trains_without_trainer: bool = False,
    trains_under_deepspeed: bool = False,
    trains_with_trainer: bool = False,
) -> None:
    """Seed 003: a train/4-bit/LoRA model from a local bf16 (stage-1) checkpoint, placed as the loader asks on 2 GPUs, is not data-parallelised by a stock Trainer (its own decision) and its first step runs with consistent dtypes; FAILED only where the repo declares or imports Trainer; needs bitsandbytes 4-bit (its CPU backend will do)."""
    from pytest_llmload.fixes.trainer_guard import observe_trainer

    if trains_without_trainer or trains_under_deepspeed:
        how = ("to train without transformers.Trainer (llmload_trains_without_trainer)" if trains_without_trainer
               else "to train only under DeepSpeed, one process per GPU (llmload_trains_under_deepspeed)")
        not_exercised(CHECK.name, f"is declared {how}", "Trainer's wrap decision")
    refusal = four_bit_refusal()
    if refusal is not None:
        import pytest

        pytest.skip(f"write-up 003's model is 4-bit: {refusal}")
    function = getattr(loader, "function", loader)
    declared = ("a training-args hook" if prepare_args is not None
                else TRAINS_WITH_TRAINER_ATTRIBUTE if trains_with_trainer
                or getattr(function, TRAINS_WITH_TRAINER_ATTRIBUTE, False) else None)
    observed = [] if declared else trainer_use_observed(function)
    if observed:
        contract.note(f"observed: Trainer use in the loader's package or the modules it imports ("
                      f"{'; '.join(observed[:2])}): judged as a stock Trainer takes the model (declare "
                      "llmload_trains_without_trainer where it never does)")
    workdir = Path(workdir)
    stage1 = workdir / "stage1"
    if stage1.exists():
        shutil.rmtree(stage1)
    write_stage1_checkpoint(Path(checkpoint), stage1)

    request = LoadRequest(stage1, purpose="train", dtype="bfloat16", device="cpu", quantization="4bit", lora=True,
                          gpu_count=simulated_n_gpu)
    seen: list[Simulated] = []
    unplanned: list[str] = []
    simulating = placed_as_on_gpus(request, simulated_n_gpu, seen, unplanned) if simulated_n_gpu \
        else contextlib.nullcontext()
    with simulating:
        model = contract.load(loader, request, check=CHECK.name).model
    if simulated_n_gpu:
        placed = "; ".join(dict.fromkeys(
            f"from_pretrained({', '.join(f'{k}={v!r}' for k, v in call.asked.items())}) planned as "
            f"{_where(call.planned)}" for call in seen)) or "it puts nothing on a GPU: judged as loaded here"
        contract.note(f"simulated: {simulated_n_gpu} GPUs of {SIMULATED_GPU_BYTES // 2**30} GiB for Trainer's own "
                      f"decision (TrainingArguments n_gpu={simulated_n_gpu}, device cuda:0); the loader's placement "
                      f"by the predictions' planner ({placed}); the weights and the training step on the cpu"
                      + (f"; not planned: {'; '.join(unplanned)}" if unplanned else ""))
    if not _is_4bit(model):
        # DataParallel over a plain, unplaced model is ordinary and works: not this failure's scenario.
        _own_maps_back(seen)
        got = contract.observe(model).quantization
        not_exercised(CHECK.name, f"ignored the 4-bit request: it returned "
                      f"{'an ' + got if got else 'an unquantized'} model, {where_loaded(model)}",
                      "a placed 4-bit model handed to Trainer")
    obs = observe_trainer(model, workdir / "trainer", simulated_n_gpu=simulated_n_gpu,
                          prepare_args=prepare_args, after_decision=lambda: _own_maps_back(seen))
    _own_maps_back(seen)  # (without a simulated machine there was no decision to come back from)
    reading = _upstream_reading(obs)
    logger.info("dp-dtype (Trainer over a placed model): %s -- %s", obs.describe(), reading)

    problems, others = [], []
    if obs.data_parallel:
        problems.append("Trainer wrapped the model in nn.DataParallel")
    if obs.n_gpu > 1 or obs.train_batch_size != obs.per_device_batch:
        unused = "" if obs.data_parallel else " for a model it does not replicate"
        problems.append(
            f"Trainer counts n_gpu={obs.n_gpu}{unused}: {obs.per_device_batch} rows per device became "
            f"{obs.train_batch_size} per step, so the step count divides by {obs.n_gpu} (the write-up's run: 68 steps instead of 136)"
        )
    if obs.dtype_error or obs.dtype_mismatches:
        problems.append(
            f"the first step mixed dtypes at the lm_head: {obs.error or obs.dtype_mismatches}"
        )
    # Not this failure's mechanism: the loader's model cannot train under Trainer for another reason.
    elif obs.error:
        others.append(f"the first step failed: {obs.error}")
    elif obs.first_step_loss is None:
        others.append("the first step logged no loss")
    elif obs.first_step_grad_norm is not None and not obs.first_step_grad_norm > 0:
        others.append(f"the first step's gradient norm is {obs.first_step_grad_norm}: nothing was trained")
    ratio = obs.loss_ratio
    # Under nn.DataParallel on CPU the module runs unsplit, so its loss figure means nothing off CPU.
    if not obs.data_parallel and ratio is not None and abs(ratio - 1) > LOSS_RATIO_TOLERANCE:
        problems.append(f"the first step's loss is x{ratio:.3f} the model's own loss on the same rows")
    if not declared and not observed:  # how the repo trains is unknown: never FAILED on an assumption
        if problems or others:
            import pytest

            contract.note(ASSUMED_NO_TRAINER)
            pytest.skip(f"{NOT_EXERCISED}{CHECK.name}: {ASSUMED_NO_TRAINER}. Were it "
                        f"handed to a stock Trainer on {simulated_n_gpu} GPUs: "
                        f"{'; '.join(problems + others)} ({reading})")
        contract.note(NOT_DECLARED_EITHER_WAY)
        return
    if others and not problems:
        raise LoaderModelError(f"the loader's 4-bit model does not train under a stock Trainer, for a reason that is "
                               f"not write-up 003's ({'; '.join(others)}).\n{obs.describe()}")
    problems += others
    if problems:
        basis = (f"Trainer use declared ({declared})" if declared
                 else f"Trainer use observed in the loader's package or the modules it imports: "
                      f"{'; '.join(observed[:2])}")
        hint = (
            "" if prepare_args is not None else
            " This judges a stock Trainer (no training-args hook was given). Fix it in the training script: call "
            "pytest_llmload.fixes.trainer_guard.prepare_training_args_for_placed_model(args, model) before building the "
            "Trainer (write-up 003: training_args._n_gpu = 1) and name that hook (--llmload-training-args-hook, the "
            "ini key or the loader's llmload_training_args_hook); or, where the repo never trains with "
            "transformers.Trainer, declare llmload_trains_without_trainer."
        )
        raise AssertionError(
            f"Trainer data-parallelised a model already placed with device_map: {'; '.join(problems)}.\n"
            f"Upstream behaviour seen: {reading}.\n{obs.describe()}.\n{basis}.{hint}"
        )


# Isolated: Trainer leaves accelerate's process-wide AcceleratorState behind (class-level singletons that later
# tests and forked ranks inherit) and reseeds the global RNGs; the 4-bit load runs bitsandbytes' native code.
# Trainer as transformers ships it; a training script's own fix comes in as `prepare_args` (the
# llmload_training_args_hook option, ini key or loader attribute), as it does in the script.
CHECK = Check(check_trainer_does_not_wrap_placed_model, failure=FAILURE, timeout=180, purpose="train", isolated=True,
              extras=("quant",))  # (its model is 4-bit)
CHECKS = (CHECK,)
