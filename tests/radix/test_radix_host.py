"""The host tier (T2) of HiMambaRadixCache on real pools (CPU): tiered matches, load back, write
policies, host room, corrupt entries, splits of host nodes. GPU variants run the same on CUDA streams."""

from __future__ import annotations

import pytest
import torch

from tests.support.radix_util import (
    alloc_kv,
    check_kv,
    check_state,
    demote_tail,
    insert_fresh,
    make_hi_cache,
    match,
    node_at,
    write_kv,
    write_state,
)
from tiered_cache.radix import (
    CacheReq,
    EvictParams,
    InitLoadBackParams,
    InsertParams,
)


def req_for(toks):
    return CacheReq(token_ids=list(toks), kv_indices=torch.empty(0, dtype=torch.int64))


def rows_of(cache, ids):
    ps = cache.page_size
    return cache.kv.rows_bytes()[cache.kv.translate(ids[::ps]) // ps].clone()


def tiered(codec="int8", device="cpu"):
    """device [1,2] with a T1 state -> host-only [3,4] (tombstone) -> host-only [5,6] with a T2 state;
    plus [9,10] beside [5,6]. Returns the cache, the KV rows [3..6] had, and the dequantized state at 6."""
    cache = make_hi_cache(page_size=2, codec=codec, device=device)
    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [1, 2, 3, 4, 5, 6])
    insert_fresh(cache, [1, 2, 3, 4, 9, 10])  # splits [3..6]: [3, 4] becomes a tombstone
    cache.check_hicache_events()  # write-through backups land
    assert all(node_at(cache, t).host_kv is not None for t in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]))
    ref = req_for([1, 2, 3, 4, 5, 6])
    m = match(cache, [1, 2, 3, 4, 5, 6], cow_mamba=True, req=ref)  # the dequantized checkpoint at 6
    assert len(m.device_indices) == 6
    saved = rows_of(cache, m.device_indices[2:])
    state = (cache.states.temporal_view_all()[:, cache.states.translate(ref.mamba_pool_idx)[0]].clone(),
             cache.states.conv_view_all(0)[:, cache.states.translate(ref.mamba_pool_idx)[0]].clone())
    cache.states.free(ref.mamba_pool_idx)
    match(cache, [1, 2, 3, 4, 9, 10])
    match(cache, [1, 2])  # [1, 2] is now the most recent in KV and state
    r = cache.evict(EvictParams(mamba_num=1))  # [5, 6]'s state: T1 -> T2
    assert r.mamba_num_evicted == 1
    r = cache.evict(EvictParams(num_tokens=6))  # [5, 6], [9, 10], then [3, 4] demoted; [1, 2] stays
    assert r.num_tokens_evicted == 6
    cache.check_invariants(request_states=torch.empty(0))
    return cache, saved, state


