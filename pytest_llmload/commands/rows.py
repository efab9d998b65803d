"""A command's run judged: the command's own row (it finished its bounded run, crashed at the repo's line, or passed
its deadline) and one row per known failure, each a :class:`~pytest_llmload.reports.row.Row` as the checks make.

A known failure is caught where the run raised its error (its texts, :meth:`KnownFailure.matches`, the detector the
checks' reports use) or hung inside a load where a hang is its mechanism; else its row says whether the run reached
the failure's mechanism (:data:`REACHED`, from what each process recorded: a load that offloaded, an optimizer step,
a GradScaler that unscaled, Trainer's GPU count, a distributed process), so that a row that passed says what it
watched, and one that could not happen on this runner says why.
"""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

from pytest_llmload.checks.base import NOT_EXERCISED
from pytest_llmload.commands.command import CommandRun
from pytest_llmload.commands.in_process import GENERATE_TOKENS, is_repo_file
from pytest_llmload.failures import CATALOG
from pytest_llmload.reports.row import Row
from pytest_llmload.reports.verdict import failure_origin

COMMAND_ROW = "command"


class Facts:
    """What the run's processes did, together."""

    def __init__(self, run: CommandRun) -> None:
        processes = sorted(run.processes, key=lambda p: p.get("started", 0))  # (their files' order is their pids')
        self.loads = [load for p in processes for load in p["loads"]]  # every from_pretrained call, raised or not
        self.loaded = [load for load in self.loads if not load.get("raised")]
        self.offloaded = [load for load in self.loaded if load["offloaded"]]
        self.steps = max((p["steps"] for p in processes), default=0)
        self.unscales = sum(p["unscales"] for p in processes)
        self.generates = sum(p["generates"] for p in processes)
        self.trainers = [t for p in processes for t in p["trainers"]]
        self.distributed = [p for p in processes if p["distributed"]]
        self.crashed = [p for p in processes if p["crash"]]
        self.crashes = [p["crash"] for p in self.crashed]
        self.adapters = [adapter for p in processes for adapter in p["adapters"]]


def _placements(loads: list) -> str:
    """Each load's placement, and the GPUs its budget names that this runner lacks (its split differs there)."""
    def placement(load: dict) -> str:
        if load.get("raised"):
            return f"{load['where']}: raised {load['raised']}"
        absent = load.get("gpus_budgeted_absent") or []
        lacking = f" (its max_memory budgets GPU {', '.join(absent)}, which this runner lacks)" if absent else ""
        return f"{load['where']}: {', '.join(load['places']) or 'one device'}{lacking}"

    return "; ".join(placement(load) for load in loads)


def _offload_hang(facts: Facts) -> tuple[bool, str]:
    if facts.offloaded:
        return True, (f"{len(facts.offloaded)} load(s) offloaded, wrote no weight data outside their offload folder "
                      f"and returned ({_placements(facts.offloaded)})")
    return False, (f"no load offloaded ({_placements(facts.loads) or 'no model loaded'}): the temporary round-trip "
                   "happens only where from_pretrained offloads")


def _inference_stall(facts: Facts) -> tuple[bool, str]:
    if facts.generates:
        return True, f"generate ran {facts.generates} time(s), {GENERATE_TOKENS} new tokens at most, and returned"
    return False, "the command never called generate"


def _backward_through_offload(facts: Facts) -> tuple[bool, str]:
    if not facts.steps:
        return False, "no optimizer step ran"
    if facts.offloaded:
        return True, (f"{facts.steps} optimizer step(s) on a model with offloaded weights "
                      f"({_placements(facts.offloaded)})")
    return False, f"{facts.steps} optimizer step(s), but no load offloaded ({_placements(facts.loads)})"


def _dp_dtype(facts: Facts) -> tuple[bool, str]:
    if not facts.trainers:
        return False, "the command built no Trainer"
    gpus = max(t["n_gpu"] for t in facts.trainers)
    if gpus > 1 and not facts.steps:  # (Trainer decides the wrap in train(): a crash before it never reached it)
        return False, f"Trainer saw {gpus} GPUs, but no optimizer step ran: the command never trained with it"
    if gpus > 1:
        return True, f"Trainer saw {gpus} GPUs and did not wrap the placed model"
    return False, (f"Trainer at {facts.trainers[0]['where']} saw {gpus} GPU(s); it wraps a model in DataParallel "
                   "only where it sees 2 or more (not reachable on this runner)")


