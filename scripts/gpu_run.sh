#!/usr/bin/env bash
# One call on the GPU machine: the GPU tests (also under the CUDA sanitizer), then the benchmarks.
# Results land in $OUT/results (copy them into benchmarks/results/ to commit); the log in $OUT/log.txt.
# Usage: bash scripts/gpu_run.sh [bench ...]   (default: pool kernels transfer)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/tiered-cache-out}
mkdir -p "$OUT/results"
LOG=$OUT/log.txt
benches=${*:-pool kernels transfer}
TESTS=${TESTS:-tests}  # which test paths to run (default: all)
{
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "== pytest -m gpu"
  python3 -m pytest -m gpu -q -p no:cacheprovider $TESTS 2>&1 | tail -40
  echo "== pytest -m gpu under TORCH_CUDA_SANITIZER=1 (transfer, host tier and SWA tests)"
  TORCH_CUDA_SANITIZER=1 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_transfer.py tests/test_radix_host.py tests/test_radix_swa.py > "$OUT/sanitizer.txt" 2>&1
  grep -E "CSAN|passed|failed" "$OUT/sanitizer.txt" | head -20
  for b in $benches; do
    echo "== bench_$b"
    timeout 330 python3 "benchmarks/bench_$b.py" --out "$OUT/results" 2>&1 | tail -40
  done
} 2>&1 | tee "$LOG"
