"""HiSWARadixCache on real pools (CPU): windows, SWA tombstones, swa_evicted_seqlen, offload and load back."""

from __future__ import annotations

import pytest
import torch

from tests.support.radix_util import check_kv, check_swa, insert_swa, make_swa_cache, match, node_at, page
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix import CacheReq, EvictParams, InitLoadBackParams, InsertParams


def three(host=True, **kw):
    """A = [1..4], B = [5..8], C = [9, 10]; page_size 2, window 4."""
    cache = make_swa_cache(page_size=2, window=4, host=host, **kw)
    insert_swa(cache, [1, 2, 3, 4])
    insert_swa(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    insert_swa(cache, list(range(1, 11)))
    return cache


def test_a_match_whose_window_was_tombstoned_hits_shorter():
    cache = three(host=False)
    m = match(cache, range(1, 11))
    assert len(m.device_indices) == 10 and m.host_hit_length == 0
    check_kv(cache, m.device_indices, list(range(1, 11)))
    check_swa(cache, m.swa_device_indices, list(range(1, 11)))
    match(cache, [1, 2, 3, 4])  # A most recent: B is the LRU SWA candidate now
    match(cache, range(1, 11))
    r = cache.evict(EvictParams(swa_num_tokens=1))
    b = node_at(cache, range(1, 9))
    # LRU first: A, B and C were touched by the last match in path order, so A goes first
    a = node_at(cache, [1, 2, 3, 4])
    assert a.payload.swa_tomb and not b.payload.swa_tomb and r.swa_num_tokens_evicted == 4 and r.num_tokens_evicted == 0
    assert len(match(cache, [1, 2, 3, 4]).device_indices) == 0  # its own window is gone
    m = match(cache, range(1, 11))  # the window before 8 and 10 lies in B and C: still whole
    assert len(m.device_indices) == 10
    check_swa(cache, m.swa_device_indices, list(range(1, 11)), start=4)
    cache.evict(EvictParams(swa_num_tokens=1))  # B (C is newer)
    assert b.payload.swa_tomb
    m = match(cache, range(1, 11))  # window before 10 = [6, 10): B's part is gone -> no hit at all
    assert len(m.device_indices) == 0 and m.kv_hit_length == 10
    r = cache.evict(EvictParams(swa_num_tokens=1))  # C is a leaf: removed whole, then B and A (tombstones)
    assert r.swa_num_tokens_evicted == 2 and r.num_tokens_evicted == 10 and not cache.root.children
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def test_window_tombstone_in_the_middle_hits_the_node_before():
    cache = three(host=False)
    a, b = node_at(cache, [1, 2, 3, 4]), node_at(cache, range(1, 9))
    cache.inc_lock_ref(a)  # a locked path keeps its SWA KV: B (older than C) is the victim
    assert cache.evict(EvictParams(swa_num_tokens=1)).swa_num_tokens_evicted == 4
    cache.dec_lock_ref(a)
    assert b.payload.swa_tomb and not a.payload.swa_tomb
    m = match(cache, range(1, 11))  # the window before 10 reaches into B: cut back to A
    assert len(m.device_indices) == 4 and m.last_device_node is a and m.kv_hit_length == 10
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def test_swa_evicted_seqlen_caches_the_slid_out_span_as_tombstones():
    cache = make_swa_cache(page_size=2, window=4, host=False)
    res = insert_swa(cache, list(range(1, 11)), evicted=5)  # SWA of [0, 5) gone: page [4, 6) with it
    assert res.cached_len == 10
    top = cache.root.children[page(1, 2)]
    assert top.key == [1, 2, 3, 4, 5, 6] and top.payload.swa_tomb and top.payload.swa_value is None
    leaf = node_at(cache, range(1, 11))
    assert leaf.key == [7, 8, 9, 10] and not leaf.payload.swa_tomb
    assert len(match(cache, range(1, 11)).device_indices) == 10
    assert len(match(cache, range(1, 7)).device_indices) == 0
    assert cache.swa.allocator.num_live == 2  # the tree took 2 SWA pages, the caller freed the rest
    # the same tokens again with their full window: the tombstone takes the caller's SWA ids
    res = insert_swa(cache, list(range(1, 7)))
    assert res.prefix_len == 6 and not top.payload.swa_tomb
    m = match(cache, range(1, 7))
    assert len(m.device_indices) == 6
    check_swa(cache, m.swa_device_indices, list(range(1, 7)))
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_offloaded_window_loads_back_byte_equal(policy):
    cache = three(write_policy=policy)
    cache.check_hicache_events()
    b, c = node_at(cache, range(1, 9)), node_at(cache, range(1, 11))
    ps = 2
    saved_full = cache.kv.rows_bytes()[cache.kv.translate(torch.cat([b.value, c.value])[::ps]) // ps].clone()
    swa_ids = torch.cat([b.payload.swa_value, c.payload.swa_value])
    saved_swa = cache.swa.rows_bytes()[cache.swa.translate(swa_ids[::ps]) // ps].clone()
    match(cache, [1, 2, 3, 4])
    assert cache.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 6  # C, then B: demoted with their SWA KV
    assert b.value is None and b.payload.swa_host is not None and not b.payload.swa_tomb
    assert c.payload.swa_host is not None
    m = match(cache, range(1, 11))
    assert (len(m.device_indices), m.host_hit_length, m.swa_host_hit_length) == (4, 6, 6)
    assert m.best_match_node is c
    req = CacheReq(token_ids=list(range(1, 11)), kv_indices=torch.empty(0, dtype=torch.int64))
    ids, node = cache.init_load_back(InitLoadBackParams(c, 6, req=req))
    assert node is c and len(ids) == 6 and len(req.load_back.swa_indices) == 6
    cache.check_hicache_events()
    assert req.load_back.ok
    assert torch.equal(cache.kv.rows_bytes()[cache.kv.translate(ids[::ps]) // ps], saved_full)
    assert torch.equal(cache.swa.rows_bytes()[cache.swa.translate(req.load_back.swa_indices[::ps]) // ps], saved_swa)
    m = match(cache, range(1, 11))
    assert len(m.device_indices) == 10 and m.host_hit_length == 0
    check_swa(cache, m.swa_device_indices, list(range(1, 11)))
    assert b.host_kv is not None and b.payload.swa_host is not None  # host copies stay
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def _saved(cache, nodes):
    """The full and SWA page bytes of ``nodes`` (on the device), in path order."""
    ps = 2
    full = cache.kv.rows_bytes()[cache.kv.translate(torch.cat([x.value for x in nodes])[::ps]) // ps].clone()
    swa_ids = torch.cat([x.payload.swa_value for x in nodes])
    return full, cache.swa.rows_bytes()[cache.swa.translate(swa_ids[::ps]) // ps].clone()


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_swa_pressure_demotes_what_the_host_holds_and_it_loads_back_exact(policy):
    """SWA eviction of a node with no child on the device whose full and SWA KV are on the host
    (write-through: copied at insert; write-back: copied first) frees both device pages and keeps the
    node, as KV eviction demotes: C, then B (C gone from the device) become host hits, and load back
    brings their full KV and their window's SWA KV back byte-equal."""
    cache = three(write_policy=policy)
    cache.check_hicache_events()
    b, c = node_at(cache, range(1, 9)), node_at(cache, range(1, 11))
    saved_full, saved_swa = _saved(cache, [b, c])
    match(cache, range(1, 9))  # C is the LRU SWA candidate
    r = cache.evict(EvictParams(swa_num_tokens=1))
    assert (r.swa_num_tokens_evicted, r.num_tokens_evicted, cache.stats["swa_demotes"]) == (2, 2, 1)
    assert c.alive and c.value is None and c.payload.swa_value is None and c.payload.swa_host is not None
    assert not c.payload.swa_tomb and b.payload.swa_value is not None
    match(cache, [1, 2, 3, 4])  # B is the LRU one now, its only child on the host
    r = cache.evict(EvictParams(swa_num_tokens=1))
    assert (r.swa_num_tokens_evicted, r.num_tokens_evicted, cache.stats["swa_demotes"]) == (4, 4, 2)
    assert b.alive and b.value is None and b.payload.swa_host is not None
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    m = match(cache, range(1, 11))
    assert (len(m.device_indices), m.host_hit_length, m.swa_host_hit_length) == (4, 6, 6)
    assert m.best_match_node is c
    req = CacheReq(token_ids=list(range(1, 11)), kv_indices=torch.empty(0, dtype=torch.int64))
    ids, node = cache.init_load_back(InitLoadBackParams(c, 6, req=req))
    cache.check_hicache_events()
    assert node is c and req.load_back.ok and len(req.load_back.swa_indices) == 6
    ps = 2
    assert torch.equal(cache.kv.rows_bytes()[cache.kv.translate(ids[::ps]) // ps], saved_full)
    assert torch.equal(cache.swa.rows_bytes()[cache.swa.translate(req.load_back.swa_indices[::ps]) // ps], saved_swa)
    m = match(cache, range(1, 11))
    assert len(m.device_indices) == 10 and m.host_hit_length == 0
    check_kv(cache, m.device_indices, list(range(1, 11)))
    check_swa(cache, m.swa_device_indices, list(range(1, 11)))
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def test_without_the_swa_demotion_swa_pressure_drops_the_host_copy(monkeypatch):
    """Control: the same eviction with every node taken as not backed up (the old rule): C goes whole,
    its host copy with it, and the match that was a host hit of 2 finds nothing on the host."""
    from tiered_cache.radix.swa_rule import SWARule

    monkeypatch.setattr(SWARule, "_backed", staticmethod(lambda x: False))
    cache = three()
    cache.check_hicache_events()
    c = node_at(cache, range(1, 11))
    match(cache, range(1, 9))
    r = cache.evict(EvictParams(swa_num_tokens=1))
    assert (r.swa_num_tokens_evicted, r.num_tokens_evicted, cache.stats["swa_demotes"]) == (2, 2, 0)
    assert not c.alive
    m = match(cache, range(1, 11))
    assert (len(m.device_indices), m.host_hit_length, m.swa_host_hit_length) == (8, 0, 0)
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def test_corrupt_swa_host_page_is_a_miss():
    cache = three()
    cache.check_hicache_events()
    match(cache, [1, 2, 3, 4])
    cache.evict(EvictParams(num_tokens=6))
    c = node_at(cache, range(1, 11))
    cache.swa_region.flip_bit(c.payload.swa_host[0], 1, 2)
    m = match(cache, range(1, 11))
    req = CacheReq(token_ids=list(range(1, 11)), kv_indices=torch.empty(0, dtype=torch.int64))
    cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    cache.check_hicache_events()
    assert not req.load_back.ok and not c.alive
    m = match(cache, range(1, 11))
    assert len(m.device_indices) + m.host_hit_length == 8  # B loaded fine: a shorter hit
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def test_cache_finished_req_and_bad_inputs():
    cache = make_swa_cache(page_size=2, window=4, host=False)
    toks = [1, 2, 3, 4, 5, 6, 7]
    req = CacheReq(token_ids=toks, kv_indices=cache.kv.alloc(8))
    req.swa_kv_indices = cache.swa.alloc(8)
    req.swa_evicted_seqlen = 2
    cache.swa.free(req.swa_kv_indices[:2])
    from tests.support.radix_util import write_kv, write_swa

    write_kv(cache, req.kv_indices, toks)
    write_swa(cache, req.swa_kv_indices, toks)
    cache.cache_finished_req(req)
    m = match(cache, toks)
    assert len(m.device_indices) == 6
    assert cache.kv.allocator.num_live == 3 and cache.swa.allocator.num_live == 2
    with pytest.raises(InvalidArgumentError):
        cache.insert(InsertParams(key=[1, 2], value=cache.kv.alloc(2)))  # no swa_value
    with pytest.raises(InvalidArgumentError):
        cache.insert(InsertParams(key=[1, 2], value=torch.tensor([0, 1]), swa_value=torch.tensor([0, 1]),
                                  swa_evicted_seqlen=-1))
    cache.evict(EvictParams(num_tokens=100))
    assert cache.kv.allocator.num_live == 1 and cache.swa.allocator.num_live == 0


@pytest.mark.parametrize("bad", ["split page", "repeated page"])
def test_swa_ids_that_are_not_whole_distinct_pages_are_refused_with_nothing_changed(bad):
    """The tree frees the SWA ids it takes through the trusted ``free_pages``, so insert checks them whole."""
    cache = make_swa_cache(page_size=2, window=4, host=False)
    kv, swa = cache.kv.alloc(4), cache.swa.alloc(4)
    if bad == "split page":
        swa = swa[[0, 2, 1, 3]]  # each page's ids split over two pages
    else:
        swa = torch.cat([swa[:2], swa[:2]])  # one page twice
    live = (cache.kv.allocator.num_live, cache.swa.allocator.num_live)
    with pytest.raises(InvalidArgumentError, match="swa_value"):
        cache.insert(InsertParams(key=[1, 2, 3, 4], value=kv, swa_value=swa))
    assert (cache.kv.allocator.num_live, cache.swa.allocator.num_live) == live and not cache.root.children
    cache.check_invariants()


# ------------------------------------------------------------------------ chunked prefill
def _chunk_req(cache, toks):
    from tests.support.radix_util import write_kv, write_swa

    n = -(-len(toks) // cache.page_size) * cache.page_size
    req = CacheReq(token_ids=[], kv_indices=cache.kv.alloc(n))
    req.swa_kv_indices = cache.swa.alloc(n)
    req.swa_evicted_seqlen = 0
    write_kv(cache, req.kv_indices, toks)
    write_swa(cache, req.swa_kv_indices, toks)
    return req


def _owned(req):
    p = req.cache_protected_len
    return req.kv_indices[p:], req.swa_kv_indices[max(p, -(-req.swa_evicted_seqlen // 2) * 2):]


def test_cache_unfinished_req_chunked_prefill_locks_and_repoints():
    cache = make_swa_cache(page_size=2, window=4, host=False)
    free0 = (cache.kv.available_size(), cache.swa.available_size())
    toks = list(range(1, 15))  # 14 tokens, chunks of 4, 6 (with SWA slid out), 3 (unaligned), finish
    req = _chunk_req(cache, toks)
    req.token_ids = toks[:4]
    cache.cache_unfinished_req(req, chunked=True)
    assert req.cache_protected_len == 4 and req.last_node is node_at(cache, toks[:4]) and req.last_node.full_lock_ref
    assert torch.equal(req.prefix_indices, req.kv_indices[:4])
    cache.check_invariants(request_kv=_owned(req)[0], request_states=_owned(req)[1])
    # a locked path keeps its SWA KV
    assert cache.evict(EvictParams(swa_num_tokens=100, num_tokens=100)).swa_num_tokens_evicted == 0
    # chunk 2: [4, 10); the caller let the SWA KV of [4, 6) slide out of the window (its own ids)
    cache.swa.free(req.swa_kv_indices[4:6])
    req.swa_evicted_seqlen = 6
    req.token_ids = toks[:10]
    first = req.last_node
    cache.cache_unfinished_req(req, chunked=True)
    assert req.cache_protected_len == 10 and first.full_lock_ref == 1 and req.last_node.full_lock_ref == 1
    assert node_at(cache, toks[:6]).payload.swa_tomb and not node_at(cache, toks[:10]).payload.swa_tomb
    cache.check_invariants(request_kv=_owned(req)[0], request_states=_owned(req)[1])
    m = match(cache, toks[:10])
    assert len(m.device_indices) == 10 and torch.equal(m.device_indices, req.kv_indices[:10])
    check_swa(cache, m.swa_device_indices, toks[:10], start=6)
    assert torch.equal(m.swa_device_indices[6:], req.swa_kv_indices[6:10])
    assert len(match(cache, toks[:6]).device_indices) == 4  # the window before 6 was tombstoned
    # chunk 3: unaligned end 13 -> cached up to 12
    req.token_ids = toks[:13]
    cache.cache_unfinished_req(req, chunked=True)
    assert req.cache_protected_len == 12 and len(req.prefix_indices) == 13
    cache.check_invariants(request_kv=_owned(req)[0], request_states=_owned(req)[1])
    # a chunk that adds nothing cacheable changes nothing
    last = req.last_node
    cache.cache_unfinished_req(req, chunked=True)
    assert req.last_node is last and req.cache_protected_len == 12
    req.token_ids = toks
    cache.cache_finished_req(req)
    assert req.last_node is None and last.full_lock_ref == 0 and first.full_lock_ref == 0
    m = match(cache, toks)
    assert len(m.device_indices) == 14
    check_kv(cache, m.device_indices, toks)
    check_swa(cache, m.swa_device_indices, toks, start=6)
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    cache.evict(EvictParams(num_tokens=100))
    assert (cache.kv.available_size(), cache.swa.available_size()) == free0


def test_cache_unfinished_req_duplicates_go_to_the_tree_ids():
    """Two requests prefill the same prompt in chunks: the second one's ids for what the first cached
    are freed and it points at the tree's; nothing leaks, the pools drain to their initial sizes."""
    cache = make_swa_cache(page_size=2, window=4, host=False)
    free0 = (cache.kv.available_size(), cache.swa.available_size())
    toks = list(range(1, 11))
    a, b = _chunk_req(cache, toks), _chunk_req(cache, toks)
    a.token_ids = toks[:6]
    cache.cache_unfinished_req(a)
    b.token_ids = toks[:8]
    b_kv, b_swa = b.kv_indices.clone(), b.swa_kv_indices.clone()
    cache.cache_unfinished_req(b)
    assert b.cache_protected_len == 8
    assert torch.equal(b.kv_indices[:6], a.kv_indices[:6]) and torch.equal(b.swa_kv_indices[:6], a.swa_kv_indices[:6])
    assert torch.equal(b.kv_indices[6:], b_kv[6:]) and torch.equal(b.swa_kv_indices[6:], b_swa[6:])
    kv_a, swa_a = _owned(a)
    kv_b, swa_b = _owned(b)
    cache.check_invariants(request_kv=torch.cat([kv_a, kv_b]), request_states=torch.cat([swa_a, swa_b]))
    a.token_ids = b.token_ids = toks
    cache.cache_finished_req(a)
    cache.cache_finished_req(b)
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    assert len(match(cache, toks).device_indices) == 10
    cache.evict(EvictParams(num_tokens=100))
    assert (cache.kv.available_size(), cache.swa.available_size()) == free0


def test_cache_unfinished_req_bad_swa_ids():
    cache = make_swa_cache(page_size=2, window=4, host=False)
    req = CacheReq(token_ids=[1, 2, 3, 4], kv_indices=cache.kv.alloc(4))
    with pytest.raises(InvalidArgumentError, match="swa_kv_indices"):
        cache.cache_unfinished_req(req)
    req.swa_kv_indices = cache.swa.alloc(2)  # too short
    with pytest.raises(InvalidArgumentError, match="swa_kv_indices"):
        cache.cache_unfinished_req(req)


# ----------------------------------------------------------------------------- real streams (CUDA)
# The bodies take the device; the gpu-marked tests run them on CUDA (with TORCH_CUDA_SANITIZER=1 on
# the H200), the unmarked ones run the same code on CPU, where every ticket completes on submission.
def _rows(side, ids):
    ps = side.page_size
    return side.rows_bytes()[side.translate(ids[::ps]) // ps].clone()


def _nothing(cache):
    return torch.empty(0, dtype=torch.int64, device=cache.device)


def _wait(cache, h):
    """Wait on every full-KV and SWA layer of the load ``h`` (compute on layer k may start while
    k+1 is in flight), then on each ticket, with a timeout."""
    for layer in range(cache.kv.spec.num_layers):
        h.wait_layer(layer)
    for layer in range(cache.swa.spec.num_layers):
        h.wait_layer(layer, kind="swa")
    for t in h.tickets.values():
        assert cache.engine.wait(t, timeout=10)


def _load(cache, toks):
    """Match ``toks``, start loading its host part, wait on every layer and ticket, apply the events."""
    m = match(cache, toks)
    req = CacheReq(token_ids=list(toks), kv_indices=_nothing(cache))
    ids, node = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    h = req.load_back
    assert node is m.best_match_node and len(ids) == m.host_hit_length and set(h.tickets) == {"kv", "swa"}
    assert ids.device == cache.device and h.swa_indices.device == cache.device and len(h.swa_indices) == len(ids)
    _wait(cache, h)
    assert not h.done  # the tree changes only in check_hicache_events
    cache.check_hicache_events()
    assert h.done
    return m, ids, h


def _offloaded_window_loads_back_on(device, policy):
    cache = three(write_policy=policy, device=device)
    cache.check_hicache_events()
    toks = list(range(1, 11))
    a, b, c = node_at(cache, [1, 2, 3, 4]), node_at(cache, range(1, 9)), node_at(cache, toks)
    saved_full = _rows(cache.kv, torch.cat([b.value, c.value]))
    saved_swa = _rows(cache.swa, torch.cat([b.payload.swa_value, c.payload.swa_value]))
    assert saved_full.device == cache.device and saved_swa.device == cache.device
    match(cache, [1, 2, 3, 4])
    assert cache.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 6  # C, then B: demoted with their SWA KV
    for x in (b, c):
        assert x.value is None and x.payload.swa_value is None and not x.payload.swa_tomb
        assert x.host_kv is not None and x.payload.swa_host is not None
    m = match(cache, toks)
    assert (len(m.device_indices), m.host_hit_length, m.swa_host_hit_length) == (4, 6, 6)
    assert m.best_match_node is c and m.last_device_node is a
    req = CacheReq(token_ids=toks, kv_indices=_nothing(cache))
    ids, node = cache.init_load_back(InitLoadBackParams(c, 6, req=req))
    h = req.load_back
    assert node is c and len(ids) == 6 and len(h.swa_indices) == 6 and set(h.tickets) == {"kv", "swa"}
    assert ids.device == cache.device and h.swa_indices.device == cache.device
    assert a.full_lock_ref == b.full_lock_ref == c.full_lock_ref == 1  # the load's own lock
    assert b.value is None and c.value is None  # the tree changes only when the tickets complete
    cache.check_invariants(request_kv=_nothing(cache), request_states=_nothing(cache))
    _wait(cache, h)
    cache.check_hicache_events()
    assert h.done and h.ok
    assert torch.equal(torch.cat([b.value, c.value]), ids)
    assert torch.equal(torch.cat([b.payload.swa_value, c.payload.swa_value]), h.swa_indices)
    assert torch.equal(_rows(cache.kv, ids), saved_full)  # full KV byte-equal to what was demoted
    assert torch.equal(_rows(cache.swa, h.swa_indices), saved_swa)  # SWA KV too
    check_kv(cache, torch.cat([m.device_indices, ids]), toks)
    check_swa(cache, torch.cat([m.swa_device_indices, h.swa_indices]), toks)
    for x in (b, c):
        assert x.host_kv is not None and x.payload.swa_host is not None and not x.payload.swa_tomb  # host copies stay
        assert not x.tickets
    assert a.full_lock_ref == b.full_lock_ref == c.full_lock_ref == 0  # locks released
    cache.check_invariants(request_kv=_nothing(cache), request_states=_nothing(cache))
    m = match(cache, toks)
    assert len(m.device_indices) == 10 and m.host_hit_length == 0 and m.swa_host_hit_length == 0
    check_kv(cache, m.device_indices, toks)
    check_swa(cache, m.swa_device_indices, toks)


def _demotion_write_back_and_corrupt_swa_on(device):
    cache = three(write_policy="write_back", device=device)
    toks = list(range(1, 11))
    b, c = node_at(cache, range(1, 9)), node_at(cache, toks)
    assert all(x.host_kv is None and x.payload.swa_host is None for x in (b, c))  # write_back: nothing on the host yet
    saved_full, saved_swa = _rows(cache.kv, b.value), _rows(cache.swa, b.payload.swa_value)
    match(cache, [1, 2, 3, 4])
    assert cache.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 6  # written back, then demoted
    for x in (b, c):
        assert x.alive and x.value is None and x.payload.swa_value is None and not x.payload.swa_tomb and not x.tickets
        assert x.host_kv is not None and x.payload.swa_host is not None
    cache.check_invariants(request_kv=_nothing(cache), request_states=_nothing(cache))
    cache.swa_region.flip_bit(c.payload.swa_host[0], 1, 2)  # C's full KV intact, its SWA page not
    m, ids, h = _load(cache, toks[:8])  # B alone: intact
    assert h.ok and m.best_match_node is b and len(ids) == 4
    assert torch.equal(_rows(cache.kv, ids), saved_full) and torch.equal(_rows(cache.swa, h.swa_indices), saved_swa)
    check_swa(cache, torch.cat([m.swa_device_indices, h.swa_indices]), toks[:8])
    m, ids, h = _load(cache, toks)  # C: its SWA page fails the checksum
    assert m.best_match_node is c and len(ids) == 2
    assert not h.ok and not c.alive and b.children == {}
    assert cache.engine.stats["checksum_failures"] == 1 and cache.stats["corrupt_host_kv_dropped"] == 1
    assert c.value is None and c.payload.swa_value is None  # its loaded pages went back, never served
    cache.check_invariants(request_kv=_nothing(cache), request_states=_nothing(cache))
    m = match(cache, toks)  # a miss for C: the hit ends at B, on the device
    assert len(m.device_indices) == 8 and m.host_hit_length == 0 and m.swa_host_hit_length == 0
    assert m.best_match_node is b and m.last_device_node is b
    check_kv(cache, m.device_indices, toks[:8])
    check_swa(cache, m.swa_device_indices, toks[:8])
    assert b.full_lock_ref == 0 and not b.tickets
    cache.evict(EvictParams(num_tokens=100))  # A and B demoted: nothing leaked on the device
    assert cache.kv.allocator.num_live == 0 and cache.swa.allocator.num_live == 0
    assert len(match(cache, toks).device_indices) == 0
    cache.check_invariants(request_kv=_nothing(cache), request_states=_nothing(cache))


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_offloaded_window_loads_back_through_the_stream_path_on_cpu(policy):
    _offloaded_window_loads_back_on("cpu", policy)


def test_demotion_under_write_back_and_a_corrupt_swa_page_on_cpu():
    _demotion_write_back_and_corrupt_swa_on("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_offloaded_window_loads_back_on_cuda(policy):
    _offloaded_window_loads_back_on("cuda", policy)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_demotion_under_write_back_and_a_corrupt_swa_page_on_cuda():
    _demotion_write_back_and_corrupt_swa_on("cuda")
    torch.cuda.synchronize()


def test_wait_layer_kind_is_checked():
    cache = three()
    match(cache, [1, 2, 3, 4])
    assert cache.evict(EvictParams(num_tokens=6)).num_tokens_evicted == 6  # C and B go to the host
    m = match(cache, list(range(1, 11)))
    assert m.host_hit_length
    req = CacheReq(token_ids=list(range(1, 11)), kv_indices=_nothing(cache))
    cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    with pytest.raises(InvalidArgumentError, match="kind"):
        req.load_back.wait_layer(0, kind="state")
    req.load_back.wait_layer(0, kind="swa")
    cache.check_hicache_events()
    assert req.load_back.done and req.load_back.ok