def _nothing_loaded(loads: list, facts: Facts) -> str:
    """Why no model was placed: the calls that raised, else the crash before any call."""
    if loads:
        return _placements(loads)
    if facts.crashes:
        return f"the command crashed at {_where(_the_crash(facts))} before any from_pretrained call"
    return "no from_pretrained call"


def _distributed_device_map(facts: Facts) -> tuple[bool, str]:
    if not facts.distributed:
        return False, "the command started no distributed process (no WORLD_SIZE, RANK or LOCAL_RANK)"
    loaded = [load for load in facts.loaded if load["distributed"]]
    if not loaded:  # (the refusal comes at a load: ranks that crashed before one never reached it)
        called = [load for load in facts.loads if load["distributed"]]
        return False, (f"{len(facts.distributed)} distributed process(es) placed no model "
                       f"({_nothing_loaded(called, facts)})")
    mapped = [load for load in loaded if load["device_map"] is not None]
    if not mapped:
        return True, (f"{len(loaded)} load(s) in {len(facts.distributed)} distributed process(es) without a "
                      f"device_map ({', '.join(sorted({load['where'] for load in loaded}))})")
    spread = [load for load in mapped if len(load["places"]) > 1]
    if spread:
        return True, f"device_map spread a model over {_placements(spread)} in a distributed process"
    return False, (f"device_map={mapped[0]['device_map']} at {mapped[0]['where']} placed the model on one device "
                   "here; the refusal needs it spread over 2 or more (a GPU runner)")


def _zero3_device_map(facts: Facts) -> tuple[bool, str]:
    zero3 = [load for load in facts.loads if load["zero3"]]
    placed = [load for load in zero3 if not load.get("raised")]
    if placed:
        return True, f"{len(placed)} load(s) under ZeRO-3 ({_placements(placed)})"
    if zero3:
        return False, (f"ZeRO-3 was on at {len(zero3)} from_pretrained call(s), which raised before placing the model "
                       f"({_placements(zero3)})")
    made = "" if facts.loads else f" ({_nothing_loaded([], facts)})"
    return False, f"ZeRO-3 was not enabled at any from_pretrained call{made}"


def _fp16_unscale(facts: Facts) -> tuple[bool, str]:
    if facts.unscales:
        return True, f"a GradScaler unscaled gradients {facts.unscales} time(s)"
    return False, "no enabled GradScaler unscaled gradients"


def _move_offloaded(facts: Facts) -> tuple[bool, str]:
    if facts.offloaded:
        return True, (f"{len(facts.offloaded)} load(s) offloaded ({_placements(facts.offloaded)}); no move or cast "
                      "of it raised accelerate's refusal")
    return False, "no load offloaded"


def _quantized_cast(facts: Facts) -> tuple[bool, str]:
    quantized = [load for load in facts.loaded if load["quantized"]]
    if quantized:
        return True, f"{len(quantized)} quantized load(s)"
    return False, "no quantized load"


def _adapter_on_offloaded(facts: Facts) -> tuple[bool, str]:
    on_offloaded = [adapter for adapter in facts.adapters if adapter["on_offloaded"]]
    loaded = [adapter for adapter in on_offloaded if not adapter.get("raised")]
    if loaded:
        return True, f"an adapter was put on an offloaded base at {loaded[0]['where']} and loaded"
    if on_offloaded:
        return False, (f"an adapter put on an offloaded base at {on_offloaded[0]['where']} raised before it loaded "
                       f"({on_offloaded[0]['raised']}), not as this failure does")
    if facts.adapters:
        return False, f"{len(facts.adapters)} adapter(s) put on a base with nothing offloaded"
    return False, "the command put no adapter on a model (PeftModel.from_pretrained)"


# Failure id -> whether the run reached its mechanism, and what it saw (a failure missing here: not watched yet).
REACHED: dict[str, Callable[[Facts], tuple[bool, str]]] = {
    "offload-hang": _offload_hang, "inference-stall": _inference_stall, "meta-backward": _backward_through_offload,
    "dp-dtype": _dp_dtype, "distributed-device-map": _distributed_device_map, "zero3-device-map": _zero3_device_map,
    "fp16-unscale": _fp16_unscale, "move-offloaded": _move_offloaded, "quantized-cast": _quantized_cast,
    "adapter-on-offloaded": _adapter_on_offloaded,
}


