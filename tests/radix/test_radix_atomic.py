"""Issue 17 item 4 and the radix/T1 parts of 6-8: a radix call that raises has changed nothing, and bad
input is a typed error naming the argument.

Each test snapshots everything a caller can observe (``radix_util.full_snapshot``: tree, locks, hit
counts, LRU stamps and candidate sets, sizes, stats, the pools' free sizes) before a failing call and
asserts it is identical after, then that ``check_invariants`` holds.
"""

from __future__ import annotations

import math
from array import array

import numpy as np
import pytest
import torch

from tests.support.radix_util import (
    STATE_SPEC,
    alloc_kv,
    check_state,
    full_snapshot,
    insert_fresh,
    make_cache,
    make_hi_cache,
    match,
    write_kv,
    write_state,
)
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, TieredCacheError
from tiered_cache.radix import (
    CacheReq,
    EvictParams,
    HostTierConfig,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
    RadixKey,
)
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool


def raises_unchanged(cache, call, err=InvalidArgumentError, arg=None, held_states=None):
    before = full_snapshot(cache)
    with pytest.raises(err) as info:
        call()
    assert full_snapshot(cache) == before, "the call raised but changed the cache"
    if arg is not None:
        assert info.value.arg == arg, info.value
    cache.check_invariants()
    return info.value


def running_req(cache, toks):
    """A request that matched ``toks[:2]``, locked its node, and computed the rest (KV, state)."""
    m = match(cache, toks[:2])
    cache.inc_lock_ref(m.last_device_node)
    p = len(m.device_indices)
    new = alloc_kv(cache, len(toks) - p)
    kv = torch.cat([m.device_indices, new])
    write_kv(cache, kv, toks)
    slot = cache.states.alloc(1)
    write_state(cache, slot, toks)
    return CacheReq(token_ids=list(toks), kv_indices=kv, mamba_pool_idx=slot, last_node=m.last_device_node,
                    cache_protected_len=p)


def test_cache_finished_req_with_unlocked_last_node_changes_nothing():
    """Bug 4: with an unlocked last_node it cached the request and freed its pages and slot, then raised
    (a caller cleaning up after the error freed them twice)."""
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    req = running_req(cache, [1, 2, 3, 4])
    cache.dec_lock_ref(req.last_node)  # the request's lock is gone: a caller bug
    raises_unchanged(cache, lambda: cache.cache_finished_req(req), arg="req.last_node")
    assert req.mamba_pool_idx is not None and int(cache.states.translate(req.mamba_pool_idx)) >= 0


def test_cache_finished_req_with_a_freed_state_slot_changes_nothing():
    """Bug 4: the insert and the page frees ran before the free of the request's (already free) slot raised."""
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    req = running_req(cache, [1, 2, 3, 4])
    cache.states.free(req.mamba_pool_idx)
    raises_unchanged(cache, lambda: cache.cache_finished_req(req), arg="req.mamba_pool_idx")


def test_cache_finished_req_with_pages_not_the_requests_changes_nothing():
    """Bug 4: pages past the insert that the request does not own failed their free after the insert."""
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    req = running_req(cache, [1, 2, 3, 4])
    extra = cache.kv.alloc(2)
    cache.kv.free(extra)  # kv_indices ends with two free ids
    req.kv_indices = torch.cat([req.kv_indices, extra])
    raises_unchanged(cache, lambda: cache.cache_finished_req(req), arg="req.kv_indices")


def test_cache_unfinished_req_with_unlocked_last_node_changes_nothing():
    """Bug 4: the chunk was inserted and the new end locked before the unlock of last_node raised."""
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    req = running_req(cache, [1, 2, 3, 4])
    cache.dec_lock_ref(req.last_node)
    raises_unchanged(cache, lambda: cache.cache_unfinished_req(req), arg="req.last_node")


def test_cow_match_with_a_freed_request_slot_changes_nothing():
    """Bug 4: the match touched LRU order and hit counts, then the load into the freed slot raised."""
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [5, 6])
    slot = cache.states.alloc(1)
    cache.states.free(slot)
    req = CacheReq(token_ids=[1, 2], kv_indices=torch.empty(0, dtype=torch.int64), mamba_pool_idx=slot)
    raises_unchanged(cache, lambda: match(cache, [1, 2], cow_mamba=True, req=req), arg="req.mamba_pool_idx")


def test_cow_match_without_room_is_a_miss_that_counts_no_hit():
    """Bug 4 (the choice): no free T0 state slot even after evicting is a value, a device miss, and the
    state that was not served is not counted as a hit nor made more recent."""
    cache = make_cache(kv_pages=8, states=2)
    insert_fresh(cache, [1, 2])
    held = []
    while (s := cache.states.alloc(1)) is not None:  # every state byte taken; only [1, 2] could be evicted
        held.append(s)
    node = match(cache, [1, 2]).last_device_node
    hits, stamp = node.resumes, cache.policy.stamp("state", node)
    req = CacheReq(token_ids=[1, 2], kv_indices=torch.empty(0, dtype=torch.int64))
    m = match(cache, [1, 2], cow_mamba=True, req=req)  # [1, 2] is the match itself: locked while making room
    assert req.mamba_pool_idx is None
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root
    assert node.resumes == hits and cache.policy.stamp("state", node) == stamp
    cache.check_invariants(request_states=torch.cat(held))


