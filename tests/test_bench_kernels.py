"""Smoke run of benchmarks/bench_kernels.py at tiny size (CPU: the Triton interpreter), so the script the
H200 run depends on cannot rot. Writes into a temporary folder, never over committed results."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_kernels.py"
NAMED = [f"{op}_{dt}_{what}" for dt in ("fp32", "bf16") for op in ("store", "load")
         for what in ("GBps", "vs_torch", "vs_copy")] + ["states_per_GiB_int8_vs_fp32"]


def test_bench_kernels_small(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_kernels", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = module.main(["--small", "--states", "2", "--reps", "1", "--out", str(tmp_path)])
    name = f"kernels-{record['dev_short']}"
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert data["bench"] == "kernels" and set(NAMED) <= set(data["metrics"])
    assert all(v > 0 for v in data["metrics"].values())
    assert "store_fp32_GBps" in (tmp_path / f"{name}.md").read_text()
