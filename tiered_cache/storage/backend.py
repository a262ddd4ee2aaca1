"""``StorageBackend``: where T3 values live, as opaque bytes under string keys.

A backend knows nothing of the format, the keys' meaning or T2: it stores, fetches, tests and deletes
byte values in batches. Calls block and are made from the storage tier's worker threads only (the
engine's step never calls a backend), so every implementation must be thread-safe and bound each
call by its own timeouts (socket timeouts, file I/O). Failures to reach the store raise
``StorageUnavailableError``; an absent key is ``None`` / ``False``, not an error.

Keys are short ASCII strings (``<kind>-<64 hex>``) safe as file names and Redis keys.

Sizes are never taken from the store on trust: a read is told each value's exact expected size
(``sizes``; the tier knows the KV page and state envelope sizes) or is bounded by the backend's
``max_value_bytes``, and a value whose stored size or chunk count disagrees comes back as
a ``WrongSize`` before anything more is fetched or allocated (one flipped bit in a stored count must
not turn a read into 2**32 phantom fetches). ``stop()`` is asked between the pieces of a read that
takes several round trips (the op's cancel and deadline).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Optional, Union

Buffer = Union[bytes, bytearray, memoryview]
Value = Union[Buffer, list[Buffer]]
Stop = Optional[Callable[[], bool]]
DEFAULT_MAX_VALUE_BYTES = 1 << 30  # the bound on a read of unknown size (a state envelope is tens of MB)


class WrongSize:
    """The value of a key whose stored size (or chunk layout) is not the one the read expected, found
    without reading the value. ``size``: the size the store claims (``None``: no consistent size)."""

    __slots__ = ("size",)

    def __init__(self, size: Optional[int] = None) -> None:
        self.size = size

    def __repr__(self) -> str:
        return f"WrongSize({self.size})"


WRONG_SIZE = WrongSize()  # a layout no writer makes (a count that disagrees with the lengths)
Read = Union[Value, WrongSize]  # what get_many hands back for a key that is there


class StorageBackend(ABC):
    """Batched byte storage. ``name`` appears in errors and stats."""

    name = "storage"

    @abstractmethod
    def get_many(self, keys: Sequence[str], sizes: Optional[Sequence[Optional[int]]] = None,
                 stop: Stop = None) -> list[Optional[Read]]:
        """The value of each key, or ``None`` where absent. A value is one buffer or a list of parts in
        order (a chunked backend hands its chunks up unjoined: joining 21 MB costs as much as parsing it).

        ``sizes[i]``: the exact byte size key ``i``'s value must have (``None``: at most
        ``max_value_bytes``); a value of another size is a ``WrongSize``, found without reading it.
        ``stop``: when it returns True between round trips, the keys not yet read come back ``None``
        (the caller discards the batch)."""

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
