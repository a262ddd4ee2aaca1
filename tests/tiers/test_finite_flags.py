"""``FiniteFlags`` on the CPU: its synchronous path (flags read when a store is sent, kept in a dict until
polled) against the generic one (the whole-array copy to the host mirror behind an event, as on a GPU),
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
    """A store into ``slots`` as the pool makes it: arm, the kernels clear the flags of non-finite slots, sent."""
    flags = f.arm(torch.tensor(slots, dtype=torch.int64))
    for s in slots:
        if s in bad:
            flags[s] = 0
    f.sent(slots)


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_cpu_path_reports_as_the_generic_path(seed):
    rng = random.Random(seed)
    fast, ref = FiniteFlags(CAP, torch.device("cpu")), FiniteFlags(CAP, torch.device("cpu"))
    ref._cpu = None  # the generic path: host mirror, events (NullEvents on the CPU)
    assert fast._cpu is not None
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
            f._cpu = None
        store(f, [3], set())
        with pytest.raises(InvalidTypeError):
            f.poll(["3"])
        assert f.pending(3) and f.poll() == {3: True}