@pytest.mark.parametrize("codec", ["int8", "lossless"])
def test_tiered_match_and_load_back(codec):
    cache, saved, state = tiered(codec)
    n12, n34, n56 = (node_at(cache, t) for t in ([1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]))
    assert n12.value is not None and n12.payload.mamba_value is not None
    assert n34.value is None and n34.host_kv is not None and n34.is_tombstone
    assert n56.value is None and n56.payload.mamba_value is None and n56.payload.state_host is not None
    m = match(cache, [1, 2, 3, 4, 5, 6, 99])
    assert len(m.device_indices) == 2 and m.last_device_node is n12
    assert (m.host_hit_length, m.mamba_host_hit_length) == (4, 1)
    assert m.best_match_node is n56 and m.last_host_node is n56
    req = req_for([1, 2, 3, 4, 5, 6, 99])
    ids, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    assert node is n56 and len(ids) == 4 and req.mamba_pool_idx is not None
    assert n56.full_lock_ref == 1 and n34.full_lock_ref == 1 and n12.full_lock_ref == 1  # the load's own lock
    assert n34.value is None and n56.value is None  # the tree changes only when the ticket completes
    h = req.load_back
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=req.mamba_pool_idx)
    cache.check_hicache_events()
    assert h.done and h.ok
    assert torch.equal(n34.value, ids[:2]) and torch.equal(n56.value, ids[2:])
    assert torch.equal(rows_of(cache, ids), saved)  # KV byte-equal to what was demoted
    got = cache.states.temporal_view_all()[:, cache.states.translate(req.mamba_pool_idx)[0]]
    assert torch.equal(got, state[0])  # the dequantized checkpoint, bit for bit
    assert torch.equal(cache.states.conv_view_all(0)[:, cache.states.translate(req.mamba_pool_idx)[0]], state[1])
    # host copies stay
    assert n34.host_kv is not None and n56.host_kv is not None and n56.payload.state_host is not None
    assert n56.full_lock_ref == 0 and n12.full_lock_ref == 0 and not n56.tickets  # locks released
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=req.mamba_pool_idx)
    # the state at 6 came back to T1 (promoted from the load's scratch slot); its T2 copy stays
    assert n56.payload.mamba_value is not None and cache.stats["state_promotes"] == 1
    m2 = match(cache, [1, 2, 3, 4, 5, 6, 99])
    # KV and state all on the device now: a device hit, no host part (was: a state host hit every time)
    assert m2.kv_hit_length == 6 and m2.host_hit_length == 0 and m2.mamba_host_hit_length == 0
    assert m2.last_device_node is n56 and len(m2.device_indices) == 6
    full = torch.cat([m.device_indices, ids])
    check_kv(cache, full, [1, 2, 3, 4, 5, 6])
    req2 = req_for([1, 2, 3, 4, 5, 6, 99])
    m3 = match(cache, [1, 2, 3, 4, 5, 6, 99], cow_mamba=True, req=req2)  # the promoted state, from T1
    assert m3.host_hit_length == 0 and torch.equal(
        cache.states.temporal_view_all()[:, cache.states.translate(req2.mamba_pool_idx)[0]], state[0])
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64),
                           request_states=torch.cat([req.mamba_pool_idx, req2.mamba_pool_idx]))
    cache.states.free(req.mamba_pool_idx)
    cache.states.free(req2.mamba_pool_idx)
    # T1 evicting the promoted state keeps the node on its T2 copy: nothing is copied down again
    demotes, h56 = cache.stats["state_demotes"], n56.payload.state_host
    n = cache.evict(EvictParams(mamba_num=8)).mamba_num_evicted  # every T1 state, n56's among them
    assert n56.payload.mamba_value is None and n56.payload.state_host == h56
    assert cache.stats["state_demotes"] == demotes + n - 1  # the others go down; n56's is already there
    cache.check_invariants(request_states=torch.empty(0))


def test_load_back_then_lock_and_cache_the_request():
    cache, _, _ = tiered("lossless")
    toks = [1, 2, 3, 4, 5, 6, 7, 8]
    m = match(cache, toks)
    req = req_for(toks)
    ids, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    cache.inc_lock_ref(node)  # the engine locks where its prefix ends, as after a device hit
    req.last_node, req.cache_protected_len = node, 6
    req.kv_indices = torch.cat([m.device_indices, ids, alloc_kv(cache, 2)])
    cache.check_hicache_events()
    assert req.load_back.ok
    check_state(cache, req.mamba_pool_idx, toks[:6])
    write_kv(cache, req.kv_indices, toks)
    write_state(cache, req.mamba_pool_idx, toks)
    cache.cache_finished_req(req)
    cache.check_hicache_events()
    m = match(cache, toks)
    assert len(m.device_indices) == 8 and m.host_hit_length == 0
    check_kv(cache, m.device_indices, toks)
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def test_kv_only_host_hit_below_threshold_is_not_loaded():
    for threshold, loaded in ((4, False), (2, True)):
        cache = make_hi_cache(page_size=2, load_back_threshold=threshold)
        insert_fresh(cache, [1, 2])
        insert_fresh(cache, [1, 2, 3, 4])
        cache.check_hicache_events()
        match(cache, [1, 2])
        cache.evict(EvictParams(num_tokens=2))  # [3, 4]'s KV to host; its state stays in T1
        m = match(cache, [1, 2, 3, 4])
        assert (len(m.device_indices), m.host_hit_length, m.mamba_host_hit_length) == (2, 2, 0)
        req = req_for([1, 2, 3, 4])
        ids, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
        assert (len(ids) == 2) == loaded and (node is m.best_match_node) == loaded
        cache.check_hicache_events()
        if loaded:
            check_kv(cache, torch.cat([m.device_indices, ids]), [1, 2, 3, 4])
            check_state(cache, req.mamba_pool_idx, [1, 2, 3, 4])  # dequantized from T1 directly
            cache.states.free(req.mamba_pool_idx)
        else:
            assert node is m.last_device_node and req.mamba_pool_idx is None
            assert cache.stats["load_back_below_threshold"] == 1
        cache.check_invariants(request_states=torch.empty(0))


