"""MkDocs hooks (``hooks:`` in mkdocs.yml): the pages generated from code at build time, so the docs cannot drift from it.

- ``failures/index.md`` and one ``failures/<id>.md`` per known failure, from :data:`pytest_llmload.failures.CATALOG`,
  :data:`~pytest_llmload.failures.MODULES` and :data:`~pytest_llmload.failures.REGISTRY`, with the docstrings of
  each failure's before-loader (``fixtures/loaders/before_<id>.py``) and regression tests
  (``tests/failures/test_<id>.py``);
- the known-failures table of README.md and of the home page (``docs/index.md``), from the catalog: the site's copy
  is made at build time, and ``python docs/hooks.py`` rewrites both files' copies (between :data:`TABLE_START` and
  :data:`TABLE_END`), which tests/failures/test_homes.py checks are current;
- ``reference/settings.md``: every setting of :data:`pytest_llmload.config.vocabulary.SETTINGS`, the markers' help texts and
  the fixtures' docstrings (read from ``pytest_llmload/plugin/fixtures.py`` without importing it);
- the ``LoadRequest`` field table, written between a page's ``<!-- llmload:load-request-fields ... -->`` lines;
- ``reference/api.md``: the helpers a fix names (:data:`API_MODULES`), each with its signature, its docstring and an
  anchor named by its dotted path; a failure page's Fix section links each helper it names there (:func:`linked`).

The functions that make the pages (:func:`generated_pages`, :func:`failure_page`, :func:`known_failures_table`,
:func:`settings_page`, :func:`load_request_fields`, :func:`api_page`) import nothing of MkDocs, so a test can call
them without it (tests/test_docs.py).
Importing the catalog and the API page's modules needs neither torch nor the Hugging Face stack (CI's docs step has
neither).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Tables written into the pages themselves (readable on GitHub, not only on the built site), between a start and an
# end line: the LoadRequest fields on the loader contract, KnownFailure's and Check's on the extension API.
FIELDS_MARK = "<!-- llmload:load-request-fields (generated from LoadRequest: python docs/hooks.py) -->"
FIELDS_END = "<!-- /llmload:load-request-fields -->"
RECORDS_MARK = "<!-- llmload:record-fields (generated from the records: python docs/hooks.py) -->"
RECORDS_END = "<!-- /llmload:record-fields -->"
FAILURES_INDEX = "failures/index.md"
# The known-failures table sits between these lines in README.md and docs/index.md.
TABLE_START = "<!-- llmload:known-failures (generated from the catalog: python docs/hooks.py) -->"
TABLE_END = "<!-- /llmload:known-failures -->"
TABLE_HOMES = {"README.md": False, "docs/index.md": True}  # file -> whether its ids link to the failures' pages


class TableCells(typing.NamedTuple):
    """A failure's row in the known-failures table (README.md, the docs' home page), in Markdown: what the user sees,
    where it occurs in a few words, and what its regression tests show."""

    symptom: str
    occurs_briefly: str
    reproduced_here: str


# The table's cells, by failure id: written for the table, so they live with it. A failure without a row here (a new
# one) gets its catalog entry's title and `occurs`, and a link to its regression tests, until one is written here.
TABLE_CELLS = {
    'meta-backward': TableCells(
        symptom='`Function MmBackward0 returned an invalid gradient at index 1 - expected device meta but got cpu`',
        occurs_briefly='any version with accelerate offload; cpu and cuda',
        reproduced_here=("the write-up's text on CPU (12 of 16 LoRA weights on meta); without LoRA 29 of 39 "
                         'parameters silently get no gradient')),
    'offload-hang': TableCells(
        symptom='`from_pretrained` never returns after the shards load (`offload_state_dict` round-trip)',
        occurs_briefly='transformers <= 4.56 with `device_map` + `max_memory` + `offload_folder`',
        reproduced_here=('the silent temp-dir round-trip on 4.56; 5.23 drops the keyword silently (asserted); a '
                         'blocked shard read fails within its deadline naming the frame')),
    'inference-stall': TableCells(
        symptom='`generate()` appears to hang on an offloaded model',
        occurs_briefly='any version, models larger than GPU memory',
        reproduced_here=('diagnostics (`pytest_llmload/instruments/`), and a deadline hit inside `generate` is named'
                         ' in the report')),
    'dp-dtype': TableCells(
        symptom=('`expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16` under '
                 '`nn.DataParallel`'),
        occurs_briefly='2+ GPUs; Trainer wraps 4-bit models up to 4.57',
        reproduced_here="Trainer's own decision at `n_gpu=2` on CPU; the real error needs 2 GPUs (`needs_gpus(2)`)"),
    'distributed-device-map': TableCells(
        symptom="`You can't train a model that has been loaded with device_map='auto' in any distributed mode`",
        occurs_briefly='accelerate in DEEPSPEED / MULTI_GPU / MULTI_CPU mode',
        reproduced_here='2 gloo ranks, real DeepSpeed ZeRO-2 and plain multi-CPU'),
    'move-offloaded': TableCells(
        symptom=('`.to()`/`.cuda()`/`.cpu()` (or `deepspeed.initialize`) on a model that `device_map` + `max_memory`'
                 " offloaded: `RuntimeError: You can't move a model that has some modules offloaded to cpu or disk.`"),
        occurs_briefly='accelerate offload, transformers 4.x-5.x, any hardware',
        reproduced_here=('the tiny Llama with half its weights on disk, then `.to("cpu")`; on an H100, '
                         '`.to("cuda:0")` with cpu offload')),
    'adapter-on-offloaded': TableCells(
        symptom=('a trained LoRA adapter put on a base that `device_map` offloaded: `PeftModel.from_pretrained` '
                 'raises `NotImplementedError: Cannot copy out of meta tensor; no data!` (peft re-dispatches without'
                 ' the budget); other ways leave adapter weights on meta (KeyError, or silent garbage)'),
        occurs_briefly='peft + accelerate offload; cuda:N with cpu/disk offload in the reports',
        reproduced_here='the tiny Llama with a saved adapter, half its weights on disk (peft 0.21 / accelerate 1.15)'),
    'quantized-cast': TableCells(
        symptom=('a bitsandbytes 4-bit/8-bit model cast after loading (`.half()`, `.to(dtype)`): ``ValueError: You '
                 'cannot cast a bitsandbytes model in a new `dtype` `` / ``ValueError: `.half()` is not supported '
                 'for quantized model``'),
        occurs_briefly='any device; transformers since #20409',
        reproduced_here=("bitsandbytes 0.50's CPU backend, 4-bit nf4 and 8-bit (skips on 4.46, which refuses 4-bit "
                         'on CPU)')),
    'zero3-device-map': TableCells(
        symptom=('any `device_map` (even 004\'s fix `{"": LOCAL_RANK}`) under DeepSpeed ZeRO-3: ``DeepSpeed Zero-3 is'
                 ' not compatible with passing a `device_map`.``'),
        occurs_briefly='Trainer `--deepspeed` / accelerate ZeRO-3; CPU and GPU',
        reproduced_here="a stage-3 `HfDeepSpeedConfig` in-process, and 2 gloo ranks with accelerate's ZeRO-3 plugin"),
    'fp16-unscale': TableCells(
        symptom=('weights loaded in float16 and trained under fp16 mixed precision: `ValueError: Attempting to '
                 'unscale FP16 gradients.`'),
        occurs_briefly=('Trainer/accelerate `fp16=True` or `torch.amp.GradScaler`; a float16 full fine-tune, or LoRA'
                        ' with fp16 adapters'),
        reproduced_here=('an fp16 autocast + `torch.amp.GradScaler("cpu")` step on CPU; `Trainer(fp16=True)` on an '
                         'H100')),
}
# Which extra serves which check (pytest_llmload.config.distribution.extras_table, from each Check's `extras`) sits
# between these lines in these files.
EXTRAS_START = "<!-- llmload:extras (generated from the checks' extras: python docs/hooks.py) -->"
EXTRAS_END = "<!-- /llmload:extras -->"
EXTRAS_HOMES = ("README.md", "docs/getting-started.md")
SETTINGS_PAGE = "reference/settings.md"
API_PAGE = "reference/api.md"
# The modules of the API page, and which of their names it documents: None for every public function and class
# defined in the module, else the names (a helper a fix names that lives outside pytest_llmload.fixes).
API_MODULES = {
    "pytest_llmload.fixes.training_scripts": None,
    "pytest_llmload.fixes.trainer_guard": None,
    "pytest_llmload.fixes.adapters": None,
    "pytest_llmload.fixes.training_memory": None,
    "pytest_llmload.fixes.reference_loader": ("placement_kwargs", "load_model_and_tokenizer"),  # not the run's choice
    "pytest_llmload.failures.move_offloaded": ("may_move",),
    "pytest_llmload.instruments.phases": ("phase", "timed_generate", "recording"),
}

# What each LoadRequest field asks, and what a loader that honours it returns (the contract the checks verify
# before judging). The names and defaults come from the dataclass; a field without a line here fails the build.
FIELD_DOCS = {
    "model_path": ("the local checkpoint to load (`local_files_only`; nothing is downloaded)",
                   "be that checkpoint; a vocabulary at least as large as its `vocab_size` (chat tokens may add rows)"),
    "purpose": ('`"inference"` or `"train"`',
                "load for that use (the checks set train/eval mode themselves, as Trainer and servers do)"),
    "dtype": ('`"float32"`, `"float16"`, `"bfloat16"` (`request.torch_dtype` is the `torch.dtype`)',
              "hold most weights in it; a train request may also get float32 master weights; a 4-bit request may "
              "honour it as `bnb_4bit_compute_dtype`"),
    "device": ('`"cpu"` or `"cuda:N"`', "put the weights there (or, under a budget, there and on cpu/disk)"),
    "max_memory": ("a budget in `from_pretrained`'s format, `None` for none",
                   "respect it (offload what does not fit, or refuse clearly)"),
    "offload_folder": ("where disk offload may write", "write nowhere else"),
    "quantization": ('`None`, `"4bit"`, `"8bit"`', "be quantized only when asked"),
    "lora": ("put a trainable LoRA adapter on the model", "-"),
    "adapter_path": ("a trained PEFT adapter to serve", "serve it (or refuse clearly)"),
    "gradient_checkpointing": ("enable it", "-"),
    "deepspeed": ("the run is a DeepSpeed job", "-"),
    "zero_stage": ("its ZeRO stage (with `deepspeed=True`; `None` when unknown)", "-"),
    "gpu_count": ("how many GPUs the run assumes (read it instead of `torch.cuda.device_count()`)", "-"),
}

# The fields of the two records a check is made of (pytest_llmload.checks.base); a field without a line fails the build.
RECORD_DOCS = {
    "KnownFailure": {
        "id": "the failure's name, lowercase with dashes (`meta-backward`); shown in every row and report section",
        "title": "one line: what goes wrong",
        "write_up": "where it was reported (a write-up, issue numbers)",
        "signatures": "regular expressions searched in a failing test's message and traceback: a match adds the "
                      "report section naming this failure",
        "root_cause": "why it happens",
        "fix": "what the loader or the training script should do instead",
        "occurs": "versions and hardware where it has been seen or reproduced",
        "context": "extra patterns that must also appear for a signature to count (e.g. the frame a deadline "
                   "stopped in)",
        "tell": "a pattern that makes the match certain (e.g. a DataParallel frame)",
        "without_tell": "what the report section says when the tell is absent",
        "hang_is_mechanism": "a deadline passed inside the loader call is this failure itself (offload-hang); "
                             "otherwise a hung loader is an `error` row",
        "order": "its place in the catalog: the registry, the main job's rows and the tables list failures in "
                 "this order; a new failure takes the next number",
        "script_fix": "the fix phrased for a repo's own script (`python -m pytest_llmload run`'s rows): the change "
                      "there, no name of this plugin; empty where `fix` already is",
    },
    "Check": {
        "function": "`function(loader, checkpoint, workdir)`, raising `AssertionError` on a faulty loader; it gets the "
                    "options it takes as keywords (`prepare_args`, the training declarations)",
        "failure": "the `KnownFailure` it guards against",
        "needs_gpus": "GPUs the check needs; with fewer visible it skips with the counts (and carries the `gpu` "
                      "marker)",
        "world_size": "ranks of a process group the check starts itself",
        "transformers": "a PEP 440 range where the failure exists (`\"<=4.56\"`); elsewhere the check skips, saying so",
        "timeout": "seconds; a hang fails the check with every thread's stack",
        "label": "the check's name where `function` is a partial (a GPU variant, say); else the function's name",
        "purpose": "what the check asks the loader for (`inference` or `train`); a loader declared for the other "
                   "one skips it",
        "isolated": "run in a child forked from the test process: for checks that can hang, crash or change "
                    "process-wide state",
        "uses_adapters": "works with peft adapters whatever its purpose (peft is preloaded for it)",
        "extras": "the extras of pytest-llmload it needs besides `hf` (`\"quant\"`, `\"deepspeed\"`): where one is not "
                  "installed it skips, naming the pip command; the extras' table is made from these",
    },
}

# How a setting's value is parsed (Setting.kind, pytest_llmload.config.settings.PARSERS). A kind without a line fails the build.
KINDS = {
    "text": "a string",
    "path": "a file path",
    "bool": "true or false (the option takes no value; the ini key `true`/`false`, `1`/`0`, `yes`/`no`, `on`/`off`)",
    "lines": "a list: the option may be repeated, the ini key takes one a line",
    "seconds": "a number of seconds, 0 or more",
    "fraction": "a number between 0 and 1",
    "gpus": "a positive number of GPUs, or `off`",
    "count": "a positive whole number",
}


# --- Markdown helpers ---------------------------------------------------------------------------------------------

def code(text: str) -> str:
    """``text`` as a Markdown code span, whatever backticks it holds."""
    text = str(text)
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


_CODE_SPAN = re.compile(r"(`+).+?(?<!`)\1(?!`)")


def cell(text: str) -> str:
    """Text for a table cell: one line, pipes escaped outside code spans (the table reads those right)."""
    text, out, at = " ".join(str(text).split()), [], 0
    for span in _CODE_SPAN.finditer(text):
        out += [text[at:span.start()].replace("|", "\\|"), span.group()]
        at = span.end()
    return "".join(out + [text[at:].replace("|", "\\|")])


def plain(text: str) -> str:
    """Catalog text (written for a terminal) as Markdown that shows it as written: no emphasis, links or HTML tags."""
    return re.sub(r"([\\`*_\[\]])", r"\\\1", str(text)).replace("<", "&lt;")


_ROLE = re.compile(r":(?:mod|class|func|data|attr|meth|exc|obj):`(~?)([^`]+)`")


def from_rest(doc: str) -> str:
    """A docstring (reST-ish) as Markdown: roles become code spans, ``x::`` introduces an indented code block."""

    def role(match: re.Match) -> str:
        target = match.group(2)
        return code(target.rsplit(".", 1)[-1] if match.group(1) else target)

    text = _ROLE.sub(role, doc)
    return re.sub(r"(\S)::\n", r"\1:\n", text)


def module_docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


# --- the known failures -------------------------------------------------------------------------------------------

def _checks_of(failure) -> list:
    from pytest_llmload.failures import REGISTRY

    return [check for check in REGISTRY if check.failure.id == failure.id]


def homes(failure) -> dict[str, str]:
    """A failure's three files in this repository, from its root, all following the id: its module (catalog entry
    and checks), the write-up's loader before its fix, and its regression tests (an installed wheel has only the
    first, so the package does not name them)."""
    return {"catalog entry and checks": f"pytest_llmload/failures/{failure.slug}.py",
            "before-loader": f"fixtures/loaders/before_{failure.slug}.py",
            "regression tests": f"tests/failures/test_{failure.slug}.py"}


def table_cells(failure) -> TableCells:
    """The failure's cells in the known-failures table: :data:`TABLE_CELLS`' row, else its catalog entry's title and
    where it occurs (a new failure is listed before anyone writes its row)."""
    return TABLE_CELLS.get(failure.id) or TableCells(plain(failure.title), plain(failure.occurs), "")


def failure_page(failure) -> str:
    """The reference page of one known failure."""
    paths = homes(failure)
    lines = [f"# {failure.id}: {plain(failure.title)}", "",
             "*Generated from the catalog (`pytest_llmload.failures`) when the docs are built.*", "",
             "| field | value |", "|---|---|",
             f"| id | {code(failure.id)} |",
             f"| write-up or field reports | {cell(plain(failure.write_up))} |",
             f"| where it occurs | {cell(plain(failure.occurs))} |"]
    lines += [f"| {what} | {code(path)} |" for what, path in paths.items()]
    lines += ["", "## Root cause", "", plain(failure.root_cause), "",
              "## Fix", "", linked(failure.fix, f"../{API_PAGE}"), "",
              "## Signatures", "",
              "A failing test whose message or traceback matches one of these regular expressions gets a report "
              "section `llmload: known failure` naming this failure:", ""]
    lines += [f"- {code(pattern)}" for pattern in failure.signatures] or ["- none: this failure is named by its "
                                                                         "checks only"]
    if failure.context:
        lines += ["", "and only when each of these also appears:", ""]
        lines += [f"- {code(pattern)}" for pattern in failure.context]
    if failure.tell is not None:
        lines += ["", f"The match is certain when the traceback passes through {code(failure.tell)}; without it, "
                      f"the section says: {plain(failure.without_tell)}"]
    if failure.hang_is_mechanism:
        lines += ["", "A deadline passed inside the loader call is this failure's own mechanism: the check's row "
                      "is `FAILED` naming it (for every other failure a hung loader is an `error` row)."]
    lines += ["", "The section, as the report prints it:", "", "```", failure.explain(), "```", "", "## Checks", ""]
    from pytest_llmload.system.words import a

    checks = _checks_of(failure)
    if not checks:
        lines += ["None: there is no loader bug to check. The regression tests below show the failure and how the "
                  "plugin names it."]
    for check in checks:
        runs = ("isolated, in a child forked from the test process" if check.isolated else "in the test process")
        lines += [f"### {check.name}", "", plain(check.summary) or "(no docstring)", "",
                  f"- needs GPUs: {check.needs_gpus or 'none (runs on CPU)'}",
                  f"- transformers: {code(check.transformers) if check.transformers else 'any version'}",
                  f"- asks the loader for: {a(check.purpose)} load",
                  f"- ranks: {check.world_size}",
                  f"- deadline: {check.timeout:g} s, {runs}", ""]
    for title, what in (("The loader before its fix", "before-loader"), ("How it is reproduced here",
                                                                         "regression tests")):
        path = ROOT / paths[what]
        lines += [f"## {title}", "", f"From the docstring of {code(paths[what])}:", "",
                  from_rest(module_docstring(path)) if path.exists() else f"({paths[what]} is missing)", ""]
    return "\n".join(lines)


def failures_index() -> str:
    from pytest_llmload.failures import CATALOG

    lines = ["# Known failures", "",
             "*Generated from the catalog (`pytest_llmload.failures.CATALOG`) when the docs are built.*", "",
             "Each known failure has one home named by its id: `pytest_llmload/failures/<id>.py` (its catalog "
             "entry: signatures, root cause and fix; and its checks), `fixtures/loaders/before_<id>.py` (the "
             "write-up's loader before its fix) and `tests/failures/test_<id>.py` (its regression tests), with "
             "the id's dashes as underscores. The write-ups `seeds/000_...` to `seeds/004_...` are this "
             "project's source notes; the other failures come from public issue trackers.", "",
             "| id | failure | write-up or field reports | where it occurs | checks |", "|---|---|---|---|---|"]
    for failure in CATALOG:
        checks = ", ".join(code(check.name) for check in _checks_of(failure)) or "none"
        lines.append(f"| [{failure.id}]({failure.id}.md) | {cell(plain(failure.title))} | "
                     f"{cell(plain(failure.write_up))} | {cell(plain(failure.occurs))} | {checks} |")
    lines += ["", "How each is reproduced here: [the home page's table](../index.md#the-known-failures); version by version: "
                  "[Version matrix](../version_matrix.md#failures-x-versions-x-hardware)."]
    return "\n".join(lines) + "\n"


def _write_up_cell(failure) -> str:
    """A write-up's number (``seeds/002_....txt`` -> ``002``), or the field reports as the catalog names them."""
    name = failure.write_up.rpartition("/")[2]
    if failure.write_up.startswith("seeds/") and name[:3].isdigit():
        return code(name[:3])
    return cell(plain(failure.write_up))


