"""move-offloaded: ``.to(device)`` (or ``.cuda()``) on a model that ``device_map`` offloaded to cpu or disk.

``from_pretrained(..., device_map="auto", max_memory=..., offload_folder=...)`` places the model itself: what
does not fit the budget is offloaded (its parameters left on ``meta``, loaded into place by accelerate's hooks
at each forward). ``dispatch_model`` then wraps the model's ``to`` and ``cuda`` so that moving it raises
``RuntimeError: You can't move a model that has some modules offloaded to cpu or disk.`` -- for a dtype cast
(``.to(torch.float16)``) or a memory format as much as for a device. Seen in the field:

- mlfoundations/rtfm#19: ``LlamaForCausalLM.from_pretrained(..., device_map="auto").to(device)``;
- 01-ai/Yi#302: ``deepspeed.initialize`` calls ``self.module.to(self.device)`` on the offloaded model
  (also deepspeedai/DeepSpeed#5179);
- mlcommons/inference#1751: ``model.to(memory_format=torch.channels_last)`` on CPU, layers offloaded to disk;
- hiyouga/LlamaFactory#2732: a LoRA-trained model deployed on a Mac M1.

``.cpu()`` is not wrapped: on an offloaded model it fails inside torch instead (``NotImplementedError``, a
meta tensor has no data to copy), as does ``.to()`` on a PEFT model wrapped around it; the check names those
too. The fix: do not move a model loaded with an offloading ``device_map`` -- use it as loaded (accelerate
runs each layer on its execution device), or load it whole on one device (``device_map={"": device}``)
when it fits; move only a model whose ``hf_device_map`` holds one device (:func:`may_move`).

The check (see :mod:`pytest_llmload.failures.meta_backward` for the calling convention)::

    from pytest_llmload.failures import move_offloaded

    @pytest.mark.timeout(60)
    def test_my_loader_does_not_move_an_offloaded_model(llmload_checkpoint, tmp_path):
        move_offloaded.check_offloaded_model_not_moved(my_loader, llmload_checkpoint, tmp_path)
"""

from __future__ import annotations

import linecache
import re
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

from pytest_llmload.checks.base import Check, KnownFailure, not_exercised
from pytest_llmload.checks import contract
from pytest_llmload.loader.seam import LoaderError
from pytest_llmload.loader.request import LoadRequest
from pytest_llmload.checks.ground_truth import input_ids, offload_budget, where_loaded
from pytest_llmload.instruments.device_map_summary import offloaded_parts
from pytest_llmload.instruments.recorder import track_model
from pytest_llmload.system.tracebacks import LOADING_LIBRARIES, is_library, module_of

Loader = Callable[[LoadRequest], Any]

# accelerate.big_modeling.dispatch_model's guard, the same text since accelerate 0.x.
ACCELERATE_REFUSAL = r"You can't move a model that has some modules offloaded to cpu or disk"
# The check's own verdict, for the path where torch raised instead (.cpu(), .to() on a wrapper).
VERDICT = r"moved a model with \d+ of \d+ parameters offloaded"

FAILURE = KnownFailure(
    id="move-offloaded",
    order=6,
    title="moving (.to/.cuda/.cpu) a model that device_map offloaded to cpu or disk",
    write_up="mlfoundations/rtfm#19, 01-ai/Yi#302, mlcommons/inference#1751, hiyouga/LlamaFactory#2732",
    signatures=(ACCELERATE_REFUSAL, VERDICT),
    root_cause=(
        "from_pretrained with device_map (and a max_memory the model exceeds) already placed the model and "
        "offloaded what did not fit: those parameters are on meta, loaded by accelerate's hooks at each "
        "forward. accelerate wraps the model's to()/cuda() to refuse any move or cast while a parameter is "
        "on meta; .cpu() and a wrapper's .to() (PEFT, a DeepSpeed engine's module.to) fail inside torch."
    ),
    fix=(
        "Do not move or cast a model loaded with an offloading device_map: use it as loaded (pass the dtype "
        "to from_pretrained), or load it whole on one device (device_map={'': device}) when it fits; call "
        ".to() only when hf_device_map has a single device (move_offloaded.may_move), and never hand an "
        "offloaded model to deepspeed.initialize."
    ),
    script_fix=(
        "Do not move or cast a model loaded with an offloading device_map: use it as loaded (pass the dtype to "
        "from_pretrained), or load it whole on one device (device_map={'': device}) when it fits; call .to() only "
        "when hf_device_map has a single device, and never hand an offloaded model to deepspeed.initialize."
    ),
    occurs=("accelerate >= 0.2x with transformers 4.x-5.x device_map offload (reproduced: transformers 5.23, "
            "accelerate 1.15, CPU with disk offload); any hardware: cuda:N with cpu offload in the reports."),
)

