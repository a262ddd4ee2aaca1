"""benchmarks/capacity_sim.py, capacity_model.py and bench_capacity.py's real-trace mode: the model and the
fast mode serve the same hits as the full one (the real tree), (2b)'s tiers, overrides reach the cache,
serve's extra cuts, the replayed trace, the Mooncake conversion and the grid's metrics."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import bench_capacity as bc  # noqa: E402
from benchmarks import capacity_model as cm  # noqa: E402
from benchmarks import capacity_sim as cs  # noqa: E402
from benchmarks.traces import TraceRequest  # noqa: E402
from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.errors import InvalidArgumentError  # noqa: E402
from tiered_cache.stack import CountingLRUPolicy  # noqa: E402

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


def test_host_kv_fraction_moves_only_the_host_split():
    kw = dict(page=512, max_running=2, request_pages=40, kv_fraction=0.6)
    base = cs.tier_sizes("int8_t1_t2", 32 * GiB, 256 * GiB, **kw)
    more = cs.tier_sizes("int8_t1_t2", 32 * GiB, 256 * GiB, host_kv_fraction=0.9, **kw)
    assert {k: v for k, v in more.items() if not k.startswith("host_")} == \
        {k: v for k, v in base.items() if not k.startswith("host_")}
    assert more["host_kv_pages"] > base["host_kv_pages"] and more["host_states"] < base["host_states"]
    assert cs.tier_sizes("int8_t1", 32 * GiB, 0, host_kv_fraction=0.9, **kw) == cs.tier_sizes("int8_t1", 32 * GiB, 0,
                                                                                                 **kw)


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


def _random_trace(seed: int, n: int = 160) -> list[cs.SimRequest]:
    """Seeded multi-turn traffic with shared system prompts (bench_capacity's synthetic trace, small)."""
    a = bc.parse_args(["--active", "12", "--systems", "3", "--system-pages", "6", "--question-pages", "1", "5",
                       "--answer-pages", "1", "3", "--min-rounds", "2", "--max-rounds", "6", "--page", "512"])
    return list(bc.Trace(a, seed=seed).take(n))


_EVERY_TIER = dict(gpu_bytes=5 * GiB, host_bytes=2 * GiB, max_running=1, keep_hits=True)


@pytest.mark.parametrize("cfg", cs.SIM_CONFIGS)
def test_model_and_fast_mode_same_hits_as_full_mode(cfg):
    trace = cs.mooncake_requests(_conversations())
    host = 3 * GiB if cfg in bc.HOST_CONFIGS else 0
    kw = dict(gpu_bytes=1 * GiB, host_bytes=host, config_name=cfg, max_running=1, keep_hits=True)
    full = cs.simulate(trace, mode="full", **kw)
    for mode in ("model", "fast"):
        got = cs.simulate(trace, mode=mode, **kw)
        assert got["hits"] == full["hits"] and len(got["hits"]) == len(trace), mode
        assert got["evictions"] == full["evictions"], mode  # the same victims, tier by tier
        for k in ("hit_rate", "hit_rate_t2", "state_hits_t1", "state_hits_t2", "t2_states_loaded", "load_failures"):
            assert got[k] == full[k], (mode, k)
    if host:
        assert full["state_hits_t2"] > 0 and full["t2_kv_pages_loaded"] > 0  # the host tier served some of them
    assert full["evictions"].get("state", 0) > 0  # T1 was full: what fit decided the hits


@pytest.mark.parametrize("seed", range(6))
def test_model_same_hits_as_the_real_tree_on_random_traffic(seed):
    """Shared prefixes (splits, branch points), every tier evicting: request by request, victim counts too."""
    trace = _random_trace(seed)
    for cfg in cs.SIM_CONFIGS:
        kw = dict(_EVERY_TIER, host_bytes=_EVERY_TIER["host_bytes"] if cfg in bc.HOST_CONFIGS else 0)
        model, real = cs.simulate(trace, config_name=cfg, mode="model", **kw), \
            cs.simulate(trace, config_name=cfg, mode="fast", **kw)
        assert model["hits"] == real["hits"], cfg
        assert model["evictions"] == real["evictions"], cfg
        if cfg == "int8_t1_t2":
            assert {"kv", "state", "kv_host"} <= set(real["evictions"]), real["evictions"]


def test_model_checks_its_own_books_and_refuses_what_it_does_not_know():
    trace = cs.mooncake_requests(_conversations())
    tiers = cs.tier_sizes("int8_t1_t2", 1 * GiB, 3 * GiB, page=512, max_running=1, request_pages=40, kv_fraction=0.6)
    cfg = CacheConfig(page_size=1, validate=False, check_memory=False, backend="torch", **tiers)
    sim = cs.ModelSim(cfg, cs.tiny_state(cs.real_bytes(512)), page=512)
    for r in trace:
        sim.request(r, 16)
    sim.check()
    sim.model.t1_free += 1  # a T1 slot leaked
    with pytest.raises(AssertionError, match="T1"):
        sim.check()
    sim.model.t1_free -= 1
    lru = sim.model.lru
    x = next(iter(lru.sets[cm._BITS["state"]]))
    lru.heaps[cm._BITS["state"]] = [e for e in lru.heaps[cm._BITS["state"]] if e[1] is not x]  # off its heap
    with pytest.raises(AssertionError, match="'state' candidate off its heap"):
        sim.check()
    lru.sets[cm._BITS["kv"]].discard(next(iter(lru.sets[cm._BITS["kv"]])))  # a candidate lost
    with pytest.raises(AssertionError, match="'kv' candidates"):
        sim.check()
    for over in ({"eviction_policy": "marconi"}, {"state_admission": "leaf_branch"}, {"write_policy": "write_back"}):
        with pytest.raises(InvalidArgumentError, match=f"cfg.{next(iter(over))}"):
            cs.simulate(trace, gpu_bytes=1 * GiB, host_bytes=3 * GiB, config_name="int8_t1_t2", max_running=1,
                        cache_overrides=over)
    with pytest.raises(InvalidArgumentError, match="mode"):
        cs.simulate(trace, gpu_bytes=1 * GiB, host_bytes=0, config_name="gpu_only", max_running=1, mode="quick")


@pytest.mark.parametrize("seed", range(6))
def test_node_lru_pops_what_the_counting_lru_policy_pops(seed):
    """The model's NodeLRU against the tree's own CountingLRUPolicy, fed the same random touches, adds,
    discards, forgets and pops over a few nodes (stale heap entries and rebuilds included): every pop
    the same node (or none in both), the same candidate sets and victim counts after every step."""
    rng = random.Random(seed)
    nodes = [cm.Node(None, [i]) for i in range(24)]
    lru, pol = cm.NodeLRU(), CountingLRUPolicy()
    names = list(cm._BITS)
    pops = 0
    for _ in range(6000):
        op, x, r = rng.random(), rng.choice(nodes), rng.choice(names)
        b = cm._BITS[r]
        if op < 0.35:
            base = "kv" if b & cm._KV_BASE else "state"
            pol.touch(base, x)
            (lru.touch_kv if base == "kv" else lru.touch_state)(x)
        elif op < 0.6:
            pol.add(r, x)
            lru.update(x, x.cand | b)
        elif op < 0.75:
            pol.discard(r, x)
            lru.update(x, x.cand & ~b)
        elif op < 0.78:
            pol.forget(x)
            lru.forget(x)
        else:
            got = lru.pop(b)
            assert got is pol.pop(r)
            pops += got is not None
        for name in names:
            assert lru.sets[cm._BITS[name]] == pol.candidates(name), name
        assert lru.counts == dict(pol.counts)
    lru.check()
    assert pops > 500 and max(len(h) for h in lru.heaps.values()) <= 3 * 24 + 64  # stale entries were dropped


def test_replayed_shifts_every_copy_apart():
    trace = cs.mooncake_requests(_conversations(3, 2))
    got = list(cs.replayed(trace, 2 * len(trace) + 1))
    assert got[:len(trace)] == trace and len(got) == 2 * len(trace) + 1
    span = max(max(r.prompt + r.answer) for r in trace) + 1
    second = got[len(trace):2 * len(trace)]
    assert [r.prompt for r in second] == [[t + span for t in r.prompt] for r in trace]
    assert [r.tokens for r in second] == [r.tokens for r in trace]
    assert not {t for r in trace for t in r.prompt + r.answer} & {t for r in second for t in r.prompt + r.answer}
    assert got[-1].prompt == [t + 2 * span for t in trace[0].prompt]
    # a copy reuses within itself as the trace does, never across copies: its hits repeat the first copy's
    # once the cache is large enough to hold both
    kw = dict(gpu_bytes=64 * GiB, host_bytes=0, config_name="int8_t1", max_running=1, keep_hits=True,
              request_pages=max(len(r.prompt) + len(r.answer) for r in trace))
    hits = cs.simulate(cs.replayed(trace, 2 * len(trace)), **kw)["hits"]
    assert hits[:len(trace)] == hits[len(trace):] and sum(hits) > 0
    with pytest.raises(InvalidArgumentError, match="n"):
        next(cs.replayed(trace, 0))


def test_serve_extra_cuts_store_more_states():
    """``serve``'s ``extra_cuts`` (how bench_policy adds block boundaries): more states cached, and a later
    request diverging after one of them resumes there."""
    tiers = cs.tier_sizes("gpu_only", 8 * GiB, 0, page=512, max_running=1, request_pages=40, kv_fraction=0.6)
    cfg = CacheConfig(page_size=1, validate=False, check_memory=False, backend="torch", **tiers)
    state = cs.tiny_state(cs.real_bytes(512))
    first, second = list(range(1, 21)), list(range(1, 6)) + [99, 100]
    got = []
    for extra in (None, lambda p, n, cuts: range(p + 5, n, 5)):
        stack = cs.Sim(cfg, state, page=512, fast=True).stack
        a = cs.serve(stack, first, [500], 16, extra)
        b = cs.serve(stack, second, [501], 16, extra)
        assert a.reused == 0 and not a.state_from_host and not b.load_failed
        got.append((b.reused, stack.tree.total_size()[1]))
    (plain, plain_states), (cut, cut_states) = got
    assert plain == 0 and cut == 5  # without a state at 5 the shared 5 pages cannot be resumed from
    assert cut_states > plain_states


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


def _row(cfg, gpu, host, hit, share=None):
    return {"config": cfg, "gpu_gib": gpu, "host_gib": host, "hit_rate": hit, "host_kv_fraction": share}


def test_a_bytes_ratio_needs_both_crossings_bracketed_by_the_grid():
    """``bytes_ratio_*`` is the ratio of the grid's upper bounds only where a point under each crossing misses
    the target; its bounds come from those points. A grid that starts past a crossing (one point: both
    configurations reach the target there, ratio 1 by construction) gives no ratio."""
    rows = [_row("gpu_only_host", 16, h, hit) for h, hit in ((32, 0.1), (48, 0.3), (64, 0.6))]
    rows += [_row("int8_t1_t2", 16, h, hit) for h, hit in ((16, 0.2), (32, 0.55), (48, 0.7), (64, 0.8))]
    m = {"bytes_to_90pct_2b": bc.bytes_to(rows, "gpu_only_host", 0.5),
         "bytes_to_90pct_4": bc.bytes_to(rows, "int8_t1_t2", 0.5)}
    bc.crossing_ratio(m, rows, "2b", "4", 0.5)
    assert m["bytes_below_90pct_2b"] == 64 * GiB and m["bytes_below_90pct_4"] == 32 * GiB
    assert m["bytes_ratio_2b_vs_4_at_90pct"] == 80 / 48
    assert (m["bytes_ratio_2b_vs_4_at_90pct_lo"], m["bytes_ratio_2b_vs_4_at_90pct_hi"]) == (64 / 48, 80 / 32)
    one = [_row("gpu_only_host", 32, 1024, 0.9), _row("int8_t1_t2", 32, 1024, 0.9)]
    m = {"bytes_to_90pct_2b": 1056 * GiB, "bytes_to_90pct_4": 1056 * GiB}
    bc.crossing_ratio(m, one, "2b", "4", 0.5)
    assert m["bytes_ratio_2b_vs_4_at_90pct"] is None and m["bytes_ratio_2b_vs_4_at_90pct_hi"] is None
    # over several host KV shares: every share must miss under the smallest crossing (share 0.8 here)
    shares = [_row("int8_t1_t2", 16, h, hit, f) for f, pts in ((0.5, ((32, 0.2), (64, 0.4))),
                                                                (0.8, ((32, 0.3), (48, 0.6))))
              for h, hit in pts]
    assert bc.bytes_below(shares, "int8_t1_t2", 0.5, bc.bytes_to(shares, "int8_t1_t2", 0.5)) == 48 * GiB
    shares.append(_row("int8_t1_t2", 16, 64, 0.7, 0.9))  # a share with no point under the crossing: no bound
    assert bc.bytes_below(shares, "int8_t1_t2", 0.5, 64 * GiB) is None


def test_trace_grid_writes_every_metric(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                                     "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                         for r in _conversations(6, 3)))
    path = bc.main(["--trace", str(p), "--grid-gpu", "1", "--grid-host", "1", "4", "--grid-gpu-only", "1", "2",
                    "--max-running", "1", "--workers", "1", "--check-requests", "12", "--check-at", "1", "2",
                    "--million", "40", "--million-at", "1", "4", "--out", str(tmp_path), "--no-progress"])
    rec = json.load(open(path))
    m = rec["metrics"]
    for k in ("hit_rate_2_1g_0g", "hit_rate_3_2g_0g", "hit_rate_2b_1g_1g", "hit_rate_4_1g_4g",
              "ceiling_hybrid_hit_rate", "ceiling_attention_hit_rate", "bytes_to_90pct_2b", "bytes_to_90pct_4",
              "bytes_ratio_2b_vs_4_at_90pct", "bytes_ratio_2_vs_3_at_90pct", "hit_rate_4_vs_2b_1g_4g",
              "hit_rate_3_vs_2_1g", "model_mode_req_per_s_2b", "full_mode_req_per_s_4", "model_vs_fast_speed_3",
              "wall_s_1e6_requests_4_1g_4g", "cpu_s_1e6_requests_4_1g_4g", "hit_rate_1e6_requests_4_1g_4g",
              "bytes_to_90pct_4_any_split", "bytes_ratio_2b_vs_4_at_90pct_any_split",
              "host_kv_fraction_at_90pct_2b_any_split"):
        assert k in m, k
    for tag in ("2", "2b", "3", "4"):
        assert m[f"model_same_hits_as_full_{tag}"] == 1.0 and m[f"fast_same_hits_as_full_{tag}"] == 1.0
    b2b, b4 = m["bytes_to_90pct_2b"], m["bytes_to_90pct_4"]
    bracketed = m["bytes_below_90pct_2b"] is not None and m["bytes_below_90pct_4"] is not None
    r = m["bytes_ratio_2b_vs_4_at_90pct"]
    assert r == (b2b / b4 if bracketed else None)
    assert r is None or m["bytes_ratio_2b_vs_4_at_90pct_lo"] <= r <= m["bytes_ratio_2b_vs_4_at_90pct_hi"]
    assert m["wall_s_1e6_requests_4_1g_4g"] > 0 and m["cpu_s_1e6_requests_4_1g_4g"] > 0
    assert "ceiling" in rec["info"] and "10^6 requests" in rec["info"] and os.path.exists(path[:-5] + ".md")
    assert not any(r.get("million") for r in rec["rows"])  # the timed run is in the metrics, not a grid row
    shares = {r["host_kv_fraction"] for r in rec["rows"] if r["config"] == "int8_t1_t2"}
    assert shares == {0.6, 0.75, 0.9}
    # the split the benchmarks share is one of the shares: the best over them is never worse
    b4s = m["bytes_to_90pct_4_any_split"]
    assert b4 is None or (b4s is not None and b4s <= b4)


def test_synthetic_sweep_writes_the_2b_ratios(tmp_path):
    path = bc.main(["--gpu-gib", "16", "--ratio-at", "16", "--host-gib", "64", "32", "--requests", "5", "--warm", "5",
                    "--out", str(tmp_path), "--no-progress"])
    m = json.load(open(path))["metrics"]
    for k in ("hit_rate_gpu_only_host_gpu16_host64", "hit_rate_int8_t1_t2_gpu16_host32", "hit_rate_vs_gpu_only_16GiB",
              "int8_hit_rate_vs_gpu_only_16GiB", "hit_rate_4_vs_2b_gpu16_host64", "hit_rate_4_vs_2b_gpu16_host32"):
        assert k in m, k
    two_b, four = m["hit_rate_gpu_only_host_gpu16_host64"], m["hit_rate_int8_t1_t2_gpu16_host64"]
    assert m["hit_rate_4_vs_2b_gpu16_host64"] == (four / two_b if two_b else None)
