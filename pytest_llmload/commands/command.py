"""Running a repo's command once, bounded: its environment (the bootstrap first on ``PYTHONPATH``, the hub offline,
the run's folder), one deadline for the whole command, every process's stack where it passes, and every process
ended afterwards (its session, and each process the bootstrap started in, wherever a launcher put it).

What comes back is a :class:`CommandRun`: the command's exit status, time and CPU, and each process's findings
(:mod:`.in_process`), which :mod:`.rows` judges.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional

from pytest_llmload.commands.bootstrap import write_bootstrap
from pytest_llmload.commands.in_process import RUN_DIR_VARIABLE, SETTINGS_FILE, STACK_SIGNAL
from pytest_llmload.commands.tiny_weights import CACHE_VARIABLE

STACKS_GRACE_S = 2.0  # after the deadline, how long the processes get to write their stacks
MAX_FILES_LISTED = 20_000  # the repo's files listed before and after the command, to say what it wrote there
# The hub and its libraries offline: a model, tokenizer or dataset the command would download is refused, naming it.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}


class CommandNotFound(ValueError):
    """The command's program is not on PATH, nor a file: nothing was started."""


@dataclasses.dataclass
class CommandRun:
    """One run of a command: its argv, exit status (``None`` where it passed its deadline), wall and CPU seconds
    (its processes', reaped), each Python process's findings, the stacks written at the deadline, where its outputs
    went, its output's log, the processes still running after it ended (ended here), and the files it made in the
    repo all the same (a library's own writes: reported, never removed)."""

    argv: list[str]
    returncode: Optional[int]
    seconds: float
    cpu_seconds: float
    deadline: float
    processes: list[dict]
    stacks: dict[int, str]
    output_dir: Path
    log: Path
    left_behind: list[int]
    written: list[str]  # files the command made in its working directory (the repo), which the run did not redirect

    @property
    def hung(self) -> bool:
        return self.returncode is None


def check_program(argv: list[str]) -> None:
    """Raise :class:`CommandNotFound` where ``argv[0]`` is neither on PATH nor a file."""
    if not argv:
        raise CommandNotFound("no command given after '--'; e.g. python -m pytest_llmload run -- python train.py")
    if shutil.which(argv[0]) is None:
        raise CommandNotFound(f"the command {argv[0]!r} is not found (not on PATH, nor an executable file); run it "
                              "from the repo's folder with the environment it needs active.")


def run_command(argv: list[str], workdir: Path, *, steps: int, deadline: float, models: dict[str, str],
                cache_dir: Optional[Path] = None) -> CommandRun:
    """Run ``argv`` under the bootstrap with ``workdir`` (a fresh folder) holding the run's files."""
    check_program(argv)
    run_dir, output_dir, log = workdir / "run", workdir / "outputs", workdir / "command.log"
    run_dir.mkdir(parents=True)
    output_dir.mkdir()
    (run_dir / SETTINGS_FILE).write_text(json.dumps({"steps": steps, "models": models, "output_dir": str(output_dir),
                                                     "repo": str(Path.cwd())}))  # (where the repo's code is)
    boot = write_bootstrap(workdir / "bootstrap")
    env = {**os.environ, **OFFLINE, RUN_DIR_VARIABLE: str(run_dir),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(boot), os.environ.get("PYTHONPATH")]))}
    if cache_dir is not None:
        env[CACHE_VARIABLE] = str(cache_dir)
    files_before = _files_in(Path.cwd())
    cpu_before = _children_cpu()
    started = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            returncode: Optional[int] = process.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            returncode = None
            _wait_for_stacks(_signal_all(process.pid, run_dir, STACK_SIGNAL) + [process.pid], run_dir)
        except BaseException:  # an interrupt (Ctrl-C, SIGTERM): nothing of the command outlives the run
            _signal_all(process.pid, run_dir, signal.SIGKILL)
            process.wait()
            raise
        left_behind = _signal_all(process.pid, run_dir, signal.SIGKILL)
        process.wait()
    seconds = time.monotonic() - started
    processes = [json.loads(path.read_text()) for path in sorted(run_dir.glob("process-*.json"))]
    stacks = {int(path.stem.partition("-")[2]): path.read_text(errors="replace")
              for path in sorted(run_dir.glob("stacks-*.txt")) if path.stat().st_size}
    with log.open("a") as out:  # (the command's output, then where each process was at the deadline)
        for pid, text in stacks.items():
            out.write(f"\n--- pytest-llmload run: process {pid}'s stack at the {deadline:g} s deadline ---\n{text}")
    written = sorted(_files_in(Path.cwd()) - files_before) if files_before is not None else []
    return CommandRun(argv, returncode, seconds, _children_cpu() - cpu_before, deadline, processes, stacks,
                      output_dir, log, [] if returncode is None else left_behind, written)


def _wait_for_stacks(pids: list[int], run_dir: Path) -> None:
    """Until each of ``pids`` has written its stacks, or :data:`STACKS_GRACE_S` passed."""
    until = time.monotonic() + STACKS_GRACE_S
    files = [run_dir / f"stacks-{pid}.txt" for pid in pids if (run_dir / f"pid-{pid}").exists()]
    while time.monotonic() < until and not all(f.is_file() and f.stat().st_size for f in files):
        time.sleep(0.05)


def _files_in(folder: Path) -> "set[str] | None":
    """The files under ``folder`` (its ``.git`` aside), relative to it; ``None`` past :data:`MAX_FILES_LISTED`
    (a folder that large is not listed twice)."""
    found: set[str] = set()
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if d != ".git"]
        found.update(os.path.relpath(os.path.join(root, name), folder) for name in files)
        if len(found) > MAX_FILES_LISTED:
            return None
    return found


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _signal_all(leader: int, run_dir: Path, signum: int) -> list[int]:
    """Send ``signum`` to the command's session and to every process the bootstrap started in (a launcher may start
    its ranks in sessions of their own); returns those still alive, the leader aside."""
    alive = []
    for path in run_dir.glob("pid-*"):
        pid = int(path.name.partition("-")[2])
        if not _in_run(pid, run_dir):  # ended (its pid may be another's by now)
            continue
        try:
            os.kill(pid, signum)
            if pid != leader:
                alive.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        os.killpg(leader, signum)
    except (ProcessLookupError, PermissionError):
        pass
    return alive


def _in_run(pid: int, run_dir: Path) -> bool:
    """Whether ``pid`` is a live process of this run: its environment names the run's folder."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{RUN_DIR_VARIABLE}={run_dir}".encode() in environ.split(b"\0")


def new_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="llmload-run-"))
