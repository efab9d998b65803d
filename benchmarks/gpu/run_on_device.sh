#!/usr/bin/env bash
# One call on a lent GPU machine (no network): install the carried wheels (.whl: bitsandbytes, deepspeed and
# their small dependencies, pytest 9.2, setuptools>=77 for this project's PEP 639 metadata), install this project with --no-deps (the machine's own torch stays),
# then run what the arguments name, each writing its JUnit XML and log under $OUT:
#   gpu       pytest -m gpu (GPU_WORKERS=N: N xdist workers sharing the one GPU)
#   dp        benchmarks/gpu/dp_same_device.py (write-up 003 on one GPU)
#   figures   benchmarks/gpu/gpu_figures.py
#   all       the whole suite, -n 8 with every worker seeing the GPU (--llmload-gpus-per-worker off: 8 workers on 1 GPU)
#   main      the main job (python -m pytest_llmload, reference loader) on the GPU machine, its rows and its time
#   nccl      benchmarks/gpu/gpu_figures.py --only-nccl (issue 28's figure: write-up 004's check on 1 nccl rank)
#   issue40   benchmarks/gpu/issue40_figures.py: the main job against its import floor, and pytest -m gpu -n 4
#             with the GPU shared (issue 40's goals 1 and 2; ROUNDS=N rounds, default 1)
#   cpu4      the CPU test command with the GPU hidden, -n 4 on 4 of the machine's cores (taskset), its wall and CPU
#             time (issue 28: what the test command takes on a 4-core runner)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 3; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, torch, transformers, accelerate, peft, bitsandbytes, deepspeed, pytest; print('python', sys.version.split()[0], '| torch', torch.__version__, 'cuda', torch.version.cuda, '| transformers', transformers.__version__, '| accelerate', accelerate.__version__, '| peft', peft.__version__, '| bitsandbytes', bitsandbytes.__version__, '| deepspeed', deepspeed.__version__, '| pytest', pytest.__version__)"
} 2>&1 | tee "$OUT/versions.txt"
for what in "$@"; do
    start=$SECONDS
    case $what in
        gpu) timeout "${GPU_TIMEOUT:-420}" python3 -m pytest -m gpu ${GPU_WORKERS:+-n $GPU_WORKERS --llmload-gpus-per-worker off} -rA -v -p no:cacheprovider --junitxml="$OUT/junit-gpu.xml" 2>&1 | tee "$OUT/gpu.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS|passed|failed" ;;
        dp) timeout 180 python3 benchmarks/gpu/dp_same_device.py 2>&1 | tee "$OUT/dp.log" | tail -5 ;;
        figures) timeout 300 python3 benchmarks/gpu/gpu_figures.py --out "$OUT/figures.json" 2>&1 | tee "$OUT/figures.log" | tail -30 ;;
        main) timeout "${MAIN_TIMEOUT:-200}" python3 -m pytest_llmload --json "$OUT/main.json" 2>&1 | tee "$OUT/main.log" | tail -25 ;;
        issue40) timeout "${ISSUE40_TIMEOUT:-480}" python3 benchmarks/gpu/issue40_figures.py --rounds "${ROUNDS:-1}" --out "$OUT/issue40.json" 2>&1 | tee "$OUT/issue40.log" | tail -30 ;;
        nccl) timeout 300 python3 benchmarks/gpu/gpu_figures.py --only-nccl --out "$OUT/nccl.json" 2>&1 | tee "$OUT/nccl.log" | tail -20 ;;
        cpu4) CUDA_VISIBLE_DEVICES= timeout "${CPU4_TIMEOUT:-400}" python3 -c 'import resource, subprocess, sys, time
start = time.perf_counter(); code = subprocess.call(sys.argv[1:]); used = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"cpu4: wall {time.perf_counter() - start:.1f} s, CPU {used.ru_utime + used.ru_stime:.1f} s, exit {code}")' \
              taskset -c 0-3 python3 -m pytest -n 4 -q -rfE -p no:cacheprovider -p no:randomly \
              --junitxml="$OUT/junit-cpu4.xml" 2>&1 | tee "$OUT/cpu4.log" | tail -30 ;;
        all) timeout "${ALL_TIMEOUT:-300}" python3 -m pytest -n 8 --llmload-gpus-per-worker off -q -rfE -p no:cacheprovider --junitxml="$OUT/junit-all.xml" 2>&1 | tee "$OUT/all.log" | tail -40 ;;
    esac
    echo "=== $what: $((SECONDS - start)) s"
done
