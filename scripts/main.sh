#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run `python -m tiered_cache demo` (args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh engine
exec "${PYTHON:-python3}" -m tiered_cache "${@:-demo}"
