"""The plugin's added cost on a pytest run that uses none of its fixtures (goal: under 20 ms).

Two measurements of ``pytest --collect-only`` of a trivial test file:

- paired runs: with the plugin and with ``-p no:llmload``, one right after the other, ``--runs`` pairs; the
  median of the per-pair differences of CPU time (user + system) and its interquartile range. Pairing cancels
  the drift of a shared machine; on a busy 2-core box one run still varies by tens of ms, so read the IQR.
- attribution: ``python -X importtime``: the time spent importing the plugin's modules (and whatever they
  import that pytest had not), median of 5 runs. Its hooks (options, markers, header) add well under 1 ms.

Both variants run without hypothesis' pytest plugin, which imports all of hypothesis (~1 s) at the end of
every run and would drown the figure in noise. Bytecode is cached (``.pyc``, as in an installed package)
unless ``--no-bytecode-cache`` (every module compiled on every run, as under PYTHONDONTWRITEBYTECODE=1).

    python benchmarks/bench_plugin_load.py [--runs 31] [--no-bytecode-cache]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import load_average, median, print_table, repo_env, run_timed  # noqa: E402


def plugin_import_ms(argv: list[str], cwd: str, env: dict) -> float:
    """Milliseconds spent in top-level imports of ``pytest_llmload`` modules in one run (``-X importtime``)."""
    result = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], cwd=cwd, env=env, capture_output=True, text=True)
    total_us = 0
    for line in result.stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        _, cumulative, name = line.split("|")
        if name.startswith(" pytest_llmload") and cumulative.strip().isdigit():  # one space: not nested
            total_us += int(cumulative)
    return total_us / 1000


def main(runs: int = 31, bytecode_cache: bool = True) -> dict:
    env = repo_env()
    if bytecode_cache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    else:  # an empty cache directory that is never written: .pyc files elsewhere are not read either
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="llmload-no-pyc-")
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "test_trivial.py").write_text("def test_one():\n    assert True\n")
        with_plugin = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                       "-p", "no:hypothesispytest"]
        without = with_plugin + ["-p", "no:llmload"]
        for argv in (with_plugin, without):  # warm-up: file cache, .pyc
            run_timed(argv, cwd=tmp, env=env)
        pairs = [(run_timed(with_plugin, cwd=tmp, env=env)[1], run_timed(without, cwd=tmp, env=env)[1])
                 for _ in range(runs)]
        imports = [plugin_import_ms(with_plugin, tmp, env) for _ in range(5)]
    diffs = [(w - wo) * 1000 for w, wo in pairs]
    q1, _, q3 = statistics.quantiles(diffs, n=4)
    added = median(diffs)
    print_table(
        f"pytest --collect-only of a trivial file, {runs} pairs of runs "
        f"({'bytecode cached' if bytecode_cache else 'no bytecode cache'}; {load_average()})",
        [("with llmload, CPU time (median)", f"{median([w for w, _ in pairs]) * 1000:.0f} ms"),
         ("-p no:llmload, CPU time (median)", f"{median([wo for _, wo in pairs]) * 1000:.0f} ms"),
         ("added by llmload: median of paired differences", f"{added:.1f} ms (IQR {q1:.1f} to {q3:.1f})"),
         ("importing the plugin's modules (-X importtime, median of 5)", f"{median(imports):.1f} ms")],
        ("measure", "value"),
    )
    return {"plugin_added_cpu_ms": added, "plugin_added_iqr_ms": (q1, q3), "plugin_import_ms": median(imports)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=31)
    parser.add_argument("--no-bytecode-cache", action="store_true")
    options = parser.parse_args()
    main(options.runs, bytecode_cache=not options.no_bytecode_cache)