def known_failures_table(linked: bool) -> str:
    """The table of the known failures, one row a failure in the catalog's order; ``linked``: each id links to its
    page (the site's copy; the README's links nowhere, for it is read on a package index too)."""
    from pytest_llmload.failures import CATALOG

    lines = ["| id | failure | write-up or field reports | where it occurs | reproduced here by |",
             "|---|---|---|---|---|"]
    for failure in CATALOG:
        cells = table_cells(failure)
        name = f"[{code(failure.id)}](failures/{failure.id}.md)" if linked else code(failure.id)
        tests = code(homes(failure)["regression tests"])
        reproduced = f"{tests}: {cell(cells.reproduced_here)}" if cells.reproduced_here else tests
        lines.append(f"| {name} | {cell(cells.symptom)} | {_write_up_cell(failure)} | "
                     f"{cell(cells.occurs_briefly)} | {reproduced} |")
    return "\n".join(lines)


def with_block(text: str, start_line: str, end_line: str, content: str) -> str:
    """``text`` with ``content`` between ``start_line`` and ``end_line``, whatever was there before."""
    before, start, rest = text.partition(start_line)
    _, end, after = rest.partition(end_line)
    if not start or not end:
        raise ValueError(f"docs/hooks.py: no {start_line!r} ... {end_line!r} lines to put the generated table between")
    return f"{before}{start}\n\n{content}\n\n{end}{after}"


