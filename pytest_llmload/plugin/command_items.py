"""The repo's own commands from pytest: the ``llmload_run`` fixture, and the named commands of the ini key
``llmload_commands`` collected as test items (``llmload-command::train``), each run once by
``python -m pytest_llmload run --json PATH -- COMMAND...`` in a process of its own (that command is a layer above the
plugin), its rows read back from its ``--json`` as :class:`~pytest_llmload.reports.row.Row` records.

An item fails with the rows' sentences and fixes when a known failure is caught or the command crashed or hung,
skips with the reasons when the run exercised no known failure's mechanism, and passes otherwise. A line
``gpu: NAME: COMMAND`` marks the item ``gpu`` (``pytest -m gpu`` selects it; it skips where no GPU is visible).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Union

import pytest

from pytest_llmload.reports.row import Row, failed_lines

COMMAND_NODE = "llmload-command"  # the items' node ids: llmload-command::NAME
GPU_PREFIX = "gpu"  # llmload_commands = gpu: serve: python serve.py --device cuda
COMMAND_ROW = "command"  # the row `run` makes for the command itself
FAILED_VERDICTS = ("failed", "error")
# Past the run's own deadline (it ends every process of the command and writes its rows), what `run` may take to
# say so before this process ends it.
RUN_GRACE_S = 60.0


@dataclasses.dataclass(frozen=True)
class NamedCommand:
    """One line of ``llmload_commands``: ``[gpu: ]NAME: COMMAND``."""

    name: str
    argv: tuple[str, ...]
    gpu: bool = False
    line: str = ""  # as written


def named_commands(lines: list[str], where: str) -> list[NamedCommand]:
    """The lines of ``llmload_commands`` (read from ``where``), parsed; a bad line is a usage error naming it."""
    commands: dict[str, NamedCommand] = {}
    for line in lines:
        name, sep, command = line.partition(":")
        gpu = name.strip() == GPU_PREFIX and sep
        if gpu:
            name, sep, command = command.partition(":")
        name = name.strip()
        try:
            argv = tuple(shlex.split(command))
        except ValueError as exc:  # an unclosed quote
            raise pytest.UsageError(f"{where}: {line!r}: the command does not split as a shell would ({exc}); "
                                    "close its quotes.") from None
        if not sep or not name or " " in name or not argv:
            raise pytest.UsageError(f"{where}: {line!r} is not 'NAME: COMMAND'; write e.g. 'train: python train.py "
                                    f"--config ci.yaml' (or '{GPU_PREFIX}: serve: python serve.py' for a GPU one).")
        if name in commands:
            raise pytest.UsageError(f"{where}: the name {name!r} is given twice; give each command its own name.")
        commands[name] = NamedCommand(name, argv, bool(gpu), line)
    return list(commands.values())


class CommandNotRun(Exception):
    """``run`` gave no rows: a usage error (a program not found, a bad ``--model``), a signal, or no ``--json``."""


@dataclasses.dataclass(frozen=True)
class CommandResult:
    """What one run of a command said: ``command_row`` (it finished its bounded run, crashed or hung), ``rows`` (one
    per known failure), ``returncode`` (``run``'s: 0 nothing failed, 1 a row failed), ``outputs`` (the folder ``run``
    kept, where a row failed)."""

    argv: tuple[str, ...]
    returncode: int
    command_row: Row
    rows: tuple[Row, ...]
    outputs: Optional[str] = None

    def row(self, name: str) -> Row:
        """The row of a known failure by its id (``"fp16-unscale"``) or its row's name (``"watch_fp16_unscale"``);
        ``"command"`` is the command's own."""
        for row in (self.command_row, *self.rows):
            if name in (row.check, row.guards):
                return row
        known = ", ".join(row.guards or row.check for row in self.rows)
        raise KeyError(f"no row {name!r} in the run of {shlex.join(self.argv)}; its rows: command, {known}")

    @property
    def failed(self) -> list[Row]:
        return [row for row in (self.command_row, *self.rows) if row.verdict in FAILED_VERDICTS]

    @property
    def exercised(self) -> list[Row]:
        """The known failures' rows the run reached (passed or failed), not the command's own."""
        return [row for row in self.rows if row.outcome != "skipped"]

    def failure_text(self) -> str:
        """The failed rows, each with its fix, as ``python -m pytest_llmload run`` prints them."""
        lines = [line for row in self.failed for line in failed_lines(row, "the command")]
        kept = f"\nits output and outputs: {self.outputs}" if self.outputs else ""
        return "\n".join(lines) + kept

    def assert_no_known_failure(self) -> None:
        """Fail, with the failed rows' sentences and fixes, where a known failure was caught or the command
        crashed or hung."""
        __tracebackhide__ = True  # the failure is the rows', not this helper's
        if self.failed:
            raise AssertionError(f"{shlex.join(self.argv)}: {len(self.failed)} row(s) failed\n{self.failure_text()}")


