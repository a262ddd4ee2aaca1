"""The host tier (T2) of the radix cache: backups, T2 room, and applying finished transfers.

Bytes move through the ``TransferEngine`` (``moves.py``); ``HostTier`` decides what moves and keeps
the tree in step, through the ``RadixTree``'s methods. A move is an ``Op``: its tickets, the nodes whose
data it reads or writes (their ``tickets`` list holds it, so they are never dropped and never
victims), and what finishing does::

    backup (D2H)   node.value --> node.host_pending ..ticket done..> node.host_kv
    load   (H2D)   node.host_kv --> node.value_pending ..done + checksums ok..> node.value   (loadback.py)

The tree changes where a node lives only when ``check_events`` (``check_hicache_events``, called by
the engine every step) sees the op's tickets done. Eviction-driven moves (a write-back of a victim)
wait for their ticket right away: ``evict`` must hand back room now, as SGLang's write-back does.
Backups for write-through and loads run in the background. Backed-up nodes form a contiguous prefix
from the root: a backup copies the path down from the deepest node already on the host, in one ticket
per ``Stream`` (the KV, and any KV-like data the resume rule adds, such as SWA pages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional

import torch

from tiered_cache.errors import IntegrityError, InvalidArgumentError
from tiered_cache.radix.frees import Frees
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import HostTierConfig
from tiered_cache.radix.tree import RadixTree
from tiered_cache.transfer.moves import demote_kv
from tiered_cache.validate import instance_arg


@dataclasses.dataclass(frozen=True)
class Stream:
    """One kind of KV page the tree moves: where a node holds it (``on(node)``: the node itself, or its
    payload), the attribute names there, its T0 side, its T2 region, and the ``Frees`` sinks of its T0
    ids and of its host pages."""

    name: str
    on: Callable[[TreeNode], Any]
    dev: str
    pending: str
    host: str
    host_pending: str
    side: Any
    region: Any
    sink: str
    host_sink: str

    def get(self, x: TreeNode, attr: str) -> Any:
        return getattr(self.on(x), getattr(self, attr))

    def set(self, x: TreeNode, attr: str, v: Any) -> None:
        setattr(self.on(x), getattr(self, attr), v)


@dataclasses.dataclass(eq=False)
class Op:
    kind: str  # "backup" | "load"
    tickets: dict
    nodes: list  # top-down; a split inserts the new upper half before its lower half
    finish: Callable[[Op], None]  # applies it to the tree once its tickets are done
    lock: Optional[TreeNode] = None  # a load's own lock on its best node, released when it finishes
    scratch: Optional[torch.Tensor] = None  # T1 slot a state restore lands in (freed when it finishes)
    scratch_id: int = 0  # its host id
    handle: Any = None  # a load's ``LoadBack``


def check_args(host: Any, transfer: Any, config: Any, storage: Any) -> None:
    """Every argument of the host tier, checked before anything is built (a bad one leaves nothing behind)."""
    from tiered_cache.storage import StorageTier
    from tiered_cache.tiers.host_mirror import HostMirror
    from tiered_cache.transfer.engine import TransferEngine

    instance_arg("host", host, HostMirror, "a HostMirror", none_ok=True)
    instance_arg("transfer", transfer, TransferEngine, "a TransferEngine", none_ok=True)
    instance_arg("host_config", config, HostTierConfig, "a HostTierConfig", none_ok=True)
    instance_arg("storage", storage, StorageTier, "a StorageTier", none_ok=True)
    if host is not None and transfer is None:
        raise InvalidArgumentError("transfer", "a TransferEngine beside host (TieredCache.build makes one)", None)


class HostTier:
    """T2 under ``tree``: ``mirror`` (a ``HostMirror``, or None: the GPU tiers alone, every method a
    no-op), its ``engine`` (``TransferEngine``), ``conf`` (``HostTierConfig``), the ops in flight,
    ``t3`` (a ``StorageHook``, set by the cache that has T3) and ``loads`` (``loadback.Loads``)."""

    def __init__(self, tree: RadixTree, mirror: Any, transfer: Any, config: Optional[HostTierConfig]) -> None:
        self.tree = tree
        self.mirror = mirror
        self.conf = config or HostTierConfig()
        self.t3: Any = None
        self.agree: Any = None  # parallel.Agreement under tensor parallelism: settle agrees on checksums
        self.ops: list[Op] = []
        self.streams: list[Stream] = []
        self.kv_region: Any = None
        self.engine: Any = None
        self.loads: Any = None
        if mirror is None:
            return
        self.engine = transfer
        self.kv_region = self.region(self.conf.kv_region, tree.kv.entry_bytes, "kv_host")
        self.add_stream(Stream("kv", _node, "value", "value_pending", "host_kv", "host_pending", tree.kv,
                               self.kv_region, "kv", "kv_host"))
        tree.host_on = True

    @property
    def enabled(self) -> bool:
        return self.mirror is not None

    @property
    def busy(self) -> bool:
        """Transfers of the tree are in flight (backups or loads not applied yet)."""
        return bool(self.ops)

    def region(self, name: str, slot_bytes: int, sink: str) -> Any:
        """The mirror's region ``name`` of ``slot_bytes``-byte slots, registered as the ``Frees`` sink ``sink``."""
        r = self.mirror.region(name)
        if r.slot_bytes != slot_bytes:
            raise InvalidArgumentError("host", f"region {name!r} of {slot_bytes}-byte slots", r.slot_bytes)
        self.tree.sinks[sink] = r
        return r

    def add_stream(self, s: Stream) -> None:
        self.streams.append(s)

    # ----------------------------------------------------------------------------- events
    def check_events(self) -> None:
        """Apply every finished transfer to the tree. The tier polls its ``TransferEngine``; another
        user of the same engine must track its own tickets by ``ticket.done``, not by what ``poll`` returns."""
        if self.engine is None:
            return
        self.engine.poll()
        self.apply_ops(lambda op: all(t.done for t in op.tickets.values()))
        if self.t3 is not None:
            self.t3.poll()

    def apply_ops(self, which: Callable[[Op], bool]) -> bool:
        ready = [op for op in self.ops if which(op)]
        for op in ready:
            self.ops.remove(op)
            op.finish(op)
        return bool(ready)

    def settle(self, kind: str) -> bool:
        """Wait for every op of ``kind`` and apply it. -> whether there was one."""
        if self.engine is None:
            return False
        ops = [op for op in self.ops if op.kind == kind]
        for op in ops:
            for t in op.tickets.values():
                self.engine.wait(t)
        if self.agree is not None and ops:
            self.agree.settle(ops)  # every rank waited here: a checksum failed anywhere fails everywhere
        return self.apply_ops(lambda op: op in ops)

    def settle_loads(self, path: list, prev: int, pending: bool) -> bool:
        """Before an insert: settle the loads its caller may have computed on. ``path``: the insert's
        (``RadixTree.probe``'s); ``pending``: a node on it is still being loaded into. Also settled: a load
        ending (its lock) at a node of the caller's first ``prev`` tokens, even one bringing only the state.
        A load of those that failed its checksum: ``IntegrityError`` (the load applied, its garbage dropped,
        nothing else changed): the caller's KV and state past it were computed on garbage, so nothing may be
        cached; it releases the request (``cache_finished_req(req, is_insert=False)``) and recomputes (the
        ``LoadBack`` contract). -> whether it settled."""
        mine: list = []
        loads = [op for op in self.ops if op.kind == "load"] if self.ops else None
        if loads:  # the ends of the caller's prefix's nodes, by node
            ends, n = {}, 0
            for y in path:
                n += len(y.akey)
                if n > prev:
                    break
                ends[id(y)] = n
            mine = [(op, ends[id(op.lock)]) for op in loads if id(op.lock) in ends]
        if not (pending or mine):
            return False
        self.settle("load")
        bad = [end for op, end in mine if not op.handle.ok]
        if bad:
            raise IntegrityError(
                f"prev_prefix_len {prev}: the caller's prefix reads a load back (init_load_back, req.load_back) "
                f"of the tokens up to {bad[0]} that failed its checksum: the KV or state it brought was garbage "
                "and is dropped, and nothing computed on it is cached; release the request "
                "(cache_finished_req(req, is_insert=False)) and recompute")
        return True

    def drain(self) -> None:
        """For ``reset``: wait for everything in flight (T3 fetches too); loads end not ok; the tree
        frees the nodes."""
        if self.t3 is not None:
            self.t3.drain()
        for op in self.ops:
            for t in op.tickets.values():
                self.engine.wait(t)
            if op.scratch is not None:
                self.tree.sinks["t1"].free(op.scratch)
            if op.handle is not None:
                op.handle.done, op.handle.ok = True, False
            for y in op.nodes:
                y.tickets.clear()
        self.ops.clear()
        if self.engine is not None:
            self.engine.poll()

    # ----------------------------------------------------------------------------- backups
    def after_insert(self, node: Optional[TreeNode]) -> None:
        """write_through: what an insert cached goes to T2 now."""
        if self.enabled and self.conf.write_policy == "write_through" and node is not None \
                and node is not self.tree.root and node.alive:
            self.backup_path(node)

    def count_hits(self, path: list[TreeNode], best: TreeNode) -> None:
        """write_through_selective: a node matched ``write_through_threshold`` times is backed up. Every node of
        the matched path down to ``best`` counts the match (SGLang's ``hit_count``; the resumption at ``best``
        is ``resumes``, counted by the resume rule: the policies read that one)."""
        if not self.enabled or self.conf.write_policy != "write_through_selective":
            return
        target = None
        for x in path:
            x.hit_count += 1
            if x.value is not None and x.hit_count >= self.conf.write_through_threshold and x.host_kv is None:
                target = x
            if x is best:
                break
        if target is not None and target.host_pending is None:
            self.backup_path(target)

    def backup_path(self, x: TreeNode) -> Optional[Op]:
        """Start copying ``x`` and its ancestors not yet on the host to T2. ``None``: nothing to do,
        or no room even after evicting host LRU entries (counted in ``stats``; the tree is unchanged)."""
        tree = self.tree
        chain = []
        y = x
        while y is not tree.root and y.host_kv is None and y.host_pending is None:
            if y.value is None or y.tickets:
                return None
            chain.append(y)
            y = y.parent
        if not chain:
            return None
        chain.reverse()
        ps = tree.page_size
        per = [(s, [n for n in chain if s.get(n, "dev") is not None]) for s in self.streams]
        slots = self.alloc_pages([(s.region, sum(len(n.key) for n in ns) // ps) for s, ns in per], x)
        if slots is None:
            tree.stats["backup_no_room"] += 1
            return None
        op = Op("backup", {}, chain, self.apply_backup)
        for (s, ns), hs in zip(per, slots):
            if not ns:
                continue
            ids = torch.cat([s.get(n, "dev") for n in ns])
            op.tickets[s.name] = demote_kv(self.engine, s.side, ids, s.region, hs)
            k = 0
            for n in ns:
                m = len(n.key) // ps
                s.set(n, "host_pending", hs[k:k + m])
                k += m
        for n in chain:
            n.tickets.append(op)
            tree.sync(n)
        tree.sync(chain[0].parent)
        self.ops.append(op)
        tree.stats["backups"] += 1
        return op

    def backup_sync(self, x: TreeNode) -> bool:
        """Back ``x``'s path up and wait for it (write-back of an eviction victim)."""
        op = self.backup_path(x)
        if op is None:
            return False
        for t in op.tickets.values():
            self.engine.wait(t)  # the victim's pages are freed right after: the copy must have read them
        self.ops.remove(op)
        self.apply_backup(op)
        return True

    def apply_backup(self, op: Op) -> None:
        tree = self.tree
        for y in op.nodes:
            y.tickets.remove(op)
            for s in self.streams:
                p = s.get(y, "host_pending")
                if p is not None:
                    s.set(y, "host", p)
                    s.set(y, "host_pending", None)
        for y in op.nodes:
            tree.sync(y)
        tree.sync(op.nodes[0].parent)
        if self.t3 is not None:
            self.t3.on_backup(op)
        for y in reversed(op.nodes):  # a tombstone that lost its children while it was being copied
            if y.alive:
                tree.prune_up(y)

    # ----------------------------------------------------------------------------- room
    def alloc_pages(self, needs: list, protect: TreeNode) -> Optional[list]:
        """Host pages per ``(region, n)``; evicts host LRU KV (``protect``'s path kept) only when that
        is sure to make room, so a refusal changes nothing."""
        tree = self.tree
        short = [(r, n - r.available_size()) for r, n in needs if n > r.available_size()]
        if short:
            tree.lock(protect)
            try:
                if not self._reclaimable(short):
                    return None
                while any(n > r.available_size() for r, n in needs):
                    want = max(n - r.available_size() for r, n in needs) * tree.page_size
                    if not self.evict_kv(want):
                        return None
            finally:
                tree.unlock(protect, prune=False)
        out = [r.alloc(n) if n else [] for r, n in needs]
        if any(o is None for o in out):
            for (r, _), o in zip(needs, out):
                if o:
                    r.free(o)
            return None
        return out

    def _reclaimable(self, short: list) -> bool:
        """Would evicting host KV free ``short`` pages per region? Counts host leaves, then parents
        all of whose host children would go (what ``evict_kv`` would reach), until enough: the leaves are
        drawn from the policy one at a time (no copy of its set), a parent's host children counted once, so
        the work is what it reads before the answer (which is the same in any order: what evicting reaches)."""
        root = self.tree.root
        got = {id(r): 0 for r, _ in short}
        want = {id(r): n for r, n in short}
        leaves, parents = self.tree.policy.iter_candidates("kv_host"), list[TreeNode]()
        seen: dict[int, list[int]] = {}  # parent id -> [its host children counted, how many it has]
        while any(got[k] < want[k] for k in got):
            y = parents.pop() if parents else next(leaves, None)
            if y is None:
                break
            for s in self.streams:
                pages = s.get(y, "host")
                if pages is not None and id(s.region) in got:
                    got[id(s.region)] += len(pages)
            p = y.parent
            if p is root or p.host_kv is None or p.full_lock_ref or p.tickets:
                continue
            c = seen.get(p.id)
            if c is None:
                c = seen[p.id] = [0, sum(1 for z in p.children.values()
                                         if z.host_kv is not None or z.host_pending is not None)]
            c[0] += 1
            if c[0] == c[1]:
                parents.append(p)
        return all(got[k] >= want[k] for k in got)

    def evict_kv(self, num: int) -> int:
        """Drop T2 KV (every stream's pages) of host leaves, LRU first; a node left with KV nowhere goes
        (it is a leaf). -> tokens."""
        return self.tree.evict_each("kv_host", num, self._evict_one)

    def _evict_one(self, x: TreeNode, f: Frees) -> int:
        for s in self.streams:
            pages = s.get(x, "host")
            if pages is not None:
                f.put_pages(s.host_sink, pages)
                s.set(x, "host", None)
        if x.value is not None:
            self.tree.sync(x)
            self.tree.sync(x.parent)
        else:
            assert not x.children, f"{x} is on the host only but has children"
            self.tree.drop_leaf(x, f)
        return len(x.key)


def _node(x: TreeNode) -> TreeNode:
    return x
