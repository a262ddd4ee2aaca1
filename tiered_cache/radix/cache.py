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
copies (nodes backed up on the host form a contiguous prefix from the root). Movement to and from T2
is in ``host.py``, eviction in ``evict.py``; the tree changes where a node lives only when the
transfer's ticket completes.

Locks: ``inc_lock_ref(node)`` adds one to ``full_lock_ref`` of every node from ``node`` to the root
and one to ``node.mamba_lock_ref``, which protects the node's state. A tombstone may be locked (the
engine locks where its prefix ends); a locked tombstone may become a leaf when its children go, and
is removed when its last lock is released. Otherwise no leaf is a tombstone.

Recency: an insert or a match refreshes the KV recency of every node on its path (both halves of a
node it splits included); a state's recency is refreshed when it is stored, offered again
(``mamba_exist``) or matched. Eviction asks the policy (``LRUPolicy`` by default) for victims.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix import invariants as _inv
from tiered_cache.radix import nonfinite as _nf
from tiered_cache.radix import requests as _req
from tiered_cache.radix.checks import (
    check_callers_kv,
    check_locked,
    check_node,
    check_prev_prefix_len,
    check_state_allocated,
    common_len,
    desc,
    parse_key,
    state_slot,
)
from tiered_cache.radix.evict import EvictionMixin, Frees
from tiered_cache.radix.host import HostTierMixin
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import (
    DecLockRefParams,
    DecLockRefResult,
    HostTierConfig,
    IncLockRefResult,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from tiered_cache.radix.placement import CheckpointPlacement
from tiered_cache.radix.policy import EvictionPolicy, LRUPolicy


class HiMambaRadixCache(EvictionMixin, HostTierMixin):
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
        transfer: the ``TransferEngine`` moving bytes to and from ``host`` (default: a new one).
        host_config: ``HostTierConfig`` (write policy, thresholds, region names, T3 policies).
        storage: a ``StorageTier`` (T3) below ``host``, or ``None`` (``storage_hook.py``).
    """

    mode = "mamba"

    def __init__(self, pool: Any, ckpt_pool: Any, *, kv_side: str = "full", state_side: str = "mamba",
                 checkpoint_unit: Optional[int] = None, placement: Optional[CheckpointPlacement] = None,
                 policy: Optional[EvictionPolicy] = None, validate: bool = True, host: Any = None,
                 transfer: Any = None, host_config: Optional[HostTierConfig] = None,
                 storage: Any = None) -> None:
        self._setup(pool, kv_side, policy, validate)
        self.states = _side_of(pool, state_side, "state_side")
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
        self._init_host(host, transfer, host_config, storage)
        self.reset()

    def _setup(self, pool: Any, kv_side: str, policy: Optional[EvictionPolicy], validate: bool) -> None:
        from tiered_cache.tiers.unified_pool import UnifiedPool

        if not isinstance(pool, UnifiedPool):
            raise InvalidTypeError("pool", "a UnifiedPool", type(pool).__name__)
        self.pool = pool
        self.kv = _side_of(pool, kv_side, "kv_side")
        self.page_size = ps = self.kv.page_size
        self.device = self.kv.device
        if policy is not None and not isinstance(policy, EvictionPolicy):
            raise InvalidTypeError("policy", "an EvictionPolicy", type(policy).__name__)
        if not isinstance(validate, bool):
            raise InvalidTypeError("validate", "a bool", validate)
        self.policy = policy or LRUPolicy()
        self.validate = bool(validate)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        # Page-level "the tree owns this KV page": refuses inserts of ids the tree already holds.
        self._owned = torch.zeros(self.kv.capacity, dtype=torch.bool, device=self.device)
        self._offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        self.root: Optional[TreeNode] = None

    # ----------------------------------------------------------------------------- lifecycle
    @property
    def root_node(self) -> TreeNode:
        return self.root

    def reset(self) -> None:
        """Drop the tree and give every slot it owns, in every tier, back to its pool.

        Meant for an idle engine: transfers in flight are waited for first, loads in flight end not
        ``ok``; nodes held by requests become stale (a later call with one raises).
        """
        if self.root is not None:
            if self.t3 is not None:
                self.t3.drain()
            self._drain_ops()
            f = Frees()
            stack = list(self.root.children.values())
            while stack:
                x = stack.pop()
                stack.extend(x.children.values())
                f.take(self, x)
                x.alive = False
            f.flush(self)
        self._token = object()  # new owner tag: nodes of the old tree are refused from now on
        self.root = TreeNode(self._token, None, [], self._empty)
        self.policy.clear()
        self._owned.zero_()
        self._t1_owner: dict[int, TreeNode] = {}  # T1 host slot id -> node, while its NaN/inf flag is unread
        self._full_evictable = self._full_protected = 0
        self._mamba_evictable = self._mamba_protected = 0
        self._n_dev_freed = self._n_t1_freed = self._n_swa_freed = 0  # running totals; evict reports deltas

    # ----------------------------------------------------------------------------- sizes
    def full_evictable_size(self) -> int:
        return self._full_evictable

    def full_protected_size(self) -> int:
        return self._full_protected

    def mamba_evictable_size(self) -> int:
        return self._mamba_evictable

    def mamba_protected_size(self) -> int:
        return self._mamba_protected

    def evictable_size(self) -> int:
        return self._full_evictable

    def protected_size(self) -> int:
        return self._full_protected

    def total_size(self) -> tuple[int, int]:
        """(KV tokens on the device, states in T1)."""
        return (self._full_evictable + self._full_protected, self._mamba_evictable + self._mamba_protected)

    def supports_mamba(self) -> bool:
        return True

    def _has_state(self, x: TreeNode) -> bool:
        """A model can resume at ``x``'s end from some tier (SWA mode: ``x`` is not an SWA tombstone)."""
        return x.mamba_value is not None or x.state_host is not None

    # ----------------------------------------------------------------------------- match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key`` that ends at a state (see ``MatchResult``).

        With ``cow_mamba`` and no T0 state slot for the request even after evicting KV, the device part
        is a miss (a value, not an error: see the module docstring); a bad argument raises first."""
        if not isinstance(params, MatchPrefixParams):
            raise InvalidTypeError("params", "a MatchPrefixParams", type(params).__name__)
        toks, salt = parse_key(params.key)
        req, cow = params.req, params.cow_mamba
        if not isinstance(cow, bool):
            raise InvalidTypeError("cow_mamba", "a bool", cow)
        dst = None
        if cow:
            if req is None or not hasattr(req, "mamba_pool_idx"):
                raise InvalidArgumentError("req", "a request with .mamba_pool_idx when cow_mamba is set", req)
            if req.mamba_pool_idx is not None:
                dst = state_slot(self, "req.mamba_pool_idx", req.mamba_pool_idx)
                if self.validate:
                    check_state_allocated(self, dst, "req.mamba_pool_idx")
        # Every check is done: what follows may change the tree.
        if self.t3 is not None:  # T3 -> T2 for pages past the tree's match (wait policies: before the walk)
            self.t3.maybe_prefetch(toks, salt, req)
        _nf.poll(self)
        while True:
            path, values, kv_len, dev, dev_len, dev_k, best, best_len = self._walk(toks, salt, len(toks))
            # Neither state may be reported before its NaN/inf flag is read: a drop changes the walk.
            if _nf.verify(self, dev) and _nf.verify(self, best):
                break
        touch = self.policy.touch
        for x in path:
            touch("kv", x)
        branching = None
        if kv_len > best_len:
            b = kv_len // self.checkpoint_unit * self.checkpoint_unit
            branching = b if b > best_len else None
        if best is self.root:
            return self._result(self._empty, self.root, self.root, 0, 0, branching, kv_len)
        unserved = None
        if cow and dev is not self.root and dst is None:
            dst = self._alloc_active_state(dev)  # evicts KV (dev's path locked meanwhile)
            if dst is None:  # no room for the request's state: the device part is unusable, a miss
                unserved, dev, dev_k, dev_len = dev, self.root, 0, 0
            else:
                req.mamba_pool_idx = dst
        if best is not unserved:  # a state not served is not a hit
            touch("state", best)
            best.hit_count += 1
        if dev is not best and dev is not self.root:
            touch("state", dev)
        if self.host is not None and self.hconf.write_policy == "write_through_selective":
            self._count_hits(path, best)
        if cow and dev is not self.root:
            self.ckpt.load_to_active(dev.mamba_value, self.states, dst)
        idx = self._empty if dev_k == 0 else values[0] if dev_k == 1 else torch.cat(values[:dev_k])
        host_len = best_len - dev_len
        mamba_host = int(best is not dev and best.mamba_value is None)
        return self._result(idx, dev, best, host_len, mamba_host, branching, kv_len)

    def _result(self, idx: torch.Tensor, dev: TreeNode, best: TreeNode, host_len: int, mamba_host: int,
                branching: Optional[int], kv_len: int, **kw: Any) -> MatchResult:
        last_host = best
        if self.host is not None:
            while last_host is not self.root and last_host.host_kv is None:
                last_host = last_host.parent
        return MatchResult(device_indices=idx, last_device_node=dev, last_host_node=last_host,
                           best_match_node=best, host_hit_length=host_len, mamba_host_hit_length=mamba_host,
                           mamba_branching_seqlen=branching, cache_protected_len=len(idx), kv_hit_length=kv_len,
                           **kw)

    def _walk(self, toks: list[int], salt: Optional[str], end: int):
        """Read-only walk. -> (nodes on the path, device values of fully matched nodes, page-aligned
        tokens whose KV matched in any tier, deepest node with a T1 state reachable on the device,
        its depth, its #values, deepest node with a state in any tier, its depth)."""
        ps = self.page_size
        end = end // ps * ps
        node = root = self.root
        path: list[TreeNode] = []
        values: list[torch.Tensor] = []
        i = 0
        dev, dev_len, dev_k = root, 0, 0
        best, best_len = root, 0
        on_dev = True
        children = node.children
        while i < end:
            ck = toks[i] if ps == 1 else tuple(toks[i:i + ps])
            child = children.get(ck if node is not root or salt is None else (salt, ck))
            if child is None:
                break
            v = child.value
            if v is None and child.host_kv is None:
                break  # dead: matches nothing
            m = common_len(child.key, toks, i, end, ps)
            path.append(child)
            if m < len(child.key):
                return path, values, i + m, dev, dev_len, dev_k, best, best_len
            i += m
            node, children = child, child.children
            if v is None:
                on_dev = False
            elif on_dev:
                values.append(v)
            if child.mamba_value is not None:
                best, best_len = child, i
                if on_dev:
                    dev, dev_len, dev_k = child, i, len(values)
            elif child.state_host is not None:
                best, best_len = child, i
        return path, values, i, dev, dev_len, dev_k, best, best_len

    # ----------------------------------------------------------------------------- insert
    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``key`` -> ``value`` with the state ``mamba_value`` at its end (see module docstring).

        Only whole pages are cached; a state is stored only when ``len(key)`` is page-aligned (it is
        valid at that position alone). New KV is taken only together with a state (a leaf is never a
        tombstone). With no T1 room even after evicting states, nothing is cached:
        ``prefix_len == cached_len == prev_prefix_len`` and the caller keeps ``value[prev_prefix_len:]``.
        """
        if not isinstance(params, InsertParams):
            raise InvalidTypeError("params", "an InsertParams", type(params).__name__)
        toks, salt = parse_key(params.key)
        n, ps = len(toks), self.page_size
        value = params.value
        self._check_value("value", value, n)
        prev = params.prev_prefix_len
        check_prev_prefix_len(prev, n, ps)
        prev = int(prev)
        slot = None if params.mamba_value is None else state_slot(self, "mamba_value", params.mamba_value)
        aligned = n // ps * ps
        if aligned == 0:
            return InsertResult(prefix_len=0, cached_len=0, last_device_node=self.root)
        path, end_node, dev_prefix, pending = self._insert_probe(toks, salt, aligned)
        if prev > dev_prefix:
            raise InvalidArgumentError("prev_prefix_len", f"<= the cached prefix length ({dev_prefix})", prev)
        if self.validate and prev < aligned:
            check_callers_kv(self, value[prev:aligned])
        if self.validate and slot is not None:
            check_state_allocated(self, slot)
        if pending:  # the caller computed on KV a load is writing: its ticket is done, or nearly
            self._settle_loads()
            path, end_node, dev_prefix, _ = self._insert_probe(toks, salt, aligned)
            if prev > dev_prefix:
                raise InvalidArgumentError("prev_prefix_len", f"<= the prefix whose load succeeded ({dev_prefix})",
                                           prev)
        mamba_exist = aligned == n and end_node is not None and self._has_state(end_node)
        t1 = t1_id = None
        if slot is not None and aligned == n and not mamba_exist:
            got = self.ckpt.alloc_ids(1) or self._alloc_ckpt_protected(path[-1] if path else None)
            if got is None:
                return InsertResult(prefix_len=prev, cached_len=prev, last_device_node=None)
            t1, (t1_id,) = got
            try:
                self.ckpt.store_from_active(self.states, slot, t1)
            except BaseException:
                self.ckpt.free(t1)
                raise
        res = self._insert_walk(toks, salt, value, aligned, prev, t1, mamba_exist, slot is not None)
        if res.mamba_stored:
            _nf.stored(self, res.last_device_node, t1_id)
        self._after_insert(res)
        return res

    def _check_value(self, arg: str, value: Any, n: int) -> None:
        if not isinstance(value, torch.Tensor):
            raise InvalidTypeError(arg, "a 1-D int64 tensor of KV ids", desc(value))
        if value.dtype != torch.int64:
            raise InvalidTypeError(arg, "a 1-D int64 tensor of KV ids", desc(value))
        if value.dim() != 1:
            raise InvalidArgumentError(arg, "a 1-D int64 tensor of KV ids", desc(value))
        if value.device != self.device:
            raise InvalidArgumentError(arg, f"a tensor on {self.device}", value.device)
        if value.numel() != n:
            # The two disagree: either may be the wrong one, so the error names both.
            raise InvalidArgumentError(f"key, {arg}", f"one KV id per token ({n} tokens)", f"{value.numel()} ids")

    def _insert_probe(self, toks: list[int], salt: Optional[str], aligned: int):
        """Read-only walk. -> (path, the node ending exactly at ``aligned`` or None, device-matched
        tokens, whether a load is in flight on the path). Tokens a load is writing count as on the
        device (the caller got their ids from ``init_load_back``); a node on the host only, or dead,
        ends the device part: insert gives it the caller's ids."""
        ps, node, root = self.page_size, self.root, self.root
        path, i, dev, on_dev, pending, total = [], 0, 0, True, False, 0
        while i < aligned:
            ck = toks[i] if ps == 1 else tuple(toks[i:i + ps])
            child = node.children.get(ck if node is not root or salt is None else (salt, ck))
            if child is None:
                break
            m = common_len(child.key, toks, i, aligned, ps)
            path.append(child)
            pending = pending or child.value_pending is not None
            on_dev = on_dev and (child.value is not None or child.value_pending is not None)
            i += m
            total += len(child.key)
            dev = i if on_dev else dev
            if m < len(child.key):
                break
            node = child
        end = path[-1] if path and i == aligned == total else None
        return path, end, dev, pending

    def _insert_walk(self, toks, salt, value, aligned, prev, t1, mamba_exist, offered) -> InsertResult:
        ps, root, touch = self.page_size, self.root, self.policy.touch
        node, i, prefix = root, 0, None
        dups: list[torch.Tensor] = []
        split_suffix = None
        while i < aligned:
            ck = toks[i] if ps == 1 else tuple(toks[i:i + ps])
            if node is root and salt is not None:
                ck = (salt, ck)
            child = node.children.get(ck)
            if child is None:
                break
            m = common_len(child.key, toks, i, aligned, ps)
            if m < len(child.key):
                split_suffix = child
                child = self._split(child, m)
            touch("kv", child)
            if child.value is None:  # on the host only (or dead): take the caller's ids for its span
                prefix = i if prefix is None else prefix
                self._reattach(child, value[i:i + m])
            elif prefix is None:
                lo = max(prev, i)
                if lo < i + m:
                    dups.append(value[lo:i + m])
            i += m
            node = child
        prefix = i if prefix is None else prefix
        stored = False
        if i < aligned:
            if t1 is not None:
                node = self._new_leaf(node, toks[i:aligned], value[i:aligned], t1, salt)
                stored, i = True, aligned
        elif node is not root:
            if not self._has_state(node) and t1 is not None:
                self._set_state(node, t1)
                stored = True
            elif mamba_exist and offered:
                touch("state", node)
        if t1 is not None and not stored:
            self.ckpt.free(t1)
        if dups:
            self.kv.free(dups[0] if len(dups) == 1 else torch.cat(dups))
        if split_suffix is not None and split_suffix.alive:
            self._prune_up(split_suffix)  # states evicted for room may have taken its children
        return InsertResult(prefix_len=prefix, cached_len=i, mamba_exist=mamba_exist, mamba_stored=stored,
                            last_device_node=node)

    def _reattach(self, x: TreeNode, ids: torch.Tensor) -> None:
        """``x``'s KV was on the host only (or nowhere): it takes the caller's ids for its span."""
        x.value = ids.clone()
        self._owned[x.value[::self.page_size] // self.page_size] = True
        if x.full_lock_ref:
            self._full_protected += len(x.key)
        else:
            self._full_evictable += len(x.key)
        self._sync(x)
        self._sync(x.parent)

    def _new_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, t1: Optional[torch.Tensor],
                  salt: Optional[str]) -> TreeNode:
        ps = self.page_size
        leaf = TreeNode(self._token, parent, key, value.clone())
        ck = key[0] if ps == 1 else tuple(key[:ps])
        leaf.ck = (salt, ck) if parent is self.root and salt is not None else ck
        parent.children[leaf.ck] = leaf
        self._owned[leaf.value[::ps] // ps] = True
        self._full_evictable += len(key)
        self.policy.touch("kv", leaf)
        if t1 is not None:
            self._set_state(leaf, t1)
        self._sync(leaf)
        self._sync(parent)
        return leaf

    def _set_state(self, node: TreeNode, t1: torch.Tensor) -> None:
        node.mamba_value = t1
        self.policy.touch("state", node)
        if node.mamba_lock_ref:  # a locked tombstone got its state: protected at once
            self._mamba_protected += 1
        else:
            self._mamba_evictable += 1
        self._sync(node)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """child -> new (key[:m], a tombstone) -> child (key[m:]); returns new. Sizes do not change.
        Host pages (one per page) and data in flight are partitioned at the same page boundary."""
        ps, parent, k = self.page_size, child.parent, m // self.page_size
        new = TreeNode(self._token, parent, child.key[:m], None if child.value is None else child.value[:m].clone())
        new.ck = child.ck
        new.full_lock_ref = child.full_lock_ref  # every lock below child is below new too
        new.hit_count = child.hit_count
        child.key = child.key[m:]
        if child.value is not None:
            child.value = child.value[m:].clone()
        for attr in self._TOKEN_ATTRS:
            t = getattr(child, attr)
            if t is not None:
                setattr(new, attr, t[:m].clone())
                setattr(child, attr, t[m:].clone())
        for attr in self._PAGE_ATTRS:
            lst = getattr(child, attr)
            if lst is not None:
                setattr(new, attr, lst[:k])
                setattr(child, attr, lst[k:])
        new.swa_tomb = child.swa_tomb
        new.tickets = list(child.tickets)
        for op in child.tickets:  # the op now finishes both halves
            op.nodes.insert(op.nodes.index(child), new)
        child.ck = child.key[0] if ps == 1 else tuple(child.key[:ps])
        child.parent = new
        new.children[child.ck] = child
        parent.children[new.ck] = new
        self.policy.touch("kv", child)
        self._sync(new)
        self._sync(child)
        return new

    _TOKEN_ATTRS = ("value_pending", "swa_value", "swa_pending")
    _PAGE_ATTRS = ("host_kv", "host_pending", "swa_host", "swa_host_pending")

    # ----------------------------------------------------------------------------- locks
    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        check_node(self, node)
        return IncLockRefResult(delta=self._lock(node), node_id=node.id)

    def dec_lock_ref(self, node: TreeNode, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        check_locked(self, node, "node")
        if params is not None and not isinstance(params, DecLockRefParams):
            raise InvalidTypeError("params", "a DecLockRefParams or None", type(params).__name__)
        return DecLockRefResult(delta=self._unlock(node))

    def _lock(self, node: TreeNode) -> int:
        if node is self.root:
            return 0
        discard = self.policy.discard
        if node.mamba_lock_ref == 0:
            if node.mamba_value is not None:
                self._mamba_evictable -= 1
                self._mamba_protected += 1
                discard("state", node)
            if node.state_host is not None:
                discard("state_host", node)
        node.mamba_lock_ref += 1
        delta, x = 0, node
        while x is not self.root:
            if x.full_lock_ref == 0:
                n = len(x.key) if x.value is not None else 0
                self._full_evictable -= n
                self._full_protected += n
                delta -= n
                discard("kv", x)
                discard("kv_host", x)
                discard("swa", x)
            x.full_lock_ref += 1
            x = x.parent
        return delta

    def _unlock(self, node: TreeNode, prune: bool = True) -> int:
        if node is self.root:
            return 0
        node.mamba_lock_ref -= 1
        if node.mamba_lock_ref == 0 and node.mamba_value is not None:
            self._mamba_evictable += 1
            self._mamba_protected -= 1
        f = Frees()
        delta, x = 0, node
        while x is not self.root:
            x.full_lock_ref -= 1
            parent = x.parent
            if x.full_lock_ref == 0:
                n = len(x.key) if x.value is not None else 0
                self._full_evictable += n
                self._full_protected -= n
                delta += n
                if prune and not x.children and not x.tickets and not self._has_state(x):
                    # a locked tombstone (or dead node) that lost its children: gone with its last lock
                    self._remove(x, f)
                    delta -= n
                else:
                    self._sync(x)
            elif x is node:
                self._sync(x)
            x = parent
        f.flush(self)
        return delta

    # ----------------------------------------------------------------------------- requests
    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """A request finished: cache its tokens (``is_insert``), free the KV ids and the T0 state slot it
        still owns, release its lock (``requests.py``). Checks everything first: when it raises, the
        request still owns all it owned and the tree is unchanged."""
        _req.cache_finished_req(self, req, is_insert)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """A prefill chunk is done: cache what it wrote, point the request's prefix at the tree's ids,
        move its lock to the new end. The request keeps its T0 state slot (``requests.py``)."""
        _req.cache_unfinished_req(self, req, chunked)

    # ----------------------------------------------------------------------------- placement
    def checkpoint_positions(self, start: int, end: int) -> list[int]:
        """Where the engine may export a state while prefilling ``[start, end)`` (``placement.py``)."""
        return self.placement.positions(start, end)

    # ----------------------------------------------------------------------------- checks
    def check_invariants(self, request_kv: Optional[torch.Tensor] = None,
                         request_states: Optional[torch.Tensor] = None) -> None:
        """Recompute everything from the sets; ``request_*``: ids the engine's requests own (then every
        slot must be exactly free, cached, a request's or in flight). Raises AssertionError."""
        _inv.check_invariants(self, request_kv, request_states)


def _side_of(pool: Any, name: Any, arg: str) -> Any:
    """``pool.side(name)``, with a bad name reported under the tree's own argument name."""
    try:
        return pool.side(name)
    except InvalidTypeError as e:
        raise InvalidTypeError(arg, e.expected, name) from None
    except InvalidArgumentError as e:
        raise InvalidArgumentError(arg, e.expected, name) from None
