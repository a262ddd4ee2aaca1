"""``PageTable``: a side's virtual slot id -> physical row map, on the host and on the device.

The allocator reads and writes the host copy (``v2p``, numpy: alloc, free and compaction change a
few entries at a time, where torch's per-call overhead would dominate) and marks what it changed;
``sync`` pushes those entries to the device copy, which kernels and ``translate`` gather from. On CPU
the two are one array. A free id maps to -1; id 0 is the sink. KV sides are page-aware: a slot is a
page of ``page_size`` tokens and ``translate`` speaks token ids (``page * page_size + offset``).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, OutOfRangeError
from tiered_cache.validate import int_list, is_int

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_I64, _U64 = np.dtype(np.int64), np.dtype(np.uint64)


class PageTable:
    """``capacity`` virtual slot ids -> physical rows; ``page_size`` tokens a slot."""

    def __init__(self, capacity: int, page_size: int, device: torch.device) -> None:
        self.capacity = capacity
        self.page_size = page_size
        self.device = device
        self._on_device = device.type != "cpu"  # read on every free: ``device.type`` makes a str (~1 us)
        self.v2p = np.full(capacity, -1, dtype=np.int64)
        # The device table is what kernels gather from; on CPU it shares memory with the host copy.
        if device.type == "cpu":
            self._table = torch.from_numpy(self.v2p)
        else:
            self._table = torch.full((capacity,), -1, dtype=torch.int64, device=device)
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=device)
        self._ps, self._ps_u = np.array(page_size, dtype=np.int64), np.array(page_size, dtype=np.uint64)
        self._dirty: set[int] = set()
        self.reset()

    def reset(self) -> None:
        """Every id free (the caller maps the sink again)."""
        self.v2p[:] = -1
        self._dirty = set(range(self.capacity)) if self._on_device else set()

    def mark_dirty(self, vids: Iterable[int]) -> None:
        """Host entries changed: ``sync`` pushes them to the device copy."""
        if self._on_device:
            self._dirty.update(vids)

    def translate(self, ids: torch.Tensor) -> torch.Tensor:
        """Virtual token ids -> physical token ids (``page_size`` 1: slot rows), one gather.

        The table's address never changes, so a captured CUDA graph that gathers from it stays valid.
        Ids are an integer tensor (or an int); on CPU their range is checked too (on a GPU that would
        be a device sync per call: there the gather itself faults on an id outside the table).
        """
        ids = self._id_tensor("ids", ids, self.capacity * self.page_size)
        self.sync()
        if self.page_size == 1:
            return self._table[ids]
        return self._table[ids // self.page_size] * self.page_size + ids % self.page_size

    def translate_host(self, ids: np.ndarray) -> np.ndarray:
        """``translate`` on the host table (no device work): free ids map to negative rows."""
        if type(ids) is np.ndarray and ids.dtype is _I64:
            # the common case (a request's slot, a prompt's pages): the same rows as below; any id out of range takes
            # the path below (its error)
            if self.page_size > 1:
                # read as unsigned, a negative id's page is past the table (>= 2^63 / page_size), so ``take``'s own
                # bounds check (IndexError) refuses it with the ids past the end: no bounds pass of our own
                try:
                    rows = self.v2p.take((ids.view(_U64) // self._ps_u).view(_I64))
                except IndexError:
                    pass
                else:  # 0-d operands: numpy's cheaper path for an array operand than for a Python int
                    rows *= self._ps
                    rows += ids % self._ps
                    return rows
            elif ids.size == 1:  # one id (a state slot's, twice a match and an insert): no list made
                if 0 <= ids.item() < self.v2p.shape[0]:
                    return self.v2p[ids]
            elif 0 < ids.size <= 64:  # one test and one bounds pair
                small = ids.ravel().tolist()
                if min(small) >= 0 and max(small) < self.v2p.shape[0]:
                    return self.v2p[ids]
        if isinstance(ids, np.ndarray) and ids.dtype.kind in "iu":
            ids = ids.astype(np.int64, copy=False)  # a uint64 past int64 wraps negative: refused below
        elif is_int(ids):
            ids = np.asarray(int(ids), dtype=np.int64)
        else:  # a float array would truncate, a str would be read as digits: ints only
            lst = int_list("ids", ids)
            if lst and (min(lst) < 0 or max(lst) >= self.capacity * self.page_size):
                raise OutOfRangeError("ids", f"virtual ids in [0, {self.capacity * self.page_size})", lst[:16])
            ids = np.asarray(lst, dtype=np.int64)
        pages = ids // self.page_size if self.page_size > 1 else ids
        # the range: a few ids (a request's slot, a prompt's pages) by Python's min/max, more by numpy's
        few = ids.ravel().tolist() if 0 < ids.size <= 64 else None
        lo, hi = (min(few), max(few)) if few else (ids.min(), ids.max()) if ids.size else (0, 0)
        if lo < 0 or hi // self.page_size >= self.v2p.shape[0]:
            raise OutOfRangeError("ids", f"virtual ids in [0, {self.v2p.shape[0] * self.page_size})",
                                  ids[(ids < 0) | (pages >= self.v2p.shape[0])][:16].tolist())
        if self.page_size == 1:
            return self.v2p[ids]
        return self.v2p[pages] * self.page_size + ids % self.page_size

    def translate_pages(self, page_ids: torch.Tensor) -> torch.Tensor:
        """Virtual page (slot) ids -> physical rows."""
        page_ids = self._id_tensor("page_ids", page_ids, self.capacity)
        self.sync()
        return self._table[page_ids]

    @property
    def table(self) -> torch.Tensor:
        """The table on ``device`` (-1 for free ids), synced; its address never changes."""
        self.sync()
        return self._table

    def sync(self) -> None:
        """Push host-side table changes to the device copy (a no-op on CPU, where they share memory)."""
        if not self._dirty:
            return
        idx = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
        # through pinned memory, without blocking: a pageable copy would hold this thread until the
        # H2D copy engine reached it, behind every large load in flight
        self._table[dev.host_to_device(torch.from_numpy(idx), self.device)] = \
            dev.host_to_device(torch.from_numpy(self.v2p[idx]), self.device)
        self._dirty.clear()

    def expand(self, vids: list[int]) -> torch.Tensor:
        """Virtual page ids -> the token ids of their pages (``page * page_size + 0..page_size-1``) on ``device``."""
        t = torch.tensor(vids, dtype=torch.int64, device=self.device)
        if self.page_size == 1:
            return t
        return (t[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def _id_tensor(self, arg: str, ids, size: int):
        """Ids for a gather: an integer tensor on the table's device (or an int), in ``[0, size)`` on CPU."""
        if isinstance(ids, torch.Tensor):
            if ids.dtype not in _INT_DTYPES:
                raise InvalidTypeError(arg, "an integer tensor of ids", ids.dtype)
            if ids.device.type != "cpu" and ids.device != self.device:  # host ids may index a device table
                raise InvalidArgumentError(arg, f"a tensor on {self.device} or the CPU", ids.device)
            if ids.device.type == "cpu" and ids.numel() and bool(((ids < 0) | (ids >= size)).any()):
                raise OutOfRangeError(arg, f"ids in [0, {size})", ids.reshape(-1)[:16].tolist())
            return ids
        if is_int(ids):
            v = int(ids)
            if not 0 <= v < size:
                raise OutOfRangeError(arg, f"an id in [0, {size})", ids)
            return torch.tensor(v, dtype=torch.int64, device=self.device)
        lst = int_list(arg, ids)
        bad = [v for v in lst if not 0 <= v < size]
        if bad:
            raise OutOfRangeError(arg, f"ids in [0, {size})", bad[:16])
        return torch.tensor(lst, dtype=torch.int64, device=self.device)
