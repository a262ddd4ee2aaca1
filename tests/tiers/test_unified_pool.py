"""T0: exact ids and rows of both sides, frontiers, compaction, views, errors."""

from __future__ import annotations

import pytest
import torch

from tiered_cache import InvalidArgumentError, KVSpec, MemoryBudgetError, SlotStateError, StateSpec, UnifiedPool
from tiered_cache.kernels.move import move_rows
from tiered_cache.kernels.reference import move_rows_reference

# 32 B K + 32 B V per token and layer: 128 B a token (page_size 1)
KV = KVSpec(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16)
ST = StateSpec(num_layers=2, temporal_shape=(2, 4, 8), temporal_dtype=torch.float32,
               conv_shapes=((6, 3),), conv_dtype=torch.bfloat16)  # 256 B temporal + 36->48 B conv per layer: 608 B


def make(page_size=1, lazy=False, low_slots=6, high_slots=3, high=ST, **kw):
    return UnifiedPool(KV, high, low_slots=low_slots, high_slots=high_slots, page_size=page_size,
                       device="cpu", lazy_compaction=lazy, **kw)


def ids(t):
    return t.tolist()


def test_entry_bytes_and_capacity():
    pool = make()
    assert pool.low.entry_bytes == 128 and pool.high.entry_bytes == 2 * (256 + 48)
    assert pool.total_bytes == 7 * 128 + 4 * 608
    assert pool.low.capacity == pool.total_bytes // 128 and pool.high.capacity == pool.total_bytes // 608
    assert make(page_size=8).low.entry_bytes == 8 * 128


def test_both_growth_directions_exact_ids_and_rows():
    pool = make()
    full, mamba = pool.side("full"), pool.side("mamba")
    a = full.alloc(3)
    assert ids(a) == [1, 2, 3] and ids(full.translate(a)) == [1, 2, 3]
    b = mamba.alloc(2)
    cap = mamba.capacity
    assert ids(b) == [1, 2] and ids(mamba.translate(b)) == [cap - 2, cap - 3]
    # the sink is virtual id 0 on both sides: the lowest row and the highest row
    assert ids(full.translate(torch.tensor([0]))) == [0]
    assert ids(mamba.translate(torch.tensor([0]))) == [cap - 1]
    assert mamba.base + cap * mamba.entry_bytes == pool.total_bytes
    pool.check_invariants()


def test_frontiers_meet_and_no_room_changes_nothing():
    pool = make()
    full, mamba = pool.side("full"), pool.side("mamba")
    got = mamba.alloc(3)
    assert got is not None
    room = full.available_size()
    # bytes left after both sinks and 3 states, in whole KV slots
    assert room == (pool.total_bytes - 4 * 608) // 128 - 1
    snapshot = (full.allocator._v2p.copy(), mamba.allocator._v2p.copy(), room, mamba.available_size())
    assert full.alloc(room + 1) is None
    assert full.allocator._v2p.tolist() == snapshot[0].tolist()
    assert (full.available_size(), mamba.available_size()) == snapshot[2:]
    assert full.alloc(room) is not None
    assert full.available_size() == 0 and mamba.available_size() == 0
    assert mamba.alloc(1) is None
    pool.check_invariants()


def test_grow_after_peer_frees():
    pool = make()
    full, mamba = pool.side("full"), pool.side("mamba")
    states = mamba.alloc(3)
    kv = full.alloc(full.available_size())
    assert mamba.alloc(1) is None
    mamba.free(states[:1])  # eager: the state side shrinks by one envelope
    assert full.available_size() == 608 // 128
    full.free(kv[-3:])
    assert mamba.available_size() >= 1
    assert mamba.alloc(1) is not None
    pool.check_invariants()


@pytest.mark.parametrize("page_size", [1, 8])
def test_page_aware_ids(page_size):
    pool = make(page_size=page_size, low_slots=4)
    full = pool.side("full")
    a = full.alloc(2 * page_size)
    assert ids(a) == list(range(page_size, 3 * page_size))
    with pytest.raises(InvalidArgumentError, match="n"):
        full.alloc(page_size + 1) if page_size > 1 else full.alloc(-1)
    b = full.alloc(page_size)
    full.free(a)
    # eager compaction: page 3 moved into row 1; its tokens translate page-wise
    assert ids(full.translate(b)) == list(range(page_size, 2 * page_size))
    assert ids(full.alloc(page_size)) == list(range(page_size, 2 * page_size))  # vid 1 reused (LIFO)
    if page_size > 1:
        with pytest.raises(SlotStateError):
            full.free(b[1:])  # not a whole page
    pool.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4])
