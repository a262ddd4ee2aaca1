"""The request flows of the radix caches: ``cache_finished_req`` and ``cache_unfinished_req``.

The request carries what SGLang reads from ``Req`` and its ``req_to_token_pool`` row (see
``params.CacheReq``): ``token_ids``, ``kv_indices`` (whole pages; ``[:cache_protected_len]`` are the
tree's), ``mamba_pool_idx`` (its T0 state slot, the state at ``len(token_ids)``), ``last_node``
(locked), ``cache_protected_len`` and ``extra_key``; an SWA request has ``swa_kv_indices`` and
``swa_evicted_seqlen`` instead of a state slot. The flows use the cache's public methods and its
tree's (``RadixTree.lock``, ``path_values``).
"""

from __future__ import annotations

from typing import Any

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix.checks import check_callers_kv, check_state_allocated, desc, parse_key, state_slot
from tiered_cache.radix.params import InsertParams, RadixKey
from tiered_cache.validate import int_arg

_FIELDS = ("token_ids", "kv_indices", "mamba_pool_idx", "last_node", "cache_protected_len", "extra_key")


def cache_finished_req(cache, req: Any, is_insert: bool = True) -> None:
    """A request finished: cache its tokens (``is_insert``), free the KV ids and the T0 state slot it
    still owns, release its lock. Everything it frees or releases is checked before the insert: when
    it raises, the request still owns all it owned and the tree is unchanged (but for a load back the insert
    settled: ``IntegrityError`` when the request's own load failed, then release it with ``is_insert=False``)."""
    if not isinstance(is_insert, bool):
        raise InvalidTypeError("is_insert", "a bool", is_insert)
    toks, kv, prev = req_fields(cache, req)
    if cache.validate and prev < kv.numel():
        check_callers_kv(cache.tree, kv[prev:], "req.kv_indices")  # what it frees after the insert is the request's
    keep = prev
    if is_insert:
        res = cache.insert(InsertParams(key=RadixKey(toks, req.extra_key), value=kv[:len(toks)],
                                       mamba_value=req.mamba_pool_idx, prev_prefix_len=prev, last_node=req.last_node))
        keep = max(res.cached_len, prev)
    if keep < kv.numel():
        cache.kv.free(kv[keep:])
    if req.mamba_pool_idx is not None:
        slot = state_slot(cache.states, "req.mamba_pool_idx", req.mamba_pool_idx)
        cache.states.free(slot)
        cache.rule.fresh_slot(slot)
        req.mamba_pool_idx = None
    if req.last_node is not None:
        cache.dec_lock_ref(req.last_node)
        req.last_node = None
    req.cache_protected_len = 0
    if is_insert:  # last, once the request is settled: a policy that learns from the requests (Marconi's alpha)
        t = cache.tree
        t.policy.observe(toks, t.full_evictable + t.full_protected)


def cache_unfinished_req(cache, req: Any, chunked: bool = False) -> None:
    """A chunk of a prefill is done: cache what it wrote, point the request's prefix at the tree's
    ids, move its lock to the new end. The request keeps its T0 state slot."""
    if not isinstance(chunked, bool):
        raise InvalidTypeError("chunked", "a bool", chunked)
    toks, kv, prev = req_fields(cache, req)
    res = cache.insert(InsertParams(key=RadixKey(toks, req.extra_key), value=kv[:len(toks)],
                                   mamba_value=req.mamba_pool_idx, prev_prefix_len=prev, chunked=chunked,
                                   last_node=req.last_node))
    if res.cached_len <= prev:
        req.prefix_indices = kv[:len(toks)]
        return
    node = res.last_device_node
    req.kv_indices = torch.cat([cache.tree.path_values(node), kv[res.cached_len:]])
    req.prefix_indices = req.kv_indices[:len(toks)]
    _move_lock(cache, req, node, res.cached_len)


def _move_lock(cache, req: Any, node: Any, cached_len: int) -> None:
    """The request's prefix now ends at ``node`` (``cached_len`` tokens): lock it, release the old end."""
    cache.tree.lock(node)
    if req.last_node is not None:
        cache.dec_lock_ref(req.last_node)
    req.last_node = node
    req.cache_protected_len = cached_len


