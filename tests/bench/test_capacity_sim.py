"""benchmarks/capacity_sim.py and bench_capacity.py's real-trace mode: the fast mode serves the same hits
as the full one, (2b)'s tiers, overrides reach the cache, the Mooncake conversion and the grid's metrics."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import bench_capacity as bc  # noqa: E402
from benchmarks import capacity_sim as cs  # noqa: E402
from benchmarks.traces import TraceRequest  # noqa: E402
from tiered_cache.errors import InvalidArgumentError  # noqa: E402

GiB = cs.GiB


def _conversations(n_conv: int = 8, rounds: int = 5) -> list[TraceRequest]:
    """Multi-turn conversations interleaved round-robin (a reuse distance of n_conv requests), each turn
    the previous prompt's full blocks + a fresh block or two; all start with a shared block 0."""
    nxt, out, hist = 1, [], [[0] for _ in range(n_conv)]
    for rnd in range(rounds):
        for c in range(n_conv):
            add = 1 + (c + rnd) % 2
            hist[c] = hist[c] + list(range(nxt, nxt + add))
            nxt += add
            out.append(TraceRequest(len(out), len(hist[c]) * 512 - 100, 300, tuple(hist[c])))
    return out


def test_mooncake_requests_pages_and_fresh_answers():
    t = [TraceRequest(0, 1000, 30, (0, 1)), TraceRequest(1, 1024, 1, (0, 1)), TraceRequest(2, 600, 900, (0, 5))]
    got = cs.mooncake_requests(t)
    assert [r.prompt for r in got] == [[1, 2], [1, 2], [1, 6]]
    assert [r.tokens for r in got] == [1000, 1024, 600]
    # KV fed: ceil((in + out - 1) / 512) pages = prompt pages + answer pages - 1
    assert [len(r.prompt) + len(r.answer) - 1 for r in got] == [3, 2, 3]
    answers = [a for r in got for a in r.answer]
    assert len(set(answers)) == len(answers) and min(answers) > 6  # no prompt names them


def test_gpu_only_host_has_the_host_bytes_of_4_in_lossless_states():
    kw = dict(page=512, max_running=2, request_pages=40, kv_fraction=0.6)
    real = cs.real_bytes(512)
    b2, b4 = (cs.tier_sizes(c, 32 * GiB, 256 * GiB, **kw) for c in ("gpu_only_host", "int8_t1_t2"))
    two = cs.tier_sizes("gpu_only", 32 * GiB, 256 * GiB, **kw)
    assert {k: b2[k] for k in two} == two  # (2)'s GPU tiers, lossless T1
    assert b2["host_kv_pages"] == b4["host_kv_pages"]
    state_bytes = 256 * GiB - b2["host_kv_pages"] * real.kv_page
    assert b2["host_states"] == state_bytes // real.t1_lossless < b4["host_states"] == state_bytes // real.t1_int8
    with pytest.raises(InvalidArgumentError, match="config_name"):
        cs.tier_sizes("no_cache", 32 * GiB, 0, **kw)


@pytest.mark.parametrize("cfg", ["gpu_only_host", "int8_t1_t2"])
def test_fast_mode_same_hits_as_full_mode(cfg):
    trace = cs.mooncake_requests(_conversations())
    kw = dict(gpu_bytes=1 * GiB, host_bytes=3 * GiB, config_name=cfg, max_running=1, keep_hits=True)
    fast, full = cs.simulate(trace, fast=True, **kw), cs.simulate(trace, fast=False, **kw)
    assert fast["hits"] == full["hits"] and len(fast["hits"]) == len(trace)
    assert fast["state_hits_t2"] > 0 and fast["t2_kv_pages_loaded"] > 0  # the host tier served some of them
    assert fast["evictions"].get("kv", 0) > 0  # T0 was full: what fit decided the hits
    for k in ("hit_rate", "hit_rate_t2", "state_hits_t1", "state_hits_t2", "t2_states_loaded", "load_failures"):
        assert fast[k] == full[k], k


