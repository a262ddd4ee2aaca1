"""``HiMambaRadixCache``: the radix prefix cache of a hybrid model over T0, T1 and (optionally) T2.

A radix tree over token ids in pages of ``page_size``. Each node owns the KV of its span (T0 virtual
ids, and/or T2 host pages) and, optionally, the state at its end (a T1 int8 slot and/or a T2 host
slot); a node without a state is a *tombstone*: its KV can be reused only by a longer match that ends
at a state::

    root ── [1 2]* ── [3 4] ── [5 6]°          * = state in T1, ° = state in T2
       │    device     host      host          matching [1..6, 99]: 2 tokens usable from the device,
       └── [10 11 12]*                          4 more loadable from the host (init_load_back)

Ownership (SGLang's ``MambaRadixCache`` contract, with one difference):

- The engine owns a request's KV ids and its T0 state slot. ``insert`` frees the caller's duplicate
  KV ids ``value[prev_prefix_len:prefix_len]`` and takes ``value[prefix_len:cached_len]``. Nodes whose
  KV lives on the host only take the caller's ids for their span (the caller recomputed them).
- The tree never takes the caller's T0 slot (SGLang donates it): it quantizes a copy into a T1 slot
  it owns (``Int8CheckpointPool.store_from_active``). The caller keeps its slot; ``mamba_exist`` says
  the node already had a state. ``cache_finished_req`` frees the finished request's T0 slot.
- A ``cow_mamba`` match dequantizes the T1 state of ``last_device_node`` into the request's T0 slot,
  allocating one (``req.mamba_pool_idx``) when it has none, evicting KV for room. No room is a value,
  not an error (as in SGLang's tree, which evicts or reports no state): the device part of the match
  is a miss (``device_indices`` empty, ``last_device_node`` the root), and nothing of what the device
  part would have used is counted as hit (the KV path's recency is refreshed: it was matched).

Errors: every call checks all its arguments and preconditions first and raises a typed error from
``tiered_cache.errors`` before its first change (``InvalidTypeError`` for a wrong type). A state
whose store read a NaN or an inf is never served (``nonfinite.py``, ``stats["nonfinite_states"]``).

Tiers: device KV is upward closed (a node on the device has its parent on the device) and so are host
copies (nodes backed up on the host form a contiguous prefix from the root). The cache is a facade
(``facade.py``) over a ``RadixTree`` (``tree.py``: nodes, keys, locks, sizes), the Mamba resume rule
(``mamba.py``: match, insert), ``MambaStates`` (``mamba_states.py``: T1/T2 states), the ``HostTier``
(``host.py``, ``loadback.py``) and the ``Eviction`` (``evict.py``); the tree changes where a node
lives only when the transfer's ticket completes.

Locks: ``inc_lock_ref(node)`` (``RadixTree.lock``) adds one to ``full_lock_ref`` of every node from
``node`` to the root and one to ``node.mamba_lock_ref``, which protects the node's state.

Recency: an insert or a match refreshes the KV recency of every node on its path (both halves of a
node it splits included); a state's recency is refreshed when it is stored, offered again
(``mamba_exist``) or matched. Eviction asks the policy (``LRUPolicy`` by default) for victims.
"""

from __future__ import annotations

from typing import Any, Optional

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix import requests as _req
from tiered_cache.radix.checks import state_slot
from tiered_cache.radix.facade import RadixCacheFacade, side_of
from tiered_cache.radix.host import HostTier, check_args
from tiered_cache.radix.mamba import MambaRule
from tiered_cache.radix.mamba_states import MambaStates
from tiered_cache.radix.params import HostTierConfig
from tiered_cache.radix.placement import CheckpointPlacement
from tiered_cache.radix.policies.admission import StateAdmission
from tiered_cache.radix.policy import EvictionPolicy


