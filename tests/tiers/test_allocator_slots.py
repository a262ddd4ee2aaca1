"""``SlotAllocator.free_owned`` (the trusted free the radix tree gives its T1 slots back through) against the
checked ``free``: the same random allocs and frees leave the same state; a busy slot is refused by both."""

from __future__ import annotations

import random

import pytest

from tiered_cache.errors import SlotBusyError
from tiered_cache.tiers.slots import SlotAllocator


def state(a: SlotAllocator):
    return a._allocated.tolist(), sorted(a._free), a.available_size()


@pytest.mark.parametrize("seed", range(10))
def test_trusted_and_checked_frees_leave_the_same_state(seed):
    rng = random.Random(seed)
    checked, trusted = SlotAllocator(24), SlotAllocator(24)
    held: list[int] = []
    for _ in range(200):
        if held and rng.random() < 0.5:
            rng.shuffle(held)
            k = rng.randrange(1, len(held) + 1)
            out, held = held[:k], held[k:]
            checked.free(out)
            trusted.free_owned(out)
        else:
            n = rng.randrange(0, 5)
            a, b = checked.alloc(n), trusted.alloc(n)
            assert a == b
            held += a or []
        assert state(checked) == state(trusted)
        trusted.check_invariants()


def test_both_refuse_a_busy_slot_and_change_nothing():
    for free in ("free", "free_owned"):
        a = SlotAllocator(4)
        ids = a.alloc(2)
        a.mark_busy([ids[1]])
        before = state(a)
        with pytest.raises(SlotBusyError):
            getattr(a, free)(ids)
        assert state(a) == before