def test_write_through_demotes_backed_up_and_deletes_the_rest():
    cache = make_hi_cache(host_pages=2)
    insert_fresh(cache, [1, 2])
    cache.check_hicache_events()
    cache.inc_lock_ref(node_at(cache, [1, 2]))  # its host copy cannot make room for the next backup
    insert_fresh(cache, [5, 6])  # host full and nothing evictable there: never backed up
    assert cache.stats["backup_no_room"] == 1 and node_at(cache, [5, 6]).host_pending is None
    cache.dec_lock_ref(node_at(cache, [1, 2]))
    r = cache.evict(EvictParams(num_tokens=4))
    assert r.num_tokens_evicted == 4
    n12 = node_at(cache, [1, 2])
    assert n12.value is None and n12.host_kv is not None  # demoted: still in the tree
    assert (5,) not in cache.root.children and 5 not in cache.root.children  # deleted
    assert match(cache, [1, 2]).host_hit_length == 2
    cache.check_invariants(request_states=torch.empty(0))


def test_write_through_selective_backs_up_after_n_hits():
    cache = make_hi_cache(write_policy="write_through_selective", write_through_threshold=2)
    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [3, 4])
    assert cache.engine.pending == 0
    match(cache, [1, 2])
    assert node_at(cache, [1, 2]).host_pending is None
    match(cache, [1, 2])  # second hit: backed up
    assert node_at(cache, [1, 2]).host_pending is not None
    cache.check_invariants(request_states=torch.empty(0))
    cache.check_hicache_events()
    cache.evict(EvictParams(num_tokens=4))
    assert node_at(cache, [1, 2]).host_kv is not None and 3 not in cache.root.children
    cache.check_invariants(request_states=torch.empty(0))


def test_write_back_writes_then_demotes():
    cache = make_hi_cache(page_size=2, write_policy="write_back")
    insert_fresh(cache, [1, 2, 3, 4])
    x = node_at(cache, [1, 2, 3, 4])
    assert x.host_kv is None and cache.engine.pending == 0  # nothing written while cached
    saved = rows_of(cache, x.value)
    assert cache.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4
    assert x.alive and x.value is None and x.host_kv is not None and not x.tickets  # written, then demoted
    m = match(cache, [1, 2, 3, 4])
    assert m.host_hit_length == 4 and m.best_match_node is x
    req = req_for([1, 2, 3, 4])
    ids, _ = cache.init_load_back(InitLoadBackParams(x, 4, req=req))
    cache.check_hicache_events()
    assert torch.equal(rows_of(cache, ids), saved)
    check_state(cache, req.mamba_pool_idx, [1, 2, 3, 4])
    cache.check_invariants(request_states=req.mamba_pool_idx)


