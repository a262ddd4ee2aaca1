"""``FiniteFlags`` on the CPU: its synchronous path (no event) and the generic one (each store behind an event, as
on a GPU; a CPU instance runs it when ``_cpu`` is taken away) against a model of what they promise (a dict of the
stores sent and not yet polled, slot -> finite, a re-stored slot moved to the end). Driven by the same random
stores (some non-finite, as a NaN makes them), frees and polls, all three report the same slots, in the same
order, with the same flags, and agree on what is pending. On the generic path, stores whose events have not
fired stay pending, and ``wait_for`` waits for the stores up to the wanted slots' only."""

from __future__ import annotations

import random

import numpy as np
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
    f.sent(slots, mark)


class Model:
    """What the flags promise on the CPU: the stores sent and not polled, slot -> finite, in order of their last
    store (a store's slots in slot order)."""

    def __init__(self) -> None:
        self.landed: dict[int, bool] = {}

    def store(self, slots: list[int], bad: set[int]) -> None:
        for s in sorted(set(slots)):
            self.landed.pop(s, None)
            self.landed[s] = s not in bad

    def forget(self, slots: list[int]) -> None:
        for s in slots:
            self.landed.pop(s, None)

    def poll(self) -> dict[int, bool]:
        out, self.landed = self.landed, {}
        return out


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_cpu_path_reports_as_the_generic_path(seed):
    rng = random.Random(seed)
    fast, ref, model = FiniteFlags(CAP, torch.device("cpu")), FiniteFlags(CAP, torch.device("cpu")), Model()
    ref._cpu = False  # the generic path: flags read behind events (NullEvents on the CPU)
    assert fast._cpu
    for _ in range(60):
        op = rng.random()
        if op < 0.5:
            slots = rng.sample(range(1, CAP), rng.randrange(1, 4))
            bad = {s for s in slots if rng.random() < 0.3}
            store(fast, slots, bad)
            store(ref, slots, bad)
            model.store(slots, bad)
        elif op < 0.7:
            gone = rng.sample(range(CAP), rng.randrange(0, 4))
            fast.forget(gone)
            ref.forget(gone)
            model.forget(gone)
        elif op < 0.9:
            wait = None if rng.random() < 0.5 else rng.sample(range(CAP), rng.randrange(0, 3))
            want = list(model.poll().items())
            assert list(fast.poll(wait).items()) == want and list(ref.poll(wait).items()) == want
        else:
            fast.clear()
            ref.clear()
            model.landed.clear()
        want_pending = [s in model.landed for s in range(CAP)]
        assert [fast.pending(s) for s in range(CAP)] == want_pending == [ref.pending(s) for s in range(CAP)]
    want = list(model.poll().items())
    assert list(fast.poll().items()) == want and list(ref.poll().items()) == want


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
    f.sent([2, 5], m1, first)
    m2 = f.arm(torch.tensor([5]))
    assert m2 != m1
    f.sent([5], m2, second)
    f.flags[5] = m1  # store 1's kernels found a NaN in slot 5, and ran before store 2's (stream order)
    if second_bad:
        f.flags[5] = m2
    assert f.poll() == {} and f.pending(5) and f.pending(2)  # nothing fired: nothing final
    first.done = second.done = True
    assert f.poll() == {2: True, 5: not second_bad}  # store 1's slot 5 superseded by store 2
    assert first.waits == second.waits == 0


def test_poll_stops_at_a_store_in_flight_and_waits_only_up_to_the_wanted_slots():
    f = FiniteFlags(CAP, torch.device("cpu"))
    f._cpu = False
    events = [SlowEvent() for _ in range(3)]
    for slots, event in zip(([1, 2], [3], [4]), events):
        mark = f.arm(np.array(slots))
        f.flags[slots[-1]] = mark  # the last slot of each store non-finite
        f.sent(np.array(slots), mark, event)
    events[1].done = True
    assert f.poll() == {} and all(f.pending(s) for s in (1, 2, 3, 4))  # the oldest is in flight: nothing final
    assert f.poll(wait_for=[3]) == {1: True, 2: False, 3: False}  # waits for the first store, not the third
    assert [e.waits for e in events] == [1, 0, 0] and f.pending(4) and not f.pending(3)
    f.forget([4])  # freed while in flight: never reported
    events[2].done = True
    assert f.poll(wait_for=[4]) == {} and not f.pending(4) and events[2].waits == 0
    assert not f.pending(-1) and not f.pending(CAP)


