"""Issue 26's speed figures: a prediction row for a 70B model on an 8-GPU profile after the stack is imported, and
the main job with ``--runner`` against the plain main job (a ratio from paired runs).

    python benchmarks/bench_prediction.py [--repeat 5]

Prints the median seconds of each scenario for llama-3-70b on 8xH100-80GB (the empty model and the model
directory built once, first, as a main job run builds them for its first row), then the paired main-job medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import REPO, repo_env, run_timed  # noqa: E402


def rows(repeat: int) -> None:
    import torch  # noqa: F401 - the stack, imported before the clock starts
    import transformers  # noqa: F401

    from pytest_llmload.placement import architectures, profiles
    from pytest_llmload.prediction import predict
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer as reference

    profile, config = profiles.load_profile("8xH100-80GB"), architectures.load_config("llama-3-70b")
    workdir = Path(tempfile.mkdtemp(prefix="bench-prediction-"))
    start = time.perf_counter()
    predict.model_dir(config, workdir)
    print(f"first use: model directory (config, tokenizer, weights header) {time.perf_counter() - start:.2f} s")
    for scenario in predict.scenarios():
        if scenario.name == "predict_trainer":
            continue  # runs Trainer on the tiny checkpoint: bench_main_job's territory, not the planner's
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            try:
                scenario.function(reference, profile, config, "llama-3-70b", workdir)
            except predict.PredictedFailure:
                pass
            times.append(time.perf_counter() - start)
        print(f"{scenario.name:<28} median {statistics.median(times):.3f} s  (first {times[0]:.3f} s, "
              f"{repeat} runs)")


def main_job(repeat: int) -> None:
    plain, runner = [], []
    for _ in range(repeat):  # paired: the machine's load moves both alike
        plain.append(run_timed([sys.executable, "-m", "pytest_llmload", "-k", "not cuda"], cwd=REPO,
                               env=repo_env(), check=False)[0])
        runner.append(run_timed([sys.executable, "-m", "pytest_llmload", "-k", "not cuda", "--runner", "8xH100-80GB",
                                 "--model", "llama-3-70b"], cwd=REPO, env=repo_env(), check=False)[0])
    p, r = statistics.median(plain), statistics.median(runner)
    print(f"main job: plain median {p:.1f} s, with --runner 8xH100-80GB --model llama-3-70b median {r:.1f} s, "
          f"ratio {r / p:.2f} ({repeat} paired runs)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-main-job", action="store_true")
    args = parser.parse_args()
    rows(args.repeat)
    if not args.skip_main_job:
        main_job(max(3, args.repeat // 2))
