"""``bench_kernels.py --parts host`` (the T1 path's host work with the launch stubbed, CPU) runs, checks each call's
ids before timing, and labels its file a CPU emulation, never a GPU number."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tiered_cache.kernels import launch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"


def test_host_part_times_each_call_through_the_bound_path(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_kernels_host", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    getters, fast = launch._driver_getters, launch.stats["fast"]
    rec = module.main(["--parts", "host", "--small", "--states", "1", "3", "--dtypes", "fp32", "--reps", "1",
                       "--out", str(tmp_path)])
    assert launch._driver_getters is getters  # put back
    assert launch.stats["fast"] - fast >= 2 * 4 * 3 * 400  # every timed call took the bound path
    data = json.loads((tmp_path / "kernels-host-cpu.json").read_text())
    assert data == json.loads(json.dumps(rec)) and "emulation" in data["device"] and "stubbed" in data["device"]
    for op in ("store", "load", "store_rows", "load_rows"):
        for n in (1, 3):
            key = f"host_{op}_fp32_n{n}_us"
            assert 0 < data["metrics"][key + "_min"] <= data["metrics"][key] <= data["metrics"][key + "_max"]
    assert "| store | fp32 | 3 |" in (tmp_path / "kernels-host-cpu.md").read_text()