def test_host_full_evicts_host_lru_then_retries_else_reports_and_changes_nothing():
    cache = make_hi_cache(host_pages=4)
    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [3, 4])
    cache.check_hicache_events()
    insert_fresh(cache, [5, 6])  # host full: [1, 2]'s copy (host LRU) goes, then the backup fits
    assert node_at(cache, [1, 2]).host_kv is None and node_at(cache, [5, 6]).host_pending is not None
    cache.check_hicache_events()
    for t in ([3, 4], [5, 6]):
        cache.inc_lock_ref(node_at(cache, t))
    def where():
        return [(t, node_at(cache, t).host_kv, node_at(cache, t).value.tolist()) for t in ([1, 2], [3, 4], [5, 6])]

    before = where()
    free_before = cache.kv_region.available_size()
    insert_fresh(cache, [7, 8])  # only locked copies left: refused, nothing changes
    assert cache.stats["backup_no_room"] == 1
    assert where() == before
    assert cache.kv_region.available_size() == free_before and node_at(cache, [7, 8]).host_pending is None
    cache.check_invariants(request_states=torch.empty(0))


def test_t1_full_demotes_states_to_host_and_t2_full_drops_lru():
    cache = make_hi_cache(t1_slots=2, host_states=1)
    insert_fresh(cache, [1])
    insert_fresh(cache, [2])
    insert_fresh(cache, [3])  # T1 full: [1]'s state (LRU) is demoted to T2
    n1 = node_at(cache, [1])
    assert n1.payload.mamba_value is None and n1.payload.state_host is not None
    assert match(cache, [1]).mamba_host_hit_length == 1
    insert_fresh(cache, [4])  # T1 full, T2 full: [1]'s host state goes (T2 LRU), then [2]'s moves down
    assert not n1.alive and node_at(cache, [2]).payload.state_host is not None
    cache.check_invariants(request_states=torch.empty(0))


@pytest.mark.parametrize("what", ["kv", "state"])
@pytest.mark.parametrize("locked", [False, True])
def test_corrupt_host_entry_is_a_miss_never_a_hit(what, locked):
    cache = make_hi_cache(page_size=2)
    demote_tail(cache)
    x = node_at(cache, [1, 2, 3, 4])
    if what == "kv":
        cache.kv_region.flip_bit(x.host_kv[0], 5, 1)
    else:
        cache.state_region.flip_bit(x.payload.state_host, 3, 7)
    m = match(cache, [1, 2, 3, 4])
    assert m.best_match_node is x and m.host_hit_length == 2
    req = req_for([1, 2, 3, 4])
    ids, node = cache.init_load_back(InitLoadBackParams(x, 2, req=req))
    if locked:
        cache.inc_lock_ref(node)
    cache.check_hicache_events()
    assert req.load_back.done and not req.load_back.ok
    assert cache.engine.stats["checksum_failures"] == 1
    assert cache.stats[f"corrupt_host_{'kv' if what == 'kv' else 'state'}_dropped"] == 1
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=req.mamba_pool_idx)
    m = match(cache, [1, 2, 3, 4])
    assert m.best_match_node is node_at(cache, [1, 2]) and m.host_hit_length == 0  # a shorter hit
    if locked:
        cache.dec_lock_ref(node)
    assert not x.alive or not locked
    cache.states.free(req.mamba_pool_idx)
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    cache.evict(EvictParams(num_tokens=100, mamba_num=100, host_num_tokens=100, host_mamba_num=100))
    assert cache.kv_region.available_size() == cache.kv_region.allocator.num_slots


