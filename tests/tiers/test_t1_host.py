"""T1's moves on numpy views (``tiers/t1_host.py``) against the torch twins they replace on the CPU: the
same T1 bytes, the same finiteness flags and the same T0 states, for every seed; where the fast path
does not apply (bf16, a non-finite state) the twins run."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tiered_cache.specs import StateSpec
from tiered_cache.tiers import t1_args
from tiered_cache.tiers.checkpoint_pool import ActiveViews, Int8CheckpointPool

ROWS, SLOTS = 12, 9


def case(seed: int, big: bool = False):
    """A random spec, codec and T0 views (never zeros), from ``seed``; ``big``: more values a state than
    ``t1_host._FEW``, so the finiteness checks take numpy's sum rather than Python's."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    dtype, conv_dtype = pick([torch.float32, torch.float16]), pick([torch.float32, torch.float16])
    shape = (pick([5, 8]), pick([16, 24]), pick([16, 20])) if big else (pick([1, 2]), pick([3, 4, 16]), pick([4, 5, 8]))
    convs = pick([((6, 3),), ((32, 4), (4, 2))]) if big else pick([(), ((6, 3),), ((6, 3), (4, 2))])
    spec = StateSpec(pick([1, 2]), shape, dtype, conv_shapes=convs, conv_dtype=conv_dtype, value_axis=pick([1, 2]))
    # magnitudes over decades: tiny amaxes hit the 1e-8 clamp (fp16: the scale floor), large ones round
    scale = 10.0 ** torch.randint(-9, 4, (ROWS, spec.num_layers, *shape[:1], 1, 1), generator=g).float()
    temporal = (torch.randn((ROWS, spec.num_layers, *shape), generator=g) * scale).to(dtype)
    conv = tuple(torch.randn((ROWS, spec.num_layers, *c), generator=g).to(conv_dtype).transpose(0, 1) for c in convs)
    return spec, pick(["int8", "lossless"]), ActiveViews(temporal.transpose(0, 1), conv), g


def twins_layout(pool, views):
    """The same checked layout with the numpy path off: the torch twins run."""
    lay = t1_args.make_layout(pool, views)
    return lay, dataclasses.replace(lay, host=None)


def store(pool, lay, rows, slots):
    rows_t, slots_t = torch.tensor(rows), torch.tensor(slots)
    t1_args.kernels_store(pool, lay, rows_t, slots_t, pool.flags.arm(slots_t), len(rows))


def clone(views):
    return ActiveViews(views.temporal.clone(), tuple(c.clone() for c in views.convs))


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("seed", range(24))
def test_numpy_moves_equal_the_torch_twins(seed, big, poison):
    spec, codec, views, g = case(seed, big)
    fast, ref = (Int8CheckpointPool(spec, SLOTS, "cpu", codec=codec, backend="torch") for _ in range(2))
    lay, _ = twins_layout(fast, views)
    _, lay_ref = twins_layout(ref, views)
    assert lay.host is not None and lay_ref.host is None
    for pool in (fast, ref):
        pool.raw.copy_(torch.randint(0, 256, pool.raw.shape, dtype=torch.uint8, generator=torch.Generator()))
    # one state (every other seed: the numpy path's one-slot views) or a few
    n = 1 if seed % 2 else int(torch.randint(1, 6, (1,), generator=g))
    rows = torch.randint(ROWS, (n,), generator=g).tolist()  # a store may read one row twice
    slots = (torch.randperm(SLOTS - 1, generator=g)[:n] + 1).tolist()
    store(fast, lay, rows, slots)
    store(ref, lay_ref, rows, slots)
    assert torch.equal(fast.raw, ref.raw) and torch.equal(fast.flags.flags, ref.flags.flags)
    dst = torch.randperm(ROWS, generator=g)[:n].tolist()  # distinct destinations
    outs = []
    for pool, layout_of in ((fast, lambda v: twins_layout(fast, v)[0]), (ref, lambda v: twins_layout(ref, v)[1])):
        out = clone(views)
        out.temporal[:, dst] = poison.value(spec.temporal_dtype)
        for c in out.convs:
            c[:, dst] = poison.value(spec.conv_dtype)
        t1_args.kernels_load(pool, layout_of(out), torch.tensor(slots), torch.tensor(dst), len(dst))
        outs.append(out)
    (a, b) = outs
    assert torch.equal(a.temporal, b.temporal) and all(torch.equal(x, y) for x, y in zip(a.convs, b.convs))
    assert not a.temporal[:, dst].isnan().any()  # every poisoned row was written


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_state_goes_through_the_twins_and_is_flagged(bad):
    spec, codec, views, _ = case(3)
    fast, ref = (Int8CheckpointPool(spec, SLOTS, "cpu", codec="int8", backend="torch") for _ in range(2))
    views.temporal[0, 2].view(-1)[1] = bad
    lay, _ = twins_layout(fast, views)
    _, lay_ref = twins_layout(ref, views)
    assert not lay.host.store(torch.tensor([2]).numpy(), torch.tensor([4]).numpy())  # refused, nothing written
    assert torch.equal(fast.raw, ref.raw)
    store(fast, lay, [1, 2], [3, 4])
    store(ref, lay_ref, [1, 2], [3, 4])
    assert torch.equal(fast.raw, ref.raw) and torch.equal(fast.flags.flags, ref.flags.flags)
    assert fast.flags.flags[[3, 4]].tolist() == [0, fast.flags._mark]  # slot 4 holds the store's mark


