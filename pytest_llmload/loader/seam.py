"""The loader seam: which loader is under test, and calling it under its contract.

Precedence, stated once: ``--llmload-loader``, then ``PYTEST_LLMLOAD_LOADER``, then the ini key
``llmload_loader``, then the built-in reference loader. A conftest can also override the ``llmload_loader``
fixture, which bypasses all of these.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

from pytest_llmload.system import tracebacks
from pytest_llmload.config.vocabulary import (  # (the names the plugin declares; read here)
    HOOK_ATTRIBUTE,
    HOOK_INI,
    HOOK_OPTION,
    DTYPES_ATTRIBUTE,
    NOT_APPLICABLE_ATTRIBUTE,
    PURPOSES_ATTRIBUTE,
    LOADER_ENV as ENV_VAR,
    LOADER_INI as INI_KEY,
    LOADER_OPTION as OPTION,
)

# The seam's errors cross a process boundary (an isolated check's child, a rank) as themselves, though their
# __init__ takes more than the message: the one scheme every boundary uses.
from pytest_llmload.runners.wire import Portable
from pytest_llmload.system.words import a_type

if TYPE_CHECKING:
    from pytest_llmload.loader.request import LoadRequest

# Where a run names no loader, the caller's default: the built-in reference loader, which a layer above this one holds
# (pytest_llmload.fixes.reference_loader.REFERENCE), so this layer names it only by its source.
REFERENCE_SOURCE = "built-in default"

_SPEC_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class LoaderSpecError(Exception):
    """A loader spec that is malformed, does not import, or names no callable."""


class LoaderContractError(Portable, TypeError):
    """A loader that returned something other than a model or ``(model, tokenizer)``, or that changed
    process-wide state the harness needs (its own ``Accelerator()``)."""


class LoaderError(Portable, Exception):
    """The loader raised. Not a known failure by itself: a check names a failure only when it sees the failure's
    own mechanism; anything else is the loader's own error, reported as an ``error`` row. ``original`` is the
    loader's exception (also chained as ``__cause__``, so the full traceback is in the log). Where it is a known
    loader fault (:mod:`pytest_llmload.loader.faults`), ``cause`` says it in one sentence and ``fix`` is the code to
    write instead (``None`` otherwise); both are in the message too, before the loader's frames and the source line
    of the innermost one (the pin, the keyword: what to change)."""

    def __init__(self, original: BaseException, loader_name: str, request: "LoadRequest") -> None:
        from pytest_llmload.loader.faults import diagnose, said

        self.original = original
        diagnosis = diagnose(original)
        self.cause = diagnosis.cause if diagnosis else None
        self.fix = diagnosis.fix if diagnosis else None
        frames = _own_frames(original, loader_name)
        where = f"\n  in the loader's code: {' <- '.join(map(tracebacks.where, frames))}" if frames else ""
        where += "".join(f"\n    {line}" for line in _statement(frames[0])) if frames else ""
        super().__init__(f"loader error: {type(original).__name__}: {original} (loader {loader_name}, "
                         f"{_phase_detail(request)}){said(diagnosis) if diagnosis else ''}{where}")


class LoaderModelError(Portable, Exception):
    """The loader's model misbehaves in a way that is not the check's failure (it cannot train for another
    reason, say): reported as an ``error`` row, like :class:`LoaderError`, never as the known failure. ``fix``: the
    code to write instead, where the check knows it."""

    def __init__(self, message: str, fix: Optional[str] = None) -> None:
        self.fix = fix
        super().__init__(message)


def _own_frames(exc: BaseException, loader_name: str = "", keep: int = 3) -> list:
    """The innermost frames of the traceback in the loader's own code, innermost first: outside installed libraries
    and this package (a spy or a check's code the call passed through; the reference loader's module excepted, where
    it is the loader)."""
    import traceback

    module = sys.modules.get(loader_name.partition(":")[0]) if ":" in loader_name else None
    loader_file = os.path.abspath(getattr(module, "__file__", None) or os.devnull)

    def is_loaders(filename: str) -> bool:
        path = os.path.abspath(filename)
        return not tracebacks.is_installed(filename) and (not tracebacks.is_ours(path) or path == loader_file)

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_loaders(f.filename)]
    return list(reversed(frames[-keep:]))  # (traceback.FrameSummary: where, and its source line)


STATEMENT_LINES = 4  # of the loader's innermost statement, shown under its frame: a call over several lines whole


def _statement(frame) -> list[str]:
    """The source lines of the statement ``frame`` (a ``traceback.FrameSummary``) was running, dedented: a call
    written over several lines whole (its keyword is on one of them), up to :data:`STATEMENT_LINES`."""
    import linecache
    import textwrap

    last = min(getattr(frame, "end_lineno", None) or frame.lineno, frame.lineno + STATEMENT_LINES - 1)
    text = "".join(linecache.getline(frame.filename, n) for n in range(frame.lineno, last + 1))
    return [line for line in textwrap.dedent(text).splitlines() if line.strip()]


class LoaderChoice(NamedTuple):
    """A loader spec and where it came from (``--llmload-loader``, ``$PYTEST_LLMLOAD_LOADER``, ...)."""

    spec: str
    source: str

    @property
    def is_reference(self) -> bool:
        return self.source == REFERENCE_SOURCE


def choose_loader(option: Optional[str], environ: "os._Environ[str] | dict", ini: Optional[str],
                  default: Optional[LoaderChoice] = None) -> Optional[LoaderChoice]:
    """Apply the precedence; ``default`` where none of them names a loader (the plugin's: the reference loader).
    Each candidate is syntax-checked here, imported only when first used."""
    _refuse_empty_option(option, OPTION)
    if option is None and ENV_VAR in environ and not environ[ENV_VAR].strip():
        # `PYTEST_LLMLOAD_LOADER=$LOADER` with LOADER unset in a CI file: the same mistake as the empty option.
        raise LoaderSpecError(f"${ENV_VAR} is set but empty; set it to the loader under test as 'module:function', "
                              f"or unset it to use the ini key {INI_KEY} or the built-in reference loader.")
    for value, source in ((option, OPTION), (environ.get(ENV_VAR), f"${ENV_VAR}"), (ini, f"ini '{INI_KEY}'")):
        if value is not None and value.strip():
            choice = LoaderChoice(value.strip(), source)
            check_spec_syntax(choice)
            return choice
    return default


def _refuse_empty_option(value: Optional[str], option: str) -> None:
    # `--llmload-loader=$LOADER` with LOADER unset would otherwise check the next candidate (the reference
    # loader, say) and pass: a green run that checked something else. An empty ini key, by contrast, reads as
    # unset, as usual (an empty environment variable is refused in choose_loader).
    if value is not None and not value.strip():
        raise LoaderSpecError(f"{option} {value!r} is empty; give it 'module:function', or leave the option out.")


def choose_training_args_hook(option: Optional[str], ini: Optional[str]) -> Optional[LoaderChoice]:
    """The training script's hook by its precedence (option, then ini; the loader's own attribute is read by the
    check), syntax-checked; ``None`` when neither names one."""
    _refuse_empty_option(option, HOOK_OPTION)
    for value, source in ((option, HOOK_OPTION), (ini, f"ini '{HOOK_INI}'")):
        if value is not None and value.strip():
            choice = LoaderChoice(value.strip(), source)
            check_spec_syntax(choice)
            return choice
    return None


def check_spec_syntax(choice: LoaderChoice) -> None:
    if not _SPEC_RE.match(choice.spec):
        raise LoaderSpecError(
            f"loader spec {choice.spec!r} from {choice.source} is not of the form 'module:function' "
            "(for example 'mypkg.loading:load_model_and_tokenizer'); fix it there."
        )


def import_loader(choice: LoaderChoice) -> Callable[["LoadRequest"], Any]:
    """Import ``module:attr.path`` and return the callable, or raise :class:`LoaderSpecError` saying why."""
    check_spec_syntax(choice)
    module_name, _, attr_path = choice.spec.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LoaderSpecError(
            f"loader spec {choice.spec!r} from {choice.source}: module {module_name!r} does not import "
            f"({type(exc).__name__}: {exc}). Is it installed, or on sys.path (rootdir conftest, PYTHONPATH)?"
        ) from exc
    except (Exception, SystemExit) as exc:  # the module's own code failed (or exited) while being imported
        message = exc.msg if isinstance(exc, SyntaxError) else exc
        raise LoaderSpecError(
            f"loader spec {choice.spec!r} from {choice.source}: importing module {module_name!r} raised "
            f"{type(exc).__name__}: {message} ({_where_raised(exc)}); fix the module so that importing it runs no "
            "script code (put that under `if __name__ == '__main__':`), or name another loader."
        ) from exc
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise LoaderSpecError(
                f"loader spec {choice.spec!r} from {choice.source}: module {module_name!r} has no attribute "
                f"{attr_path!r}. Name the function that takes a LoadRequest."
            ) from exc
    if not callable(obj):
        raise LoaderSpecError(
            f"loader spec {choice.spec!r} from {choice.source} names {a_type(obj)}, not a callable. "
            "Name a function that takes a pytest_llmload.LoadRequest."
        )
    return obj


def _where_raised(exc: BaseException) -> str:
    """``path:line`` of the innermost frame of ``exc`` outside importlib (for a SyntaxError, the bad line)."""
    import traceback

    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not tracebacks.is_frozen(f.filename)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "no traceback"


class LoadResult(NamedTuple):
    """What a loader returned, normalised: the model and, where the loader gave one, its tokenizer."""

    model: Any
    tokenizer: Any = None


def _describe(value: Any) -> str:
    text = repr(value)
    return (text[:80] + "...") if len(text) > 80 else text


def normalise_result(value: Any, *, loader_name: str, request: "LoadRequest") -> LoadResult:
    """Check a loader's return value against the contract and wrap it as a :class:`LoadResult`."""
    torch = sys.modules.get("torch")
    module_type = torch.nn.Module if torch is not None else None

    def is_model(obj: Any) -> bool:
        return module_type is not None and isinstance(obj, module_type)

    if is_model(value):
        return LoadResult(value, None)
    if isinstance(value, tuple) and len(value) == 2 and is_model(value[0]):
        return LoadResult(value[0], value[1])
    got = f"a {len(value)}-tuple {_describe(value)}" if isinstance(value, tuple) else _describe(value)
    raise LoaderContractError(
        f"loader {loader_name} returned {got} (type {type(value).__name__}) for a purpose={request.purpose!r} request of "
        f"{request.model_path}; a loader must return a torch.nn.Module (a transformers model) or a "
        "(model, tokenizer) tuple."
    )


