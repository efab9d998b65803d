"""Does having pytest-llmload installed change other projects' test outcomes? (issue 17)

For each peer project (the version installed in this venv), download its sdist, unpack it, and run its own test
suite twice with this venv's python: with the plugin (loaded through its ``pytest11`` entry point) and with
``-p no:llmload``. Per-test outcomes come from ``--junitxml``; the table lists how many tests differ, and which.

A third, cheap run per project (``--collect-only`` without ``-q``, which hides the report header) counts the
``llmload:`` lines in the session header: there should be exactly one.

Limit: ``-p no:llmload`` reaches the outer session only. Tests that start inner pytest sessions (pytester, xdist
workers) load the plugin in both modes, since pytester drops ``PYTEST_ADDOPTS``.

Usage: python benchmarks/peer_suites.py WORKDIR [--timeout SECONDS] [--only NAME ...]
Needs the network (pip download); everything else runs offline with DeepSpeed on CPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import load_average, print_table  # noqa: E402

# distribution name -> where its tests live inside the unpacked sdist
PEERS = {
    "iniconfig": "testing",
    "pytest-timeout": "test_pytest_timeout.py",
    "execnet": "testing",
    "pytest-xdist": "testing",
}
BASE_ARGS = ["-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly"]
HEADER_LINE = re.compile(r"^llmload:", re.MULTILINE)


def _normalize(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def _sdist_release(archive: Path) -> tuple[str, str]:
    """``(normalized project, version)`` from an sdist's file name, e.g. ``pytest_xdist-3.8.0.tar.gz``."""
    project, _, version = archive.name.removesuffix(".tar.gz").rpartition("-")
    return _normalize(project), version


def fetch_sdist(name: str, version: str, workdir: Path) -> Path:
    """Download and unpack ``name==version``'s sdist under ``workdir``; returns the unpacked project root."""
    downloads = workdir / "sdists"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                    f"{name}=={version}", "-d", str(downloads)], check=True)
    archive = next(p for p in downloads.glob("*.tar.gz") if _sdist_release(p) == (_normalize(name), version))
    root = workdir / archive.name.removesuffix(".tar.gz")
    if not root.exists():
        with tarfile.open(archive) as tar:
            tar.extractall(workdir, filter="data")
    return root


def junit_outcomes(path: Path) -> dict[str, str]:
    """``{test id: outcome}`` from a junit XML report; a test reported twice (a failed call and a teardown
    error) gets both outcomes joined with '+'."""
    outcomes: dict[str, list[str]] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcome = {"failure": "failed", "error": "error"}.get(kinds[0], "skipped") if kinds else "passed"
        if kinds == ["skipped"] and "xfail" in (case.find("skipped").get("type") or ""):
            outcome = "xfailed"
        outcomes.setdefault(test_id, []).append(outcome)
    return {test_id: "+".join(kinds) for test_id, kinds in outcomes.items()}


def run_suite(root: Path, testdir: str, plugin: bool, timeout: float, env: dict) -> dict:
    """One full run of a peer's suite; returns its outcomes, exit status, wall time and output facts."""
    tag = "with" if plugin else "without"
    xml = root / f"junit-{tag}.xml"
    # Our own basetemp: pytest prunes all but the newest 3 /tmp/pytest-of-<user>/pytest-N dirs, so concurrent
    # pytest runs by the same user would delete this run's tmp_path roots midway (FileNotFoundError errors).
    argv = [sys.executable, *BASE_ARGS, "-q", "-rA", f"--junitxml={xml}", f"--basetemp={root / f'tmp-{tag}'}",
            testdir]
    if not plugin:
        argv[3:3] = ["-p", "no:llmload"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"timed_out": True, "wall": time.perf_counter() - start}
    output = proc.stdout + proc.stderr
    (root / f"output-{tag}.txt").write_text(output)
    summary = output.strip().splitlines()[-1] if output.strip() else ""
    warnings = re.search(r"(\d+) warnings?", summary)
    return {
        "timed_out": False,
        "wall": time.perf_counter() - start,
        "status": proc.returncode,
        "outcomes": junit_outcomes(xml) if xml.exists() else {},
        "warnings": int(warnings.group(1)) if warnings else 0,
        "llmload_lines": len(HEADER_LINE.findall(output)),  # -q hides the header: any here came from inner runs
    }


def header_count(root: Path, testdir: str, env: dict) -> int:
    """``llmload:`` lines in the session header (the lines before 'collected ...') of a collect-only run."""
    proc = subprocess.run([sys.executable, *BASE_ARGS, "--collect-only", testdir], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    header = re.split(r"^collected ", proc.stdout, maxsplit=1, flags=re.MULTILINE)[0]
    return len(HEADER_LINE.findall(header))


def tally(outcomes: dict[str, str]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in sorted(Counter(outcomes.values()).items())) or "none"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per suite run; a slower one is skipped")
    parser.add_argument("--only", nargs="*", default=list(PEERS), help="peer projects to run (default: all)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    print(f"python {sys.executable}; {load_average()}")

    rows, differences = [], []
    for name in args.only:
        version = metadata.version(name)
        root = fetch_sdist(name, version, args.workdir.resolve())
        headers = header_count(root, PEERS[name], env)
        with_run = run_suite(root, PEERS[name], True, args.timeout, env)
        without_run = run_suite(root, PEERS[name], False, args.timeout, env)
        label = f"{name} {version}"
        if with_run["timed_out"] or without_run["timed_out"]:
            rows.append((label, "-", f"skipped: over {args.timeout:.0f}s", "", "", str(headers), ""))
            continue
        with_out, without_out = with_run["outcomes"], without_run["outcomes"]
        differing = sorted(t for t in with_out.keys() | without_out.keys()
                           if with_out.get(t, "absent") != without_out.get(t, "absent"))
        differences += [f"{label}: {t}: with {with_out.get(t, 'absent')}, without {without_out.get(t, 'absent')}"
                        for t in differing]
        rows.append((label, str(len(with_out | without_out)),
                     f"{tally(with_out)} (rc {with_run['status']}, {with_run['warnings']} warn, "
                     f"{with_run['wall']:.0f}s)",
                     f"{tally(without_out)} (rc {without_run['status']}, {without_run['warnings']} warn, "
                     f"{without_run['wall']:.0f}s)",
                     str(len(differing)), str(headers),
                     f"{with_run['llmload_lines']}/{without_run['llmload_lines']}"))
    print_table("Peer suites with and without pytest-llmload", rows,
                ("project", "tests", "with plugin", "without (-p no:llmload)", "differ", "header lines",
                 "llmload: lines in -q output (with/without)"))
    print("\n".join(["", "Tests whose outcome differs:", *differences]) if differences
          else "\nNo test's outcome differs.")
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