@pytest.mark.parametrize("big", [False, True])
@pytest.mark.parametrize("where", ["temporal", "conv"])
@pytest.mark.parametrize("codec", ["int8", "lossless"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_non_finite_value_is_refused_by_the_numpy_path(bad, codec, where, big):
    """One NaN or +-inf anywhere in a state, its temporal part or a conv window, at either size of finiteness
    check: the numpy store refuses it and writes nothing; the twins store it and flag it, as they do alone."""
    spec, _, views, g = case(5, big)
    fast, ref = (Int8CheckpointPool(spec, SLOTS, "cpu", codec=codec, backend="torch") for _ in range(2))
    t = views.temporal if where == "temporal" else views.convs[-1]
    row = t[:, 2]
    row.reshape(-1)[int(torch.randint(row.numel(), (1,), generator=g))] = bad
    lay, _ = twins_layout(fast, views)
    _, lay_ref = twins_layout(ref, views)
    assert not lay.host.store(torch.tensor([2]).numpy(), torch.tensor([4]).numpy())  # refused, nothing written
    assert torch.equal(fast.raw, ref.raw)
    assert lay.host.store(torch.tensor([1]).numpy(), torch.tensor([3]).numpy())  # a finite row still goes
    store(ref, lay_ref, [1], [3])
    store(fast, lay, [2], [4])
    store(ref, lay_ref, [2], [4])
    assert torch.equal(fast.raw, ref.raw) and fast.flags.flags[4] == fast.flags._mark


def test_no_numpy_path_where_it_does_not_apply():
    """bf16 (no numpy dtype) and the Triton backend keep their own paths."""
    bf16 = StateSpec(1, (1, 4, 4), torch.bfloat16, conv_shapes=((4, 3),), conv_dtype=torch.float32)
    pool = Int8CheckpointPool(bf16, 3, "cpu", backend="torch")
    views = ActiveViews(torch.randn(1, 2, 1, 4, 4).to(torch.bfloat16), (torch.randn(1, 2, 4, 3),))
    assert t1_args.make_layout(pool, views).host is None
    spec = dataclasses.replace(bf16, temporal_dtype=torch.float32)
    pool = Int8CheckpointPool(spec, 3, "cpu", backend="triton")
    views = ActiveViews(torch.randn(1, 2, 1, 4, 4), (torch.randn(1, 2, 4, 3),))
    assert t1_args.make_layout(pool, views).host is None


@pytest.mark.parametrize("codec", ["int8", "lossless"])
def test_a_rows_kept_views_read_and_write_its_current_bytes(codec, poison):
    """``HostMoves`` keeps each T0 row's views after its first move: a store after the row was written again reads
    the new values, and a load writes the row itself (the twins' T1 bytes and T0 rows, move by move)."""
    spec, _, views, g = case(7)
    fast, ref = (Int8CheckpointPool(spec, SLOTS, "cpu", codec=codec, backend="torch") for _ in range(2))
    lay, _ = twins_layout(fast, views)
    _, lay_ref = twins_layout(ref, views)

    def store_np(pool, layout, row, slot):  # host arrays, as ``store_rows`` passes them
        slots = np.array([slot], dtype=np.int64)
        t1_args.kernels_store(pool, layout, np.array([row], dtype=np.int64), slots, pool.flags.arm(slots), 1)

    for k, slot in enumerate((1, 2, 3)):
        views.temporal[:, 4] = torch.randn(views.temporal[:, 4].shape, generator=g).to(spec.temporal_dtype) * (k + 1)
        for c in views.convs:
            c[:, 4] = torch.randn(c[:, 4].shape, generator=g).to(spec.conv_dtype)
        store_np(fast, lay, 4, slot)
        store_np(ref, lay_ref, 4, slot)
        assert torch.equal(fast.raw, ref.raw)
    assert 4 in lay.host._rows  # the row's views were kept
    outs = []
    for pool in (fast, ref):
        out = clone(views)
        out_lay = twins_layout(pool, out)[0 if pool is fast else 1]  # one layout: the fast one keeps row 4's views
        loaded = []
        for slot in (2, 1):  # the same row loaded twice: each load's values land in it
            out.temporal[:, 4] = poison.value(spec.temporal_dtype)
            t1_args.kernels_load(pool, out_lay, np.array([slot], dtype=np.int64), np.array([4], dtype=np.int64), 1)
            loaded.append(out.temporal[:, 4].clone())
        outs.append(loaded)
    assert all(torch.equal(a, b) for a, b in zip(*outs)) and not torch.equal(outs[0][0], outs[0][1])