class LoaderUnderTest(NamedTuple):
    """A loader together with its name, called under the contract: ``loader(request) -> LoadResult``.
    What the loader declares about itself, as scikit-learn's estimator tags do: ``purposes``, what it is for
    (``None``: anything); ``dtypes``, the dtypes it loads (``None``: observed, see
    :func:`pytest_llmload.checks.contract.load`); ``not_applicable``, ``(check name, reason)`` pairs for the
    checks that do not apply to the repo."""

    function: Callable[["LoadRequest"], Any]
    name: str
    source: str = "fixture"
    purposes: Optional[tuple[str, ...]] = None
    dtypes: Optional[tuple[str, ...]] = None
    not_applicable: tuple[tuple[str, str], ...] = ()

    def not_applicable_reason(self, check: str) -> Optional[str]:
        """Why the repo declared ``check`` not to apply to it, or ``None``."""
        return next((reason for name, reason in self.not_applicable if name == check), None)

    def __call__(self, request: "LoadRequest") -> LoadResult:
        return call_loader(self.function, request, loader_name=self.name)


def call_loader(loader: Callable[["LoadRequest"], Any], request: "LoadRequest", *, loader_name: str = "") -> LoadResult:
    """Call ``loader(request)`` and normalise what it returns; raises :class:`LoaderContractError`."""
    if isinstance(loader, LoaderUnderTest):
        return loader(request)
    from pytest_llmload.instruments.phases import phase, track_model
    from pytest_llmload.instruments.recorder import MODEL_ATTRIBUTE_FIX, ModelAttributeError
    from pytest_llmload.loader import cuda_pins

    name = loader_name or getattr(loader, "__qualname__", None) or repr(loader)
    # What the loader leaves in the process is put back on every way out of it (returned, raised, exited): a check
    # that goes on after a loader's error (a retry, the next mode) must not inherit the loader's set-up.
    # A CUDA pin on a runner without CUDA runs on the cpu where the check observes the same load (cuda_pins).
    with phase("load", _phase_detail(request)) as timed, _exits_refused(name, request), \
            _accelerate_state_kept(name), _environment_kept(name), _torch_defaults_kept(name), \
            cuda_pins.mapped_to_cpu(request):
        try:
            returned = loader(request)
        except Exception as exc:
            raise LoaderError(exc, name, request) from exc
        result = normalise_result(returned, loader_name=name, request=request)
    if getattr(sys.stdout, "closed", False) or getattr(sys.stderr, "closed", False):
        closed = "sys.stdout" if getattr(sys.stdout, "closed", False) else "sys.stderr"
        raise LoaderContractError(f"loader {name} closed {closed} while loading ({_phase_detail(request)}): the "
                                  "process it runs in still writes there; a loader must leave the process's streams open.")
    try:
        track_model(result.model, request.model_path, timed.seconds)
    except ModelAttributeError as exc:  # (the first reader of the model's attributes: a hostile model fails here)
        raise LoaderModelError(f"loader {name} returned a model that fails when read: {exc}",
                               fix=MODEL_ATTRIBUTE_FIX) from exc
    return result