def with_known_failures_table(text: str, linked: bool) -> str:
    """``text`` (README.md, docs/index.md) with the table between :data:`TABLE_START` and :data:`TABLE_END` made
    anew from the catalog."""
    return with_block(text, TABLE_START, TABLE_END, known_failures_table(linked))


# --- settings, markers, fixtures ----------------------------------------------------------------------------------

def _fixtures() -> list[tuple[str, str, str]]:
    """``(name, scope, docstring)`` of each fixture in pytest_llmload/plugin/fixtures.py, in file order (read, not imported)."""
    # From the package's own folder: once an old import path was resolved in this process, the module's spec may be
    # the alias' (no origin).
    path = Path(importlib.util.find_spec("pytest_llmload").origin).parent / "plugin" / "fixtures.py"
    found = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for decorator in node.decorator_list:
            target = decorator.func if isinstance(decorator, ast.Call) else decorator
            if ast.unparse(target) != "pytest.fixture":
                continue
            keywords = {k.arg: k.value for k in decorator.keywords} if isinstance(decorator, ast.Call) else {}
            scope = ast.literal_eval(keywords["scope"]) if "scope" in keywords else "function"
            found.append((node.name, scope, ast.get_docstring(node) or ""))
    return found


def _markers() -> list[tuple[str, str]]:
    """``(name, help)`` of each marker the plugin registers: the ``*_HELP`` texts of the vocabulary that start with a name."""
    from pytest_llmload.config import vocabulary

    helps = [value for name, value in vars(vocabulary).items()
             if name.endswith("_HELP") and name != "GPU_FIXTURES_HELP" and isinstance(value, str)]
    return [(text.split(":", 1)[0], text.split(":", 1)[1].strip()) for text in helps]