def test_host_translate_equals_device_translate(page_size):
    """``translate_host`` (the host table, no device work) maps every id as ``translate`` does, freed
    ids to negative rows, and names unknown ids."""
    import numpy as np

    pool = make(page_size=page_size, low_slots=6)
    full, mamba = pool.side("full"), pool.side("mamba")
    a, b, s = full.alloc(3 * page_size), full.alloc(2 * page_size), mamba.alloc(2)
    full.free(a[:page_size])  # compaction moves a live page
    for side, live, dead in ((full, torch.cat([a[page_size:], b]), a[:page_size]), (mamba, s, None)):
        perm = live[torch.randperm(len(live), generator=torch.Generator().manual_seed(page_size))]
        assert np.array_equal(side.allocator.translate_host(perm.numpy()), side.translate(perm).numpy())
        if dead is not None:
            assert (side.allocator.translate_host(dead.numpy()) < 0).all()
        with pytest.raises(InvalidArgumentError, match="ids"):
            side.allocator.translate_host(np.array([-1]))
        with pytest.raises(InvalidArgumentError, match="ids"):
            side.allocator.translate_host(np.array([1 << 30]))


def test_eager_and_lazy_give_same_contents():
    results = []
    for lazy in (False, True):
        pool = make(lazy=lazy, low_slots=10)
        full = pool.side("full")
        got = [full.alloc(1) for _ in range(8)]
        k = full.k_view_all()
        for i, g in enumerate(got):
            k[:, full.translate(g)] = float(i)
        for g in got[1:7:2]:
            full.free(g)
        if lazy:
            assert full.allocator.num_holes == 3 and full.allocator.num_moves == 0
            assert full.compact() == 2  # ranks 7, 8 into holes 2, 4; hole 6 falls off the band
        assert full.allocator.num_holes == 0
        live = [g for i, g in enumerate(got) if i not in (1, 3, 5)]
        rows = sorted(int(full.translate(g)) for g in live)
        assert rows == [1, 2, 3, 4, 5]
        results.append([full.k_view_all()[:, full.translate(g)].clone() for g in live])
        pool.check_invariants()
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_lazy_compacts_peer_when_bytes_are_needed():
    pool = make(lazy=True)
    full, mamba = pool.side("full"), pool.side("mamba")
    states = [mamba.alloc(1) for _ in range(3)]
    mamba.temporal_view_all()[:, mamba.translate(states[2])] = 7.0
    mamba.free(states[0])  # a hole at rank 1; the band keeps its size
    before = full.available_size()
    total = pool.total_bytes
    assert before == (total - 4 * 608) // 128 - 1
    assert full.schedulable_available_size() == (total - 3 * 608) // 128 - 1
    got = full.alloc(full.schedulable_available_size())
    assert got is not None and mamba.allocator.num_moves == 1 and mamba.allocator.num_holes == 0
    assert bool((mamba.temporal_view_all()[:, mamba.translate(states[2])] == 7.0).all())
    pool.check_invariants()


def test_kv_view_aliases_pool_bytes_and_follows_compaction():
    pool = make(page_size=4, low_slots=4)
    full = pool.side("full")
    a, b = full.alloc(4), full.alloc(4)
    k = torch.randn(4, 2, 8, dtype=torch.float16)
    v = torch.randn(4, 2, 8, dtype=torch.float16)
    row = int(full.translate(b)[0]) // 4
    full.k_view(1)[row] = k
    full.v_view(1)[row] = v
    # the same bytes through the raw buffer: layer 1 of the page envelope, K then V
    env = full.rows_bytes()[row]
    k_off, v_off = KV.field_offsets(4)[1]
    assert torch.equal(env[k_off:k_off + k.numel() * 2].view(torch.float16).view_as(k), k)
    assert torch.equal(env[v_off:v_off + v.numel() * 2].view(torch.float16).view_as(v), v)
    full.free(a)  # b moves from row 2 to row 1
    new_row = int(full.translate(b)[0]) // 4
    assert new_row == 1 and new_row != row
    assert torch.equal(full.k_view(1)[new_row], k) and torch.equal(full.v_view(1)[new_row], v)


def test_state_views_are_disjoint_and_cover_the_envelope():
    pool = make()
    mamba = pool.side("mamba")
    s = mamba.alloc(1)
    r = int(mamba.translate(s))
    t = mamba.temporal_view_all()
    c = mamba.conv_view_all(0)
    assert t.shape == (2, mamba.capacity, 2, 4, 8) and c.shape == (2, mamba.capacity, 6, 3)
    vals_t = torch.randn(2, 2, 4, 8)
    vals_c = torch.randn(2, 6, 3).to(torch.bfloat16)
    t[:, r] = vals_t
    c[:, r] = vals_c
    assert torch.equal(t[:, r], vals_t) and torch.equal(c[:, r], vals_c)
    others = torch.cat([mamba.rows_bytes()[:r], mamba.rows_bytes()[r + 1:]])
    assert int(others.count_nonzero()) == 0  # nothing spilled into a neighbour
    with pytest.raises(InvalidArgumentError, match="side"):
        mamba.k_view(0)
    with pytest.raises(InvalidArgumentError, match="layer"):
        mamba.temporal_view(2)


def test_swa_pairing():
    swa = KVSpec(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float16, window=16)
    pool = UnifiedPool(KV, swa, low_slots=4, high_slots=8, page_size=2, device="cpu")
    assert [s.name for s in pool.sides] == ["full", "swa"]
    s = pool.side("swa")
    got = s.alloc(4)
    assert ids(s.translate(got)) == [2 * (s.capacity - 2), 2 * (s.capacity - 2) + 1,
                                     2 * (s.capacity - 3), 2 * (s.capacity - 3) + 1]
    s.k_view(2)[s.capacity - 2] = 1.0
    pool.check_invariants()


