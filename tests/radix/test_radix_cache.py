"""HiMambaRadixCache on the real T0/T1 pools (CPU): the issue's scenarios, exact ids, sizes and orders."""

from __future__ import annotations

import pytest
import torch

from tests.support.radix_util import (
    alloc_kv,
    check_kv,
    check_state,
    full_snapshot,
    insert_fresh,
    make_cache,
    match,
    page,
    read_state,
    write_kv,
    write_state,
)
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix import (
    CacheReq,
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)


@pytest.mark.parametrize("codec", ["int8", "lossless"])
def test_sglang_scenario_page_size_1(codec):
    cache = make_cache(codec=codec)
    for toks in ([1, 2, 3], [1, 2, 3, 4, 5, 6, 7], [10, 11, 12], [1, 2, 3, 4, 5, 60, 70]):
        insert_fresh(cache, toks)
        cache.check_invariants(request_states=torch.empty(0))
    assert cache.total_size() == (12, 4)

    r = cache.evict(EvictParams(num_tokens=1))
    assert (r.num_tokens_evicted, r.mamba_num_evicted) == (3, 1)  # [10, 11, 12], the LRU leaf, whole
    assert len(match(cache, [10, 11, 12]).device_indices) == 0
    r = cache.evict(EvictParams(mamba_num=1))
    assert (r.num_tokens_evicted, r.mamba_num_evicted) == (0, 1)  # [1, 2, 3] becomes a tombstone
    assert cache.root.children[page(1)].key == [1, 2, 3] and cache.root.children[page(1)].payload.mamba_value is None
    cache.check_invariants(request_states=torch.empty(0))

    assert len(match(cache, [1, 2, 3, 4, 5]).device_indices) == 0
    m = match(cache, [1, 2, 3, 4, 5, 60, 70])
    assert len(m.device_indices) == 7 and m.last_device_node.key == [60, 70]
    check_kv(cache, m.device_indices, [1, 2, 3, 4, 5, 60, 70])
    m = match(cache, [1, 2, 3, 4, 5, 6, 7])
    assert len(m.device_indices) == 7 and m.last_device_node.key == [6, 7]

    r = cache.evict(EvictParams(mamba_num=1))  # [60, 70]: the LRU state, a leaf, removed whole
    assert (r.num_tokens_evicted, r.mamba_num_evicted) == (2, 1)
    m = match(cache, [1, 2, 3, 4, 5, 60, 70])
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root
    assert m.mamba_branching_seqlen == 5  # KV of [1..5] is still there: export a state at 5 next time
    cache.check_invariants(request_states=torch.empty(0))

    req = CacheReq(token_ids=[1, 2, 3, 4, 5, 6, 7], kv_indices=torch.empty(0, dtype=torch.int64))
    m = match(cache, [1, 2, 3, 4, 5, 6, 7], cow_mamba=True, req=req)
    assert len(m.device_indices) == 7 and req.mamba_pool_idx is not None
    check_state(cache, req.mamba_pool_idx, [1, 2, 3, 4, 5, 6, 7])  # exact when lossless, one rounding for int8
    cache.check_invariants(request_states=req.mamba_pool_idx)
    cache.states.free(req.mamba_pool_idx)


def test_duplicate_kv_prefix_lengths_and_available_deltas():
    cache = make_cache()
    slot = cache.states.alloc(1)
    write_state(cache, slot, [0])
    got = []
    for toks, prev in (([1, 2, 3], 0), ([1, 2, 3, 4, 5, 6, 7], 0), ([1, 2, 3, 4, 5, 6, 7, 8], 2),
                       ([1, 2, 3, 4, 5, 6, 7, 8, 9], 8)):
        before = cache.kv.available_size()
        ids = cache.kv.alloc(len(toks))
        res = cache.insert(InsertParams(key=toks, value=ids, mamba_value=slot, prev_prefix_len=prev))
        got.append((res.prefix_len, cache.kv.available_size() - before))
    assert got == [(0, -3), (3, -4), (7, -3), (8, -9)]