def _main_job_options() -> list[tuple[str, str]]:
    """``(option, help)`` of each option of the main job's parser (``pytest_llmload.main_job.cli.build_parser``)."""
    import argparse

    from pytest_llmload.main_job.cli import build_parser

    found = []
    for action in build_parser()._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        takes_value = action.nargs != 0
        metavar = action.metavar or (action.dest.upper() if takes_value else "")
        option = ", ".join(code(name) for name in action.option_strings)
        found.append((option + (f" {code(metavar)}" if metavar else ""), action.help or ""))
    return found


def settings_page() -> str:
    from pytest_llmload.config.vocabulary import SETTINGS

    lines = ["# Settings, markers and fixtures", "",
             "*Generated from `pytest_llmload.config.vocabulary` and `pytest_llmload/plugin/fixtures.py` when the docs are built.*",
             "", "## Settings", "",
             "Every setting is an option and an ini key of the same name (`--llmload-x-y` and `llmload_x_y`, in "
             "`pytest.ini`, `tox.ini`'s `[pytest]` or `pyproject.toml`'s `[tool.pytest.ini_options]`), with one help "
             "text and one type; the option wins over the ini key. A bad value is a usage error naming the value, "
             "where it came from and what to give instead. `pytest --help` prints the same help.", "",
             "| option | ini key | type | default | help |", "|---|---|---|---|---|"]
    for setting in SETTINGS:
        option = code(setting.option) + (f" {code(setting.metavar)}" if setting.metavar else "")
        extra = ""
        if setting.aliases:
            extra += " Older spelling, still accepted: " + ", ".join(code(a) for a in setting.aliases) + "."
        if setting.env:
            extra += f" Environment variable: {code('$' + setting.env)}."
        default = (code(setting.default) if setting.default is not None
                   else {"bool": code("false"), "lines": "none"}.get(setting.kind, "none"))
        lines.append(f"| {option} | {code(setting.ini)} | {code(setting.kind)} | {default} | "
                     f"{cell(plain(setting.help) + extra)} |")
    lines += ["", "The types:", "", "| type | value |", "|---|---|"]
    for kind in sorted({setting.kind for setting in SETTINGS}):
        if kind not in KINDS:
            raise ValueError(f"docs/hooks.py: setting kind {kind!r} has no description in KINDS; add one")
        lines.append(f"| {code(kind)} | {cell(KINDS[kind])} |")
    lines += ["", "## The main job's options", "",
              "`python -m pytest_llmload` (or `llmload`) has options of its own (`--help` prints them); the "
              "arguments after `--` go to pytest.", "", "| option | help |", "|---|---|"]
    for option, help_text in _main_job_options():
        lines.append(f"| {option} | {cell(plain(help_text))} |")
    lines += ["", "## Markers", "",
              "Registered by the plugin (so `--strict-markers` runs accept them):", ""]
    for name, text in _markers():
        lines += [f"- {code(name)}: {plain(text)}"]
    lines += ["", "## Fixtures", "",
              "Each fixture is an override point: define a fixture of the same name and scope in a conftest.py, and "
              "the fixtures built on it follow. `pytest --fixtures` prints the same docstrings.", "",
              "| fixture | scope | what |", "|---|---|---|"]
    fixtures = _fixtures()
    for name, scope, doc in fixtures:
        first = " ".join(doc.split("\n\n")[0].split())
        lines.append(f"| [{code(name)}](#{name}) | {scope} | {cell(from_rest(first))} |")
    for name, scope, doc in fixtures:
        lines += ["", f"### {name}", "", f"Scope: {scope}.", "", from_rest(doc)]
    return "\n".join(lines) + "\n"