def run_command(argv: "Union[str, list[str], tuple[str, ...]]", *, workdir: Path, cwd: Path, steps: int = 2,
                deadline: float = 600.0, models: Optional[dict[str, str]] = None) -> CommandResult:
    """Run ``argv`` (a list, or a string split as a shell would) through ``python -m pytest_llmload run`` in
    ``cwd``; its temporary files (``--json``, the run's folder) go under ``workdir``."""
    argv = tuple(shlex.split(argv) if isinstance(argv, str) else argv)
    json_path = workdir / "llmload-run.json"
    options = ["--json", str(json_path), "--steps", str(steps), "--deadline", f"{deadline:g}"]
    options += [part for model, config in (models or {}).items() for part in ("--model", f"{model}={config}")]
    environ = {**os.environ, "TMPDIR": str(workdir)}  # the run's folder, and the command's temporary files, here
    try:
        completed = subprocess.run([sys.executable, "-m", "pytest_llmload", "run", *options, "--", *argv], cwd=cwd,
                                   env=environ, capture_output=True, text=True, timeout=deadline + RUN_GRACE_S)
    except subprocess.TimeoutExpired:
        raise CommandNotRun(f"{shlex.join(argv)}: python -m pytest_llmload run had not ended {RUN_GRACE_S:g} s "
                            f"past its --deadline {deadline:g}; it was ended") from None
    if not json_path.is_file():
        said = completed.stderr.strip().splitlines()[-1:] or [f"it exited {completed.returncode} and said nothing"]
        raise CommandNotRun(f"{shlex.join(argv)} was not run: {said[0]}")
    document = json.loads(json_path.read_text())
    rows = [Row.from_dict(record) for record in document["results"]]
    command_row = next(row for row in rows if row.check == COMMAND_ROW)
    return CommandResult(argv, completed.returncode, command_row, tuple(row for row in rows if row is not command_row),
                         document.get("outputs"))


def run_options(config: pytest.Config) -> dict:
    """The run options the settings give: ``steps``, ``deadline``, ``models`` (``ID=CONFIG`` lines)."""
    from pytest_llmload.config import settings

    found = settings.given(config, "command_models")
    models = {}
    for spec in found[0] if found else ():
        model, sep, architecture = spec.partition("=")
        if not sep or not model.strip() or not architecture.strip():
            raise pytest.UsageError(f"{found[1]}: {spec!r} is not ID=CONFIG; write e.g. "
                                    "Qwen/Qwen2-0.5B=qwen2.5-7b (a shipped name, or a config.json).")
        models[model.strip()] = architecture.strip()
    return {"steps": settings.value(config, "command_steps"), "deadline": settings.value(config, "command_deadline"),
            "models": models}


class CommandFailed(Exception):
    """A named command's rows failed (or ``run`` gave none): the text is the whole report."""


