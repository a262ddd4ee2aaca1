"""``HostTier._reclaimable`` (would evicting host KV make room for a backup?) reads the policy's host-leaf
candidates one at a time instead of copying the set on every call: the same answers as the copying version it
replaced (kept here as the model), the same victims on random traces, and it stops reading once it has enough."""

from __future__ import annotations

import random
import types

import pytest
import torch

from tests.support.radix_util import full_snapshot, insert_fresh, make_hi_cache, match
from tiered_cache.radix import EvictParams


def _copying_reclaimable(self, short: list) -> bool:
    """The version before: a copy of the candidate set per call, a parent's host children counted per child."""
    root = self.tree.root
    got = {id(r): 0 for r, _ in short}
    want = {id(r): n for r, n in short}
    queue = list(self.tree.policy.candidates("kv_host"))
    seen: dict[int, int] = {}
    while queue and any(got[k] < want[k] for k in got):
        y = queue.pop()
        for s in self.streams:
            pages = s.get(y, "host")
            if pages is not None and id(s.region) in got:
                got[id(s.region)] += len(pages)
        p = y.parent
        if p is root or p.host_kv is None or p.full_lock_ref or p.tickets:
            continue
        seen[p.id] = seen.get(p.id, 0) + 1
        if seen[p.id] == sum(1 for c in p.children.values() if c.host_kv is not None or c.host_pending is not None):
            queue.append(p)
    return all(got[k] >= want[k] for k in got)


def _step(cache, rng: random.Random, op: int, toks: list[int]) -> None:
    if op < 5:
        insert_fresh(cache, toks)
    elif op < 7:
        match(cache, toks)
    elif op < 9:
        cache.evict(EvictParams(num_tokens=2 * rng.randrange(1, 4)))  # device KV to host-only nodes
    else:
        cache.check_hicache_events()


@pytest.mark.parametrize("seed", range(6))
def test_same_answers_and_victims_as_the_copying_version(seed):
    rng = random.Random(seed)
    new, old = make_hi_cache(page_size=2, host_pages=6), make_hi_cache(page_size=2, host_pages=6)
    old.host_tier._reclaimable = types.MethodType(_copying_reclaimable, old.host_tier)
    answers = []
    lazy = new.host_tier._reclaimable

    def both(short):
        got = lazy(short)
        assert got == _copying_reclaimable(new.host_tier, short), short
        answers.append(got)
        return got

    new.host_tier._reclaimable = both
    for _ in range(120):
        op = rng.randrange(10)
        toks = [rng.randrange(1, 4) for _ in range(2 * rng.randrange(1, 5))]
        for cache in (new, old):
            _step(cache, random.Random(op), op, toks)
        assert full_snapshot(new) == full_snapshot(old)
    new.check_invariants(request_states=torch.empty(0))
    assert True in answers and False in answers  # both answers were given: the trace reached the full host


def test_it_stops_reading_once_it_has_enough():
    """Many host leaves, a backup short of one page: a few candidates are read, not the whole set."""
    cache = make_hi_cache(page_size=2, host_pages=40, kv_pages=64)
    for t in range(1, 41):
        insert_fresh(cache, [t, t])
    cache.check_hicache_events()
    host = cache.host_tier
    assert cache.policy.size("kv_host") >= 30
    drawn = []
    lazy = cache.policy.iter_candidates

    def counting(resource):
        for y in lazy(resource):
            drawn.append(y)
            yield y

    cache.policy.iter_candidates = counting
    assert host._reclaimable([(cache.kv_region, 1)])
    assert len(drawn) == 1
    assert not host._reclaimable([(cache.kv_region, 10 ** 6)])  # not enough anywhere: every one is read
    assert len(drawn) == 1 + cache.policy.size("kv_host")
