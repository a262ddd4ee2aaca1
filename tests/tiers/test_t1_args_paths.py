"""The per-call id checks of a T1 move (``t1_args.CallArgs``) take a short list of ints by Python's builtins
(min / max / set / in on the caller's list) and anything else by numpy: on random ids, valid or not (out of
range, the sink, free T0 ids, unallocated or repeated slots, ints past int64), given as a short list, a long
list, a tuple, an array or a tensor, every form gives the same rows and slots or the same typed error with the
same message; and a move made with lists leaves the same bytes, stats and flags as one made with arrays."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_cache.errors import TieredCacheError
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.tiers.checkpoint_pool import ActiveViews, Int8CheckpointPool
from tiered_cache.tiers.unified_pool import UnifiedPool

SLOTS, ROWS = 40, 48
SPEC = StateSpec(2, (2, 4, 4), torch.float32, conv_shapes=((6, 3),), conv_dtype=torch.bfloat16)


def build(seed: int):
    g = torch.Generator().manual_seed(seed)
    kv = KVSpec(num_layers=1, kv_heads=1, head_dim=16, dtype=torch.bfloat16)
    side = UnifiedPool(kv, SPEC, low_slots=1, high_slots=ROWS, device="cpu").side("mamba")
    vids = side.alloc(ROWS - 8).tolist()
    side.free(torch.tensor(vids[::5]))  # some free ids among the live ones
    t, c = side.temporal_view_all(), side.conv_view_all(0)
    t.copy_(torch.randn(t.shape, generator=g))
    c.copy_(torch.randn(c.shape, generator=g).to(c.dtype))
    pool = Int8CheckpointPool(SPEC, SLOTS, "cpu", backend="torch")
    got = pool.alloc_ids(SLOTS - 6)
    assert got is not None
    pool.free(got[1][::4])
    views = ActiveViews(torch.randn(2, ROWS, 2, 4, 4, generator=g), (torch.zeros(2, ROWS, 6, 3, dtype=torch.bfloat16),))
    return side, pool, views


def outcome(fn, *args):
    try:
        out = fn(*args)
    except TieredCacheError as err:
        return type(err), str(err)
    assert out.dtype == np.int64 and out.ndim == 1
    return out.tolist()


def forms(ids: list[int]):
    """The ids as the caller may give them: list, tuple, int64 array, tensor, and lists of numpy ints and of
    0-d tensors (``validate.int_list`` takes both; a 0-d tensor hashes by identity) when they fit int64."""
    out = [list(ids), tuple(ids)]
    if all(-2**63 <= v < 2**63 for v in ids):
        out += [np.array(ids, dtype=np.int64), torch.tensor(ids, dtype=torch.int64),
                [np.int64(v) for v in ids], [torch.tensor(v) for v in ids]]
    return out


def random_ids(rng: random.Random, lo: int, hi: int) -> list[int]:
    n = rng.choice([0, 1, 2, 3, 5, 16, 17, 30])
    ids = [rng.randrange(lo, hi) for _ in range(n)]
    if ids and rng.random() < 0.05:
        ids[rng.randrange(n)] = 2**64  # past int64
    return ids


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_every_form_of_the_ids_checks_alike(seed):
    rng = random.Random(seed)
    side, pool, views = build(seed % 7)
    args = pool._args
    lay_side, lay_views = args.layout(side), args.layout(views)
    for _ in range(20):
        unique = rng.random() < 0.5
        ids = random_ids(rng, -2, SLOTS + 3)
        if rng.random() < 0.5 and len(ids) > 1:
            ids[-1] = ids[0]  # a repeat
        got = {repr(outcome(args.slots, "ckpt_slots", f, unique)) for f in forms(ids)}
        assert len(got) == 1, (ids, got)
        for s, lay, hi in ((side, lay_side, ROWS + 3), (views, lay_views, ROWS + 3)):
            ids = random_ids(rng, -2, hi)
            if rng.random() < 0.5 and len(ids) > 1:
                ids[-1] = ids[0]
            got = {repr(outcome(args.rows, s, lay, f, unique)) for f in forms(ids)}
            assert len(got) == 1, (ids, got)


@pytest.mark.parametrize("n", [1, 3, 16, 17, 24])
def test_a_move_with_lists_leaves_what_a_move_with_arrays_leaves(n):
    rng = random.Random(n)
    twins = [build(n), build(n)]
    live = twins[0][0].live_virtual_ids()
    slots = twins[0][1].allocator.allocated_ids()
    src, dst, sl = rng.sample(live, n), rng.sample(live, n), rng.sample(slots, n)
    for (side, pool, _), cast in zip(twins, (list, lambda v: np.array(v, dtype=np.int64))):
        pool.store_from_active(side, cast(src), cast(sl))
        pool.load_to_active(cast(sl[::-1]), side, cast(dst))
    (s0, p0, _), (s1, p1, _) = twins
    assert torch.equal(p0.raw, p1.raw) and p0.stats == p1.stats
    assert torch.equal(s0.temporal_view_all(), s1.temporal_view_all())
    assert torch.equal(s0.conv_view_all(0).view(torch.int16), s1.conv_view_all(0).view(torch.int16))
    f0, f1 = p0.poll_flags(), p1.poll_flags()
    assert list(f0.items()) == list(f1.items()) and sorted(f0) == sorted(sl) and all(f0.values())
    assert p0.stats["stores"] == p0.stats["loads"] == n
