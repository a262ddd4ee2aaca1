"""``TieredCache.build_on``: the tiers above a T0 the caller owns (``tiers.protocols.T0Pool``), here two
pools whose sides share no bytes, as an engine's own pools would be. Nothing of T0 is built: the stack's
sides are the given ones; T1 (and T2 when asked) and the tree sit on top; state room is never made by
evicting KV (it frees no slot; over a built ``UnifiedPool`` it is: test_stack.py's
``test_alloc_states_evicts_kv_for_the_bytes_then_none_when_locked``); bad arguments are typed errors
naming the argument."""

from __future__ import annotations

import pytest
import torch

from tests.support.radix_util import KV_SPEC, STATE_SPEC, check_state, insert_fresh
from tiered_cache import CacheConfig, TieredCache, UnifiedPool
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix import CacheReq, HiMambaRadixCache, MatchPrefixParams, RadixKey

BASE = dict(page_size=1, kv_pages=4, t0_states=1, t1_states=8, codec="lossless", check_memory=False, backend="torch")


class SplitT0:
    """KV pages in one pool, active states in another: the sides share nothing."""

    def __init__(self, states: int = 3) -> None:
        self.kv_pool = UnifiedPool(KV_SPEC, STATE_SPEC, low_slots=32, high_slots=1, page_size=1, device="cpu",
                                   check_memory=False)
        self.st_pool = UnifiedPool(KV_SPEC, STATE_SPEC, low_slots=1, high_slots=states, page_size=1, device="cpu",
                                   check_memory=False)

    def side(self, name: str):
        sides = {"kv": self.kv_pool.side("full"), "states": self.st_pool.side("mamba")}
        if name not in sides:
            raise InvalidArgumentError("name", f"one of {sorted(sides)}", name)
        return sides[name]

    def check_invariants(self) -> None:
        self.kv_pool.check_invariants()
        self.st_pool.check_invariants()


def _on(t0, **kw) -> TieredCache:
    return TieredCache.build_on(CacheConfig(**{**BASE, **kw.pop("cfg", {})}), t0, kv_side="kv", state_side="states",
                                **kw)


def test_the_tiers_sit_on_the_given_t0():
    t0 = SplitT0()
    with _on(t0) as c:
        assert c.pool is t0 and c.kv is t0.side("kv") and c.states is t0.side("states")
        assert isinstance(c.tree, HiMambaRadixCache) and c.tree.kv is c.kv and c.tree.states is c.states
        assert c.t1.num_slots == 8 and c.host is None
        # cfg's T0 sizes are not read: the room is the given pools'
        kv_room = t0.kv_pool.side("full").available_size()
        assert kv_room >= 32 and c.free_sizes() == {"t0_kv": kv_room, "t0_states": 3, "t1": 8}
        insert_fresh(c.tree, [1, 2, 3, 4])
        req = CacheReq(token_ids=[1, 2, 3, 4], kv_indices=torch.empty(0, dtype=torch.int64))
        m = c.tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4]), cow_mamba=True, req=req))
        assert m.device_indices.numel() == 4
        check_state(c.tree, req.mamba_pool_idx, [1, 2, 3, 4])
        c.states.free(req.mamba_pool_idx)
        c.check_invariants(request_states=torch.empty(0))


def test_with_a_host_tier_on_the_given_t0():
    with _on(SplitT0(), cfg=dict(host_kv_pages=8, host_states=4)) as c:
        assert c.host is not None and c.transfer is not None
        assert c.host.regions[c.tree.host_tier.conf.kv_region].available_size() == 8


def test_state_room_is_never_made_by_evicting_kv():
    """The sides share no bytes: with every state slot held, alloc_states and a copy-on-write match
    get none, and the cached KV stays; the match is a miss with no host hit."""
    t0 = SplitT0(states=1)
    with _on(t0) as c:
        insert_fresh(c.tree, [1, 2, 3, 4])
        insert_fresh(c.tree, [7, 8])
        held = c.alloc_states(1)
        assert held is not None
        cached = c.tree.full_evictable_size()
        assert c.alloc_states(1) is None and c.tree.full_evictable_size() == cached
        req = CacheReq(token_ids=[1, 2, 3, 4, 5], kv_indices=torch.empty(0, dtype=torch.int64))
        m = c.tree.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5]), cow_mamba=True, req=req))
        assert m.device_indices.numel() == 0 and m.host_hit_length == 0 and m.mamba_host_hit_length == 0
        assert m.best_match_node is c.tree.root and req.mamba_pool_idx is None
        assert c.tree.full_evictable_size() == cached
        c.states.free(held)


@pytest.mark.parametrize("t0, kw, err, arg", [
    ("pool", {}, InvalidTypeError, "t0"),
    (SplitT0(), {"kv_side": "full"}, InvalidArgumentError, "kv_side"),
    (SplitT0(), {"state_side": "kv"}, InvalidTypeError, "state_side"),       # a KV side where states go
    (SplitT0(), {"kv_side": "states"}, InvalidTypeError, "kv_side"),
    (SplitT0(), {"cfg": dict(page_size=2)}, InvalidArgumentError, "page_size"),  # not the KV side's
    (SplitT0(), {"cfg": dict(host_kv_pages=8)}, InvalidArgumentError, "host_states"),
])
def test_bad_arguments_are_typed_errors_naming_them(t0, kw, err, arg):
    names = {"kv_side": kw.pop("kv_side", "kv"), "state_side": kw.pop("state_side", "states")}
    cfg = CacheConfig(**{**BASE, **kw.pop("cfg", {})})
    with pytest.raises(err) as e:
        TieredCache.build_on(cfg, t0, **names)
    assert e.value.arg == arg
