"""bench_workload's run order at tiny scale: the warm pass serves every timed run's requests once, untimed,
before any timed run (and ``--no-warm-each`` turns it off), and the timed runs rotate between repeats in
the order the JSON says they ran."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

pytest.importorskip("transformers")
pytest.importorskip("asyncio_throttle")

TRACE = [{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
         {"timestamp": 500, "input_length": 1600, "output_length": 2, "hash_ids": [0, 1, 3, 4]},
         {"timestamp": 1000, "input_length": 600, "output_length": 4, "hash_ids": [0, 5]}]


def test_rotated_puts_each_run_first_once_in_n_repeats():
    from benchmarks.workload_common import rotated

    keys = ["a", "b", "c", "d", "e"]
    orders = [rotated(keys, r) for r in range(2 * len(keys))]
    assert all(sorted(o) == keys for o in orders)
    assert [o[0] for o in orders[:5]] == keys and orders[5:] == orders[:5]
    assert orders[1] == ["b", "c", "d", "e", "a"] and orders[4] == ["e", "a", "b", "c", "d"]
    assert rotated([], 3) == [] and keys == ["a", "b", "c", "d", "e"]  # the input is left as it was


def test_ratio_sides_speedup_is_base_over_top_and_gain_top_over_base():
    from benchmarks.workload_common import ratio_sides

    assert ratio_sides("speedup", 1.0, 4.0) == (4.0, 1.0) and ratio_sides("gain", 1.0, 4.0) == (1.0, 4.0)
    assert ratio_sides("speedup", "ttft_top", "ttft_base") == ("ttft_base", "ttft_top")
    with pytest.raises(ValueError, match="kind: expected 'speedup' or 'gain', got 'ratio'"):
        ratio_sides("ratio", 1.0, 2.0)


RUNS = {"no_cache": "(1) no cache", "int8_t1_t2": "(4) + T2 host", "int8_t1_t2_lru": "(4) + T2 host [lru]",
        "int8_t1_t2_tiered": "(4) + T2 host [tiered]"}


def run_logged(monkeypatch, argv: list[str]) -> tuple[dict, list[tuple]]:
    """``main(argv)`` with every engine run logged: (label, requests served, eviction policy or None)."""
    from benchmarks import bench_workload as bw

    calls: list[tuple] = []
    real = bw.run_config

    def logged(model, ecfg, drive, total, label, *a, **kw):
        st = real(model, ecfg, drive, total, label, *a, **kw)
        calls.append((label, len(st["turns"]), ecfg.cache.eviction_policy if ecfg.use_cache else None))
        return st

    monkeypatch.setattr(bw, "run_config", logged)
    return bw.main(argv), calls


@pytest.mark.parametrize("warm_each", [True, False])
def test_warm_pass_runs_each_timed_run_once_and_the_order_rotates(tmp_path, keep_threads, monkeypatch, warm_each):
    rec, calls = run_logged(monkeypatch, [
        "--scale", "small", "--workloads", "multi_turn", "--set", "clients=2", "rounds=2", "--repeats", "3",
        "--configs", "no_cache", "int8_t1_t2", "--eviction-policies", "lru", "tiered", "--out", str(tmp_path),
        "--no-progress"] + ([] if warm_each else ["--no-warm-each"]))
    info = rec["info"]["workloads"]["multi_turn"]
    orders = info["repeat_orders"]
    keys = list(RUNS)
    assert orders == [keys, keys[1:] + keys[:1], keys[2:] + keys[:2]]
    timed = [(f"multi_turn {RUNS[k]} #{r + 1}", 4) for r, o in enumerate(orders) for k in o]
    assert [c[:2] for c in calls[-len(timed):]] == timed  # the timed runs ran in the order the JSON gives
    before = calls[:-len(timed)]
    if warm_each:  # each timed run once, the whole workload (4 requests), its own policy, before any timed run
        assert [c[:2] for c in before] == [(f"multi_turn {RUNS[k]} (warm pass)", 4) for k in keys]
        assert [c[2] for c in before] == [None, "lru", "lru", "tiered"]
        assert sorted(info["warm_pass_s"]) == sorted(keys) and all(v > 0 for v in info["warm_pass_s"].values())
    else:  # only the per-model warm-up through (4): two requests at once, twice
        assert [c[:2] for c in before] == [("warm-up", 4)] and info["warm_pass_s"] == {}
    assert rec["metrics"]["warm_each"] == float(warm_each) and rec["info"]["warm_each"] is warm_each
    rows = {r["config"]: r["order"] for r in rec["rows"]}
    assert rows == {RUNS[k]: ",".join(str(o.index(k) + 1) for o in orders) for k in keys}
    assert rows["(1) no cache"] == "1,4,3" and rows["(4) + T2 host [tiered]"] == "4,3,2"
    with open(tmp_path / "workload-cpu.json") as f:
        assert json.load(f)["info"]["workloads"]["multi_turn"]["repeat_orders"] == orders
    md = (tmp_path / "workload-cpu.md").read_text()
    assert ("Warm pass (warm_each true)" in md) is warm_each
    assert ("warm_each false, --no-warm-each" in md) is not warm_each


def test_warm_pass_serves_the_whole_trace_window_after_the_calibration(tmp_path, keep_threads, monkeypatch):
    with open(tmp_path / "t.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in TRACE)
    rec, calls = run_logged(monkeypatch, [
        "--scale", "small", "--trace", str(tmp_path / "t.jsonl"), "--trace-block", "16", "--trace-max-blocks", "4",
        "--repeats", "2", "--configs", "no_cache", "int8_t1", "--out", str(tmp_path), "--no-progress"])
    orders = rec["info"]["workloads"]["mooncake"]["repeat_orders"]
    assert orders == [["no_cache", "int8_t1"], ["int8_t1", "no_cache"]]
    labels = {"no_cache": "(1) no cache", "int8_t1": "(3) + int8 T1"}
    # (1)'s capacity first (two passes, the first compiling), then each run's warm pass over all 3 requests
    assert [c[:2] for c in calls] == (
        [("capacity (1)", 3)] * 2 + [(f"mooncake {labels[k]} (warm pass)", 3) for k in orders[0]]
        + [(f"mooncake {labels[k]} #{r + 1}", 3) for r, o in enumerate(orders) for k in o])
