"""``StorageBackend``: where T3 values live, as opaque bytes under string keys.

A backend knows nothing of the format, the keys' meaning or T2: it stores, fetches, tests and deletes
byte values in batches. Calls block and are made from the storage tier's worker threads only (the
engine's step never calls a backend), so every implementation must be thread-safe and bound each
call by its own timeouts (socket timeouts, file I/O). Failures to reach the store raise
``StorageUnavailableError``; an absent key is ``None`` / ``False``, not an error.

Keys are short ASCII strings (``<kind>-<64 hex>``) safe as file names and Redis keys.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Optional, Union

Buffer = Union[bytes, bytearray, memoryview]
Value = Union[Buffer, list[Buffer]]


class StorageBackend(ABC):
    """Batched byte storage. ``name`` appears in errors and stats."""

    name = "storage"

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[Optional[Value]]:
        """The value of each key, or ``None`` where absent. A value is one buffer or a list of parts in
        order (a chunked backend hands its chunks up unjoined: joining 21 MB costs as much as parsing it)."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        """Store each ``(key, parts)``: the value is the parts concatenated (header, payload), so no
        caller joins them. A reader never sees a value half-written under its key (a torn value
        would still fail its checksum, but it would be counted as corrupt rather than absent)."""

    @abstractmethod
    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        ...

    @abstractmethod
    def delete_many(self, keys: Sequence[str]) -> None:
        ...

    def close(self) -> None:
        """Release connections / handles. Idempotent. (Nothing to release by default.)"""
        return None