@pytest.mark.parametrize("bad, err, arg", [
    ("abc", InvalidTypeError, "key"),
    (b"ab", InvalidTypeError, "key"),
    ([1.0, 2.0], InvalidTypeError, "key"),
    ([1, True], InvalidTypeError, "key"),
    ([1, None], InvalidTypeError, "key"),
    ([[1, 2]], InvalidTypeError, "key"),
    ([1, math.inf], InvalidTypeError, "key"),
    ([1, 2**70], InvalidArgumentError, "key"),
    (None, InvalidTypeError, "key"),
    (torch.tensor([1.0, 2.0]), InvalidTypeError, "key"),
    (np.array([1.5]), InvalidTypeError, "key"),
])
def test_keys_are_integers_only(bad, err, arg):
    """Bug 6/7: strings, floats, bools, None, nested lists and out-of-range ids were taken as keys (or
    failed deep inside with TypeError/OverflowError); now a typed error names the key."""
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    ids = cache.kv.alloc(2)
    e = raises_unchanged(cache, lambda: cache.match_prefix(MatchPrefixParams(key=bad)), err, arg)
    assert isinstance(e, TieredCacheError)
    raises_unchanged(cache, lambda: cache.insert(InsertParams(key=bad, value=ids)), err, arg)


@pytest.mark.parametrize("key", [[1, 2], (1, 2), array("q", [1, 2]), np.array([1, 2]), np.array([1, 2], np.int32),
                                 torch.tensor([1, 2]), torch.tensor([1, 2], dtype=torch.int32), range(1, 3),
                                 RadixKey(np.array([1, 2]))])
def test_integer_keys_of_every_form_match(key):
    """Bug 6: array('q') and numpy keys were refused; every integer form is the same key."""
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    assert len(cache.match_prefix(MatchPrefixParams(key=key)).device_indices) == 2


def test_radix_key_and_params_refuse_bad_fields_at_construction():
    """Bug 7/8: the param dataclasses took anything and failed later (or never)."""
    with pytest.raises(InvalidTypeError):
        RadixKey("abc")
    with pytest.raises(InvalidTypeError):
        RadixKey([1, 2], extra_key=3)
    with pytest.raises(InvalidTypeError):
        MatchPrefixParams(key=[1], cow_mamba="yes")
    with pytest.raises(InvalidTypeError):
        EvictParams(num_tokens=1.5)
    with pytest.raises(InvalidArgumentError):
        EvictParams(mamba_num=-1)
    with pytest.raises(InvalidTypeError):
        InsertParams(prev_prefix_len=True)
    with pytest.raises(InvalidTypeError):
        InitLoadBackParams(best_match_node=None, host_hit_length=None)
    with pytest.raises(InvalidTypeError):
        CacheReq(token_ids=[1.5], kv_indices=torch.empty(0, dtype=torch.int64))
    with pytest.raises(InvalidTypeError):
        CacheReq(token_ids=[1], kv_indices=None)
    for kw in ({"prefetch_timeout_s": math.nan}, {"prefetch_timeout_s": math.inf}, {"write_policy": "bogus"},
               {"prefetch_policy": 3}, {"write_through_threshold": 2.0}):
        with pytest.raises(InvalidArgumentError):
            HostTierConfig(**kw)


def test_wrong_objects_are_typed_errors_that_change_nothing():
    """Bug 8: None, ints or foreign objects where a node, params or a slot is needed raised
    AttributeError/TypeError from deep inside, or InvalidArgumentError without the type."""
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    ids = cache.kv.alloc(2)
    node = match(cache, [1, 2]).last_device_node
    calls = [
        (lambda: cache.inc_lock_ref(None), "node"),
        (lambda: cache.inc_lock_ref(3), "node"),
        (lambda: cache.dec_lock_ref("n"), "node"),
        (lambda: cache.match_prefix(None), "params"),
        (lambda: cache.insert({"key": [1]}), "params"),
        (lambda: cache.evict(None), "params"),
        (lambda: cache.init_load_back(None), "params"),
        (lambda: cache.insert(InsertParams(key=[3, 4], value=None)), "value"),
        (lambda: cache.insert(InsertParams(key=[3, 4], value=ids, mamba_value="1")), "mamba_value"),
        (lambda: cache.insert(InsertParams(key=[3, 4], value=ids, mamba_value=torch.tensor([1.0]))), "mamba_value"),
        (lambda: cache.cache_finished_req(None), "req"),
        (lambda: cache.cache_finished_req(CacheReq([1, 2], ids), is_insert="yes"), "is_insert"),
    ]
    for call, arg in calls:
        raises_unchanged(cache, call, InvalidTypeError, arg)
    raises_unchanged(cache, lambda: cache.dec_lock_ref(node), InvalidArgumentError, "node")  # not locked
    bad_evict = EvictParams()
    bad_evict.num_tokens = True  # set after construction: evict checks again
    raises_unchanged(cache, lambda: cache.evict(bad_evict), InvalidTypeError, "num_tokens")


