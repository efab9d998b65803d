"""Every benchmark, one command: ``python benchmarks/run_all.py`` (add ``--quick`` for fewer runs).

Prints each benchmark's table, then a summary against the goals of issue 8. On a shared machine read the
CPU-time figures next to the wall times: wall time includes everyone else's load.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed reads it once, at import
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_distributed  # noqa: E402
import bench_isolation  # noqa: E402
import bench_plugin_load  # noqa: E402
import bench_suite  # noqa: E402
from _timing import load_average, print_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer runs (noisier medians), no fresh interpreter")
    parser.add_argument("--no-suite", action="store_true", help="skip the whole-suite runs (minutes)")
    options = parser.parse_args()
    quick = options.quick

    plugin = bench_plugin_load.main(runs=11 if quick else 31)
    isolation = bench_isolation.main(runs=5 if quick else 9, fresh=not quick)
    ranks = bench_distributed.main(runs=3 if quick else 5)
    suite = {} if options.no_suite else bench_suite.main(runs=1 if quick else 3)

    deepspeed = ranks["2-rank DeepSpeed ZeRO-2 load + prepare + step"]
    rows = [
        ("plugin's added cost, pytest run using none of its fixtures", "< 20 ms",
         f"{plugin['plugin_added_cpu_ms']:.1f} ms CPU (IQR {plugin['plugin_added_iqr_ms'][0]:.0f} to "
         f"{plugin['plugin_added_iqr_ms'][1]:.0f}); its imports {plugin['plugin_import_ms']:.1f} ms"),
        ("overhead of one isolated check over the same work in-process", "< 0.3 s",
         ", ".join(f"{s:.3f} s" for s in isolation["overheads_s"].values())
         + (f" (fresh interpreter: {isolation['fresh_interpreter_s']:.2f} s)" if isolation["fresh_interpreter_s"] else "")),
        ("2-rank DeepSpeed ZeRO-2 load + prepare + step", "< 3 s", f"{deepspeed:.2f} s"),
    ]
    for key, label, goal in (("serial", "CPU suite, serial", "< 90 s"), ("n2", "CPU suite, -n 2", "")):
        if key in suite:
            result = suite[key]
            state = "" if result["exit_statuses"] == [0] else f", exit status {result['exit_statuses']}"
            rows.append((label, goal, f"{result['wall_s']:.1f} s wall, {result['cpu_s']:.1f} s CPU{state}"))
    print_table(f"summary: medians ({os.cpu_count()} CPUs; {load_average()} at the end)", rows,
                ("measure", "goal", "measured"))


if __name__ == "__main__":
    main()
