"""tiered-cache: a tiered cache for the KV and recurrent states of hybrid LLMs.

T0 ``UnifiedPool`` (one GPU byte buffer, two sub-pools growing towards each other), T1 int8
checkpoint pool, T2 pinned host mirror, T3 storage, and the radix caches that drive them. The door is
``TieredCache.build(CacheConfig(...), kv=KVSpec(...), state=StateSpec(...))``: it builds and owns them all.
"""

from __future__ import annotations

from tiered_cache.config import CacheConfig
from tiered_cache.errors import (
    IntegrityError,
    InvalidArgumentError,
    InvalidTypeError,
    MemoryBudgetError,
    OutOfRangeError,
    RanksDivergedError,
    SlotBusyError,
    SlotStateError,
    StorageError,
    StorageFormatError,
    StorageTimeoutError,
    StorageUnavailableError,
    TieredCacheError,
    TransferTimeoutError,
    UsageError,
)
from tiered_cache.radix import (
    CacheReq,
    EvictParams,
    EvictResult,
    HiMambaRadixCache,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    prefill_checkpoint_positions,
)
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.stack import TieredCache
from tiered_cache.tiers.allocator import MultiEndedAllocator
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec
from tiered_cache.tiers.protocols import ActiveSide, KVSide, StateSide, T0Pool
from tiered_cache.tiers.unified_pool import SubPool, UnifiedPool
from tiered_cache.transfer.engine import Ticket, TransferEngine

__version__ = "0.1.0"

__all__ = [
    "ActiveSide",
    "CacheConfig",
    "CacheReq",
    "EvictParams",
    "EvictResult",
    "HiMambaRadixCache",
    "HostMirror",
    "InitLoadBackParams",
    "InsertParams",
    "InsertResult",
    "Int8CheckpointPool",
    "MatchPrefixParams",
    "MatchResult",
    "RegionSpec",
    "Ticket",
    "TransferEngine",
    "prefill_checkpoint_positions",
    "IntegrityError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "KVSide",
    "KVSpec",
    "MemoryBudgetError",
    "MultiEndedAllocator",
    "OutOfRangeError",
    "RanksDivergedError",
    "SlotBusyError",
    "SlotStateError",
    "StateSide",
    "StateSpec",
    "StorageError",
    "StorageFormatError",
    "StorageTimeoutError",
    "StorageUnavailableError",
    "SubPool",
    "T0Pool",
    "TieredCache",
    "TieredCacheError",
    "TransferTimeoutError",
    "UnifiedPool",
    "UsageError",
]