# nn.Module methods that move or cast every parameter.
MOVES = ("to", "cpu", "cuda", "half", "float", "double", "bfloat16", "type", "xpu", "mps", "npu")
# Frames that are libraries, not the loader: where a move made on the loader's behalf came from.
LIBRARIES = LOADING_LIBRARIES + ("deepspeed",)


class OffloadState(NamedTuple):
    """How much of a model is offloaded: parameters on meta, modules behind an offloading hook, its map."""

    meta: int
    parameters: int
    hooked: int
    device_map: Optional[dict]

    @property
    def by_accelerate(self) -> bool:
        """Offloaded by accelerate (hooks that offload, or a map with a tier below the device), not merely on meta."""
        tiers = {str(v) for v in (self.device_map or {}).values()}
        return bool(self.hooked or "disk" in tiers or ("cpu" in tiers and len(tiers) > 1))

    def describe(self) -> str:
        return (f"{self.meta} of {self.parameters} parameters on meta (offloaded), {self.hooked} modules behind "
                f"an offloading accelerate hook, hf_device_map={self.device_map}")


def offload_state(model) -> OffloadState:
    """What of ``model`` is offloaded (the ``hf_device_map`` is its own, or that of the model it wraps: a PEFT
    model's base model)."""
    params = list(model.parameters())
    meta = sum(p.device.type == "meta" for p in params)
    hooked = sum(bool(getattr(getattr(m, "_hf_hook", None), "offload", False)) for m in model.modules())
    device_map = next((dict(m.hf_device_map) for m in model.modules()
                       if isinstance(getattr(m, "hf_device_map", None), dict)), None)
    return OffloadState(meta, len(params), hooked, device_map)


def may_move(model) -> bool:
    """Whether ``model.to(...)`` is safe: nothing is offloaded and ``hf_device_map``, if any, has one device.

    The fix, for a loader that must move or cast after ``from_pretrained``::

        model = AutoModelForCausalLM.from_pretrained(path, device_map="auto", max_memory=budget)
        if move_offloaded.may_move(model):
            model = model.to(device)
    """
    device_map = getattr(model, "hf_device_map", None) or {}
    if len({str(v) for v in device_map.values()}) > 1 or {"disk", "meta"} & {str(v) for v in device_map.values()}:
        return False
    return not any(p.device.type == "meta" for p in model.parameters())


class Move(NamedTuple):
    """A move of an offloaded model, found in an exception's traceback."""

    call: str  # ".to('cpu')"
    made_by: str  # where the loader's code made it (file:line `source`), and through which library call
    state: Optional[OffloadState]
    error: BaseException
    model: Any = None  # the model that was moved, where the traceback holds it


def _call_text(name: str, args: tuple, kwargs: dict) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f".{name}({', '.join(shown)})"


def _statement(filename: str, lineno: int, width: int = 160) -> str:
    """The statement at ``lineno`` of ``filename`` on one line (a call spread over lines is shown whole)."""
    import ast

    line = linecache.getline(filename, lineno).strip()
    source = "".join(linecache.getlines(filename))
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return line
    best = None
    compound = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.With, ast.Try, ast.If, ast.For, ast.While)
    for node in ast.walk(tree):
        if (isinstance(node, ast.stmt) and not isinstance(node, compound)
                and node.lineno <= lineno <= (node.end_lineno or node.lineno)
                and (best is None or node.lineno >= best.lineno)):
            best = node
    segment = ast.get_source_segment(source, best) if best is not None else None
    text = " ".join(segment.split()).replace("( ", "(").replace(" )", ")") if segment else line
    return text if len(text) <= width else f"{text[:width // 2 - 3]} ... {text[-(width // 2 - 2):]}"  # keep the call


def _where(frame, lineno: int) -> str:
    filename = frame.f_code.co_filename
    try:
        shown = str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        shown = filename
    return f"{shown}:{lineno} in {frame.f_code.co_name} (`{_statement(filename, lineno)}`)"


# The package whose wrappers stand between the loader and torch while a check runs (loader/cuda_pins.py's .to).
SEAM_PACKAGE = "pytest_llmload.loader."


