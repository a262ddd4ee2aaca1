"""``HiMambaRadixCache``: the radix prefix cache of a hybrid model over T0 (KV pages) and T1 (states).

A radix tree over token ids in pages of ``page_size``. Each node owns the T0 virtual KV ids of its
span and, optionally, the T1 checkpoint slot of the recurrent state at its end; a node without a
state is a *tombstone*: its KV can be reused only by a longer match that ends at a state::

    root ── [1 2 3]* ── [4 5] ── [6 7]*        * = state in T1
       │                   └──── [60 70]*      [4 5] is a tombstone: a match of [1..5] is cut back
       └── [10 11 12]*                          to [1 2 3], the deepest node with a state

Ownership (SGLang's ``MambaRadixCache`` contract, with one difference):

- The engine owns a request's KV ids and its T0 state slot. ``insert`` frees the caller's duplicate
  KV ids ``value[prev_prefix_len:prefix_len]`` and takes ``value[prefix_len:cached_len]``.
- The tree never takes the caller's T0 slot (SGLang donates it): it quantizes a copy into a T1 slot
  it owns (``Int8CheckpointPool.store_from_active``). The caller keeps its slot; ``mamba_exist`` says
  the node already had a state. ``cache_finished_req`` frees the finished request's T0 slot.
- A ``cow_mamba`` match dequantizes the node's T1 state into the request's T0 slot, allocating one
  (``req.mamba_pool_idx``) when it has none, evicting KV for room; with no room the match is a miss.

Locks: ``inc_lock_ref(node)`` adds one to ``full_lock_ref`` of every node from ``node`` to the root
and one to ``node.mamba_lock_ref``, which protects the node's state. A tombstone may be locked (the
engine locks where its prefix ends); a locked tombstone may become a leaf when its children go, and
is removed when its last lock is released. Otherwise no leaf is a tombstone.

Recency: an insert or a match refreshes the KV recency of every node on its path (both halves of a
node it splits included); a state's recency is refreshed when it is stored, offered again
(``mamba_exist``) or matched. Eviction asks the policy (``LRUPolicy`` by default) for victims:
KV eviction takes unlocked leaves; state eviction tombstones internal nodes and removes leaves,
then any parents left as childless unlocked tombstones.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix import invariants as _inv
from tiered_cache.radix import requests as _req
from tiered_cache.radix.checks import (
    check_callers_kv,
    check_node,
    check_state_allocated,
    common_len,
    desc,
    parse_key,
    state_slot,
)
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import (
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
)
from tiered_cache.radix.placement import CheckpointPlacement
from tiered_cache.radix.policy import EvictionPolicy, LRUPolicy


class HiMambaRadixCache:
    """Radix prefix cache over a ``UnifiedPool`` (T0) and an ``Int8CheckpointPool`` (T1).

    Args:
        pool: T0; ``pool.side(kv_side)`` holds KV pages, ``pool.side(state_side)`` active states.
        ckpt_pool: T1; the tree's cached states.
        checkpoint_unit: tokens between exported checkpoints (a multiple of ``page_size``; default one
            page); ``mamba_branching_seqlen`` is aligned to it.
        placement: the mid-prefill checkpoint rule (default: unit, hash block = page, block = unit,
            alignment = unit).
        policy: an ``EvictionPolicy`` (default ``LRUPolicy``).
        validate: check that inserted ids are the caller's (one device sync per insert).
    """

    def __init__(self, pool: Any, ckpt_pool: Any, *, kv_side: str = "full", state_side: str = "mamba",
                 checkpoint_unit: Optional[int] = None, placement: Optional[CheckpointPlacement] = None,
                 policy: Optional[EvictionPolicy] = None, validate: bool = True) -> None:
        self.pool = pool
        self.kv = pool.side(kv_side)
        self.states = pool.side(state_side)
        self.ckpt = ckpt_pool
        if self.states.device != self.kv.device or ckpt_pool.device != self.kv.device:
            raise InvalidArgumentError("ckpt_pool", f"a pool on {self.kv.device}", ckpt_pool.device)
        self.page_size = ps = self.kv.page_size
        self.device = self.kv.device
        unit = ps if checkpoint_unit is None else checkpoint_unit
        if not isinstance(unit, int) or isinstance(unit, bool) or unit < ps or unit % ps:
            raise InvalidArgumentError("checkpoint_unit", f"a positive multiple of page_size={ps}", unit)
        self.checkpoint_unit = unit
        self.placement = placement or CheckpointPlacement(unit, ps, unit, unit)
        if policy is not None and not isinstance(policy, EvictionPolicy):
            raise InvalidArgumentError("policy", "an EvictionPolicy", type(policy).__name__)
        self.policy = policy or LRUPolicy()
        self.validate = bool(validate)
        self._empty = torch.empty(0, dtype=torch.int64, device=self.device)
        # Page-level "the tree owns this KV page": refuses inserts of ids the tree already holds.
        self._owned = torch.zeros(self.kv.capacity, dtype=torch.bool, device=self.device)
        self._offsets = torch.arange(ps, dtype=torch.int64, device=self.device)
        self.root: Optional[TreeNode] = None
        self.reset()

    # ----------------------------------------------------------------------------- lifecycle
    @property
    def root_node(self) -> TreeNode:
        return self.root

    def reset(self) -> None:
        """Drop the tree and give every KV page and T1 slot it owns back to its pool.

        Meant for an idle engine: nodes held by requests become stale (a later call with one raises).
        """
        if self.root is not None:
            kvs, t1s = [], []
            stack = list(self.root.children.values())
            while stack:
                x = stack.pop()
                stack.extend(x.children.values())
                kvs.append(x.value)
                if x.mamba_value is not None:
                    t1s.append(x.mamba_value)
                x.alive = False
            self._free_batch(kvs, t1s)
        self._token = object()  # new owner tag: nodes of the old tree are refused from now on
        self.root = TreeNode(self._token, None, [], self._empty)
        self.policy.clear()
        self._owned.zero_()
        self._full_evictable = self._full_protected = 0
        self._mamba_evictable = self._mamba_protected = 0

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
        """(cached KV tokens, cached states)."""
        return (self._full_evictable + self._full_protected, self._mamba_evictable + self._mamba_protected)

    def supports_mamba(self) -> bool:
        return True

    # ----------------------------------------------------------------------------- match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key`` that ends at a state (see the module docstring)."""
        toks, salt = parse_key(params.key)
        req = params.req
        if params.cow_mamba and (req is None or not hasattr(req, "mamba_pool_idx")):
            raise InvalidArgumentError("req", "a request with .mamba_pool_idx when cow_mamba is set", req)
        dst = None if req is None or not params.cow_mamba else req.mamba_pool_idx
        if dst is not None:
            dst = state_slot(self, "req.mamba_pool_idx", dst)
        path, values, full_len, partial, best, best_len, best_k = self._walk(toks, salt, len(toks))
        touch = self.policy.touch
        for x in path:
            touch("kv", x)
        kv_len = full_len + partial
        branching = None
        if kv_len > best_len:
            b = kv_len // self.checkpoint_unit * self.checkpoint_unit
            branching = b if b > best_len else None
        if best is self.root:
            return self._result(self._empty, self.root, branching, kv_len)
        touch("state", best)
        best.hit_count += 1
        if params.cow_mamba:
            if dst is None:
                dst = self._alloc_active_state(best)
                if dst is None:  # no room for the request's state even after evicting KV: unusable hit
                    return self._result(self._empty, self.root, branching, kv_len)
                req.mamba_pool_idx = dst
            self.ckpt.load_to_active(best.mamba_value, self.states, dst)
        idx = values[0] if best_k == 1 else torch.cat(values[:best_k])
        return self._result(idx, best, branching, kv_len)

    def _result(self, idx: torch.Tensor, node: TreeNode, branching: Optional[int], kv_len: int) -> MatchResult:
        return MatchResult(device_indices=idx, last_device_node=node, last_host_node=node, best_match_node=node,
                           mamba_branching_seqlen=branching, cache_protected_len=len(idx), kv_hit_length=kv_len)

    def _walk(self, toks: list[int], salt: Optional[str], end: int):
        """Read-only walk. -> (nodes on the path, values of fully matched nodes, tokens in them,
        page-aligned tokens matched inside the next node, deepest state node, its depth, its #values)."""
        ps = self.page_size
        end = end // ps * ps
        node = self.root
        path: list[TreeNode] = []
        values: list[torch.Tensor] = []
        i = partial = 0
        best, best_len, best_k = self.root, 0, 0
        children = node.children
        while i < end:
            ck = toks[i] if ps == 1 else tuple(toks[i:i + ps])
            child = children.get(ck if node is not self.root or salt is None else (salt, ck))
            if child is None:
                break
            m = common_len(child.key, toks, i, end, ps)
            path.append(child)
            if m < len(child.key):
                partial = m
                break
            values.append(child.value)
            i += m
            node, children = child, child.children
            if child.mamba_value is not None:
                best, best_len, best_k = child, i, len(values)
        return path, values, i, partial, best, best_len, best_k

    # ----------------------------------------------------------------------------- insert
    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``key`` -> ``value`` with the state ``mamba_value`` at its end (see module docstring).

        Only whole pages are cached; a state is stored only when ``len(key)`` is page-aligned (it is
        valid at that position alone). New KV is taken only together with a state (a leaf is never a
        tombstone). With no T1 room even after evicting states, nothing is cached:
        ``prefix_len == cached_len == prev_prefix_len`` and the caller keeps ``value[prev_prefix_len:]``.
        """
        toks, salt = parse_key(params.key)
        n, ps = len(toks), self.page_size
        value = params.value
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype != torch.int64:
            raise InvalidArgumentError("value", "a 1-D int64 tensor of KV ids", desc(value))
        if value.device != self.device:
            raise InvalidArgumentError("value", f"a tensor on {self.device}", value.device)
        if value.numel() != n:
            raise InvalidArgumentError("value", f"{n} ids, one per token of key", value.numel())
        prev = params.prev_prefix_len
        if not isinstance(prev, int) or isinstance(prev, bool) or not 0 <= prev <= n or prev % ps:
            raise InvalidArgumentError("prev_prefix_len", f"a multiple of page_size={ps} in [0, {n}]", prev)
        slot = None if params.mamba_value is None else state_slot(self, "mamba_value", params.mamba_value)
        aligned = n // ps * ps
        if aligned == 0:
            return InsertResult(prefix_len=0, cached_len=0, last_device_node=self.root)
        path, _, full_len, partial, _, _, _ = self._walk(toks, salt, aligned)
        prefix = full_len + partial
        if prev > prefix:
            raise InvalidArgumentError("prev_prefix_len", f"<= the cached prefix length ({prefix})", prev)
        if self.validate and prev < aligned:
            check_callers_kv(self, value[prev:aligned])
        if self.validate and slot is not None:
            check_state_allocated(self, slot)
        end_node = path[-1] if path and partial == 0 and full_len == aligned else None
        mamba_exist = aligned == n and end_node is not None and end_node.mamba_value is not None
        t1 = None
        if slot is not None and aligned == n and not mamba_exist:
            t1 = self.ckpt.alloc(1)
            if t1 is None:
                t1 = self._alloc_ckpt_protected(path[-1] if path else None)
                if t1 is None:
                    return InsertResult(prefix_len=prev, cached_len=prev, last_device_node=None)
            try:
                self.ckpt.store_from_active(self.states, slot, t1)
            except BaseException:
                self.ckpt.free(t1)
                raise
        return self._insert_walk(toks, salt, value, aligned, prev, t1, mamba_exist, slot is not None)

    def _insert_walk(self, toks, salt, value, aligned, prev, t1, mamba_exist, offered) -> InsertResult:
        ps, root, touch = self.page_size, self.root, self.policy.touch
        node, i = root, 0
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
            lo = max(prev, i)
            if lo < i + m:
                dups.append(value[lo:i + m])
            i += m
            node = child
        prefix, stored = i, False
        if i < aligned:
            if t1 is not None:
                node = self._new_leaf(node, toks[i:aligned], value[i:aligned], t1, salt)
                stored, i = True, aligned
        elif node is not root:
            if node.mamba_value is None and t1 is not None:
                self._set_state(node, t1)
                stored = True
            elif mamba_exist and offered:
                touch("state", node)
        if dups:
            self.kv.free(dups[0] if len(dups) == 1 else torch.cat(dups))
        if split_suffix is not None and not split_suffix.children and split_suffix.mamba_value is None:
            self._prune_up(split_suffix)  # states evicted for room took its children
        return InsertResult(prefix_len=prefix, cached_len=i, mamba_exist=mamba_exist, mamba_stored=stored,
                            last_device_node=node)

    def _new_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor, t1: torch.Tensor,
                  salt: Optional[str]) -> TreeNode:
        ps = self.page_size
        leaf = TreeNode(self._token, parent, key, value.clone())
        ck = key[0] if ps == 1 else tuple(key[:ps])
        leaf.ck = (salt, ck) if parent is self.root and salt is not None else ck
        if not parent.children and parent is not self.root:
            self.policy.discard("kv", parent)
        parent.children[leaf.ck] = leaf
        self._owned[leaf.value[::ps] // ps] = True
        self._full_evictable += len(key)
        self.policy.touch("kv", leaf)
        self.policy.add("kv", leaf)
        self._set_state(leaf, t1)
        return leaf

    def _set_state(self, node: TreeNode, t1: torch.Tensor) -> None:
        node.mamba_value = t1
        self.policy.touch("state", node)
        if not node.children and not node.full_lock_ref:  # a tombstone whose children went while we held it
            self.policy.add("kv", node)
        if node.mamba_lock_ref:  # a locked tombstone got its state: protected at once
            self._mamba_protected += 1
        else:
            self._mamba_evictable += 1
            self.policy.add("state", node)

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """child -> new (key[:m], a tombstone) -> child (key[m:]); returns new. Sizes do not change."""
        ps, parent = self.page_size, child.parent
        new = TreeNode(self._token, parent, child.key[:m], child.value[:m].clone())
        new.ck = child.ck
        new.full_lock_ref = child.full_lock_ref  # every lock below child is below new too
        child.key = child.key[m:]
        child.value = child.value[m:].clone()
        child.ck = child.key[0] if ps == 1 else tuple(child.key[:ps])
        child.parent = new
        new.children[child.ck] = child
        parent.children[new.ck] = new
        self.policy.touch("kv", child)
        return new

    # ----------------------------------------------------------------------------- evict
    def evict(self, params: EvictParams) -> EvictResult:
        """Free at least ``num_tokens`` KV tokens and ``mamba_num`` states, LRU first, while unlocked
        ones remain. ``num_tokens_evicted`` counts every KV token freed (state eviction removes leaves)."""
        for arg in ("num_tokens", "swa_num_tokens", "mamba_num"):
            v = getattr(params, arg)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidArgumentError(arg, "an int >= 0", v)
        tok, st = self._evict_kv(params.num_tokens) if params.num_tokens else (0, 0)
        if params.mamba_num:
            t2, s2 = self._evict_states(params.mamba_num)
            tok, st = tok + t2, st + s2
        return EvictResult(num_tokens_evicted=tok, mamba_num_evicted=st)

    def _evict_kv(self, num: int) -> tuple[int, int]:
        kvs, t1s = [], []
        tok = st = 0
        while tok < num:
            x = self.policy.pop("kv")
            if x is None:
                break
            tok += len(x.key)
            st += x.mamba_value is not None
            p = x.parent
            self._remove(x, kvs, t1s)
            tok += self._after_child_removed(p, kvs, t1s)
        self._free_batch(kvs, t1s)
        return tok, st

    def _evict_states(self, num: int) -> tuple[int, int]:
        kvs, t1s = [], []
        tok = st = 0
        while st < num:
            x = self.policy.pop("state")
            if x is None:
                break
            st += 1
            if x.children:  # internal: becomes a tombstone, its KV stays
                t1s.append(x.mamba_value)
                x.mamba_value = None
                self._mamba_evictable -= 1
            else:
                tok += len(x.key)
                p = x.parent
                self._remove(x, kvs, t1s)
                tok += self._after_child_removed(p, kvs, t1s)
        self._free_batch(kvs, t1s)
        return tok, st

    def _remove(self, x: TreeNode, kvs: list, t1s: list) -> None:
        """Unlink an unlocked childless node; its ids go to the caller's free lists."""
        del x.parent.children[x.ck]
        self.policy.forget(x)
        self._full_evictable -= len(x.key)
        kvs.append(x.value)
        if x.mamba_value is not None:
            t1s.append(x.mamba_value)
            self._mamba_evictable -= 1
        x.alive = False

    def _after_child_removed(self, p: TreeNode, kvs: list, t1s: list) -> int:
        """``p`` lost a child: drop it (and up) while a childless unlocked tombstone, else maybe a candidate."""
        tok = 0
        while p is not self.root and not p.children and p.full_lock_ref == 0:
            if p.mamba_value is not None:
                self.policy.add("kv", p)
                break
            q = p.parent
            tok += len(p.key)
            self._remove(p, kvs, t1s)
            p = q
        return tok

    def _prune_up(self, x: TreeNode) -> None:
        kvs, t1s = [], []
        if not x.children and x.full_lock_ref == 0 and x.mamba_value is None and x is not self.root:
            p = x.parent
            self._remove(x, kvs, t1s)
            self._after_child_removed(p, kvs, t1s)
        elif not x.children and x.full_lock_ref == 0 and x is not self.root:
            self.policy.add("kv", x)
        self._free_batch(kvs, t1s)

    def _free_batch(self, kvs: Sequence[torch.Tensor], t1s: Sequence[torch.Tensor]) -> None:
        if kvs:
            ids = kvs[0] if len(kvs) == 1 else torch.cat(kvs)
            if ids.numel():
                self._owned[ids[::self.page_size] // self.page_size] = False
                self.kv.free(ids)
        if t1s:
            self.ckpt.free(t1s[0] if len(t1s) == 1 else torch.cat(t1s))

    def _alloc_ckpt_protected(self, protect: Optional[TreeNode]) -> Optional[torch.Tensor]:
        """A T1 slot, evicting states; ``protect``'s path survives (unlocked without pruning: the
        insert that follows gives its end a state or a child, or prunes it)."""
        if protect is not None:
            self._lock(protect)
        try:
            t1 = None
            while t1 is None and self._evict_states(1)[1]:
                t1 = self.ckpt.alloc(1)
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

    # ----------------------------------------------------------------------------- locks
    def inc_lock_ref(self, node: TreeNode) -> IncLockRefResult:
        check_node(self, node)
        return IncLockRefResult(delta=self._lock(node), node_id=node.id)

    def dec_lock_ref(self, node: TreeNode, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        check_node(self, node)
        if node is not self.root and node.mamba_lock_ref <= 0:
            raise InvalidArgumentError("node", "a node locked by inc_lock_ref", node)
        return DecLockRefResult(delta=self._unlock(node))

    def _lock(self, node: TreeNode) -> int:
        if node is self.root:
            return 0
        if node.mamba_lock_ref == 0 and node.mamba_value is not None:
            self._mamba_evictable -= 1
            self._mamba_protected += 1
            self.policy.discard("state", node)
        node.mamba_lock_ref += 1
        delta, x, discard = 0, node, self.policy.discard
        while x is not self.root:
            if x.full_lock_ref == 0:
                n = len(x.key)
                self._full_evictable -= n
                self._full_protected += n
                delta -= n
                discard("kv", x)
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
            self.policy.add("state", node)
        kvs, t1s = [], []
        delta, x = 0, node
        while x is not self.root:
            x.full_lock_ref -= 1
            parent = x.parent
            if x.full_lock_ref == 0:
                n = len(x.key)
                self._full_evictable += n
                self._full_protected -= n
                delta += n
                if not x.children:
                    if x.mamba_value is not None:
                        self.policy.add("kv", x)
                    elif prune:  # a locked tombstone that lost its children: gone with its last lock
                        self._remove(x, kvs, t1s)
                        delta -= n
            x = parent
        self._free_batch(kvs, t1s)
        return delta

    # ----------------------------------------------------------------------------- requests
    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """A request finished: cache its tokens (``is_insert``), free the KV ids and the T0 state slot it
        still owns, release its lock (``requests.py``)."""
        _req.cache_finished_req(self, req, is_insert)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """A prefill chunk is done: cache what it wrote, point the request's prefix at the tree's ids,
        move its lock to the new end. The request keeps its T0 state slot (``requests.py``)."""
        _req.cache_unfinished_req(self, req, chunked)

    # ----------------------------------------------------------------------------- host tier (issue 6)
    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        """Nothing lives on the host yet: nothing to load."""
        return self._empty, params.best_match_node

    def check_hicache_events(self) -> None:
        """No transfers exist yet."""

    # ----------------------------------------------------------------------------- placement
    def checkpoint_positions(self, start: int, end: int) -> list[int]:
        """Where the engine may export a state while prefilling ``[start, end)`` (``placement.py``)."""
        return self.placement.positions(start, end)

    # ----------------------------------------------------------------------------- checks
    def check_invariants(self, request_kv: Optional[torch.Tensor] = None,
                         request_states: Optional[torch.Tensor] = None) -> None:
        """Recompute everything from the sets; ``request_*``: ids the engine's requests own (then every
        slot must be exactly free, cached or a request's). Raises AssertionError."""
        _inv.check_invariants(self, request_kv, request_states)