# --- the loader contract ------------------------------------------------------------------------------------------

def _type_name(hint) -> str:
    """A type hint as a reader writes it: ``Optional[int]``, ``Literal['4bit', '8bit']``, ``str | PathLike``."""
    name = hint.__name__ if isinstance(hint, type) else str(hint)
    return re.sub(r"\b(typing|os|collections\.abc)\.", "", name)


def load_request_fields() -> str:
    """The table of every LoadRequest field: name and default from the dataclass, what it asks and what the returned
    model must from :data:`FIELD_DOCS`."""
    from pytest_llmload.loader.request import LoadRequest

    fields = dataclasses.fields(LoadRequest)
    hints = typing.get_type_hints(LoadRequest)
    names = [field.name for field in fields]
    missing, stale = set(names) - set(FIELD_DOCS), set(FIELD_DOCS) - set(names)
    if missing or stale:
        raise ValueError(f"docs/hooks.py FIELD_DOCS is out of date with LoadRequest: fields without a line "
                         f"{sorted(missing)}, lines for no field {sorted(stale)}")
    lines = ["| field | type | default | what it asks | the returned model must |", "|---|---|---|---|---|"]
    for field in fields:
        default = "required" if field.default is dataclasses.MISSING else code(repr(field.default))
        asks, must = FIELD_DOCS[field.name]
        lines.append(f"| {code(field.name)} | {code(_type_name(hints[field.name]))} | {default} | {asks} | {must} |")
    return "\n".join(lines)


