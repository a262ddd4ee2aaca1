"""Non-finite states in the radix tree: a state whose store read a NaN or an inf is never served.

``Int8CheckpointPool.store_from_active`` flags such a slot on the device and copies the flags to the
host behind an event, without waiting (``checkpoint_pool.py``). The tree records which node owns each
slot whose flag is still on its way (``TreeNode.t1_unverified``, ``cache._t1_owner``) and reads the
flags:

- at every ``check_hicache_events`` and at the start of every match, without waiting (the copy of a
  store made in an earlier step has long landed);
- before the state of a node is served or moved (a match that would report it, a load back from
  T1, a demotion to T2, a write to T3), waiting for that one store's flags if they have not landed.

A non-finite state is dropped: its T1 slot is freed, the node becomes a tombstone (or goes, when it
is an unlocked leaf), and ``stats["nonfinite_states"]`` counts it. A state evicted before it was read
is checked first: it is dropped instead of demoted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Optional

from tiered_cache.radix.evict import Frees
from tiered_cache.radix.node import TreeNode


def poll(cache: Any, wait_for: Optional[Iterable[int]] = None, keep: Optional[TreeNode] = None) -> bool:
    """Read the flags that have landed (and wait for those of ``wait_for``); drop every non-finite state
    but ``keep``'s (the caller deals with it). -> whether a state was dropped."""
    if cache.ckpt is None or not cache._t1_owner and wait_for is None:
        return False
    flags = cache.ckpt.poll_flags(wait_for)
    dropped = False
    for s, ok in flags.items():
        x = cache._t1_owner.pop(s, None)
        if x is None or x.t1_unverified != s:
            continue
        x.t1_unverified = None
        if ok or x is keep or not x.alive or x.mamba_value is None:
            if not ok and x is keep:
                x.t1_unverified = -1  # known bad: the caller drops it
            continue
        drop(cache, x)
        dropped = True
    return dropped


def state_bad(cache: Any, x: TreeNode) -> bool:
    """Whether ``x``'s T1 state is known (after waiting, if need be) to hold a NaN or an inf. Other
    non-finite states found on the way are dropped; ``x`` itself is left to the caller (who counts it)."""
    if x.mamba_value is None or x.t1_unverified is None:
        return False
    if x.t1_unverified >= 0:
        poll(cache, [x.t1_unverified], keep=x)
    if x.t1_unverified == -1:
        x.t1_unverified = None
        return True
    return False


def verify(cache: Any, x: TreeNode) -> bool:
    """Before ``x``'s T1 state is served or moved: drop it if it is not finite. -> whether it stays."""
    if state_bad(cache, x):
        drop(cache, x)
        return False
    return True


def drop(cache: Any, x: TreeNode) -> None:
    """Free ``x``'s non-finite T1 state; ``x`` becomes a tombstone, or goes if an idle unlocked leaf."""
    f = Frees()
    f.t1.append(x.mamba_value)
    x.mamba_value = None
    x.t1_unverified = None
    if x.mamba_lock_ref:
        cache._mamba_protected -= 1
    else:
        cache._mamba_evictable -= 1
    cache.stats["nonfinite_states"] += 1
    f.flush(cache)
    cache._prune_up(x)  # the tree's own rule: an idle stateless leaf goes, anything else is re-listed


def stored(cache: Any, x: TreeNode, slot: int) -> None:
    """``x`` took the T1 slot ``slot`` (host id) just stored: its flags are on their way."""
    x.t1_unverified = slot
    cache._t1_owner[slot] = x
