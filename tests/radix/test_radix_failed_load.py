"""An insert over a prefix whose load back fails its checksum (the load still in flight when the insert comes):
the insert settles the load, and the caller's prefix covering the failed part is refused with an
``IntegrityError`` naming the failed load (not blamed on ``prev_prefix_len``); nothing computed on that
garbage is cached, the failed range's ids are freed once, and releasing the request leaves every pool as
it was."""

from __future__ import annotations

import pytest
import torch

from tests.support.radix_util import (
    alloc_kv,
    demote_tail,
    insert_fresh,
    insert_swa,
    make_hi_cache,
    make_swa_cache,
    match,
    node_at,
    write_kv,
    write_state,
    write_swa,
)
from tiered_cache.errors import IntegrityError, InvalidArgumentError
from tiered_cache.radix import CacheReq, EvictParams, InitLoadBackParams, InsertParams, RadixKey

TOKS = [1, 2, 3, 4, 5, 6, 7, 8]


def _demoted():
    """[1, 2] on the device with its state; [3, 4] (with a state) only on the host, KV and state. -> the cache
    and its pools' free sizes when it was new."""
    cache = make_hi_cache(page_size=2)
    fresh = _free_sizes(cache)
    demote_tail(cache)
    cache.check_invariants(request_states=torch.empty(0))
    return cache, fresh


def _free_sizes(cache):
    return (cache.kv.available_size(), cache.states.available_size(), cache.ckpt.available_size(),
            cache.kv_region.available_size(), cache.state_region.available_size())


def _loading_request(cache, what):
    """A request that matched [1, 2, 3, 4] and loads [3, 4] back from a host copy damaged in ``what``, locked
    at the loaded node, with [5..8] computed on top (its own ids and state): the load not yet applied."""
    x = node_at(cache, [1, 2, 3, 4])
    if what == "kv":
        cache.kv_region.flip_bit(x.host_kv[0], 5, 1)
    else:
        cache.state_region.flip_bit(x.payload.state_host, 3, 7)
    m = match(cache, TOKS)
    assert m.best_match_node is x and m.host_hit_length == 2
    req = CacheReq(token_ids=list(TOKS), kv_indices=torch.empty(0, dtype=torch.int64))
    ids, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    assert node is x and len(ids) == 2 and not req.load_back.done
    cache.inc_lock_ref(node)
    req.last_node, req.cache_protected_len = node, 4
    req.kv_indices = torch.cat([m.device_indices, ids, alloc_kv(cache, 4)])
    write_kv(cache, req.kv_indices[4:], TOKS[4:])
    write_state(cache, req.mamba_pool_idx, TOKS)
    return req, x


@pytest.mark.parametrize("what", ["kv", "state"])
@pytest.mark.parametrize("finished", [True, False])
def test_insert_over_a_failed_pending_load_names_the_load_and_caches_nothing(what, finished):
    cache, fresh = _demoted()
    req, x = _loading_request(cache, what)
    handle, own = req.load_back, req.kv_indices[4:].clone()
    with pytest.raises(IntegrityError, match="load back") as e:
        if finished:
            cache.cache_finished_req(req)
        else:
            cache.cache_unfinished_req(req)
    assert not isinstance(e.value, InvalidArgumentError)  # the caller's argument was valid
    assert handle.done and not handle.ok  # the insert applied the load: the request can see why
    assert cache.stats[f"corrupt_host_{what}_dropped"] == 1
    # nothing computed on the garbage is cached: [5..8] is not in the tree, [3, 4] is a miss
    m = match(cache, TOKS)
    assert len(m.device_indices) == 2 and m.host_hit_length == 0
    assert m.best_match_node is node_at(cache, [1, 2])
    # the request still owns what it owned (its ids, its state slot, its lock): the tree took none of it
    assert req.last_node is x and x.full_lock_ref == 1 and torch.equal(req.kv_indices[4:], own)
    assert req.mamba_pool_idx is not None
    cache.check_invariants(request_kv=own, request_states=req.mamba_pool_idx)
    # the contract: release the lock and recompute
    cache.cache_finished_req(req, is_insert=False)
    assert not x.alive
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    cache.evict(EvictParams(num_tokens=100, mamba_num=100, host_num_tokens=100, host_mamba_num=100))
    cache.check_hicache_events()
    assert _free_sizes(cache) == fresh  # every id came back, the failed range's once (a second free raises)


