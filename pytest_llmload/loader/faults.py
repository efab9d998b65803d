"""A loader's own fault, diagnosed: the cause in one sentence and the fix as code, from one table (:data:`FAULTS`).

A fault is known by what raised it, never by wording alone: the exception's type, the library whose frame raised it
(the innermost installed frame: transformers' own check, torch's CUDA initialisation) and its text, in every wording
of the stacks the project tests (transformers 4.56 and 5.x); and, beside the table, a name the loader's own code binds
only under an ``if`` about a GPU (its source read). An error row of the loader then says what to change
(``reason``, ``fix`` in the row record: ``--json``, JUnit, the HTML report, the table); anything not in the table is
the loader's error as raised, with ``fix`` left empty.

Example::

    try:
        AutoModelForCausalLM.from_pretrained(path, load_in_8bit=True)   # transformers 5
    except TypeError as exc:
        diagnose(exc).fix   # 'quantization_config=BitsAndBytesConfig(load_in_8bit=True)'

Only the standard library and :mod:`pytest_llmload.system.tracebacks`: the verdict reads it in the main job's parent.
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
import traceback
from typing import Callable, NamedTuple, Optional

from pytest_llmload.system import tracebacks


class Diagnosis(NamedTuple):
    """What a loader fault is: ``fault`` (the table's name for it), ``cause`` (one sentence, in the user's words),
    ``fix`` (code to write instead)."""

    fault: str
    cause: str
    fix: str


class LoaderFault(NamedTuple):
    """One known loader fault. ``raised``: the exception type names it comes as; ``raised_in``: module prefixes of
    the innermost installed frame it is raised from (``()``: raised by torch's native code, called from any frame);
    ``wording``: its text on every stack; ``cause`` and ``fix``: from the match, a sentence and code."""

    name: str
    raised: tuple[str, ...]
    raised_in: tuple[str, ...]
    wording: re.Pattern
    cause: Callable[[re.Match], str]
    fix: Callable[[re.Match], str]


# Keywords transformers 5 removed from from_pretrained (4.x took them with a deprecation warning); 5.x passes them on
# to the model's __init__, which refuses them. torch_dtype -> dtype is only deprecated on 5.x: not a fault.
REMOVED_KEYWORDS = {
    "load_in_8bit": "quantization_config=BitsAndBytesConfig(load_in_8bit=True)  # in place of load_in_8bit=True; "
                    "where the call already passes quantization_config=, only drop load_in_8bit=",
    "load_in_4bit": "quantization_config=BitsAndBytesConfig(load_in_4bit=True)  # in place of load_in_4bit=True; "
                    "where the call already passes quantization_config=, only drop load_in_4bit=",
    "use_auth_token": "token=<your token> (or nothing: the saved login is used)",
}

DEVICE_FIX = 'device_map={"": torch.cuda.current_device()} if torch.cuda.is_available() else "cpu"'
PAD_TOKEN_FIX = "model.resize_token_embeddings(len(tokenizer))"
# Why the runner cannot honour a CUDA pin, by torch's own words for it.
_NO_CUDA = {
    "Torch not compiled with CUDA enabled": "the installed torch is built without CUDA",
    "No CUDA GPUs are available": "this runner has no CUDA GPU",
    "Found no NVIDIA driver on your system": "this runner has no NVIDIA driver (no GPU)",
    "Cannot access accelerator device when none is available": "this runner has no GPU (torch.device(0) needs one)",
    "invalid device ordinal": "the GPU index is beyond the GPUs this runner has",
}


def _installed_transformers() -> str:
    version = getattr(sys.modules.get("transformers"), "__version__", None)
    return f"the installed transformers {version}" if version else "transformers 5"


def _removed_keyword(match: re.Match) -> str:
    keyword = match["keyword"]
    return (f"{keyword}= is a from_pretrained keyword transformers 5 removed (4.x took it with a deprecation "
            f"warning): {_installed_transformers()} hands it on to the model's __init__, which refuses it")


def _tokenizer_package(match: re.Match) -> str:
    package = (match["package"] or "sentencepiece").lower()
    return (f"the tokenizer needs the {package} package to load (a slow, SentencePiece- or tiktoken-based tokenizer, "
            "or one converted from it), and it is not installed in this environment")


def _package_fix(match: re.Match) -> str:
    package = (match["package"] or "sentencepiece").lower()
    package = "sentencepiece tiktoken" if package == "sentencepiece or tiktoken" else package
    return f"pip install {package}  # or AutoTokenizer.from_pretrained(path, use_fast=True) with a tokenizer.json"


COMPILE_CACHE_FIX = ("export TORCHINDUCTOR_CACHE_DIR=<a directory this job can write>  # before pytest starts, e.g. "
                     "$RUNNER_TEMP/torchinductor")


def _compile_cache(match: re.Match) -> str:
    """torch's inductor cache directory, as ``torch._inductor`` left it in the environment when it tried to make it."""
    import os

    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "the default, torchinductor_<user> in the temp dir"
    existing = folder
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing) if os.path.dirname(existing) != existing else ""
    why = ("a file, not a directory" if existing and not os.path.isdir(existing) else
           f"read-only ({existing!r} cannot be written)" if existing and not os.access(existing, os.W_OK) else
           "not a directory this process could create")
    return (f"torch's compile cache directory {folder!r} is {why}: torch._inductor's import fails making it (and "
            "every later import says only that a cache type is already registered)")


