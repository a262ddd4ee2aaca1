"""``check_invariants`` of the radix caches: everything recomputed from the sets themselves.

Slow on purpose (a full walk, host copies): for tests and debugging, never the serving path.

Every slot of every pool is exactly one of: free; cached (owned by a node); owned by a request;
in flight (owned by a transfer op until the tree applies it: a load's T0 pages and T1 scratch slot,
a backup's host pages).
"""

from __future__ import annotations

from typing import Optional

import torch


def _ids(t: Optional[torch.Tensor]) -> list:
    return [] if t is None else t.reshape(-1).tolist()


def _pages(x, vals: list, ps: int, what: str) -> list[int]:
    out = []
    for j in range(0, len(vals), ps):
        page = vals[j] // ps
        assert vals[j:j + ps] == list(range(page * ps, page * ps + ps)), f"{x} holds a partial {what} page"
        out.append(page)
    return out


def _add(seen: set, items, what: str) -> None:
    for i in items:
        assert i not in seen, f"{what} {i} is held twice"
        seen.add(i)


def check_invariants(cache, request_kv: Optional[torch.Tensor] = None,
                     request_states: Optional[torch.Tensor] = None) -> None:
    ps, root, pol = cache.page_size, cache.root, cache.policy
    mamba, swa_mode, host = cache.mode == "mamba", cache.mode == "swa", cache.host is not None
    assert root.parent is None and root.key == [] and root.full_lock_ref == 0 and root.mamba_lock_ref == 0
    kv_pages: set[int] = set()
    inflight_kv: set[int] = set()
    swa_pages: set[int] = set()
    inflight_swa: set[int] = set()
    t1: set[int] = set()
    hkv: set[int] = set()
    hkv_pending: set[int] = set()
    hswa: set[int] = set()
    hswa_pending: set[int] = set()
    hstate: set[int] = set()
    full_ev = full_pr = m_ev = m_pr = 0
    want = {r: set() for r in ("kv", "state", "kv_host", "state_host", "swa")}
    ops = list(cache._ops)
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
        n, p = len(x.key), x.parent
        assert n > 0 and n % ps == 0, f"span of {x} is not whole pages"
        assert x.mamba_lock_ref >= 0 and x.full_lock_ref >= 0, f"negative lock on {x}"
        assert x.full_lock_ref == x.mamba_lock_ref + sub_locks, f"full lock of {x} != own + children's"
        has_state = cache._has_state(x)
        assert x.children or has_state or x.full_lock_ref > 0 or x.tickets, f"unlocked tombstone leaf {x}"
        for op in x.tickets:
            assert op in ops and x in op.nodes, f"{x} names an op that does not know it"
        assert x.value is None or x.value_pending is None, f"{x} is on the device and being loaded"
        assert x.host_kv is None or x.host_pending is None, f"{x} is on the host and being backed up"
        if x.value is None and x.host_kv is None and x.value_pending is None:
            assert x.full_lock_ref > 0, f"dead node {x} is not locked"
        # tiers are upward closed: a node on the device (on the host) has its parent there too
        if x.value is not None:
            assert p is root or p.value is not None, f"{x} is on the device, its parent is not"
        if x.host_kv is not None or x.host_pending is not None:
            assert p is root or p.host_kv is not None or p.host_pending is not None, (
                f"{x} is backed up, its parent is not: host copies must be a prefix from the root")
        if x.value_pending is not None:
            assert any(op.kind == "load" for op in x.tickets), f"{x} has KV in flight but no load op"
        if x.host_pending is not None:
            assert any(op.kind == "backup" for op in x.tickets), f"{x} has host pages in flight but no backup op"
        for attr, want_len in (("value", n), ("value_pending", n), ("swa_value", n), ("swa_pending", n),
                               ("host_kv", n // ps), ("host_pending", n // ps), ("swa_host", n // ps),
                               ("swa_host_pending", n // ps)):
            v = getattr(x, attr)
            if v is not None:
                got = v.numel() if isinstance(v, torch.Tensor) else len(v)
                assert got == want_len, f"{x}.{attr} has {got} entries for {n} tokens"
        if x.value is not None:
            _add(kv_pages, _pages(x, x.value.tolist(), ps, "KV"), "KV page")
            if x.full_lock_ref:
                full_pr += n
            else:
                full_ev += n
        if x.value_pending is not None:
            _add(inflight_kv, _pages(x, x.value_pending.tolist(), ps, "KV"), "KV page")
        for attr, seen in (("host_kv", hkv), ("host_pending", hkv_pending), ("swa_host", hswa),
                           ("swa_host_pending", hswa_pending)):
            if getattr(x, attr) is not None:
                _add(seen, getattr(x, attr), f"host {attr} slot")
        if x.mamba_value is not None:
            _add(t1, [int(x.mamba_value)], "T1 slot")
            if x.mamba_lock_ref:
                m_pr += 1
            else:
                m_ev += 1
        if x.state_host is not None:
            _add(hstate, [x.state_host], "host state slot")
        if swa_mode:
            if x.swa_value is not None:
                assert x.value is not None and not x.swa_tomb, f"{x} has SWA KV on the device but not its KV"
                _add(swa_pages, _pages(x, x.swa_value.tolist(), ps, "SWA"), "SWA page")
            if x.swa_pending is not None:
                assert x.value_pending is not None, f"{x} loads SWA KV without its KV"
                _add(inflight_swa, _pages(x, x.swa_pending.tolist(), ps, "SWA"), "SWA page")
            if x.swa_host is not None:
                assert x.host_kv is not None and not x.swa_tomb, f"{x} has SWA KV on the host but not its KV"
            if x.swa_tomb:
                assert x.swa_value is None and x.swa_host is None, f"SWA tombstone {x} holds SWA KV"
        # the candidate sets, recomputed
        idle = not x.tickets
        unlocked = idle and x.full_lock_ref == 0
        if x.value is not None and unlocked and not any(c.value is not None or c.value_pending is not None
                                                        for c in x.children.values()):
            want["kv"].add(x)
        if x.mamba_value is not None and idle and x.mamba_lock_ref == 0:
            want["state"].add(x)
        if host and x.host_kv is not None and unlocked and not any(
                c.host_kv is not None or c.host_pending is not None for c in x.children.values()):
            want["kv_host"].add(x)
        if host and x.state_host is not None and idle and x.mamba_lock_ref == 0:
            want["state_host"].add(x)
        if swa_mode and x.swa_value is not None and unlocked:
            want["swa"].add(x)
    assert (full_ev, full_pr) == (cache._full_evictable, cache._full_protected), (
        f"full sizes {(cache._full_evictable, cache._full_protected)} != recomputed {(full_ev, full_pr)}")
    assert (m_ev, m_pr) == (cache._mamba_evictable, cache._mamba_protected), (
        f"mamba sizes {(cache._mamba_evictable, cache._mamba_protected)} != recomputed {(m_ev, m_pr)}")
    for r, w in want.items():
        assert pol.candidates(r) == w, f"{r} eviction candidates are wrong: extra {pol.candidates(r) - w}, " \
                                       f"missing {w - pol.candidates(r)}"

    # ops: every node an op names knows it; what it holds is in flight
    scratch = set()
    for op in ops:
        for y in op.nodes:
            assert op in y.tickets, f"op {op.kind} names {y}, which does not know it"
        if op.scratch is not None:
            _add(scratch, _ids(op.scratch), "T1 scratch slot")

    # Every slot of every pool is exactly one of: free, cached, a request's, in flight.
    live_pages = set(cache.kv.allocator.live_virtual_ids())
    owned = set(torch.nonzero(cache._owned).reshape(-1).tolist())
    assert owned == kv_pages, "the tree's KV ownership map disagrees with its nodes"
    assert not (kv_pages & inflight_kv), "a KV page is both cached and in flight"
    assert kv_pages | inflight_kv <= live_pages, (
        f"cached or in-flight KV pages are free in T0: {sorted((kv_pages | inflight_kv) - live_pages)[:8]}")
    if request_kv is not None:
        req_pages = {i // ps for i in _ids(request_kv)}
        assert not (req_pages & (kv_pages | inflight_kv)), "pages both the tree's and a request's"
        assert live_pages == kv_pages | inflight_kv | req_pages, (
            f"T0 KV pages neither free, cached, in flight nor a request's: "
            f"{sorted(live_pages - kv_pages - inflight_kv - req_pages)[:8]}; "
            f"a request's but free: {sorted(req_pages - live_pages)[:8]}")
    if swa_mode:
        live_swa = set(cache.swa.allocator.live_virtual_ids())
        assert swa_pages | inflight_swa <= live_swa, "cached SWA pages are free in T0"
        if request_states is not None:  # SWA mode: request_states are the requests' SWA ids
            req_swa = {i // ps for i in _ids(request_states)}
            assert live_swa == swa_pages | inflight_swa | req_swa, (
                f"T0 SWA pages neither free, cached, in flight nor a request's: "
                f"{sorted(live_swa - swa_pages - inflight_swa - req_swa)[:8]}; free: {sorted(req_swa - live_swa)[:8]}")
    if mamba:
        live_states = set(cache.states.allocator.live_virtual_ids())
        if request_states is not None:
            rs = _ids(request_states)
            assert len(set(rs)) == len(rs), "a T0 state slot is held by two requests"
            assert live_states == set(rs), (f"T0 state slots allocated but no request's: "
                                            f"{sorted(live_states - set(rs))}; a request's but free: "
                                            f"{sorted(set(rs) - live_states)}")
        ck = cache.ckpt
        assert not (t1 & scratch), "a T1 slot is both cached and a scratch slot"
        assert set(ck.allocator.allocated_ids()) == t1 | scratch, (
            f"T1 slots neither free, cached nor in flight: {sorted(set(ck.allocator.allocated_ids()) - t1 - scratch)}; "
            f"free but held: {sorted((t1 | scratch) - set(ck.allocator.allocated_ids()))}")
    if host:
        for region, held, pending in ((cache.kv_region, hkv, hkv_pending),
                                      (getattr(cache, "swa_region", None), hswa, hswa_pending),
                                      (getattr(cache, "state_region", None), hstate, set())):
            if region is None:
                continue
            alloc = set(region.allocator.allocated_ids())
            assert not (held & pending), f"host {region.name}: a slot is both owned and in flight"
            assert alloc == held | pending, (
                f"host {region.name}: slots neither free, owned nor in flight: {sorted(alloc - held - pending)[:8]}; "
                f"free but held: {sorted((held | pending) - alloc)[:8]}")
            assert all(region.valid[s] for s in held), f"host {region.name}: a slot a node owns is not valid"
            busy = set(region.allocator.busy_ids)
            assert busy <= held | pending, f"host {region.name}: a busy slot is nobody's"
        cache.host.check_invariants()
    cache.pool.check_invariants()
