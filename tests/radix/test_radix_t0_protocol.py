"""The trees take any T0 that offers ``tiers.protocols.T0Pool``: here two pools whose sides share no
bytes (the KV side of one ``UnifiedPool``, the state side of another), as an engine's own pools would be."""

from __future__ import annotations

import pytest
import torch

from tests.support.radix_util import KV_SPEC, STATE_SPEC, check_kv, check_state, insert_fresh, match
from tiered_cache import InvalidTypeError, T0Pool, UnifiedPool
from tiered_cache.radix import CacheReq, EvictParams, HiMambaRadixCache
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool


class SplitT0:
    """T0 as two pools that share nothing: KV pages in one, active states in the other."""

    def __init__(self) -> None:
        self.kv_pool = UnifiedPool(KV_SPEC, STATE_SPEC, low_slots=32, high_slots=1, page_size=1, device="cpu",
                                   check_memory=False)
        self.st_pool = UnifiedPool(KV_SPEC, STATE_SPEC, low_slots=1, high_slots=6, page_size=1, device="cpu",
                                   check_memory=False)
        self.checked = 0

    def side(self, name: str):
        return {"kv": self.kv_pool.side("full"), "states": self.st_pool.side("mamba")}[name]

    def check_invariants(self) -> None:
        self.checked += 1
        self.kv_pool.check_invariants()
        self.st_pool.check_invariants()


def _cache(t0) -> HiMambaRadixCache:
    t1 = Int8CheckpointPool(STATE_SPEC, 8, device="cpu", codec="lossless", check_memory=False, backend="torch")
    return HiMambaRadixCache(t0, t1, kv_side="kv", state_side="states")


def test_a_tree_over_pools_that_share_no_bytes():
    t0 = SplitT0()
    assert isinstance(t0, T0Pool)
    cache = _cache(t0)
    kv_free, st_free = cache.kv.available_size(), cache.states.available_size()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 7, 8])
    m = match(cache, [1, 2, 3, 4])
    assert len(m.device_indices) == 4
    check_kv(cache, m.device_indices, [1, 2, 3, 4])
    req = CacheReq(token_ids=[1, 2, 7, 8], kv_indices=torch.empty(0, dtype=torch.int64))
    m = match(cache, [1, 2, 7, 8], cow_mamba=True, req=req)
    assert len(m.device_indices) == 4 and req.mamba_pool_idx is not None
    check_state(cache, req.mamba_pool_idx, [1, 2, 7, 8])  # lossless: exact, out of a slot of the other pool
    cache.check_invariants(request_states=req.mamba_pool_idx)
    assert t0.checked >= 1  # the tree's invariants include the pool's own
    cache.states.free(req.mamba_pool_idx)
    r = cache.evict(EvictParams(num_tokens=8, mamba_num=2))
    assert r.num_tokens_evicted == 6 and r.mamba_num_evicted == 2
    assert (cache.kv.available_size(), cache.states.available_size()) == (kv_free, st_free)
    cache.check_invariants(request_states=torch.empty(0))


class NoSides:
    def check_invariants(self) -> None:
        pass


class BadSide(SplitT0):
    def side(self, name: str):
        return object() if name == "kv" else super().side(name)


@pytest.mark.parametrize("t0, arg", [(NoSides(), "pool"), ("pool", "pool"), (BadSide(), "kv_side")])
def test_a_t0_without_the_protocol_is_refused_naming_the_argument(t0, arg):
    with pytest.raises(InvalidTypeError, match=f"^{arg}:"):
        _cache(t0)
