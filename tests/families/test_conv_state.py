"""A state of conv windows only (Lfm2's short conv: ``StateSpec(temporal_shape=())``) through the spec, T0,
T1 and the adapter: what the per-family test (test_families.py) relies on, checked piece by piece.

Every codec keeps conv windows in their own dtype, so a conv-only state moves T0 -> T1 -> T0 bit for bit
under int8 as under lossless; the destinations are NaN-poisoned first, so an unwritten value fails.
"""

from __future__ import annotations

import pytest
import torch

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.tiers.checkpoint_pool import ActiveViews, Int8CheckpointPool, envelope_layout
from tiered_cache.tiers.unified_pool import UnifiedPool

CONVS = (((24, 3),), ((24, 3), (7, 5)))


def conv_spec(convs=((24, 3),), layers=2, dtype=torch.float32) -> StateSpec:
    return StateSpec(layers, (), dtype, conv_shapes=convs, conv_dtype=dtype)


def test_spec_without_temporal_state():
    spec = conv_spec(CONVS[1])
    assert not spec.has_temporal and spec.temporal_bytes == 0
    # the envelope is the conv windows alone: no field of 0 bytes, no padding for one
    assert spec.bytes_per_slot() == 2 * (24 * 3 * 4 + 7 * 5 * 4 + 4)  # 7 x 5 x 4 = 140 -> 144 aligned
    assert [c for _, c in spec.field_offsets()] == [(0, 288), (432, 720)]
    with pytest.raises(InvalidArgumentError) as err:  # 7 channels of the second window: not by 2
        spec.shard(2)
    assert err.value.arg == "tp"
    assert conv_spec().shard(2).conv_shapes == ((12, 3),)
    for prop in ("d_v", "d_k", "num_heads"):  # what only a temporal state has: a typed error naming the spec
        with pytest.raises(InvalidArgumentError) as err:
            getattr(spec, prop)
        assert err.value.arg == "spec"


@pytest.mark.parametrize("bad, arg", [(dict(conv_shapes=()), "conv_shapes"),
                                      (dict(temporal_shape=(4, 8)), "temporal_shape"),
                                      (dict(temporal_shape="44"), "temporal_shape")])
def test_spec_without_temporal_state_bad_input(bad, arg):
    """``()`` means no temporal state only beside a conv window; a shape of other than 3 dims stays refused."""
    kw = dict(num_layers=2, temporal_shape=(), conv_shapes=((24, 3),)) | bad
    with pytest.raises((InvalidArgumentError, TypeError)) as err:
        StateSpec(**kw)
    assert getattr(err.value, "arg", None) == arg


@pytest.mark.parametrize("codec", ["int8", "lossless"])
@pytest.mark.parametrize("convs", CONVS, ids=["one-window", "two-windows"])
def test_t1_moves_conv_only_states_bit_for_bit(codec, convs, poison):
    """Store four T0 states (physical rows) into T1 and load them back into poisoned rows: equal, under
    either codec; the envelope holds the conv fields alone."""
    spec = conv_spec(convs)
    fields, nbytes = envelope_layout(spec, codec)
    assert [f.name for f in fields] == [f"conv{i}" for i in range(len(convs))] and nbytes == spec.bytes_per_slot()
    pool = Int8CheckpointPool(spec, 6, "cpu", codec=codec, backend="triton")
    g = torch.Generator().manual_seed(1)
    src = ActiveViews(None, tuple(torch.randn((spec.num_layers, 5, *c), generator=g) for c in convs))
    rows, slots = [4, 0, 2, 3], pool.alloc(4)
    pool.store_from_active(src, rows, slots)
    dst = ActiveViews(None, tuple(poison((spec.num_layers, 5, *c)) for c in convs))
    pool.load_to_active(slots, dst, [1, 2, 3, 4])
    for s, d in zip(src.convs, dst.convs):
        assert torch.equal(d[:, 1:], s[:, rows])
        assert d[:, 0].isnan().all()  # a row no load named is untouched
    assert pool.poll_nonfinite(slots.tolist()) == []