def test_free_errors_change_nothing():
    pool = make()
    full = pool.side("full")
    a = full.alloc(3)
    before = (full.allocator._v2p.copy(), full.available_size())
    for bad in (torch.tensor([9]), torch.tensor([0]), torch.tensor([1, 1]), torch.tensor([1, 2, 4]),
                torch.tensor([full.capacity])):
        with pytest.raises(SlotStateError, match="ids"):
            full.free(bad)
    with pytest.raises(InvalidArgumentError, match="ids"):
        full.free(torch.tensor([1.0]))
    full.free(a[:1])
    with pytest.raises(SlotStateError, match="allocated"):
        full.free(a[:1])  # double free
    assert full.available_size() == before[1] + 1
    pool.check_invariants()


def test_bad_construction_is_typed():
    with pytest.raises(InvalidArgumentError, match="page_size"):
        make(page_size=0)
    with pytest.raises(InvalidArgumentError, match="total_bytes"):
        UnifiedPool(KV, ST, total_bytes=100, device="cpu")
    with pytest.raises(InvalidArgumentError, match="low"):
        UnifiedPool("kv", ST, total_bytes=1 << 16, device="cpu")
    with pytest.raises(InvalidArgumentError, match="name"):
        make().side("nope")
    with pytest.raises(InvalidArgumentError, match="temporal_shape"):
        StateSpec(num_layers=1, temporal_shape=(2, 4))
    with pytest.raises(InvalidArgumentError, match="kv_heads"):
        KVSpec(num_layers=1, kv_heads=0, head_dim=8)


def test_memory_check_names_the_setting():
    with pytest.raises(MemoryBudgetError, match="total_bytes"):
        UnifiedPool(KV, ST, total_bytes=1 << 50, device="cpu")


def test_fp8_kv_is_stored_as_bytes():
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("torch without fp8")
    spec = KVSpec(num_layers=1, kv_heads=1, head_dim=16, dtype=torch.float8_e4m3fn)
    pool = UnifiedPool(spec, ST, low_slots=2, high_slots=1, device="cpu")
    assert pool.low.k_view(0).dtype == torch.uint8 and spec.bytes_per_slot() == 32


@pytest.mark.parametrize("entry_bytes", [16, 48, 4096 + 32])
def test_move_kernel_matches_reference(entry_bytes):
    g = torch.Generator().manual_seed(entry_bytes)
    rows, base = 9, 32
    buf = torch.randint(0, 256, (base + rows * entry_bytes + 16,), dtype=torch.uint8, generator=g)
    src = torch.tensor([7, 8, 3])
    dst = torch.tensor([1, 2, 5])
    orig = buf.clone()
    ref = buf.clone()
    move_rows_reference(ref, base, entry_bytes, rows, src, dst)
    move_rows(buf, base, entry_bytes, rows, src, dst, backend="triton")
    assert torch.equal(buf, ref)
    row = lambda t, r: t[base + r * entry_bytes: base + (r + 1) * entry_bytes]
    for s_, d_ in zip(src.tolist(), dst.tolist()):
        assert torch.equal(row(buf, d_), row(orig, s_)) and not torch.equal(row(orig, d_), row(orig, s_))
    assert torch.equal(buf[:base], orig[:base])  # nothing outside the rows written


def test_move_kernel_rejects_bad_input():
    buf = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="entry_bytes"):
        move_rows(buf, 0, 24, 4, torch.tensor([1]), torch.tensor([2]))
    with pytest.raises(InvalidArgumentError, match="dst_rows"):
        move_rows(buf, 0, 16, 4, torch.tensor([1]), torch.tensor([2, 3]))
    with pytest.raises(InvalidArgumentError, match="src_rows"):
        move_rows(buf, 0, 16, 4, torch.tensor([1.0]), torch.tensor([2]))
    with pytest.raises(InvalidArgumentError, match="num_rows"):
        move_rows(buf, 0, 16, 100, torch.tensor([1]), torch.tensor([2]))


@pytest.mark.gpu
def test_pool_on_cuda_with_triton_moves():
    pool = UnifiedPool(KV, ST, low_slots=64, high_slots=16, page_size=4, device="cuda", lazy_compaction=True)
    full, mamba = pool.side("full"), pool.side("mamba")
    states = [mamba.alloc(1) for _ in range(16)]
    vals = torch.randn(16, 2, 2, 4, 8, device="cuda")
    for i, s in enumerate(states):
        mamba.temporal_view_all()[:, mamba.translate(s)] = vals[i][:, None]
    for s in states[::2]:
        mamba.free(s)
    got = full.alloc(full.schedulable_available_size())
    assert got is not None and mamba.allocator.num_moves > 0
    for i, s in enumerate(states[1::2]):
        assert torch.equal(mamba.temporal_view_all()[:, mamba.translate(s)][:, 0], vals[2 * i + 1])
    pool.check_invariants()
