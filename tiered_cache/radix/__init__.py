"""The HiMamba radix cache: a prefix cache of hybrid models over T0 KV pages and T1 int8 states."""

from __future__ import annotations

from tiered_cache.radix.cache import HiMambaRadixCache
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import (
    CacheReq,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
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

__all__ = [
    "CacheReq",
    "CheckpointPlacement",
    "DecLockRefParams",
    "DecLockRefResult",
    "EvictParams",
    "EvictResult",
    "EvictionPolicy",
    "HiMambaRadixCache",
    "IncLockRefResult",
    "InitLoadBackParams",
    "InsertParams",
    "InsertResult",
    "LRUPolicy",
    "MatchPrefixParams",
    "MatchResult",
    "RadixKey",
    "TreeNode",
    "checkpoint_position",
    "is_checkpoint_valid",
    "prefill_checkpoint_positions",
]
