"""``SlotAllocator``: fixed-size slots ``1..num_slots`` (0 is reserved), with a busy guard.

Used where slots never move (host mirror regions): no virtual ids, no compaction. A slot that an
in-flight transfer reads or writes is *busy*; freeing it raises ``SlotBusyError`` until the transfer
completes, so it can never be handed out again while bytes are still moving.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Optional, Union

import numpy as np
import torch

from tiered_cache.device import host_available_memory
from tiered_cache.errors import MemoryBudgetError, SlotBusyError, SlotStateError
from tiered_cache.validate import int_arg, int_list, is_int, str_arg

IdsLike = Union[torch.Tensor, Sequence[int], np.ndarray]

_TABLE_BYTES_PER_SLOT = 48  # bool flag + heap entry (8-byte pointer, 28-byte int object), rounded up


def id_list(arg: str, ids: IdsLike) -> list[int]:
    """A 1-D integer tensor / sequence as a list of ints (``validate.int_list``: strings, floats, bools and
    None are refused with ``InvalidTypeError``; ``free("12")`` once freed slots 1 and 2)."""
    return int_list(arg, ids)


class BusyMarks:
    """Counts the transfers in flight on each slot id; a busy slot may not be freed."""

    def __init__(self) -> None:
        self._busy: dict[int, int] = {}

    def mark_busy(self, ids: Iterable[int]) -> None:
        for i in ids:
            self._busy[i] = self._busy.get(i, 0) + 1

    def unmark_busy(self, ids: Iterable[int]) -> None:
        for i in ids:
            left = self._busy[i] - 1
            if left:
                self._busy[i] = left
            else:
                del self._busy[i]

    def is_busy(self, slot: int) -> bool:
        return slot in self._busy

    @property
    def busy_ids(self) -> list[int]:
        return sorted(self._busy)


class SlotAllocator(BusyMarks):
    """Slots ``1..num_slots``; ``alloc`` always gives the lowest free ids (a min-heap), so the slots
    of one call tend to be consecutive: a host region then moves them as one contiguous copy."""

    def __init__(self, num_slots: int, name: str = "slots") -> None:
        num_slots = int_arg("num_slots", num_slots, lo=1)
        str_arg("name", name)
        # the host tables (a bool per slot, a heap of Python ints) are allocated here: check they fit first
        need, avail = (num_slots + 1) * _TABLE_BYTES_PER_SLOT, host_available_memory()
        if need > avail:
            raise MemoryBudgetError(f"SlotAllocator {name!r}", need, avail, "num_slots")
        super().__init__()
        self.name = name
        self.num_slots = num_slots
        self.clear()

    def clear(self) -> None:
        if self._busy:
            raise SlotBusyError(f"{self.name}: slots {sorted(self._busy)[:16]} are in flight")
        self._allocated = np.zeros(self.num_slots + 1, dtype=bool)
        self._free: list[int] = list(range(1, self.num_slots + 1))  # a sorted list is a valid heap

    def alloc(self, n: int = 1) -> Optional[list[int]]:
        """``n`` slot ids, or ``None`` when fewer are free (nothing changes)."""
        if type(n) is int and n == 1:  # one slot (an insert's state): no list index into the flags
            if not self._free:
                return None
            i = heapq.heappop(self._free)
            self._allocated[i] = True
            return [i]
        n = int_arg("n", n, lo=0)
        if n > len(self._free):
            return None
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._allocated[ids] = True
        return ids

    def check(self, arg: str, ids: IdsLike, *, unique: bool = True) -> list[int]:
        """Validate allocated ids (typed errors); returns them as a list."""
        lst = id_list(arg, ids)
        if lst and (min(lst) < -2**63 or max(lst) >= 2**63):  # a uint64 id past int64: no slot of ours
            raise SlotStateError(arg, f"allocated {self.name} ids in [1, {self.num_slots}]",
                                 [i for i in lst if not 1 <= i <= self.num_slots][:16])
        arr = np.asarray(lst, dtype=np.int64)
        inside = (arr >= 1) & (arr <= self.num_slots)
        ok = inside.copy()
        ok[inside] = self._allocated[arr[inside]]
        if not ok.all():
            bad = arr[~ok].tolist()
            raise SlotStateError(arg, f"allocated {self.name} ids in [1, {self.num_slots}]", bad[:16])
        if unique and len(set(lst)) != len(lst):
            raise SlotStateError(arg, "distinct ids", lst[:16])
        return lst

    def free(self, ids: IdsLike) -> None:
        """Return slots. Unknown, free, repeated or busy ids raise before anything changes."""
        lst = self.check("ids", ids)
        busy = [i for i in lst if i in self._busy]
        if busy:
            raise SlotBusyError(f"{self.name}: slots {busy[:16]} are read or written by a transfer in flight")
        self._allocated[lst] = False
        for i in lst:
            heapq.heappush(self._free, i)

    def free_owned(self, ids: list[int]) -> None:
        """Trusted ``free``: ids (Python ints) the caller got from ``alloc``, holds and gives back once; only
        the busy marks are checked (an owner that keeps its ids, the radix tree's T1 states, validated
        them when it took them). Anything else corrupts the free list: the public door is ``free``."""
        if self._busy and any(i in self._busy for i in ids):
            busy = [i for i in ids if i in self._busy]
            raise SlotBusyError(f"{self.name}: slots {busy[:16]} are read or written by a transfer in flight")
        if len(ids) == 1:
            self._allocated[ids[0]] = False  # one id: no list index into the flags
        else:
            self._allocated[ids] = False
        for i in ids:
            heapq.heappush(self._free, i)

    def available_size(self) -> int:
        return len(self._free)

    def is_allocated(self, slot: int) -> bool:
        if not is_int(slot):
            int_arg("slot", slot)  # raises InvalidTypeError: a str or float is no slot id
        slot = int(slot)
        return bool(0 < slot <= self.num_slots and self._allocated[slot])

    def allocated_ids(self) -> list[int]:
        return np.nonzero(self._allocated)[0].tolist()

    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"{self.name}: a slot is free twice"
        assert free == set(range(1, self.num_slots + 1)) - set(self.allocated_ids()), f"{self.name}: free set wrong"
        assert not self._allocated[0], f"{self.name}: the reserved slot 0 is allocated"
        assert all(self._allocated[i] for i in self._busy), f"{self.name}: a free slot is busy"
