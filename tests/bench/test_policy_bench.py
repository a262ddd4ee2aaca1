"""benchmarks/bench_policy.py (issue 23): the session generator, the worst-point ratio, and a short run of
every configuration on the real structures (invariants checked at its end)."""

from __future__ import annotations

import pytest

from benchmarks import bench_policy as bp
from benchmarks import workload_common as wc
from tiered_cache import costs


def test_sessions_continue_their_history():
    """Every turn's prompt is an earlier turn's prompt + answer + new tokens, or a new session's start
    (chat: a system prompt; swe: a fresh context)."""
    a = bp.parse_args([])
    for kind in ("chat", "swe"):
        reqs = bp.marconi_sessions(kind, 1.0, 200, 0, a)
        seen: list[list[int]] = []
        starts = 0
        for r in reqs:
            prev = [h for h in seen if len(h) < len(r.prompt) and r.prompt[:len(h)] == h]
            starts += not prev
            seen.append(r.prompt + r.answer)
            assert r.tokens == 64 * len(r.prompt)
        assert 0 < starts < len(reqs) // 2
        assert bp.marconi_sessions(kind, 1.0, 200, 0, a) == reqs  # seeded


def test_worst_point_and_undefined():
    rows = [{"scenario": "a", "trace": "t", "gpu_gib": g, "policy": p, "hit_rate": v}
            for g, vals in ((8, {"x": 0.5, "y": 0.25}), (16, {"x": 0.6, "y": 0.4})) for p, v in vals.items()]
    assert bp.worst(rows, "x", "y", "hit_rate") == pytest.approx(1.5)
    rows[1]["hit_rate"] = 0.0
    assert bp.worst(rows, "x", "y", "hit_rate") is None  # a point without a ratio: no worst point


def test_worst_gpu_bound_points():
    """GPU-bound points: Marconi saves under half of what it saves unbounded (that row is no grid point)."""
    rows = [{"scenario": "a", "trace": "t", "gpu_gib": g, "policy": p, "flops_saved": v}
            for g, vals in ((8, {"ours_tiered": 0.8, "marconi": 0.2}), (24, {"ours_tiered": 0.9, "marconi": 0.85}),
                            (None, {"marconi": 0.9})) for p, v in vals.items()]
    assert bp.worst(rows, "ours_tiered", "marconi", "flops_saved") == pytest.approx(0.9 / 0.85)
    assert bp.worst(rows, "ours_tiered", "marconi", "flops_saved", gpu_bound=True) == pytest.approx(4.0)
    rows[1]["flops_saved"] = 0.5  # no point is GPU-bound: undefined
    assert bp.worst(rows, "ours_tiered", "marconi", "flops_saved", gpu_bound=True) is None


def test_ceiling_over_marconi_and_goals():
    """The unbounded row over Marconi's at each point, the least of them; the goals read off the values."""
    rows = [{"scenario": "a", "trace": "t", "gpu_gib": g, "policy": p, "flops_saved": v}
            for g, vals in ((8, {"marconi": 0.2}), (24, {"marconi": 0.8}), (None, {"marconi": 0.9}))
            for p, v in vals.items()]
    assert bp.ceiling_vs_marconi(rows) == pytest.approx(0.9 / 0.8)
    rows[1]["flops_saved"] = 0.0
    assert bp.ceiling_vs_marconi(rows) is None
    m = dict.fromkeys(("flops_saved_ours_vs_marconi", "hit_rate_ours_vs_marconi",
                       "flops_saved_tiered_vs_marconi_gpu_bound", "hit_rate_marconi_vs_sglang_style"), 1.0)
    m["flops_saved_tiered_vs_marconi"] = 1.5
    g = bp.goals(m)
    assert g["goal_tiered"].endswith("NOT met (1.5)") and g["goal_ours"].endswith(": met (1)")
    m["flops_saved_tiered_vs_marconi"] = None
    assert bp.goals(m)["goal_tiered"].endswith("undefined")