def test_slot_zero_is_not_an_active_state():
    """Bug 6: slot 0 (the sink) was accepted as the caller's state slot."""
    cache = make_cache()
    ids = cache.kv.alloc(2)
    raises_unchanged(cache, lambda: cache.insert(InsertParams(key=[3, 4], value=ids, mamba_value=0)),
                     InvalidArgumentError, "mamba_value")
    raises_unchanged(cache, lambda: cache.insert(InsertParams(key=[3, 4], value=ids,
                                                              mamba_value=torch.tensor([0]))),
                     InvalidArgumentError, "mamba_value")
    t1 = cache.ckpt.alloc(1)
    with pytest.raises(InvalidArgumentError) as e:
        cache.ckpt.store_from_active(cache.states, [0], t1)
    assert e.value.arg == "active_ids"


def test_init_load_back_checks_everything_first():
    """Bug 4/8: a missing request, a bad mem_quota or a foreign node raised after stats or locks changed,
    or as an untyped error."""
    cache = make_hi_cache()
    insert_fresh(cache, [1, 2, 3, 4])
    cache.evict(EvictParams(num_tokens=100))  # KV to host (write-through backed it up)
    m = match(cache, [1, 2, 3, 4])
    assert m.host_hit_length == 4
    best = m.best_match_node
    raises_unchanged(cache, lambda: cache.init_load_back(InitLoadBackParams(best, 4)), InvalidArgumentError, "req")
    req = CacheReq(token_ids=[1, 2, 3, 4], kv_indices=torch.empty(0, dtype=torch.int64))
    p = InitLoadBackParams(best, 4, req=req)
    p.mem_quota = 1.5
    raises_unchanged(cache, lambda: cache.init_load_back(p), InvalidTypeError, "mem_quota")
    raises_unchanged(cache, lambda: cache.init_load_back(InitLoadBackParams(object(), 4, req=req)), InvalidTypeError,
                     "best_match_node")
    ids, node = cache.init_load_back(InitLoadBackParams(best, 4, req=req))
    assert len(ids) == 4 and node is best


@pytest.mark.parametrize("bad, err", [
    ("12", InvalidTypeError), ([1.5], InvalidTypeError), ([True], InvalidTypeError), (None, InvalidTypeError),
    ([[1]], InvalidTypeError), ([2**70], InvalidArgumentError), (torch.tensor([1.0]), InvalidTypeError),
])
def test_checkpoint_pool_ids_are_integers_only(bad, err):
    """Bug 6/8: free("12") and free([1.5]) were read as ids, [2**70] overflowed inside numpy."""
    pool = Int8CheckpointPool(STATE_SPEC, 4, device="cpu", check_memory=False, backend="torch")
    t1 = pool.alloc(2)
    free0 = pool.available_size()
    with pytest.raises(err) as e:
        pool.free(bad)
    assert e.value.arg == "ids" and pool.available_size() == free0
    with pytest.raises(err):
        pool.load_to_active(bad, torch.zeros(2, 2, 2, 4, 4), [1])
    pool.free(array("q", t1.tolist()))  # integer forms are taken
    assert pool.available_size() == 4


def test_checkpoint_pool_refuses_bad_settings_and_objects_by_name():
    """Bug 7/8: bools as sizes, unknown backends, None as a side reached deep code."""
    for kw, arg in (({"num_slots": True}, "num_slots"), ({"num_slots": 2.0}, "num_slots"),
                    ({"num_slots": 2, "codec": "fp4"}, "codec"), ({"num_slots": 2, "backend": "cuda"}, "backend"),
                    ({"num_slots": 2, "check_memory": "no"}, "check_memory")):
        with pytest.raises(InvalidArgumentError) as e:
            Int8CheckpointPool(STATE_SPEC, device="cpu", **{"check_memory": False, **kw})
        assert e.value.arg == arg
    pool = Int8CheckpointPool(STATE_SPEC, 2, device="cpu", check_memory=False, backend="torch")
    t1 = pool.alloc(1)
    with pytest.raises(InvalidTypeError) as e:
        pool.store_from_active(None, [1], t1)
    assert e.value.arg == "side"
    with pytest.raises(InvalidTypeError):
        pool.envelope(True)
    with pytest.raises(InvalidTypeError):
        pool.is_allocated(None)


def test_a_failing_call_after_a_good_one_still_serves_the_state():
    """The checks-first rewrite keeps the good path: a full request cycle after refused calls."""
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    req = running_req(cache, [1, 2, 3, 4])
    with pytest.raises(InvalidTypeError):
        cache.cache_finished_req(req, is_insert=1)
    cache.cache_finished_req(req)
    req2 = CacheReq(token_ids=[1, 2, 3, 4], kv_indices=torch.empty(0, dtype=torch.int64))
    m = match(cache, [1, 2, 3, 4], cow_mamba=True, req=req2)
    assert len(m.device_indices) == 4
    check_state(cache, req2.mamba_pool_idx, [1, 2, 3, 4])
    cache.check_invariants(request_states=req2.mamba_pool_idx)
