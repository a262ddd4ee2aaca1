#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests (also under the CUDA sanitizer), then the benchmarks.
# Results land in $OUT/results (copy them into benchmarks/results/ to commit); the log in $OUT/log.txt.
# Usage: bash scripts/gpu_run.sh [bench ...]   (default: pool kernels transfer)
#   Results record TIERED_CACHE_COMMIT when set: set it from your own checkout (the device copy's .git
#   may be stale; on 2026-11-30 it reported an older commit than the files that ran).
#   bench "workload" runs bench_workload.py with $WORKLOAD_ARGS (default: the full-scale multi-turn
#   workload, decoding through CUDA graphs; --decode-batch instead for eager batched decode; add e.g.
#   "--rates 4 8 12" for TTFT and throughput against the arrival rate, about 60 s per rate) and, when
#   .whl/ holds the flash-linear-attention wheels (carry .whl), installs them for that benchmark only:
#   the tests keep transformers' fp32 torch gated delta. bench_workload also needs asyncio-throttle (its
#   Poisson arrival clock), which the GPU machine cannot download: put its wheel in .whl/ beside the
#   flash-linear-attention ones (pip download asyncio-throttle -d .whl); without it the benchmark is skipped
#   with that message. WORKLOAD_TIMEOUT: its time limit in seconds (default 540; bench_workload serves each
#   configuration once untimed before timing it, about twice the time of a run without: add --no-warm-each
#   to WORKLOAD_ARGS where it would not fit, and order effects then remain).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tiered-cache-out}
mkdir -p "$OUT/results"
LOG=$OUT/log.txt
benches=${*:-pool kernels transfer}
TESTS=${TESTS:-tests}  # which test paths to run (default: all)
SKIP_TESTS=${SKIP_TESTS:-0}  # 1: benchmarks only (the tests ran in an earlier call on the same tree)
WORKLOAD_ARGS=${WORKLOAD_ARGS:---scale full --workloads multi_turn --decode-graphs --prefill-graphs --no-progress}
{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  if [ "$SKIP_TESTS" != 1 ]; then
    echo "== pytest -m gpu"
    # shellcheck disable=SC2086
    python3 -m pytest -m gpu -q -p no:cacheprovider $TESTS 2>&1 | tail -40
    echo "== pytest -m gpu under TORCH_CUDA_SANITIZER=1 (transfer, host tier and SWA tests)"
    TORCH_CUDA_SANITIZER=1 python3 -m pytest -m gpu -q -p no:cacheprovider tests/transfer/test_transfer.py \
      tests/radix/test_radix_host.py tests/radix/test_radix_swa.py > "$OUT/sanitizer.txt" 2>&1
    grep -E "CSAN|passed|failed" "$OUT/sanitizer.txt" | head -20
  fi
  for b in $benches; do
    echo "== bench_$b"
    if [ "$b" = workload ]; then
      site=$PYTHONPATH
      if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
          && site=/tmp/site:$PYTHONPATH
      fi
      if ! PYTHONPATH=$site python3 -c "import asyncio_throttle" >/dev/null 2>&1; then
        echo "bench_workload needs asyncio-throttle: put its wheel in .whl/ beside the flash-linear-attention wheels (skipped)"
        continue
      fi
      # shellcheck disable=SC2086
      PYTHONPATH=$site timeout "${WORKLOAD_TIMEOUT:-540}" python3 benchmarks/bench_workload.py $WORKLOAD_ARGS --out "$OUT/results" 2>&1 | tail -40
      continue
    fi
    timeout 330 python3 "benchmarks/bench_$b.py" --out "$OUT/results" 2>&1 | tail -40
  done
} 2>&1 | tee "$LOG"
