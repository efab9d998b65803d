"""Issue 38's figure: the planner's map against from_pretrained's own, cell for cell, on each stack.

    python benchmarks/bench_planner_exact.py [--python .venv/bin/python .venv-456/bin/python] [--no-4bit]

A cell is a shipped architecture x a shipped GPU profile x a strategy x a budget (the profile's capacities as
``max_memory``, or none), in bfloat16; and, where bitsandbytes is installed, 4-bit with ``auto`` (the quantizer's
own check may refuse the map: the refusal is then what is compared). For each, from_pretrained itself is called
(fixtures/from_pretrained_map.py: the real ``from_pretrained`` on a config + header-only checkpoint, on the
profile's simulated devices, stopped once it has placed the model) and its decision compared with the
prediction's (``placement.planned.place``). Prints cells equal / total per kind, strategy and budget, the cells
that differ, and the median seconds of each side. With ``--python``, runs in each interpreter named (one per
stack) instead of this one.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import REPO, print_table, repo_env  # noqa: E402

sys.path.insert(0, str(REPO))


def compare(strategies: list[str], four_bit: bool) -> int:
    import importlib.util

    import accelerate
    import transformers

    from fixtures import from_pretrained_map as own_map
    from pytest_llmload.placement import architectures, profiles

    runners = [name for name in profiles.shipped_names() if profiles.load_profile(name).devices]
    kinds = [("bfloat16", None, strategies)]
    if four_bit and importlib.util.find_spec("bitsandbytes"):
        kinds.append(("4-bit", own_map.four_bit(), ["auto"]))
    workdir = Path(tempfile.mkdtemp(prefix="bench-planner-exact-"))
    totals: dict = {}
    differing, own_times, plan_times = [], [], []
    for arch in architectures.shipped_names():
        checkpoint = own_map.checkpoint_for(arch, workdir / arch)
        for runner in runners:
            profile = profiles.load_profile(runner)
            for kind, quantization, kind_strategies in kinds:
                for strategy in kind_strategies:
                    for budget in own_map.BUDGETS:
                        max_memory = own_map.budget_of(profile, budget)
                        start = time.perf_counter()
                        expected = own_map.take(checkpoint, strategy, max_memory, own_map.machine_of(profile),
                                                quantization).decided
                        own_times.append(time.perf_counter() - start)
                        start = time.perf_counter()
                        got = own_map.predicted(arch, strategy, max_memory, profile, quantization)
                        plan_times.append(time.perf_counter() - start)
                        equal, total = totals.get((kind, strategy, budget), (0, 0))
                        totals[kind, strategy, budget] = (equal + (got == expected), total + 1)
                        if got != expected:
                            differing.append((f"{arch}@{runner}", kind, strategy, budget,
                                              own_map.differences(expected, got)))
    equal, total = (sum(counts[i] for counts in totals.values()) for i in (0, 1))
    stack = f"transformers {transformers.__version__}, accelerate {accelerate.__version__}"
    rows = [(kind, strategy, budget, f"{e} / {t}") for (kind, strategy, budget), (e, t) in totals.items()]
    rows.append(("all", "", "", f"{equal} / {total}"))
    print_table(f"{stack}: cells where the plan is from_pretrained's own decision "
                f"({len(architectures.shipped_names())} architectures x {len(runners)} GPU profiles)", rows,
                ("weights", "strategy", "max_memory", "equal / total"))
    if differing:
        print_table("cells that differ", differing, ("cell", "weights", "strategy", "max_memory", "how"))
    print(f"median seconds per cell: from_pretrained's own map {statistics.median(own_times):.3f} s, the plan "
          f"{statistics.median(plan_times):.3f} s (a run's first per architecture builds its empty model)")
    return 0 if equal == total else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", nargs="+", help="run in each of these interpreters (one per stack)")
    parser.add_argument("--strategies", nargs="+", default=["auto", "balanced", "sequential"])
    parser.add_argument("--no-4bit", action="store_true", help="leave out the 4-bit (bitsandbytes) auto cells")
    args = parser.parse_args()
    if not args.python:
        return compare(args.strategies, four_bit=not args.no_4bit)
    options = ["--strategies", *args.strategies, *(["--no-4bit"] if args.no_4bit else [])]
    statuses = [subprocess.run([python, __file__, *options], cwd=REPO, env=repo_env(), check=False).returncode
                for python in args.python]
    return max(statuses)


if __name__ == "__main__":
    sys.exit(main())