def _round_trip(facts: Facts) -> Optional[str]:
    """offload-hang's mechanism, where a load showed it: weight data written outside its offload folder."""
    load = next((load for load in facts.loads if load["weight_writes"]), None)
    if load is None:
        return None
    return (f"{load['where']}: from_pretrained wrote {load['weight_writes']} weight file(s) or folder(s) outside its "
            f"offload folder, a silent temporary round-trip of the weights (e.g. {load['weight_writes_shown'][0]})")


# Failure id -> where the run showed its mechanism without an error (a load's writes), else None.
CAUGHT: dict[str, Callable[[Facts], Optional[str]]] = {"offload-hang": _round_trip}


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _where(crash: dict) -> str:
    if crash["repo_frames"]:
        return crash["repo_frames"][-1]
    return "a library's code (no file of the repo in its traceback)"


def _the_crash(facts: Facts) -> dict:
    """The crash the command's row names: one in the repo's code before a launcher's report of it (torchrun's
    ChildFailedError, raised in its own bin script), a rank's before a launcher's; the earliest started first."""
    return max(facts.crashed, key=lambda p: (bool(p["crash"]["repo_frames"]), bool(p["distributed"])))["crash"]


def _fix_at(line: str, fix: str) -> str:
    """A fix as the repo's change at its line."""
    return f"at {line}: {fix}" if fix else fix


def _load_that_raised(crash: dict, facts: Facts) -> Optional[dict]:
    """The from_pretrained call a crash came out of: a call that raised at a line among the crash's frames."""
    lines = {frame.partition(" in ")[0] for frame in crash["repo_frames"]}
    return next((load for load in facts.loads if load.get("raised") and load["where"] in lines), None)


def _budget_names_absent_gpus(load: Optional[dict]) -> Optional[tuple[str, str]]:
    """Where the call that raised budgets GPUs this runner lacks: the cause and the change at its line."""
    if not load or not load.get("gpus_budgeted_absent"):
        return None
    gpus = ", ".join(load["gpus_budgeted_absent"])
    return (f" (max_memory={load['max_memory']} at {load['where']} budgets GPU {gpus}, which this runner lacks)",
            _fix_at(load["where"], f"give max_memory only the GPUs the runner has (e.g. {{i: ... for i in "
                    f"range(torch.cuda.device_count())}} and 'cpu'), or run the command where GPU {gpus} exists"))


# A frame in a faulthandler dump: `  File "train.py", line 12 in main` (innermost first).
_DUMPED_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')


def _repo_frames_dumped(text: str) -> list[str]:
    """The repo's frames of a faulthandler dump, innermost first, as ``path:line in function``."""
    return [f"{os.path.relpath(path)}:{line} in {name}" for path, line, name in _DUMPED_FRAME.findall(text)
            if is_repo_file(path)]


# A stack stopped inside transformers' own from_pretrained, and one stopped in this run's own code (a tiny build).
_IN_FROM_PRETRAINED = re.compile(r'transformers[/\\]modeling_utils\.py", line \d+ in from_pretrained')
_IN_THE_RUN = re.compile(r'pytest_llmload[/\\]commands[/\\]tiny_weights\.py"')


def _hung_in_load(run: CommandRun) -> bool:
    """The command passed its deadline inside a load (offload-hang's mechanism), not in this run's tiny build."""
    return run.hung and any(_IN_FROM_PRETRAINED.search(text) and not _IN_THE_RUN.search(text)
                            for text in run.stacks.values())


