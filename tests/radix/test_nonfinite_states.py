"""Issue 17 item 11: a state holding a NaN or an inf is never cached as a servable state.

The T1 store kernels flag such a slot on the device (``finite``), the flags go to the host behind an
event, and the tree drops the state before it serves or moves it (counted in ``stats``). One bad
element, NaN / +inf / -inf, in the temporal state or in a conv window of one of several states.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.radix_util import (
    STATE_SPEC,
    check_state,
    insert_fresh,
    make_cache,
    make_hi_cache,
    page,
    state_pattern,
    write_kv,
    write_state,
)
from tiered_cache.kernels import quant
from tiered_cache.kernels._ref_quant import copy_rows_reference, quantize_store_reference
from tiered_cache.radix import CacheReq, EvictParams, InsertParams, MatchPrefixParams, RadixKey
from tiered_cache.tiers.checkpoint_pool import ActiveViews, Int8CheckpointPool

BAD = [float("nan"), float("inf"), float("-inf")]


def _poison(gen: torch.Generator, t: torch.Tensor, row: int, value: float) -> None:
    """One random element of row ``row`` of ``t [L, R, ...]`` := value."""
    flat = t[:, row].reshape(-1)
    flat[int(torch.randint(flat.numel(), (1,), generator=gen))] = value
    t[:, row] = flat.view(t[:, row].shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", BAD)
@pytest.mark.parametrize("value_axis", [1, 2])
def test_store_kernel_flags_equal_reference(poison, dtype, value, value_axis):
    """The Triton store's flag output equals its torch twin's; finite states stay bit-exact."""
    gen = torch.Generator().manual_seed(hash((str(dtype), value, value_axis)) % 2**31)
    src = torch.randn(2, 5, 2, 4, 8, generator=gen).to(dtype)
    bad_row = int(torch.randint(5, (1,), generator=gen))
    _poison(gen, src, bad_row, value)
    rows = torch.randperm(5, generator=gen)[:4]
    slots = torch.randperm(7, generator=gen)[:4] + 1
    out = []
    for backend in ("triton", "torch"):
        dv, dk = (4, 8) if value_axis == 1 else (8, 4)
        q, s = poison((2, 8, 2, dv, dk), torch.int8), poison((2, 8, 2, 1, dk), dtype)
        fin = torch.ones(8, dtype=torch.uint8)
        quant.quantize_store(src, rows, q, s, slots, value_axis, backend=backend, finite=fin)
        out.append((q, s, fin))
    (q_k, s_k, f_k), (q_r, s_r, f_r) = out
    assert torch.equal(f_k, f_r)
    want = torch.ones(8, dtype=torch.uint8)
    want[slots[rows == bad_row]] = 0
    assert torch.equal(f_k, want)
    good = slots[rows != bad_row]
    assert torch.equal(q_k[:, good], q_r[:, good]) and torch.equal(s_k[:, good], s_r[:, good])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", BAD)
def test_copy_kernel_flags_equal_reference(poison, dtype, value):
    """The conv-window (and lossless) copy flags a row that received a NaN/inf, like its twin."""
    gen = torch.Generator().manual_seed(hash((str(dtype), value)) % 2**31)
    src = torch.randn(2, 5, 4, 3, generator=gen).to(dtype)
    bad_row = int(torch.randint(5, (1,), generator=gen))
    _poison(gen, src, bad_row, value)
    rows = torch.randperm(5, generator=gen)
    dst_rows = torch.randperm(7, generator=gen)[:5] + 1
    flags = []
    for backend in ("triton", "torch"):
        dst = poison((2, 8, 4, 3), dtype)
        fin = torch.ones(8, dtype=torch.uint8)
        quant.copy_rows(src, rows, dst, dst_rows, backend=backend, finite=fin)
        bits = {2: torch.int16, 4: torch.int32}[dtype.itemsize]
        assert torch.equal(dst[:, dst_rows].view(bits), src[:, rows].view(bits))
        flags.append(fin)
    assert torch.equal(flags[0], flags[1])
    assert flags[0].tolist() == [0 if r in dst_rows[rows == bad_row].tolist() else 1 for r in range(8)]


def test_flags_only_clear_never_set():
    """A kernel writes 0 for a bad slot and leaves the others' flags as they were (the pool sets them)."""
    src = torch.randn(1, 2, 1, 2, 2)
    q, s = torch.zeros(1, 3, 1, 2, 2, dtype=torch.int8), torch.zeros(1, 3, 1, 1, 2)
    fin = torch.tensor([1, 0, 1], dtype=torch.uint8)
    quantize_store_reference(src, torch.tensor([0, 1]), q, s, torch.tensor([1, 2]), 1, finite=fin)
    assert fin.tolist() == [1, 0, 1]
    copy_rows_reference(src[:, :, 0], torch.tensor([0]), torch.zeros(1, 3, 2, 2), torch.tensor([1]), finite=fin)
    assert fin.tolist() == [1, 0, 1]


