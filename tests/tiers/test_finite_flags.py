"""``FiniteFlags`` on the CPU: its synchronous path (flags read when a store is sent, kept in a dict until
polled) against the generic one (flags read once a store's event fired, as on a GPU),
which a CPU instance runs when its numpy view is taken away. Driven by the same random stores (some
clearing flags, as a NaN does), frees and polls, the two report the same slots, in the same order, with
the same flags, and agree on what is pending."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_cache.errors import InvalidTypeError
from tiered_cache.tiers.finite_flags import FiniteFlags

CAP = 12


def store(f: FiniteFlags, slots: list[int], bad: set[int]) -> None:
    """A store into ``slots`` as the pool makes it: arm, the kernels mark the flags of non-finite slots, sent."""
    mark = f.arm(torch.tensor(slots, dtype=torch.int64))
    for s in slots:
        if s in bad:
            f.flags[s] = mark
    f.sent(slots)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_cpu_path_reports_as_the_generic_path(seed):
    rng = random.Random(seed)
    fast, ref = FiniteFlags(CAP, torch.device("cpu")), FiniteFlags(CAP, torch.device("cpu"))
    ref._cpu = False  # the generic path: flags read behind events (NullEvents on the CPU)
    assert fast._cpu
    for _ in range(60):
        op = rng.random()
        if op < 0.5:
            slots = rng.sample(range(1, CAP), rng.randrange(1, 4))
            bad = {s for s in slots if rng.random() < 0.3}
            store(fast, slots, bad)
            store(ref, slots, bad)
        elif op < 0.7:
            gone = rng.sample(range(CAP), rng.randrange(0, 4))
            fast.forget(gone)
            ref.forget(gone)
        elif op < 0.9:
            wait = None if rng.random() < 0.5 else rng.sample(range(CAP), rng.randrange(0, 3))
            assert list(fast.poll(wait).items()) == list(ref.poll(wait).items())
        else:
            fast.clear()
            ref.clear()
        assert [fast.pending(s) for s in range(CAP)] == [ref.pending(s) for s in range(CAP)]
    assert list(fast.poll().items()) == list(ref.poll().items())


def test_poll_refuses_bad_wait_for_on_both_paths():
    for generic in (False, True):
        f = FiniteFlags(CAP, torch.device("cpu"))
        if generic:
            f._cpu = False
        store(f, [3], set())
        with pytest.raises(InvalidTypeError):
            f.poll(["3"])
        assert f.pending(3) and f.poll() == {3: True}


class SlowEvent:
    """A store's event that fires when the test says (``done``); ``synchronize`` is counted."""

    def __init__(self) -> None:
        self.done, self.waits = False, 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waits += 1
        self.done = True


@pytest.mark.parametrize("second_bad", [False, True])
def test_a_slot_stored_again_while_in_flight_needs_no_wait_and_the_newer_mark_counts(second_bad):
    """Store 1 of slot 5 (non-finite) is still in flight when store 2 of slot 5 is armed and sent; store
    1's kernels write their mark late, after store 2 was armed: only store 2's own mark makes slot 5
    non-finite. Nothing waited."""
    f = FiniteFlags(CAP, torch.device("cpu"))
    f._cpu = False  # the GPU's path
    first, second = SlowEvent(), SlowEvent()
    m1 = f.arm(torch.tensor([2, 5]))
    f.sent([2, 5], first)
    m2 = f.arm(torch.tensor([5]))
    assert m2 != m1
    f.sent([5], second)
    f.flags[5] = m1  # store 1's kernels found a NaN in slot 5, and ran before store 2's (stream order)
    if second_bad:
        f.flags[5] = m2
    assert f.poll() == {} and f.pending(5) and f.pending(2)  # nothing fired: nothing final
    first.done = second.done = True
    assert f.poll() == {2: True, 5: not second_bad}  # store 1's slot 5 superseded by store 2
    assert first.waits == second.waits == 0
