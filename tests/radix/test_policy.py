"""Costs, admission and the cost-aware eviction policies (issue 23).

Costs: every formula of ``tiered_cache.costs`` against a hand count on a tiny geometry, the real
geometries' bytes against the specs the repo sizes them with, and the quadratic term's split
consistency. Admission: which chunk states each rule keeps, on a real cache. Policies: the victim each
one picks on a tree built to tell them apart; the names through CacheConfig (SGLang's backend config:
tests/integrations/sglang/test_policy_config.py), typed errors for bad names.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.radix_util import (
    KV_SPEC,
    STATE_SPEC,
    alloc_kv,
    insert_fresh,
    match,
    node_at,
    write_kv,
    write_state,
)
from tiered_cache import config, costs
from tiered_cache.config import CacheConfig
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix import CacheReq, EvictParams
from tiered_cache.radix.policies import (
    SCORED,
    MarconiPolicy,
    PrefixCosts,
    SegLenPolicy,
    StateAdmission,
    TieredPolicy,
    make_policy,
)
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.stack import TieredCache

TINY_M2 = costs.Geometry("t", d_model=4, attention=costs.Attention(1, 1, 4), attention_layers=1,
                         mixer=costs.Mamba2(d_state=2, expand=2, head_dim=4), mixer_layers=1,
                         mlp=costs.MLP(d_ff=8), mlp_layers=1)
TINY_GDN = costs.Geometry("g", d_model=4, attention=costs.Attention(2, 1, 4, gated=True), attention_layers=1,
                          mixer=costs.GatedDeltaNet(key_heads=1, value_heads=2, key_dim=2, value_dim=2),
                          mixer_layers=1, mlp=costs.MoE(experts=4, active=2, d_expert=3, shared=1), mlp_layers=1,
                          state_bytes_per_elem=4)


# ------------------------------------------------------------------------------------------ costs
def test_flops_by_hand_mamba2():
    # n = 3 new tokens after ctx = 2; d 4, q = kv = 4; di = 8, N 2, nh 2, conv 4; d_ff 8 (2 matrices)
    assert TINY_M2.attention_flops(3, 2) == 2 * 3 * 4 * (4 + 8) + 2 * 3 * 4 * 4 + 4 * 4 * (3 * 2 + 6)  # 576
    assert TINY_M2.mixer_flops(3) == 2 * 3 * 4 * (16 + 4 + 2) + 2 * 3 * 4 * 12 + 5 * 3 * 8 * 2 + 2 * 3 * 8 * 4
    assert TINY_M2.mlp_flops(3) == 2 * 3 * 4 * 8 * 2
    assert TINY_M2.prefill_flops(3, 2) == 576 + 1248 + 384
    assert TINY_M2.kv_bytes_per_token == 2 * 1 * 4 * 2
    # state: di x N = 16 bf16 + conv (di + 2N = 12) x 3 bf16; int8: 16 B + 4 scales (nh x N) bf16 + conv
    assert TINY_M2.state_bytes == 16 * 2 + 12 * 3 * 2
    assert TINY_M2.state_bytes_int8 == 16 + 4 * 2 + 12 * 3 * 2


def test_flops_by_hand_gdn_moe():
    # gated attention: q projection doubled (8 x 2), kv 4 each; GDN: qk 2, v 4, 2 value heads of 2 x 2
    assert TINY_GDN.attention_flops(1, 0) == 2 * 4 * (16 + 8) + 2 * 8 * 4 + 4 * 8 * 1
    assert TINY_GDN.mixer_flops(5) == 5 * (2 * 4 * (4 + 8 + 4) + 2 * 4 * 8 + 7 * 2 * 2 * 2 + 2 * 4 * 4)
    assert TINY_GDN.mlp_flops(5) == 5 * (2 * 4 * 4 + 3 * 3 * 2 * 4 * 3)
    assert TINY_GDN.state_bytes == 8 * 4 + 8 * 3 * 2  # [2, 2, 2] fp32 + conv (2 qk + v = 8) x 3 bf16


def test_real_geometries_match_the_specs():
    """Qwen3-Next-80B's bytes are those of the specs bench_capacity sizes it with; Marconi's 7B state
    includes the expand factor (2 x d x N per layer), which Marconi's artifact leaves out."""
    q = costs.geometry("qwen3-next-80b")
    kv = KVSpec(num_layers=12, kv_heads=2, head_dim=256, dtype=torch.bfloat16)
    st = StateSpec(num_layers=36, temporal_shape=(32, 128, 128), temporal_dtype=torch.float32,
                   conv_shapes=((8192, 3),), conv_dtype=torch.bfloat16, value_axis=2)
    assert q.kv_bytes_per_token * 64 == kv.bytes_per_slot(64)
    assert q.state_bytes == st.bytes_per_slot()
    m = costs.geometry("marconi-7b")
    assert m.state_bytes == 24 * (2 * 4096 * 128 * 2 + (2 * 4096 + 2 * 128) * 3 * 2)
    assert m.kv_bytes_per_token == 4 * 2 * 4096 * 2
    assert set(costs.GEOMETRIES) == set(config.COST_MODELS)
    with pytest.raises(InvalidArgumentError, match="geometry"):
        costs.geometry("llama")