def test_t1_flags_a_non_finite_conv_window():
    spec = conv_spec()
    pool = Int8CheckpointPool(spec, 2, "cpu", codec="int8", backend="triton")
    conv = torch.randn((spec.num_layers, 2, 24, 3))
    conv[1, 1, 5, 2] = float("inf")
    slots = pool.alloc(2)
    pool.store_from_active(ActiveViews(None, (conv,)), [0, 1], slots)
    assert pool.poll_nonfinite(slots.tolist()) == [int(slots[1])]


def test_t1_refuses_a_temporal_view_for_a_conv_only_spec():
    """A temporal tensor (or views that carry one) where the spec has none: a typed error, nothing written."""
    spec = conv_spec()
    pool = Int8CheckpointPool(spec, 2, "cpu", codec="int8")
    slots = pool.alloc(1)
    before = pool.raw.clone()
    conv = (torch.ones(2, 2, 24, 3),)
    for side in (torch.zeros(spec.num_layers, 2, 4, 8, 8), ActiveViews(torch.zeros(2, 2, 4), conv)):
        with pytest.raises(InvalidArgumentError) as err:
            pool.store_from_active(side, [0], slots)
        assert err.value.arg == "side.temporal"
    assert torch.equal(pool.raw, before)


def test_t0_side_of_a_conv_only_state(poison):
    """A ``UnifiedPool`` state side holds conv windows only: its conv view aliases the slot's bytes, T1 moves
    it through the side's virtual ids, and the temporal view is a typed error."""
    spec = conv_spec()
    t0 = UnifiedPool(KVSpec(2, 2, 16, torch.float32), spec, low_slots=4, high_slots=4, page_size=4, device="cpu")
    side = t0.side("mamba")
    assert side.entry_bytes == spec.bytes_per_slot()
    with pytest.raises(InvalidArgumentError) as err:
        side.temporal_view_all()
    assert err.value.arg == "spec"
    ids = side.alloc(2)
    conv = side.conv_view_all(0)
    rows = side.translate(ids)
    conv[:, rows] = torch.randn((spec.num_layers, 2, 24, 3))
    want = conv[:, rows].clone()
    pool = Int8CheckpointPool(spec, 3, "cpu", codec="int8")
    slots = pool.alloc(2)
    pool.store_from_active(side, ids, slots)
    conv[:, rows] = poison.value(conv.dtype)
    pool.load_to_active(slots.flip(0), side, ids)
    assert torch.equal(conv[:, rows], want.flip(1))


def test_adapter_moves_lfm2_conv_windows():
    """Lfm2: the spec read off its cache has no temporal state; a cache's windows written to a T0 slot and
    read back into a fresh cache continue exactly as the original."""
    pytest.importorskip("transformers")
    from tiered_cache.engine.adapters import HybridCacheAdapter
    from tiered_cache.engine.models import tiny_family
    from tiered_cache.engine.runner.forward import forward_chunk, new_cache

    model = tiny_family("lfm2", seed=0, long_memory=True, device="cpu")
    ad = HybridCacheAdapter(model, page_size=4)
    st = ad.specs.state
    assert st is not None and not st.has_temporal and st.conv_shapes == ((64, 3),)
    assert ad.specs.linear_layers == (0, 2) and ad.specs.full_layers == (1, 3)
    t0 = UnifiedPool(ad.specs.full, st, low_slots=8, high_slots=2, page_size=4, device="cpu")
    kv, states = t0.side("full"), t0.side("mamba")
    ids = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(0))
    cache = new_cache(model)
    forward_chunk(model, cache, ids[:16], 0)
    token_ids = kv.alloc(16)
    ad.export_kv(cache, kv, token_ids, 0, 16)
    slot = states.alloc(1)
    ad.export_state(cache, states, slot)
    restored = ad.build_cache(kv, token_ids, states, slot, n_tokens=16)
    want, _ = forward_chunk(model, cache, ids[16:], 16)
    got, _ = forward_chunk(model, restored, ids[16:], 16)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    states.conv_view_all(0)[:, states.translate(slot)] = 0  # the control: without the windows it differs
    zeroed, _ = forward_chunk(model, ad.build_cache(kv, token_ids, states, slot, n_tokens=16), ids[16:], 16)
    assert (zeroed - want).abs().max().item() > 0.1