@contextlib.contextmanager
def _torch_defaults_kept(name: str):
    """torch's process-wide defaults (``set_default_dtype``, ``set_default_device``) as they were before the loader
    ran: a loader that leaves them changed (a model builder that sets bfloat16 or "meta" and never resets it) would
    make whatever runs next in the process (the check's ground truth, the training script) build its tensors there.
    They are put back, and the row names the loader as the one that changed them."""
    torch = sys.modules.get("torch")
    before = None if torch is None else (torch.get_default_dtype(), _default_device(torch))
    try:
        yield
    finally:
        torch = sys.modules.get("torch")
        if torch is not None:
            dtype, device = before or (torch.float32, "cpu")
            left = []
            if torch.get_default_dtype() != dtype:
                left.append(f"torch.set_default_dtype({torch.get_default_dtype()})")
                torch.set_default_dtype(dtype)
            if str(_default_device(torch)) != str(device):
                left.append(f"torch.set_default_device({str(_default_device(torch))!r})")
                torch.set_default_device(None if str(device) == "cpu" else device)
            if left:
                from pytest_llmload.config.stash_keys import add_note

                add_note(f"the loader {name} left {' and '.join(left)} behind; put back to {dtype} on {device} for "
                         "what runs after it in this process (a training script after such a loader would build its "
                         "tensors there: reset it in the loader)")