@pytest.mark.parametrize("g", [TINY_M2, TINY_GDN, costs.QWEN3_NEXT_80B, costs.MARCONI_7B], ids=lambda g: g.name)
def test_saved_flops_add_up(g):
    """A prefix computed in pieces costs what it costs whole (the quadratic term reads the cached keys)."""
    for a, b, c in ((0, 5, 9), (3, 3, 17), (1, 64, 1000)):
        assert g.saved_flops(a, b) + g.saved_flops(b, c) == g.saved_flops(a, c) == g.prefill_flops(c - a, a)
    assert g.saved_flops(0, 0) == 0
    with pytest.raises(InvalidArgumentError, match="end"):
        g.saved_flops(5, 4)


# ------------------------------------------------------------------------------------------ admission
def _cache(**kw):
    cfg = CacheConfig(**{"page_size": 1, "kv_pages": 64, "t0_states": 4, "t1_states": 8, "codec": "lossless",
                         "check_memory": False, "backend": "torch", **kw})
    return TieredCache.build(cfg, kv=KV_SPEC, state=STATE_SPEC, device="cpu").tree


def _chunk(cache, toks):
    """A request's prefill chunk ending at ``len(toks)`` (fresh KV and state): -> (stored, request)."""
    ids = alloc_kv(cache, len(toks))
    write_kv(cache, ids, toks)
    slot = cache.states.alloc(1)
    write_state(cache, slot, toks)
    req = CacheReq(token_ids=list(toks), kv_indices=ids, mamba_pool_idx=slot)
    before = cache.ckpt.available_size()
    cache.cache_unfinished_req(req, chunked=True)
    return cache.ckpt.available_size() < before, req


def _done(cache, req):
    cache.cache_finished_req(req)


@pytest.mark.parametrize("name,block,kept", [("chunk", None, [True, True, True]),
                                             ("leaf_branch", None, [False, False, True]),
                                             ("block", 4, [True, False, True])])
def test_admission_keeps_what_its_rule_says(name, block, kept):
    """Chunk states at 4 and 6 (neither a branch point), then at 2 on another path that branches there."""
    cache = _cache(state_admission=name, **({"admission_block": block} if block else {}))
    insert_fresh(cache, [1, 2, 3, 4, 5, 6, 7, 8])  # a direct insert (a finished request): always kept
    got = []
    for toks in ([9, 9, 9, 9], [9, 9, 9, 9, 9, 9], [1, 2]):
        stored, req = _chunk(cache, toks)
        got.append(stored)
        _done(cache, req)
        cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    assert got == kept
    assert node_at(cache, [1, 2]).payload.mamba_value is not None  # the branch point, kept by every rule
    assert node_at(cache, [9, 9, 9, 9, 9, 9]).payload.mamba_value is not None  # the finished request's leaf


def test_admission_bad_names():
    with pytest.raises(InvalidArgumentError, match="state_admission"):
        CacheConfig(state_admission="every")
    with pytest.raises(InvalidArgumentError, match="admission_block"):
        CacheConfig(state_admission="block", page_size=16, admission_block=24)
    with pytest.raises(InvalidArgumentError, match="state_admission"):
        StateAdmission("leaf")
    with pytest.raises(InvalidArgumentError, match="admission_block"):
        StateAdmission("block")
    with pytest.raises(InvalidTypeError, match="admission"):
        from tiered_cache.radix import HiMambaRadixCache

        c = _cache()
        HiMambaRadixCache(c.pool if hasattr(c, "pool") else None, c.ckpt, admission="leaf")


# ------------------------------------------------------------------------------------------ policies
def _costs():
    return PrefixCosts.of(costs.MARCONI_7B, tokens_per_key=64, t1_int8=False)


def _tree_for_policies(policy: str):
    """root -> [1..8]* (two children: [9]* and [10 11]*), [20]* (a short old leaf), [30..37]* (a long
    recent leaf); states everywhere; then [20] and [30..37] re-used so recency differs."""
    cache = _cache(eviction_policy=policy, cost_model="marconi-7b", t1_states=8)
    for toks in ([20], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11],
                 [30, 31, 32, 33, 34, 35, 36, 37]):
        insert_fresh(cache, toks)
    return cache


