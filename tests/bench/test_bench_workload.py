"""Smoke runs of benchmarks/bench_workload.py and bench_capacity.py at tiny scale, in-process, into tmp
dirs: the files and metric names exist and the cached configurations reuse tokens."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

pytest.importorskip("transformers")
pytest.importorskip("asyncio_throttle")


def test_split_budget_same_bytes_more_int8_states():
    from benchmarks.workload_common import TierBytes, split_budget

    b = TierBytes(kv_page=1000, state_native=40_000, t1_lossless=40_000, t1_int8=11_000)
    t = split_budget(b, gpu_bytes=2_000_000, host_bytes=10_000_000, max_running=2, request_pages=100,
                     kv_fraction=0.5)
    assert t["no_cache"] == {"use_cache": False}
    go, i8, t2 = t["gpu_only"], t["int8_t1"], t["int8_t1_t2"]
    assert go["kv_pages"] == i8["kv_pages"] == t2["kv_pages"] and go["t0_states"] == i8["t0_states"] == 2
    # cache share 2e6 - 2 * (40e3 + 100e3) = 1.72e6: 860 KV pages; T1 gets 860e3 bytes
    assert go["kv_pages"] == 2 * 100 + 860 - 1
    assert (go["t1_states"], i8["t1_states"]) == (860_000 // 40_000 - 1, 860_000 // 11_000 - 1)
    assert t2["host_kv_pages"] == 5000 and t2["host_states"] == 5_000_000 // 11_000
    with pytest.raises(ValueError, match="running reservation"):
        split_budget(b, 100_000, 0, 2, 100, 0.5)


def test_bench_workload_tiny(tmp_path, keep_threads):
    from benchmarks.bench_workload import main

    rec = main(["--scale", "small", "--workloads", "multi_turn", "long_context_qa", "--set", "clients=2", "rounds=2",
                "--out", str(tmp_path), "--no-progress", "--repeats", "1", "--decode-graphs", "--prefill-graphs"])
    m = rec["metrics"]
    for k in ("ttft_p50_speedup_vs_nocache", "throughput_vs_nocache", "throughput_round3plus_vs_nocache",
              "hit_rate_vs_gpu_only", "ttft_p50_s_no_cache",
              "ttft_p50_s_int8_t1_t2", "requests_per_s_no_cache", "requests_per_s_int8_t1_t2", "hit_rate_gpu_only",
              "hit_rate_int8_t1_t2", "long_context_qa_hit_rate_vs_gpu_only", "fla_used"):
        assert k in m, k
    for wl in ("multi_turn", "long_context_qa"):
        assert m[f"{wl}_no_cache_prefill_tokens_saved"] == 0
        for cfg in ("gpu_only", "int8_t1", "int8_t1_t2"):
            assert m[f"{wl}_{cfg}_prefill_tokens_saved"] > 0, (wl, cfg)
            assert m[f"{wl}_{cfg}_hit_rate"] > 0
        assert os.path.exists(tmp_path / f"workload-{wl}-cpu.png")
    assert m["multi_turn_int8_t1_t2_pcie_bytes"] > 0 and m["multi_turn_gpu_only_pcie_bytes"] == 0
    assert os.path.exists(tmp_path / "workload-cpu.md")
    gd = rec["info"]["workloads"]["multi_turn"]["graph_decoder"]  # eager static steps on CPU
    assert all(g["steps"] > 0 and g["replays"] == 0 and g["capture_error"] is None for g in gd.values())
    info = json.load(open(tmp_path / "workload-cpu.json"))["info"]
    assert info["gated_delta"] and info["decode_graphs_flag"] and not info["decode_batch_flag"]
    assert info["undefined_ratios"] == {}  # (2) reused tokens in both workloads: every ratio has a value
    # the chunk rule on padded static buffers: every prefill call taken, and exact against eager on CPU
    gp = rec["info"]["workloads"]["multi_turn"]["graph_prefill"]
    assert info["prefill_graphs_flag"] and all(g["calls"] > 0 and g["eager"] == 0 for g in gp.values())
    assert m["prefill_graph_out_max_abs_diff"] == 0 and m["prefill_graph_state_max_abs_diff"] == 0


def test_bench_capacity_tiny(tmp_path):
    from benchmarks.bench_capacity import main

    path = main(["--requests", "150", "--warm", "100", "--active", "32", "--gpu-gib", "4", "--ratio-at", "4", "8",
                 "--host-gib", "64", "16", "--host-sweep-gpu", "4", "--out", str(tmp_path), "--no-progress"])
    rec = json.load(open(path))
    m = rec["metrics"]
    for g in ("4", "8"):
        assert m[f"hit_rate_vs_gpu_only_{g}GiB"] >= 1.0
        assert m[f"hit_rate_gpu_only_gpu{g}"] > 0
    assert m["hit_rate_int8_t1_t2_gpu4_host16"] > 0
    assert {r["sweep"] for r in rec["rows"]} == {"gpu", "host"}
    assert os.path.exists(path[:-5] + ".md") and os.path.exists(tmp_path / "capacity-cpu.png")


def test_steady_throughput_counts_what_finished_after_round_3_began():
    from benchmarks.bench_workload import steady_throughput
    from benchmarks.workload_common import Finished

    def f(rnd, sent, done):
        return Finished(0, rnd, 1, {}, [], sent, done)

    # round 3 (index 2) first sent at t=4; after it 4 requests of any round finish, the last at t=8: 4 / 4 s
    turns = [f(0, 0, 2), f(1, 2, 5), f(2, 4, 6), f(2, 4.5, 7), f(3, 6, 8), f(0, 0, 3.9)]
    assert steady_throughput(turns) == 4 / 4
    # no round 3: the whole run, from t=0
    assert steady_throughput([f(0, 1, 3), f(1, 2, 5)]) == 2 / 5
    assert steady_throughput([]) == 0.0


def test_arrivals_keep_their_rate_while_steps_block_the_loop():
    """The sender's Poisson clock runs apart from the engine's steps: with 30 ms steps and 1 ms mean gaps,
    20 single-round clients are all due within about 20 ms, each stamped (as its arrival) with its due
    time, not with when the blocked loop let it through; the ones due during a step count that wait."""
    import time

    from benchmarks.workload_common import ClientPlan, drive

    class SlowEngine:  # finishes every request one step after it is submitted; a step takes 30 ms
        def __init__(self):
            self.queue, self.log = [], []

        def submit(self, req, arrival=None):
            self.log.append((req.rid, arrival, time.perf_counter()))
            self.queue.append(req)

        def has_work(self):
            return bool(self.queue)

        def step(self):
            time.sleep(0.03)
            done, self.queue = self.queue, []
            return done

    clients = [ClientPlan(c, [1, 2], [[3]], [[4]], True) for c in range(20)]
    eng, turns = SlowEngine(), []
    t0 = time.perf_counter()
    drive(eng, clients, {"request_rate": 1000.0, "max_parallel": 64, "max_new_tokens": 1, "seed": 0}, turns.append)
    assert len(turns) == 20 and len(eng.log) == 20
    sent = sorted(t.submitted_s for t in turns)
    wall = time.perf_counter() - t0
    assert sent[-1] < 0.2, (sent, wall)  # one request per 30 ms step would take >= 0.57 s
    assert all(a <= s for _, a, s in eng.log)  # a stamp is never after the hand-over
    assert sum(s - a > 0.01 for _, a, s in eng.log) >= 10  # most waited for a step to end
    assert [a - eng.log[0][1] for _, a, _ in eng.log] == pytest.approx([s - sent[0] for s in sent], abs=1e-9)


def test_ratios_of_the_configurations_that_ran():
    from benchmarks.bench_workload import ratios

    def cfg(ttft, rps, hit):
        return {"ttft_p50_s": ttft, "ttft_p50_round3plus_s": ttft, "requests_per_s": rps,
                "requests_per_s_round3plus": rps, "hit_rate": hit}

    s = {"no_cache": cfg(2.0, 1.0, 0.0), "int8_t1_t2": cfg(0.5, 3.0, 0.8)}
    r = ratios(s)
    assert r["ttft_p50_speedup_vs_nocache"] == 4.0 and r["throughput_round3plus_vs_nocache"] == 3.0
    assert "hit_rate_vs_gpu_only" not in r  # (2) did not run
    r = ratios(dict(s, gpu_only=cfg(1.0, 1.5, 0.0), int8_t1=cfg(1.0, 1.5, 0.2)))
    assert r["hit_rate_vs_gpu_only"] is None and r["hit_rate_gpu_only"] == 0.0  # no hits in (2): undefined
    assert r["hit_rate_gain_vs_gpu_only"] == 0.8  # ... where the gain is defined
    from benchmarks.bench_workload import undefined_ratios

    assert undefined_ratios([{"name": "mt", "ratios": r}]) == {
        "mt_hit_rate_vs_gpu_only": {"numerator": 0.8, "denominator": 0.0},
        "mt_int8_hit_rate_vs_gpu_only": {"numerator": 0.2, "denominator": 0.0}}
    r = ratios(dict(s, gpu_only=cfg(1.0, 1.5, 0.2)))
    assert r["hit_rate_vs_gpu_only"] == 4.0 and abs(r["hit_rate_gain_vs_gpu_only"] - 0.6) < 1e-12
    assert ratios({"no_cache": s["no_cache"]}) == {}


def test_bench_workload_rate_sweep(tmp_path, keep_threads):
    from benchmarks.bench_workload import main

    rec = main(["--scale", "small", "--workloads", "multi_turn", "--set", "clients=2", "rounds=3",
                "--configs", "no_cache", "int8_t1_t2", "--rates", "0", "40", "--out", str(tmp_path), "--no-progress",
                "--repeats", "1"])
    m = rec["metrics"]
    for r in ("0", "40"):
        assert m[f"multi_turn_rate{r}_throughput_round3plus_vs_nocache"] > 0
        assert m[f"multi_turn_rate{r}_int8_t1_t2_hit_rate"] > 0 == m[f"multi_turn_rate{r}_no_cache_hit_rate"]
        assert f"multi_turn_rate{r}_gpu_only_hit_rate" not in m  # not among --sweep-configs
    assert sum(row["workload"].startswith("multi_turn @") for row in rec["rows"]) == 4
    assert os.path.exists(tmp_path / "workload-multi_turn-rates-cpu.png")
    # plot_results.py redraws the curve from the file alone: the sweep's rates plus the main run's
    from benchmarks.bench_workload import sweep_from_record
    from benchmarks.plot_results import plot_workload_rates

    res = sweep_from_record(json.load(open(tmp_path / "workload-cpu.json")), "multi_turn")
    assert [p["rate"] for p in res["sweep"]] == [0.0, 40.0] and set(res["summary"]) == {"no_cache", "int8_t1_t2"}
    for p in res["sweep"]:
        got = p["summary"]["int8_t1_t2"]["requests_per_s_round3plus"]
        assert got == m[f"multi_turn_rate{p['rate']:g}_int8_t1_t2_requests_per_s_round3plus"]
    os.remove(tmp_path / "workload-multi_turn-rates-cpu.png")
    assert plot_workload_rates(rec, str(tmp_path / "workload-cpu.json")) == [
        str(tmp_path / "workload-multi_turn-rates-cpu.png")]
    assert os.path.exists(tmp_path / "workload-multi_turn-rates-cpu.png")


def test_bench_workload_timeline(tmp_path, keep_threads):
    from benchmarks.bench_workload import main

    main(["--scale", "small", "--workloads", "multi_turn", "--set", "clients=2", "rounds=2", "--configs", "no_cache",
          "int8_t1_t2", "--timeline", str(tmp_path / "tl"), "--out", str(tmp_path), "--no-progress",
          "--repeats", "1"])
    for c in ("no_cache", "int8_t1_t2"):
        tl = json.load(open(tmp_path / "tl" / f"timeline-multi_turn-{c}.json"))
        assert len(tl["turns"]) == 4 and sum(s["finished"] for s in tl["steps"]) == 4
        assert all(t["due_s"] <= t["finished_s"] and t["ttft_s"] > 0 for t in tl["turns"])
        starts = [s["start_s"] for s in tl["steps"]]
        assert starts == sorted(starts) and all(s["length_s"] > 0 for s in tl["steps"])
        assert any(s["running"].get("prefill") for s in tl["steps"])