@pytest.mark.parametrize("codec", ["int8", "lossless"])
@pytest.mark.parametrize("where", ["temporal", "conv"])
@pytest.mark.parametrize("value", BAD)
def test_pool_reports_the_one_bad_state_of_a_store(poison, codec, where, value):
    """One call stores three states; the pool reports exactly the poisoned one, the others load back
    exactly as the reference math gives."""
    gen = torch.Generator().manual_seed(hash((codec, where, value)) % 2**31)
    pool = Int8CheckpointPool(STATE_SPEC, 6, device="cpu", codec=codec, check_memory=False, backend="triton")
    temporal = torch.randn(2, 4, *STATE_SPEC.temporal_shape, generator=gen)
    conv = torch.randn(2, 4, *STATE_SPEC.conv_shapes[0], generator=gen)
    bad = int(torch.randint(1, 4, (1,), generator=gen))
    _poison(gen, temporal if where == "temporal" else conv, bad, value)
    slots = pool.alloc(3)
    pool.store_from_active(ActiveViews(temporal, (conv,)), [1, 2, 3], slots)
    assert pool.poll_nonfinite() == [int(slots[bad - 1])]
    assert pool.poll_nonfinite() == []  # reported once
    out_t, out_c = poison.like(temporal), poison.like(conv)
    good = [r for r in (1, 2, 3) if r != bad]
    pool.load_to_active(slots[[r - 1 for r in good]], ActiveViews(out_t, (out_c,)), good)
    if codec == "int8":
        q, s = torch.zeros(2, 4, 2, 4, 4, dtype=torch.int8), torch.zeros(2, 4, 2, 1, 4)
        quantize_store_reference(temporal, torch.tensor(good), q, s, torch.tensor(good), STATE_SPEC.value_axis)
        ref = poison.like(temporal)
        from tiered_cache.kernels._ref_quant import dequantize_load_reference

        dequantize_load_reference(q, s, torch.tensor(good), ref, torch.tensor(good), STATE_SPEC.value_axis)
        assert torch.equal(out_t[:, good], ref[:, good])
    else:
        assert torch.equal(out_t[:, good], temporal[:, good])
    assert torch.equal(out_c[:, good], conv[:, good])


def test_pool_forgets_flags_of_freed_and_restored_slots():
    """A freed slot is never reported; a newer store of a slot supersedes the older one's flag."""
    pool = Int8CheckpointPool(STATE_SPEC, 4, device="cpu", codec="int8", check_memory=False, backend="torch")
    t = torch.randn(2, 2, *STATE_SPEC.temporal_shape)
    c = torch.randn(2, 2, *STATE_SPEC.conv_shapes[0])
    t[0, 1, 0, 0, 0] = float("nan")
    a = pool.alloc(1)
    pool.store_from_active(ActiveViews(t, (c,)), [1], a)
    assert pool.flags_pending(int(a))
    pool.free(a)
    assert not pool.flags_pending(int(a)) and pool.poll_nonfinite() == []
    b = pool.alloc(1)
    pool.store_from_active(ActiveViews(t, (c,)), [1], b)
    pool.store_from_active(ActiveViews(t, (c,)), [0], b)  # finite now
    assert pool.poll_flags() == {int(b): True}


def _insert_poisoned(cache, toks, where, value):
    """insert_fresh, with one element of the caller's state poisoned before the insert."""
    ps = cache.page_size
    ids = cache.kv.alloc(-(-len(toks) // ps) * ps)
    write_kv(cache, ids, toks)
    slot = cache.states.alloc(1)
    write_state(cache, slot, toks)
    phys = int(cache.states.translate(slot))
    view = cache.states.temporal_view_all() if where == "temporal" else cache.states.conv_view_all(0)
    view[1, phys].view(-1)[3] = value
    res = cache.insert(InsertParams(key=RadixKey(toks), value=ids[:len(toks)], mamba_value=slot))
    if ids[res.cached_len:].numel():
        cache.kv.free(ids[res.cached_len:])
    cache.states.free(slot)
    return res


def _cow(cache, toks):
    req = CacheReq(token_ids=list(toks), kv_indices=torch.empty(0, dtype=torch.int64))
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(toks)), cow_mamba=True, req=req))
    return m, req