def test_page_size_4_alignment():
    cache = make_cache(page_size=4)
    res, _ = insert_fresh(cache, [1, 2, 3])  # shorter than a page: no node, nothing taken
    assert (res.prefix_len, res.cached_len) == (0, 0) and not cache.root.children
    assert len(match(cache, [1, 2, 3]).device_indices) == 0
    res, _ = insert_fresh(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    assert (res.prefix_len, res.cached_len, res.mamba_stored) == (0, 8, True)
    assert len(match(cache, [1, 2, 3, 4, 5, 6]).device_indices) == 0  # inside the node: no state at 4
    m = match(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert len(m.device_indices) == 8 and m.kv_hit_length == 8
    check_kv(cache, m.device_indices, list(range(1, 9)))
    # unaligned key: KV of whole pages only, and no state (it is valid at position 10 alone)
    res, _ = insert_fresh(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert (res.prefix_len, res.cached_len, res.mamba_stored) == (8, 8, False)
    # a branch after one page splits the node at a page boundary
    res, _ = insert_fresh(cache, [1, 2, 3, 4, 9, 9, 9, 9])
    assert (res.prefix_len, res.cached_len) == (4, 8)
    top = cache.root.children[page(1, 2, 3, 4)]
    assert top.key == [1, 2, 3, 4] and top.payload.mamba_value is None and len(top.children) == 2
    m = match(cache, [1, 2, 3, 4, 5, 6, 7])  # KV for 4 tokens, no state before 8
    assert len(m.device_indices) == 0 and m.kv_hit_length == 4 and m.mamba_branching_seqlen == 4
    for x in cache.root.children.values():
        assert len(x.key) % 4 == 0
    cache.check_invariants(request_states=torch.empty(0))
    cache.evict(EvictParams(num_tokens=10 ** 6))
    assert cache.total_size() == (0, 0) and cache.kv.allocator.num_live == 0


def test_page_size_checkpoint_unit_branching():
    cache = make_cache(page_size=2, checkpoint_unit=4)
    insert_fresh(cache, list(range(1, 9)))
    m = match(cache, [1, 2, 3, 4, 5, 6, 99])
    assert len(m.device_indices) == 0 and m.kv_hit_length == 6 and m.mamba_branching_seqlen == 4
    with pytest.raises(InvalidArgumentError):
        make_cache(page_size=2, checkpoint_unit=3)


def test_tenant_salts_share_nothing():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3], salt="a")
    assert len(match(cache, [1, 2, 3], salt="b").device_indices) == 0
    assert len(match(cache, [1, 2, 3]).device_indices) == 0
    res, _ = insert_fresh(cache, [1, 2, 3], salt="b")
    assert res.prefix_len == 0 and res.cached_len == 3
    ma, mb = match(cache, [1, 2, 3], salt="a"), match(cache, [1, 2, 3], salt="b")
    assert set(ma.device_indices.tolist()).isdisjoint(mb.device_indices.tolist())
    assert ma.last_device_node is not mb.last_device_node
    check_kv(cache, ma.device_indices, [1, 2, 3], "a")
    check_kv(cache, mb.device_indices, [1, 2, 3], "b")
    cache.evict(EvictParams(num_tokens=1))  # the LRU of the two: salt "a"
    assert len(match(cache, [1, 2, 3], salt="a").device_indices) == 0
    assert len(match(cache, [1, 2, 3], salt="b").device_indices) == 3
    cache.check_invariants(request_states=torch.empty(0))


def test_locks_protect_and_report_deltas():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3])
    insert_fresh(cache, [1, 2, 3, 4, 5])
    leaf = match(cache, [1, 2, 3, 4, 5]).last_device_node
    r = cache.inc_lock_ref(leaf)
    assert r.delta == -5 and cache.full_protected_size() == 5 and cache.mamba_protected_size() == 1
    assert cache.mamba_evictable_size() == 1  # [1, 2, 3]'s state is not locked: the state lock is the node's
    assert cache.evict(EvictParams(num_tokens=100)).num_tokens_evicted == 0
    r = cache.evict(EvictParams(mamba_num=5))
    assert r.mamba_num_evicted == 1 and cache.root.children[page(1)].payload.mamba_value is None  # tombstone, kept
    cache.check_invariants(request_states=torch.empty(0))
    assert cache.dec_lock_ref(leaf).delta == 5
    with pytest.raises(InvalidArgumentError):
        cache.dec_lock_ref(leaf)  # not locked any more
    r = cache.evict(EvictParams(num_tokens=1))
    assert r.num_tokens_evicted == 5  # the leaf, and its parent left as a childless tombstone
    assert cache.total_size() == (0, 0)