def _default_device(torch) -> str:
    getter = getattr(torch, "get_default_device", None)  # (torch >= 2.3)
    return str(getter()) if getter is not None else "cpu"


class _LoaderExited(BaseException):
    """``os._exit`` called by the loader, turned into an exception: a BaseException, past its ``except Exception``."""


@contextlib.contextmanager
def _exits_refused(name: str, request: "LoadRequest"):
    """A loader that ends its process (``sys.exit``, ``os._exit``) is an error row saying so, not a dead child
    blamed on the check's failure."""
    real_exit = os._exit
    loading_pid = os.getpid()

    def refuse(code=0):
        if os.getpid() != loading_pid:  # a child the loader forked ends as fork children do: that is no exit of ours
            real_exit(code)
        raise _LoaderExited(code)

    os._exit = refuse
    try:
        yield
    except (SystemExit, _LoaderExited) as exc:
        how = "sys.exit" if isinstance(exc, SystemExit) else "os._exit"
        raise LoaderContractError(
            f"loader {name} tried to end its process with {how}({exc.args[0] if exc.args else ''}) while loading "
            f"({_phase_detail(request)}); a loader must return the model or raise, never exit.") from None
    finally:
        os._exit = real_exit


# accelerate's process-wide states, each a class whose instances share one ``_shared_state`` dict.
_ACCELERATE_STATES = ("AcceleratorState", "PartialState", "GradientState")