FAULTS: tuple[LoaderFault, ...] = (
    LoaderFault(
        "removed keyword", ("TypeError",), ("transformers.",),
        re.compile(r"__init__\(\) got an unexpected keyword argument '(?P<keyword>"
                   + "|".join(REMOVED_KEYWORDS) + ")'"),
        _removed_keyword, lambda match: REMOVED_KEYWORDS[match["keyword"]]),
    LoaderFault(  # transformers 4.x, where the keywords were only deprecated
        "removed keyword", ("ValueError",), ("transformers.modeling_utils",),
        re.compile(r"You can't pass `load_in_4bit`\s*or `load_in_8bit` as a kwarg when passing `quantization_config`"),
        lambda match: "from_pretrained got load_in_4bit=/load_in_8bit= and quantization_config= together: "
                      f"{_installed_transformers()} refuses both at once (and transformers 5 removed the keywords)",
        lambda match: "quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...) alone: drop load_in_4bit= and "
                      "load_in_8bit="),
    LoaderFault(  # (transformers 5 maps llama's tokenizer by its checkpoint, no longer by the type "llama")
        "tokenizer type", ("ValueError",), ("transformers.models.auto.tokenization_auto",),
        re.compile(r"Passed `tokenizer_type` (?P<type>\S+) does not exist"),
        lambda match: f"AutoTokenizer.from_pretrained(..., tokenizer_type={match['type']!r}) names a tokenizer type "
                      f"{_installed_transformers()} does not know",
        lambda match: "AutoTokenizer.from_pretrained(path)  # no tokenizer_type: the checkpoint's tokenizer_config.json "
                      "names its class"),
    LoaderFault(
        "device pin", ("AssertionError", "RuntimeError"), ("torch.cuda",),
        re.compile(r"(?P<why>Torch not compiled with CUDA enabled|No CUDA GPUs are available|"
                   r"Found no NVIDIA driver on your system)"),
        lambda match: f"the loader pins the model to a CUDA device (device_map={{'': 0}}, .cuda(), .to('cuda')) and "
                      f"{_NO_CUDA[match['why']]}",
        lambda match: DEVICE_FIX),
    LoaderFault(  # torch.device(0) and a bad ordinal fail in torch's native code, called from whichever frame pinned
        "device pin", ("RuntimeError",), (),
        re.compile(r"(?P<why>Cannot access accelerator device when none is available|invalid device ordinal)"),
        lambda match: f"the loader pins the model to a CUDA device by index (device_map={{'': 0}}, torch.device(0), "
                      f"cuda:N) and {_NO_CUDA[match['why']]}",
        lambda match: DEVICE_FIX),
    LoaderFault(  # attn_implementation="flash_attention_2" hard-coded: needs the flash-attn package and a CUDA GPU
        "attention kernel", ("ImportError", "ValueError"), ("transformers.modeling_utils",),
        re.compile(r"FlashAttention(?P<version>\d*) has been toggled on, but it cannot be used due to the following "
                   r"error: (?P<why>[^.]*)"),
        lambda match: f"the loader asks for attn_implementation='flash_attention_{match['version'] or 2}', which "
                      f"this runner cannot run ({match['why'].strip()})",
        lambda match: f'attn_implementation="flash_attention_{match["version"] or 2}" if '
                      'importlib.util.find_spec("flash_attn") and torch.cuda.is_available() else "sdpa"'),
    LoaderFault(  # transformers 4.x's pipeline() builds its generation config from the model's: a second one refused
        "pipeline keyword", ("TypeError",), ("transformers.pipelines",),
        re.compile(r"got multiple values for keyword argument 'generation_config'"),
        lambda match: f"pipeline(..., generation_config=...) is refused by {_installed_transformers()}: its pipeline "
                      "passes a generation config of its own, built from the model's",
        lambda match: "model.generation_config = generation_config  # before pipeline(...), and no generation_config= "
                      "in the pipeline call"),
    LoaderFault(
        "pad token", ("IndexError",), ("torch.nn.functional",),
        re.compile(r"index out of range in self"),
        lambda match: "a token id is past the model's embedding rows: the tokenizer has a token (a pad token added "
                      "with add_special_tokens, say) that the model's embeddings were never resized for",
        lambda match: PAD_TOKEN_FIX),
    LoaderFault(  # LoRA over frozen embeddings, checkpointed reentrantly (transformers 4.x's default for the model)
        "no gradient path", ("RuntimeError",), ("torch.autograd",),
        re.compile(r"element 0 of tensors does not require grad and does not have a grad_fn"),
        lambda match: "the loss has no gradient path to a trainable weight: reentrant gradient checkpointing "
                      "(transformers 4.x's default) over frozen input embeddings (a LoRA model's) cuts it, unless "
                      "the forward ran with gradients off",
        lambda match: "model.enable_input_require_grads()  # after loading, before training with gradient "
                      "checkpointing; or gradient_checkpointing_kwargs={'use_reentrant': False}"),
    LoaderFault(  # torch._inductor imported a second time after its first import could not make its cache directory
        "compile cache", ("AssertionError",), ("torch.compiler._cache",),
        re.compile(r"Artifact of type=(?P<type>\w+) already registered in mega-cache"),
        _compile_cache, lambda match: COMPILE_CACHE_FIX),
    LoaderFault(  # the first import of torch._inductor, making its cache directory
        "compile cache", ("FileNotFoundError", "PermissionError", "NotADirectoryError", "FileExistsError", "OSError"),
        ("torch._inductor.runtime.cache_dir_utils",), re.compile(r"\[Errno \d+\]"),
        _compile_cache, lambda match: COMPILE_CACHE_FIX),
    LoaderFault(
        "tokenizer package", ("ImportError",), ("transformers.utils.import_utils",),
        re.compile(r"requires the (?P<package>SentencePiece|protobuf) library but it was not found"),
        _tokenizer_package, _package_fix),
    LoaderFault(  # transformers 4.x's AutoTokenizer(use_fast=False) without sentencepiece
        "tokenizer package", ("ValueError",), ("transformers.models.auto.tokenization_auto",),
        re.compile(r"make sure you have `(?P<package>sentencepiece)` installed"),
        _tokenizer_package, _package_fix),
    LoaderFault(  # no tokenizer.json, and the slow tokenizer cannot be converted (4.x fast, 5.x tokenizers backend)
        "tokenizer package", ("ValueError",),
        ("transformers.tokenization_utils_fast", "transformers.tokenization_utils_tokenizers"),
        re.compile(r"You need to have (?P<package>sentencepiece or tiktoken) installed to convert a slow tokenizer"),
        _tokenizer_package, _package_fix),
    LoaderFault(
        "tokenizer package", ("ValueError",), ("transformers.convert_slow_tokenizer",),
        re.compile(r"`(?P<package>tiktoken)` is required to read a `tiktoken` file"),
        _tokenizer_package, _package_fix),
)