def test_lru_recency_insert_split_and_match():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [5, 6])
    insert_fresh(cache, [7, 8])
    match(cache, [5, 6])  # refreshes [5, 6]
    insert_fresh(cache, [1, 2, 9])  # splits [1..4]: both halves refreshed, [3, 4] is newer than [7, 8]
    order = []
    for _ in range(4):
        before = {tuple(k) for k in _leaf_keys(cache)}
        cache.evict(EvictParams(num_tokens=1))
        order.extend(sorted(before - {tuple(k) for k in _leaf_keys(cache)}))
    assert order[:3] == [(7, 8), (5, 6), (3, 4)]


def _leaf_keys(cache):
    out, stack = [], [cache.root]
    while stack:
        x = stack.pop()
        stack.extend(x.children.values())
        if not x.children and x is not cache.root:
            out.append(x.key)
    return out


def test_state_recency_only_on_store_or_match():
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [3, 4])
    insert_fresh(cache, [1, 2, 5])  # walks through [1, 2] but does not refresh its state
    assert cache.evict(EvictParams(mamba_num=1)).mamba_num_evicted == 1
    assert cache.root.children[page(1)].payload.mamba_value is None
    match(cache, [3, 4])
    insert_fresh(cache, [6])
    r = cache.evict(EvictParams(mamba_num=1))  # [5] is now the LRU state: a leaf, removed with its tombstone parent
    assert (r.num_tokens_evicted, r.mamba_num_evicted) == (3, 1) and 1 not in cache.root.children
    assert len(match(cache, [3, 4]).device_indices) == 2
    cache.check_invariants(request_states=torch.empty(0))


def test_cache_finished_and_unfinished_req():
    cache = make_cache(page_size=2)
    toks = [1, 2, 3, 4, 5, 6, 7]
    req = CacheReq(token_ids=toks[:4], kv_indices=alloc_kv(cache, 8), mamba_pool_idx=cache.states.alloc(1))
    write_kv(cache, req.kv_indices, toks)
    write_state(cache, req.mamba_pool_idx, toks[:4])
    cache.cache_unfinished_req(req, chunked=True)  # first chunk of 4 tokens
    assert req.cache_protected_len == 4 and req.last_node.key == [1, 2, 3, 4]
    assert cache.full_protected_size() == 4
    cache.check_invariants(request_kv=req.kv_indices[4:], request_states=req.mamba_pool_idx)
    req.token_ids = toks  # prefill done + decode: 7 tokens, the state at 7 (unaligned: not published)
    write_state(cache, req.mamba_pool_idx, toks)
    cache.cache_finished_req(req)
    assert req.mamba_pool_idx is None and req.last_node is None
    # [5, 6] has no state at its end (the state at 7 is unaligned), so the tree does not take its KV
    assert cache.total_size() == (4, 1) and cache.full_protected_size() == 0
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    m = match(cache, toks)
    assert len(m.device_indices) == 4
    cache.evict(EvictParams(num_tokens=100))
    assert cache.kv.allocator.num_live == 0 and cache.states.allocator.num_live == 0


def test_cow_evicts_kv_for_room_or_misses():
    cache = make_cache(kv_pages=6, states=1)
    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [3, 4])
    held = []
    while (s := cache.states.alloc(1)) is not None:
        held.append(s)
    req = CacheReq(token_ids=[1, 2], kv_indices=torch.empty(0, dtype=torch.int64))
    m = match(cache, [1, 2], cow_mamba=True, req=req)
    if req.mamba_pool_idx is not None:  # KV of [3, 4] made room in the shared bytes
        assert len(m.device_indices) == 2
        check_state(cache, req.mamba_pool_idx, [1, 2])
        held.append(req.mamba_pool_idx)
    else:
        assert len(m.device_indices) == 0 and m.last_device_node is cache.root
    cache.check_invariants(request_states=torch.cat(held))