def failure_rows(run: CommandRun, facts: Facts) -> list[Row]:
    rows = []
    for failure in CATALOG:
        common = {"check": f"watch_{failure.slug}", "guards": failure.id, "guards_origin": failure_origin(failure),
                  "loader": " ".join(run.argv),  # (what ran: the command, not a loader function)
                  "seconds": round(run.seconds, 2)}  # (the watch lasted the command's run)
        fix = failure.script_fix or failure.fix  # (phrased for a script: no name of this plugin)
        caught = next((crash for crash in facts.crashes if failure.matches(crash["text"])), None)
        if caught is not None:
            rows.append(Row(verdict="failed", failure=failure.id, fix=_fix_at(_where(caught), fix), **common,
                            sentence=f"{failure.id} caught at {_where(caught)}: {_first_line(caught['message'])}"))
            continue
        if failure.hang_is_mechanism and _hung_in_load(run):
            rows.append(Row(verdict="failed", failure=failure.id, fix=fix, **common,
                            sentence=f"{failure.id}: a from_pretrained call did not return within the run's "
                                     f"{run.deadline:g} s deadline"))
            continue
        seen_by_mechanism = CAUGHT.get(failure.id, lambda facts: None)(facts)
        if seen_by_mechanism is not None:
            rows.append(Row(verdict="failed", failure=failure.id, fix=fix, **common,
                            sentence=f"{failure.id} caught at {seen_by_mechanism}"))
            continue
        judge = REACHED.get(failure.id)
        reached, seen = judge(facts) if judge else (False, f"`run` does not watch {failure.id} yet")
        if reached:
            rows.append(Row(verdict="passed", notes=(f"watched: {seen}",), **common))
        else:
            rows.append(Row(verdict="not exercised", sentence=f"{NOT_EXERCISED}{failure.id}: {seen}", **common))
    return rows


def command_row(run: CommandRun, facts: Facts) -> Row:
    """The command's own outcome: finished (bounded), crashed (where in the repo, the known fault's fix), hung;
    noted with what the run saw besides (files it wrote into the repo, processes it left running, what the watch
    could not see)."""
    common = {"check": COMMAND_ROW, "loader": " ".join(run.argv), "seconds": round(run.seconds, 2),
              "notes": _besides(run)}
    if run.hung:
        stuck = sorted({frame for text in run.stacks.values() for frame in _repo_frames_dumped(text)[:1]})
        at = f" stuck at {', '.join(stuck)};" if stuck else ""
        ours = " (in pytest-llmload run's own tiny build: a fault of the run, please report it)" if any(
            _IN_THE_RUN.search(text) for text in run.stacks.values()) else ""
        return Row(verdict="error", cause="hang", **common, sentence=(
            f"the command did not end within its {run.deadline:g} s deadline:{at}{ours} every process was ended, "
            f"their stacks ({len(run.stacks)}) are at the end of its output {run.log}"))
    if facts.crashes:
        crash = _the_crash(facts)
        fault: Optional[dict] = crash["fault"]
        cause, fix = (f" ({fault['cause']})", _fix_at(_where(crash), fault["fix"])) if fault else ("", None)
        cause, fix = _budget_names_absent_gpus(_load_that_raised(crash, facts)) or (cause, fix)
        known = [failure.id for failure in CATALOG if failure.matches(crash["text"])]
        cause += f" (the known failure {', '.join(known)}: its row says what to change)" if known else ""
        return Row(verdict="error", cause="command", fix=fix, **common, sentence=(
            f"the command crashed at {_where(crash)}: {crash['type']}: {_first_line(crash['message'])}{cause}"))
    if not run.processes:
        return Row(verdict="error", cause="command", **common, sentence=(
            f"the command exited {run.returncode} and no Python process of it started the bootstrap (run with "
            f"python -S or -I, or not Python): nothing was watched; its output: {run.log}"))
    if run.returncode != 0:
        return Row(verdict="error", cause="died", **common, sentence=(
            f"the command exited {run.returncode} without a Python traceback; its output: {run.log}"))
    bounded = any(p["outcome"] == "bounded" for p in run.processes) or any(facts.trainers)
    ended = f"stopped after {facts.steps} optimizer step(s)" if bounded and facts.steps else \
        f"finished ({facts.steps} optimizer step(s))"
    ran = f"{ended} in {len(run.processes)} process(es); {len(facts.loaded)} model load(s) on tiny weights"
    return Row(verdict="passed", **{**common, "notes": (ran, *common["notes"])})


def _besides(run: CommandRun) -> tuple[str, ...]:
    notes: tuple[str, ...] = ()
    errors = [error for p in run.processes for error in p["watch_errors"]]
    if errors:
        notes += (f"not watched, a fault of pytest-llmload run (please report it): {'; '.join(errors)}",)
    if run.written:
        notes += (f"it wrote {len(run.written)} file(s) into its working directory all the same (left there): "
                  f"{', '.join(run.written[:3])}",)
    if run.left_behind:
        notes += (f"{len(run.left_behind)} process(es) it started still ran after it ended: ended here",)
    return notes


def rows_of(run: CommandRun) -> list[Row]:
    facts = Facts(run)
    return [command_row(run, facts), *failure_rows(run, facts)]