def _made_by(frames: list, index: int) -> str:
    """The innermost frame before ``frames[index]`` that is not a library's, and the library call between."""
    library_call = None
    for frame, lineno in reversed(frames[:index]):
        module = module_of(frame)
        if module.startswith(SEAM_PACKAGE):  # the seam's own wrappers (a CUDA pin mapped to the cpu): not the caller
            continue
        if is_library(module, LIBRARIES):
            if library_call is None:
                library_call = f"{module}.{frame.f_code.co_name}"
            continue
        where = _where(frame, lineno)
        return f"{where}, through {library_call}" if library_call else where
    return f"{library_call or 'an unknown caller'}"


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def find_move(exc: BaseException) -> Optional[Move]:
    """The move of an offloaded model that raised ``exc`` (or an exception it was raised from), if it was one:
    accelerate's refusal, or torch failing to copy a meta parameter out of a ``.cpu()``/``.to()`` of a model
    whose modules are offloaded. ``None`` for anything else."""
    for error in _chain(exc):
        frames = list(traceback.walk_tb(error.__traceback__))
        if re.search(ACCELERATE_REFUSAL, str(error)):
            for i, (frame, _) in enumerate(frames):
                if module_of(frame) == "accelerate.big_modeling" and "model" in frame.f_locals:
                    local = frame.f_locals
                    name = getattr(local.get("fn"), "__name__", "to")
                    state = offload_state(local["model"])
                    return Move(_call_text(name, local.get("args", ()), local.get("kwargs", {})),
                                _made_by(frames, i), state, error, local["model"])
            return Move(".to(...)", "an unknown caller (no accelerate frame in the traceback)", None, error)
        if "meta" not in str(error):
            continue
        for i, (frame, _) in enumerate(frames):
            if (module_of(frame) == "torch.nn.modules.module" and frame.f_code.co_name in MOVES
                    and "self" in frame.f_locals):
                state = offload_state(frame.f_locals["self"])
                if not state.by_accelerate:
                    break  # a model on meta that accelerate did not offload (built on meta): not this failure
                local = frame.f_locals
                args = tuple(local.get("args", ())) or tuple(
                    local[k] for k in ("device", "dst_type") if local.get(k) is not None)
                return Move(_call_text(frame.f_code.co_name, args, dict(local.get("kwargs", {}))),
                            _made_by(frames, i), state, error, frame.f_locals["self"])
    return None


def check_offloaded_model_not_moved(loader: Loader, checkpoint, workdir, *, device: str = "cpu",
                                    fraction: float = 0.5) -> None:
    """Guards move-offloaded: an offloading inference load returns a usable model, never moved or cast after it.

    The request's ``max_memory`` holds ``fraction`` of the weights on ``device`` (the rest: disk on cpu, cpu
    on ``cuda:N``), with an ``offload_folder``. A ``.to()``/``.cuda()``/``.cpu()`` of the offloaded model
    (by the loader, or by a library it calls: ``deepspeed.initialize``) fails, naming the call, where it was
    made and the ``hf_device_map``. Skips when the returned model has nothing offloaded (loaded whole);
    otherwise the model must run one forward pass as returned (an error there propagates as it is)."""
    import torch

    request = LoadRequest(checkpoint, purpose="inference", device=device,
                          max_memory=offload_budget(checkpoint, device, fraction=fraction),
                          offload_folder=Path(workdir) / "offload")
    try:
        model, request = contract.load(loader, request, check=CHECK.name).model_and_request
    except LoaderError as exc:
        move = find_move(exc.original)
        if move is None:
            raise  # the loader's own error, not this failure
        if move.model is not None:  # no model came back to the seam: the report draws the one that was moved
            track_model(move.model, str(checkpoint))
        accelerate_said = re.search(ACCELERATE_REFUSAL, str(move.error)) is not None
        # torch's own text for the meta copy is another catalog entry's signature: say what it means instead
        error = (f"{type(move.error).__name__}: {move.error}" if accelerate_said
                 else f"{type(move.error).__name__} from torch (a meta parameter has no data to copy)")
        state = move.state.describe() if move.state else "the model was not found in the traceback"
        counts = f"{move.state.meta} of {move.state.parameters}" if move.state else "some of its"
        raise AssertionError(
            f"move-offloaded: the loader moved a model with {counts} parameters offloaded: {move.call} at "
            f"{move.made_by} raised {error}\n  {state}\n  (max_memory={request.max_memory_dict}, "
            f"offload_folder={request.offload_folder}). A model loaded with an offloading device_map is already "
            "placed: use it as loaded, or load it whole (device_map={'': device}) when it fits."
        ) from (move.error if accelerate_said else None)
    if not offloaded_parts(model):
        not_exercised(CHECK.name, f"loaded the model {where_loaded(model)} under "
                      f"max_memory={request.max_memory}: nothing was offloaded", "moving an offloaded model")
    model.eval()
    ids = input_ids(model, device, batch=1, length=8)
    with torch.no_grad():  # usable as loaded: accelerate's hooks bring each offloaded layer in (errors propagate)
        model(input_ids=ids)


# Isolated, like every check that calls the loader in this process: a load that hangs in native code can only be
# stopped by killing the process it runs in, and a loader may set up process-wide state (deepspeed.initialize).
CHECK = Check(check_offloaded_model_not_moved, failure=FAILURE, isolated=True)
CHECKS = (CHECK, CHECK.on_gpu())
