"""T3 in the radix cache: T2 entries written to a ``StorageTier``, and T3 -> T2 prefetch on a miss.

The tree calls these (all on the engine's thread; none blocks except the ``wait_complete`` /
``timeout`` prefetch policies, always bounded)::

    on_backup(op)          a T2 backup landed: its KV pages go to T3 (a snapshot of the host slots,
                           so the tree may free them at once); write-through only
    on_kv_demoted(node)    eviction freed the node's device KV, its T2 copy stays: without
                           write-through, its KV pages go to T3 now
    on_state(node)         a state was cached (write-through) or demoted T1 -> T2: it goes to T3
    maybe_prefetch(...)    match_prefix: the walk stopped at a node boundary (root included), or
                           diverged inside a node (split there when the fetch lands), whose
                           node is on the host, and pages follow: ask T3 which of them it holds
                           (``lookup``), then fetch the longest run of KV pages that ends at a page
                           whose state T3 also holds into fresh T2 slots (host KV LRU and the
                           LRU unlocked T2 state evicted for room, the anchor's path kept), then
                           hang a host-only node (``host_kv`` + ``state_host``) under the anchor.
                           The next match (``wait_*``: this very one) finds it and
                           ``init_load_back`` loads it.
    poll()                 check_hicache_events: advance fetches whose storage ops are done
    cancel(req)            the request was aborted: its fetches stop; their slots go back when done

Keys: ``tier.keys`` over the node's token path from the root, for the tenant of the path: the tier's
``salt`` and the path's ``RadixKey.extra_key`` (``None`` and ``""`` apart, as the tree keeps them),
so two caches whose tiers carry other salts, or two requests with other keys, share no T3 entry;
states use the key of the page they end at, under ``Kind.STATE``.
Anything wrong below (miss, damage, backend down, no T2 room, the tree changed meanwhile) makes the
fetch a miss, counted in ``cache.stats`` as ``t3_*``; the tier counts its own reasons in ``tier.stats``.

While a fetch is in flight its T2 slots belong to it, not to a node: ``check_invariants`` run in
that window would report them; the engine checks invariants when idle (no fetch pending).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Optional

from tiered_cache.config import PREFETCH_POLICIES
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix.checks import common_len
from tiered_cache.radix.node import TreeNode
from tiered_cache.storage.format import Kind
from tiered_cache.transfer.moves import demote_states
from tiered_cache.validate import choice_arg, float_arg

WAIT_COMPLETE_BOUND_S = 60.0  # "wait for completion" still never waits forever


@dataclasses.dataclass(eq=False)
class _Fetch:
    req: Any
    salt: Optional[str]
    toks: list
    start: int  # tokens of the anchor's path
    anchor: TreeNode
    keys: list  # page keys after the anchor
    ops: list
    phase: str = "lookup"
    pages: int = 0
    slots: Optional[list] = None
    state_slot: Optional[int] = None
    cancelled: bool = False
    cut: int = 0  # tokens into ``anchor`` where the query diverged (0: at its end)


class StorageHook:
    def __init__(self, cache: Any, tier: Any, *, policy: str = "best_effort", timeout_s: float = 1.0,
                 write_through: bool = True) -> None:
        if cache.host is None:
            raise InvalidArgumentError("storage", "None without a host tier (T3 prefetches into T2)", tier)
        if not cache.supports_mamba():
            raise InvalidArgumentError("storage", "None in SWA mode (T3 is wired for the mamba tree only)", tier)
        choice_arg("prefetch_policy", policy, PREFETCH_POLICIES)
        timeout_s = float_arg("prefetch_timeout_s", timeout_s, lo=0, lo_open=True)
        if not isinstance(write_through, bool):
            raise InvalidTypeError("storage_write_through", "a bool", write_through)
        if tier.fingerprint.page_size != cache.page_size:
            raise InvalidArgumentError("storage", f"a tier of page_size {cache.page_size}",
                                       tier.fingerprint.page_size)
        self.cache, self.tree, self.tier, self.policy = cache, cache.tree, tier, policy
        self.timeout_s, self.write_through = timeout_s, write_through
        self.fetches: list[_Fetch] = []
        self.agree: Any = None  # parallel.Agreement under tensor parallelism: a hit counts on every rank or none

    # ----------------------------------------------------------------------------- keys
    def _node_keys(self, x: TreeNode) -> list[bytes]:
        toks, salt = self.tree.path_tokens(x)
        keys = self.tier.keys(toks, extra_key=salt)
        return keys[len(keys) - len(x.key) // self.cache.page_size:]

    # ----------------------------------------------------------------------------- writes
    def on_backup(self, op: Any) -> None:
        """A T2 backup landed: under write-through its KV pages go to T3 now."""
        if not self.write_through:
            return  # they go when eviction demotes them (on_kv_demoted), not when copied
        for y in op.nodes:
            self._put_kv(y)

    def on_kv_demoted(self, x: TreeNode) -> None:
        """``x``'s device KV was evicted and its complete T2 copy stays: without write-through, this
        is when its KV pages go to T3 (with it, they went when the backup landed)."""
        if not self.write_through:
            self._put_kv(x)

    def _put_kv(self, y: TreeNode) -> None:
        c = self.cache
        if not y.alive or y.host_kv is None or y is c.root:
            return
        r = c.kv_region
        keys = self._node_keys(y)
        self.tier.put(keys, Kind.KV, [r.slot(s).numpy().copy() for s in y.host_kv],
                      t2_checksums=[int(r.checksums[s]) for s in y.host_kv])
        c.stats["t3_kv_pages_written"] += len(keys)

    def on_state(self, x: TreeNode, demoted: bool) -> None:
        """``x``'s state was cached (``demoted`` False: only under write-through) or went T1 -> T2."""
        c = self.cache
        if demoted == self.write_through or x is c.root or not x.alive:
            return  # write-through wrote it when it was cached; otherwise it goes when demoted
        r = c.state_region
        h, tmp = x.payload.state_host, None
        if h is None:
            if x.payload.mamba_value is None:
                return
            got = r.alloc(1)  # a scratch T2 slot: never evicts for it
            if got is None:
                c.stats["t3_state_write_no_room"] += 1
                return
            tmp = h = got[0]
            t = demote_states(c.engine, c.ckpt, [int(x.payload.mamba_value)], r, [h])
            c.engine.wait(t)
            if t is None or not all(t.ok):
                r.free([h])
                return
        try:
            key = self._node_keys(x)[-1]
            self.tier.put([key], Kind.STATE, [r.slot(h).numpy().copy()], t2_checksums=[int(r.checksums[h])])
            c.stats["t3_states_written"] += 1
        finally:
            if tmp is not None:
                r.free([tmp])

    # ----------------------------------------------------------------------------- prefetch
    def _anchor(self, toks: list, salt: Optional[str], end: int) -> Optional[tuple[TreeNode, int, int]]:
        """Where the walk of ``toks[:end]`` stops with pages left: ``(node, tokens walked, cut)``, at the end
        of ``node`` (``cut`` 0) or, where the query diverges inside ``node``, ``cut`` tokens into it (the
        fetched node hangs under its upper half once split there); else None."""
        tree = self.tree
        ps, node, i = tree.page_size, tree.root, 0
        while i < end:
            child = tree.child(node, toks, i, salt)
            if child is None:
                return node, i, 0
            if child.value is None and child.host_kv is None:
                return None
            m = common_len(child.key, toks, i, end, ps)
            if m < len(child.key):
                return (child, i + m, m) if i + m < end else None
            i += m
            node = child
        return None

    def maybe_prefetch(self, toks: list, salt: Optional[str], req: Any) -> None:
        c = self.cache
        end = len(toks) // c.page_size * c.page_size
        found = self._anchor(toks, salt, end)
        if found is None:
            return
        anchor, start, cut = found
        if anchor is not c.root and anchor.host_kv is None and anchor.host_pending is None:
            c.stats["t3_skip_anchor_not_on_host"] += 1  # host copies must stay a prefix from the root
            return
        ps = c.page_size
        first = tuple(toks[:start + ps])
        for f in self.fetches:
            if f.salt == salt and tuple(f.toks[:f.start + ps]) == first:
                return  # already being fetched
        keys = self.tier.keys(toks[:end], extra_key=salt)[start // ps:]
        ops = [self.tier.lookup(keys, Kind.KV), self.tier.lookup(keys, Kind.STATE)]
        f = _Fetch(req, salt, list(toks[:end]), start, anchor, keys, ops, cut=cut)
        self.fetches.append(f)
        c.stats["t3_lookups"] += 1
        if self.policy != "best_effort":
            bound = WAIT_COMPLETE_BOUND_S if self.policy == "wait_complete" else self.timeout_s
            deadline = time.monotonic() + bound
            while f in self.fetches and f.ops:
                for op in f.ops:
                    self.tier.wait(op, max(0.0, deadline - time.monotonic()))
                if not (all(op.done for op in f.ops) if self.agree is None else self.agree.fetches([f])):
                    c.stats["t3_wait_timed_out"] += 1  # it goes on in the background
                    return
                self._advance(f)

    def poll(self, ready: Optional[list] = None) -> None:
        """Advance the fetches whose storage ops are done (``ready``: those the TP ranks agreed on)."""
        self.tier.poll()
        for f in list(self.fetches) if ready is None else ready:
            if f in self.fetches and (ready is not None or all(op.done for op in f.ops)):
                self._advance(f)

    def cancel(self, req: Any) -> None:
        for f in self.fetches:
            if f.req is req and not f.cancelled:
                f.cancelled = True
                for op in f.ops:
                    self.tier.cancel(op)
                self.cache.stats["t3_cancelled"] += 1

    def drain(self) -> None:
        """For ``reset``: stop every fetch and give its slots back (bounded by the backend timeouts)."""
        for f in self.fetches:
            f.cancelled = True
            for op in f.ops:
                self.tier.cancel(op)
        for f in list(self.fetches):
            for op in f.ops:
                self.tier.wait(op, WAIT_COMPLETE_BOUND_S)
            self._drop(f)

    def _drop(self, f: _Fetch) -> None:
        c = self.cache
        if any(not op.done for op in f.ops):  # a worker may still write the slots: leak rather than reuse
            c.stats["t3_slots_abandoned"] += 1
        else:
            if f.slots:
                c.kv_region.free(f.slots)
            if f.state_slot is not None:
                c.state_region.free([f.state_slot])
        f.slots, f.state_slot = None, None
        if f in self.fetches:
            self.fetches.remove(f)

    def _state_slot(self, anchor: TreeNode) -> Optional[list]:
        """A T2 state slot for a fetch: a free one, else the LRU unlocked T2 state is evicted for it
        (``anchor``'s path kept, as ``alloc_pages`` keeps it for the KV). None: none can be had."""
        c, tree = self.cache, self.tree
        h = c.state_region.alloc(1)
        if h is not None or not tree.policy.size("state_host"):
            return h
        tree.lock(anchor)
        try:
            if c.state_tier.evict_host_states(1):
                h = c.state_region.alloc(1)
        finally:
            tree.unlock(anchor, prune=False)
        return h

    def _advance(self, f: _Fetch) -> None:
        c = self.cache
        if f.cancelled:
            self._drop(f)
            return
        if f.phase == "lookup":
            kv, st = f.ops[0].hits, f.ops[1].hits
            p = 0
            for j in range(len(f.keys)):
                if not kv[j]:
                    break
                if st[j]:
                    p = j + 1
            if p == 0 or not f.anchor.alive:
                c.stats["t3_miss"] += 1
                self._drop(f)
                return
            got = c.host_tier.alloc_pages([(c.kv_region, p)], f.anchor)
            h = self._state_slot(f.anchor) if got is not None else None
            if got is None or h is None or not f.anchor.alive:
                if h is not None:
                    c.state_region.free(h)
                if got is not None:
                    c.kv_region.free(got[0])
                c.stats["t3_no_room"] += 1
                self._drop(f)
                return
            f.slots, f.state_slot, f.pages, f.phase = got[0], h[0], p, "prefetch"
            f.ops = [self.tier.prefetch(f.keys[:p], Kind.KV, c.kv_region, f.slots),
                     self.tier.prefetch([f.keys[p - 1]], Kind.STATE, c.state_region, [f.state_slot])]
            return
        kv_op, st_op = f.ops
        ok = kv_op.hit_prefix == f.pages and st_op.hit_prefix == 1
        again = self._anchor(f.toks, f.salt, len(f.toks)) if ok else None
        moved = again is None or again[0] is not f.anchor or again[1:] != (f.start, f.cut)
        if not ok or moved or not f.anchor.alive or (
                f.anchor is not c.root and f.anchor.host_kv is None and f.anchor.host_pending is None):
            c.stats["t3_miss" if not ok else "t3_tree_changed"] += 1
            self._drop(f)
            return
        tree = self.tree
        assert f.slots is not None, "a fetch past its lookup holds its T2 slots"
        if f.cut:  # the query diverged inside the anchor: its upper half (host pages included) anchors it
            f.anchor = tree.split(f.anchor, f.cut)
            c.stats["t3_split_anchors"] += 1
        key = f.toks[f.start:f.start + f.pages * c.page_size]
        x = tree.link(f.anchor, key, None, f.salt)
        x.host_kv, x.payload.state_host = list(f.slots), f.state_slot
        f.slots, f.state_slot = None, None
        tree.policy.touch("kv", x)
        tree.policy.touch("state", x)
        tree.sync(x)
        tree.sync(f.anchor)
        c.stats["t3_hits"] += 1
        c.stats["t3_hit_tokens"] += len(key)
        self.fetches.remove(f)