@pytest.mark.parametrize("generic", [False, True])
def test_an_owner_that_never_polls_keeps_a_bounded_list(generic):
    """Stores again and again into the same few slots, never polled: the stores no slot counts in are dropped,
    so the list stays within twice the capacity, and the first poll still reports each slot's last store."""
    f = FiniteFlags(CAP, torch.device("cpu"))
    f._cpu = not generic
    rng = random.Random(3)
    last: dict[int, bool] = {}
    for _ in range(20 * CAP):
        slots = rng.sample(range(1, 4), rng.randrange(1, 3))
        bad = {s for s in slots if rng.random() < 0.3}
        store(f, slots, bad)
        last.update((s, s not in bad) for s in slots)
        assert len(f._pending) <= 2 * CAP
    assert f.poll() == last


def test_a_reported_stores_event_is_recorded_again_and_one_in_flight_never(monkeypatch):
    """The events the flags record themselves come back once their store is reported (fired, held by no one else)
    and are recorded for later stores; an event still in flight is never taken, nor one a caller gave; the spares
    stay bounded."""
    from tiered_cache import device as dev
    from tiered_cache.tiers import finite_flags

    made: list[SlowEvent] = []

    def new_event(device: object) -> SlowEvent:
        made.append(SlowEvent())
        return made[-1]

    monkeypatch.setattr(dev, "new_event", new_event)
    monkeypatch.setattr(dev, "record_current", lambda event, device: setattr(event, "done", False))  # in flight
    f = FiniteFlags(CAP, torch.device("cpu"))
    f._cpu = False
    store(f, [1], set())
    store(f, [2], set())
    assert len(made) == 2
    made[0].done = True
    assert f.poll() == {1: True}  # the second store's event has not fired: it stays pending, and is not spare
    store(f, [3], {3})
    assert len(made) == 2 and f._pending[-1][0] is made[0]  # the reported store's event, recorded again
    store(f, [4], set())
    assert len(made) == 3 and made[2] is not made[1]  # none spare: a new one (the one in flight not taken)
    for e in made:
        e.done = True
    assert f.poll() == {2: True, 3: False, 4: True}
    lent = SlowEvent()  # an event the caller gave (an id ring entry's, which the ring still queries): never spare
    spare = len(f._spare)
    mark = f.arm(np.array([9]))
    f.sent(np.array([9]), mark, lent)
    lent.done = True
    assert f.poll() == {9: True} and len(f._spare) == spare and lent not in f._spare
    monkeypatch.setattr(finite_flags, "_SPARE", 2)
    for s in (5, 6, 7, 8):
        store(f, [s], set())
    for e in made:
        e.done = True
    f.poll()
    assert len(f._spare) <= 2


@pytest.mark.gpu
def test_gpu_record_current_records_on_the_current_stream():
    """``device.record_current`` (the flags' and the id ring's event record) records on the stream current at the
    call, a side stream's as the default's: behind a long sleep queued on the side stream, not on the idle default."""
    from tiered_cache import device as dev

    cuda = torch.device("cuda")
    side, ev = torch.cuda.Stream(), torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time, on the side stream only
        dev.record_current(ev, cuda)
    torch.cuda.current_stream().synchronize()  # the default stream has nothing queued
    assert not ev.query()  # behind the side stream's sleep
    ev.synchronize()
    assert (torch.cuda.current_device(), side.cuda_stream) in dev._STREAMS
    ev2 = torch.cuda.Event()
    dev.record_current(ev2, cuda)  # the default stream again
    ev2.synchronize()
    assert ev2.query()