def test_t1_full_evicts_states_and_locked_t1_caches_nothing():
    cache = make_cache(t1_slots=2)
    insert_fresh(cache, [1])
    insert_fresh(cache, [2])
    res, _ = insert_fresh(cache, [3])  # evicts [1] (LRU) for a T1 slot
    assert res.cached_len == 1 and len(match(cache, [1]).device_indices) == 0
    for t in (2, 3):
        cache.inc_lock_ref(match(cache, [t]).last_device_node)
    before = cache.kv.available_size()
    res, _ = insert_fresh(cache, [4, 5])
    assert (res.prefix_len, res.cached_len, res.mamba_stored) == (0, 0, False)
    assert cache.kv.available_size() == before
    cache.check_invariants(request_states=torch.empty(0))


def test_bad_inputs_raise_and_change_nothing():
    cache = make_cache()
    insert_fresh(cache, [1, 2, 3])
    other = make_cache()
    insert_fresh(other, [1, 2, 3])
    m = match(cache, [])
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root
    slot = cache.states.alloc(1)
    ids = cache.kv.alloc(3)
    cached_ids = match(cache, [1, 2, 3]).device_indices
    free_ids = torch.tensor([60, 61, 62])
    before = full_snapshot(cache)
    bad = [
        lambda: cache.insert(InsertParams(key=[1, 2, 3, 4], value=ids, mamba_value=slot)),  # lengths differ
        lambda: cache.insert(InsertParams(key=[1, 2, 3], value=ids.to(torch.int32), mamba_value=slot)),
        lambda: cache.insert(InsertParams(key=[1, 2, 3], value=torch.empty(3, dtype=torch.int64, device="meta"))),
        lambda: cache.insert(InsertParams(key=[4, 5, 6], value=cached_ids, mamba_value=slot)),  # the tree's ids
        lambda: cache.insert(InsertParams(key=[4, 5, 6], value=free_ids, mamba_value=slot)),  # nobody's ids
        lambda: cache.insert(InsertParams(key=[4, 5, 6], value=torch.tensor([5, 5, 6]), mamba_value=slot)),
        lambda: cache.insert(InsertParams(key=[4, 5, 6], value=ids, mamba_value=torch.tensor([7]))),  # free slot
        lambda: cache.insert(InsertParams(key=[4, 5, 6], value=ids, mamba_value=1.5)),
        lambda: cache.insert(InsertParams(key=[4, 5, 6], value=ids, prev_prefix_len=2)),  # longer than cached
        lambda: cache.insert(InsertParams(key="abc", value=ids)),
        lambda: cache.inc_lock_ref(other.root.children[page(1)]),  # a node of another cache
        lambda: cache.dec_lock_ref(cache.root.children[page(1)]),  # not locked
        lambda: cache.evict(EvictParams(num_tokens=-1)),
        lambda: cache.match_prefix(MatchPrefixParams(key=[1, 2, 3], cow_mamba=True)),  # cow without a request
    ]
    for i, call in enumerate(bad):
        with pytest.raises(InvalidArgumentError):
            call()
        assert full_snapshot(cache) == before, f"bad call {i} changed the cache"
    res = cache.insert(InsertParams(key=[], value=torch.empty(0, dtype=torch.int64)))
    assert res.prefix_len == 0 and res.cached_len == 0
    stale = cache.root.children[page(1)]
    cache.reset()
    with pytest.raises(InvalidArgumentError):
        cache.inc_lock_ref(stale)


def test_reset_gives_everything_back():
    cache = make_cache()
    free0 = (cache.kv.available_size(), cache.ckpt.available_size())
    for toks in ([1, 2, 3], [1, 2, 4], [7]):
        insert_fresh(cache, toks)
    cache.inc_lock_ref(match(cache, [7]).last_device_node)
    cache.reset()
    assert (cache.kv.available_size(), cache.ckpt.available_size()) == free0
    assert cache.total_size() == (0, 0)
    cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def test_int8_cow_state_is_one_rounding_and_checkpoint_stays():
    cache = make_cache(codec="int8")
    insert_fresh(cache, [4, 2])
    for _ in range(2):  # copy-on-write: the checkpoint stays, a second hit gives the same state
        req = CacheReq(token_ids=[4, 2], kv_indices=torch.empty(0, dtype=torch.int64))
        match(cache, [4, 2], cow_mamba=True, req=req)
        check_state(cache, req.mamba_pool_idx, [4, 2])
        t, _ = read_state(cache, req.mamba_pool_idx)
        assert not torch.equal(t, torch.zeros_like(t))
        cache.states.free(req.mamba_pool_idx)