def _first_state_victim(cache):
    before = {tuple(k) for k in _states(cache)}
    cache.evict(EvictParams(mamba_num=1))
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    (gone,) = before - {tuple(k) for k in _states(cache)}
    return list(gone)


def _states(cache):
    out, stack = [], [(c, []) for c in cache.root.children.values()]
    while stack:
        x, pre = stack.pop()
        p = pre + x.key
        if x.payload.mamba_value is not None:
            out.append(p)
        stack.extend((c, p) for c in x.children.values())
    return out


def test_policies_pick_their_own_victims():
    """LRU takes the oldest state ([20]); SegLen the shortest replay times recency ([20]: 1 token from
    the root, against a branch point's 8); Marconi never a node with two children, and with a FLOP
    weight the state of least FLOPs per byte; ours a one-child-free leaf of least cost per byte."""
    assert _first_state_victim(_tree_for_policies("lru")) == [20]
    assert _first_state_victim(_tree_for_policies("seglen")) == [20]
    m = _tree_for_policies("marconi")
    assert isinstance(m.tree.policy, MarconiPolicy)
    assert _first_state_victim(m) != [1, 2, 3, 4, 5, 6, 7, 8]
    t = _tree_for_policies("tiered")
    assert isinstance(t.tree.policy, TieredPolicy)
    # [9] (1 token past a state) and [20] (1 token from the root) are the cheapest per byte to lose
    assert _first_state_victim(t) in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [20])


def test_marconi_alpha_weights_flop_efficiency():
    """[9] is matched (now the most recent state). alpha 0 is recency alone: after [20] the oldest
    one-child-or-leaf state goes ([.. 10 11]); a large alpha takes the one of least FLOPs per byte,
    however recent: [9] (one token past its parent's state) before [.. 10 11] (two tokens)."""
    c = _costs()
    assert c.saved(8, 9) / (c.t1_state_bytes + c.kv_bytes) < c.saved(8, 10) / (c.t1_state_bytes + 2 * c.kv_bytes)
    for alpha, want in ((0.0, [1, 2, 3, 4, 5, 6, 7, 8, 10, 11]), (100.0, [1, 2, 3, 4, 5, 6, 7, 8, 9])):
        cache = _tree_for_policies("marconi")
        match(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9])
        cache.tree.policy.alpha = alpha
        assert _first_state_victim(cache) == [20]
        assert _first_state_victim(cache) == want


def test_ours_keeps_a_shared_prefix_with_one_child_left():
    """A one-child node resumed by one request (a conversation's earlier turn: its next turn moved on to
    the child) goes first; one resumed by several (a shared system prompt whose other sessions were
    evicted) is a shared prefix still: it is ranked by its saving per byte, not taken as passed."""
    from tiered_cache.radix.policies import GhostCache

    g = GhostCache(TieredPolicy(_costs()), kv_tokens=1000, states=100)
    system = [1, 2, 3, 4, 5, 6, 7, 8]
    for tail in ([9], [10], [11], [12]):  # the split at [10] puts a state on the system prompt; 2 hits after
        g.request(system + tail)
    for seq in ([50, 51], [50, 51, 52]):  # a conversation: its first turn is resumed once, then passed
        g.request(seq)
    shared = g.root.children[1]
    for leaf in list(shared.children.values())[:3]:
        g._drop(leaf)
    turn = g.root.children[50]
    assert len(shared.children) == len(turn.children) == 1 and shared.resumes == 2 and turn.resumes == 1
    pol = g.policy
    cands = list(pol.candidates("state"))
    assert pol.choose("state", cands) is turn
    rest = [x for x in cands if x is not turn]
    assert pol.choose("state", rest) is not shared and pol.priority("state", shared, 10 ** 6) > 0


def test_ours_ranks_a_never_resumed_one_child_state_as_a_leaf():
    """A one-child node no request resumed (a state the admission placed inside a prompt: a block boundary,
    the request that placed it went on to make the child) is no passed turn: it is ranked by its saving
    per byte with the leaves, and the old cheap leaf [20] goes first. (Taken as passed, freq 0, every block
    state went before any leaf: policy_budgets' Mooncake replay, whose next turns resume at such states.)"""
    cache = _cache(eviction_policy="tiered", cost_model="marconi-7b")
    for toks in ([20], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]):
        insert_fresh(cache, toks)
    x, pol = node_at(cache, [1, 2, 3, 4]), cache.tree.policy
    assert len(x.children) == 1 and x.resumes == 0
    assert _first_state_victim(cache) == [20]
    assert pol.freq(x) == 1