def record_fields() -> str:
    """The fields of ``KnownFailure`` and ``Check``: names and defaults from the records, meanings from RECORD_DOCS."""
    from pytest_llmload.checks.base import Check, KnownFailure

    out = []
    for record in (KnownFailure, Check):
        docs = RECORD_DOCS[record.__name__]
        missing, stale = set(record._fields) - set(docs), set(docs) - set(record._fields)
        if missing or stale:
            raise ValueError(f"docs/hooks.py RECORD_DOCS[{record.__name__!r}] is out of date: fields without a "
                             f"line {sorted(missing)}, lines for no field {sorted(stale)}")
        out += [f"`{record.__name__}`:", "", "| field | default | what |", "|---|---|---|"]
        for name in record._fields:
            default = code(repr(record._field_defaults[name])) if name in record._field_defaults else "required"
            out.append(f"| {code(name)} | {default} | {docs[name]} |")
        out.append("")
    return "\n".join(out)


# --- the helpers' API page ----------------------------------------------------------------------------------------

def _api_entries() -> dict[str, list[tuple[str, object]]]:
    """``{module: [(name, object), ...]}`` of the API page, in :data:`API_MODULES`' order and the module's own."""
    entries = {}
    for module_name, names in API_MODULES.items():
        module = importlib.import_module(module_name)
        if names is None:
            names = [name for name, obj in vars(module).items()
                     if not name.startswith("_") and (inspect.isfunction(obj) or inspect.isclass(obj))
                     and obj.__module__ == module_name]
        entries[module_name] = [(name, getattr(module, name)) for name in names]
    return entries