def test_insert_over_a_pending_load_that_succeeds_still_caches():
    """The same flow with an intact host copy: the insert settles the load and caches the request."""
    cache, _ = _demoted()
    x = node_at(cache, [1, 2, 3, 4])
    m = match(cache, TOKS)
    req = CacheReq(token_ids=list(TOKS), kv_indices=torch.empty(0, dtype=torch.int64))
    ids, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    cache.inc_lock_ref(node)
    req.last_node, req.cache_protected_len = node, 4
    req.kv_indices = torch.cat([m.device_indices, ids, alloc_kv(cache, 4)])
    write_kv(cache, req.kv_indices[4:], TOKS[4:])
    write_state(cache, req.mamba_pool_idx, TOKS)
    cache.cache_finished_req(req)
    assert req.load_back.done and req.load_back.ok and x.value is not None
    assert len(match(cache, TOKS).device_indices) == 8
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def test_swa_insert_over_a_failed_pending_load_names_the_load_and_caches_nothing():
    """The SWA tree: its insert used to give the dead node the failed range's ids (freed by the load) and
    then fail half-done; now the same refusal, nothing cached, every id back once the request is released."""
    cache = make_swa_cache(page_size=2, window=4)
    fresh = (cache.kv.available_size(), cache.swa.available_size(), cache.kv_region.available_size(),
             cache.swa_region.available_size())
    for toks in ([1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], list(range(1, 11))):
        insert_swa(cache, toks)
    cache.check_hicache_events()
    match(cache, [1, 2, 3, 4])
    cache.evict(EvictParams(num_tokens=6))  # [5..8] and [9, 10] to T2
    c = node_at(cache, range(1, 11))
    cache.swa_region.flip_bit(c.payload.swa_host[0], 1, 2)
    toks = list(range(1, 13))
    m = match(cache, toks)
    assert (len(m.device_indices), m.host_hit_length) == (4, 6)
    req = CacheReq(token_ids=toks, kv_indices=torch.empty(0, dtype=torch.int64))
    ids, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    handle = req.load_back
    cache.inc_lock_ref(node)
    own, own_swa = cache.kv.alloc(2), cache.swa.alloc(2)
    req.kv_indices = torch.cat([m.device_indices, ids, own])
    req.swa_kv_indices = torch.cat([m.swa_device_indices, handle.swa_indices, own_swa])
    write_kv(cache, req.kv_indices, toks)
    write_swa(cache, req.swa_kv_indices, toks)
    req.last_node, req.cache_protected_len = node, 10
    with pytest.raises(IntegrityError, match="load back"):
        cache.cache_finished_req(req)
    assert handle.done and not handle.ok and cache.stats["corrupt_host_kv_dropped"] == 1
    m = match(cache, toks)
    assert len(m.device_indices) + m.host_hit_length == 8  # [5..8] loaded fine; [9..12] is not cached
    assert torch.equal(req.kv_indices[10:], own) and node.full_lock_ref == 1
    cache.check_invariants(request_kv=own, request_states=own_swa)  # an SWA cache: request_states are SWA ids
    cache.cache_finished_req(req, is_insert=False)
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    cache.evict(EvictParams(num_tokens=100, swa_num_tokens=100, host_num_tokens=100))
    cache.check_hicache_events()
    assert (cache.kv.available_size(), cache.swa.available_size(), cache.kv_region.available_size(),
            cache.swa_region.available_size()) == fresh


@pytest.mark.parametrize("what", ["kv", "state"])
@pytest.mark.parametrize("flow", ["finished", "unfinished", "insert"])
def test_a_caller_that_ignores_a_finished_failed_load_gets_nothing_cached(what, flow):
    """The load finished (``check_hicache_events``) with ``ok`` False and the caller inserts anyway, through either
    request flow or a plain insert of the state slot the load filled: ``IntegrityError`` naming the load, nothing
    cached (the failed state load's was cached, computed on garbage), and the contract's release still works."""
    cache, fresh = _demoted()
    req, x = _loading_request(cache, what)
    cache.check_hicache_events()
    assert req.load_back.done and not req.load_back.ok  # the caller does not look
    own = req.kv_indices[4:].clone()
    with pytest.raises(IntegrityError, match="load back") as e:
        if flow == "finished":
            cache.cache_finished_req(req)
        elif flow == "unfinished":
            cache.cache_unfinished_req(req)
        else:
            cache.insert(InsertParams(key=RadixKey(TOKS), value=req.kv_indices[:8], mamba_value=req.mamba_pool_idx,
                                      prev_prefix_len=4))
    assert not isinstance(e.value, InvalidArgumentError)
    m = match(cache, TOKS)
    assert len(m.device_indices) + m.host_hit_length <= 4  # [5..8] is not cached
    assert req.last_node is x and torch.equal(req.kv_indices[4:], own) and req.mamba_pool_idx is not None
    cache.check_invariants(request_kv=own, request_states=req.mamba_pool_idx)
    cache.cache_finished_req(req, is_insert=False)
    assert not cache.rule.failed_loads  # released: the slot's mark goes with it
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    cache.evict(EvictParams(num_tokens=100, mamba_num=100, host_num_tokens=100, host_mamba_num=100))
    cache.check_hicache_events()
    assert _free_sizes(cache) == fresh


