"""The host tier (T2) of the radix cache: backups, load back, and applying finished transfers.

Bytes move through the ``TransferEngine`` (``moves.py``); this module decides what moves and keeps
the tree in step. A move is an ``Op``: its tickets, the nodes whose data it reads or writes (their
``tickets`` list holds it, so they are never dropped and never victims), and what finishing does::

    backup (D2H)   node.value --> node.host_pending ..ticket done..> node.host_kv
    load   (H2D)   node.host_kv --> node.value_pending ..done + checksums ok..> node.value
                   state: T2 slot --> T1 scratch --dequantize--> the request's T0 slot

The tree changes where a node lives only when ``check_hicache_events`` (called by the engine every
step) sees the op's tickets done. A load whose checksum fails drops the corrupt host copy (counted
in ``stats``): the node, and everything below it that was reachable only through it, becomes a miss;
a node a request still holds stays as a *dead* node (KV nowhere) until its last lock goes.

Eviction-driven moves (T1 state -> T2, write-back of a victim) wait for their ticket right away:
``evict`` must hand back room now, as SGLang's write-back does. Backups for write-through and loads
run in the background. Backed-up nodes form a contiguous prefix from the root: a backup copies the
path down from the deepest node already on the host, in one ticket per region.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix.checks import check_node, check_state_allocated, state_slot
from tiered_cache.radix.evict import Frees
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import HostTierConfig, InitLoadBackParams
from tiered_cache.transfer.moves import demote_kv, demote_states, load_kv, restore_states
from tiered_cache.validate import choice_arg, instance_arg, int_arg


@dataclasses.dataclass(frozen=True)
class Stream:
    """One kind of KV page the tree moves: the node attributes that hold it, its T0 side, its T2 region."""

    name: str
    dev: str
    pending: str
    host: str
    host_pending: str
    side: Any
    region: Any


@dataclasses.dataclass
class LoadBack:
    """What ``init_load_back`` started (``req.load_back``). Before using the loaded KV, wait on its
    layers (``wait_layer``); once ``done`` (after ``check_hicache_events``), ``ok`` False means a
    checksum failed: the loaded prefix is garbage, the request must release its lock and recompute."""

    device_indices: torch.Tensor
    last_node: TreeNode
    tickets: dict
    state_slot: Optional[torch.Tensor] = None
    swa_indices: Optional[torch.Tensor] = None
    done: bool = False
    ok: bool = False

    def wait_layer(self, layer: int, stream: Any = None, kind: str = "kv") -> None:
        """Make ``stream`` (default: the current one) wait until layer ``layer`` of the ``kind`` KV
        (``"kv"``: the full-attention layers; ``"swa"``: the sliding-window layers, in their own
        order) has landed. A kind this load does not move has nothing to wait for."""
        choice_arg("kind", kind, ("kv", "swa"))
        layer = int_arg("layer", layer, lo=0)
        t = self.tickets.get(kind)
        if t is not None:
            t.wait_layer(layer, stream)


@dataclasses.dataclass(eq=False)
class Op:
    kind: str  # "backup" | "load"
    tickets: dict
    nodes: list  # top-down; a split inserts the new upper half before its lower half
    lock: Optional[TreeNode] = None  # a load's own lock on its best node, released when it finishes
    scratch: Optional[torch.Tensor] = None  # T1 slot a state restore lands in
    handle: Optional[LoadBack] = None


class HostTierMixin:
    def _init_host(self, host: Any, transfer: Any, config: Optional[HostTierConfig], storage: Any = None) -> None:
        from tiered_cache.storage import StorageTier
        from tiered_cache.tiers.host_mirror import HostMirror
        from tiered_cache.transfer.engine import TransferEngine

        # Check every argument before anything is built (a bad one must leave nothing behind).
        instance_arg("host", host, HostMirror, "a HostMirror", none_ok=True)
        instance_arg("transfer", transfer, TransferEngine, "a TransferEngine", none_ok=True)
        instance_arg("host_config", config, HostTierConfig, "a HostTierConfig", none_ok=True)
        instance_arg("storage", storage, StorageTier, "a StorageTier", none_ok=True)
        self.host = host
        self.t3 = None
        self.hconf = config or HostTierConfig()
        self._ops: list[Op] = []
        self.stats: collections.Counter = collections.Counter()
        self._streams: list[Stream] = []
        if host is None:
            self.engine = None
            return
        if transfer is None:
            transfer = TransferEngine(self.device)
        self.engine = transfer
        self.kv_region = self._region(self.hconf.kv_region, self.kv.entry_bytes)
        self._streams.append(Stream("kv", "value", "value_pending", "host_kv", "host_pending", self.kv, self.kv_region))
        if self.mode == "mamba":
            self.state_region = self._region(self.hconf.state_region, self.ckpt.slot_bytes)
        if storage is not None:
            from tiered_cache.radix.storage_hook import StorageHook

            self.t3 = StorageHook(self, storage, policy=self.hconf.prefetch_policy,
                                  timeout_s=self.hconf.prefetch_timeout_s,
                                  write_through=self.hconf.storage_write_through)

    def _region(self, name: str, slot_bytes: int) -> Any:
        r = self.host.region(name)
        if r.slot_bytes != slot_bytes:
            raise InvalidArgumentError("host", f"region {name!r} of {slot_bytes}-byte slots", r.slot_bytes)
        return r

    # ----------------------------------------------------------------------------- events
    def check_hicache_events(self) -> None:
        """Apply every finished transfer to the tree (the engine calls this every step).

        The cache polls its ``TransferEngine``; another user of the same engine must track its own
        tickets by ``ticket.done`` rather than by what ``poll`` returns."""
        if self.mode == "mamba":
            from tiered_cache.radix.nonfinite import poll

            poll(self)  # NaN/inf flags of earlier stores: landed by now, read without waiting
        if self.engine is None:
            return
        self.engine.poll()
        self._apply_ops(lambda op: all(t.done for t in op.tickets.values()))
        if self.t3 is not None:
            self.t3.poll()

    def cancel_prefetch(self, req: Any) -> None:
        """``req`` was aborted: stop its T3 prefetches (their T2 slots go back once their workers stop)."""
        if self.t3 is not None:
            self.t3.cancel(req)

    def _apply_ops(self, which) -> bool:
        ready = [op for op in self._ops if which(op)]
        for op in ready:
            self._ops.remove(op)
            (self._apply_backup if op.kind == "backup" else self._apply_load)(op)
        return bool(ready)

    def _settle(self, kind: str) -> bool:
        """Wait for every op of ``kind`` and apply it. -> whether there was one."""
        ops = [op for op in self._ops if op.kind == kind]
        for op in ops:
            for t in op.tickets.values():
                self.engine.wait(t)
        return self._apply_ops(lambda op: op in ops)

    def _settle_backups(self) -> bool:
        return self.engine is not None and self._settle("backup")

    def _settle_loads(self) -> bool:
        return self.engine is not None and self._settle("load")

    def _drain_ops(self) -> None:
        """For ``reset``: wait for everything in flight; loads end not ok; the caller frees the nodes."""
        for op in self._ops:
            for t in op.tickets.values():
                self.engine.wait(t)
            if op.scratch is not None:
                self.ckpt.free(op.scratch)
            if op.handle is not None:
                op.handle.done, op.handle.ok = True, False
            for y in op.nodes:
                y.tickets.clear()
        self._ops.clear()
        if self.engine is not None:
            self.engine.poll()

    # ----------------------------------------------------------------------------- backups
    def _after_insert(self, res: Any) -> None:
        node = res.last_device_node
        if self.host is not None and self.hconf.write_policy == "write_through" and node is not None \
                and node is not self.root and node.alive:
            self._backup_path(node)
        if self.t3 is not None and res.mamba_stored and node is not None and node.alive:
            from tiered_cache.radix.nonfinite import verify

            if verify(self, node):  # T3 is shared: a NaN state never goes there (write-through waits anyway)
                self.t3.on_state(node, demoted=False)

    def _count_hits(self, path: list[TreeNode], best: TreeNode) -> None:
        """write_through_selective: a node matched ``write_through_threshold`` times is backed up."""
        target = None
        for x in path:
            if x is not best:
                x.hit_count += 1
            if x.value is not None and x.hit_count >= self.hconf.write_through_threshold and x.host_kv is None:
                target = x
            if x is best:
                break
        if target is not None and target.host_pending is None:
            self._backup_path(target)

    def _backup_path(self, x: TreeNode) -> Optional[Op]:
        """Start copying ``x`` and its ancestors not yet on the host to T2. ``None``: nothing to do,
        or no room even after evicting host LRU entries (counted in ``stats``; the tree is unchanged)."""
        chain = []
        y = x
        while y is not self.root and y.host_kv is None and y.host_pending is None:
            if y.value is None or y.tickets:
                return None
            chain.append(y)
            y = y.parent
        if not chain:
            return None
        chain.reverse()
        per = [(s, [n for n in chain if getattr(n, s.dev) is not None]) for s in self._streams]
        slots = self._alloc_host_pages([(s.region, sum(len(n.key) for n in ns) // self.page_size) for s, ns in per],
                                       x)
        if slots is None:
            self.stats["backup_no_room"] += 1
            return None
        op = Op("backup", {}, chain)
        for (s, ns), hs in zip(per, slots):
            if not ns:
                continue
            ids = torch.cat([getattr(n, s.dev) for n in ns])
            op.tickets[s.name] = demote_kv(self.engine, s.side, ids, s.region, hs)
            k = 0
            for n in ns:
                m = len(n.key) // self.page_size
                setattr(n, s.host_pending, hs[k:k + m])
                k += m
        for n in chain:
            n.tickets.append(op)
            self._sync(n)
        self._sync(chain[0].parent)
        self._ops.append(op)
        self.stats["backups"] += 1
        return op

    def _backup_sync(self, x: TreeNode) -> bool:
        """Back ``x``'s path up and wait for it (write-back of an eviction victim)."""
        op = self._backup_path(x)
        if op is None:
            return False
        for t in op.tickets.values():
            self.engine.wait(t)  # the victim's pages are freed right after: the copy must have read them
        self._ops.remove(op)
        self._apply_backup(op)
        return True

    def _apply_backup(self, op: Op) -> None:
        for y in op.nodes:
            y.tickets.remove(op)
            for s in self._streams:
                p = getattr(y, s.host_pending)
                if p is not None:
                    setattr(y, s.host, p)
                    setattr(y, s.host_pending, None)
        for y in op.nodes:
            self._sync(y)
        self._sync(op.nodes[0].parent)
        if self.t3 is not None:
            self.t3.on_backup(op)
        for y in reversed(op.nodes):  # a tombstone that lost its children while it was being copied
            if y.alive:
                self._prune_up(y)

    def _alloc_host_pages(self, needs: list, protect: TreeNode) -> Optional[list]:
        """Host pages per ``(region, n)``; evicts host LRU KV (``protect``'s path kept) only when that
        is sure to make room, so a refusal changes nothing."""
        short = [(r, n - r.available_size()) for r, n in needs if n > r.available_size()]
        if short:
            self._lock(protect)
            try:
                if not self._host_reclaimable(short):
                    return None
                while any(n > r.available_size() for r, n in needs):
                    want = max(n - r.available_size() for r, n in needs) * self.page_size
                    if not self._evict_host_kv(want):
                        return None
            finally:
                self._unlock(protect, prune=False)
        out = [r.alloc(n) if n else [] for r, n in needs]
        if any(o is None for o in out):
            for (r, _), o in zip(needs, out):
                if o:
                    r.free(o)
            return None
        return out

    def _host_reclaimable(self, short: list) -> bool:
        """Would evicting host KV free ``short`` pages per region? Counts host leaves, then parents
        all of whose host children would go (what ``_evict_host_kv`` would reach), until enough."""
        got = {id(r): 0 for r, _ in short}
        want = {id(r): n for r, n in short}
        queue = list(self.policy.candidates("kv_host"))
        seen: dict[int, int] = {}
        while queue and any(got[k] < want[k] for k in got):
            y = queue.pop()
            for s in self._streams:
                pages = getattr(y, s.host)
                if pages is not None and id(s.region) in got:
                    got[id(s.region)] += len(pages)
            p = y.parent
            if p is self.root or p.host_kv is None or p.full_lock_ref or p.tickets:
                continue
            seen[p.id] = seen.get(p.id, 0) + 1
            if seen[p.id] == sum(1 for c in p.children.values() if c.host_kv is not None or c.host_pending is not None):
                queue.append(p)
        return all(got[k] >= want[k] for k in got)

    def _alloc_host_state(self) -> Optional[int]:
        r = self.state_region
        h = r.alloc(1)
        if h is None and self.policy.size("state_host"):
            self._evict_host_states(1)
            h = r.alloc(1)
        return None if h is None else h[0]

    def _demote_state_sync(self, x: TreeNode) -> bool:
        """T1 -> T2 for an eviction victim; waits, since its T1 slot is freed right after."""
        h = self._alloc_host_state()
        if h is None:
            return False
        t = demote_states(self.engine, self.ckpt, [int(x.mamba_value)], self.state_region, [h])
        self.engine.wait(t)  # the caller frees the T1 slot next: the D2H copy must have read it
        x.state_host = h
        self.stats["state_demotes"] += 1
        if self.t3 is not None:
            self.t3.on_state(x, demoted=True)
        return True

    # ----------------------------------------------------------------------------- load back
    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        """Start loading the host part of a match: T0 pages for the KV of ``best_match_node``'s path
        below ``last_device_node`` that is on the host only, and the state at ``best_match_node``
        (T2: promoted and dequantized straight into the request's T0 slot; T1: dequantized).

        Returns ``(ids, node)``: the T0 ids of the ``host_hit_length`` tokens (append them to the
        match's ``device_indices``) and the node the prefix now ends at; ``(empty, last_device_node)``
        when nothing is loaded (no room even after evicting, below the threshold, over ``mem_quota``,
        or a node of the path already in flight). Host copies stay; the locks the load takes are
        released when its ticket completes. ``req.load_back`` (a ``LoadBack``) tracks it.
        """
        if not isinstance(params, InitLoadBackParams):
            raise InvalidTypeError("params", "an InitLoadBackParams", type(params).__name__)
        best, hl, quota, req = params.best_match_node, params.host_hit_length, params.mem_quota, params.req
        check_node(self, best, "best_match_node")
        hl = int_arg("host_hit_length", hl, lo=0)
        if quota is not None:
            quota = int_arg("mem_quota", quota, lo=0)
        if self.host is None or hl == 0 or best is self.root:
            return self._empty, best
        if self.mode == "mamba":  # checked before anything changes (stats included)
            if req is None or not hasattr(req, "mamba_pool_idx"):
                raise InvalidArgumentError("req", "a request with .mamba_pool_idx to receive the state", req)
            if req.mamba_pool_idx is not None:
                slot = state_slot(self, "req.mamba_pool_idx", req.mamba_pool_idx)
                if self.validate:
                    check_state_allocated(self, slot, "req.mamba_pool_idx")
        chain, start, n = [], best, 0
        while n < hl and start is not self.root:
            chain.append(start)
            n += len(start.key)
            start = start.parent
        if n != hl:
            raise InvalidArgumentError("host_hit_length", "the tokens from last_device_node to best_match_node", hl)
        chain.reverse()
        miss = (self._empty, start)
        if self.mode == "mamba":
            from tiered_cache.radix.nonfinite import verify

            if not verify(self, best):  # its T1 state held a NaN or an inf: dropped, nothing to load
                return miss
        if any(y.value is None and (y.host_kv is None or y.tickets) for y in chain) or not self._has_state(best):
            return miss
        load = [y for y in chain if y.value is None]
        host_tokens = sum(len(y.key) for y in load)
        if not self._state_on_host(best) and host_tokens < self.hconf.load_back_threshold:
            self.stats["load_back_below_threshold"] += 1
            return miss
        if quota is not None and host_tokens > quota:
            return miss
        self._lock(best)  # the load's own lock: the path and best's state stay until its ticket completes
        op = self._start_load(load, best, req)
        if op is None:
            self._unlock(best)
            self.stats["load_back_no_room"] += 1
            return miss
        ids = torch.cat([y.value if y.value is not None else y.value_pending for y in chain])
        op.handle = LoadBack(ids, best, op.tickets, getattr(req, "mamba_pool_idx", None))
        if req is not None:
            req.load_back = op.handle
        if op.tickets:
            self._ops.append(op)
        else:
            self._apply_load(op)
        self.stats["load_backs"] += 1
        return ids, best

    def _state_on_host(self, best: TreeNode) -> bool:
        return best.mamba_value is None

    def _start_load(self, load: list[TreeNode], best: TreeNode, req: Any) -> Optional[Op]:
        """Allocate T0 room (evicting; the caller holds ``best`` locked) and start the tickets."""
        per = [(s, [y for y in load if getattr(y, s.host) is not None]) for s in self._streams]
        got: list[tuple[Stream, list, torch.Tensor]] = []
        slot = scratch = None
        own_slot = self.mode == "mamba" and req.mamba_pool_idx is None

        def undo() -> None:
            for s, _, ids in got:
                s.side.free(ids)
            if own_slot and slot is not None:
                self.states.free(slot)
            if scratch is not None:
                self.ckpt.free(scratch)

        for s, ys in per:
            ntok = sum(len(y.key) for y in ys)
            if not ntok:
                continue
            ids = self._alloc_side(s.side, ntok)
            if ids is None:
                undo()
                return None
            got.append((s, ys, ids))
        if self.mode == "mamba":
            slot = req.mamba_pool_idx if not own_slot else self._alloc_active_state(best)
            if slot is None:
                undo()
                return None
            slot = state_slot(self, "req.mamba_pool_idx", slot)
            if self._state_on_host(best):
                t1 = self.ckpt.alloc_ids(1) or self._alloc_ckpt_protected(best)
                if t1 is None:
                    undo()
                    return None
                scratch = t1[0]
        op = Op("load", {}, list(load), lock=best, scratch=scratch)
        for s, ys, ids in got:
            hs = [h for y in ys for h in getattr(y, s.host)]
            op.tickets[s.name] = load_kv(self.engine, s.region, hs, s.side, ids, layerwise=True)
            k = 0
            for y in ys:
                setattr(y, s.pending, ids[k:k + len(y.key)])
                k += len(y.key)
        if slot is not None:
            if scratch is not None:
                op.tickets["state"] = restore_states(self.engine, self.state_region, [best.state_host], self.ckpt,
                                                     scratch.tolist(), self.states, slot.tolist())
            else:
                self.ckpt.load_to_active(best.mamba_value, self.states, slot)
            if own_slot:
                req.mamba_pool_idx = slot
        for y in load:
            y.tickets.append(op)
            self._sync(y)
        return op

    def _apply_load(self, op: Op) -> None:
        f = Frees()
        oks = {name: dict(zip(t.host_slots, t.ok)) for name, t in op.tickets.items() if name != "state"}
        failed = None
        for y in op.nodes:
            y.tickets.remove(op)
            good = failed is None
            for s in self._streams:
                pend = getattr(y, s.pending)
                if pend is None:
                    continue
                good = good and all(oks[s.name][h] for h in getattr(y, s.host))
            for s in self._streams:
                pend = getattr(y, s.pending)
                if pend is None:
                    continue
                setattr(y, s.pending, None)
                if good:
                    setattr(y, s.dev, pend)
                else:
                    (f.kv if s.name == "kv" else f.swa).append(pend)
            if good:
                self._owned[y.value[::self.page_size] // self.page_size] = True
                if y.full_lock_ref:
                    self._full_protected += len(y.key)
                else:
                    self._full_evictable += len(y.key)
                if self.mode == "swa":
                    y.swa_tomb = y.swa_value is None
            elif failed is None:
                failed = y
        st = op.tickets.get("state")
        state_ok = st is None or all(st.ok)
        best = op.lock
        if failed is not None:
            self.stats["corrupt_host_kv_dropped"] += 1
            self._drop_dead(failed, f)
        if not state_ok:
            self.stats["corrupt_host_state_dropped"] += 1
            if best.alive and best.state_host is not None:
                f.hstate.append(best.state_host)
                best.state_host = None
        if op.scratch is not None:
            f.t1.append(op.scratch)
        if op.handle is not None:
            op.handle.done, op.handle.ok = True, failed is None and state_ok
        for y in op.nodes:
            if y.alive:
                self._sync(y)
                self._sync(y.parent)
        f.flush(self)
        self._unlock(best)

    def _drop_dead(self, top: TreeNode, f: Frees) -> None:
        """``top``'s host copy is corrupt: it and its subtree (reachable only through it) hold nothing
        any more. Unlocked nodes go; locked ones stay dead until their last lock."""
        order, stack = [], [top]
        while stack:
            y = stack.pop()
            order.append(y)
            stack.extend(y.children.values())
        for y in reversed(order):  # children first
            assert not y.tickets and y.value is None, f"{y} is below a host-only node but busy or on the device"
            if y.mamba_value is not None:
                if y.mamba_lock_ref:
                    self._mamba_protected -= 1
                else:
                    self._mamba_evictable -= 1
            f.take(self, y)
            y.swa_tomb = True
            if not y.children and not y.full_lock_ref:
                self._remove(y, f)
            else:
                self._sync(y)
