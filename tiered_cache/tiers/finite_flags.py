"""``FiniteFlags``: whether each T1 slot's last store read only finite values, known without a sync.

Every store clears a slot's flag (``flags [capacity]`` uint8, on the device) when a value it reads,
temporal or conv, is NaN or +-inf; the store kernels already hold every value, so the check is nearly
free, and nothing waits for it. After the store the flags are copied to a pinned host mirror without
blocking, behind an event::

    store kernels (compute stream) --clear flags--> flags --copy (same stream)--> host mirror
    poll: an event that has fired -> its slots' host flags are valid; one that has not -> skipped,
          unless the caller waits for one of its slots (``wait_for``: a sync on that small copy)

The owner must not serve a non-finite slot: one NaN spreads through its whole int8 scale group.
On the CPU the work is synchronous: a store's flags are known when it is sent, so they are read then
(numpy views, no copy, no event) into ``_landed``, slot -> flag in the order ``poll`` reports them; a
free drops its slots from that dict instead of scanning every store not yet polled.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.validate import int_list


class FiniteFlags:
    """The flags of ``capacity`` slots on ``device``, 1 = every value of the slot's last store was finite."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self.flags = torch.ones(capacity, dtype=torch.uint8, device=device)
        self._host = dev.pinned_empty(capacity)
        self._host_np = self._host.numpy()
        self._cpu = self.flags.numpy() if device.type == "cpu" else None
        self._landed: dict[int, bool] = {}  # CPU: the flags of stores sent but not yet polled
        # Stores whose flags are on their way to the host: (event after the copy, their slots). A slot is
        # in one entry at most (a newer store of it supersedes), and leaves it when it is freed.
        self._pending: list[tuple[Any, set[int]]] = []

    def arm(self, slots: Any) -> torch.Tensor:
        """Before a store into ``slots`` (a tensor on the device; on the CPU, a host array too): set their
        flags (the kernels only clear them); returns ``flags``."""
        if self._cpu is not None:
            self._cpu[slots if isinstance(slots, np.ndarray) else slots.numpy()] = 1
        else:
            self.flags.index_fill_(0, slots, 1)
        return self.flags

    def sent(self, slots: list[int]) -> None:
        """After a store: copy the flags to the host without blocking; the event says when they landed."""
        self.forget(slots)
        if self._cpu is not None:
            landed, flags = self._landed, self._cpu
            for s in sorted(set(slots)):
                landed[s] = bool(flags[s])
            return
        # The whole flag array (capacity bytes) in one copy: the slots of older pending stores get their
        # own values again, which no store changed since (a newer store of a slot supersedes its entry).
        self._host.copy_(self.flags, non_blocking=True)
        event = dev.new_event(self.device)
        event.record(dev.current_stream(self.device))
        self._pending.append((event, set(slots)))

    def poll(self, wait_for: Optional[Iterable[int]] = None) -> dict[int, bool]:
        """Slot -> whether its last store was all finite, for the stores whose flags reached the host
        (and those of the slots in ``wait_for``, waited for now). Each slot is reported once."""
        want = set() if wait_for is None else set(int_list("wait_for", wait_for))
        if self._cpu is not None:  # every store sent has landed
            landed, self._landed = self._landed, {}
            return landed
        if want and not any(want & slots for _, slots in self._pending):
            want = set()
        out: dict[int, bool] = {}
        keep: list[tuple[Any, set[int]]] = []
        for i, (event, slots) in enumerate(self._pending):
            if not event.query():
                if not want:  # later stores were copied after this one: not landed either
                    keep.extend(self._pending[i:])
                    break
                event.synchronize()  # waits for this store's flags only
            want -= slots
            out.update((s, bool(self._host_np[s])) for s in sorted(slots))
        self._pending = [e for e in keep if e[1]]
        return out

    def pending(self, slot: int) -> bool:
        """Whether the finiteness of ``slot``'s last store is not known on the host yet."""
        return slot in self._landed or any(slot in slots for _, slots in self._pending)

    def forget(self, slots: Iterable[int]) -> None:
        """Freed slots: their pending results are dropped (a later store of them starts afresh)."""
        if self._cpu is not None:
            landed = self._landed
            if landed:
                for s in slots:
                    landed.pop(s, None)
            return
        drop = set(slots)
        if drop and self._pending:
            for _, pend in self._pending:
                pend -= drop
            self._pending = [e for e in self._pending if e[1]]

    def clear(self) -> None:
        self._pending.clear()
        self._landed.clear()
