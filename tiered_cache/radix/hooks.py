"""The interfaces between the generic parts of a radix cache and the resume rule of its hybrid kind.

The ``RadixTree``, the ``Eviction`` and the ``Loads`` (load back) know KV and nodes; whatever depends
on what a kind needs to resume (a recurrent state; the window's SWA KV) they ask through these. The
Mamba kind implements ``KindHooks`` in ``mamba.MambaRule`` and the other two in
``mamba_states.MambaStates``; the SWA kind implements all three in ``swa_rule.SWARule``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol

if TYPE_CHECKING:
    import torch

    from tiered_cache.radix.frees import Frees
    from tiered_cache.radix.host import Op
    from tiered_cache.radix.invariants import Seen
    from tiered_cache.radix.loadback import LoadBack
    from tiered_cache.radix.node import TreeNode
    from tiered_cache.radix.params import EvictParams, InsertParams, InsertResult, MatchPrefixParams, MatchResult


class KindHooks(Protocol):
    """What the tree asks the resume rule of its hybrid kind."""

    path_resources: tuple[str, ...]  # the kind's candidate sets a lock on a descendant protects

    def payload(self) -> Any:
        """A fresh (tombstone) payload for a new node."""

    def sync(self, x: TreeNode, idle: bool, unlocked: bool) -> None:
        """Put ``x`` in exactly the kind's candidate sets it belongs to now."""

    def own_lock_changed(self, x: TreeNode, locked: bool) -> None:
        """``x.mamba_lock_ref`` went from 0 to 1 (``locked``) or from 1 to 0."""

    def removed(self, x: TreeNode) -> None:
        """``x`` leaves the tree with its payload still in it (counters; the ids go to a ``Frees``)."""


class ResumeRule(KindHooks, Protocol):
    """What the cache facade routes to the rule: match and insert, and its part of reset, of every
    engine step and of ``check_invariants`` (recording into ``invariants.Seen``)."""

    def match(self, params: MatchPrefixParams) -> MatchResult: ...

    def insert(self, params: InsertParams) -> InsertResult: ...

    def clear(self) -> None: ...

    def on_events(self) -> None: ...

    def check_node(self, x: TreeNode, seen: Seen, idle: bool, unlocked: bool) -> None: ...

    def check_slots(self, seen: Seen, request_states: Optional[torch.Tensor]) -> None: ...


class EvictHooks(Protocol):
    """What eviction asks the resume rule."""

    def evict_device(self, params: EvictParams) -> None:
        """Evict the kind's device resources ``params`` asks for (T1 states; SWA KV)."""

    def evict_host(self, params: EvictParams) -> int:
        """Evict the kind's T2 resources ``params`` asks for. -> how many went."""

    def can_demote(self, x: TreeNode) -> bool:
        """Whether freeing ``x``'s device KV keeps what the kind needs of it (else the leaf goes whole)."""

    def demoted(self, x: TreeNode, f: Frees) -> None:
        """``x``'s device KV is being freed, its host copy stays: the kind frees its device part."""


class LoadHooks(Protocol):
    """What a load asks the resume rule about the data it needs at the prefix's end (``best``)."""

    def check_load_req(self, req: Any) -> None:
        """Raise for a request that cannot receive what the load brings (before anything changes)."""

    def loadable(self, best: TreeNode) -> bool:
        """Whether ``best``'s payload may be served (a Mamba state found non-finite is dropped)."""

    def state_on_host(self, best: TreeNode) -> bool:
        """Whether the load must bring ``best``'s payload from T2 (then no threshold applies)."""

    def prepare_load(self, best: TreeNode, req: Any) -> Optional[Any]:
        """Room for the payload part of the load (evicting); None: no room (nothing kept)."""

    def start_load(self, op: Op, prepared: Any, best: TreeNode, req: Any) -> None:
        """Start the payload part of ``op`` (its tickets beside the KV ones)."""

    def loaded(self, y: TreeNode) -> None:
        """``y``'s KV (every stream) landed intact."""

    def load_finished(self, op: Op, f: Frees) -> bool:
        """``op`` is done: settle its payload part. -> whether that part landed intact."""

    def emptied(self, y: TreeNode) -> None:
        """``y``'s payload is about to be dropped with its corrupt host copy (counters)."""

    def loaded_handle(self, handle: LoadBack) -> None:
        """The handle of a load just started (the SWA rule adds the SWA ids of the loaded tokens)."""