class HiMambaRadixCache(RadixCacheFacade):
    """Radix prefix cache over a ``UnifiedPool`` (T0), an ``Int8CheckpointPool`` (T1) and a ``HostMirror`` (T2).

    Args:
        pool: T0; ``pool.side(kv_side)`` holds KV pages, ``pool.side(state_side)`` active states.
        ckpt_pool: T1; the tree's cached states.
        checkpoint_unit: tokens between exported checkpoints (a multiple of ``page_size``; default one
            page); ``mamba_branching_seqlen`` is aligned to it.
        placement: the mid-prefill checkpoint rule (default: unit, hash block = page, block = unit,
            alignment = unit).
        policy: an ``EvictionPolicy`` (default ``LRUPolicy``).
        validate: check that inserted ids are the caller's (one device sync per insert).
        host: a ``HostMirror`` (T2) with a KV region of T0 page envelopes and a state region of T1
            envelopes (names in ``host_config``); ``None``: the GPU tiers alone.
        transfer: the ``TransferEngine`` moving bytes to and from ``host`` (required with ``host``).
        host_config: ``HostTierConfig`` (write policy, thresholds, region names, T3 policies).
        storage: a ``StorageTier`` (T3) below ``host``, or ``None`` (``storage_hook.py``).
        admission: which states prefill chunks offer are kept (``policies.StateAdmission``; default all).
    """

    def __init__(self, pool: Any, ckpt_pool: Any, *, kv_side: str = "full", state_side: str = "mamba",
                 checkpoint_unit: Optional[int] = None, placement: Optional[CheckpointPlacement] = None,
                 policy: Optional[EvictionPolicy] = None, validate: bool = True, host: Any = None,
                 transfer: Any = None, host_config: Optional[HostTierConfig] = None,
                 storage: Any = None, admission: Optional[StateAdmission] = None) -> None:
        self._build_tree(pool, kv_side, policy, validate)
        self.states = side_of(pool, state_side, "state_side")
        from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool

        if not isinstance(ckpt_pool, Int8CheckpointPool):
            raise InvalidTypeError("ckpt_pool", "an Int8CheckpointPool", type(ckpt_pool).__name__)
        if ckpt_pool.spec != self.states.spec:
            raise InvalidArgumentError("ckpt_pool", f"a pool of the T0 state spec {self.states.spec}", ckpt_pool.spec)
        self.ckpt = ckpt_pool
        if self.states.device != self.kv.device or ckpt_pool.device != self.kv.device:
            raise InvalidArgumentError("ckpt_pool", f"a pool on {self.kv.device}", ckpt_pool.device)
        ps = self.page_size
        unit = ps if checkpoint_unit is None else checkpoint_unit
        if not isinstance(unit, int) or isinstance(unit, bool):
            raise InvalidTypeError("checkpoint_unit", f"a positive multiple of page_size={ps}", unit)
        if unit < ps or unit % ps:
            raise InvalidArgumentError("checkpoint_unit", f"a positive multiple of page_size={ps}", unit)
        if placement is not None and not isinstance(placement, CheckpointPlacement):
            raise InvalidTypeError("placement", "a CheckpointPlacement", type(placement).__name__)
        self.checkpoint_unit = unit
        self.placement = placement or CheckpointPlacement(unit, ps, unit, unit)
        check_args(host, transfer, host_config, storage)
        if admission is not None and not isinstance(admission, StateAdmission):
            raise InvalidTypeError("admission", "a StateAdmission", type(admission).__name__)
        self.rule = rule = MambaRule(self.tree, self.states, ckpt_pool, unit)
        if admission is not None:
            rule.admission = admission
        self.tree.bind(rule)
        self.host_tier = HostTier(self.tree, host, transfer, host_config)
        self.state_tier = MambaStates(self.tree, self.rule.flags, self.states, ckpt_pool, self.host_tier)
        self._wire(rule, self.state_tier)
        self.state_tier.bind(self.eviction, rule)
        from tiered_cache.tiers.unified_pool import UnifiedPool

        self.state_tier.shared_t0 = isinstance(pool, UnifiedPool) or bool(getattr(pool, "sides_share_bytes", False))
        rule.bind(self.host_tier, self.state_tier)
        if storage is not None and host is not None:
            from tiered_cache.radix.storage_hook import StorageHook

            conf = self.host_tier.conf
            self.host_tier.t3 = StorageHook(self, storage, policy=conf.prefetch_policy,
                                            timeout_s=conf.prefetch_timeout_s, write_through=conf.storage_write_through)
        self.reset()

    @property
    def state_region(self) -> Any:
        """The T2 region of states, or None."""
        return self.state_tier.region

    def supports_mamba(self) -> bool:
        return True

    # ----------------------------------------------------------------------------- requests
    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """A request finished: cache its tokens (``is_insert``), free the KV ids and the T0 state slot it
        still owns, release its lock (``requests.py``). Checks everything first: when it raises, the
        request still owns all it owned and the tree is unchanged."""
        _req.cache_finished_req(self, req, is_insert)

    def free_request_state(self, slot: Any) -> None:
        """An engine that frees a request's T0 state slot itself (not through ``cache_finished_req``): the slot
        goes back to the state pool, and a failed load back's mark on it goes too (else the slot's next owner
        would have its inserts refused as computed on that load: ``MambaRule.check_failed_load``)."""
        slot = state_slot(self.states, "slot", slot)
        self.states.free(slot)
        self.state_tier.rule.fresh_slot(slot)  # the MambaRule (typed as the facade's ResumeRule on self.rule)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """A prefill chunk is done: cache what it wrote, point the request's prefix at the tree's ids,
        move its lock to the new end. The request keeps its T0 state slot (``requests.py``)."""
        _req.cache_unfinished_req(self, req, chunked)

    # ----------------------------------------------------------------------------- placement
    def checkpoint_positions(self, start: int, end: int) -> list[int]:
        """Where the engine may export a state while prefilling ``[start, end)`` (``placement.py``)."""
        return self.placement.positions(start, end)