def test_a_refused_bad_insert_keeps_the_failed_loads_mark():
    """An insert with the failed load's slot refused for a bad argument (a key that is not the one loaded, and a
    ``prev_prefix_len`` past what the tree holds of it) changes nothing, the slot's mark included: the caller's
    insert that ignores ``ok`` False still gets ``IntegrityError`` (the mark was dropped before the insert's other
    checks ran, and that insert cached the state computed on garbage)."""
    cache, _ = _demoted()
    req, x = _loading_request(cache, "state")
    cache.check_hicache_events()
    assert req.load_back.done and not req.load_back.ok
    slot = req.mamba_pool_idx
    bad = [99] + TOKS[1:]
    with pytest.raises(InvalidArgumentError, match="prev_prefix_len"):
        cache.insert(InsertParams(key=RadixKey(bad), value=req.kv_indices[:8], mamba_value=slot, prev_prefix_len=4))
    assert int(slot) in cache.rule.failed_loads
    with pytest.raises(IntegrityError, match="load back"):
        cache.insert(InsertParams(key=RadixKey(TOKS), value=req.kv_indices[:8], mamba_value=slot, prev_prefix_len=4))
    m = match(cache, TOKS)
    assert len(m.device_indices) + m.host_hit_length <= 4  # [5..8] is not cached
    cache.cache_finished_req(req, is_insert=False)
    assert not cache.rule.failed_loads


@pytest.mark.parametrize("release", ["free_request_state", "by_hand"])
def test_a_slot_freed_by_the_engine_loses_the_failed_loads_mark(release):
    """An engine that frees a request's state slot itself (the SGLang backend does) frees it through
    ``free_request_state``: the mark goes, and the slot's next owner, resuming from a device hit of the same
    prefix (no copy-on-write: the engine fills its slot itself) and inserting with ``prev_prefix_len`` past the
    failed prefix, is cached. Freed behind the tree's back (``by_hand``), the mark stays and that correct insert
    is refused: why the backend must not free the slot itself."""
    cache, _ = _demoted()
    req, x = _loading_request(cache, "state")
    cache.check_hicache_events()
    slot = req.mamba_pool_idx
    insert_fresh(cache, TOKS[:4])  # another request recomputed [1..4]: a device hit now
    if release == "free_request_state":
        cache.free_request_state(slot)
        assert int(slot) not in cache.rule.failed_loads
    else:
        cache.states.free(slot)
    again = cache.states.alloc(1)
    assert int(again) == int(slot)
    m = match(cache, TOKS)
    hit = len(m.device_indices)
    assert hit == 4
    ids = torch.cat([m.device_indices, alloc_kv(cache, 8 - hit)])
    write_kv(cache, ids[hit:], TOKS[hit:])
    write_state(cache, again, TOKS)
    params = InsertParams(key=RadixKey(TOKS), value=ids, mamba_value=again, prev_prefix_len=hit)
    if release == "by_hand":
        with pytest.raises(IntegrityError, match="load back"):
            cache.insert(params)
        return
    res = cache.insert(params)
    assert res.cached_len == 8 and res.mamba_stored


def test_a_slot_a_failed_load_filled_serves_the_next_owner():
    """The caller frees the failed load's slot itself (not through the cache) and the slot is taken again: the
    next owner's insert, computed from scratch (``prev_prefix_len`` 0), is cached and the mark goes."""
    cache, _ = _demoted()
    req, x = _loading_request(cache, "state")
    cache.check_hicache_events()
    slot = req.mamba_pool_idx
    cache.states.free(slot)  # by hand: the tree does not see it
    assert int(slot) in cache.rule.failed_loads
    again = cache.states.alloc(1)
    assert int(again) == int(slot)
    ids = alloc_kv(cache, 8)
    write_kv(cache, ids, TOKS)
    write_state(cache, again, TOKS)
    res = cache.insert(InsertParams(key=RadixKey(TOKS), value=ids, mamba_value=again, prev_prefix_len=0))
    assert res.cached_len == 8 and res.mamba_stored and not cache.rule.failed_loads
    cache.states.free(again)
    cache.kv.free(req.kv_indices[4:])  # the first owner's, released by hand too
    cache.dec_lock_ref(x)
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
