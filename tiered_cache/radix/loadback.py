"""Load back: the host part of a match, T2 -> T0, and applying a finished load to the tree.

    load (H2D)   node.host_kv --> node.value_pending ..done + checksums ok..> node.value
                 and what the resume rule needs at the prefix's end (``hooks.LoadHooks``: a Mamba state goes
                 T2 slot --> T1 scratch --dequantize--> the request's T0 slot; SWA pages are a ``Stream``)

A load whose checksum fails drops the corrupt host copy (counted in ``stats``): the node, and
everything below it that was reachable only through it, becomes a miss; a node a request still holds
stays as a *dead* node (KV nowhere) until its last lock goes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix.frees import Frees
from tiered_cache.radix.hooks import LoadHooks
from tiered_cache.radix.host import HostTier, Op, Stream
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import InitLoadBackParams
from tiered_cache.radix.tree import RadixTree
from tiered_cache.transfer.moves import load_kv
from tiered_cache.validate import choice_arg, int_arg


@dataclasses.dataclass
class LoadBack:
    """What ``init_load_back`` started (``req.load_back``). Before using the loaded KV, wait on its
    layers (``wait_layer``); once ``done`` (after ``check_hicache_events``), ``ok`` False means a
    checksum failed: the loaded prefix is garbage, the request must release its lock and recompute
    (``cache_finished_req(req, is_insert=False)``). An insert that comes while the load is still in flight
    settles it first; when it failed, the insert raises ``IntegrityError`` and caches nothing (all the request
    computed on it is garbage too: ``HostTier.settle_loads``). A caller that ignores a finished ``ok`` False gets
    the same refusal: the failed load marks the request's T0 state slot (``MambaRule.check_failed_load``)."""

    device_indices: torch.Tensor
    last_node: TreeNode
    tickets: dict
    state_slot: Optional[torch.Tensor] = None
    swa_indices: Optional[torch.Tensor] = None
    done: bool = False
    ok: bool = False

    @property
    def host_kv_bytes(self) -> int:
        """Bytes of full-attention KV this load copies from T2 (``device_indices`` also covers path KV
        that was still on the device)."""
        t = self.tickets.get("kv")
        return 0 if t is None else t.nbytes

    @property
    def loads_state(self) -> bool:
        """Whether the prefix's state comes from T2 (else it was in T1, or the model has none)."""
        return "state" in self.tickets

    def wait_layer(self, layer: int, stream: Any = None, kind: str = "kv") -> None:
        """Make ``stream`` (default: the current one) wait until layer ``layer`` of the ``kind`` KV
        (``"kv"``: the full-attention layers; ``"swa"``: the sliding-window layers, in their own
        order) has landed. A kind this load does not move has nothing to wait for."""
        choice_arg("kind", kind, ("kv", "swa"))
        layer = int_arg("layer", layer, lo=0)
        t = self.tickets.get(kind)
        if t is not None:
            t.wait_layer(layer, stream)


