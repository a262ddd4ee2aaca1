"""Non-finite states in the radix tree: a state whose store read a NaN or an inf is never served.

``Int8CheckpointPool.store_from_active`` flags such a slot on the device and copies the flags to the
host behind an event, without waiting (``checkpoint_pool.py``). ``StateFlags`` records which node owns
each slot whose flag is still on its way (``MambaPayload.t1_unverified``) and reads the flags:

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

from tiered_cache.radix.frees import Frees
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.tree import RadixTree


class StateFlags:
    """The NaN/inf flags of the T1 stores of ``tree``'s states, in ``ckpt`` (an ``Int8CheckpointPool``)."""

    def __init__(self, tree: RadixTree, ckpt: Any) -> None:
        self.tree, self.ckpt = tree, ckpt
        self.owner: dict[int, TreeNode] = {}  # T1 host slot id -> node, while its NaN/inf flag is unread
        # parallel.Agreement under tensor parallelism: flags are read only where every rank reads them
        # (each step's agreement, and a wait before a state is served), and agreed
        self.agree: Any = None

    def clear(self) -> None:
        self.owner = {}

    def poll(self, wait_for: Optional[Iterable[int]] = None, keep: Optional[TreeNode] = None) -> bool:
        """Read the flags that have landed (and wait for those of ``wait_for``); drop every non-finite
        state but ``keep``'s (the caller deals with it). -> whether a state was dropped."""
        if not self.owner and wait_for is None:
            return False
        if self.agree is not None:
            return wait_for is not None and self.apply(self.agree.flags(self), keep)
        return self.apply(self.ckpt.poll_flags(wait_for), keep)

    def apply(self, flags: dict[int, bool], keep: Optional[TreeNode] = None) -> bool:
        """Act on read flags (slot -> finite): drop every non-finite state but ``keep``'s. -> whether
        a state was dropped."""
        dropped = False
        for s, ok in flags.items():
            x = self.owner.pop(s, None)
            if x is None or x.payload.t1_unverified != s:
                continue
            x.payload.t1_unverified = None
            if ok or x is keep or not x.alive or x.payload.mamba_value is None:
                if not ok and x is keep:
                    x.payload.t1_unverified = -1  # known bad: the caller drops it
                continue
            self.drop(x)
            dropped = True
        return dropped

    def state_bad(self, x: TreeNode) -> bool:
        """Whether ``x``'s T1 state is known (after waiting, if need be) to hold a NaN or an inf. Other
        non-finite states found on the way are dropped; ``x`` itself is left to the caller (who counts it)."""
        p = x.payload
        if p.mamba_value is None or p.t1_unverified is None:
            return False
        if p.t1_unverified >= 0:
            self.poll([p.t1_unverified], keep=x)
        if p.t1_unverified == -1:
            p.t1_unverified = None
            return True
        return False

    def verify(self, x: TreeNode) -> bool:
        """Before ``x``'s T1 state is served or moved: drop it if it is not finite. -> whether it stays."""
        if self.state_bad(x):
            self.drop(x)
            return False
        return True

    def drop(self, x: TreeNode) -> None:
        """Free ``x``'s non-finite T1 state; ``x`` becomes a tombstone, or goes if an idle unlocked leaf."""
        tree, p = self.tree, x.payload
        f = Frees(tree)
        f.put("t1", p.mamba_value)
        p.mamba_value = None
        p.t1_unverified = None
        if x.mamba_lock_ref:
            tree.state_protected -= 1
        else:
            tree.state_evictable -= 1
        tree.stats["nonfinite_states"] += 1
        f.flush()
        tree.prune_up(x)  # the tree's own rule: an idle stateless leaf goes, anything else is re-listed

    def stored(self, x: TreeNode, slot: int) -> None:
        """``x`` took the T1 slot ``slot`` (host id) just stored: its flags are on their way."""
        x.payload.t1_unverified = slot
        self.owner[slot] = x
