"""Typed errors.

Every error raised for bad input names the argument, what was expected and what was given, and is
raised before anything changes. Expected outcomes are not errors: a miss is an empty match and
"no room" is ``None``.
"""

from __future__ import annotations

from typing import Any


class TieredCacheError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidArgumentError(TieredCacheError, ValueError):
    """An argument has the wrong value, shape, dtype or device.

    ``arg`` names the argument, ``expected`` says what was expected and ``got`` what was given.
    Also a ``ValueError``, so callers that catch the builtin keep working.
    """

    def __init__(self, arg: str, expected: str, got: Any):
        self.arg = arg
        self.expected = expected
        self.got = got
        super().__init__(f"{arg}: expected {expected}, got {_short(got)}")


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type (a str or float where ids are ints, None where a tensor is
    needed). Also a ``TypeError``, so callers that catch the builtin keep working."""


class UsageError(InvalidArgumentError):
    """A command-line flag is wrong; ``arg`` is the flag (``--kv-pages``). The CLI prints it as one line
    and exits 2; it is raised before the run starts."""


class OutOfRangeError(InvalidArgumentError, IndexError):
    """An index argument (a layer, a slot, a conv window, a byte of a slot) lies outside what exists.
    Also an ``IndexError``, what callers of an indexing API catch."""


class SlotStateError(InvalidArgumentError):
    """A slot id is not in the state the call needs: freeing a free or unknown id, an id twice."""


class SlotBusyError(TieredCacheError):
    """A slot is read or written by a transfer still in flight; it may not be freed or reused."""


class MemoryBudgetError(TieredCacheError, MemoryError):
    """A pool would not fit in the memory there is. ``setting`` names what to lower."""

    def __init__(self, what: str, need_bytes: float, free_bytes: float, setting: str):
        self.what = what
        self.need_bytes = need_bytes
        self.free_bytes = free_bytes
        self.setting = setting
        super().__init__(
            f"{what} needs {need_bytes / 2**20:.1f} MiB but only {free_bytes / 2**20:.1f} MiB "
            f"is free; lower {setting}"
        )


class IntegrityError(TieredCacheError):
    """Bytes read back do not match the checksum taken when they were written."""


class RanksDivergedError(TieredCacheError):
    """The caches of a tensor-parallel group no longer agree (``parallel.agree``): a rank would resume
    from another position than its peers, and the model's output would be garbage."""

    def __init__(self, rank: int, what: str):
        super().__init__(f"rank {rank}: {what}")


class TransferTimeoutError(TieredCacheError, TimeoutError):
    """A wait on a transfer ticket (or for room under the engine's in-flight byte bound) ran out of time."""


class StorageError(TieredCacheError):
    """T3 storage (``tiered_cache.storage``) failed. The storage tier turns these into counted misses;
    they reach a caller only from the low-level backend and format calls."""


class StorageUnavailableError(StorageError, ConnectionError):
    """A storage backend could not be reached or gave up (connection refused or lost, socket timeout,
    I/O error). ``backend`` names it."""

    def __init__(self, backend: str, cause: Any):
        self.backend = backend
        self.cause = cause
        super().__init__(f"{backend}: {_short(cause)}")


class StorageTimeoutError(StorageError, TimeoutError):
    """A wait on a storage operation ran out of time."""


class StorageFormatError(StorageError, IntegrityError):
    """A stored value is not a valid entry for what was asked: truncated, damaged, of another version
    or of another fingerprint. ``reason`` is one short word (``truncated``, ``magic``, ``checksum``,
    ``foreign`` ...), the key the storage tier counts misses under."""

    def __init__(self, reason: str, detail: str = ""):
        self.reason = reason
        super().__init__(f"{reason}: {detail}" if detail else reason)


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
