"""The tree's trusted paths leave the state its checked paths leave (issue 22: ids validated once).

With ``validate`` on, an insert checks the caller's KV pages and T0 slot once and then frees duplicates
through the trusted ``free_pages``, marks ownership from the checked pages and stores into T1 through
``store_rows``; a ``cow_mamba`` match loads through ``load_rows``. With ``validate`` off the tree uses
the checked doors (``kv.free``, ``store_from_active``, ``load_to_active``). Driven by the same random
engine turns, the two caches must agree on everything observable after every step: the tree, sizes,
stats, LRU stamps, the KV allocator's tables, T1's bytes and the states a match loads.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.support.radix_util import KV_SPEC, STATE_SPEC, full_snapshot, insert_after_match
from tiered_cache.config import CacheConfig
from tiered_cache.radix import EvictParams, MatchPrefixParams, RadixKey
from tiered_cache.stack import TieredCache

PS = 2


def build(validate: bool, codec: str):
    cfg = CacheConfig(page_size=PS, kv_pages=48, t0_states=6, t1_states=10, codec=codec, check_memory=False,
                      backend="torch", validate=validate)
    return TieredCache.build(cfg, kv=KV_SPEC, state=STATE_SPEC, device="cpu").tree


class Req:
    def __init__(self, slot):
        self.mamba_pool_idx = slot


def turn(cache, toks: list[int], dup: bool):
    """An engine turn: match (state loaded into the request's slot), lock, KV for the rest, insert with the
    hit as ``prev_prefix_len`` (``dup``: 0, so the hit's ids come again as duplicates), unlock, free.
    -> the loaded state's bytes (or None), the insert's result."""
    slot = cache.states.alloc(1)
    assert slot is not None
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(toks), req=Req(slot), cow_mamba=True))
    loaded = None
    if len(m.device_indices):
        phys = cache.states.translate(slot)
        loaded = (cache.states.temporal_view_all()[:, phys].clone(), cache.states.conv_view_all(0)[:, phys].clone())
    return loaded, insert_after_match(cache, toks, m, slot, dup)


def observed(cache):
    a = cache.kv.allocator
    return (full_snapshot(cache), a._v2p.tolist(), sorted(a._free_vids), bytes(cache.ckpt.raw.numpy()),
            sorted(cache.ckpt.allocator.allocated_ids()))


@pytest.mark.parametrize("codec", ["int8", "lossless"])
@pytest.mark.parametrize("seed", range(6))
def test_trusted_and_checked_paths_leave_the_same_state(seed, codec):
    rng = random.Random(seed)
    fast, checked = build(True, codec), build(False, codec)
    calls = {"store_rows": 0, "load_rows": 0, "store_from_active": 0, "load_to_active": 0}
    def counting(fn, name, is_fast):
        def counted(*a, **kw):
            calls[name] += is_fast or name.endswith("active")  # the checked cache's inner *_rows not counted
            return fn(*a, **kw)
        return counted

    for cache in (fast, checked):
        for name in calls:
            setattr(cache.ckpt, name, counting(getattr(cache.ckpt, name), name, cache is fast))
    dup_hits = 0
    stems = [[rng.randrange(1, 40) for _ in range(rng.randrange(2, 9))] for _ in range(4)]
    for step in range(40):
        toks = rng.choice(stems) + [rng.randrange(1, 40) for _ in range(rng.randrange(0, 9))]
        if rng.random() < 0.3:
            stems.append(toks)
        dup = rng.random() < 0.3
        evict = rng.random() < 0.25
        n = rng.randrange(1, 12)
        got = []
        for cache in (fast, checked):
            got.append(turn(cache, toks, dup))
            if evict:
                got.append(cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted)
            cache.check_invariants(request_states=torch.empty(0, dtype=torch.int64))
        half = len(got) // 2
        (la, ra), (lb, rb) = got[0], got[half]
        dup_hits += dup and ra[0] > 0  # duplicates freed: through free_pages in ``fast``
        assert ra == rb and got[1:half] == got[half + 1:], f"step {step}: results differ"
        assert (la is None) == (lb is None) and (la is None or all(torch.equal(x, y) for x, y in zip(la, lb)))
        assert observed(fast) == observed(checked), f"step {step}: the caches differ"
    # both paths ran: the fast cache never took the checked doors, the checked one always did
    assert calls["store_rows"] > 0 and calls["load_rows"] > 0 and dup_hits > 0, (calls, dup_hits)
    assert calls["store_from_active"] == calls["store_rows"] and calls["load_to_active"] == calls["load_rows"]
    assert np.count_nonzero(fast.kv.allocator._v2p >= 0) > 1  # something stayed cached
