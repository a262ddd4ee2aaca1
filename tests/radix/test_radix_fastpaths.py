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
import warnings

import numpy as np
import pytest
import torch

from tests.support.radix_util import KV_SPEC, STATE_SPEC, full_snapshot, insert_after_match
from tiered_cache.config import CacheConfig
from tiered_cache.errors import InvalidArgumentError, OutOfRangeError
from tiered_cache.radix import EvictParams, InsertParams, MatchPrefixParams, RadixKey
from tiered_cache.radix.checks import check_state_allocated, one_id
from tiered_cache.radix.policy import LRUPolicy
from tiered_cache.stack import TieredCache
from tiered_cache.tiers.holes import HoleMap
from tiered_cache.tiers.page_table import PageTable
from tiered_cache.tiers.t1_args import ids_tensor

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


def test_one_id_is_kept_and_read_only():
    """A slot's id array is made once and cannot be written (it is shared by every later check of that id)."""
    a = one_id(7)
    assert a.dtype == np.int64 and a.tolist() == [7] and one_id(7) is a and one_id(8) is not a
    with pytest.raises(ValueError):
        a[0] = 3
    assert one_id(7).tolist() == [7]


def test_state_check_gives_the_kept_id_and_refuses_what_is_not_allocated():
    cache = build(True, "int8")
    slot = cache.states.alloc(1)
    assert check_state_allocated(cache.states, slot) is one_id(int(slot))
    cache.states.free(slot)
    for bad in (slot, torch.tensor([0]), torch.tensor([cache.states.capacity]), torch.tensor([-1])):
        with pytest.raises(InvalidArgumentError) as e:
            check_state_allocated(cache.states, bad)
        assert e.value.arg == "mamba_value"


def test_a_kept_id_reaches_torch_as_a_copy():
    """The torch twins take a kept (read-only) id array as a copy, without torch's warning; any other array is
    wrapped in place."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = ids_tensor(one_id(5))
    assert t.tolist() == [5] and t.data_ptr() != one_id(5).ctypes.data
    w = np.array([4, 6])
    assert ids_tensor(w).data_ptr() == w.ctypes.data


def test_a_non_finite_state_stored_through_the_trusted_path_is_flagged_without_warnings(poison):
    """An insert's T1 store of a NaN state takes the torch twin with the kept id of its T1 slot: no warning, and
    the state is dropped as its flag says (the tree keeps its KV as a tombstone's or none)."""
    cache = build(True, "int8")
    ids, slot = cache.kv.alloc(4), cache.states.alloc(1)
    cache.states.temporal_view_all()[:, int(cache.states.translate(slot))] = poison.value(torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        res = cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4]), value=ids, mamba_value=slot))
        assert res.mamba_stored
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4])))
    assert len(m.device_indices) == 0  # its flag read: the NaN state is no hit
    cache.check_invariants(request_states=slot)


@pytest.mark.parametrize("ps", [1, 4])
def test_translate_of_one_id_is_the_contract(ps):
    """One id (a state slot's, twice a match and an insert) takes its own path: the same rows as the table says, a
    free id negative, an id outside the table ``OutOfRangeError`` naming ``ids``, in any shape of one element."""
    table = PageTable(6, ps, torch.device("cpu"))
    table.v2p[[1, 2, 4]] = [5, 3, 1]
    for i in range(-2, 6 * ps + 2):
        for ids in (np.array([i]), np.array([[i]])):
            if 0 <= i < 6 * ps:
                got = table.translate_host(ids)
                assert got.shape == ids.shape and got.ravel().tolist() == [table.v2p[i // ps] * ps + i % ps]
            else:
                with pytest.raises(OutOfRangeError) as e:
                    table.translate_host(ids)
                assert e.value.arg == "ids"


@pytest.mark.parametrize("seed", range(4))
def test_hole_trim_drops_exactly_the_holes_at_the_top(seed):
    """A free of the pages an insert found cached (fresh pages, at the band's top) trims the frontier by a byte
    search per 64-rank window: the new frontier lies just above the highest rank below it that is no hole (1 at
    least: the sink), and exactly the holes above it stop being holes."""
    rng = random.Random(seed)
    for _ in range(200):
        cap = rng.randrange(2, 300)
        holes = HoleMap(cap)
        n = rng.randrange(1, cap + 1)
        ranks = [r for r in range(1, n) if rng.random() < rng.choice([0.2, 0.9, 1.0])]
        if ranks:
            holes.add(np.array(ranks, dtype=np.int64))
        top = n
        while top > 1 and top - 1 in ranks:
            top -= 1
        assert holes.trim(n) == top
        assert holes.count == len([r for r in ranks if r < top]) and holes.ranks() == {r for r in ranks if r < top}


@pytest.mark.parametrize("seed", range(4))
def test_lru_heap_rebuilt_in_c_pops_least_recent_first(seed):
    """The lazy heap is rebuilt from the live candidates (``zip`` over ``map``) once it holds 3x as many entries as
    candidates: over random adds, discards, touches and pops (many rebuilds), each pop is the least recently
    touched candidate, as a plain model of stamps says."""
    rng = random.Random(seed)
    pol, stamp, cand, rebuilds = LRUPolicy(), {}, set(), 0
    nodes = [object() for _ in range(30)]
    for step in range(4000):
        op, x, heap = rng.random(), rng.choice(nodes), pol._heap["state"]
        if op < 0.85:
            pol.touch("state", x)
            stamp[x] = step
        elif op < 0.95:
            if x not in cand and x not in stamp:
                stamp[x] = step
            pol.add("state", x)
            cand.add(x)
        elif op < 0.98:
            pol.discard("state", x)
            cand.discard(x)
        else:
            got = pol.pop("state")
            assert got is (min(cand, key=stamp.__getitem__) if cand else None)
            cand.discard(got)
        rebuilds += pol._heap["state"] is not heap
    assert rebuilds > 10
