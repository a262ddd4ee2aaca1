"""``HoleMap``: the free ranks (holes) inside one allocator band, as a bitmap.

A lazily compacted band leaves holes where slots were freed; ``alloc`` reuses the lowest first and the
band's frontier drops past holes at its top. A release frees tens of ranks at a time (an eviction's
pages), so the map is a numpy bool array indexed by rank: a release is one fancy assignment instead
of a heap push per rank, and the lowest holes are found by scanning from ``lo`` (no hole lies below
it) in doubling windows. Rank 0, the sink, is never a hole.
"""

from __future__ import annotations

import numpy as np

from tiered_cache.errors import IntegrityError


class HoleMap:
    """Holes among ranks ``[1, capacity)``; ``count`` of them."""

    __slots__ = ("bits", "count", "lo")

    def __init__(self, capacity: int) -> None:
        self.bits = np.zeros(capacity, dtype=bool)
        self.count = 0
        self.lo = capacity  # every hole's rank is >= lo

    def add(self, ranks: np.ndarray) -> None:
        """``ranks`` (distinct, live until now) become holes."""
        self.bits[ranks] = True
        self.count += len(ranks)
        self.lo = min(self.lo, int(np.minimum.reduce(ranks)))  # the ufunc itself: ndarray.min() adds a Python layer

    def take_lowest(self, k: int) -> np.ndarray:
        """The ``k`` lowest holes (``k <= count``), ascending; they stop being holes."""
        if k == 0:
            return np.empty(0, dtype=np.int64)
        bits, lo, step, parts, got = self.bits, self.lo, max(256, 4 * k), [], 0
        while got < k:
            if lo >= len(bits):  # not an assert: under python -O the loop would never end
                raise IntegrityError(f"the hole count {self.count} disagrees with the map ({got} of {k} found)")
            found = np.flatnonzero(bits[lo:lo + step])[:k - got] + lo
            parts.append(found)
            got += len(found)
            lo += step
            step *= 2
        ranks = parts[0] if len(parts) == 1 else np.concatenate(parts)
        bits[ranks] = False
        self.count -= k
        self.lo = int(ranks[-1]) + 1
        return ranks

    def trim(self, n: int) -> int:
        """The band's new frontier for frontier ``n``: below the holes at its top, which stop being holes."""
        bits = self.bits
        top = n
        while top > 1 and bits[top - 1]:
            lo = max(1, top - 64)
            # the window's last rank that is no hole, by its bytes (0 / 1 a rank): one C search, where seg.all() and
            # np.argmin go through Python wrappers (most of a free of the pages an insert found cached, ~2-5 us)
            j = bits[lo:top].tobytes().rfind(b"\x00")
            if j < 0:  # all holes
                top = lo
                continue
            top = lo + j + 1  # above it: the trailing holes of the window
            break
        if top < n:
            bits[top:n] = False
            self.count -= n - top
        return top

    def below(self, n: int) -> list[int]:
        """The holes of rank below ``n``, ascending."""
        return np.flatnonzero(self.bits[:n]).tolist()

    def clear(self, n: int) -> None:
        """No holes (all lay below the frontier ``n``)."""
        if self.count:
            self.bits[:n] = False
        self.count = 0
        self.lo = len(self.bits)

    def ranks(self) -> set[int]:
        """Every hole (``check_invariants`` and tests)."""
        return set(np.flatnonzero(self.bits).tolist())