def test_split_of_a_host_node_partitions_its_pages_also_in_flight():
    cache = make_hi_cache(page_size=2)
    insert_fresh(cache, [1, 2, 3, 4, 5, 6])
    x = node_at(cache, [1, 2, 3, 4, 5, 6])
    pending = list(x.host_pending)
    insert_fresh(cache, [1, 2, 3, 4, 7, 8])  # splits x while its backup is in flight
    top = node_at(cache, [1, 2, 3, 4])
    assert top.host_pending == pending[:2] and x.host_pending == pending[2:]
    assert top.tickets == x.tickets and len(x.tickets) == 1 and top in x.tickets[0].nodes
    cache.check_invariants(request_states=torch.empty(0))
    cache.check_hicache_events()
    assert top.host_kv == pending[:2] and x.host_kv == pending[2:]
    saved = rows_of(cache, x.value)
    match(cache, [1, 2, 3, 4, 7, 8])
    cache.evict(EvictParams(num_tokens=2))  # x: demoted
    assert x.value is None
    insert_fresh(cache, [1, 2, 9, 10])  # splits top, on the device, with its host copy
    up = node_at(cache, [1, 2])
    assert up.host_kv == pending[:1] and top.host_kv == pending[1:2]
    m = match(cache, [1, 2, 3, 4, 5, 6])
    req = req_for([1, 2, 3, 4, 5, 6])
    # [1, 2] and [3, 4] are tombstones on the device: the usable device part is empty, and the ids
    # init_load_back returns start with theirs (no copy) before the loaded [5, 6]
    assert len(m.device_indices) == 0 and m.host_hit_length == 6 and m.mamba_host_hit_length == 0
    ids, _ = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    assert torch.equal(ids[:2], up.value) and torch.equal(ids[2:4], top.value)
    cache.check_hicache_events()
    assert torch.equal(rows_of(cache, ids[4:]), saved)
    check_kv(cache, ids, [1, 2, 3, 4, 5, 6])
    cache.check_invariants(request_states=req.mamba_pool_idx)


def test_insert_over_a_host_only_node_takes_the_callers_ids():
    cache = make_hi_cache(page_size=2)
    insert_fresh(cache, [1, 2, 3, 4])
    cache.check_hicache_events()
    cache.evict(EvictParams(num_tokens=4))
    x = node_at(cache, [1, 2, 3, 4])
    assert x.value is None
    ids = alloc_kv(cache, 6)
    write_kv(cache, ids, [1, 2, 3, 4, 5, 6])
    slot = cache.states.alloc(1)
    write_state(cache, slot, [1, 2, 3, 4, 5, 6])
    res = cache.insert(InsertParams(key=[1, 2, 3, 4, 5, 6], value=ids, mamba_value=slot))
    assert (res.prefix_len, res.cached_len) == (0, 6) and torch.equal(x.value, ids[:4])
    assert x.host_kv is not None  # the host copy stays
    cache.states.free(slot)
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def test_no_room_for_load_back_is_a_value():
    cache, _, _ = tiered("lossless")
    held = []
    while (s := cache.states.alloc(1)) is not None:
        held.append(s)
    cache.inc_lock_ref(node_at(cache, [1, 2]))  # nothing on the device can be evicted for room
    m = match(cache, [1, 2, 3, 4, 5, 6])
    req = req_for([1, 2, 3, 4, 5, 6])
    ids, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    assert len(ids) == 0 and node is m.last_device_node and cache.stats["load_back_no_room"] == 1
    assert node_at(cache, [1, 2, 3, 4, 5, 6]).full_lock_ref == 0
    cache.check_invariants(request_states=torch.cat(held))


def test_reset_with_transfers_in_flight_gives_everything_back():
    cache, _, _ = tiered("lossless")
    m = match(cache, [1, 2, 3, 4, 5, 6])
    req = req_for([1, 2, 3, 4, 5, 6])
    cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    insert_fresh(cache, [20, 21])  # a backup in flight too
    cache.reset()
    assert req.load_back.done and not req.load_back.ok
    cache.states.free(req.mamba_pool_idx)
    assert cache.kv_region.available_size() == cache.kv_region.allocator.num_slots
    assert cache.state_region.available_size() == cache.state_region.allocator.num_slots
    assert cache.ckpt.available_size() == cache.ckpt.num_slots and cache.kv.allocator.num_live == 0
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


