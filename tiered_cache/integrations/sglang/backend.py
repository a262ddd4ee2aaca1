"""``TieredRadixCache``: SGLang 0.5.23's ``BasePrefixCache`` over our radix tree.

It translates, it holds no policy (STYLE 6): SGLang's param objects become ours, our results become
SGLang's, and SGLang's ``Req`` is read where our flows read a ``CacheReq``. What differs between the
two interfaces, field by field, is in ``docs/sglang.md``; in short:

- ``match_prefix`` returns SGLang's ``MatchResult`` (``device_prefix_len``, ids through
  ``path_device_indices``), from SGLang's ``RadixKey`` (``array('q')`` or any int sequence, cut at
  ``limit``; ``extra_key`` and ``cache_salt`` together are the tree's salt);
- ``checkpoint(req, up_to=)`` inserts the request's row up to ``up_to``, repoints the row at the
  tree's ids, moves ``req.lock`` and ``req.last_node`` and advances ``req.kv.cache_protected_len``;
  like SGLang's own, it frees no KV the request still owns (``release_kv_cache`` does). The tree
  stores a T1 copy of the request's state, so the request's T0 state slot stays the request's until
  it finishes: the final checkpoint (``req.finished()``) frees it, and so does ``on_release`` of a
  request released without one (an abort), as SGLang's mamba component does;
- ``evict`` takes SGLang's three-field ``EvictParams``; locks return SGLang's receipts;
- ``init_load_back`` returns ``(tokens loaded, node)``.

The tree's T0 is the memory behind SGLang's pools (``t0.py``; ``factory`` builds the tree over it), so the
ids mean the same thing on both sides.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import torch
from sglang.srt.mem_cache import base_prefix_cache as B

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix import params as P
from tiered_cache.radix.node import TreeNode


def tree_key(key: Any) -> P.RadixKey:
    """SGLang's ``RadixKey`` (or a bare int sequence) as ours: tokens cut at ``limit``, salted by
    ``extra_key`` and ``cache_salt`` (``salted``)."""
    if not hasattr(key, "token_ids"):
        return P.RadixKey(key)
    if getattr(key, "is_bigram", False):
        raise InvalidArgumentError("key.is_bigram", "False (EAGLE bigram keys are not supported)", True)
    toks = key.token_ids
    limit = getattr(key, "limit", None)
    if limit is not None:
        toks = toks[:limit]
    return salted(toks, getattr(key, "extra_key", None), getattr(key, "cache_salt", None))


def salted(toks: Any, extra_key: Optional[str], cache_salt: Optional[str]) -> P.RadixKey:
    """The tree's salt is ``extra_key``, or ``[extra_key, cache_salt]`` as JSON when a cache salt is set:
    two requests share a prefix only when they agree on both."""
    return P.RadixKey(toks, extra_key if cache_salt is None else json.dumps([extra_key, cache_salt]))


class _ReqView:
    """The attributes our match and load back write on a request, on SGLang's ``Req``:
    ``mamba_pool_idx`` is ``req.kv.mamba_pool_idx``; ``load_back`` is kept beside it."""

    def __init__(self, req: Any) -> None:
        self._req = req

    @property
    def mamba_pool_idx(self) -> Any:
        return self._req.kv.mamba_pool_idx

    @mamba_pool_idx.setter
    def mamba_pool_idx(self, v: Any) -> None:
        self._req.kv.mamba_pool_idx = None if v is None else v.reshape(-1)[0]

    @property
    def load_back(self) -> Any:
        return getattr(self._req, "tiered_load_back", None)

    @load_back.setter
    def load_back(self, v: Any) -> None:
        self._req.tiered_load_back = v


class TieredRadixCache(B.BasePrefixCache):
    """SGLang's prefix cache, backed by ``tree`` (a ``HiMambaRadixCache``: T1, T2, T3 on top of T0).

    Args:
        tree: the radix cache (``TieredCache.tree``).
        req_to_token_pool, token_to_kv_pool_allocator: SGLang's pools (``CacheInitParams``); SGLang's
            helpers (``free_kv_row``, ``release_kv_cache``) read them from the cache.
        page_size: tokens per KV page; must be the tree's.
        disable: SGLang's ``--disable-radix-cache``.
        stack: the ``TieredCache`` that owns ``tree`` (``factory`` passes it; ``close()`` closes it).
        sliding_window_size, draft_swa_window: an SWA hybrid's (``tree`` a ``HiSWARadixCache``, the
            allocator SGLang's ``SWATokenToKVPoolAllocator``): SGLang reads them off the cache to know
            which SWA KV a running request may free; None for a model without SWA layers.
    """

    def __init__(self, tree: Any, *, req_to_token_pool: Any, token_to_kv_pool_allocator: Any,
                 page_size: int, disable: bool = False, stack: Any = None,
                 sliding_window_size: Optional[int] = None, draft_swa_window: int = 0) -> None:
        if not hasattr(tree, "match_prefix") or not hasattr(tree, "tree"):
            raise InvalidTypeError("tree", "a radix cache of tiered_cache.radix", type(tree).__name__)
        if page_size != tree.page_size:
            raise InvalidArgumentError("page_size", f"the tree's page size {tree.page_size}", page_size)
        if not isinstance(disable, bool):
            raise InvalidTypeError("disable", "a bool", disable)
        self.cache = tree
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.stack = stack
        self.sliding_window_size = sliding_window_size
        self.draft_swa_window = draft_swa_window
        # SGLang's full id -> SWA id of each token (0: its SWA KV freed), for an SWA hybrid
        self.swa_mapping: Optional[torch.Tensor] = (
            None if sliding_window_size is None else token_to_kv_pool_allocator.full_to_swa_index_mapping)

    def close(self) -> None:
        """Close the stack the factory built (T3's workers and backend); idempotent."""
        if self.stack is not None:
            self.stack.close()

    @property
    def root_node(self) -> Any:
        return self.cache.root

    # ----------------------------------------------------------------------------- abstract methods
    def reset(self) -> None:
        self.cache.reset()

    def match_prefix(self, params: B.MatchPrefixParams) -> B.MatchResult:
        root = self.cache.root
        if self.disable:
            return B.MatchResult(device_prefix_len=0, last_device_node=root, last_host_node=root,
                                 best_match_node=root)
        req = params.req
        cow = bool(params.cow_mamba) and req is not None
        r = self.cache.match_prefix(P.MatchPrefixParams(key=tree_key(params.key), cow_mamba=cow,
                                                        req=_ReqView(req) if req is not None else None))
        return B.MatchResult(
            device_prefix_len=int(r.device_indices.numel()),
            last_device_node=r.last_device_node,
            last_host_node=r.last_host_node,
            best_match_node=r.best_match_node,
            host_hit_length=r.host_hit_length,
            swa_host_hit_length=r.swa_host_hit_length,
            swa_branching_seqlen=r.swa_branching_seqlen,
            mamba_host_hit_length=r.mamba_host_hit_length,
            mamba_branching_seqlen=r.mamba_branching_seqlen,
            cache_protected_len=r.cache_protected_len,
            full_kv_hit_length=r.kv_hit_length,
            last_visited_node_id=None,  # not reported (the tree does not track rejected nodes)
            full_device_match_len=None,  # not reported (no shorter scan length)
        )

    def checkpoint(self, req: Any, *, up_to: int, **kwargs: Any) -> None:
        try:
            self._checkpoint(req, up_to)
            if req.finished() and not self.disable:  # a policy that learns from the requests (Marconi's alpha)
                t = self.cache.tree
                t.policy.observe(req.full_untruncated_fill_ids[:up_to], t.full_evictable + t.full_protected)
        finally:
            if req.finished():  # the tree holds its own copy: the request's state slot goes back
                self._free_state(req)

    def on_release(self, req: Any, *, checkpointed: bool) -> None:
        if not checkpointed:
            self._free_state(req)

    def _free_state(self, req: Any) -> None:
        slot = req.kv.mamba_pool_idx
        if slot is not None:
            self.cache.free_request_state(slot.reshape(1))  # with any failed load's mark on it
            req.kv.mamba_pool_idx = None

    def _checkpoint(self, req: Any, up_to: Any) -> None:
        if self.disable:
            return
        if isinstance(up_to, bool) or not isinstance(up_to, int) or up_to < 0:
            raise InvalidArgumentError("up_to", "a row position >= 0", up_to)
        kv = req.kv
        toks = req.full_untruncated_fill_ids[:up_to]
        if len(toks) < up_to:
            raise InvalidArgumentError("up_to", f"at most the request's {len(toks)} fill ids", up_to)
        prev = int(kv.cache_protected_len)
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx, :up_to].to(torch.int64)
        slot = kv.mamba_pool_idx
        swa: dict[str, Any] = {} if self.swa_mapping is None else self._swa_insert(row, prev)
        stale = swa.pop("stale", None)
        hint = getattr(req, "last_node", None)  # its match's or last checkpoint's node: the walk may start there
        res = self.cache.insert(P.InsertParams(
            key=salted(toks, req.extra_key, getattr(req, "cache_salt", None)),
            value=row, mamba_value=None if slot is None else slot.reshape(1),
            prev_prefix_len=prev, priority=int(req.priority or 0),
            last_node=hint if type(hint) is TreeNode else None, **swa))
        kv.cache_inserted_len = max(int(getattr(kv, "cache_inserted_len", 0)), res.cached_len)
        if res.cached_len <= prev:
            return
        node = res.last_device_node
        ids = self.cache.tree.path_values(node)
        if self.swa_mapping is not None:
            if stale is not None and bool((stale < res.cached_len).any()):  # now the tree's, as tombstones
                self.token_to_kv_pool_allocator.free_swa(row[stale[stale < res.cached_len]])
            self._swa_remap(node, row[prev:ids.numel()], ids[prev:])
        self.req_to_token_pool.write((kv.req_pool_idx, slice(prev, ids.numel())),
                                     ids[prev:].to(self.req_to_token_pool.req_to_token.dtype))
        old = req.lock
        req.lock = self.lock(node)
        self.unlock(old)
        req.last_node = node
        kv.cache_protected_len = int(ids.numel())

    def _swa_insert(self, row: torch.Tensor, prev: int) -> dict[str, Any]:
        """The SWA fields of an SWA hybrid's insert, read off SGLang's mapping: ``swa_value`` (each token's
        SWA id) and ``swa_evicted_seqlen`` (where the request's trailing run of live SWA pages starts).
        The tree takes one cut (SWA KV gone before it, present after): a live page of the request's below
        a page SGLang freed (its prefill's shield, ``swa_evict_floor``) lies outside every window the
        tree keeps; ``stale`` names its tokens, and the caller frees their SWA KV through SGLang once the
        insert has cached them (as tombstones, or as duplicates it freed: the SWA half stays otherwise);
        a stale page the insert did not reach stays the request's, for SGLang's ``release_kv_cache``."""
        ps, m = self.page_size, self.swa_mapping
        assert m is not None
        swa = m[row]
        n = row.numel() // ps * ps
        self.cache.swa.pair(row[prev:n], swa[prev:n])  # the pages the insert may take or free as duplicates
        live = swa[prev:n:ps] > 0
        dead = torch.nonzero(~live).reshape(-1)
        cut = prev if dead.numel() == 0 else prev + (int(dead[-1]) + 1) * ps
        pages = torch.nonzero(live[:(cut - prev) // ps]).reshape(-1)
        stale = (prev + pages[:, None] * ps + torch.arange(ps, device=pages.device)[None, :]).reshape(-1)
        return {"swa_value": swa, "swa_evicted_seqlen": cut, "stale": stale if stale.numel() else None}

    def _swa_remap(self, node: Any, old: torch.Tensor, new: torch.Tensor) -> None:
        """After an insert, SGLang's mapping says what the tree holds: each cached full id maps to its
        node's SWA id (0 under a tombstone; a tombstone that took the request's SWA KV keeps its own full
        ids), and the request's full ids the tree freed as duplicates map to nothing."""
        m, x = self.swa_mapping, node
        assert m is not None
        m[old[old != new]] = 0
        full, swa = [], []  # the path's ids, gathered: one indexed write, not one per node
        while x is not self.cache.root:
            s = x.payload.swa_value
            full.append(x.value)
            swa.append(torch.zeros_like(x.value) if s is None else s)
            x = x.parent
        if full:
            f, s = torch.cat(full), torch.cat(swa).to(m.dtype)
            m[f] = s
            self.cache.swa.pair(f, s)

    def evict(self, params: B.EvictParams) -> B.EvictResult:
        # SGLang's mamba_num asks for free slots of its mamba pool; the tree holds none there (its states
        # are T1's, copied in and out), so evicting T1 states would free none: it is not passed on.
        r = self.cache.evict(P.EvictParams(num_tokens=params.num_tokens, swa_num_tokens=params.swa_num_tokens,
                                           mamba_num=0))
        return B.EvictResult(num_tokens_evicted=r.num_tokens_evicted,
                             swa_num_tokens_evicted=r.swa_num_tokens_evicted,
                             mamba_num_evicted=r.mamba_num_evicted)

    def inc_lock_ref(self, node: Any) -> B.IncLockRefResult:
        r = self.cache.inc_lock_ref(node)
        return B.IncLockRefResult(delta=r.delta, node_id=r.node_id)

    def dec_lock_ref(self, node: Any, params: Optional[B.DecLockRefParams] = None) -> B.DecLockRefResult:
        if params is not None and params.node_id is not None and params.node_id != node.id:
            raise InvalidArgumentError("params.node_id", f"the id of the node released ({node.id})", params.node_id)
        return B.DecLockRefResult(delta=self.cache.dec_lock_ref(node).delta)

    # ----------------------------------------------------------------------------- helpers SGLang calls
    def path_device_indices(self, node: Any) -> torch.Tensor:
        return self.cache.tree.path_values(node)

    def init_load_back(self, params: B.InitLoadBackParams) -> Optional[tuple[int, Any]]:
        """Load the host part of a match into SGLang's pools; ``(tokens loaded, node)``.

        SGLang runs the forward over what this reports as soon as it returns, and has no way to hear of
        a load that fails later. So the load is waited for here (its bytes landed, their checksums
        compared: without it the forward could read pages still in flight), and a load whose host copy
        failed its checksum (the tree drops that copy) reports nothing loaded, which SGLang's
        all-or-none rule accepts: the request keeps its device prefix (``req.last_node``) and computes
        the rest, its state slot holding that prefix's state again (or given back, when the load had
        taken it)."""
        req = params.req
        view = _ReqView(req) if req is not None else None  # None: the tree refuses a load that needs one
        had_slot = req is not None and req.kv.mamba_pool_idx is not None
        before = view.load_back if view is not None else None
        ids, node = self.cache.init_load_back(P.InitLoadBackParams(
            best_match_node=params.best_match_node, host_hit_length=params.host_hit_length,
            mem_quota=params.mem_quota, req=view))
        lb = view.load_back if view is not None else None
        if lb is None or lb is before:  # nothing started
            return int(ids.numel()), node
        if not lb.done:
            self.cache.host_tier.settle("load")
        if lb.ok:
            if self.swa_mapping is not None:  # the loaded full pages to the SWA pages loaded beside them
                self._swa_remap(node, self.cache.tree.empty, self.cache.tree.empty)
            return int(ids.numel()), node
        dev = req.last_node  # SGLang's last device node, locked by its admission: its T1 state stays
        if had_slot and dev is not self.cache.root and dev.payload.mamba_value is not None:
            self.cache.ckpt.load_to_active(dev.payload.mamba_value, self.cache.states, req.kv.mamba_pool_idx.reshape(1))
        else:  # the load took the slot (or the prefix is empty): SGLang allocates a fresh one
            self._free_state(req)
        return 0, dev

    def check_hicache_events(self) -> None:
        self.cache.check_hicache_events()

    def supports_mamba(self) -> bool:
        return bool(self.cache.supports_mamba())

    def supports_swa(self) -> bool:
        return self.swa_mapping is not None

    def swa_evictable_size(self) -> int:
        return self.cache.swa_evictable_size() if self.swa_mapping is not None else 0

    def swa_protected_size(self) -> int:
        """SWA KV tokens the tree holds on the device under a lock (SGLang's leak check: free + evictable +
        protected + the requests' own = the SWA pool). One walk of the tree: SGLang asks only there."""
        if self.swa_mapping is None:
            return 0
        held, todo = 0, list(self.cache.root.children.values())
        while todo:
            x = todo.pop()
            todo.extend(x.children.values())
            held += len(x.key) if x.payload.swa_value is not None else 0
        return held - self.cache.swa_evictable_size()

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def evictable_size(self) -> int:
        return self.cache.full_evictable_size()

    def full_evictable_size(self) -> int:
        return self.cache.full_evictable_size()

    def protected_size(self) -> int:
        return self.cache.full_protected_size()

    def full_protected_size(self) -> int:
        return self.cache.full_protected_size()

    def mamba_evictable_size(self) -> int:
        return self.cache.mamba_evictable_size()

    def mamba_protected_size(self) -> int:
        return self.cache.mamba_protected_size()

    def total_size(self) -> Any:
        return self.cache.total_size()

    def check_invariants(self) -> None:
        self.cache.check_invariants()