def req_fields(cache, req: Any) -> tuple[list[int], torch.Tensor, int]:
    """Every field a request flow reads, checked (typed errors naming ``req.<field>``) before it acts."""
    missing = [f for f in _FIELDS if not hasattr(req, f)]
    if missing:
        raise InvalidTypeError("req", f"a request with {', '.join(_FIELDS)} (CacheReq)", type(req).__name__)
    toks, _ = parse_key(req.token_ids, "req.token_ids")
    if req.extra_key is not None and not isinstance(req.extra_key, str):
        raise InvalidTypeError("req.extra_key", "a str or None", req.extra_key)
    kv = req.kv_indices
    if not isinstance(kv, torch.Tensor):
        raise InvalidTypeError("req.kv_indices", f"a 1-D int64 tensor on {cache.device}", desc(kv))
    if kv.dtype != torch.int64:
        raise InvalidTypeError("req.kv_indices", f"a 1-D int64 tensor on {cache.device}", desc(kv))
    if kv.dim() != 1 or kv.device != cache.device:
        raise InvalidArgumentError("req.kv_indices", f"a 1-D int64 tensor on {cache.device}", desc(kv))
    if kv.numel() < len(toks) or kv.numel() % cache.page_size:
        raise InvalidArgumentError("req.kv_indices", f"whole pages covering {len(toks)} tokens", kv.numel())
    prev = int_arg("req.cache_protected_len", req.cache_protected_len, lo=0, hi=len(toks))
    if req.last_node is not None:
        cache.tree.check_locked(req.last_node, "req.last_node")  # released at the end: must be held now
    if req.mamba_pool_idx is not None:
        slot = state_slot(cache.states, "req.mamba_pool_idx", req.mamba_pool_idx)
        if cache.validate:
            check_state_allocated(cache.states, slot, "req.mamba_pool_idx")
    return toks, kv, prev



# --------------------------------------------------------------------------------- SWA
def swa_cache_finished_req(cache, req: Any, is_insert: bool = True) -> None:
    """A request finished: cache its tokens, free the full and SWA ids it still owns (SWA ids
    before ``req.swa_evicted_seqlen`` it freed itself), release its lock."""
    toks = list(req.token_ids)
    kv, swa, prev = req.kv_indices, req.swa_kv_indices, int(req.cache_protected_len)
    ev = int(getattr(req, "swa_evicted_seqlen", 0))
    if req.last_node is not None:
        cache.tree.check_node(req.last_node)
    keep = prev
    if is_insert:
        res = cache.insert(InsertParams(key=RadixKey(toks, req.extra_key), value=kv[:len(toks)],
                                       swa_value=swa[:len(toks)], prev_prefix_len=prev, swa_evicted_seqlen=ev))
        keep = max(res.cached_len, prev)
    if keep < kv.numel():
        cache.kv.free(kv[keep:])
    lo = max(keep, -(-ev // cache.page_size) * cache.page_size)
    if lo < swa.numel():
        cache.swa.free(swa[lo:])
    if req.last_node is not None:
        cache.dec_lock_ref(req.last_node)
        req.last_node = None
    req.cache_protected_len = 0


def swa_cache_unfinished_req(cache, req: Any, chunked: bool = False) -> None:
    """A chunk of a prefill is done: cache what it wrote (full + SWA KV), point the request's prefix at
    the tree's ids (sink ids where the tree holds an SWA tombstone), move its lock to the new end."""
    toks = req.token_ids.tolist() if isinstance(req.token_ids, torch.Tensor) else list(req.token_ids)
    n = len(toks)
    kv, prev = req.kv_indices, int(req.cache_protected_len)
    swa: Any = getattr(req, "swa_kv_indices", None)
    for arg, ids in (("req.kv_indices", kv), ("req.swa_kv_indices", swa)):
        if (not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype != torch.int64
                or ids.device != cache.device or ids.numel() < n or ids.numel() % cache.page_size):
            raise InvalidArgumentError(arg, f"a 1-D int64 tensor on {cache.device}, whole pages covering "
                                       f"{n} tokens", getattr(ids, "shape", ids))
    ev = int(getattr(req, "swa_evicted_seqlen", 0))
    if req.last_node is not None:
        cache.tree.check_node(req.last_node)
    res = cache.insert(InsertParams(key=RadixKey(toks, req.extra_key), value=kv[:n], swa_value=swa[:n],
                                   prev_prefix_len=prev, swa_evicted_seqlen=ev, chunked=chunked))
    if res.cached_len <= prev:
        req.prefix_indices = kv[:n]
        return
    node = res.last_device_node
    req.kv_indices = torch.cat([cache.tree.path_values(node), kv[res.cached_len:]])
    req.swa_kv_indices = torch.cat([cache.rule.path_swa(node), swa[res.cached_len:]])
    req.prefix_indices = req.kv_indices[:n]
    _move_lock(cache, req, node, res.cached_len)
