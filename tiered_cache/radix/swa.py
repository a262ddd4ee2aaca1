"""``HiSWARadixCache``: the radix prefix cache of a sliding-window hybrid (full + SWA attention).

The same tree, tiers and API as ``HiMambaRadixCache``, over a T0 pool of full KV + SWA KV
(``UnifiedPool(KVSpec, KVSpec(window=W))``) and T2. What a hybrid needs to resume at a position is
the SWA KV of the ``W`` tokens before it, so "the state" of a node is its span's SWA KV, and a node
whose SWA KV was freed is an *SWA tombstone* (``swa_tomb``)::

    tokens:   0 ........ p-W ......... p
    node:     [ tomb ][ SWA ][ SWA  ]      a match may end at p only if the SWA KV of
                      |<--- W ---->|       [max(0, p-W), p) is present (device, or host to load)

- A node's SWA KV lives where its full KV lives: on the device with it (``swa_value``), on the host
  with it (``swa_host``), or nowhere (tombstone). Backups, demotion and load back move both.
- ``evict(swa_num_tokens=n)`` frees SWA KV, LRU first: an internal node becomes an SWA tombstone
  (its full KV stays, usable by longer matches), a leaf goes whole (a leaf is never a tombstone).
- ``insert`` takes the caller's SWA ids (``InsertParams.swa_value``) as it takes full ids; SWA KV
  before ``swa_evicted_seqlen`` was freed by the caller as it slid out of the window: the span it
  covers is cached as tombstones.
- Locks: a locked path keeps its SWA KV (coarser than SGLang, which protects only the window).
- Matches end at node boundaries (SGLang splits nodes inside a match; here a match never writes).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix.cache import HiMambaRadixCache
from tiered_cache.radix.checks import check_node, check_prev_prefix_len, common_len, parse_key
from tiered_cache.radix.evict import Frees
from tiered_cache.radix.host import Stream
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import (
    HostTierConfig,
    InitLoadBackParams,
    InsertParams,
    InsertResult,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
)
from tiered_cache.radix.policy import EvictionPolicy
from tiered_cache.validate import int_arg


class HiSWARadixCache(HiMambaRadixCache):
    """Radix prefix cache over a ``UnifiedPool`` of full + SWA KV (T0) and a ``HostMirror`` (T2).

    Args:
        pool: T0; ``pool.side(kv_side)`` full KV pages, ``pool.side(swa_side)`` SWA KV pages (same
            ``page_size``).
        window: tokens of SWA KV needed before a position (default: the SWA side's ``KVSpec.window``).
        host, transfer, host_config: as in ``HiMambaRadixCache``; the host needs a KV region of full
            page envelopes and one of SWA page envelopes (``host_config.kv_region`` / ``swa_region``).
    """

    mode = "swa"

    def __init__(self, pool: Any, *, window: Optional[int] = None, kv_side: str = "full", swa_side: str = "swa",
                 policy: Optional[EvictionPolicy] = None, validate: bool = True, host: Any = None,
                 transfer: Any = None, host_config: Optional[HostTierConfig] = None) -> None:
        self._setup(pool, kv_side, policy, validate)
        self.swa = pool.side(swa_side)
        if not self.swa.is_kv or self.swa.page_size != self.page_size:
            raise InvalidArgumentError("swa_side", f"a KV side with page_size={self.page_size}", swa_side)
        w = self.swa.spec.window if window is None else window
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise InvalidArgumentError("window", "an int >= 1 (or a SWA KVSpec with window set)", w)
        self.window = w
        self.ckpt = self.states = None
        self.checkpoint_unit = self.page_size
        self._sink = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._init_host(host, transfer, host_config)
        if host is not None:
            self.swa_region = self._region(self.hconf.swa_region, self.swa.entry_bytes)
            self._streams.append(Stream("swa", "swa_value", "swa_pending", "swa_host", "swa_host_pending",
                                        self.swa, self.swa_region))
        self.reset()

    def supports_mamba(self) -> bool:
        return False

    def _has_state(self, x: TreeNode) -> bool:
        return not x.swa_tomb

    def swa_evictable_size(self) -> int:
        return sum(len(x.key) for x in self.policy.candidates("swa"))

    # ----------------------------------------------------------------------------- match
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key`` whose window's SWA KV is present (see module docstring)."""
        if not isinstance(params, MatchPrefixParams):
            raise InvalidTypeError("params", "a MatchPrefixParams", type(params).__name__)
        toks, salt = parse_key(params.key)
        ps, w, root = self.page_size, self.window, self.root
        end = len(toks) // ps * ps
        node, children = root, root.children
        path, values, swas = [], [], []
        i = run_any = run_dev = 0
        on_dev = True
        dev, dev_len, dev_k, best, best_len = root, 0, 0, root, 0
        while i < end:
            ck = toks[i] if ps == 1 else tuple(toks[i:i + ps])
            child = children.get(ck if node is not root or salt is None else (salt, ck))
            if child is None or (child.value is None and child.host_kv is None):
                break
            m = common_len(child.key, toks, i, end, ps)
            path.append(child)
            if m < len(child.key):
                i += m
                break
            i += m
            node, children = child, child.children
            run_any = 0 if child.swa_tomb else run_any + m
            run_dev = run_dev + m if child.swa_value is not None else 0
            if child.value is None:
                on_dev = False
            elif on_dev:
                values.append(child.value)
                swas.append(child.swa_value)
            if run_any >= min(w, i):
                best, best_len = child, i
                if on_dev and run_dev >= min(w, i):
                    dev, dev_len, dev_k = child, i, len(values)
        for x in path:
            self.policy.touch("kv", x)
        if best is root:
            return self._result(self._empty, root, root, 0, 0, None, i, swa_device_indices=self._empty)
        best.hit_count += 1
        if self.host is not None and self.hconf.write_policy == "write_through_selective":
            self._count_hits(path, best)
        idx = self._empty if dev_k == 0 else torch.cat(values[:dev_k])
        swa_idx = self._empty if dev_k == 0 else torch.cat([
            s if s is not None else self._sink_ids(len(v)) for s, v in zip(swas[:dev_k], values[:dev_k])])
        swa_host = 0
        x = best
        while x is not dev:
            if x.value is None and x.swa_host is not None:
                swa_host += len(x.key)
            x = x.parent
        return self._result(idx, dev, best, best_len - dev_len, 0, None, i, swa_host_hit_length=swa_host,
                            swa_device_indices=swa_idx)

    def _sink_ids(self, n: int) -> torch.Tensor:
        """Ids of the reserved sink page, for tokens whose SWA KV is outside every needed window."""
        return torch.arange(n, dtype=torch.int64, device=self.device) % self.page_size

    # ----------------------------------------------------------------------------- insert
    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``key`` -> (``value``, ``swa_value``). Ownership as for full ids: the tree frees the
        caller's duplicates in ``[prev_prefix_len, prefix_len)`` (SWA ids before ``swa_evicted_seqlen``
        are ignored: the caller freed them), takes what it caches, the caller keeps ``[cached_len:]``."""
        if not isinstance(params, InsertParams):
            raise InvalidTypeError("params", "an InsertParams", type(params).__name__)
        toks, salt = parse_key(params.key)
        n, ps = len(toks), self.page_size
        self._check_value("value", params.value, n)
        self._check_value("swa_value", params.swa_value, n)
        prev, ev = params.prev_prefix_len, params.swa_evicted_seqlen
        check_prev_prefix_len(prev, n, ps)
        prev, ev = int(prev), int_arg("swa_evicted_seqlen", ev, lo=0)
        aligned = n // ps * ps
        if aligned == 0:
            return InsertResult(prefix_len=0, cached_len=0, last_device_node=self.root)
        _, _, dev_prefix, pending = self._insert_probe(toks, salt, aligned)
        if prev > dev_prefix:
            raise InvalidArgumentError("prev_prefix_len", f"<= the cached prefix length ({dev_prefix})", prev)
        e = min(-(-ev // ps) * ps, aligned)  # SWA ids before e are gone
        if self.validate and prev < aligned:
            from tiered_cache.radix.checks import check_callers_kv

            check_callers_kv(self, params.value[prev:aligned])
            lo = max(prev, e)
            if lo < aligned and bool((self.swa.translate(params.swa_value[lo:aligned][::ps]) < 0).any()):
                raise InvalidArgumentError("swa_value", "SWA ids the caller owns",
                                           params.swa_value[lo:lo + 16].tolist())
        if pending:
            self._settle_loads()
        res = self._insert_swa(toks, salt, params.value, params.swa_value, aligned, prev, e)
        self._after_insert(res)
        return res

    def _insert_swa(self, toks, salt, value, swa, aligned, prev, e) -> InsertResult:
        ps, root, touch = self.page_size, self.root, self.policy.touch
        node, i, prefix, stopped = root, 0, None, False
        dups, swa_dups = [], []
        while i < aligned:
            ck = toks[i] if ps == 1 else tuple(toks[i:i + ps])
            child = node.children.get(ck if node is not root or salt is None else (salt, ck))
            if child is None:
                break
            m = common_len(child.key, toks, i, aligned, ps)
            if m < len(child.key):
                child = self._split(child, m)
            touch("kv", child)
            lo = max(prev, e, i)  # the caller's SWA ids offered for this span: taken or freed
            if child.value is None:  # on the host only (or dead): the caller's ids for its span
                if i < e:  # the caller has no SWA KV for it: the node stays on the host, the insert ends
                    stopped = True
                    break
                prefix = i if prefix is None else prefix
                self._reattach(child, value[i:i + m])
                self._take_swa(child, swa[i:i + m])
            else:
                if prefix is None and max(prev, i) < i + m:
                    dups.append(value[max(prev, i):i + m])
                if child.swa_tomb and i >= max(e, prev):
                    self._take_swa(child, swa[i:i + m])
                elif lo < i + m:
                    swa_dups.append(swa[lo:i + m])
            i += m
            node = child
        prefix = i if prefix is None else prefix
        if i < aligned and e < aligned and not stopped:
            if i < e:
                node = self._new_leaf(node, toks[i:e], value[i:e], None, salt)
                node.swa_tomb = True
                i = e
            node = self._new_leaf(node, toks[i:aligned], value[i:aligned], None, salt)
            self._take_swa(node, swa[i:aligned])
            i = aligned
        if dups:
            self.kv.free(torch.cat(dups))
        if swa_dups:
            self.swa.free(torch.cat(swa_dups))
        return InsertResult(prefix_len=prefix, cached_len=i, last_device_node=node)

    def _take_swa(self, x: TreeNode, ids: torch.Tensor) -> None:
        x.swa_value = ids.clone()
        x.swa_tomb = False
        self.policy.touch("kv", x)
        self._sync(x)

    def _new_leaf(self, parent, key, value, t1, salt) -> TreeNode:
        leaf = super()._new_leaf(parent, key, value, None, salt)
        leaf.swa_tomb = True  # until the caller's SWA ids are taken
        return leaf

    # ----------------------------------------------------------------------------- evict
    def _can_demote(self, x: TreeNode) -> bool:
        # an SWA copy missing on the host would be lost: fine for an internal node (it becomes a
        # tombstone), not for a leaf (a leaf is never a tombstone)
        return x.host_kv is not None and (x.swa_value is None or x.swa_host is not None or bool(x.children))

    def _evict_swa(self, num: int) -> tuple[int, int]:
        f = Frees()
        tok = 0
        while tok < num:
            x = self.policy.pop("swa")
            if x is None:
                break
            tok += len(x.key)
            if x.children:  # internal: an SWA tombstone; its full KV stays
                f.swa.append(x.swa_value)
                if x.swa_host is not None:
                    f.hswa.extend(x.swa_host)
                x.swa_value, x.swa_host, x.swa_tomb = None, None, True
                self._n_swa_freed += len(x.key)
                self._sync(x)
            else:
                p = x.parent
                self._remove(x, f)
                self._after_child_removed(p, f)
        f.flush(self)
        return 0, tok

    # ----------------------------------------------------------------------------- load back
    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        """As ``HiMambaRadixCache.init_load_back``, loading full and SWA pages; no state. The SWA ids
        of the returned tokens are in ``req.load_back.swa_indices`` (sink ids under tombstones)."""
        ids, node = super().init_load_back(params)
        h = getattr(params.req, "load_back", None) if params.req is not None else None
        if len(ids) and h is not None and h.last_node is node:
            parts, x, n = [], node, 0
            while n < len(ids):
                s = x.swa_value if x.swa_value is not None else x.swa_pending
                parts.append(s if s is not None else self._sink_ids(len(x.key)))
                n += len(x.key)
                x = x.parent
            h.swa_indices = torch.cat(parts[::-1])
        return ids, node

    def _state_on_host(self, best: TreeNode) -> bool:
        return False

    # ----------------------------------------------------------------------------- requests
    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """A request finished: cache its tokens, free the full and SWA ids it still owns (SWA ids
        before ``req.swa_evicted_seqlen`` it freed itself), release its lock."""
        toks = list(req.token_ids)
        kv, swa, prev = req.kv_indices, req.swa_kv_indices, int(req.cache_protected_len)
        ev = int(getattr(req, "swa_evicted_seqlen", 0))
        if req.last_node is not None:
            check_node(self, req.last_node)
        keep = prev
        if is_insert:
            res = self.insert(InsertParams(key=RadixKey(toks, req.extra_key), value=kv[:len(toks)],
                                           swa_value=swa[:len(toks)], prev_prefix_len=prev, swa_evicted_seqlen=ev))
            keep = max(res.cached_len, prev)
        if keep < kv.numel():
            self.kv.free(kv[keep:])
        lo = max(keep, -(-ev // self.page_size) * self.page_size)
        if lo < swa.numel():
            self.swa.free(swa[lo:])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
            req.last_node = None
        req.cache_protected_len = 0

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """A chunk of a prefill is done: cache what it wrote (full + SWA KV), point the request's prefix
        at the tree's ids, move its lock to the new end (as ``HiMambaRadixCache.cache_unfinished_req``).

        Afterwards ``req.kv_indices[:cache_protected_len]`` and ``req.swa_kv_indices[:cache_protected_len]``
        are the tree's (sink ids where the tree holds an SWA tombstone); the request owns the rest, and
        frees its own SWA ids as they slide out of the window (``req.swa_evicted_seqlen``) only at
        positions >= ``cache_protected_len``. The locked path keeps its SWA KV."""
        toks = req.token_ids.tolist() if isinstance(req.token_ids, torch.Tensor) else list(req.token_ids)
        n = len(toks)
        kv, swa, prev = req.kv_indices, getattr(req, "swa_kv_indices", None), int(req.cache_protected_len)
        for arg, ids in (("req.kv_indices", kv), ("req.swa_kv_indices", swa)):
            if (not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64
                    or ids.device != self.device or ids.numel() < n or ids.numel() % self.page_size):
                raise InvalidArgumentError(arg, f"a 1-D int64 tensor on {self.device}, whole pages covering "
                                           f"{n} tokens", getattr(ids, "shape", ids))
        ev = int(getattr(req, "swa_evicted_seqlen", 0))
        if req.last_node is not None:
            check_node(self, req.last_node)
        res = self.insert(InsertParams(key=RadixKey(toks, req.extra_key), value=kv[:n], swa_value=swa[:n],
                                       prev_prefix_len=prev, swa_evicted_seqlen=ev, chunked=chunked))
        if res.cached_len <= prev:
            req.prefix_indices = kv[:n]
            return
        node, vals, swas = res.last_device_node, [], []
        x = node
        while x is not self.root:
            vals.append(x.value)
            swas.append(x.swa_value if x.swa_value is not None else self._sink_ids(len(x.key)))
            x = x.parent
        req.kv_indices = torch.cat(vals[::-1] + [kv[res.cached_len:]])
        req.swa_kv_indices = torch.cat(swas[::-1] + [swa[res.cached_len:]])
        req.prefix_indices = req.kv_indices[:n]
        self._lock(node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = node
        req.cache_protected_len = res.cached_len