def _accelerate_states_set_up() -> frozenset:
    """The names of accelerate's shared states that are set up; empty where accelerate is not imported."""
    state = sys.modules.get("accelerate.state")
    return frozenset(name for name in _ACCELERATE_STATES
                     if getattr(getattr(state, name, None), "_shared_state", None))


@contextlib.contextmanager
def _accelerate_state_kept(name: str):
    """accelerate's shared states as they were before the loader ran. An evaluation harness or a script that makes
    its own ``Accelerator()`` (or ``PartialState()``) before loading is correct for how its users run it; what the
    check does next (its own Accelerator, DeepSpeed, a Trainer, a retry of the load) must start from the
    environment, not from the loader's choice: each state the loader set up is reset, also when it then raised,
    and the row says so. A state set up before the loader ran is the harness's, and stays."""
    before = _accelerate_states_set_up()
    try:
        yield
    finally:
        made = sorted(_accelerate_states_set_up() - before, key=_ACCELERATE_STATES.index)
        if made:
            state = sys.modules["accelerate.state"]
            for cls in made:
                getattr(state, cls)._reset_state()  # (AcceleratorState's leaves PartialState: reset on its own)
            from pytest_llmload.config.stash_keys import add_note

            what = "Accelerator()" if "AcceleratorState" in made else f"{made[0]}()"
            add_note(f"the loader {name} made its own {what} while loading; accelerate's process-wide state was reset "
                     "after the load, so the check's own set-up starts from the environment as a training script's "
                     "would")


@contextlib.contextmanager
def _environment_kept(name: str):
    """``os.environ`` as it was before the loader ran: a loader that sets ``LOCAL_RANK``, ``CUDA_VISIBLE_DEVICES`` or
    ``ACCELERATE_USE_DEEPSPEED`` (``Accelerator(deepspeed_plugin=...)`` does) would change what the check's own
    set-up decides after it. Every variable it set, changed or removed is put back, and the row names them."""
    before = dict(os.environ)
    try:
        yield
    finally:
        changed = sorted(key for key in set(before) | set(os.environ) if before.get(key) != os.environ.get(key))
        for key in changed:
            if key in before:
                os.environ[key] = before[key]
            else:
                del os.environ[key]
        if changed:
            from pytest_llmload.config.stash_keys import add_note

            add_note(f"the loader {name} changed the environment variable{'s' if len(changed) > 1 else ''} "
                     f"{', '.join(changed)} while loading; put back after the load, so the check's own set-up reads "
                     "the environment it was given")


def _phase_detail(request: "LoadRequest") -> str:
    """``llama-float32-seed0 for train on cpu, lora, max_memory``: what a load phase loaded."""
    extras = [flag for flag in ("lora", "gradient_checkpointing") if getattr(request, flag)]
    extras += [request.quantization] if request.quantization else []
    extras += [f"max_memory={dict(request.max_memory)}"] if request.max_memory is not None else []
    head = f"{os.path.basename(os.fspath(request.model_path).rstrip(os.sep))} for {request.purpose} on {request.device}"
    return ", ".join([head, *extras])


def as_loader_under_test(loader: Any, *, name: str = "", source: str = "fixture") -> LoaderUnderTest:
    """Wrap a plain callable (or pass a :class:`LoaderUnderTest` through)."""
    if isinstance(loader, LoaderUnderTest):
        return loader
    if not callable(loader):
        raise LoaderSpecError(
            f"the loader from {source} is {a_type(loader)} ({_describe(loader)}), not a callable; "
            "the llmload_loader fixture must return a function that takes a pytest_llmload.LoadRequest."
        )
    module = getattr(loader, "__module__", None)
    qualname = getattr(loader, "__qualname__", None)
    name = name or (f"{module}:{qualname}" if module and qualname else repr(loader))
    declared = getattr(loader, PURPOSES_ATTRIBUTE, None)
    purposes = None if declared is None else parse_purposes(declared, f"{name}.{PURPOSES_ATTRIBUTE}")
    declared = getattr(loader, DTYPES_ATTRIBUTE, None)
    dtypes = None if declared is None else parse_dtypes(declared, f"{name}.{DTYPES_ATTRIBUTE}")
    declared = getattr(loader, NOT_APPLICABLE_ATTRIBUTE, None)
    not_applicable = () if declared is None else parse_not_applicable(declared, f"{name}.{NOT_APPLICABLE_ATTRIBUTE}")
    return LoaderUnderTest(loader, name, source, purposes, dtypes, not_applicable)