# Faults a loader's model shows after the load too (a check's forward or backward): the loader's, not the check's.
MODEL_FAULTS = ("pad token", "no gradient path")


def said(diagnosis: Diagnosis) -> str:
    """The lines a message adds for a diagnosed fault, its cause and its fix (read back by :func:`fix_in`)."""
    return f"\n  cause: {diagnosis.cause}.\n  fix: {diagnosis.fix}"


_FIX_LINE = re.compile(r"^\s*fix: (.+)$", re.MULTILINE)


def fix_in(text: str) -> Optional[str]:
    """The fix a message says (:func:`said`), where the exception that carried it did not come back as itself."""
    found = _FIX_LINE.search(text)
    return found[1].strip() if found else None


def diagnose(exc: BaseException, traceback_text: str = "") -> Optional[Diagnosis]:
    """The known loader fault ``exc`` (or an exception it was raised from, or while handling) is, ``None`` where it is
    none. ``traceback_text``: the frames of an exception that crossed a process boundary without its traceback."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        found = _diagnosed(exc, _raising_module(exc, traceback_text)) or _bound_only_where_a_gpu_is(exc)
        if found is not None:
            return found
        exc, traceback_text = exc.__cause__ or exc.__context__, ""
    return None


def _diagnosed(exc: BaseException, raising_module: str) -> Optional[Diagnosis]:
    text = str(exc)
    for fault in FAULTS:
        if type(exc).__name__ not in fault.raised:
            continue
        if fault.raised_in and not raising_module.startswith(fault.raised_in):
            continue
        match = fault.wording.search(text)
        if match is not None:
            return Diagnosis(fault.name, fault.cause(match), fault.fix(match))
    return None


# A frame's file in traceback text.
_FRAME_FILE = re.compile(r'File "([^"]+)", line \d+')


def _raising_module(exc: BaseException, traceback_text: str) -> str:
    """The module of the innermost installed frame ``exc`` was raised through (``torch.cuda.__init__``)."""
    if exc.__traceback__ is not None:
        modules = [tracebacks.installed_module(frame.filename) for frame in traceback.extract_tb(exc.__traceback__)]
    else:
        modules = [tracebacks.installed_module(path) for path in _FRAME_FILE.findall(traceback_text)]
    return next((module for module in reversed(modules) if module), "")


# A local the loader read before binding it (3.11's words, then older Pythons'), and an `if` about a GPU.
_UNBOUND = re.compile(r"(?:cannot access local variable|local variable) '(?P<name>\w+)'")
_ABOUT_A_GPU = re.compile(r"cuda|xpu|gpu", re.IGNORECASE)


def _bound_only_where_a_gpu_is(exc: BaseException) -> Optional[Diagnosis]:
    """A name the loader's own code binds only under an ``if`` about a GPU, then reads on a runner without one
    (qlora's ``if torch.cuda.is_available(): n_gpus = ...`` and then ``range(n_gpus)``): known by the
    ``UnboundLocalError`` raised in the loader's own frame and by that function's source, every assignment of the
    name under such an ``if``."""
    import inspect

    match = _UNBOUND.search(str(exc)) if isinstance(exc, UnboundLocalError) else None
    if match is None or exc.__traceback__ is None:
        return None
    *_, (frame, _line) = traceback.walk_tb(exc.__traceback__)
    if tracebacks.is_installed(frame.f_code.co_filename):
        return None  # (a library's own bug)
    try:
        lines, first = inspect.getsourcelines(frame.f_code)
        function = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    guards = _guards_of(function, match["name"])
    if not guards or not all(guard is not None and _ABOUT_A_GPU.search(guard[0]) for guard in guards):
        return None
    test, line = guards[0]
    return Diagnosis(
        "device pin",
        f"the loader binds {match['name']} only where a GPU is (`if {test}:`, line {first + line - 1}) and then reads "
        "it: on this runner without one it has no value",
        f"{match['name']} = ...  # before `if {test}:`, its value where no GPU is (0 GPUs, \"cpu\")")


def _guards_of(tree: ast.AST, name: str) -> list:
    """For each assignment of ``name`` in ``tree``: ``(the test of its innermost enclosing if, that if's line)``, or
    ``None`` where it is bound unconditionally."""
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    guards = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            enclosing = parents.get(node)
            while enclosing is not None and not isinstance(enclosing, (ast.If, ast.FunctionDef)):
                enclosing = parents.get(enclosing)
            guards.append((ast.unparse(enclosing.test), enclosing.lineno) if isinstance(enclosing, ast.If) else None)
    return guards
