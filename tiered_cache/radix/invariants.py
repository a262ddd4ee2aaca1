"""``check_invariants`` of ``HiMambaRadixCache``: everything recomputed from the sets themselves.

Slow on purpose (a full walk, host copies): for tests and debugging, never the serving path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from tiered_cache.radix.cache import HiMambaRadixCache


def _ids(t: Optional[torch.Tensor]) -> list:
    return [] if t is None else t.reshape(-1).tolist()


def check_invariants(cache: HiMambaRadixCache, request_kv: Optional[torch.Tensor] = None,
                     request_states: Optional[torch.Tensor] = None) -> None:
    ps, root, pol = cache.page_size, cache.root, cache.policy
    assert root.parent is None and root.key == [] and root.full_lock_ref == 0 and root.mamba_lock_ref == 0
    kv_pages: set[int] = set()
    t1: set[int] = set()
    full_ev = full_pr = m_ev = m_pr = 0
    want_kv_cand, want_state_cand = set(), set()
    stack = [root]
    while stack:
        x = stack.pop()
        assert x.alive and x.owner is cache._token, f"dead or foreign node in the tree: {x}"
        sub_locks = 0
        for ck, c in x.children.items():
            assert c.parent is x, f"{c} does not point back to its parent"
            assert c.ck == ck, f"{c} is filed under {ck!r}, its key says {c.ck!r}"
            first = c.key[0] if ps == 1 else tuple(c.key[:ps])
            assert ck == first or (x is root and isinstance(ck, tuple) and len(ck) == 2 and ck[1] == first
                                   and isinstance(ck[0], str)), f"child key {ck!r} does not match {c}"
            sub_locks += c.full_lock_ref
            stack.append(c)
        if x is root:
            continue
        n = len(x.key)
        assert n > 0 and n % ps == 0, f"span of {x} is not whole pages"
        assert x.value is not None and x.value.numel() == n, f"{x} has {x.value.numel()} KV ids for {n} tokens"
        assert x.mamba_lock_ref >= 0 and x.full_lock_ref >= 0, f"negative lock on {x}"
        assert x.full_lock_ref == x.mamba_lock_ref + sub_locks, f"full lock of {x} != own + children's"
        assert x.children or x.mamba_value is not None or x.full_lock_ref > 0, f"unlocked tombstone leaf {x}"
        vals = x.value.tolist()
        for j in range(0, n, ps):
            page = vals[j] // ps
            assert vals[j:j + ps] == list(range(page * ps, page * ps + ps)), f"{x} holds a partial page"
            assert page not in kv_pages, f"KV page {page} is cached twice"
            kv_pages.add(page)
        if x.full_lock_ref:
            full_pr += n
        else:
            full_ev += n
            if not x.children:
                want_kv_cand.add(x)
        if x.mamba_value is not None:
            s = int(x.mamba_value)
            assert s not in t1, f"T1 slot {s} is cached twice"
            t1.add(s)
            if x.mamba_lock_ref:
                m_pr += 1
            else:
                m_ev += 1
                want_state_cand.add(x)
    assert (full_ev, full_pr) == (cache._full_evictable, cache._full_protected), (
        f"full sizes {(cache._full_evictable, cache._full_protected)} != recomputed {(full_ev, full_pr)}")
    assert (m_ev, m_pr) == (cache._mamba_evictable, cache._mamba_protected), (
        f"mamba sizes {(cache._mamba_evictable, cache._mamba_protected)} != recomputed {(m_ev, m_pr)}")
    assert pol.candidates("kv") == want_kv_cand, "KV eviction candidates are not the unlocked leaves"
    assert pol.candidates("state") == want_state_cand, "state eviction candidates are not the unlocked states"

    # Every slot of every pool is exactly one of: free, cached by the tree, owned by a request.
    live_pages = set(cache.kv.allocator.live_virtual_ids())
    owned = set(torch.nonzero(cache._owned).reshape(-1).tolist())
    assert owned == kv_pages, "the tree's KV ownership map disagrees with its nodes"
    assert kv_pages <= live_pages, f"cached KV pages are free in T0: {sorted(kv_pages - live_pages)[:8]}"
    if request_kv is not None:
        req_pages = {i // ps for i in _ids(request_kv)}
        assert not (req_pages & kv_pages), f"pages both cached and a request's: {sorted(req_pages & kv_pages)[:8]}"
        assert live_pages == kv_pages | req_pages, (
            f"T0 KV pages neither free, cached nor a request's: {sorted(live_pages - kv_pages - req_pages)[:8]}; "
            f"a request's but free: {sorted(req_pages - live_pages)[:8]}")
    live_states = set(cache.states.allocator.live_virtual_ids())
    if request_states is not None:
        rs = _ids(request_states)
        assert len(set(rs)) == len(rs), "a T0 state slot is held by two requests"
        assert live_states == set(rs), (f"T0 state slots allocated but no request's: {sorted(live_states - set(rs))}; "
                                        f"a request's but free: {sorted(set(rs) - live_states)}")
    ck = cache.ckpt
    assert all(ck.is_allocated(s) for s in t1), "a cached T1 slot is free"
    assert ck.available_size() + len(t1) == ck.num_slots, (
        f"T1: {ck.available_size()} free + {len(t1)} cached != {ck.num_slots} slots (a slot leaked)")
    cache.pool.check_invariants()