def training_args_hook(loader: LoaderUnderTest) -> Optional[Callable[[Any, Any], Any]]:
    """The training-script hook a loader names in its ``llmload_training_args_hook`` attribute, imported."""
    spec = getattr(loader.function, HOOK_ATTRIBUTE, None)
    if spec is None or callable(spec):
        return spec
    return import_loader(LoaderChoice(str(spec), f"{loader.name}.{HOOK_ATTRIBUTE}"))


def parse_purposes(declared: Any, source: str) -> tuple[str, ...]:
    """``("inference",)`` from an attribute or ini lines; :class:`LoaderSpecError` naming ``source`` otherwise."""
    values = (declared,) if isinstance(declared, str) else declared
    try:
        purposes = tuple(str(v).strip() for v in values if str(v).strip())
    except TypeError:
        purposes = ()
    if not purposes or any(p not in ("inference", "train") for p in purposes):
        raise LoaderSpecError(
            f"{source} = {declared!r} is not a list of purposes; use 'inference' and/or 'train', "
            "e.g. load.llmload_purposes = ('inference',) for an evaluation loader."
        )
    return purposes


def declaration_parsers() -> tuple:
    """``(setting key, LoaderUnderTest field, parser)`` for what a configuration declares about the loader: read at
    configure (a bad value is one usage error) and applied by the ``llmload_loader`` fixture."""
    return (("loader_purposes", "purposes", parse_purposes), ("loader_dtypes", "dtypes", parse_dtypes),
            ("not_applicable", "not_applicable", parse_not_applicable))


def parse_dtypes(declared: Any, source: str) -> tuple[str, ...]:
    """``("bfloat16",)`` from an attribute or ini lines (``torch.bfloat16``, ``"bf16"`` too); :class:`LoaderSpecError`
    naming ``source`` otherwise."""
    from pytest_llmload.loader.request import DTYPES, _dtype_name

    values = (declared,) if isinstance(declared, str) or not hasattr(declared, "__iter__") else declared
    try:
        dtypes = tuple(dict.fromkeys(_dtype_name(v) for v in values if str(v).strip()))
    except (TypeError, ValueError):
        dtypes = ()
    if not dtypes:
        raise LoaderSpecError(
            f"{source} = {declared!r} is not a list of dtypes; use {', '.join(DTYPES)} (or torch dtypes), "
            "e.g. load.llmload_dtypes = ('bfloat16',) for a loader that loads bfloat16 whatever is asked.")
    return dtypes


def parse_not_applicable(declared: Any, source: str) -> tuple[tuple[str, str], ...]:
    """``(("check_x", "why"), ...)`` from a ``{check: reason}`` attribute or ``'check: reason'`` lines;
    :class:`LoaderSpecError` naming ``source`` otherwise. Which names are checks is verified where the run's checks
    are known (:func:`pytest_llmload.plugin.fixtures.declared_by_configuration`)."""
    items = declared.items() if hasattr(declared, "items") else None
    if items is None:
        lines = (declared,) if isinstance(declared, str) else declared
        try:
            items = [str(line).partition(":")[::2] for line in lines if str(line).strip()]
        except TypeError:
            items = None
    pairs = tuple((str(name).strip(), str(reason).strip()) for name, reason in (items or ()))
    if not pairs or any(not name or not reason for name, reason in pairs):
        raise LoaderSpecError(
            f"{source} = {declared!r} does not declare checks with their reasons; use a mapping "
            "{'check_name': 'why it does not apply to this repo'} (or ini lines 'check_name: why'), e.g. "
            "load.llmload_not_applicable = {'check_offload_inference': 'we never offload'}.")
    return pairs
