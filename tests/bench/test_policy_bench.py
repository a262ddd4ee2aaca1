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
        for prompt, answer in reqs:
            prev = [h for h in seen if len(h) < len(prompt) and prompt[:len(h)] == h]
            starts += not prev
            seen.append(prompt + answer)
        assert 0 < starts < len(reqs) // 2
        assert bp.marconi_sessions(kind, 1.0, 200, 0, a) == reqs  # seeded


def test_worst_point_and_undefined():
    rows = [{"scenario": "a", "trace": "t", "gpu_gib": g, "policy": p, "hit_rate": v}
            for g, vals in ((8, {"x": 0.5, "y": 0.25}), (16, {"x": 0.6, "y": 0.4})) for p, v in vals.items()]
    assert bp.worst(rows, "x", "y", "hit_rate") == pytest.approx(1.5)
    rows[1]["hit_rate"] = 0.0
    assert bp.worst(rows, "x", "y", "hit_rate") is None  # a point without a ratio: no worst point


@pytest.mark.parametrize("policy,admission,cuts", [("lru", "block", "every_block"), ("lru", "chunk", None),
                                                   ("marconi", "leaf_branch", None), ("tiered", "leaf_branch", None),
                                                   ("tiered", "block", "last_block")])
def test_a_short_run_of_each_configuration(policy, admission, cuts):
    a = bp.parse_args([])
    reqs = bp.marconi_sessions("chat", 2.0, 60, 1, a)
    real = wc.TierBytes.from_specs(bp.MARCONI_KV, bp.MARCONI_STATE, 64)
    tiers = wc.split_budget(real, 6 << 30, 8 << 30, 4, max(len(p) + len(q) for p, q in reqs), 0.6)["gpu_only"]
    pc = bp.PrefixCosts.of(costs.MARCONI_7B, tokens_per_key=64, t1_int8=False)
    r = bp.run(reqs, 20, tiers, bp.tiny_state(real), pc, policy, admission, cuts, 8, 128, 20)
    assert r["requests"] == 40 and 0.0 < r["hit_rate"] <= 1.0 and 0.0 < r["flops_saved"] <= 1.0
    if policy == "marconi":
        assert len(r["alphas_tuned"]) == 3 and r["alpha"] in bp.ALPHAS