# ----------------------------------------------------------------------------- GPU (real streams)
@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["int8", "lossless"])
def test_tiered_load_back_on_cuda(codec):
    cache, saved, state = tiered(codec, device="cuda")
    m = match(cache, [1, 2, 3, 4, 5, 6, 99])
    assert (len(m.device_indices), m.host_hit_length, m.mamba_host_hit_length) == (2, 4, 1)
    req = CacheReq(token_ids=[1, 2, 3, 4, 5, 6], kv_indices=torch.empty(0, dtype=torch.int64, device="cuda"))
    ids, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    h = req.load_back
    for layer in range(2):
        h.wait_layer(layer)  # compute waits on layer k while k+1 may still be in flight
    for t in h.tickets.values():
        assert cache.engine.wait(t, timeout=10)
    cache.check_hicache_events()
    assert h.ok and torch.equal(rows_of(cache, ids), saved)
    slot = cache.states.translate(req.mamba_pool_idx)[0]
    assert torch.equal(cache.states.temporal_view_all()[:, slot], state[0])
    assert torch.equal(cache.states.conv_view_all(0)[:, slot], state[1])
    check_kv(cache, torch.cat([m.device_indices, ids]), [1, 2, 3, 4, 5, 6])
    cache.check_invariants(request_states=req.mamba_pool_idx)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_demotion_and_write_back_on_cuda():
    cache = make_hi_cache(page_size=2, device="cuda", write_policy="write_back")
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [5, 6])
    x = node_at(cache, [1, 2, 3, 4])
    saved = rows_of(cache, x.value)
    cache.evict(EvictParams(num_tokens=6, mamba_num=2))
    assert x.value is None and x.host_kv is not None and x.payload.state_host is not None
    cache.kv_region.flip_bit(node_at(cache, [5, 6]).host_kv[0], 0, 0)
    for toks, ok in (([1, 2, 3, 4], True), ([5, 6], False)):
        m = match(cache, toks)
        req = CacheReq(token_ids=toks, kv_indices=torch.empty(0, dtype=torch.int64, device="cuda"))
        ids, _ = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
        for t in req.load_back.tickets.values():
            assert cache.engine.wait(t, timeout=10)
        cache.check_hicache_events()
        assert req.load_back.ok == ok
        if ok:
            assert torch.equal(rows_of(cache, ids), saved)
            check_state(cache, req.mamba_pool_idx, toks)
        cache.states.free(req.mamba_pool_idx)
    assert len(match(cache, [5, 6]).device_indices) == 0 and match(cache, [5, 6]).host_hit_length == 0
    cache.check_invariants(request_states=torch.empty(0, dtype=torch.int64, device="cuda"))
    torch.cuda.synchronize()


@pytest.mark.parametrize("layerwise", [False, True])
def test_load_back_moves_whole_pages_unless_asked_for_layers(layerwise):
    """Whole pages by default (one event; layer-by-layer loads were half as fast on an H100, and no caller here
    overlaps per layer); ``loads.layerwise`` asks for one event per layer. Either way the bytes land exactly and
    ``wait_layer`` is valid for every layer."""
    cache, saved, _ = tiered("int8")
    cache.host_tier.loads.layerwise = layerwise
    seen = []
    orig = cache.engine.load

    def spy(*a, **kw):
        if kw.get("kind") == "load_kv":
            seen.append(kw.get("layer_ranges"))
        return orig(*a, **kw)

    cache.engine.load = spy
    m = match(cache, [1, 2, 3, 4, 5, 6, 99])
    req = req_for([1, 2, 3, 4, 5, 6, 99])
    ids, _ = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    for layer in range(2):
        req.load_back.wait_layer(layer)
    cache.check_hicache_events()
    assert req.load_back.ok and torch.equal(rows_of(cache, ids), saved)
    assert len(seen) == 1 and (seen[0] is not None) == layerwise
    cache.states.free(req.mamba_pool_idx)