def _signature(name: str, obj) -> str:
    """``name(parameters)`` without annotations (they are strings under ``from __future__ import annotations``)."""
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return name
    bare = [parameter.replace(annotation=inspect.Parameter.empty) for parameter in signature.parameters.values()]
    prefix = "class " if inspect.isclass(obj) else ""
    return prefix + name + str(signature.replace(parameters=bare, return_annotation=inspect.Signature.empty))


def api_page() -> str:
    """The reference page of the helpers the fixes name: a section a module, an entry (anchored by its dotted path)
    a function or class, with its signature and docstring."""
    lines = ["# Helpers for training scripts and loaders", "",
             "*Generated from the docstrings of the modules below when the docs are built.* The fixes the checks "
             "recommend, as functions a training script or a loader can import; none of them imports pytest. The "
             "Fix section of each [known failure](../failures/index.md) links the helpers it names here."]
    for module_name, entries in _api_entries().items():
        module = importlib.import_module(module_name)
        lines += ["", f"## {code(module_name)} {{#{module_name}}}", "", from_rest(inspect.getdoc(module) or "")]
        for name, obj in entries:
            lines += ["", f"### {code(name)} {{#{module_name}.{name}}}", "", "```python", _signature(name, obj), "```",
                      "", from_rest(inspect.getdoc(obj) or "(no docstring)")]
    return "\n".join(lines) + "\n"


def _anchors() -> dict[int, str]:
    """``{id(object): anchor}`` of every entry of the API page (a module's anchor is its name)."""
    anchors = {id(importlib.import_module(module_name)): module_name for module_name in API_MODULES}
    for module_name, entries in _api_entries().items():
        anchors.update({id(obj): f"{module_name}.{name}" for name, obj in entries})
    return anchors


def _target(dotted: str, anchors: dict[int, str]) -> str | None:
    """The API page's anchor of a dotted name as a fix writes it: a full path (``pytest_llmload.fixes.x.f``), a path
    through a module that imports the helper, or one from a module's own name on (``move_offloaded.may_move``)."""
    head, _, name = dotted.rpartition(".")
    # only modules already imported (the catalog's, the API page's): a dotted word never imports anything
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("pytest_llmload") and (module_name == head or module_name.endswith("." + head)):
            obj = getattr(module, name, None)
            if obj is not None and id(obj) in anchors:
                return anchors[id(obj)]
    module = sys.modules.get(dotted)
    return anchors.get(id(module)) if module is not None else None


