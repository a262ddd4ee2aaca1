"""``FiniteFlags``: whether each T1 slot's last store read only finite values, known without a sync.

Every store gets a fresh ``mark`` (a counter); its kernels write the mark into a slot's flag when a value
they read for that slot, temporal or conv, is NaN or +-inf (they already hold every value, so the check
is nearly free), and write nothing otherwise. A slot's last store was finite unless its flag holds that
store's mark. Nothing is set before a store (a stale mark of an older store never equals a newer one),
so nothing is launched for the flags, and a store of a slot whose previous store is still in flight
needs no wait: the stream runs the two in order, and only the newer mark counts.

On a GPU the flags live in page-locked host memory, which the kernels write through its mapping (UVA;
only a non-finite store writes at all): no device copy. A store's flags are final once its event fired,
recorded after its kernels by the caller (``IdRing.done``) or here::

    store kernels --non-finite: flags[slot] = mark, over PCIe--> flags (host memory, int64)
    poll: an event that has fired -> its slots' flags are final; one that has not -> skipped, unless the
          caller waits for one of its slots (``wait_for``: a sync on that store, normally long finished)

The owner must not serve a non-finite slot: one NaN spreads through its whole int8 scale group.
On the CPU the work is synchronous: a store's flags are final when it is sent, so no event is recorded.
A store or a free costs numpy work on its own slots, not Python work per slot nor a walk over the stores in
flight: ``_open[s]`` says that slot ``s``'s last store is not reported yet; a store in flight is ``(event,
mark, slots)``, and at poll its slots that are still open and whose last store it was (``_expect == mark``)
are reported.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.validate import int_list

_SPARE = 64  # fired events kept for reuse (an event made and destroyed a store costs host time)


class FiniteFlags:
    """The flags of ``capacity`` slots for a pool on ``device``: ``flags[s]`` holds the mark of the last
    non-finite store of slot ``s`` (0: none yet); ``_expect[s]`` the mark of slot ``s``'s last store."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        # host memory the kernels write through its mapping (an ordinary tensor on the CPU)
        self.flags = dev.pinned_empty(capacity * 8).view(torch.int64)
        self.flags.zero_()
        self._flags_np = self.flags.numpy()
        self._expect = np.zeros(capacity, dtype=np.int64)
        self._open = np.zeros(capacity, dtype=bool)  # the slot's last store is not reported (nor freed) yet
        self._mark = 0
        self._cpu = device.type == "cpu"
        # Stores not yet reported, oldest first: (event after their kernels or None on the CPU, mark, slots, whether
        # the event is this object's own). A slot counts in the newest of them only (``_expect``), and in none once
        # reported or freed.
        self._pending: list[tuple[Any, int, np.ndarray, bool]] = []
        # events this object recorded for reported stores (fired, held by nobody else): recorded again. An event a
        # caller gave (an id ring entry's, which the ring still queries) is never one of them.
        self._spare: list[Any] = []

    def arm(self, slots: Any) -> int:
        """Before a store into ``slots`` (a host int64 array, or a CPU tensor): the store's mark, which its
        kernels write into the flags of the slots they find non-finite."""
        self._mark += 1
        self._expect[slots if isinstance(slots, np.ndarray) else slots.numpy()] = self._mark
        return self._mark

    def sent(self, slots: Any, mark: int, event: Any = None) -> None:
        """After the kernels of the store armed with ``mark`` into ``slots`` (a host int64 array or a list;
        copied): ``event`` (recorded after the kernels; None: one is recorded now, none on the CPU) says when
        its flags are final."""
        slots = np.array(slots, dtype=np.int64)
        self._open[slots] = True
        own = event is None
        if not self._cpu and own:
            event = self._spare.pop() if self._spare else dev.new_event(self.device)
            dev.record_current(event, self.device)
        pending = self._pending
        pending.append((None if self._cpu else event, mark, slots, own))
        if len(pending) > 2 * self._open.size:  # never polled: drop the stores no slot counts in any more (at
            # most one a slot is left, so this runs once per ``capacity`` stores or more)
            open_, expect = self._open, self._expect
            self._pending = [e for e in pending if np.count_nonzero(open_[e[2]] & (expect[e[2]] == e[1]))]

    def poll(self, wait_for: Optional[Iterable[int]] = None) -> dict[int, bool]:
        """Slot -> whether its last store was all finite, for the stores whose flags are final (and those of
        the slots in ``wait_for``, waited for now). Each slot is reported once, a store's in slot order."""
        want = set() if wait_for is None else set(int_list("wait_for", wait_for))
        cap, open_ = self._open.size, self._open
        want = {s for s in want if 0 <= s < cap and open_[s]}
        out: dict[int, bool] = {}
        flags, expect = self._flags_np, self._expect
        done = 0
        for event, mark, slots, own in self._pending:
            if event is not None and not event.query():
                if not want:  # later stores were sent after this one: not done either
                    break
                event.synchronize()  # waits for this store only
            done += 1
            if own and event is not None and len(self._spare) < _SPARE:  # fired, and this object's own
                self._spare.append(event)
            live = slots[open_[slots] & (expect[slots] == mark)]
            if live.size:
                open_[live] = False
                got = live.tolist()
                want.difference_update(got)
                out.update(sorted(zip(got, (flags[live] != mark).tolist())))
        del self._pending[:done]
        return out

    def pending(self, slot: int) -> bool:
        """Whether the finiteness of ``slot``'s last store is not known on the host yet."""
        return 0 <= slot < self._open.size and bool(self._open[slot])

    def forget(self, slots: Any) -> None:
        """Freed slots (ints in range: a host int64 array or a list): their pending results are dropped (a
        later store of them starts afresh)."""
        self._open[slots] = False

    def clear(self) -> None:
        self._pending.clear()
        self._open[:] = False
