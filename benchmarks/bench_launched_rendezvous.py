"""How often a ``distributed_env.run`` under torchrun fails to meet: many trivial runs, each rank's child joining a
fresh gloo group, counted per checkout in alternating rounds.

A rank's child forked while its process's store thread was serving another rank's connection could inherit the C
library's resolver mid-lookup and hang in its rendezvous until the run's deadline (CI, 2026-11-27: one
``test_two_ranks_under_torchrun_agree_on_every_outcome`` lost 60 s so). Rank 0 now forks its child before its store
serves (:mod:`pytest_llmload.plugin.launched_env`). Four ranks widen the window: three connect while rank 0 forks.

    python benchmarks/bench_launched_rendezvous.py [--rounds 3] [--runs 100] [--ranks 4] [--against DIR]

``--against DIR``: also another checkout (a ``git worktree`` of an earlier commit), in the same rounds: each round
runs this checkout's file, then DIR's. Every run has an 8 s deadline (a trivial run meets in about 0.1 s).
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import REPO, load_average, print_table, repo_env, run_timed  # noqa: E402

TESTS = '''
import pytest


def trivial():
    import torch
    import torch.distributed as dist

    total = torch.ones(1)
    dist.all_reduce(total)
    return total.item()


@pytest.mark.parametrize("n", range({runs}))
def test_run(distributed_env, n):
    assert distributed_env.run(trivial, world_size={ranks}, backend="gloo", timeout=8) == [{ranks}.0] * {ranks}
'''


def one_round(checkout: Path, folder: Path, ranks: int) -> tuple[int, int, float]:
    """(runs that failed, runs, wall seconds) of one torchrun pytest over the file in ``folder``."""
    env = repo_env(OMP_NUM_THREADS="1", PYTHONPATH=str(checkout))
    env.pop("PYTEST_ADDOPTS", None)
    log = folder / f"log-{checkout.name}.txt"
    wall, _, _ = run_timed(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         "--log-dir", str(folder / f"torchrun-{checkout.name}"), "-m", "pytest",
         "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-q", "-c", "/dev/null", "--rootdir", str(folder),
         "test_runs.py"], cwd=folder, env=env, check=False, log=log)
    text = log.read_text(errors="replace")
    failed = int(m.group(1)) if (m := re.search(r"(\d+) failed", text)) else 0
    passed = int(m.group(1)) if (m := re.search(r"(\d+) passed", text)) else 0
    return failed, failed + passed, wall


def main(rounds: int = 3, runs: int = 100, ranks: int = 4, against=None) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="llmload-bench-rendezvous-"))
    (folder / "test_runs.py").write_text(TESTS.format(runs=runs, ranks=ranks))
    checkouts = {"this checkout": REPO, **({f"against {against}": Path(against)} if against else {})}
    found = {label: [0, 0, []] for label in checkouts}
    loads = []
    for _ in range(rounds):
        loads.append(load_average())
        for label, checkout in checkouts.items():
            failed, total, wall = one_round(Path(checkout).resolve(), folder, ranks)
            found[label][0] += failed
            found[label][1] += total
            found[label][2].append(wall)
    rows = [(label, f"{failed} of {total}", ", ".join(f"{w:.1f} s" for w in walls))
            for label, (failed, total, walls) in found.items()]
    print_table(f"distributed_env.run under torchrun, {ranks} ranks, {rounds} round(s) of {runs} trivial runs "
                f"(8 s deadline each); loads: {'; '.join(loads)}", rows, ("checkout", "runs that failed", "wall per round"))
    if any(failed for failed, _, _ in found.values()):
        print(f"the runs' logs (torchrun's and pytest's): {folder}")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return {label: {"failed": f, "runs": t} for label, (f, t, _) in found.items()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--against", metavar="DIR")
    options = parser.parse_args()
    main(options.rounds, options.runs, options.ranks, options.against)
