"""bench_workload's --eviction-policies at tiny scale: each policy's runs exist, the engine's tree really
ran that policy and its admission, and the ratios against LRU are null (and listed as undefined) when a
side is missing."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

pytest.importorskip("transformers")
pytest.importorskip("asyncio_throttle")


TRACE = [{"timestamp": 0, "input_length": 1100, "output_length": 300, "hash_ids": [0, 1, 2]},
         {"timestamp": 500, "input_length": 1600, "output_length": 2, "hash_ids": [0, 1, 3, 4]},
         {"timestamp": 1000, "input_length": 600, "output_length": 40, "hash_ids": [0, 5]},
         {"timestamp": 3000, "input_length": 2048, "output_length": 9, "hash_ids": [0, 1, 3, 6]}]


def summary(rps: float, ttft: float, hit: float) -> dict:
    return {"requests_per_s": rps, "requests_per_s_round3plus": rps, "ttft_p50_s": ttft,
            "ttft_p50_round3plus_s": ttft, "hit_rate": hit}


def test_policy_ratios_against_lru_and_null_when_a_side_is_missing():
    from benchmarks.bench_workload import aggregate, policy_ratios, undefined_ratios

    s = {"int8_t1_t2_lru": summary(2.0, 0.4, 0.5), "int8_t1_t2_tiered": summary(3.0, 0.1, 0.6),
         "gpu_only_tiered": summary(1.0, 0.2, 0.3)}
    r = policy_ratios(s, ["int8_t1_t2", "gpu_only"], ["lru", "tiered"])
    assert r["throughput_tiered_vs_lru"] == r["int8_t1_t2_throughput_tiered_vs_lru"] == 1.5
    assert r["ttft_p50_speedup_tiered_vs_lru"] == 4.0 and r["hit_rate_tiered_vs_lru"] == pytest.approx(1.2)
    assert r["requests_per_s_int8_t1_t2_tiered"] == 3.0 and "throughput_lru_vs_lru" not in r
    # gpu_only has no LRU run: its ratios are null, and so is every ratio when lru was not asked for
    assert r["gpu_only_throughput_tiered_vs_lru"] is None and r["gpu_only_ttft_p50_speedup_tiered_vs_lru"] is None
    none = policy_ratios({k: v for k, v in s.items() if "lru" not in k}, ["int8_t1_t2"], ["tiered"])
    assert none["throughput_tiered_vs_lru"] is None and none["ttft_p50_speedup_tiered_vs_lru"] is None
    # a zero denominator is undefined too; a side that fell back is refused (invalid), not undefined
    zero = policy_ratios({**s, "int8_t1_t2_lru": summary(0.0, 0.4, 0.0)}, ["int8_t1_t2"], ["lru", "tiered"])
    assert zero["throughput_tiered_vs_lru"] is None and zero["ttft_p50_speedup_tiered_vs_lru"] == 4.0
    fell = policy_ratios(s, ["int8_t1_t2"], ["lru", "tiered"], fell_back={"int8_t1_t2_tiered": "capture"})
    assert fell["throughput_tiered_vs_lru"] is None and "int8_t1_t2_throughput_tiered_vs_lru" in fell["invalid"]
    res = {"name": "w", "ratios": aggregate([r]), "policies": {"configs": ["int8_t1_t2", "gpu_only"],
                                                               "policies": ["lru", "tiered"]}}
    und = undefined_ratios([res])
    assert und["w_gpu_only_throughput_tiered_vs_lru"] == {"numerator": 1.0, "denominator": None}
    assert not any(k.startswith("w_int8_t1_t2") for k in und)
    res_fell = {"name": "w", "ratios": aggregate([fell]), "policies": {"configs": ["int8_t1_t2"],
                                                                       "policies": ["lru", "tiered"]}}
    assert undefined_ratios([res_fell]) == {}


def test_eviction_policies_through_the_engine(tmp_path, keep_threads):
    from benchmarks.bench_workload import main
    from benchmarks.workload_common import LABELS

    rec = main(["--scale", "small", "--workloads", "multi_turn", "--set", "clients=2", "rounds=2", "--repeats", "2",
                "--configs", "no_cache", "--eviction-policies", "lru", "tiered", "marconi", "--out", str(tmp_path),
                "--no-progress"])
    m = rec["metrics"]
    for pol in ("lru", "tiered", "marconi"):
        assert m[f"multi_turn_int8_t1_t2_{pol}_prefill_tokens_saved"] > 0, pol
        assert m[f"multi_turn_int8_t1_t2_{pol}_requests_per_s"] > 0 and f"multi_turn_int8_t1_t2_{pol}_ttft_p50_s" in m
    for pol in ("tiered", "marconi"):
        for k in (f"throughput_{pol}_vs_lru", f"ttft_p50_speedup_{pol}_vs_lru"):
            assert m[k] == m[f"multi_turn_{k}"] == m[f"multi_turn_int8_t1_t2_{k}"], k
            assert m[f"{k}_min"] <= m[k] <= m[f"{k}_max"] and m[k] > 0, k
    assert "throughput_lru_vs_lru" not in m and "throughput_vs_nocache" not in m  # (4) itself did not run
    ran = rec["info"]["workloads"]["multi_turn"]["policies"]["cache_policy"]
    assert {k: (v["eviction_policy"], v["policy_class"], v["state_admission"]) for k, v in ran.items()} == {
        "int8_t1_t2_lru": ("lru", "CountingLRUPolicy", "chunk"),
        "int8_t1_t2_tiered": ("tiered", "TieredPolicy", "leaf_branch"),
        "int8_t1_t2_marconi": ("marconi", "MarconiPolicy", "leaf_branch")}
    assert ran["int8_t1_t2_marconi"]["tuned_value"] == 1.0  # too few requests for a tuning window
    rows = {r["config"] for r in rec["rows"]}
    assert rows == {LABELS["no_cache"], *(f"{LABELS['int8_t1_t2']} [{p}]" for p in ("lru", "tiered", "marconi"))}
    info = json.load(open(tmp_path / "workload-cpu.json"))["info"]
    assert info["eviction_policies"] == ["lru", "tiered", "marconi"] and info["policy_configs"] == ["int8_t1_t2"]


def test_eviction_policies_on_a_trace_with_block_admission(tmp_path, keep_threads):
    """With --trace and --admission block: LRU and ours keep the blocks, Marconi its leaf and branch points."""
    from benchmarks.bench_workload import main
    with open(tmp_path / "t.jsonl", "w") as f:  # two conversations sharing blocks 0 and 1, a third block 0
        for ln in TRACE:
            f.write(json.dumps(ln) + "\n")
    rec = main(["--scale", "small", "--trace", str(tmp_path / "t.jsonl"), "--trace-block", "16", "--trace-max-blocks",
                "4", "--trace-max-answer", "3", "--repeats", "1", "--admission", "block", "--configs",
                "--eviction-policies", "lru", "tiered", "marconi", "--policy-configs", "gpu_only", "--out",
                str(tmp_path), "--no-progress"])
    m = rec["metrics"]
    wl = rec["info"]["workloads"]["mooncake"]["policies"]
    assert {k: v["state_admission"] for k, v in wl["cache_policy"].items()} == {
        "gpu_only_lru": "block", "gpu_only_tiered": "block", "gpu_only_marconi": "leaf_branch"}
    assert wl["tree_stats"]["gpu_only_lru"]["checkpoints"]["block_boundaries"] > 0
    for pol in ("tiered", "marconi"):  # one repeat: the ratio is the runs' own
        assert m[f"throughput_{pol}_vs_lru"] == pytest.approx(
            m[f"mooncake_gpu_only_{pol}_requests_per_s"] / m["mooncake_gpu_only_lru_requests_per_s"])
        assert m[f"ttft_p50_speedup_{pol}_vs_lru"] == pytest.approx(
            m["mooncake_gpu_only_lru_ttft_p50_s"] / m[f"mooncake_gpu_only_{pol}_ttft_p50_s"])
    assert m["mooncake_gpu_only_lru_prefill_tokens_saved"] > 0


def test_budget_policy_ratios_name_each_budget_and_leave_the_main_runs_alone():
    from benchmarks.bench_workload import budget_policy_ratios

    s = {"gpu512_int8_t1_t2_lru": summary(2.0, 0.4, 0.5), "gpu512_int8_t1_t2_tiered": summary(3.0, 0.1, 0.6),
         "gpu1024_int8_t1_t2_lru": summary(1.0, 0.2, 0.5), "gpu1024_int8_t1_t2_tiered": summary(1.0, 0.4, 0.5),
         "int8_t1_t2_lru": summary(9.0, 9.0, 0.9), "int8_t1_t2_tiered": summary(1.0, 1.0, 0.1)}
    r = budget_policy_ratios(s, [512.0, 1024.0], ["int8_t1_t2"], ["lru", "tiered"])
    assert r["gpu512_throughput_tiered_vs_lru"] == r["gpu512_int8_t1_t2_throughput_tiered_vs_lru"] == 1.5
    assert r["gpu512_ttft_p50_speedup_tiered_vs_lru"] == 4.0 and r["gpu1024_ttft_p50_speedup_tiered_vs_lru"] == 0.5
    assert r["gpu1024_hit_rate_tiered_vs_lru"] == 1.0 and r["requests_per_s_gpu512_int8_t1_t2_tiered"] == 3.0
    assert not any(k.startswith(("throughput", "int8_t1_t2")) or k.endswith("int8_t1_t2_lru") and "gpu" not in k
                   for k in r)  # the main runs' ratios are policy_ratios' to give
    fell = budget_policy_ratios(s, [512.0], ["int8_t1_t2"], ["lru", "tiered"], {"gpu512_int8_t1_t2_lru": "capture"})
    assert fell["gpu512_throughput_tiered_vs_lru"] is None and "gpu512_throughput_tiered_vs_lru" in fell["invalid"]
    assert "gpu512_int8_t1_t2_throughput_tiered_vs_lru" in fell["invalid"]
    assert budget_policy_ratios(s, [], ["int8_t1_t2"], ["lru", "tiered"]) == {"invalid": []}


def test_policy_gpu_budgets_run_each_policy_at_each_budget_warmed_and_rotated(tmp_path, keep_threads, monkeypatch):
    from benchmarks import bench_workload as bw
    from benchmarks import workload_common as wc

    calls: list[tuple] = []
    real = bw.run_config

    def logged(model, ecfg, drive, total, label, *a, **kw):
        st = real(model, ecfg, drive, total, label, *a, **kw)
        c = ecfg.cache
        calls.append((label, c.eviction_policy, c.kv_pages, c.t1_states, c.host_kv_pages))
        return st

    monkeypatch.setattr(bw, "run_config", logged)
    argv = ["--scale", "small", "--workloads", "multi_turn", "--set", "clients=2", "rounds=2", "--repeats", "2",
            "--configs", "--eviction-policies", "lru", "tiered", "--policy-gpu-budgets", "1", "2", "--out",
            str(tmp_path), "--no-progress"]
    rec = bw.main(argv)
    m, info = rec["metrics"], rec["info"]["workloads"]["multi_turn"]
    keys = ["int8_t1_t2_lru", "int8_t1_t2_tiered", "gpu1_int8_t1_t2_lru", "gpu1_int8_t1_t2_tiered",
            "gpu2_int8_t1_t2_lru", "gpu2_int8_t1_t2_tiered"]
    assert info["repeat_orders"] == [keys, keys[1:] + keys[:1]] and sorted(info["warm_pass_s"]) == sorted(keys)
    # the warm pass first (each run once, untimed), then the timed runs; every budget's tiers are its split's
    assert [c[0].endswith("(warm pass)") for c in calls] == [True] * 6 + [False] * 12
    tiers = info["policies"]["gpu_budget_tiers"]
    for mib in ("1", "2"):
        t = tiers[mib]["int8_t1_t2"]
        sec = wc.load_workload("multi_turn", "small", {"clients": 2, "rounds": 2})
        assert t["kv_pages"] == bw.wc.split_budget(
            wc.TierBytes(**info["tier_bytes"]), int(float(mib) * wc.MiB), int(sec["host_budget_mib"] * wc.MiB),
            sec["engine"]["max_running"], -(-info["longest_request"] // sec["engine"]["page_size"]),
            sec["engine"]["kv_fraction"])["int8_t1_t2"]["kv_pages"]
        ran = {(c[1], c[2], c[3], c[4]) for c in calls if c[0].endswith(f"@ GPU {mib} MiB") or
               c[0].endswith(f"@ GPU {mib} MiB (warm pass)")}
        assert ran == {(p, t["kv_pages"], t["t1_states"], t["host_kv_pages"]) for p in ("lru", "tiered")}
    main_t = info["tiers"]["int8_t1_t2"]
    assert tiers["1"]["int8_t1_t2"]["kv_pages"] < tiers["2"]["int8_t1_t2"]["kv_pages"] != main_t["kv_pages"]
    for mib in ("1", "2"):
        for k in ("throughput", "ttft_p50_speedup", "hit_rate"):
            key = f"gpu{mib}_{k}_tiered_vs_lru"
            assert m[key] == m[f"multi_turn_{key}"] == m[f"multi_turn_gpu{mib}_int8_t1_t2_{k}_tiered_vs_lru"], key
            assert m[f"{key}_min"] <= m[key] <= m[f"{key}_max"], key
        assert m[f"multi_turn_gpu{mib}_int8_t1_t2_tiered_requests_per_s"] > 0
        assert m[f"multi_turn_gpu{mib}_int8_t1_t2_lru_hit_rate"] == m[f"hit_rate_gpu{mib}_int8_t1_t2_lru"]
        assert m[f"gpu{mib}_hit_rate_tiered_vs_lru"] == pytest.approx(
            m[f"hit_rate_gpu{mib}_int8_t1_t2_tiered"] / m[f"hit_rate_gpu{mib}_int8_t1_t2_lru"])
    assert m["throughput_tiered_vs_lru"] == m["multi_turn_int8_t1_t2_throughput_tiered_vs_lru"]  # the main budget
    assert {r["config"] for r in rec["rows"]} >= {f"{wc.LABELS['int8_t1_t2']} [{p}] @ GPU {mib} MiB"
                                                 for p in ("lru", "tiered") for mib in ("1", "2")}


@pytest.mark.parametrize("extra, msg", [(["--policy-gpu-budgets", "512"], "only with --eviction-policies"),
                                        (["--eviction-policies", "lru", "tiered", "--policy-gpu-budgets", "512", "0"],
                                         "MiB > 0")])
def test_policy_gpu_budgets_refused(extra, msg, capsys):
    from benchmarks.bench_workload import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--configs", "no_cache", *extra])
    assert msg in capsys.readouterr().err