@pytest.mark.parametrize("codec", ["int8", "lossless"])
@pytest.mark.parametrize("where", ["temporal", "conv"])
@pytest.mark.parametrize("value", BAD)
def test_tree_never_serves_a_nonfinite_state(codec, where, value):
    """Three prefixes cached, the middle one's state poisoned: a match never returns it, its T1 slot is
    freed and counted; the others are served as stored."""
    cache = make_cache(codec=codec)
    insert_fresh(cache, [1, 2])
    free_before = cache.ckpt.available_size()
    res = _insert_poisoned(cache, [5, 6], where, value)
    assert res.mamba_stored  # published; its flag is read before anything serves it
    insert_fresh(cache, [8, 9])
    m, req = _cow(cache, [5, 6])
    assert len(m.device_indices) == 0 and m.last_device_node is cache.root and req.mamba_pool_idx is None
    assert cache.stats["nonfinite_states"] == 1
    assert cache.ckpt.available_size() == free_before - 1  # [8, 9]'s slot only
    for toks in ([1, 2], [8, 9]):
        m, req = _cow(cache, toks)
        assert len(m.device_indices) == 2
        check_state(cache, req.mamba_pool_idx, toks)
        cache.states.free(req.mamba_pool_idx)
    m, _ = _cow(cache, [5, 6])
    assert len(m.device_indices) == 0 and cache.stats["nonfinite_states"] == 1
    cache.check_invariants(request_states=torch.empty(0, dtype=torch.int64))


def test_event_poll_drops_a_nonfinite_state_and_keeps_its_prefix_kv():
    """check_hicache_events reads the flags; a state under a longer cached one becomes a tombstone."""
    cache = make_cache()
    _insert_poisoned(cache, [1, 2], "temporal", float("nan"))
    insert_fresh(cache, [1, 2, 3, 4])
    cache.check_hicache_events()
    assert cache.stats["nonfinite_states"] == 1 and cache.total_size() == (4, 1)
    node = cache.root.children[page(1)]
    assert node.is_tombstone and len(_cow(cache, [1, 2])[0].device_indices) == 0
    m, req = _cow(cache, [1, 2, 3, 4])
    assert len(m.device_indices) == 4
    check_state(cache, req.mamba_pool_idx, [1, 2, 3, 4])
    cache.check_invariants(request_states=req.mamba_pool_idx)


def test_locked_nonfinite_state_is_dropped_and_its_node_goes_with_the_lock():
    """A request locked the node before the flag was read: the state goes, the node stays until unlock."""
    cache = make_cache()
    insert_fresh(cache, [1, 2])
    _insert_poisoned(cache, [1, 2, 3, 4], "conv", float("inf"))
    node = cache.root.children[page(1)].children[page(3)]
    cache.inc_lock_ref(node)
    cache.check_hicache_events()
    assert node.is_tombstone and cache.mamba_protected_size() == 0 and cache.stats["nonfinite_states"] == 1
    cache.check_invariants()
    cache.dec_lock_ref(node)
    assert not node.alive and cache.total_size() == (2, 1)
    cache.check_invariants()


def test_nonfinite_state_is_never_demoted_to_host():
    """A state evicted before its flag was read is dropped, not demoted to T2."""
    cache = make_hi_cache(t1_slots=4)
    insert_fresh(cache, [1, 2])
    _insert_poisoned(cache, [5, 6], "temporal", float("-inf"))
    host_free = cache.state_region.available_size()
    cache.evict(EvictParams(mamba_num=2))
    assert cache.stats["nonfinite_states"] == 1 and cache.stats["state_demotes"] == 1
    assert cache.state_region.available_size() == host_free - 1  # [1, 2]'s state only
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([5, 6])))
    assert m.best_match_node is cache.root
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2])))
    assert m.best_match_node is not cache.root and m.mamba_host_hit_length == 1
    cache.check_invariants()


def test_finite_states_keep_round_trip_through_the_pattern():
    """The flag path changes nothing for finite states (int8 one rounding, lossless exact)."""
    for codec in ("int8", "lossless"):
        cache = make_cache(codec=codec)
        insert_fresh(cache, [3, 4])
        cache.check_hicache_events()
        m, req = _cow(cache, [3, 4])
        assert len(m.device_indices) == 2 and cache.stats["nonfinite_states"] == 0
        check_state(cache, req.mamba_pool_idx, [3, 4])
        t, _ = state_pattern([3, 4])
        assert torch.isfinite(t).all()
