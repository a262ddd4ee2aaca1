"""bench_sass: the T1 kernels compiled for sm_90 on the CPU, and the structure the pool's code order claims.

The pool's code order since 4623ffd says a ``[d_k, d_v]`` state's store needs no shared-memory transpose: it shows
in the compiled code (shared bytes, instructions), whatever a GPU would time. The script runs in its own
process: the tests' Triton interpreter (``TRITON_INTERPRET=1``) compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks import bench_sass  # noqa: E402

if not os.path.exists(bench_sass._nvdisasm()):
    pytest.skip("this triton wheel carries no nvdisasm (bench_sass reads the SASS with it)", allow_module_level=True)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("sass")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_sass.py"), "--quick", "--out", str(out)],
                   check=True, env=env, cwd=ROOT, capture_output=True, timeout=600)
    record = json.load(open(out / "sass-cpu.json"))
    assert (out / "sass-cpu.md").exists()
    got = {r["kernel"]: r for r in record["rows"]}
    for name, r in got.items():
        assert record["metrics"][f"{name}_instructions"] == r["instructions"] > 0
        assert 0 < r["registers"] <= 255 and r["programs_per_sm"] >= 1
    return got


def test_programs_per_sm_by_registers():
    assert bench_sass.programs_per_sm(123, 4) == 4  # 128 a thread: 16,384 a program of 4 warps
    assert bench_sass.programs_per_sm(96, 4) == 5
    assert bench_sass.programs_per_sm(32, 4) == 16  # 64 warps a SM at most
    assert bench_sass.programs_per_sm(16, 1) == 32  # 32 programs a SM at most


def test_every_layout_and_dtype_is_compiled(rows):
    for dt in ("fp32", "bf16"):
        for lay in ("va1", "va2", "va2q"):
            assert any(k.startswith(f"store_{dt}_{lay}_") for k in rows)
            assert any(k.startswith(f"load_{dt}_{lay}_") for k in rows)


def _one(rows, prefix):
    (row,) = [r for k, r in rows.items() if k.startswith(prefix)]
    return row


def test_codes_in_the_states_order_need_no_transpose(rows):
    for dt in ("fp32", "bf16"):
        transposed, own = _one(rows, f"store_{dt}_va2_"), _one(rows, f"store_{dt}_va2q_")
        assert transposed["shared_bytes"] >= 8192  # the whole tile through shared memory
        assert own["shared_bytes"] <= 256
        assert own["instructions"] < transposed["instructions"]
