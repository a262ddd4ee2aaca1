"""``check_invariants`` covers the T1 NaN/inf flags (``tiers/finite_flags.py``, read by ``radix/nonfinite.py``):
a cached state counts as finite only once its store's flag was read (until then the tree awaits it, for the
slot the node holds), and no free T1 slot has a flag still awaited. Each check is shown to fail on a tree
broken the way it guards against, and to hold again once repaired."""

from __future__ import annotations

import pytest
import torch

from tests.support.radix_util import insert_fresh, make_cache, node_at, write_kv, write_state
from tiered_cache.radix import InsertParams, RadixKey


def _insert_nan(cache, toks):
    """``toks`` inserted with a NaN in the caller's temporal state (its T1 flag is set on the store)."""
    ids = cache.kv.alloc(len(toks))
    write_kv(cache, ids, toks)
    slot = cache.states.alloc(1)
    write_state(cache, slot, toks)
    cache.states.temporal_view_all()[1, int(cache.states.translate(slot))].view(-1)[3] = float("nan")
    res = cache.insert(InsertParams(key=RadixKey(toks), value=ids, mamba_value=slot))
    assert res.mamba_stored and res.cached_len == len(toks)
    cache.states.free(slot)


def test_an_unread_flag_is_awaited_for_the_slot_the_node_holds():
    cache = make_cache(page_size=2)
    insert_fresh(cache, [1, 2])
    _insert_nan(cache, [1, 2, 3, 4])
    x = node_at(cache, [1, 2, 3, 4])
    slot = x.payload.t1_slot
    assert x.payload.t1_unverified == slot
    cache.check_invariants(request_states=torch.empty(0))  # awaited: fine until it is read
    x.payload.t1_unverified = None  # a bug that takes the state as finite before its flag was read
    with pytest.raises(AssertionError, match="never read"):
        cache.check_invariants(request_states=torch.empty(0))
    x.payload.t1_unverified = node_at(cache, [1, 2]).payload.t1_slot  # awaited for another node's slot
    with pytest.raises(AssertionError, match="awaited for slot"):
        cache.check_invariants(request_states=torch.empty(0))
    x.payload.t1_unverified = slot
    cache.check_hicache_events()  # the flag is read: the NaN state is dropped
    assert x.payload.mamba_value is None and cache.stats["nonfinite_states"] == 1
    cache.check_invariants(request_states=torch.empty(0))


def test_no_free_t1_slot_has_a_flag_awaited():
    cache = make_cache(page_size=2)
    insert_fresh(cache, [1, 2])
    t1, (sid,) = cache.ckpt.alloc_ids(1)
    slot = cache.states.alloc(1)
    write_state(cache, slot, [5, 6])
    cache.ckpt.store_from_active(cache.states, slot, t1)
    cache.states.free(slot)
    assert cache.ckpt.flags_pending(sid)
    cache.ckpt.allocator.free_owned([sid])  # a bug: freed without forgetting its flags (ckpt.free does both)
    with pytest.raises(AssertionError, match="free T1 slots with a store's NaN/inf flag"):
        cache.check_invariants(request_states=torch.empty(0))
    cache.ckpt.flags.forget([sid])
    cache.check_invariants(request_states=torch.empty(0))
