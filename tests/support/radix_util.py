"""Shared helpers of the radix tests: tiny real pools on CPU and content patterns derived from tokens."""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from typing import Optional

import torch

from tiered_cache.config import CacheConfig
from tiered_cache.radix import HiMambaRadixCache, HiSWARadixCache, InsertParams, MatchPrefixParams, RadixKey
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.stack import TieredCache

KV_SPEC = KVSpec(num_layers=2, kv_heads=1, head_dim=4, dtype=torch.float32)
STATE_SPEC = StateSpec(num_layers=2, temporal_shape=(2, 4, 4), temporal_dtype=torch.float32,
                       conv_shapes=((4, 3),), conv_dtype=torch.float32)


def _tree(cfg: CacheConfig, device: str, **kw):
    """The radix tree of a ``TieredCache`` over the test specs (``kw``: ``TieredCache.build``'s)."""
    return TieredCache.build(cfg, kv=KV_SPEC, device=device, **kw).tree


def _backend(device: str) -> str:
    return "torch" if device == "cpu" else "auto"


def make_cache(page_size: int = 1, kv_pages: int = 64, states: int = 8, t1_slots: int = 16,
               codec: str = "lossless", checkpoint_unit: Optional[int] = None, **kw) -> HiMambaRadixCache:
    """T0 + T1 on CPU; ``kw`` goes to ``TieredCache.build`` (``placement``)."""
    cfg = CacheConfig(page_size=page_size, kv_pages=kv_pages, t0_states=states, t1_states=t1_slots, codec=codec,
                      checkpoint_unit=checkpoint_unit, check_memory=False, backend="torch")
    return _tree(cfg, "cpu", state=STATE_SPEC, **kw)


def make_hi_cache(page_size: int = 1, kv_pages: int = 64, states: int = 8, t1_slots: int = 16,
                  codec: str = "lossless", host_pages: int = 64, host_states: int = 16,
                  write_policy: str = "write_through", device: str = "cpu", **kw) -> HiMambaRadixCache:
    """A cache with all three tiers; ``kw``: the other ``CacheConfig`` fields (``write_through_threshold``,
    ``load_back_threshold``, ...)."""
    cfg = CacheConfig(page_size=page_size, kv_pages=kv_pages, t0_states=states, t1_states=t1_slots, codec=codec,
                      host_kv_pages=host_pages, host_states=host_states, write_policy=write_policy,
                      check_memory=False, backend=_backend(device), **kw)
    return _tree(cfg, device, state=STATE_SPEC)


SWA_SPEC = KVSpec(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32, window=4)
SWA_OFFSET = 5000.0  # SWA K of a token := its prefix hash + SWA_OFFSET + layer (apart from its full K)


def make_swa_cache(page_size: int = 1, window: int = 4, full_pages: int = 32, swa_pages: int = 32,
                   host_pages: int = 32, host_swa_pages: int = 32, write_policy: str = "write_through",
                   device: str = "cpu", host: bool = True, **kw) -> HiSWARadixCache:
    """Full + SWA KV (``window`` tokens) over T0 and, with ``host``, T2; ``kw``: other ``CacheConfig`` fields."""
    cfg = CacheConfig(page_size=page_size, kv_pages=full_pages, swa_pages=swa_pages,
                      host_kv_pages=host_pages if host else 0, host_swa_pages=host_swa_pages if host else None,
                      write_policy=write_policy, check_memory=False, backend=_backend(device), **kw)
    return _tree(cfg, device, swa=dataclasses.replace(SWA_SPEC, window=window))


