#!/usr/bin/env bash
# The test command on a fresh machine: set up, lint (ruff), type-check (mypy), run every test (args go to pytest).
# GPU tests skip where CUDA is absent; on CPU Triton kernels run in the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
PY=${PYTHON:-python3}
"$PY" -m ruff check .
"$PY" -m mypy  # files and settings: [tool.mypy] in pyproject.toml
exec "$PY" -m pytest -q "$@"
