"""The two counts of a node: ``resumes`` (matches that resumed at its state: what the eviction policies read)
and ``hit_count`` (matches that passed through it: SGLang's count, which write_through_selective backs up by).

Until they were apart, write_through_selective bumped the count the policies read on every node of a matched
path, so a shared prefix a request only passed looked resumed (and a one-child one passed: ``TieredPolicy``'s
freq 0), and a split gave its new upper node, which holds no state, the lower node's resumptions."""

from __future__ import annotations

import random

import torch

from tests.support.radix_util import insert_fresh, make_hi_cache, match, node_at
from tiered_cache import costs
from tiered_cache.radix import EvictParams
from tiered_cache.radix.policies import GhostCache, PrefixCosts, TieredPolicy


def _costs():
    return PrefixCosts.of(costs.MARCONI_7B, tokens_per_key=64, t1_int8=False)


def _hi(write_policy: str):
    return make_hi_cache(write_policy=write_policy, write_through_threshold=2, kv_pages=512, t1_slots=32,
                         host_states=32, eviction_policy="tiered", cost_model="marconi-7b")


def _nodes(cache) -> dict:
    """Every node below the root by the tokens from the root to its end."""
    out, stack = {}, [(c, ()) for c in cache.root.children.values()]
    while stack:
        x, pre = stack.pop()
        p = pre + tuple(x.key)
        out[p] = x
        stack.extend((c, p) for c in x.children.values())
    return out


def _facts(cache) -> dict:
    pol = cache.tree.policy
    return {p: (pol.facts.hits(x), pol.freq(x)) for p, x in _nodes(cache).items() if x.payload.resumable}


def _state_victims(cache) -> list:
    """The order the policy takes the T1 states in, evicting them one at a time (each goes to T2); the backups
    in flight finish first (a node with one is no victim)."""
    out = []
    while True:
        cache.check_hicache_events()
        before = {p for p, x in _nodes(cache).items() if x.payload.mamba_value is not None}
        if not before or cache.evict(EvictParams(mamba_num=1)).mamba_num_evicted != 1:
            return out
        after = {p for p, x in _nodes(cache).items() if x.payload.mamba_value is not None}
        (gone,) = before - after
        out.append(gone)


def _drive(cache, rng: random.Random) -> None:
    """Sessions of a few turns over a shared system prompt: each turn matches, then inserts, its sequence."""
    system = [rng.randrange(1, 4) for _ in range(3)]
    seqs = [list(system)]
    for _ in range(10):
        base = rng.choice(seqs)
        seq = base + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 4))]
        match(cache, seq)
        insert_fresh(cache, seq)
        seqs.append(seq)
        if rng.random() < 0.5:
            match(cache, rng.choice(seqs))


def test_write_through_selective_leaves_the_policy_facts_alone():
    """The same requests under write_back and write_through_selective give every state the same resumptions
    and freq, and the tiered policy takes the states in the same order; under selective some node counted
    more path matches than resumptions (the case that used to leak into the policy)."""
    leaked = 0
    for seed in range(8):
        caches = [_hi(w) for w in ("write_back", "write_through_selective")]
        for c in caches:
            _drive(c, random.Random(seed))
            c.check_invariants(request_states=torch.empty(0))
        back, selective = caches
        assert _facts(back) == _facts(selective)
        leaked += sum(x.hit_count > x.resumes for x in _nodes(selective).values())
        assert all(x.hit_count == 0 for x in _nodes(back).values())
        assert _state_victims(back) == _state_victims(selective)
    assert leaked


def test_a_passed_prefix_is_no_resumption():
    """[1 2] with one child [3 4]: a request resumed at [3 4] passed [1 2]. Under selective that is a path
    match of [1 2] (hit_count 1) but no resumption: its freq stays a never-resumed node's (1), not a passed
    turn's (0)."""
    for w in ("write_back", "write_through_selective"):
        cache = _hi(w)
        insert_fresh(cache, [1, 2])
        insert_fresh(cache, [1, 2, 3, 4])
        assert match(cache, [1, 2, 3, 4, 9]).best_match_node is node_at(cache, [1, 2, 3, 4])
        x, pol = node_at(cache, [1, 2]), cache.tree.policy
        assert (x.resumes, node_at(cache, [1, 2, 3, 4]).resumes) == (0, 1)
        assert x.hit_count == (w == "write_through_selective")
        assert pol.facts.hits(x) == 0 and pol.freq(x) == 1


def test_a_split_gives_the_new_prefix_no_resumptions():
    """[1 2 3 4] resumed twice, then split at 2 by [1 2 5 6]: the new [1 2] holds no state a request resumed
    from (0 resumptions), [3 4] keeps its 2; both passed twice (hit_count 2 each under selective)."""
    cache = _hi("write_through_selective")
    insert_fresh(cache, [1, 2, 3, 4])
    for _ in range(2):
        match(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 5, 6])
    new, child = node_at(cache, [1, 2]), node_at(cache, [1, 2, 3, 4])
    assert child.parent is new and len(new.children) == 2
    assert (new.resumes, child.resumes) == (0, 2) and (new.hit_count, child.hit_count) == (2, 2)
    assert cache.tree.policy.facts.hits(new) == 0
    cache.check_invariants(request_states=torch.empty(0))


def test_the_ghost_counts_resumptions_the_same_way():
    """The ghost's split gives its new branch point no resumptions and the lower node keeps them; a copy keeps
    every node's count."""
    g = GhostCache(TieredPolicy(_costs()), kv_tokens=1000, states=100)
    g.request([1, 2, 3, 4])
    g.request([1, 2, 3, 4, 7])
    g.request([1, 2, 3, 4, 8])  # resumes at [1 2 3 4] twice in all
    low = g.root.children[1]
    assert low.resumes == 2
    g.request([1, 2, 5])  # split at 2
    mid = g.root.children[1]
    assert mid is not low and low.parent is mid and (mid.resumes, low.resumes) == (0, 2)
    h = g.copy(TieredPolicy(_costs()))
    assert sorted(x.resumes for x in h.nodes()) == sorted(x.resumes for x in g.nodes())
