"""Eviction of the radix caches: the cascade down the tiers, drawn from the policy's candidate sets.

    device KV  (T0) --evict: demote if backed up (write-back: back up first), else drop--> T2 / gone
    payload         --evict: the resume rule's (a T1 state demoted to T2 or dropped; SWA KV tombstoned)
    T2 KV / state   --evict: drop

Victims come from the policy, one candidate set per (resource, tier), which the ``RadixTree`` keeps
(``sync``); a node with a transfer in flight is never a candidate: nothing is freed or dropped while
a ticket reads or writes it. ``Eviction`` owns the device KV and T0 room; the kind's own resources are
evicted by its rule (``hooks.EvictHooks``), T2 KV by the ``HostTier``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidTypeError
from tiered_cache.radix.frees import Frees
from tiered_cache.radix.hooks import EvictHooks
from tiered_cache.radix.host import HostTier
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import EvictParams, EvictResult, counts_ok
from tiered_cache.radix.tree import RadixTree
from tiered_cache.validate import int_arg

_COUNTS = ("num_tokens", "swa_num_tokens", "mamba_num", "host_num_tokens", "host_mamba_num")


class Eviction:
    """Evicts device KV of ``tree`` (demoting to ``host`` when it has a copy) and finds T0 room."""

    def __init__(self, tree: RadixTree, rule: EvictHooks, host: HostTier) -> None:
        self.tree, self.rule, self.host = tree, rule, host

    def evict(self, params: EvictParams) -> EvictResult:
        """See ``RadixCacheFacade.evict``."""
        if not isinstance(params, EvictParams):
            raise InvalidTypeError("params", "an EvictParams", type(params).__name__)
        # checked again (a field can be set after construction): one condition, the typed errors through int_arg,
        # every count checked before any is replaced by int_arg's plain int (as at construction)
        if not counts_ok(params):
            counts = [int_arg(arg, getattr(params, arg), lo=0) for arg in _COUNTS]
            for arg, v in zip(_COUNTS, counts, strict=True):
                setattr(params, arg, v)
        # Counted as freed wherever the cascade frees them (a host eviction for room can remove a
        # leaf with a T1 state; a T2 state eviction can remove a leaf on the device).
        freed = self.tree.freed
        dev0, t10, swa0 = freed["kv"], freed["state"], freed["swa"]
        r = EvictResult()
        if params.num_tokens:
            self.evict_kv(params.num_tokens)
        self.rule.evict_device(params)
        if self.host.enabled:
            if params.host_num_tokens:
                r.host_num_tokens_evicted = self.host.evict_kv(params.host_num_tokens)
            r.host_mamba_num_evicted = self.rule.evict_host(params)
        r.num_tokens_evicted = freed["kv"] - dev0
        r.mamba_num_evicted = freed["state"] - t10
        r.swa_num_tokens_evicted = freed["swa"] - swa0
        return r

    def evict_kv(self, num: int) -> int:
        """Free at least ``num`` device KV tokens, LRU first, while candidates remain. -> tokens."""
        return self.tree.evict_each("kv", num, self._evict_one, lambda: self.host.settle("backup"))

    def _evict_one(self, x: TreeNode, f: Frees) -> int:
        host = self.host
        if not self.rule.can_demote(x) and host.enabled and host.conf.write_policy == "write_back":
            host.backup_sync(x)  # write-back: written first, then demoted
            self.tree.policy.discard("kv", x)
        if self.rule.can_demote(x):
            self.demote(x, f)
            return len(x.key)
        assert not x.children, f"{x} has children on the host but no host copy itself"
        return self.tree.drop_leaf(x, f)

    def demote(self, x: TreeNode, f: Frees) -> None:
        """Free ``x``'s device KV; its complete host copy stays (the tree keeps the node). Also the SWA
        rule's, for an SWA victim backed up whole."""
        tree = self.tree
        f.kv.append(x.value)  # type: ignore[arg-type]  # a "kv" candidate is on the device
        x.value = None
        self.rule.demoted(x, f)
        tree.full_evictable -= len(x.key)
        tree.freed["kv"] += len(x.key)
        tree.sync(x)
        tree.sync(x.parent)
        if self.host.t3 is not None:  # T3 without write-through gets KV when eviction demotes it
            self.host.t3.on_kv_demoted(x)

    def alloc_side(self, side: Any, n: int) -> Optional[torch.Tensor]:
        """``n`` T0 ids of ``side`` (KV tokens), evicting device KV LRU while that makes progress. The
        caller holds a lock on what must survive."""
        ids = side.alloc(n)
        while ids is None and self.evict_kv(max(self.tree.page_size, n - side.available_size())):
            ids = side.alloc(n)
        return ids

    def alloc_protected(self, side: Any, n: int, protect: TreeNode) -> Optional[torch.Tensor]:
        """``n`` ids of ``side`` (a state side: no KV), evicting KV a page at a time; ``protect``'s path survives."""
        ids = side.alloc(n)
        if ids is not None:
            return ids
        self.tree.lock(protect)
        try:
            while ids is None and self.evict_kv(self.tree.page_size):
                ids = side.alloc(n)
        finally:
            self.tree.unlock(protect)
        return ids
