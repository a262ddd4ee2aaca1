"""The radix caches of hybrid models: ``HiMambaRadixCache`` (KV + recurrent states over T0, T1 and
T2) and ``HiSWARadixCache`` (full + sliding-window KV over T0 and T2), facades over a ``RadixTree``,
a resume rule per kind (``MambaRule``, ``SWARule``), the ``HostTier`` and the ``Eviction``."""

from __future__ import annotations

from tiered_cache.radix.cache import HiMambaRadixCache
from tiered_cache.radix.loadback import LoadBack
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import (
    CacheReq,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    HostTierConfig,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
)
from tiered_cache.radix.placement import (
    CheckpointPlacement,
    checkpoint_position,
    is_checkpoint_valid,
    prefill_checkpoint_positions,
)
from tiered_cache.radix.policy import EvictionPolicy, LRUPolicy
from tiered_cache.radix.swa import HiSWARadixCache

__all__ = [
    "CacheReq",
    "CheckpointPlacement",
    "DecLockRefParams",
    "DecLockRefResult",
    "EvictParams",
    "EvictResult",
    "EvictionPolicy",
    "HiMambaRadixCache",
    "HiSWARadixCache",
    "HostTierConfig",
    "IncLockRefResult",
    "InitLoadBackParams",
    "InsertParams",
    "InsertResult",
    "LRUPolicy",
    "LoadBack",
    "MatchPrefixParams",
    "MatchResult",
    "RadixKey",
    "TreeNode",
    "checkpoint_position",
    "is_checkpoint_valid",
    "prefill_checkpoint_positions",
]
