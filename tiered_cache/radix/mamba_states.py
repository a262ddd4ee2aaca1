"""``MambaStates``: where the recurrent states of the tree go when they move, and room for them.

    T1 state  --evict: demote to T2 when it has room (evicting T2 states LRU), else drop
    T2 state  --evict: drop
    load back: T2 slot --> T1 scratch --dequantize--> the request's T0 slot (T1: dequantized directly);
               the scratch slot then stays as the node's T1 state (promoted, ``stats["state_promotes"]``;
               its T2 copy stays too), unless the load failed or the node got a T1 state meanwhile

Eviction-driven demotion (T1 -> T2) waits for its ticket right away: ``evict`` must hand back room now.
It is the Mamba kind's side of eviction (``evict.EvictHooks``) and of load back (``loadback.LoadHooks``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix.checks import check_state_allocated, state_slot
from tiered_cache.radix.frees import Frees
from tiered_cache.radix.host import HostTier, Op
from tiered_cache.radix.loadback import LoadBack
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.nonfinite import StateFlags
from tiered_cache.radix.params import EvictParams
from tiered_cache.radix.tree import RadixTree
from tiered_cache.tiers.protocols import StateSide

if TYPE_CHECKING:
    from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool
from tiered_cache.transfer.moves import demote_states, restore_states


class MambaStates:
    """The states of ``tree`` in T1 (``ckpt``) and T2 (``host``'s state region), for T0 slots of ``states``."""

    def __init__(self, tree: RadixTree, flags: StateFlags, states: StateSide, ckpt: Int8CheckpointPool,
                 host: HostTier) -> None:
        self.tree, self.flags, self.states, self.ckpt, self.host = tree, flags, states, ckpt, host
        tree.sinks["t1"] = ckpt
        self.region: Any = host.region(host.conf.state_region, ckpt.slot_bytes, "state_host") if host.enabled else None
        self.room: Any = None  # evict.Eviction
        self.rule: Any = None  # mamba.MambaRule (set_state, for a state promoted back to T1)
        self.shared_t0 = True  # T0's KV and state sides share bytes (set by the cache from its pool)

    def bind(self, room: Any, rule: Any = None) -> None:
        self.room, self.rule = room, rule

    # ----------------------------------------------------------------------------- eviction
    def evict_device(self, params: EvictParams) -> None:
        if params.mamba_num:
            self.evict_states(params.mamba_num)

    def evict_host(self, params: EvictParams) -> int:
        return self.evict_host_states(params.host_mamba_num) if params.host_mamba_num else 0

    def can_demote(self, x: TreeNode) -> bool:
        return x.host_kv is not None

    def demoted(self, x: TreeNode, f: Frees) -> None:
        """The state does not live with the KV: nothing of it moves."""

    def evict_states(self, num: int) -> int:
        """Free ``num`` T1 states, LRU first (demoted to T2 when it has room). -> how many."""
        return self.tree.evict_each("state", num, self._evict_state, lambda: self.host.settle("backup"))

    def _evict_state(self, x: TreeNode, f: Frees) -> int:
        tree, p = self.tree, x.payload
        if self.flags.state_bad(x):  # never demoted: dropped (and counted) instead
            tree.stats["nonfinite_states"] += 1
        elif self.host.enabled and p.state_host is None:
            self.demote_sync(x)
        f.put_t1(p.t1_slot)
        p.mamba_value = None
        tree.state_evictable -= 1
        tree.freed["state"] += 1
        if x.children or p.state_host is not None:  # demoted, or an internal tombstone: the node stays
            tree.sync(x)
        else:
            tree.drop_leaf(x, f)
        return 1

    def evict_host_states(self, num: int) -> int:
        """Drop ``num`` T2 states, LRU first; a node left a childless unlocked tombstone goes."""
        return self.tree.evict_each("state_host", num, self._evict_host_state)

    def _evict_host_state(self, x: TreeNode, f: Frees) -> int:
        f.put_pages("state_host", [x.payload.state_host])
        x.payload.state_host = None
        if not x.children and not x.payload.resumable and not x.full_lock_ref:
            self.tree.drop_leaf(x, f)
        else:
            self.tree.sync(x)
        return 1

    # ----------------------------------------------------------------------------- room
    def alloc_ckpt_protected(self, protect: Optional[TreeNode]) -> Optional[tuple[torch.Tensor, list[int]]]:
        """A T1 slot (device tensor, host id), evicting states; ``protect``'s path survives (unlocked
        without pruning: the insert that follows gives its end a state or a child, or prunes it)."""
        tree = self.tree
        if protect is not None:
            tree.lock(protect)
        try:
            t1 = None
            while t1 is None and self.evict_states(1):
                t1 = self.ckpt.alloc_ids(1)
        finally:
            if protect is not None:
                tree.unlock(protect, prune=False)
        if t1 is None and protect is not None:
            tree.prune_up(protect)
        return t1

    def alloc_active_state(self, protect: TreeNode) -> Optional[torch.Tensor]:
        """A T0 state slot for a request; KV pages are evicted (LRU) until the state side has room when
        the two sides share bytes (``UnifiedPool``, or a T0 with ``sides_share_bytes`` true). Over sides
        that share nothing (an engine's own pools) evicting KV frees no slot, and the tree holds no T0
        state to evict (its states are T1's): then only a free slot serves, else None."""
        slot = self.states.alloc(1) if not self.shared_t0 else self.room.alloc_protected(self.states, 1, protect)
        if slot is not None:
            self.rule.fresh_slot(slot)
        return slot

    def _alloc_host_state(self) -> Optional[int]:
        r = self.region
        h = r.alloc(1)
        if h is None and self.tree.policy.size("state_host"):
            self.evict_host_states(1)
            h = r.alloc(1)
        return None if h is None else h[0]

    def demote_sync(self, x: TreeNode) -> bool:
        """T1 -> T2 for an eviction victim; waits, since its T1 slot is freed right after."""
        h = self._alloc_host_state()
        if h is None:
            return False
        engine = self.host.engine
        t = demote_states(engine, self.ckpt, [int(x.payload.mamba_value)], self.region, [h])
        engine.wait(t)  # the caller frees the T1 slot next: the D2H copy must have read it
        x.payload.state_host = h
        self.tree.stats["state_demotes"] += 1
        if self.host.t3 is not None:
            self.host.t3.on_state(x, demoted=True)
        return True

    # ----------------------------------------------------------------------------- load back
    def check_load_req(self, req: Any) -> None:
        if req is None or not hasattr(req, "mamba_pool_idx"):
            raise InvalidArgumentError("req", "a request with .mamba_pool_idx to receive the state", req)
        if req.mamba_pool_idx is not None:
            slot = state_slot(self.states, "req.mamba_pool_idx", req.mamba_pool_idx)
            if self.tree.validate:
                check_state_allocated(self.states, slot, "req.mamba_pool_idx")

    def loadable(self, best: TreeNode) -> bool:
        return self.flags.verify(best)  # its T1 state held a NaN or an inf: dropped, nothing to load

    def state_on_host(self, best: TreeNode) -> bool:
        return best.payload.mamba_value is None

    def prepare_load(self, best: TreeNode, req: Any) -> Optional[tuple]:
        """-> (the request's T0 slot, whether the load allocated it, a T1 scratch slot and its host id, or None)."""
        own = req.mamba_pool_idx is None
        slot = req.mamba_pool_idx if not own else self.alloc_active_state(best)
        if slot is None:
            return None
        slot = state_slot(self.states, "req.mamba_pool_idx", slot)
        scratch = None
        if self.state_on_host(best):
            t1 = self.ckpt.alloc_ids(1) or self.alloc_ckpt_protected(best)
            if t1 is None:
                if own:
                    self.states.free(slot)
                return None
            scratch = t1
        return slot, own, scratch

    def start_load(self, op: Op, prepared: tuple, best: TreeNode, req: Any) -> None:
        slot, own, scratch = prepared
        self.rule.fresh_slot(slot)  # what it held is overwritten (a failure of this load marks it again)
        if scratch is not None:
            op.scratch, op.scratch_id = scratch[0], scratch[1][0]
            op.tickets["state"] = restore_states(self.host.engine, self.region, [best.payload.state_host], self.ckpt,
                                                 scratch[1], self.states, slot.tolist())
        else:
            self.ckpt.load_to_active(best.payload.mamba_value, self.states, slot)
        if own:
            req.mamba_pool_idx = slot

    def loaded(self, y: TreeNode) -> None:
        """The state does not live with the KV: nothing to do."""

    def load_finished(self, op: Op, f: Frees) -> bool:
        st = op.tickets.get("state")
        ok = st is None or all(st.ok)
        best = op.lock
        assert best is not None, "a load holds its own lock"
        if not ok:
            self.tree.stats["corrupt_host_state_dropped"] += 1
            if best.alive and best.payload.state_host is not None:
                f.put_pages("state_host", [best.payload.state_host])
                best.payload.state_host = None
        # the request's state (ok False), or the KV up to it (best left dead, its KV nowhere), was garbage
        if (not ok or best.value is None) and op.handle is not None and op.handle.state_slot is not None:
            self.rule.failed_loads[int(op.handle.state_slot)] = self._prefix(best)
        if op.scratch is not None:
            if ok and best.alive and best.value is not None and best.payload.mamba_value is None:
                self.rule.set_state(best, op.scratch, op.scratch_id)  # promoted: the next hit is a T1 hit, no PCIe copy
                self.tree.stats["state_promotes"] += 1
            else:
                f.put("t1", op.scratch)
            op.scratch = None
        return ok

    def _prefix(self, x: TreeNode) -> tuple[Optional[str], bytes]:
        """-> (the salt, the tokens' bytes) of the path from the root to the end of ``x``."""
        parts, y = [], x
        while y.parent is not self.tree.root:
            parts.append(y.bkey)
            y = y.parent
        parts.append(y.bkey)
        return self.tree.key_salt(y.ck), b"".join(reversed(parts))

    def emptied(self, y: TreeNode) -> None:
        if y.payload.mamba_value is not None:
            if y.mamba_lock_ref:
                self.tree.state_protected -= 1
            else:
                self.tree.state_evictable -= 1

    def loaded_handle(self, handle: LoadBack) -> None:
        """The handle carries the request's state slot already."""