class CommandItem(pytest.Item):
    """One named command of ``llmload_commands``, run when the item runs."""

    def __init__(self, *, command: NamedCommand, **kwargs) -> None:
        super().__init__(**kwargs)
        self.command = command
        if command.gpu:
            self.add_marker(pytest.mark.gpu)

    def runtest(self) -> None:  # (a gpu one is skipped at setup where no GPU is visible: markers.enforce_needs_gpus)
        # In the system's temp folder, removed unless a row failed (the failure then names its outputs).
        workdir = Path(tempfile.mkdtemp(prefix=f"llmload-command-{self.command.name}-"))
        kept = False
        try:
            try:
                result = run_command(self.command.argv, workdir=workdir, cwd=self.config.rootpath,
                                     **self.parent.options)
            except CommandNotRun as exc:
                raise CommandFailed(str(exc)) from None
            if result.failed:
                kept = bool(result.outputs)
                raise CommandFailed(result.failure_text())
            if not result.exercised:
                reasons = "; ".join(row.finding.removeprefix("not exercised: ") for row in result.rows)
                raise pytest.skip.Exception(f"{self.command.name} ran ({result.command_row.note or 'finished'}) but "
                                            f"reached no known failure's mechanism: {reasons}", _use_item_location=True)
        finally:
            if not kept:
                shutil.rmtree(workdir, ignore_errors=True)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, CommandFailed):
            return f"{shlex.join(self.command.argv)}\n{excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        """The ini file's line that names the command (0 where the option gave it)."""
        inipath = self.config.inipath
        lines = inipath.read_text().splitlines() if inipath else []
        line = next((number for number, text in enumerate(lines) if self.command.line in text), 0)
        return inipath or self.config.rootpath, line, f"{COMMAND_NODE}::{self.name}"


def _runs_the_whole_project(config: pytest.Config) -> bool:
    """A run of the project as a whole (no argument, its testpaths, or a folder holding its ini) runs its named
    commands; a run of chosen test files does not. Read from the arguments, so xdist's workers agree."""
    root = config.rootpath
    testpaths = {(root / path).resolve() for path in config.getini("testpaths")}
    for argument in config.args:
        path = (config.invocation_params.dir / argument.split("::")[0]).resolve()
        if root.is_relative_to(path) or path in testpaths or path == config.inipath:
            return True
    return False


@pytest.hookimpl(tryfirst=True)  # before -k, -m and --deselect choose among the items
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The named commands, as items after the collected tests, before ``-k`` and ``-m`` deselect."""
    from pytest_llmload.config import settings

    found = settings.given(config, "commands")
    if not found or not _runs_the_whole_project(config):
        return
    commands = CommandList.from_parent(session, name=COMMAND_NODE, nodeid=COMMAND_NODE,
                                       commands=named_commands(found[0], found[1]), options=run_options(config))
    items.extend(session.genitems(commands))  # (reported as collected: the counts and --collect-only say them)


class CommandList(pytest.Collector):
    """``llmload-command``: the named commands, one item each."""

    def __init__(self, *, commands: list[NamedCommand], options: dict, **kwargs) -> None:
        super().__init__(**kwargs)
        self.commands = commands
        self.options = options  # (read at collection: a bad mapping is a usage error before anything runs)

    def collect(self) -> list[pytest.Item]:
        return [CommandItem.from_parent(self, name=command.name, command=command) for command in self.commands]


def command_runner(config: pytest.Config, tmp_path: Path):
    """The ``llmload_run`` fixture's function (:mod:`pytest_llmload.plugin.fixtures` declares the fixture)."""
    defaults = run_options(config)

    def run(command, *, steps: Optional[int] = None, deadline: Optional[float] = None,
            models: Optional[dict[str, str]] = None, cwd: "Optional[Path | str]" = None) -> CommandResult:
        try:
            return run_command(command, workdir=Path(tempfile.mkdtemp(dir=tmp_path)),
                               cwd=Path(cwd) if cwd else config.rootpath, steps=steps or defaults["steps"],
                               deadline=deadline or defaults["deadline"],
                               models={**defaults["models"], **(models or {})})
        except CommandNotRun as exc:
            not_run = str(exc)
        pytest.fail(not_run, pytrace=False)

    return run
