#!/usr/bin/env bash
# SGLang 0.5.23's Python cache modules on a machine with no registry (the GPU machine: Python 3.12,
# torch 2.11 + CUDA, no network), from the folder .sgl/ at the repository root (ignored by git, carried
# to the machine). The folder holds
#   .sgl/sglang-0.5.23-py.tar.xz  SGLang's wheel (cp311 only) less its five rust .so files (nothing that
#                                 tests/integrations/sglang imports loads one), as sglang/ + its dist-info;
#   .sgl/wheels/*.whl             cp312 manylinux x86-64 (or pure) wheels of each package of
#                                 constraints/sglang-test.txt that the GPU image lacks, plus pydantic,
#                                 pydantic-core, annotated-types and typing-inspection (image lacks them too).
# (With CUDA present sglang.srt.layers.quantization imports sgl_kernel at module level: the SGLang tests'
# conftest installs tests/support/sgl_kernel_stub.py for it, so a plain pytest run needs nothing more.)
# `scripts/sglang_env.sh --build` makes the folder here (needs PyPI); see build() for the list.
#
# Usage:  export PYTHONPATH="$(bash scripts/sglang_env.sh [DIR])${PYTHONPATH:+:$PYTHONPATH}"
# Installs the wheels with `pip install --no-index --no-deps --target DIR` and unpacks SGLang into DIR
# (default /tmp/sgl-site), then prints DIR, the only line on stdout; everything else goes to stderr.
# Idempotent: a second run with the same folder and Python prints DIR and installs nothing.
# PYTHON picks the interpreter (default python3); it must be the one that runs the tests.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SGL="${SGL_DIR:-$ROOT/.sgl}"
PY="${PYTHON:-python3}"
TARBALL="sglang-0.5.23-py.tar.xz"

log() { echo "sglang_env: $*" >&2; }

build() {
    # Python 3.12 wheels for the GPU machine; one version of each (two would stop the install there).
    local wheels=(apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 dill==0.4.1 distro==1.9.0 gguf==0.19.0
        ipython==9.18.1 loguru==0.7.3 msgspec==0.23.0 openai==2.8.0 orjson==3.13.0
        partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pyzmq==27.3.0 sniffio==1.3.1 starlette==1.10.0
        traitlets==5.16.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5)
    local tmp
    tmp="$(mktemp -d)"
    mkdir -p "$SGL/wheels"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
        -d "$SGL/wheels" "${wheels[@]}"
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" sglang==0.5.23
    (cd "$tmp" && mkdir x && cd x && "$PY" -m zipfile -e ../sglang-0.5.23-*.whl . \
        && find . -name '*.so' -delete && rm -f sglang-0.5.23.dist-info/RECORD \
        && tar -cJf "$SGL/$TARBALL" sglang sglang-0.5.23.dist-info)
    rm -rf "$tmp"
    du -sh "$SGL" >&2
}

if [[ "${1:-}" == "--build" ]]; then
    build
    exit 0
fi

DIR="${1:-/tmp/sgl-site}"
if [[ ! -f "$SGL/$TARBALL" ]] || ! compgen -G "$SGL/wheels/*.whl" >/dev/null; then
    log "no SGLang bundle at $SGL (want $TARBALL and wheels/*.whl)."
    log "make it on a machine with PyPI: bash scripts/sglang_env.sh --build; then carry .sgl to this one"
    log "(device call: carry [\".sgl\"])."
    exit 1
fi
pyver="$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ "$pyver" != "3.12" ]]; then
    log "warning: the wheels in $SGL/wheels are for Python 3.12; $PY is $pyver"
fi

# The stamp names the bundle's files (name, size, mtime) and the interpreter.
stamp="$( (cd "$SGL" && ls -l --time-style=+%s "$TARBALL" wheels/) | awk '{print $5, $6, $7}'; echo "$pyver")"
if [[ -f "$DIR/.sgl-stamp" ]] && [[ "$(cat "$DIR/.sgl-stamp")" == "$stamp" ]]; then
    log "already installed in $DIR"
    echo "$DIR"
    exit 0
fi

if [[ -e "$DIR" && ! -f "$DIR/.sgl-stamp" ]] && [[ -n "$(ls -A "$DIR" 2>/dev/null)" ]]; then
    log "$DIR exists, is not empty and was not made by this script: give another DIR"
    exit 1
fi
rm -rf "$DIR"  # an older install of this script's (stamp differs), or empty
mkdir -p "$DIR"
log "installing $(ls "$SGL"/wheels/*.whl | wc -l) wheels into $DIR"
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --target "$DIR" "$SGL"/wheels/*.whl >&2
log "unpacking $TARBALL"
# Python's tarfile, not tar: the machine may lack xz.
"$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$SGL/$TARBALL" "$DIR"
echo "$stamp" >"$DIR/.sgl-stamp"
echo "$DIR"
