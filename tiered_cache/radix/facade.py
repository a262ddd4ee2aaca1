"""``RadixCacheFacade``: the prefix-cache interface both radix caches offer, over their components.

A cache is a ``RadixTree`` (nodes, keys, locks, sizes), a resume rule of its hybrid kind (match and
insert; ``mamba.MambaRule``, ``swa.SWARule``), a ``HostTier`` (T2 backups and room, with ``Loads``
for load back, and T3 through ``StorageHook``) and an ``Eviction``; the facade only checks arguments
that belong to no single component and routes each call to the component that owns it. The
components are public attributes (``tree``, ``rule``, ``host_tier``, ``eviction``) for engines and
tests that need more than the SGLang-shaped methods.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix import invariants as _inv
from tiered_cache.radix import params as P
from tiered_cache.radix.evict import Eviction
from tiered_cache.radix.hooks import ResumeRule
from tiered_cache.radix.host import HostTier
from tiered_cache.radix.loadback import Loads
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.policy import EvictionPolicy
from tiered_cache.radix.tree import RadixTree
from tiered_cache.tiers.protocols import ActiveSide, T0Pool


def _of(component: str, attr: str, doc: str) -> property:
    """A read-only attribute of the facade that is ``attr`` of its ``component``."""
    return property(lambda self: getattr(getattr(self, component), attr), doc=doc)


class RadixCacheFacade:
    """Shared by ``HiMambaRadixCache`` and ``HiSWARadixCache`` (see them for the contract)."""

    tree: RadixTree
    rule: ResumeRule
    host_tier: HostTier
    eviction: Eviction
    agreement: Any = None  # a parallel.Agreement under tensor parallelism (None: this rank decides alone)

    def _build_tree(self, pool: Any, kv_side: Any, policy: Optional[EvictionPolicy], validate: bool) -> None:
        if not isinstance(pool, T0Pool):
            raise InvalidTypeError("pool", "a T0 pool (tiers.protocols.T0Pool: a UnifiedPool, or an engine's "
                                   "pools offering side(name) and check_invariants())", type(pool).__name__)
        self.pool = pool
        self.kv = side_of(pool, kv_side, "kv_side")
        self.tree = RadixTree(self.kv, policy, validate)

    def _wire(self, rule: Any, kind: Any) -> None:
        """``rule`` answers the tree; ``kind`` is the kind's side of eviction and load back."""
        self.eviction = Eviction(self.tree, kind, self.host_tier)
        self.host_tier.loads = Loads(self.tree, self.host_tier, kind, self.eviction)

    # ----------------------------------------------------------------------------- components' state
    page_size = _of("tree", "page_size", "Tokens per KV page.")
    device = _of("tree", "device", "The device of T0 (and T1).")
    policy = _of("tree", "policy", "The ``EvictionPolicy``.")
    validate = _of("tree", "validate", "Whether inserted ids are checked to be the caller's.")
    root = _of("tree", "root", "The root node (no key, never locked).")
    root_node = root
    stats = _of("tree", "stats", "Event counts (a ``collections.Counter``): backups, loads, drops, T3 traffic, ...")
    host = _of("host_tier", "mirror", "The ``HostMirror`` (T2), or None.")
    engine = _of("host_tier", "engine", "The ``TransferEngine`` of T2, or None.")
    t3 = _of("host_tier", "t3", "The ``StorageHook`` of T3, or None.")
    hconf = _of("host_tier", "conf", "The ``HostTierConfig``.")
    kv_region = _of("host_tier", "kv_region", "The T2 region of KV pages, or None.")

    # ----------------------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        """Drop the tree and give every slot it owns, in every tier, back to its pool.

        Meant for an idle engine: transfers in flight are waited for first, loads in flight end not
        ``ok``; nodes held by requests become stale (a later call with one raises).
        """
        if self.tree.epochs:
            self.host_tier.drain()
        self.tree.clear()
        self.rule.clear()

    # ----------------------------------------------------------------------------- sizes
    def full_evictable_size(self) -> int:
        return self.tree.full_evictable

    def full_protected_size(self) -> int:
        return self.tree.full_protected

    def mamba_evictable_size(self) -> int:
        return self.tree.state_evictable

    def mamba_protected_size(self) -> int:
        return self.tree.state_protected

    evictable_size = full_evictable_size
    protected_size = full_protected_size

    def total_size(self) -> tuple[int, int]:
        """(KV tokens on the device, states in T1)."""
        t = self.tree
        return (t.full_evictable + t.full_protected, t.state_evictable + t.state_protected)

    # ----------------------------------------------------------------------------- the interface
    def match_prefix(self, params: P.MatchPrefixParams) -> P.MatchResult:
        """The longest cached prefix of ``params.key`` the model can resume at (the rule's ``match``)."""
        return self.rule.match(params)

    def insert(self, params: P.InsertParams) -> P.InsertResult:
        """Cache ``params.key`` and its ids (the rule's ``insert``; ownership in ``params``)."""
        return self.rule.insert(params)

    def inc_lock_ref(self, node: TreeNode) -> P.IncLockRefResult:
        self.tree.check_node(node)
        return P.IncLockRefResult(delta=self.tree.lock(node), node_id=node.id)

    def dec_lock_ref(self, node: TreeNode, params: Optional[P.DecLockRefParams] = None) -> P.DecLockRefResult:
        self.tree.check_locked(node, "node")
        if params is not None and not isinstance(params, P.DecLockRefParams):
            raise InvalidTypeError("params", "a P.DecLockRefParams or None", type(params).__name__)
        return P.DecLockRefResult(delta=self.tree.unlock(node))

    def evict(self, params: P.EvictParams) -> P.EvictResult:
        """Free at least the asked amounts, LRU first, while unlocked candidates remain.

        ``num_tokens``: device KV tokens (demoted when backed up, else dropped; a leaf dropped takes its
        states); ``mamba_num``: T1 states (demoted to T2 when it has room); ``swa_num_tokens``: SWA KV
        (SWA mode); ``host_*``: T2 entries. ``num_tokens_evicted`` counts every device KV token freed
        (state eviction removes leaves)."""
        return self.eviction.evict(params)

    def init_load_back(self, params: P.InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        """Start loading the host part of a match: T0 pages for the KV of ``best_match_node``'s path
        below ``last_device_node`` that is on the host only, and what resuming at ``best_match_node``
        needs (a state, T2: promoted and dequantized straight into the request's T0 slot; T1:
        dequantized; or the SWA pages, as KV).

        Returns ``(ids, node)``: the T0 ids of the ``host_hit_length`` tokens (append them to the
        match's ``device_indices``) and the node the prefix now ends at; ``(empty, last_device_node)``
        when nothing is loaded (no room even after evicting, below the threshold, over ``mem_quota``,
        or a node of the path already in flight). Host copies stay; the locks the load takes are
        released when its ticket completes. ``req.load_back`` (a ``LoadBack``) tracks it.
        """
        return self.host_tier.loads.init_load_back(params)

    def check_hicache_events(self) -> None:
        """Apply every finished transfer to the tree (the engine calls this every step).

        The cache polls its ``TransferEngine``; another user of the same engine must track its own
        tickets by ``ticket.done`` rather than by what ``poll`` returns. Under tensor parallelism what
        each rank finished is agreed first (``parallel.agree``: one collective)."""
        if self.agreement is not None:
            self.agreement.check_events()
            return
        self.rule.on_events()
        self.host_tier.check_events()

    def cancel_prefetch(self, req: Any) -> None:
        """``req`` was aborted: stop its T3 prefetches (their T2 slots go back once their workers stop)."""
        if self.host_tier.t3 is not None:
            self.host_tier.t3.cancel(req)

    def check_invariants(self, request_kv: Optional[torch.Tensor] = None,
                         request_states: Optional[torch.Tensor] = None) -> None:
        """Recompute everything from the sets; ``request_*``: ids the engine's requests own (then every
        slot must be exactly free, cached, a request's or in flight). Raises AssertionError."""
        _inv.check_invariants(self, request_kv, request_states)


def side_of(pool: Any, name: Any, arg: str) -> Any:
    """``pool.side(name)``, with a bad name reported under the tree's own argument name; the side must
    offer what the tree asks of every side (``ActiveSide``)."""
    try:
        side = pool.side(name)
    except InvalidTypeError as e:
        raise InvalidTypeError(arg, e.expected, name) from None
    except InvalidArgumentError as e:
        raise InvalidArgumentError(arg, e.expected, name) from None
    if not isinstance(side, ActiveSide):
        raise InvalidTypeError(arg, "the name of a side offering tiers.protocols.ActiveSide", type(side).__name__)
    return side
