"""Eviction of ``HiMambaRadixCache``: the cascade down the tiers, and the candidate sets it draws from.

    device KV  (T0) --evict: demote if backed up (write-back: back up first), else drop--> T2 / gone
    T1 state        --evict: demote to T2 when it has room (evicting T2 states LRU), else drop
    T2 KV / state   --evict: drop

Victims come from the policy, one candidate set per (resource, tier); ``_sync`` recomputes whether a
node belongs to each set from the node alone (and its children), so every path that changes a node
calls it instead of keeping add/discard pairs in step by hand. A node with a transfer in flight is
never a candidate: nothing is freed or dropped while a ticket reads or writes it.

Dropping a leaf removes it, then any parents it leaves as childless unlocked tombstones.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidTypeError
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import EvictParams, EvictResult
from tiered_cache.validate import int_arg


class Frees:
    """Ids to give back, batched per pool so a long eviction frees each pool once."""

    __slots__ = ("kv", "swa", "t1", "hkv", "hstate", "hswa")

    def __init__(self) -> None:
        self.kv: list[torch.Tensor] = []
        self.swa: list[torch.Tensor] = []
        self.t1: list[torch.Tensor] = []
        self.hkv: list[int] = []
        self.hstate: list[int] = []
        self.hswa: list[int] = []

    def take(self, cache: Any, x: TreeNode) -> None:
        """Everything ``x`` owns or has in flight (nothing may be in flight any more)."""
        for t, lst in ((x.value, self.kv), (x.value_pending, self.kv), (x.swa_value, self.swa),
                       (x.swa_pending, self.swa), (x.mamba_value, self.t1)):
            if t is not None:
                lst.append(t)
        for pages, lst in ((x.host_kv, self.hkv), (x.host_pending, self.hkv), (x.swa_host, self.hswa),
                           (x.swa_host_pending, self.hswa)):
            if pages is not None:
                lst.extend(pages)
        if x.state_host is not None:
            self.hstate.append(x.state_host)
        x.value = x.value_pending = x.swa_value = x.swa_pending = x.mamba_value = None
        x.host_kv = x.host_pending = x.swa_host = x.swa_host_pending = x.state_host = None

    def flush(self, cache: Any) -> None:
        ps = cache.page_size
        if self.kv:
            ids = self.kv[0] if len(self.kv) == 1 else torch.cat(self.kv)
            if ids.numel():
                cache._owned[ids[::ps] // ps] = False
                cache.kv.free(ids)
        if self.swa:
            ids = self.swa[0] if len(self.swa) == 1 else torch.cat(self.swa)
            if ids.numel():
                cache.swa.free(ids)
        if self.t1:
            cache.ckpt.free(self.t1[0] if len(self.t1) == 1 else torch.cat(self.t1))
        for lst, region in ((self.hkv, "kv_region"), (self.hstate, "state_region"), (self.hswa, "swa_region")):
            if lst:
                getattr(cache, region).free(lst)
        self.__init__()


class EvictionMixin:
    # ----------------------------------------------------------------------------- candidates
    def _sync(self, x: TreeNode) -> None:
        """Put ``x`` in exactly the candidate sets it belongs to now."""
        if x is self.root or not x.alive:
            return
        pol = self.policy
        idle = not x.tickets
        unlocked = idle and x.full_lock_ref == 0
        kids = x.children.values()
        if x.value is None:
            pol.discard("kv", x)
        elif unlocked and (not kids or (self.host is not None and not any(
                c.value is not None or c.value_pending is not None for c in kids))):
            pol.add("kv", x)  # no child on the device: its device KV can go
        else:
            pol.discard("kv", x)
        free_state = idle and x.mamba_lock_ref == 0
        (pol.add if x.mamba_value is not None and free_state else pol.discard)("state", x)
        if self.host is not None:
            host_leaf = x.host_kv is not None and unlocked and not any(
                c.host_kv is not None or c.host_pending is not None for c in kids)
            (pol.add if host_leaf else pol.discard)("kv_host", x)
            (pol.add if x.state_host is not None and free_state else pol.discard)("state_host", x)
        if self.mode == "swa":
            (pol.add if x.swa_value is not None and unlocked else pol.discard)("swa", x)

    # ----------------------------------------------------------------------------- evict
    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least the asked amounts, LRU first, while unlocked candidates remain.

        ``num_tokens``: device KV tokens (demoted when backed up, else dropped; a leaf dropped takes its
        states); ``mamba_num``: T1 states (demoted to T2 when it has room); ``host_*``: T2 entries.
        ``num_tokens_evicted`` counts every device KV token freed (state eviction removes leaves)."""
        if not isinstance(params, EvictParams):
            raise InvalidTypeError("params", "an EvictParams", type(params).__name__)
        for arg in ("num_tokens", "swa_num_tokens", "mamba_num", "host_num_tokens", "host_mamba_num"):
            int_arg(arg, getattr(params, arg), lo=0)
        # Counted as freed wherever the cascade frees them (a host eviction for room can remove a
        # leaf with a T1 state; a T2 state eviction can remove a leaf on the device).
        dev0, t10, swa0 = self._n_dev_freed, self._n_t1_freed, self._n_swa_freed
        r = EvictResult()
        if params.num_tokens:
            self._evict_kv(params.num_tokens)
        if params.swa_num_tokens:
            self._evict_swa(params.swa_num_tokens)
        if params.mamba_num:
            self._evict_states(params.mamba_num)
        if self.host is not None:
            if params.host_num_tokens:
                r.host_num_tokens_evicted = self._evict_host_kv(params.host_num_tokens)
            if params.host_mamba_num:
                r.host_mamba_num_evicted = self._evict_host_states(params.host_mamba_num)
        r.num_tokens_evicted = self._n_dev_freed - dev0
        r.mamba_num_evicted = self._n_t1_freed - t10
        r.swa_num_tokens_evicted = self._n_swa_freed - swa0
        return r

    def _evict_swa(self, num: int) -> tuple[int, int]:
        return 0, 0

    def _can_demote(self, x: TreeNode) -> bool:
        return x.host_kv is not None

    def _evict_kv(self, num: int) -> tuple[int, int]:
        f = Frees()
        tok = st = 0
        while tok < num:
            x = self.policy.pop("kv")
            if x is None:
                if self._settle_backups():  # candidates held by backups in flight: they finish now
                    continue
                break
            if not self._can_demote(x) and self.host is not None and self.hconf.write_policy == "write_back":
                self._backup_sync(x)  # write-back: written first, then demoted
                self.policy.discard("kv", x)
            if self._can_demote(x):
                tok += len(x.key)
                self._demote_device(x, f)
                continue
            assert not x.children, f"{x} has children on the host but no host copy itself"
            tok += len(x.key)
            st += x.mamba_value is not None
            p = x.parent
            self._remove(x, f)
            tok += self._after_child_removed(p, f)
        f.flush(self)
        return tok, st

    def _demote_device(self, x: TreeNode, f: Frees) -> None:
        """Free ``x``'s device KV; its complete host copy stays (the tree keeps the node)."""
        f.kv.append(x.value)
        x.value = None
        if x.swa_value is not None:
            f.swa.append(x.swa_value)
            x.swa_value = None
            x.swa_tomb = x.swa_host is None
        self._full_evictable -= len(x.key)
        self._n_dev_freed += len(x.key)
        self._sync(x)
        self._sync(x.parent)
        if self.t3 is not None:  # T3 without write-through gets KV when eviction demotes it
            self.t3.on_kv_demoted(x)

    def _evict_states(self, num: int) -> tuple[int, int]:
        f = Frees()
        tok = st = 0
        while st < num:
            x = self.policy.pop("state")
            if x is None:
                if self._settle_backups():
                    continue
                break
            st += 1
            from tiered_cache.radix.nonfinite import state_bad

            if state_bad(self, x):  # never demoted: dropped (and counted) instead
                self.stats["nonfinite_states"] += 1
            elif self.host is not None and x.state_host is None:
                self._demote_state_sync(x)
            f.t1.append(x.mamba_value)
            x.mamba_value = None
            self._mamba_evictable -= 1
            self._n_t1_freed += 1
            if x.children or x.state_host is not None:  # demoted, or an internal tombstone: the node stays
                self._sync(x)
            else:
                tok += len(x.key) if x.value is not None else 0
                p = x.parent
                self._remove(x, f)
                tok += self._after_child_removed(p, f)
        f.flush(self)
        return tok, st

    def _evict_host_kv(self, num: int) -> int:
        """Drop T2 KV of host leaves, LRU first; a node left with KV nowhere goes (it is a leaf)."""
        f = Frees()
        tok = 0
        while tok < num:
            x = self.policy.pop("kv_host")
            if x is None:
                break
            tok += len(x.key)
            f.hkv.extend(x.host_kv)
            x.host_kv = None
            if x.swa_host is not None:
                f.hswa.extend(x.swa_host)
                x.swa_host = None
            if x.value is not None:
                self._sync(x)
                self._sync(x.parent)
            else:
                assert not x.children, f"{x} is on the host only but has children"
                p = x.parent
                self._remove(x, f)
                self._after_child_removed(p, f)
        f.flush(self)
        return tok

    def _evict_host_states(self, num: int) -> int:
        f = Frees()
        n = 0
        while n < num:
            x = self.policy.pop("state_host")
            if x is None:
                break
            n += 1
            f.hstate.append(x.state_host)
            x.state_host = None
            if not x.children and not self._has_state(x) and not x.full_lock_ref:
                p = x.parent
                self._remove(x, f)
                self._after_child_removed(p, f)
            else:
                self._sync(x)
        f.flush(self)
        return n

    def _remove(self, x: TreeNode, f: Frees) -> None:
        """Unlink an unlocked childless node with nothing in flight; its ids go to ``f``."""
        assert not x.tickets, f"{x} is removed with transfers in flight"
        del x.parent.children[x.ck]
        self.policy.forget(x)
        if x.value is not None:
            self._full_evictable -= len(x.key)
            self._n_dev_freed += len(x.key)
        if x.swa_value is not None:
            self._n_swa_freed += len(x.key)
        if x.mamba_value is not None:
            self._mamba_evictable -= 1
            self._n_t1_freed += 1
        f.take(self, x)
        x.alive = False

    def _after_child_removed(self, p: TreeNode, f: Frees) -> int:
        """``p`` lost a child: drop it (and up) while a childless unlocked idle tombstone. -> device tokens."""
        tok = 0
        while p is not self.root:
            if p.children or p.full_lock_ref or p.tickets or self._has_state(p):
                self._sync(p)
                break
            q = p.parent
            tok += len(p.key) if p.value is not None else 0
            self._remove(p, f)
            p = q
        return tok

    def _prune_up(self, x: TreeNode) -> None:
        if x is self.root or not x.alive:
            return
        f = Frees()
        if not x.children and x.full_lock_ref == 0 and not x.tickets and not self._has_state(x):
            p = x.parent
            self._remove(x, f)
            self._after_child_removed(p, f)
        else:
            self._sync(x)
        f.flush(self)

    # ----------------------------------------------------------------------------- room
    def _alloc_ckpt_protected(self, protect: Optional[TreeNode]) -> Optional[tuple[torch.Tensor, list[int]]]:
        """A T1 slot (device tensor, host id), evicting states; ``protect``'s path survives (unlocked
        without pruning: the insert that follows gives its end a state or a child, or prunes it)."""
        if protect is not None:
            self._lock(protect)
        try:
            t1 = None
            while t1 is None and self._evict_states(1)[1]:
                t1 = self.ckpt.alloc_ids(1)
        finally:
            if protect is not None:
                self._unlock(protect, prune=False)
        if t1 is None and protect is not None:
            self._prune_up(protect)
        return t1

    def _alloc_active_state(self, protect: TreeNode) -> Optional[torch.Tensor]:
        """A T0 state slot for a request; KV pages are evicted (LRU) until the state side has room."""
        slot = self.states.alloc(1)
        if slot is not None:
            return slot
        self._lock(protect)
        try:
            while slot is None and self._evict_kv(self.page_size)[0]:
                slot = self.states.alloc(1)
        finally:
            self._unlock(protect)
        return slot

    def _alloc_side(self, side: Any, n: int) -> Optional[torch.Tensor]:
        """``n`` T0 ids of ``side`` (KV tokens), evicting device KV LRU while that makes progress. The
        caller holds a lock on what must survive."""
        ids = side.alloc(n)
        while ids is None and self._evict_kv(max(self.page_size, n - side.available_size()))[0]:
            ids = side.alloc(n)
        return ids
