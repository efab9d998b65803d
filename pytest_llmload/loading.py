"""The loader seam: which loader is under test, and calling it under its contract.

Precedence, stated once: ``--llmload-loader``, then ``PYTEST_LLMLOAD_LOADER``, then the ini key
``llmload_loader``, then the built-in reference loader. A conftest can also override the ``llmload_loader``
fixture, which bypasses all of these.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

if TYPE_CHECKING:
    from pytest_llmload.request import LoadRequest

ENV_VAR = "PYTEST_LLMLOAD_LOADER"
INI_KEY = "llmload_loader"
OPTION = "--llmload-loader"
REFERENCE_SPEC = "pytest_llmload.reference_loader:load_model_and_tokenizer"
LOADER_HELP = (
    "the loader under test, as 'module:function' (a callable taking a pytest_llmload.LoadRequest and "
    f"returning a model or (model, tokenizer)). Precedence: {OPTION}, ${ENV_VAR}, ini '{INI_KEY}'. "
    "Default: the built-in reference loader."
)

_SPEC_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class LoaderSpecError(Exception):
    """A loader spec that is malformed, does not import, or names no callable."""


class LoaderContractError(TypeError):
    """A loader that returned something other than a model or ``(model, tokenizer)``."""


class LoaderChoice(NamedTuple):
    """A loader spec and where it came from (``--llmload-loader``, ``$PYTEST_LLMLOAD_LOADER``, ...)."""

    spec: str
    source: str

    @property
    def is_reference(self) -> bool:
        return self.spec == REFERENCE_SPEC


def choose_loader(option: Optional[str], environ: "os._Environ[str] | dict", ini: Optional[str]) -> LoaderChoice:
    """Apply the precedence. Each candidate is syntax-checked here, imported only when first used."""
    for value, source in ((option, OPTION), (environ.get(ENV_VAR), f"${ENV_VAR}"), (ini, f"ini '{INI_KEY}'")):
        if value is not None and value.strip():
            choice = LoaderChoice(value.strip(), source)
            check_spec_syntax(choice)
            return choice
    return LoaderChoice(REFERENCE_SPEC, "built-in default")


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
            f"loader spec {choice.spec!r} from {choice.source} names a {type(obj).__name__}, not a callable. "
            "Name a function that takes a pytest_llmload.LoadRequest."
        )
    return obj


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
    """A loader together with its name, called under the contract: ``loader(request) -> LoadResult``."""

    function: Callable[["LoadRequest"], Any]
    name: str
    source: str = "fixture"

    def __call__(self, request: "LoadRequest") -> LoadResult:
        return call_loader(self.function, request, loader_name=self.name)


def call_loader(loader: Callable[["LoadRequest"], Any], request: "LoadRequest", *, loader_name: str = "") -> LoadResult:
    """Call ``loader(request)`` and normalise what it returns; raises :class:`LoaderContractError`."""
    if isinstance(loader, LoaderUnderTest):
        return loader(request)
    from pytest_llmload.diagnostics.phases import phase, track_model

    name = loader_name or getattr(loader, "__qualname__", None) or repr(loader)
    with phase("load", _phase_detail(request)) as timed:
        result = normalise_result(loader(request), loader_name=name, request=request)
    track_model(result.model, request.model_path, timed.seconds)
    return result


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
            f"the loader from {source} is a {type(loader).__name__} ({_describe(loader)}), not a callable; "
            "the llmload_loader fixture must return a function that takes a pytest_llmload.LoadRequest."
        )
    module = getattr(loader, "__module__", None)
    qualname = getattr(loader, "__qualname__", None)
    return LoaderUnderTest(loader, name or (f"{module}:{qualname}" if module and qualname else repr(loader)), source)
