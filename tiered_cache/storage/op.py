"""``StorageOp``: one submitted storage operation of a ``StorageTier`` (its results, once ``done``)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from tiered_cache.storage.format import Kind
from tiered_cache.tiers.host_mirror import HostRegion


@dataclass(eq=False)
class StorageOp:
    """One submitted storage operation. Read the results once ``done`` (after ``poll`` / ``wait``).

    ``hits[i]``: prefetch / lookup / get: key ``i`` was found and verified (prefetch: its bytes are in
    ``slots[i]``, which is now ``valid``); write / put: key ``i`` is in the store (written or already there).
    ``values``: ``get`` only, the payloads (``None`` for a miss).
    """

    id: int
    op: str
    kind: Kind
    keys: list[bytes]
    region: Optional[HostRegion] = None
    slots: list[int] = field(default_factory=list)
    deadline: Optional[float] = None
    done: bool = False
    cancelled: bool = False
    timed_out: bool = False
    hits: list[bool] = field(default_factory=list)
    values: list[Optional[bytes]] = field(default_factory=list)
    error: Optional[str] = None
    _future: Future = field(default_factory=Future)  # the worker's, from submit on
    _t2_checksums: list[int] = field(default_factory=list)

    @property
    def hit_prefix(self) -> int:
        """Leading hits: with chained keys, how many pages a match can extend by."""
        n = 0
        for h in self.hits:
            if not h:
                break
            n += 1
        return n

    def _stop(self) -> bool:  # read by the worker between sub-batches
        return self.cancelled or (self.deadline is not None and time.monotonic() > self.deadline)
