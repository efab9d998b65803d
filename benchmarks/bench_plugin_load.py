"""The plugin's added cost on a pytest run that uses none of its fixtures (goal: under 20 ms).

Times ``pytest --collect-only`` of a trivial test file with the plugin and with ``-p no:llmload``,
alternating the two so drift on a noisy machine hits both alike. Run: ``python benchmarks/bench_plugin_load.py``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import subprocess
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import median, print_table  # noqa: E402


def main(runs: int = 15) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "test_trivial.py").write_text("def test_one():\n    assert True\n")
        base = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        variants = {"with llmload": base, "-p no:llmload": base + ["-p", "no:llmload"]}
        times: dict[str, list[float]] = {k: [] for k in variants}
        for argv in variants.values():  # warm-up: file cache, .pyc
            subprocess.run(argv, cwd=tmp, check=True, capture_output=True)
        for _ in range(runs):
            for name, argv in variants.items():
                start = time.perf_counter()
                subprocess.run(argv, cwd=tmp, check=True, capture_output=True)
                times[name].append(time.perf_counter() - start)
    with_plugin, without = median(times["with llmload"]), median(times["-p no:llmload"])
    added_ms = (with_plugin - without) * 1000
    print_table(
        f"pytest --collect-only of a trivial file, median of {runs} runs",
        [("with llmload", f"{with_plugin * 1000:.0f} ms"), ("-p no:llmload", f"{without * 1000:.0f} ms"),
         ("added by llmload", f"{added_ms:.1f} ms ({with_plugin / without:.3f}x)")],
        ("variant", "wall time"),
    )
    return {"plugin_added_ms": added_ms}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=15)
    main(parser.parse_args().runs)
