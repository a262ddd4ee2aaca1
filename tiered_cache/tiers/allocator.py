"""``MultiEndedAllocator``: one side of a ``UnifiedPool``, handing out virtual slot ids.

Two allocators share one byte buffer. The ``up`` side's band starts at the low bytes, the ``down``
side's at the high bytes; each grows towards the other and never into bytes the other holds::

    byte 0                                                                      total_bytes
    | sink | up rank 1 | up rank 2 | ... ->    (free bytes)    <- ... | down rank 1 | sink |
    |<----------- up band: n_up * E_up -------->|      |<------ down band: n_down * E_down ->|

A side counts its slots by *rank*, the distance from its own end (rank 0 is the reserved sink that
padded writes land in). The *physical* id of a slot is its row in the side's typed views, which run
in ascending byte order: row = rank on the up side, row = capacity - 1 - rank on the down side.
Everything above the allocator holds *virtual* ids; ``translate`` maps them to physical rows with
one gather, so compaction (moving live slots into holes to shrink the band) rewrites only the
tables, never a reference held above.

Eager compaction keeps a band hole-free after every ``free``. Lazy compaction leaves holes, reuses
them first, and compacts only when the peer needs the bytes (or on ``compact()``).

KV sides are page-aware: one slot is a page of ``page_size`` tokens; ``alloc``/``free``/``translate``
speak token ids (``page * page_size + offset``), as a serving engine's token-to-KV map does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.errors import (
    InvalidArgumentError,
    InvalidTypeError,
    MemoryBudgetError,
    OutOfRangeError,
    SlotBusyError,
    SlotStateError,
)
from tiered_cache.tiers.holes import HoleMap
from tiered_cache.tiers.page_table import PageTable
from tiered_cache.tiers.slots import BusyMarks
from tiered_cache.validate import bool_arg, choice_arg, int_arg, int_list, is_int, str_arg

Mover = Callable[[torch.Tensor, torch.Tensor], None]

# Host bytes per slot of capacity: v2p and p2v (int64 each) and a free-list entry (an 8-byte pointer to a
# 28-byte int object), rounded up.
HOST_TABLE_BYTES_PER_SLOT = 64

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class MultiEndedAllocator(BusyMarks):
    """Virtual-id allocator for one side of a shared byte buffer.

    Args:
        name: the side's name, used in error messages.
        entry_bytes: bytes of one slot (one page for KV).
        total_bytes: bytes of the whole shared buffer.
        grows: ``"up"`` (from byte 0) or ``"down"`` (from ``total_bytes``).
        page_size: tokens per slot (1 for state sides).
        lazy: lazy compaction instead of eager.
        device: where the translate table lives (ids handed out live there too).
        mover: ``mover(src_rows, dst_rows)`` copies whole slots inside this side's rows; called by
            compaction before the tables change. ``None``: the allocator manages ids only.
    """

    def __init__(
        self,
        *,
        name: str,
        entry_bytes: int,
        total_bytes: int,
        grows: str,
        page_size: int = 1,
        lazy: bool = False,
        device: torch.device | str = "cpu",
        mover: Optional[Mover] = None,
    ) -> None:
        # every check before any table is made: a bad argument leaves nothing half-built
        str_arg("name", name)
        entry_bytes = int_arg("entry_bytes", entry_bytes, lo=1)
        total_bytes = int_arg("total_bytes", total_bytes, lo=1)
        choice_arg("grows", grows, ("up", "down"))
        page_size = int_arg("page_size", page_size, lo=1, hi=1 << 20)
        lazy = bool_arg("lazy", lazy)
        device = dev.resolve(device)
        if mover is not None and not callable(mover):
            raise InvalidTypeError("mover", "a callable mover(src_rows, dst_rows) or None", mover)
        if total_bytes // entry_bytes < 2:
            raise InvalidArgumentError(
                "total_bytes", f"room for the sink and one slot of {entry_bytes} bytes", total_bytes
            )
        # The tables are one row per slot the side could ever hold, on the host (and on the device):
        # total_bytes=2**63 with small slots would ask for an EiB of table, so check before allocating.
        capacity = total_bytes // entry_bytes
        need, avail = capacity * HOST_TABLE_BYTES_PER_SLOT, dev.host_available_memory()
        if need > avail:
            raise MemoryBudgetError(f"allocator {name!r} tables", need, avail, "total_bytes (or raise entry_bytes)")
        if device.type == "cuda":
            need, avail = capacity * 8, dev.free_memory(device)
            if need > avail:
                raise MemoryBudgetError(f"allocator {name!r} device table", need, avail, "total_bytes")
        super().__init__()  # busy marks: virtual slot ids under a transfer in flight
        self.name = name
        self.entry_bytes = int(entry_bytes)
        self.total_bytes = int(total_bytes)
        self.grows = grows
        self.page_size = page_size
        self.lazy = lazy
        self.device = device
        self.mover = mover
        self.capacity = self.total_bytes // self.entry_bytes  # rows if this side had every byte
        self.peer: Optional[MultiEndedAllocator] = None
        # Called before compaction moves data: a transfer engine makes compute wait for its copies.
        self.fences: list[Callable[[], None]] = []
        self.num_moves = 0  # slots moved by compaction, for stats and tests
        self.pages = PageTable(self.capacity, page_size, self.device)
        self._v2p = self.pages.v2p  # the table's host copy, which alloc, free and compaction rewrite
        self._offsets = np.arange(page_size, dtype=np.int64)  # a page's token offsets, for free's check
        self.clear()

    # ----------------------------------------------------------------------------------- setup

    def bind_peer(self, peer: MultiEndedAllocator) -> None:
        if not isinstance(peer, MultiEndedAllocator):
            raise InvalidTypeError("peer", "a MultiEndedAllocator", type(peer).__name__)
        if peer is self or peer.total_bytes != self.total_bytes or peer.grows == self.grows:
            raise InvalidArgumentError("peer", "the other side of the same buffer", peer.name)
        self.peer = peer

    def clear(self) -> None:
        """Forget every allocation (no data moves): the band is the sink alone."""
        self.pages.reset()
        self._p2v = np.full(self.capacity, -1, dtype=np.int64)
        sink_row = self._row(0)
        self._v2p[0] = sink_row
        self._p2v[sink_row] = 0
        self._n = 1  # band size in ranks, sink included
        self._live = 0
        self._free_vids: list[int] = list(range(self.capacity - 1, 0, -1))  # pop() gives 1, 2, ...
        self._holes = HoleMap(self.capacity)  # free ranks inside the band (lazy compaction)
        if getattr(self, "_busy", None):
            raise SlotBusyError(f"side {self.name!r}: cannot clear with transfers in flight")

    # ------------------------------------------------------------------------------- geometry

    def _row(self, rank):
        return rank if self.grows == "up" else self.capacity - 1 - rank

    def band_bytes(self) -> int:
        """Bytes from this side's end to its frontier, holes included."""
        return self._n * self.entry_bytes

    def live_band_bytes(self) -> int:
        """Bytes the band would take once compacted."""
        return (self._live + 1) * self.entry_bytes

    def _max_ranks(self, peer_bytes: Optional[int] = None) -> int:
        if self.peer is None:
            return self.capacity
        if peer_bytes is None:
            peer_bytes = self.peer.band_bytes()
        return min(self.capacity, (self.total_bytes - peer_bytes) // self.entry_bytes)

    # ------------------------------------------------------------------------------- queries

    def available_size(self) -> int:
        """Tokens (slots when ``page_size`` is 1) ``alloc`` can return without moving the peer."""
        slots = self._holes.count + max(0, self._max_ranks() - self._n)
        return min(slots, len(self._free_vids)) * self.page_size

    def schedulable_available_size(self) -> int:
        """Tokens ``alloc`` can return now, counting peer holes that compaction would release."""
        peer_bytes = None if self.peer is None else self.peer.live_band_bytes()
        slots = self._holes.count + max(0, self._max_ranks(peer_bytes) - self._n)
        return min(slots, len(self._free_vids)) * self.page_size

    @property
    def num_live(self) -> int:
        return self._live

    @property
    def num_holes(self) -> int:
        return self._holes.count

    def hole_ranks(self) -> list[int]:
        """The band's holes, ascending (tests compare allocators by them)."""
        return sorted(self._holes.ranks())

    def live_virtual_ids(self) -> list[int]:
        return sorted(int(v) for v in np.nonzero(self._v2p >= 0)[0] if v != 0)

    def physical_of(self, vid: int) -> int:
        """The physical row of one virtual slot id (not page-expanded); -1 when free."""
        if not is_int(vid):
            raise InvalidTypeError("vid", f"an int in [0, {self.capacity})", vid)
        if not 0 <= int(vid) < self.capacity:  # numpy would count a negative id from the end
            raise OutOfRangeError("vid", f"an int in [0, {self.capacity})", vid)
        return int(self._v2p[int(vid)])

    # ------------------------------------------------------------------------------- alloc/free

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """``n`` virtual ids (tokens, whole pages) on ``device``, or ``None`` if there is no room.

        Holes are reused first (lowest rank first), then the band grows. When growing would cross
        into the peer's band and compacting the peer would make room, the peer is compacted.
        On ``None`` nothing has changed.
        """
        n = int_arg("n", n, lo=0)
        if n % self.page_size:
            raise InvalidArgumentError("n", f"a multiple of page_size={self.page_size}", n)
        k = int(n) // self.page_size
        if k > len(self._free_vids):
            return None
        reuse = min(k, self._holes.count)
        grow = k - reuse
        if self._n + grow > self._max_ranks():
            if self.peer is None or self._n + grow > self._max_ranks(self.peer.live_band_bytes()):
                return None
            self.peer.compact()  # the peer's holes are exactly the bytes we need
        ranks = np.concatenate((self._holes.take_lowest(reuse), np.arange(self._n, self._n + grow)))
        self._n += grow
        vids = [self._free_vids.pop() for _ in range(k)]
        rows = self._row(ranks)
        self._v2p[vids] = rows
        self._p2v[rows] = vids
        self._live += k
        self.pages.mark_dirty(vids)
        return self.pages.expand(vids)

    def free(self, ids: torch.Tensor) -> None:
        """Return ids from ``alloc``. Free, unknown or repeated ids raise before anything changes."""
        self._release(self._pages_of(ids))

    def free_pages(self, vids: list[int]) -> None:
        """Trusted ``free`` of virtual page (slot) ids: each one the caller got from ``alloc``, holds and gives
        back once. Nothing but the busy marks is checked: it is for an owner that validated the ids once,
        when it took them (the radix tree, at insert), and hands them back on every eviction. Anything
        else (an id twice, one never allocated) corrupts the tables: the public door is ``free``."""
        self._release(vids)

    def _release(self, vids: list[int]) -> None:
        if not vids:
            return
        if self._busy and any(v in self._busy for v in vids):
            busy = [v for v in vids if v in self._busy]
            raise SlotBusyError(f"side {self.name!r}: slots {busy[:16]} are read or written by a transfer in flight")
        arr = np.array(vids, dtype=np.int64)  # one conversion for both fancy indexes
        rows = self._v2p[arr]
        self._v2p[arr] = -1
        self._p2v[rows] = -1
        self._live -= len(vids)
        self._free_vids.extend(reversed(vids))
        self.pages.mark_dirty(vids)
        self._holes.add(self._row(rows))  # rank <-> row is its own inverse
        if self.lazy:
            self._trim()
        else:
            self.compact()

    def compact(self) -> int:
        """Move the live slots above the compacted frontier into the holes below it.

        Returns the number of slots moved. Data moves first (one ``mover`` call), then the tables.
        """
        new_n = self._live + 1
        if self._n == new_n:
            self._clear_holes()
            return 0
        targets = self._holes.below(new_n)
        top_rows = self._row(np.arange(new_n, self._n))
        sources = [int(r) for r in top_rows[self._p2v[top_rows] >= 0]]
        dst_rows = [self._row(r) for r in targets]
        assert len(sources) == len(dst_rows), "compaction lost track of a slot"
        if sources:
            for fence in self.fences:
                fence()
            if self.mover is not None:
                dev = self.device
                self.mover(torch.tensor(sources, device=dev), torch.tensor(dst_rows, device=dev))
            moved_vids = self._p2v[sources].copy()
            self._p2v[sources] = -1
            self._p2v[dst_rows] = moved_vids
            self._v2p[moved_vids] = dst_rows
            self.pages.mark_dirty(moved_vids.tolist())
            self.num_moves += len(sources)
        self._clear_holes()
        self._n = new_n
        return len(sources)

    def physical_rows(self, vids: Sequence[int], arg: str = "vids") -> list[int]:
        """Host-side translate of allocated virtual slot (page) ids to physical rows, no device round trip.

        The sink (0), free ids and ids outside ``[1, capacity)`` raise ``SlotStateError``: numpy would
        read a negative id from the table's end, and the sink is no request's slot."""
        vids = int_list(arg, vids)
        cap = self.capacity
        bad = [v for v in vids if not 0 < v < cap]
        if not bad:
            rows = self._v2p[vids].tolist()
            bad = [v for v, r in zip(vids, rows) if r < 0]
        if bad:
            raise SlotStateError(arg, f"allocated ids in [1, {cap}) of side {self.name!r}", bad[:16])
        return rows

    # -------------------------------------------------------------------------------- translate

    def translate(self, ids: torch.Tensor) -> torch.Tensor:
        """Virtual token ids -> physical token ids on ``device`` (``PageTable.translate``)."""
        return self.pages.translate(ids)

    def translate_host(self, ids: np.ndarray) -> np.ndarray:
        """``translate`` on the host table (no device work): free ids map to negative rows."""
        return self.pages.translate_host(ids)

    def translate_pages(self, page_ids: torch.Tensor) -> torch.Tensor:
        """Virtual page (slot) ids -> physical rows on ``device``."""
        return self.pages.translate_pages(page_ids)

    # ------------------------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Recompute from the tables that ids, rows, holes and bands agree. Raises AssertionError."""
        v2p, p2v = self._v2p, self._p2v
        live_v = np.nonzero(v2p >= 0)[0]
        assert v2p[0] == self._row(0) and p2v[self._row(0)] == 0, "sink moved"
        assert np.array_equal(p2v[v2p[live_v]], live_v), "v2p and p2v are not inverse"
        live_rows = np.nonzero(p2v >= 0)[0]
        assert len(live_rows) == len(live_v), "a physical row holds two ids, or an id two rows"
        assert len(live_v) == self._live + 1, "live counter disagrees with the table"
        ranks = self._row(live_rows)
        assert ranks.max() < self._n, "a live slot lies outside the band"
        band_holes = set(range(1, self._n)) - set(ranks.tolist())
        assert band_holes == self._holes.ranks(), "hole map disagrees with the table"
        assert self._holes.count == len(band_holes), "hole count disagrees with the map"
        assert min(band_holes, default=self.capacity) >= self._holes.lo, "a hole lies below the map's bound"
        assert self.lazy or not band_holes, "eager side has holes"
        assert self._n == 1 or (self._row(self._n - 1) in set(live_rows.tolist())), "band not trimmed"
        free = set(self._free_vids)
        assert len(free) == len(self._free_vids), "a virtual id is free twice"
        assert free == set(range(1, self.capacity)) - set(live_v.tolist()), "free ids disagree"
        if self.peer is not None:
            assert self.band_bytes() + self.peer.band_bytes() <= self.total_bytes, "bands overlap"
        if self.device.type != "cpu":
            assert np.array_equal(self.pages.table.cpu().numpy(), v2p), "device table out of sync"

    # --------------------------------------------------------------------------------- helpers

    def _pages_of(self, ids: torch.Tensor) -> list[int]:
        """Validate ids handed back to ``free`` (one host array, vectorised numpy checks); -> virtual slot ids."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype not in _INT_DTYPES:
                raise InvalidTypeError("ids", "a 1-D integer tensor", (tuple(ids.shape), ids.dtype))
            arr = ids.cpu().numpy().astype(np.int64, copy=False)
        else:
            lst = int_list("ids", ids)
            if lst and (min(lst) < -2**63 or max(lst) >= 2**63):  # no id of ours, and no int64 either
                raise SlotStateError("ids", f"virtual ids in [1, {self.capacity}) of side {self.name!r}", lst[:16])
            arr = np.asarray(lst, dtype=np.int64)
        ps = self.page_size
        if arr.size % ps:
            raise SlotStateError("ids", f"whole pages of page_size={ps} tokens", f"{arr.size} ids")
        if not arr.size:
            return []
        if ps == 1:
            vids = arr
        else:
            pages = arr.reshape(-1, ps)
            first = pages[:, 0]
            if (first % ps).any() or not np.array_equal(pages, first[:, None] + self._offsets):
                raise SlotStateError("ids", f"whole pages (page*{ps} + 0..{ps - 1}, in order)", arr[:16].tolist())
            vids = first // ps
        if vids.min() < 1 or vids.max() >= self.capacity:
            raise SlotStateError("ids", f"virtual ids in [1, {self.capacity}) of side {self.name!r}",
                                 vids[:16].tolist())
        out = vids.tolist()
        if len(set(out)) != len(out):
            raise SlotStateError("ids", "each id at most once per call", out[:16])
        unallocated = vids[self._v2p[vids] < 0]
        if unallocated.size:
            raise SlotStateError("ids", f"allocated ids of side {self.name!r}", unallocated[:16].tolist())
        return out

    def _trim(self) -> None:
        self._n = self._holes.trim(self._n)

    def _clear_holes(self) -> None:
        self._holes.clear(self._n)  # every hole lies below the frontier