def test_ours_takes_a_turn_resumed_as_a_leaf_as_passed_and_keeps_one_resumed_past_its_child():
    """The one-child rule counts what the resumption did. [30 31] resumed while a leaf (a turn end: its next
    turn resumed there and made the child [32]) is the passed turn: freq 0, it goes first. [1 2 3 4] resumed
    while it had its child [5 .. 8] (a request that shares the prefix and leaves it there, as the capped
    Mooncake turns all resume at one page) was reused past its child: freq 2 (1 resumption + 1). The rule
    before took every one-child node's first resumption as the one that made its child: freq 0 for both, and
    [1 2 3 4], the less recent, went first (policy_budgets' Mooncake replay at 1,024 MiB without a host: 14
    such victims, 6 reached again by later prompts)."""
    cache = _cache(eviction_policy="tiered", cost_model="marconi-7b")
    for toks in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [30, 31]):
        insert_fresh(cache, toks)
    x, pol = node_at(cache, [1, 2, 3, 4]), cache.tree.policy
    assert match(cache, [1, 2, 3, 4, 9]).best_match_node is x  # resumed with [5 .. 8] there
    turn = node_at(cache, [30, 31])
    assert match(cache, [30, 31, 32, 33]).best_match_node is turn  # resumed as a leaf ...
    insert_fresh(cache, [30, 31, 32])  # ... and the request made its child
    assert len(x.children) == len(turn.children) == 1
    assert (x.resumes, x.leaf_resumes, turn.resumes, turn.leaf_resumes) == (1, 0, 1, 1)
    assert pol.freq(turn) == 0 and pol.freq(x) == 2
    assert _first_state_victim(cache) == [30, 31]
    assert pol.freq(x) == 2


def test_recency_power_weighs_age_against_cost():
    """Two leaves of the same hits: the old one costs more per byte. At power 1 its cost keeps it and
    the recent cheap one goes; at a high power age wins and the old one goes."""
    cache = _tree_for_policies("tiered")
    pol = cache.tree.policy
    old, new = node_at(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9]), node_at(cache, [30, 31, 32, 33, 34, 35, 36, 37])
    pol.touch("state", new)
    now = max(pol.recency("state", x) for x in (old, new))
    assert pol.recency("state", old) < pol.recency("state", new)
    cost = [pol.cost_s("state", x) / pol.freed_bytes("state", x) for x in (old, new)]
    assert cost[0] != cost[1]
    for power in (1.0, 50.0):
        pol.power = power
        ranked = pol.priority("state", old, now) < pol.priority("state", new, now)
        assert ranked == (power == 50.0 or cost[0] * (now - pol.recency("state", new) + 1)
                          < cost[1] * (now - pol.recency("state", old) + 1))
    assert pol.priority("state", old, now) < pol.priority("state", new, now)


def test_policy_names_everywhere():
    assert set(config.EVICTION_POLICIES) == {"lru", *SCORED}
    for name in SCORED:
        assert isinstance(make_policy(name, _costs(), tiered=False), (MarconiPolicy, SegLenPolicy, TieredPolicy))
    with pytest.raises(InvalidArgumentError, match="eviction_policy"):
        CacheConfig(eviction_policy="lfu")
    with pytest.raises(InvalidArgumentError, match="eviction_policy"):
        make_policy("lfu", _costs(), tiered=False)
    with pytest.raises(InvalidArgumentError, match="cost_model"):
        CacheConfig(cost_model="gpt")
    with pytest.raises(InvalidTypeError, match="costs"):
        MarconiPolicy("flops")


def test_tiered_policy_with_t2_costs_a_copy():
    """With a T2 below, a T1 state's loss is a PCIe copy of its int8 bytes, not a recompute."""
    p = TieredPolicy(_costs(), tiered=True)
    q = TieredPolicy(_costs(), tiered=False)
    cache = _tree_for_policies("lru")
    x = node_at(cache, [30, 31, 32, 33, 34, 35, 36, 37])
    c = _costs()
    assert p.cost_s("state", x) == pytest.approx(c.host_state_bytes / c.pcie_bytes_per_s)
    assert q.cost_s("state", x) == pytest.approx(c.saved(0, 8) / c.prefill_flops_per_s)
    assert p.cost_s("state", x) < q.cost_s("state", x)


def test_cli_flags_reach_the_cache_config():
    """``tiered-cache stress --eviction-policy ... --state-admission ...``: the cached run's CacheConfig."""
    import argparse

    from tiered_cache.engine.stress import add_arguments, configs

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--eviction-policy", "tiered", "--state-admission", "block",
                         "--admission-block", "64", "--cost-model", "marconi-7b"])
    cached = configs(args, torch.device("cpu"))[1]
    got = cached.cache
    assert (got.eviction_policy, got.state_admission, got.admission_block, got.cost_model) == (
        "tiered", "block", 64, "marconi-7b")
    with pytest.raises(SystemExit):
        p.parse_args(["--eviction-policy", "lfu"])