def test_host_tier_and_overrides_change_the_hits():
    trace = cs.mooncake_requests(_conversations())
    kw = dict(gpu_bytes=1 * GiB, max_running=1)
    two = cs.simulate(trace, host_bytes=0, config_name="gpu_only", **kw)
    two_b = cs.simulate(trace, host_bytes=4 * GiB, config_name="gpu_only_host", **kw)
    assert two_b["hit_rate"] > two["hit_rate"]
    one_state = cs.simulate(trace, host_bytes=4 * GiB, config_name="gpu_only_host",
                            cache_overrides={"host_states": 1}, **kw)
    assert one_state["host_states"] > 1  # the split's size is reported; the override is what ran
    assert one_state["hit_rate"] < two_b["hit_rate"]
    with pytest.raises(InvalidArgumentError, match="cache_overrides"):
        cs.simulate(trace, host_bytes=0, config_name="gpu_only", cache_overrides={"no_such_field": 1}, **kw)
    with pytest.raises(InvalidArgumentError, match="request_pages"):
        cs.simulate(iter(trace), host_bytes=0, config_name="gpu_only", **kw)


def test_unbounded_tiers_bound_every_point():
    raw = _conversations()
    trace = cs.mooncake_requests(raw)
    top = cs.simulate_tiers(trace, bc.unbounded_tiers(trace, 1, 512))
    assert top["evictions"] == {}
    for cfg, host in (("int8_t1", 0), ("int8_t1_t2", 2 * GiB)):
        r = cs.simulate(trace, gpu_bytes=1 * GiB, host_bytes=host, config_name=cfg, max_running=1)
        assert r["hit_rate"] <= top["hit_rate"]
    # block-aligned turns: a state at every turn's prompt end, so the hybrid ceiling is the trace's own
    # reuse minus the last block of each prompt, which is never matched (the last token is computed)
    assert 0 < top["hit_rate"] <= bc.unbounded_reuse(raw)


def test_bytes_to_reads_the_grid():
    rows = [{"config": "x", "gpu_gib": 8, "host_gib": 64, "hit_rate": 0.5},
            {"config": "x", "gpu_gib": 16, "host_gib": 32, "hit_rate": 0.6},
            {"config": "x", "gpu_gib": 16, "host_gib": 16, "hit_rate": 0.4}]
    assert bc.bytes_to(rows, "x", 0.5) == 48 * GiB
    assert bc.bytes_to(rows, "x", 0.7) is None


def test_trace_grid_writes_every_metric(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                     "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                         for r in _conversations(6, 3)))
    path = bc.main(["--trace", str(p), "--grid-gpu", "1", "--grid-host", "1", "4", "--max-running", "1",
                    "--workers", "1", "--check-requests", "5", "--warm", "5", "--out", str(tmp_path), "--no-progress"])
    rec = json.load(open(path))
    m = rec["metrics"]
    for k in ("hit_rate_2_1g_0g", "hit_rate_3_1g_0g", "hit_rate_2b_1g_1g", "hit_rate_4_1g_4g",
              "ceiling_hybrid_hit_rate", "ceiling_attention_hit_rate", "bytes_to_90pct_2b", "bytes_to_90pct_4",
              "bytes_ratio_2b_vs_4_at_90pct", "hit_rate_4_vs_2b_1g_4g", "hit_rate_3_vs_2_1g",
              "fast_mode_same_hits_4", "fast_mode_s_per_1e6_requests_2b"):
        assert k in m, k
    assert m["fast_mode_same_hits_4"] == 1.0 and m["fast_mode_same_hits_2b"] == 1.0
    b2b, b4 = m["bytes_to_90pct_2b"], m["bytes_to_90pct_4"]
    assert m["bytes_ratio_2b_vs_4_at_90pct"] == (b2b / b4 if b2b is not None and b4 is not None else None)
    assert "ceiling" in rec["info"] and os.path.exists(path[:-5] + ".md")


def test_synthetic_sweep_writes_the_2b_ratios(tmp_path):
    path = bc.main(["--gpu-gib", "16", "--ratio-at", "16", "--host-gib", "64", "32", "--requests", "5", "--warm", "5",
                    "--out", str(tmp_path), "--no-progress"])
    m = json.load(open(path))["metrics"]
    for k in ("hit_rate_gpu_only_host_gpu16_host64", "hit_rate_int8_t1_t2_gpu16_host32", "hit_rate_vs_gpu_only_16GiB",
              "int8_hit_rate_vs_gpu_only_16GiB", "hit_rate_4_vs_2b_gpu16_host64", "hit_rate_4_vs_2b_gpu16_host32"):
        assert k in m, k
    two_b, four = m["hit_rate_gpu_only_host_gpu16_host64"], m["hit_rate_int8_t1_t2_gpu16_host64"]
    assert m["hit_rate_4_vs_2b_gpu16_host64"] == (four / two_b if two_b else None)
