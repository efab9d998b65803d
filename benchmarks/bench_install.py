"""What each extra costs to install: wall time of ``pip install`` and the size of the environment it makes.

For each extra (and the bare plugin): a fresh virtual environment under /tmp, then ``pip install -c
constraints-cpu.txt "<wheel>[extra]"`` of the wheel built from this checkout, as a user's CI installs it (the
tested stack, torch's CPU build); its wall time, then ``du -s`` of the environment. The empty environment (pip
alone) is measured too, so an extra's own share is its size less that. pip's cache is used as it is on the machine
(as CI's installs here use it): a cold cache on a new machine adds the downloads. Slow (minutes, several GB
written): run it once, on purpose, and write the figures in docs/performance.md with the date and the machine.

    python benchmarks/bench_install.py [--extras hf,quant,deepspeed,report,all] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import REPO, load_average, print_table  # noqa: E402

# The bare plugin, then each extra alone, then [all] (what the README used to ask for).
EXTRAS = ("", "hf", "quant", "deepspeed", "report", "all")


def du_mib(path: Path) -> float:
    """``du -s`` of ``path`` in MiB (what the files take on disk)."""
    out = subprocess.run(["du", "-s", "--block-size=1K", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0]) / 1024


def build_wheel(into: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(into), str(REPO)], check=True)
    (wheel,) = into.glob("pytest_llmload-*.whl")
    return wheel


def install(wheel: Path, extra: str, root: Path) -> dict:
    """A fresh venv with the wheel and ``extra`` installed: its wall time and size."""
    venv = root / (extra or "bare")
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    empty = du_mib(venv)
    target = f"{wheel}[{extra}]" if extra else str(wheel)
    # (DeepSpeed ships an sdist whose setup imports torch when DS_ACCELERATOR=cpu: installed with it unset, as CI does.)
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    load = load_average()
    start = time.perf_counter()
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c",
                           str(REPO / "constraints-cpu.txt"), target], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pip install {target} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    size = du_mib(venv)
    shutil.rmtree(venv, ignore_errors=True)
    return {"extra": extra or "(none)", "install_s": round(wall, 1), "venv_mib": round(size),
            "over_empty_venv_mib": round(size - empty), "empty_venv_mib": round(empty), "load": load}


def main(extras=EXTRAS) -> dict:
    root = Path(tempfile.mkdtemp(prefix="llmload-bench-install-", dir="/tmp"))
    try:
        wheel = build_wheel(root / "wheel")
        rows = [install(wheel, extra, root) for extra in extras]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(f"pip install -c constraints-cpu.txt {wheel.name}[EXTRA] into a fresh venv",
                [(r["extra"], f"{r['install_s']} s", f"{r['venv_mib']} MiB", f"{r['over_empty_venv_mib']} MiB",
                  r["load"]) for r in rows],
                ("extra", "install", "venv", "over an empty venv", "before"))
    return {"date": time.strftime("%Y-%m-%d"), "machine": f"{_cpu_model()}, {os.cpu_count()} CPUs, "
            f"{platform.python_implementation()} {platform.python_version()}", "wheel": wheel.name, "rows": rows}


def _cpu_model() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extras", default=",".join(e or "none" for e in EXTRAS),
                        help="comma-separated; 'none' is the bare plugin")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    options = parser.parse_args()
    figures = main(tuple("" if e == "none" else e for e in options.extras.split(",")))
    if options.json:
        Path(options.json).write_text(json.dumps(figures, indent=1) + "\n")