class Loads:
    """Load back from ``host`` into T0 (room from ``room``, an ``evict.Eviction``), payload by ``rule``."""

    def __init__(self, tree: RadixTree, host: HostTier, rule: LoadHooks, room: Any) -> None:
        self.tree, self.host, self.rule, self.room = tree, host, rule, room
        # Whole pages, one event at the end (``wait_layer`` then waits for the whole load), unless a caller
        # overlaps compute with the load layer by layer and sets this: no caller in this package does (the
        # engine waits for the load; SGLang's per-layer buffers take the layered path, one event anyway),
        # and layer-by-layer loads ran at 17-25 GB/s against 36-41 for whole pages (H100, 2026-12-07,
        # benchmarks/results/transfer-h100-*.md: each layer's 32 KiB of every page goes through the kernel).
        self.layerwise = False

    def init_load_back(self, params: InitLoadBackParams) -> tuple[torch.Tensor, Any]:
        """See ``RadixCacheFacade.init_load_back``."""
        tree, host = self.tree, self.host
        if not isinstance(params, InitLoadBackParams):
            raise InvalidTypeError("params", "an InitLoadBackParams", type(params).__name__)
        best, hl, quota, req = params.best_match_node, params.host_hit_length, params.mem_quota, params.req
        tree.check_node(best, "best_match_node")
        hl = int_arg("host_hit_length", hl, lo=0)
        if quota is not None:
            quota = int_arg("mem_quota", quota, lo=0)
        if not host.enabled or hl == 0 or best is tree.root:
            return tree.empty, best
        self.rule.check_load_req(req)  # checked before anything changes (stats included)
        chain, start, n = [], best, 0
        while n < hl and start is not tree.root:
            chain.append(start)
            n += len(start.key)
            start = start.parent
        if n != hl:
            raise InvalidArgumentError("host_hit_length", "the tokens from last_device_node to best_match_node", hl)
        chain.reverse()
        miss = (tree.empty, start)
        if not self.rule.loadable(best):
            return miss
        if any(y.value is None and (y.host_kv is None or y.tickets) for y in chain) or not best.payload.resumable:
            return miss
        load = [y for y in chain if y.value is None]
        host_tokens = sum(len(y.key) for y in load)
        if not self.rule.state_on_host(best) and host_tokens < host.conf.load_back_threshold:
            tree.stats["load_back_below_threshold"] += 1
            return miss
        if quota is not None and host_tokens > quota:
            return miss
        tree.lock(best)  # the load's own lock: the path and best's payload stay until its ticket completes
        op = self._start(load, best, req)
        if op is None:
            tree.unlock(best)
            tree.stats["load_back_no_room"] += 1
            return miss
        ids = torch.cat([y.value if y.value is not None else y.value_pending for y in chain])
        op.handle = LoadBack(ids, best, op.tickets, getattr(req, "mamba_pool_idx", None))
        if req is not None:
            req.load_back = op.handle
        if op.tickets:
            host.ops.append(op)
        else:
            op.finish(op)
        tree.stats["load_backs"] += 1
        self.rule.loaded_handle(op.handle)
        return ids, best

    def _start(self, load: list[TreeNode], best: TreeNode, req: Any) -> Optional[Op]:
        """Allocate T0 room (evicting; the caller holds ``best`` locked) and start the tickets."""
        per = [(s, [y for y in load if s.get(y, "host") is not None]) for s in self.host.streams]
        got: list[tuple[Stream, list, torch.Tensor]] = []

        def undo() -> None:
            for s, _, ids in got:
                s.side.free(ids)

        for s, ys in per:
            ntok = sum(len(y.key) for y in ys)
            if not ntok:
                continue
            ids = self.room.alloc_side(s.side, ntok)
            if ids is None:
                undo()
                return None
            got.append((s, ys, ids))
        prepared = self.rule.prepare_load(best, req)
        if prepared is None:
            undo()
            return None
        op = Op("load", {}, list(load), self.apply_load, lock=best)
        for s, ys, ids in got:
            hs = [h for y in ys for h in s.get(y, "host")]
            op.tickets[s.name] = load_kv(self.host.engine, s.region, hs, s.side, ids, layerwise=self.layerwise)
            k = 0
            for y in ys:
                s.set(y, "pending", ids[k:k + len(y.key)])
                k += len(y.key)
        self.rule.start_load(op, prepared, best, req)
        for y in load:
            y.tickets.append(op)
            self.tree.sync(y)
        return op

    def apply_load(self, op: Op) -> None:
        """``op``'s tickets are done: its KV becomes the nodes' (or, on a checksum failure, is dropped)."""
        tree, streams = self.tree, self.host.streams
        f = Frees(tree)
        oks = {s.name: dict(zip(op.tickets[s.name].host_slots, op.tickets[s.name].ok))
               for s in streams if s.name in op.tickets}
        failed = None
        for y in op.nodes:
            y.tickets.remove(op)
            good = failed is None
            for s in streams:
                if s.get(y, "pending") is not None:
                    good = good and all(oks[s.name][h] for h in s.get(y, "host"))
            for s in streams:
                pend = s.get(y, "pending")
                if pend is None:
                    continue
                s.set(y, "pending", None)
                if good:
                    s.set(y, "dev", pend)
                else:
                    f.put(s.sink, pend)
            if good:
                tree.own(y)
                self.rule.loaded(y)
            elif failed is None:
                failed = y
        best = op.lock
        assert best is not None, "a load holds its own lock"
        if failed is not None:
            tree.stats["corrupt_host_kv_dropped"] += 1
            self._drop_dead(failed, f)
        state_ok = self.rule.load_finished(op, f)
        if op.handle is not None:
            op.handle.done, op.handle.ok = True, failed is None and state_ok
        for y in op.nodes:
            if y.alive:
                tree.sync(y)
                tree.sync(y.parent)
        f.flush()
        tree.unlock(best)

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
            self.rule.emptied(y)
            f.take(y)
            if not y.children and not y.full_lock_ref:
                self.tree.remove(y, f)
            else:
                self.tree.sync(y)
