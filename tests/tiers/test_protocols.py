"""T0 behind ``tiers.protocols``: ``UnifiedPool``'s sides are ``KVSide`` / ``StateSide``, and T1 and the
T2 moves work on any object that offers those members and nothing more (an engine's own pools)."""

from __future__ import annotations

import torch

from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec
from tiered_cache.tiers.protocols import ActiveSide, KVSide, StateSide
from tiered_cache.tiers.unified_pool import SubPool, UnifiedPool
from tiered_cache.transfer.engine import TransferEngine
from tiered_cache.transfer.moves import demote_kv, demote_states, load_kv, restore_states

KV = KVSpec(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float16)
ST = StateSpec(num_layers=2, temporal_shape=(2, 8, 16), temporal_dtype=torch.float32,
               conv_shapes=((6, 3),), conv_dtype=torch.bfloat16, value_axis=2)

COMMON = ("name", "device", "page_size", "entry_bytes", "capacity", "alloc", "free", "available_size",
          "translate", "translate_host", "physical_rows", "live_virtual_ids", "rows_bytes", "mark_busy",
          "unmark_busy", "add_fence")


def make_pool():
    return UnifiedPool(KV, ST, low_slots=8, high_slots=4, page_size=4, device="cpu")


class Delegate:
    """A T0 side that is no ``SubPool``: the protocol's members only, each handed to a hidden side."""

    def __init__(self, side, members):
        self._side = side
        for m in members:
            if not callable(getattr(side, m)):
                setattr(self, m, getattr(side, m))

    def __getattr__(self, m):
        if m.startswith("_") or m not in self._allowed():
            raise AttributeError(m)
        return getattr(self._side, m)

    def _allowed(self):
        extra = ("spec", "free_pages", "k_view_all", "v_view_all") if isinstance(self._side.spec, KVSpec) else (
            "spec", "temporal_view_all", "conv_view_all")
        return COMMON + extra


def test_the_protocols_name_what_is_used_and_nothing_more():
    members = lambda p: {m for m in vars(p) if not m.startswith("_")}
    assert members(ActiveSide) == set(COMMON)
    assert members(KVSide) == {"spec", "free_pages", "k_view_all", "v_view_all"}
    assert members(StateSide) == {"spec", "temporal_view_all", "conv_view_all"}


def test_unified_pool_sides_are_the_protocols():
    pool = make_pool()
    kv: KVSide = pool.low  # a SubPool[KVSpec] is a KVSide to mypy; at run time, below
    assert isinstance(kv, KVSide) and isinstance(pool.side("mamba"), StateSide)
    assert isinstance(pool.high, ActiveSide)
    for obj in (None, torch.zeros(3), pool, pool.low.allocator):
        assert not isinstance(obj, ActiveSide)


def test_t1_and_the_moves_work_on_a_side_that_is_not_a_subpool():
    pool = make_pool()
    kv, st = Delegate(pool.low, COMMON), Delegate(pool.high, COMMON)
    assert not isinstance(kv, SubPool) and isinstance(kv, KVSide) and isinstance(st, StateSide)
    t1 = Int8CheckpointPool(ST, 4, device="cpu")
    mirror = HostMirror([RegionSpec("state", t1.slot_bytes, 4), RegionSpec("full", kv.entry_bytes, 4)])
    engine = TransferEngine("cpu")

    # T0 state -> T1 -> T0 through the delegate equals the same moves through the SubPool
    a, b, c = st.alloc(1), st.alloc(1), st.alloc(1)
    g = torch.Generator().manual_seed(0)
    pool.high.temporal_view_all()[:, st.translate(a)] = torch.randn(2, 1, 2, 8, 16, generator=g)
    pool.high.conv_view_all(0)[:, st.translate(a)] = torch.randn(2, 1, 6, 3, generator=g).to(torch.bfloat16)
    s1, s2 = t1.alloc(1), t1.alloc(1)
    t1.store_from_active(st, a, s1)
    t1.store_from_active(pool.high, a, s2)
    assert torch.equal(t1.envelope(int(s1)), t1.envelope(int(s2)))
    t1.load_to_active(s1, st, b)
    t1.load_to_active(s2, pool.high, c)
    rows = lambda t: pool.high.translate(t)
    assert torch.equal(pool.high.temporal_view_all()[:, rows(b)], pool.high.temporal_view_all()[:, rows(c)])
    assert torch.equal(pool.high.conv_view_all(0)[:, rows(b)], pool.high.conv_view_all(0)[:, rows(c)])

    # T2 -> T0 state (restore) through the delegate: the fence lands on the hidden side's allocator
    region = mirror.region("state")
    host = region.alloc(1)
    engine.wait(demote_states(engine, t1, s1.tolist(), region, host))
    d = st.alloc(1)
    scratch = t1.alloc(1)
    tk = restore_states(engine, region, host, t1, scratch, st, d.tolist())
    engine.wait(tk)
    assert tk.ok == [True] and engine.fence in pool.high.allocator.fences
    assert torch.equal(pool.high.temporal_view_all()[:, rows(d)], pool.high.temporal_view_all()[:, rows(b)])

    # T0 KV pages -> T2 -> other T0 pages through the delegate, byte for byte
    src, dst = kv.alloc(8), kv.alloc(8)
    pages = lambda t: pool.low.translate(t[::4]) // 4
    pool.low.rows_bytes()[pages(src)] = torch.randint(0, 256, (2, kv.entry_bytes), dtype=torch.uint8, generator=g)
    kv_host = mirror.region("full").alloc(2)
    engine.wait(demote_kv(engine, kv, src, mirror.region("full"), kv_host))
    tk = load_kv(engine, mirror.region("full"), kv_host, kv, dst)
    engine.wait(tk)
    assert tk.ok == [True, True]
    assert torch.equal(pool.low.rows_bytes()[pages(dst)], pool.low.rows_bytes()[pages(src)])
    engine.poll()
    kv.free(src)  # busy marks were set and released through the protocol's mark_busy / unmark_busy
    pool.check_invariants()
