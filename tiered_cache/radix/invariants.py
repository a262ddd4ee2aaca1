"""``check_invariants`` of the radix caches: everything recomputed from the sets themselves.

Slow on purpose (a full walk, host copies): for tests and debugging, never the serving path.

Every slot of every pool is exactly one of: free; cached (owned by a node); owned by a request;
in flight (owned by a transfer op until the tree applies it: a load's T0 pages and T1 scratch slot,
a backup's host pages). This module checks the tree's common part; the resume rule checks its
payloads and pools (``check_node`` per node, ``check_slots`` at the end), recording into ``Seen``.
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache.radix.policy import RESOURCES


def ids(t: Optional[torch.Tensor]) -> list:
    return [] if t is None else t.reshape(-1).tolist()


def pages(x: Any, vals: list, ps: int, what: str) -> list[int]:
    """The page numbers of the whole pages ``vals`` (ids page*ps + 0..ps-1) that node ``x`` holds."""
    out = []
    for j in range(0, len(vals), ps):
        page = vals[j] // ps
        assert vals[j:j + ps] == list(range(page * ps, page * ps + ps)), f"{x} holds a partial {what} page"
        out.append(page)
    return out


class Seen:
    """What the walk found: slots per set name (each held once), the candidate sets recomputed
    (``want``), the state counts, and the host regions to check (``host``: (region, held, pending))."""

    def __init__(self) -> None:
        self.sets: dict[str, set] = collections.defaultdict(set)
        self.want: dict[str, set] = {r: set() for r in RESOURCES}
        self.state_ev = self.state_pr = 0
        self.host: list[tuple[Any, set, set]] = []

    def add(self, name: str, items: Any, what: str) -> None:
        seen = self.sets[name]
        for i in items:
            assert i not in seen, f"{what} {i} is held twice"
            seen.add(i)


def check_lengths(x: Any, on: Any, attrs: tuple, n: int, ps: int) -> None:
    """``on``'s tensors among ``attrs`` hold one id per token of ``x``, its lists one slot per page."""
    for attr in attrs:
        v = getattr(on, attr)
        if v is not None:
            got, want_len = (v.numel(), n) if isinstance(v, torch.Tensor) else (len(v), n // ps)
            assert got == want_len, f"{x}.{attr} has {got} entries for {n} tokens"


def check_invariants(cache: Any, request_kv: Optional[torch.Tensor] = None,
                     request_states: Optional[torch.Tensor] = None) -> None:
    tree, rule, host = cache.tree, cache.rule, cache.host_tier
    ps, root, pol, host_on = tree.page_size, tree.root, tree.policy, host.enabled
    assert root.parent is None and root.key == [] and root.full_lock_ref == 0 and root.mamba_lock_ref == 0
    s = Seen()
    full_ev = full_pr = 0
    ops = list(host.ops)
    stack = [root]
    while stack:
        x = stack.pop()
        assert x.alive and x.owner is tree.token, f"dead or foreign node in the tree: {x}"
        sub_locks = 0
        for ck, c in x.children.items():
            assert c.parent is x, f"{c} does not point back to its parent"
            assert c.ck == ck, f"{c} is filed under {ck!r}, its key says {c.ck!r}"
            assert ck == tree.child_key(c.key, 0, x is root, tree.key_salt(ck) if x is root else None), (
                f"child key {ck!r} does not match {c}")
            sub_locks += c.full_lock_ref
            stack.append(c)
        if x is root:
            continue
        n, p = len(x.key), x.parent
        assert n > 0 and n % ps == 0, f"span of {x} is not whole pages"
        assert x.mamba_lock_ref >= 0 and x.full_lock_ref >= 0, f"negative lock on {x}"
        assert x.full_lock_ref == x.mamba_lock_ref + sub_locks, f"full lock of {x} != own + children's"
        assert x.children or x.payload.resumable or x.full_lock_ref > 0 or x.tickets, f"unlocked tombstone leaf {x}"
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
        check_lengths(x, x, ("value", "value_pending", "host_kv", "host_pending"), n, ps)
        if x.value is not None:
            s.add("kv", pages(x, x.value.tolist(), ps, "KV"), "KV page")
            if x.full_lock_ref:
                full_pr += n
            else:
                full_ev += n
        if x.value_pending is not None:
            s.add("kv_pending", pages(x, x.value_pending.tolist(), ps, "KV"), "KV page")
        for attr in ("host_kv", "host_pending"):
            if getattr(x, attr) is not None:
                s.add(attr, getattr(x, attr), f"host {attr} slot")
        # the candidate sets, recomputed
        idle = not x.tickets
        unlocked = idle and x.full_lock_ref == 0
        if x.value is not None and unlocked and not any(c.value is not None or c.value_pending is not None
                                                        for c in x.children.values()):
            s.want["kv"].add(x)
        if host_on and x.host_kv is not None and unlocked and not any(
                c.host_kv is not None or c.host_pending is not None for c in x.children.values()):
            s.want["kv_host"].add(x)
        rule.check_node(x, s, idle, unlocked)
    assert (full_ev, full_pr) == (tree.full_evictable, tree.full_protected), (
        f"full sizes {(tree.full_evictable, tree.full_protected)} != recomputed {(full_ev, full_pr)}")
    assert (s.state_ev, s.state_pr) == (tree.state_evictable, tree.state_protected), (
        f"mamba sizes {(tree.state_evictable, tree.state_protected)} != recomputed {(s.state_ev, s.state_pr)}")
    for r, w in s.want.items():
        assert pol.candidates(r) == w, f"{r} eviction candidates are wrong: extra {pol.candidates(r) - w}, " \
                                       f"missing {w - pol.candidates(r)}"

    # ops: every node an op names knows it; what it holds is in flight
    for op in ops:
        for y in op.nodes:
            assert op in y.tickets, f"op {op.kind} names {y}, which does not know it"
        if op.scratch is not None:
            s.add("scratch", ids(op.scratch), "T1 scratch slot")

    # Every slot of every pool is exactly one of: free, cached, a request's, in flight.
    kv_pages, inflight_kv = s.sets["kv"], s.sets["kv_pending"]
    live_pages = set(tree.kv.live_virtual_ids())
    owned = set(np.nonzero(tree.owned)[0].tolist())
    assert owned == kv_pages, "the tree's KV ownership map disagrees with its nodes"
    assert not (kv_pages & inflight_kv), "a KV page is both cached and in flight"
    assert kv_pages | inflight_kv <= live_pages, (
        f"cached or in-flight KV pages are free in T0: {sorted((kv_pages | inflight_kv) - live_pages)[:8]}")
    if request_kv is not None:
        req_pages = {i // ps for i in ids(request_kv)}
        assert not (req_pages & (kv_pages | inflight_kv)), "pages both the tree's and a request's"
        assert live_pages == kv_pages | inflight_kv | req_pages, (
            f"T0 KV pages neither free, cached, in flight nor a request's: "
            f"{sorted(live_pages - kv_pages - inflight_kv - req_pages)[:8]}; "
            f"a request's but free: {sorted(req_pages - live_pages)[:8]}")
    rule.check_slots(s, request_states)
    if host_on:
        for region, held, pending in [(host.kv_region, s.sets["host_kv"], s.sets["host_pending"])] + s.host:
            alloc = set(region.allocator.allocated_ids())
            assert not (held & pending), f"host {region.name}: a slot is both owned and in flight"
            assert alloc == held | pending, (
                f"host {region.name}: slots neither free, owned nor in flight: {sorted(alloc - held - pending)[:8]}; "
                f"free but held: {sorted((held | pending) - alloc)[:8]}")
            assert all(region.valid[h] for h in held), f"host {region.name}: a slot a node owns is not valid"
            busy = set(region.allocator.busy_ids)
            assert busy <= held | pending, f"host {region.name}: a busy slot is nobody's"
        host.mirror.check_invariants()
    cache.pool.check_invariants()
