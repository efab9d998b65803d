"""The cost of timing a phase, against a tiny-model load (goal: under 1%).

Three figures, medians of several runs, in one process (torch imported once):

- a tiny-model load through the reference loader, called directly (no phase);
- one phase as the seam wraps a load: ``with phase(...)`` inside a recording with progress lines on (RSS
  read before and after, the kernel's peak counter folded and reset, a heartbeat entry scheduled and
  cancelled), plus ``track_model`` (timed over many empty phases, per phase);
- the same load through ``call_loader`` (phase and tracking included) and directly, alternated: the
  end-to-end difference, noisier than the per-phase figure on a shared machine.

Also, for the docs, what the ``limit_torch_memory`` marker's profiler costs around the same load on CPU.
Run: ``python benchmarks/bench_diagnostics.py [--runs 15]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _timing import median, print_table  # noqa: E402


def main(runs: int = 15, phases: int = 2000) -> dict:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    from pytest_llmload import LoadRequest
    from pytest_llmload.loader.seam import call_loader
    from pytest_llmload.plugin.memory_limit import _CpuAllocations
    from pytest_llmload.instruments.phases import phase, recording, track_model
    from pytest_llmload.instruments.recorder import PhaseRecorder
    from pytest_llmload.fixes.reference_loader import load_model_and_tokenizer
    from pytest_llmload.loader.tiny_models import build_tiny_checkpoint

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_tiny_checkpoint(Path(tmp) / "llama", "llama")
        request = LoadRequest(checkpoint)
        load_model_and_tokenizer(request)  # warm-up: imports, file cache

        with _CpuAllocations():
            pass  # the profiler's one-time start, outside the figures

        def profiled_load():
            with _CpuAllocations():
                return load_model_and_tokenizer(request)

        variants = {"direct": lambda: load_model_and_tokenizer(request),
                    "seam": lambda: call_loader(load_model_and_tokenizer, request),
                    "profiled": profiled_load}
        times: dict[str, list[float]] = {name: [] for name in variants}
        recorder = PhaseRecorder("bench", progress_every=30.0)
        with recording(recorder=recorder):
            for run in range(runs):
                names = list(variants)
                for name in names[run % 3:] + names[:run % 3]:  # rotate: drift hits every variant alike
                    start = time.perf_counter()
                    model = variants[name]()[0]
                    times[name].append(time.perf_counter() - start)

            per_phase = []
            for _ in range(runs):
                start = time.perf_counter()
                for _ in range(phases):
                    with phase("load", "bench"):
                        pass
                    track_model(model, checkpoint, 0.0)
                per_phase.append((time.perf_counter() - start) / phases)
                recorder.phases.clear()
                recorder.models.clear()
    direct, seam, profiled = times["direct"], times["seam"], times["profiled"]

    load, one_phase = median(direct), median(per_phase)
    through_seam, with_profiler = median(seam), median(profiled)
    overhead = one_phase / load
    print_table(
        f"phase timing vs a tiny-model load (tiny Llama, reference loader, CPU), medians of {runs} runs",
        [("tiny-model load, direct", f"{load * 1000:.1f} ms", ""),
         ("one phase + track_model", f"{one_phase * 1e6:.0f} us", f"{overhead:.2%} of a load"),
         ("load through call_loader", f"{through_seam * 1000:.1f} ms",
          f"{through_seam / load - 1:+.1%} vs direct (noise included)"),
         ("load under limit_torch_memory's profiler", f"{with_profiler * 1000:.1f} ms",
          f"{with_profiler / load - 1:+.1%} vs direct")],
        ("what", "median", "relative"),
    )
    return {"load_s": load, "phase_s": one_phase, "overhead": overhead, "profiler_overhead": with_profiler / load - 1}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=15)
    main(parser.parse_args().runs)