def write_swa(cache: HiSWARadixCache, ids: torch.Tensor, toks: Sequence[int], salt: Optional[str] = None) -> None:
    if not len(toks):
        return
    ps = cache.page_size
    phys = cache.swa.translate(ids[:len(toks)])
    h = torch.tensor(prefix_hashes(toks, salt), dtype=torch.float32, device=cache.device) + SWA_OFFSET
    k = cache.swa.k_view_all()
    for layer in range(k.shape[0]):
        k[layer, phys // ps, phys % ps] = (h + layer)[:, None, None]


def check_swa(cache: HiSWARadixCache, ids: torch.Tensor, toks: Sequence[int], salt: Optional[str] = None,
              start: int = 0) -> None:
    """SWA K of ``toks[start:]`` (ids aligned with toks) is its pattern."""
    if len(toks) <= start:
        return
    ps = cache.page_size
    phys = cache.swa.translate(ids[start:len(toks)])
    h = torch.tensor(prefix_hashes(toks, salt)[start:], dtype=torch.float32) + SWA_OFFSET
    got = cache.swa.k_view_all()[:, phys // ps, phys % ps].cpu()  # [L, n, H, D]
    want = (h[None, :] + torch.arange(got.shape[0])[:, None])[:, :, None, None].expand_as(got)
    assert torch.equal(got, want), "SWA KV content differs from what was inserted for these tokens"


def insert_swa(cache: HiSWARadixCache, toks: list[int], salt: Optional[str] = None, evicted: int = 0):
    """Insert ``toks`` with fresh full and SWA ids (patterns written); SWA ids before ``evicted`` are freed
    first (slid out of the window), the rest the caller keeps after the insert are freed after it.
    ``None`` when T0 has no room for the ids."""
    ps = cache.page_size
    n = -(-len(toks) // ps) * ps
    ids = cache.kv.alloc(n)
    swa = None if ids is None else cache.swa.alloc(n)
    if swa is None:  # no room (the two sides share the pool's bytes)
        if ids is not None:
            cache.kv.free(ids)
        return None
    write_kv(cache, ids, toks, salt)
    write_swa(cache, swa, toks, salt)
    e = min(-(-evicted // ps) * ps, len(toks) // ps * ps)
    if e:
        cache.swa.free(swa[:e])
    res = cache.insert(InsertParams(key=RadixKey(toks, salt), value=ids[:len(toks)], swa_value=swa[:len(toks)],
                                    swa_evicted_seqlen=evicted))
    if ids[res.cached_len:].numel():
        cache.kv.free(ids[res.cached_len:])
    if swa[max(res.cached_len, e):].numel():
        cache.swa.free(swa[max(res.cached_len, e):])
    return res


def prefix_hashes(toks: Sequence[int], salt: Optional[str] = None) -> list[int]:
    """h[j]: a number derived from salt and toks[:j+1] (exact in fp32)."""
    h = (hash(salt) % 9973) if salt is not None else 7
    out = []
    for t in toks:
        h = (h * 1000003 + int(t) + 1) % (1 << 20)
        out.append(h)
    return out


def write_kv(cache: HiMambaRadixCache, ids: torch.Tensor, toks: Sequence[int], salt: Optional[str] = None) -> None:
    """Token j's K (every layer) := its prefix hash + layer."""
    if not len(toks):
        return
    ps = cache.page_size
    phys = cache.kv.translate(ids[:len(toks)])
    h = torch.tensor(prefix_hashes(toks, salt), dtype=torch.float32, device=cache.device)
    k = cache.kv.k_view_all()
    for layer in range(k.shape[0]):
        k[layer, phys // ps, phys % ps] = (h + layer)[:, None, None]


def check_kv(cache: HiMambaRadixCache, ids: torch.Tensor, toks: Sequence[int], salt: Optional[str] = None) -> None:
    if not len(toks):
        return
    ps = cache.page_size
    phys = cache.kv.translate(ids)
    h = torch.tensor(prefix_hashes(toks, salt), dtype=torch.float32)
    got = cache.kv.k_view_all()[:, phys // ps, phys % ps].cpu()  # [L, n, H, D]
    want = (h[None, :] + torch.arange(got.shape[0])[:, None])[:, :, None, None].expand_as(got)
    assert torch.equal(got, want), "KV content differs from what was inserted for these tokens"


def state_pattern(toks: Sequence[int], salt: Optional[str] = None):
    h = float(prefix_hashes(toks, salt)[-1]) if len(toks) else 0.0
    s = STATE_SPEC
    temporal = (torch.arange(s.num_layers * 2 * 4 * 4, dtype=torch.float32).view(s.num_layers, 2, 4, 4) * 0.25
                - 3.0) * (1 + (h % 97) / 50) + (h % 13)
    conv = torch.full((s.num_layers, 4, 3), h / 7.0, dtype=torch.float32)
    return temporal, conv


def write_state(cache: HiMambaRadixCache, slot: torch.Tensor, toks: Sequence[int], salt: Optional[str] = None) -> None:
    phys = cache.states.translate(slot.reshape(1))
    temporal, conv = state_pattern(toks, salt)
    cache.states.temporal_view_all()[:, phys] = temporal[:, None].to(cache.device)
    cache.states.conv_view_all(0)[:, phys] = conv[:, None].to(cache.device)


def read_state(cache: HiMambaRadixCache, slot: torch.Tensor):
    phys = cache.states.translate(slot.reshape(1))
    return cache.states.temporal_view_all()[:, phys[0]].cpu(), cache.states.conv_view_all(0)[:, phys[0]].cpu()


def check_state(cache: HiMambaRadixCache, slot: torch.Tensor, toks: Sequence[int], salt: Optional[str] = None) -> None:
    temporal, conv = read_state(cache, slot)
    want_t, want_c = state_pattern(toks, salt)
    if cache.ckpt.codec == "lossless":
        assert torch.equal(temporal, want_t) and torch.equal(conv, want_c), "state differs from the inserted one"
    else:  # one int8 rounding: |err| <= scale / 2 = amax / 254 per (head, k-channel)
        amax = want_t.abs().amax(dim=-1 - (2 - STATE_SPEC.value_axis), keepdim=True)
        assert ((temporal - want_t).abs() <= amax / 254 * 1.001 + 1e-6).all(), "state off by more than one rounding"
        assert torch.equal(conv, want_c)


def alloc_kv(cache: HiMambaRadixCache, n_tokens: int) -> torch.Tensor:
    ps = cache.page_size
    ids = cache.kv.alloc(-(-n_tokens // ps) * ps)
    assert ids is not None, "test pool too small"
    return ids


def insert_fresh(cache: HiMambaRadixCache, toks: list[int], salt: Optional[str] = None, prev: int = 0,
                 keep_state: bool = False):
    """Insert ``toks`` with fresh KV ids and a fresh T0 state (patterns written); free what the caller keeps."""
    ids = alloc_kv(cache, len(toks))
    write_kv(cache, ids, toks, salt)
    slot = cache.states.alloc(1)
    assert slot is not None
    write_state(cache, slot, toks, salt)
    res = cache.insert(InsertParams(key=RadixKey(toks, salt), value=ids[:len(toks)], mamba_value=slot,
                                    prev_prefix_len=prev))
    rest = ids[max(res.cached_len, prev):]
    if rest.numel():
        cache.kv.free(rest)
    if not keep_state:
        cache.states.free(slot)
        slot = None
    return res, slot


def insert_after_match(cache: HiMambaRadixCache, toks: list[int], m, slot: torch.Tensor, dup: bool) -> tuple:
    """The rest of an engine turn after match ``m`` (page size ``cache.page_size``): lock, KV for the tokens
    past the hit, insert with the hit as ``prev_prefix_len`` (``dup``: 0, so the hit's ids come again as
    duplicates), free what the tree did not take, unlock, free ``slot``. -> the insert's (prefix_len,
    cached_len, mamba_exist, mamba_stored)."""
    ps = cache.page_size
    cache.inc_lock_ref(m.last_device_node)
    hit, aligned = len(m.device_indices), len(toks) // ps * ps
    if dup:
        value, prev = cache.kv.alloc(aligned), 0
    else:
        value, prev = torch.cat([m.device_indices, cache.kv.alloc(aligned - hit)]), hit
    write_kv(cache, value[prev:], toks[prev:aligned])
    write_state(cache, slot, toks[:aligned])
    res = cache.insert(InsertParams(key=RadixKey(toks[:aligned]), value=value, mamba_value=slot, prev_prefix_len=prev))
    if res.cached_len < aligned:
        cache.kv.free(value[max(res.cached_len, prev):])
    cache.dec_lock_ref(m.last_device_node)
    cache.states.free(slot)
    return res.prefix_len, res.cached_len, res.mamba_exist, res.mamba_stored


def match(cache, toks: Sequence[int], salt: Optional[str] = None, **kw):
    """``match_prefix`` of ``toks`` under ``salt``; ``kw``: the other ``MatchPrefixParams`` fields."""
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(list(toks), salt), **kw))


def demote_tail(cache: HiMambaRadixCache) -> None:
    """On a fresh host-tier cache of pages of 2: [1, 2] on the device with its state, [3, 4] (with a state)
    only on the host, KV and state."""
    from tiered_cache.radix import EvictParams

    insert_fresh(cache, [1, 2])
    insert_fresh(cache, [1, 2, 3, 4])
    cache.check_hicache_events()
    match(cache, [1, 2])
    cache.evict(EvictParams(mamba_num=1))  # [3, 4]'s state to T2
    cache.evict(EvictParams(num_tokens=2))  # [3, 4]'s KV to T2


def page(*toks: int) -> bytes:
    """The key a child is filed under for its first page ``toks`` (below the root, or at it without a salt):
    the page's int64 ids as bytes (``RadixTree.child_key``)."""
    return array("q", toks).tobytes()


def node_at(cache, toks: Sequence[int]):
    """The node whose key ends exactly at ``toks`` (a test's own path: the walk must not stop inside a node)."""
    x, i, ps = cache.root, 0, cache.page_size
    while i < len(toks):
        x = x.children[page(*toks[i:i + ps])]
        i += len(x.key)
    assert i == len(toks)
    return x


def full_snapshot(cache) -> tuple:
    """Everything a caller can observe: the tree (keys, ids, states, locks, hit counts, LRU stamps and
    candidate sets), sizes, stats, and the free sizes of every pool. Equal before and after a call that
    raised means the call changed nothing."""
    pol = cache.policy
    nodes = []
    stack = [(cache.root, ())]
    while stack:
        x, pre = stack.pop()
        for ck in sorted(x.children, key=repr):
            c = x.children[ck]
            nodes.append((pre, tuple(c.key), None if c.value is None else tuple(c.value.tolist()),
                          None if getattr(c.payload, "mamba_value", None) is None else int(c.payload.mamba_value),
                          getattr(c.payload, "state_host", None), c.host_kv,
                          c.full_lock_ref, c.mamba_lock_ref, c.resumes, c.leaf_resumes, c.hit_count,
                          tuple(pol.stamp(r, c) for r in ("kv", "state")),
                          tuple(c in pol.candidates(r) for r in ("kv", "state", "kv_host", "state_host", "swa"))))
            stack.append((c, pre + tuple(c.key)))
    sizes = (cache.full_evictable_size(), cache.full_protected_size(), cache.mamba_evictable_size(),
             cache.mamba_protected_size(), cache.kv.available_size())
    if cache.supports_mamba():
        sizes += (cache.states.available_size(), cache.ckpt.available_size())
    if cache.host is not None:
        sizes += tuple(r.available_size() for r in cache.host.regions.values()) if hasattr(cache.host, "regions") \
            else ()
    return sorted(nodes, key=repr), sizes, dict(cache.stats)
