"""The memory tiers, each a pool of fixed-size slots named by ids.

    protocols.py        KVSide, StateSide: what the tree, T1 and the T2 moves need of a T0 side
    allocator.py        MultiEndedAllocator: virtual slot ids over rows that grow from both ends
    page_table.py       PageTable: an allocator's virtual id -> physical row map, host and device copies
    slots.py            id lists and the slot-state checks every tier shares
    unified_pool.py     T0 UnifiedPool: one GPU byte buffer, a KV side and a state side (SubPool)
    checkpoint_pool.py  T1 Int8CheckpointPool: cached states quantized once, on the GPU
    finite_flags.py     FiniteFlags: T1's per-slot "last store was finite" flags, read without a sync
    host_mirror.py      T2 HostMirror: pinned host regions of int8 states and KV pages
"""

from __future__ import annotations

from tiered_cache.tiers.allocator import MultiEndedAllocator
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool
from tiered_cache.tiers.host_mirror import HostMirror, HostRegion, RegionSpec
from tiered_cache.tiers.protocols import ActiveSide, KVSide, StateSide, T0Pool
from tiered_cache.tiers.unified_pool import SubPool, UnifiedPool

__all__ = ["ActiveSide", "HostMirror", "HostRegion", "Int8CheckpointPool", "KVSide", "MultiEndedAllocator",
           "RegionSpec", "StateSide", "SubPool", "T0Pool", "UnifiedPool"]
