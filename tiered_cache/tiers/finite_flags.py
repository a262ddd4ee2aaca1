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
On the CPU the work is synchronous: a store's flags are known when it is sent, so they are read then
(numpy views, no event) into ``_landed``, slot -> flag in the order ``poll`` reports them; a free drops
its slots from that dict instead of scanning every store not yet polled.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.validate import int_list


class FiniteFlags:
    """The flags of ``capacity`` slots for a pool on ``device``: ``flags[s]`` holds the mark of the last
    non-finite store of slot ``s`` (0: none yet); ``expect[s]`` the mark of slot ``s``'s last store."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        # host memory the kernels write through its mapping (an ordinary tensor on the CPU)
        self.flags = dev.pinned_empty(capacity * 8).view(torch.int64)
        self.flags.zero_()
        self._flags_np = self.flags.numpy()
        self._expect = np.zeros(capacity, dtype=np.int64)
        self._mark = 0
        self._cpu = device.type == "cpu"
        self._landed: dict[int, bool] = {}  # CPU: the flags of stores sent but not yet polled
        # Stores whose flags are not known yet: (event after their kernels, their slots). A slot is in one
        # entry at most (a newer store of it supersedes), and leaves it when it is freed; ``_where`` maps
        # each such slot to its entry's set, so that a store or a free costs its own slots, not a walk over
        # every store in flight (an owner that polls rarely had each call pay for all of them).
        self._pending: list[tuple[Any, set[int]]] = []
        self._where: dict[int, set[int]] = {}

    def arm(self, slots: Any) -> int:
        """Before a store into ``slots`` (a host int64 array, or a CPU tensor): the store's mark, which its
        kernels write into the flags of the slots they find non-finite."""
        self._mark += 1
        self._expect[slots if isinstance(slots, np.ndarray) else slots.numpy()] = self._mark
        return self._mark

    def sent(self, slots: list[int], event: Any = None) -> None:
        """After a store's kernels: ``event`` (recorded after them; None: one is recorded now) says when its
        flags are final."""
        self.forget(slots)
        if self._cpu:
            u = sorted(set(slots))
            self._landed.update(zip(u, (self._flags_np[u] != self._expect[u]).tolist()))
            return
        if event is None:
            event = dev.new_event(self.device)
            event.record(dev.current_stream(self.device))
        pend = set(slots)
        self._pending.append((event, pend))
        for s in pend:
            self._where[s] = pend

    def poll(self, wait_for: Optional[Iterable[int]] = None) -> dict[int, bool]:
        """Slot -> whether its last store was all finite, for the stores whose flags are final (and those of
        the slots in ``wait_for``, waited for now). Each slot is reported once."""
        want = set() if wait_for is None else set(int_list("wait_for", wait_for))
        if self._cpu:  # every store sent has landed
            landed, self._landed = self._landed, {}
            return landed
        if want and not any(s in self._where for s in want):
            want = set()
        out: dict[int, bool] = {}
        keep: list[tuple[Any, set[int]]] = []
        flags, expect = self._flags_np, self._expect
        for i, (event, slots) in enumerate(self._pending):
            if not event.query():
                if not want:  # later stores were sent after this one: not done either
                    keep.extend(self._pending[i:])
                    break
                event.synchronize()  # waits for this store only
            want -= slots
            out.update((s, bool(flags[s] != expect[s])) for s in sorted(slots))
            for s in slots:
                del self._where[s]
        self._pending = [e for e in keep if e[1]]
        return out

    def pending(self, slot: int) -> bool:
        """Whether the finiteness of ``slot``'s last store is not known on the host yet."""
        return slot in self._landed or slot in self._where

    def forget(self, slots: Iterable[int]) -> None:
        """Freed slots: their pending results are dropped (a later store of them starts afresh)."""
        if self._cpu:
            landed = self._landed
            if landed:
                for s in slots:
                    landed.pop(s, None)
            return
        where = self._where
        if where:
            for s in slots:
                pend = where.pop(s, None)
                if pend is not None:
                    pend.discard(s)  # an entry left empty is dropped by the next poll

    def clear(self) -> None:
        self._pending.clear()
        self._where.clear()
        self._landed.clear()