@pytest.mark.parametrize("policy,admission,cuts,config", [
    ("lru", "block", "every_block", "gpu_only"), ("lru", "chunk", None, "gpu_only"),
    ("marconi", "leaf_branch", None, "gpu_only"), ("tiered", "leaf_branch", None, "gpu_only"),
    ("tiered", "block", "last_block", "gpu_only"), ("tiered", "leaf_branch", None, "int8_t1_t2")])
def test_a_short_run_of_each_configuration(policy, admission, cuts, config):
    """Every configuration the benchmark runs, on a budget small enough to evict; ``run`` checks the
    invariants at the end."""
    a = bp.parse_args([])
    reqs = bp.marconi_sessions("chat", 2.0, 60, 1, a)
    real = wc.TierBytes.from_specs(bp.MARCONI_KV, bp.MARCONI_STATE, 64)
    tiers = wc.split_budget(real, 6 << 30, 8 << 30, 4, max(len(r.prompt) + len(r.answer) for r in reqs), 0.6)[config]
    pc = bp.PrefixCosts.of(costs.MARCONI_7B, tokens_per_key=64, t1_int8=config != "gpu_only")
    r = bp.run(reqs, 20, tiers, bp.cs.tiny_state(real), pc, policy, admission, cuts, 8, 128, 15)
    assert r["requests"] == 40 and 0.0 < r["hit_rate"] <= 1.0 and 0.0 < r["flops_saved"] <= 1.0
    if policy == "marconi" and config == "gpu_only":  # tuned from the first eviction (the host budget here
        # holds this trace: no eviction, no tuning): at least one window of 15 after it
        assert r["tunings"] and set(r["tunings"]) <= set(bp.ALPHA_GRID) and r["tuned"] == r["tunings"][-1]


def test_tiered_run_evicts_in_every_tier():
    """Ours with int8 T1 + T2 on a budget that evicts everywhere: T1 states demoted, T2 copies dropped,
    device and host KV evicted, host hits loaded back; the invariants hold at the end."""
    a = bp.parse_args([])
    reqs = bp.marconi_sessions("chat", 2.0, 120, 1, a)
    real = wc.TierBytes.from_specs(bp.MARCONI_KV, bp.MARCONI_STATE, 64)
    longest = max(len(r.prompt) + len(r.answer) for r in reqs)
    tiers = wc.split_budget(real, int(4.5 * (1 << 30)), 1 << 30, 4, longest, 0.6)["int8_t1_t2"]
    pc = bp.PrefixCosts.of(costs.MARCONI_7B, tokens_per_key=64, t1_int8=True)
    sim = bp.PolicySim(tiers, bp.cs.tiny_state(real), pc, "tiered", "leaf_branch", 8)
    for r in reqs:
        sim.request(r, 128)
    assert {"kv", "state", "kv_host", "state_host"} <= {r for r, n in sim.policy.counts.items() if n}
    assert sim.c["host"] > 0
    sim.cache.check_invariants(request_kv=bp.torch.empty(0, dtype=bp.torch.int64), request_states=bp.torch.empty(0))


def test_main_repeats_the_sessions_over_seeds(tmp_path):
    """Each seed draws (a)'s sessions again: rows per seed, the headline from the first seed, and the same
    worst-point ratios' min <= median <= max over the seeds; the goals stated in the JSON's info."""
    import json

    path = bp.main(["--scenarios", "a", "--rates", "2", "--gpu-gib-a", "6", "--host-gib-a", "8", "--requests", "30",
                    "--warm", "20", "--window", "15", "--seeds", "3", "4", "--out", str(tmp_path)])
    d = json.load(open(path))
    m, rows = d["metrics"], d["rows"]
    assert {r["seed"] for r in rows} == {3, 4} and all(r["scenario"] == "a" for r in rows)
    first = bp.headlines([r for r in rows if r["seed"] == 3])
    assert {k: m[k] for k in first} == pytest.approx(first)
    for k in first:
        lo, mid, hi = (m[f"{k}_{s}_over_seeds"] for s in ("min", "median", "max"))
        if lo is not None:
            assert lo <= mid <= hi and lo <= m[k] <= hi
    assert d["info"]["goal_tiered"].startswith("flops_saved_tiered_vs_marconi >= 2 at the worst grid point: ")
