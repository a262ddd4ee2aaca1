#!/usr/bin/env bash
# The main job on a fresh machine: set up, then run `python -m tiered_cache stress` (args pass through:
# `bash scripts/main.sh stress --clients 32`, or `bash scripts/main.sh demo` for the T0 tour).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh engine
exec "${PYTHON:-python3}" -m tiered_cache "${@:-stress}"
