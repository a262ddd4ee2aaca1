"""``MultiEndedAllocator``'s two free paths: ``free`` (token ids, every check, vectorised) and the trusted
``free_pages`` (page ids an owner validated once: the radix tree's evictions). Driven by the same random
operations, the two leave the allocator in exactly the same state; the checked path still refuses bad
ids with typed errors and changes nothing."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_cache.errors import InvalidTypeError, SlotBusyError, SlotStateError
from tiered_cache.tiers.allocator import MultiEndedAllocator
from tiered_cache.tiers.holes import HoleMap


def make(ps: int, lazy: bool):
    """A shared buffer's two sides: KV pages of ``ps`` tokens growing up, 1-slot states growing down."""
    kv = MultiEndedAllocator(name="kv", entry_bytes=64, total_bytes=64 * 40, grows="up", page_size=ps, lazy=lazy)
    sts = MultiEndedAllocator(name="st", entry_bytes=128, total_bytes=64 * 40, grows="down", lazy=lazy)
    kv.bind_peer(sts)
    sts.bind_peer(kv)
    return kv, sts


def state(a: MultiEndedAllocator):
    return (a._v2p.tolist(), a._p2v.tolist(), a._n, a._live, list(a._free_vids), a.hole_ranks(), a.num_moves)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), ps=st.sampled_from([1, 4]), lazy=st.booleans())
def test_trusted_and_checked_frees_leave_the_same_state(seed, ps, lazy):
    rng = random.Random(seed)
    checked, trusted = make(ps, lazy), make(ps, lazy)
    held: list[list[int]] = [[], []]  # per side: page ids held (the same on both allocators)
    for _ in range(60):
        side = rng.randrange(2)
        a, b = checked[side], trusted[side]
        unit = a.page_size
        if rng.random() < 0.55:
            n = rng.randrange(0, 5) * unit
            got_a, got_b = a.alloc(n), b.alloc(n)
            assert (got_a is None) == (got_b is None)
            if got_a is not None:
                assert torch.equal(got_a, got_b)
                held[side] += got_a[::unit].div(unit, rounding_mode="floor").tolist()
        elif held[side]:
            k = rng.randrange(1, len(held[side]) + 1)
            pages = rng.sample(held[side], k)
            for p in pages:
                held[side].remove(p)
            tokens = torch.tensor([p * unit + j for p in pages for j in range(unit)], dtype=torch.int64)
            a.free(tokens)
            b.free_pages(pages)
        for x, y in zip(checked, trusted):
            assert state(x) == state(y)
            x.check_invariants()
            y.check_invariants()


@pytest.mark.parametrize("bad, err", [
    (torch.tensor([4, 5, 6]), SlotStateError),  # not whole pages
    (torch.tensor([5, 6, 7, 8]), SlotStateError),  # a page's tokens not from its start
    (torch.tensor([4, 6, 5, 7]), SlotStateError),  # out of order
    (torch.tensor([0, 1, 2, 3]), SlotStateError),  # the sink
    (torch.tensor([400, 401, 402, 403]), SlotStateError),  # past capacity
    (torch.tensor([4, 5, 6, 7, 4, 5, 6, 7]), SlotStateError),  # a page twice
    (torch.tensor([12, 13, 14, 15]), SlotStateError),  # never allocated
    (torch.tensor([4.0, 5.0, 6.0, 7.0]), InvalidTypeError),
    (torch.tensor([[4, 5, 6, 7]]), InvalidTypeError),
    ([4, 5, 6, True], InvalidTypeError),
    ([2**64, 1, 2, 3], SlotStateError),
])
def test_checked_free_refuses_bad_ids_and_changes_nothing(bad, err):
    kv, _ = make(4, lazy=True)
    got = kv.alloc(8)
    assert got is not None and got.tolist() == list(range(4, 12))
    before = state(kv)
    with pytest.raises(err) as e:
        kv.free(bad)
    assert "ids" in str(e.value)
    assert state(kv) == before
    kv.free(got)  # the good ids still free
    kv.check_invariants()


