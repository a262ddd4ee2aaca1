#!/usr/bin/env bash
# Installs the package and the extras named in $1 (default: test) into the current Python.
# On a machine without torch it first takes torch 2.13.0: on the CPU machines that is the CPU wheel
# lying on disk; a bare `torch` requirement would download a multi-GB CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
extras=${1:-test}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[${extras}]"
# The SGLang integration tests (tests/integrations/sglang/): SGLang 0.5.23 with --no-deps (its own pins
# would pull CUDA torch and sglang-kernel) plus the small packages its cache modules import, all pinned
# in constraints/sglang-test.txt. SGLang needs Python >= 3.11; on 3.10 those tests skip.
if [[ ",${extras}," == *",test,"* ]] && "$PY" -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
    "$PY" -m pip install -q --no-deps -r constraints/sglang-test.txt
fi