_DOTTED = re.compile(r"(?<![\w.])[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
_SIBLING = re.compile(r"\s*/\s*([A-Za-z_]\w*)")


def linked(text: str, page: str) -> str:
    """Catalog text as :func:`plain` Markdown, each helper it names by a dotted name (and a sibling after a slash:
    ``pytest_llmload.fixes.adapters.adapter_placement_kwargs / put_adapter``) a link to its entry on ``page`` (the
    API page, relative to the page the text goes on)."""
    anchors, out, at = _anchors(), [], 0
    for match in _DOTTED.finditer(text):
        if match.start() < at:
            continue  # a sibling already linked
        anchor = _target(match.group(), anchors)
        if anchor is None:
            continue
        out += [plain(text[at:match.start()]), f"[{code(match.group())}]({page}#{anchor})"]
        at = match.end()
        head = match.group().rpartition(".")[0]
        while sibling := _SIBLING.match(text, at):
            anchor = _target(f"{head}.{sibling.group(1)}", anchors)
            if anchor is None:
                break
            out += [plain(text[at:sibling.start(1)]), f"[{code(sibling.group(1))}]({page}#{anchor})"]
            at = sibling.end()
    return "".join(out + [plain(text[at:])])


# --- everything, and the MkDocs events ----------------------------------------------------------------------------

def generated_pages() -> dict[str, str]:
    """Every generated page: its path under docs/ and its Markdown."""
    from pytest_llmload.failures import CATALOG

    pages = {FAILURES_INDEX: failures_index(), SETTINGS_PAGE: settings_page(), API_PAGE: api_page()}
    pages.update({f"failures/{failure.id}.md": failure_page(failure) for failure in CATALOG})
    return pages


def _failure_nav() -> list:
    from pytest_llmload.failures import CATALOG

    return [FAILURES_INDEX, *({failure.id: f"failures/{failure.id}.md"} for failure in CATALOG)]


def _expand(nav):
    """The nav with the entry of the failures index replaced by the index and one entry per failure."""
    if isinstance(nav, list):
        return [_expand(item) for item in nav]
    if isinstance(nav, dict):
        return {title: (_failure_nav() if target == FAILURES_INDEX else _expand(target)) for title, target in nav.items()}
    return nav


def on_config(config, **kwargs):
    if config.nav is not None:
        config.nav = _expand(config.nav)
    return config


def on_files(files, config, **kwargs):
    from mkdocs.structure.files import File

    for src_uri, content in generated_pages().items():
        files.append(File.generated(config, src_uri, content=content))
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    for start, end, make in BLOCKS.values():
        if start in markdown:
            markdown = with_block(markdown, start, end, make())
    if TABLE_START in markdown:
        markdown = with_known_failures_table(markdown, linked=True)
    return markdown


def with_extras_table(text: str) -> str:
    """``text`` with the extras' table between :data:`EXTRAS_START` and :data:`EXTRAS_END` made anew."""
    from pytest_llmload.config.distribution import extras_table
    from pytest_llmload.failures import REGISTRY

    return with_block(text, EXTRAS_START, EXTRAS_END, extras_table(REGISTRY))


# page -> (start line, end line, what goes between) of the tables written into it (besides the known failures' and
# the extras' tables); on the built site too, made anew there (on_page_markdown)
BLOCKS = {
    "docs/loader-contract.md": (FIELDS_MARK, FIELDS_END, load_request_fields),
    "docs/extension.md": (RECORDS_MARK, RECORDS_END, record_fields),
}
# page -> its text with those tables made anew
BLOCK_HOMES = {page: (lambda text, start=start, end=end, make=make: with_block(text, start, end, make()))
               for page, (start, end, make) in BLOCKS.items()}


def write_tables() -> list[str]:
    """Rewrite the known-failures table in README.md and docs/index.md from the catalog, the extras' table in
    :data:`EXTRAS_HOMES` and the tables of :data:`BLOCK_HOMES`; the files it changed."""
    changed = []
    homes = [(name, lambda text, linked=linked: with_known_failures_table(text, linked))
             for name, linked in TABLE_HOMES.items()] + [(name, with_extras_table) for name in EXTRAS_HOMES]
    homes += list(BLOCK_HOMES.items())
    for name, rewrite in homes:
        path = ROOT / name
        text = path.read_text(encoding="utf-8")
        new = rewrite(text)
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(name)
    return sorted(set(changed))


if __name__ == "__main__":  # python docs/hooks.py: the tables after a change to the catalog
    sys.path.insert(0, str(ROOT))  # this checkout's catalog, whatever copy of the package is installed
    changed = write_tables()
    print(f"rewrote the generated tables in {', '.join(changed)}" if changed else "the tables are current")
