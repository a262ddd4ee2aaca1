"""Smoke run of benchmarks/bench_kernels.py at tiny size (CPU: the Triton interpreter), so the script the
H200 run depends on cannot rot. Writes into a temporary folder, never over committed results."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"
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


def test_bench_decode_attention_small(tmp_path):
    """The decode-attention benchmark checks every method against fp64 attention before timing it."""
    from benchmarks.bench_decode_attention import main

    rec = main(["--batch", "2", "--width", "64", "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--reps", "1",
                "--out", str(tmp_path)])
    m = rec["metrics"]
    assert {"repeat_kv_ms", "packed_sdpa_ms", "gqa_sdpa_ms", "gqa_sdpa_speedup_vs_repeat_kv"} <= set(m)
    assert all(m[f"{n}_max_abs_err"] < 1e-4 for n in ("repeat_kv", "packed_sdpa", "gqa_sdpa"))
    assert os.path.exists(rec["path"]) and os.path.exists(rec["path"][:-5] + ".md")