def test_both_paths_refuse_busy_pages():
    kv, _ = make(4, lazy=True)
    got = kv.alloc(8)
    kv.mark_busy([1])
    before = state(kv)
    with pytest.raises(SlotBusyError):
        kv.free(got)
    with pytest.raises(SlotBusyError):
        kv.free_pages([1, 2])
    assert state(kv) == before
    kv.unmark_busy([1])
    kv.free_pages([2, 1])
    assert kv.num_live == 0 and np.all(kv._v2p[1:] < 0)
    kv.check_invariants()


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cap=st.sampled_from([8, 70, 600]))
def test_hole_map_equals_a_sorted_set_of_holes(seed, cap):
    """``HoleMap`` (a bitmap scanned in windows) against the plain model it replaced: a set of hole ranks,
    the lowest taken first, the frontier dropped past the holes at its top."""
    rng = random.Random(seed)
    holes, model = HoleMap(cap), set()
    n = 1  # the band's frontier; ranks [1, n) are live or holes
    for _ in range(80):
        op = rng.random()
        live = sorted(set(range(1, n)) - model)
        if op < 0.4 and n < cap:  # alloc: reuse the lowest holes, then grow
            k = rng.randrange(1, cap - n + len(model) + 1)
            reuse = min(k, len(model))
            want = sorted(model)[:reuse]
            assert holes.take_lowest(reuse).tolist() == want
            model -= set(want)
            n += k - reuse
        elif op < 0.85 and live:  # release some live ranks, then trim
            freed = rng.sample(live, rng.randrange(1, len(live) + 1))
            holes.add(np.array(freed, dtype=np.int64))
            model |= set(freed)
            new_n = holes.trim(n)
            while n > 1 and n - 1 in model:
                n -= 1
                model.discard(n)
            assert new_n == n
        elif op < 0.9:
            assert holes.below(n) == sorted(model)
            holes.clear(n)
            model = set()
        assert holes.ranks() == model and holes.count == len(model)
        assert all(r >= holes.lo for r in model)


def _translate_spec(table, ids):
    """``PageTable.translate_host``'s contract on an integer array: rows of in-range ids, else ``OutOfRangeError``
    naming ``ids``."""
    from tiered_cache.errors import OutOfRangeError

    ps, end = table.page_size, table.v2p.shape[0] * table.page_size
    flat = np.asarray(ids).ravel().tolist()
    if any(not 0 <= int(i) < end for i in flat):
        return OutOfRangeError, "ids"
    ids = np.asarray(ids).astype(np.int64)
    return (table.v2p[ids // ps] * ps + ids % ps).tolist()


@pytest.mark.parametrize("seed", range(6))
def test_translate_host_common_case_is_the_contract(seed):
    """``translate_host`` takes an int64 array at a page size > 1 by ``take``'s own bounds check (a negative id read
    as unsigned, the most negative too), a small one at page size 1 in one test and one bounds pair; anything else
    (other dtypes, an id out of range) the checked path: over random ids, valid or not, both give the rows the
    contract says, or its error."""
    from tiered_cache.errors import InvalidArgumentError
    from tiered_cache.tiers.page_table import PageTable

    rng = np.random.default_rng(seed)
    for ps in (1, 4, 16):
        table = PageTable(24, ps, torch.device("cpu"))
        live = rng.choice(24, size=12, replace=False)
        table.v2p[live] = rng.permutation(24)[:12]
        end = 24 * ps
        for _ in range(150):
            n = int(rng.choice([0, 1, 2, 5, 64, 65, 100]))
            ids = rng.integers(0, end, size=n)
            if n and rng.random() < 0.3:
                ids[rng.integers(n)] = rng.choice([-1, end, end + 7, -end, -2**63, 2**63 - 1])
            ids = ids.astype(rng.choice([np.int64, np.int32, np.uint16])) if (ids >= 0).all() else ids
            if rng.random() < 0.2 and n % 5 == 0 and n:
                ids = ids.reshape(5, -1)
            want = _translate_spec(table, ids)
            try:
                got = table.translate_host(ids).tolist()
            except InvalidArgumentError as e:
                got = (type(e), e.arg)
            assert got == want, (ps, ids, got, want)
