"""The SWA resume rule: a match may end at ``p`` only if the SWA KV of the ``window`` tokens before
``p`` is present (on the device, or on the host to load back). See ``swa.py`` for the cache.

A node's payload (``SWAPayload``) is its span's SWA KV, kept like its full KV: on the device
(``swa_value``, ``swa_pending`` while a load writes it), on the host (``swa_host``, ``swa_host_pending``
while a backup writes it) or nowhere (``swa_tomb``). The rule answers the tree (candidate set
``"swa"``), eviction (``evict_device`` tombstones SWA KV) and load back (SWA pages move as a
``host.Stream`` beside the full KV: nothing else to load).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix.checks import check_callers_kv, common_len, insert_args, parse_key
from tiered_cache.radix.frees import Frees
from tiered_cache.radix.host import Op
from tiered_cache.radix.invariants import Seen, check_lengths, ids, pages
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import EvictParams, InsertParams, InsertResult, MatchPrefixParams, MatchResult
from tiered_cache.radix.tree import RadixTree
from tiered_cache.tiers.protocols import KVSide
from tiered_cache.validate import int_arg


class SWAPayload:
    __slots__ = ("swa_value", "swa_pending", "swa_host", "swa_host_pending", "swa_tomb")

    def __init__(self) -> None:
        self.swa_value: Optional[torch.Tensor] = None
        self.swa_pending: Optional[torch.Tensor] = None
        self.swa_host: Optional[list[int]] = None
        self.swa_host_pending: Optional[list[int]] = None
        self.swa_tomb = False

    @property
    def resumable(self) -> bool:
        return not self.swa_tomb

    def release(self, f: Frees) -> None:
        for t in (self.swa_value, self.swa_pending):
            if t is not None:
                f.put("swa", t)
        for lst in (self.swa_host, self.swa_host_pending):
            if lst is not None:
                f.put_pages("swa_host", lst)
        self.swa_value = self.swa_pending = self.swa_host = self.swa_host_pending = None
        self.swa_tomb = True

    def split(self, m: int, k: int) -> SWAPayload:
        """The upper ``m`` tokens (``k`` pages) of the span; this payload keeps the rest."""
        new = SWAPayload()
        for attr in ("swa_value", "swa_pending"):
            t = getattr(self, attr)
            if t is not None:
                setattr(new, attr, t[:m].clone())
                setattr(self, attr, t[m:].clone())
        for attr in ("swa_host", "swa_host_pending"):
            lst = getattr(self, attr)
            if lst is not None:
                setattr(new, attr, lst[:k])
                setattr(self, attr, lst[k:])
        new.swa_tomb = self.swa_tomb
        return new

    def __repr__(self) -> str:
        return "swa-tomb" if self.swa_tomb else "swa"


class SWARule:
    """Match and insert for a tree of full + SWA KV (``swa``: the T0 SWA side; ``window`` tokens)."""

    path_resources: tuple[str, ...] = ("swa",)

    def __init__(self, tree: RadixTree, swa: KVSide, window: int) -> None:
        self.tree, self.swa, self.window = tree, swa, window
        tree.sinks["swa"] = swa
        self.host: Any = None  # HostTier
        self.eviction: Any = None  # Eviction: demotes an SWA victim backed up whole

    def bind(self, host: Any, eviction: Any) -> None:
        self.host, self.eviction = host, eviction

    def clear(self) -> None:
        """Nothing of the kind outlives the tree."""

    def on_events(self) -> None:
        """Nothing of the kind is polled."""

    # ----------------------------------------------------------------------------- tree hooks
    def payload(self) -> SWAPayload:
        return SWAPayload()

    def sync(self, x: TreeNode, idle: bool, unlocked: bool) -> None:
        pol = self.tree.policy
        (pol.add if x.payload.swa_value is not None and unlocked else pol.discard)("swa", x)

    def own_lock_changed(self, x: TreeNode, locked: bool) -> None:
        """A lock protects the path's SWA KV through ``path_resources``: nothing is counted per node."""

    def removed(self, x: TreeNode) -> None:
        if x.payload.swa_value is not None:
            self.tree.freed["swa"] += len(x.key)

    def check_node(self, x: TreeNode, seen: Seen, idle: bool, unlocked: bool) -> None:
        """``check_invariants``: ``x``'s SWA KV lives where its full KV lives, and its candidate set."""
        p, ps = x.payload, self.tree.page_size
        check_lengths(x, p, ("swa_value", "swa_pending", "swa_host", "swa_host_pending"), len(x.key), ps)
        if p.swa_value is not None:
            assert x.value is not None and not p.swa_tomb, f"{x} has SWA KV on the device but not its KV"
            seen.add("swa", pages(x, p.swa_value.tolist(), ps, "SWA"), "SWA page")
            if unlocked:
                seen.want["swa"].add(x)
        if p.swa_pending is not None:
            assert x.value_pending is not None, f"{x} loads SWA KV without its KV"
            seen.add("swa_pending", pages(x, p.swa_pending.tolist(), ps, "SWA"), "SWA page")
        if p.swa_host is not None:
            assert x.host_kv is not None and not p.swa_tomb, f"{x} has SWA KV on the host but not its KV"
        if p.swa_tomb:
            assert p.swa_value is None and p.swa_host is None, f"SWA tombstone {x} holds SWA KV"
        for attr in ("swa_host", "swa_host_pending"):
            if getattr(p, attr) is not None:
                seen.add(attr, getattr(p, attr), f"host {attr} slot")

    def check_slots(self, seen: Seen, request_states: Optional[torch.Tensor]) -> None:
        """``check_invariants``: every T0 SWA page is cached, in flight or a request's (``request_states``:
        the requests' SWA ids)."""
        ps = self.tree.page_size
        swa_pages, inflight = seen.sets["swa"], seen.sets["swa_pending"]
        live_swa = set(self.swa.live_virtual_ids())
        assert swa_pages | inflight <= live_swa, "cached SWA pages are free in T0"
        if request_states is not None:
            req_swa = {i // ps for i in ids(request_states)}
            assert live_swa == swa_pages | inflight | req_swa, (
                f"T0 SWA pages neither free, cached, in flight nor a request's: "
                f"{sorted(live_swa - swa_pages - inflight - req_swa)[:8]}; free: {sorted(req_swa - live_swa)[:8]}")
        if self.tree.host_on:
            seen.host.append((self.tree.sinks["swa_host"], seen.sets["swa_host"], seen.sets["swa_host_pending"]))

    def sink_ids(self, n: int) -> torch.Tensor:
        """Ids of the reserved sink page, for tokens whose SWA KV is outside every needed window."""
        return torch.arange(n, dtype=torch.int64, device=self.tree.device) % self.tree.page_size

    def path_swa(self, node: TreeNode) -> torch.Tensor:
        """SWA ids from the root to the end of ``node`` (sink ids under tombstones)."""
        parts, x = [], node
        while x is not self.tree.root:
            s = x.payload.swa_value
            parts.append(s if s is not None else self.sink_ids(len(x.key)))
            x = x.parent
        return torch.cat(parts[::-1]) if parts else self.tree.empty

    # ----------------------------------------------------------------------------- match
    def match(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key`` whose window's SWA KV is present (see ``swa.py``)."""
        tree = self.tree
        if not isinstance(params, MatchPrefixParams):
            raise InvalidTypeError("params", "a MatchPrefixParams", type(params).__name__)
        toks, salt = parse_key(params.key)
        ps, w, root = tree.page_size, self.window, tree.root
        end = len(toks) // ps * ps
        node = root
        path, values, swas = [], [], []
        i = run_any = run_dev = 0
        on_dev = True
        dev, dev_len, dev_k, best, best_len = root, 0, 0, root, 0
        while i < end:
            child = tree.child(node, toks, i, salt)
            if child is None or (child.value is None and child.host_kv is None):
                break
            m = common_len(child.key, toks, i, end, ps)
            path.append(child)
            i += m
            if m < len(child.key):
                break
            node, p = child, child.payload
            run_any = 0 if p.swa_tomb else run_any + m
            run_dev = run_dev + m if p.swa_value is not None else 0
            if child.value is None:
                on_dev = False
            elif on_dev:
                values.append(child.value)
                swas.append(p.swa_value)
            if run_any >= min(w, i):
                best, best_len = child, i
                if on_dev and run_dev >= min(w, i):
                    dev, dev_len, dev_k = child, i, len(values)
        for x in path:
            tree.policy.touch("kv", x)
        if best is root:
            return tree.match_result(tree.empty, root, root, 0, 0, None, i, swa_device_indices=tree.empty)
        best.resumes += 1
        best.leaf_resumes += not best.children  # the request moves on past best (``TreeNode``)
        self.host.count_hits(path, best)
        idx = tree.empty if dev_k == 0 else torch.cat(values[:dev_k])
        swa_idx = tree.empty if dev_k == 0 else torch.cat([
            s if s is not None else self.sink_ids(len(v)) for s, v in zip(swas[:dev_k], values[:dev_k])])
        swa_host = 0
        x = best
        while x is not dev:
            if x.value is None and x.payload.swa_host is not None:
                swa_host += len(x.key)
            x = x.parent
        return tree.match_result(idx, dev, best, best_len - dev_len, 0, None, i, swa_host_hit_length=swa_host,
                                 swa_device_indices=swa_idx)

    # ----------------------------------------------------------------------------- insert
    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``key`` -> (``value``, ``swa_value``). Ownership as for full ids: the tree frees the
        caller's duplicates in ``[prev_prefix_len, prefix_len)`` (SWA ids before ``swa_evicted_seqlen``
        are ignored: the caller freed them), takes what it caches, the caller keeps ``[cached_len:]``."""
        tree, ps = self.tree, self.tree.page_size
        toks, salt, prev, aligned = insert_args(params, ps, tree.device, ("value", "swa_value"))
        ev = int_arg("swa_evicted_seqlen", params.swa_evicted_seqlen, lo=0)
        if aligned == 0:
            return InsertResult(prefix_len=0, cached_len=0, last_device_node=tree.root)
        path, _, _, pending = tree.probe(toks, salt, aligned, prev)
        e = min(-(-ev // ps) * ps, aligned)  # SWA ids before e are gone
        value, swa = params.value, params.swa_value  # tensors: insert_args checked them
        assert value is not None and swa is not None
        if tree.validate and prev < aligned:
            check_callers_kv(tree, value[prev:aligned])
            lo = max(prev, e)
            if lo < aligned:  # the tree frees these through the trusted free_pages: whole, distinct, allocated
                ids = swa[lo:aligned].cpu().numpy()
                pages = ids[::ps] // ps
                whole = ps == 1 or ids.tobytes() == ((pages * ps)[:, None] + tree.offsets).tobytes()
                if not whole or len(set(pages.tolist())) != len(pages) \
                        or bool((self.swa.translate(swa[lo:aligned][::ps]) < 0).any()):
                    raise InvalidArgumentError("swa_value", f"SWA ids the caller owns: whole pages of {ps}, distinct, "
                                               "allocated", swa[lo:lo + 16].tolist())
        self.host.settle_loads(path, prev, pending)  # IntegrityError: the caller's prefix reads a failed load
        res = self._insert_walk(toks, salt, value, swa, aligned, prev, e)
        self.host.after_insert(res.last_device_node)
        return res

    def _insert_walk(self, toks, salt, value, swa, aligned, prev, e) -> InsertResult:
        tree = self.tree
        node, i, prefix, stopped = tree.root, 0, None, False
        dups, swa_dups = [], []
        while i < aligned:
            step = tree.insert_step(node, toks, i, aligned, salt)
            if step is None:
                break
            child, m, _ = step
            lo = max(prev, e, i)  # the caller's SWA ids offered for this span: taken or freed
            if child.value is None:  # on the host only (or dead): the caller's ids for its span
                if i < e:  # the caller has no SWA KV for it: the node stays on the host, the insert ends
                    stopped = True
                    break
                prefix = i if prefix is None else prefix
                tree.reattach(child, value[i:i + m])
                self._take_swa(child, swa[i:i + m])
            else:
                if prefix is None and max(prev, i) < i + m:
                    dups.append(value[max(prev, i):i + m])
                if child.payload.swa_tomb and i >= max(e, prev):
                    self._take_swa(child, swa[i:i + m])
                elif lo < i + m:
                    swa_dups.append(swa[lo:i + m])
            i += m
            node = child
        prefix = i if prefix is None else prefix
        if i < aligned and e < aligned and not stopped:
            if i < e:
                node = tree.new_leaf(node, toks[i:e], value[i:e], salt, _tombstone)
                i = e
            node = tree.new_leaf(node, toks[i:aligned], value[i:aligned], salt, _tombstone)
            self._take_swa(node, swa[i:aligned])
            i = aligned
        if dups:
            tree.kv.free(torch.cat(dups))
        if swa_dups:
            self.swa.free(torch.cat(swa_dups))
        return InsertResult(prefix_len=prefix, cached_len=i, last_device_node=node)

    def _take_swa(self, x: TreeNode, ids: torch.Tensor) -> None:
        x.payload.swa_value = ids.clone()
        x.payload.swa_tomb = False
        self.tree.policy.touch("kv", x)
        self.tree.sync(x)

    # ----------------------------------------------------------------------------- evict
    def evict_device(self, params: EvictParams) -> None:
        if params.swa_num_tokens:
            self.evict_swa(params.swa_num_tokens)

    def evict_host(self, params: EvictParams) -> int:
        return 0  # T2 SWA KV goes with the T2 KV of its node

    @staticmethod
    def _backed(x: TreeNode) -> bool:
        """``x``'s full KV and its SWA KV both have a complete host copy."""
        return x.host_kv is not None and x.payload.swa_host is not None

    def can_demote(self, x: TreeNode) -> bool:
        # an SWA copy missing on the host would be lost: fine for an internal node (it becomes a
        # tombstone), not for a leaf (a leaf is never a tombstone)
        p = x.payload
        return x.host_kv is not None and (p.swa_value is None or p.swa_host is not None or bool(x.children))

    def demoted(self, x: TreeNode, f: Frees) -> None:
        p = x.payload
        if p.swa_value is not None:
            f.put("swa", p.swa_value)
            p.swa_value = None
            p.swa_tomb = p.swa_host is None
            self.tree.freed["swa"] += len(x.key)

    def evict_swa(self, num: int) -> int:
        """Free ``num`` SWA KV tokens, LRU first. A node with no child on the device whose full and SWA
        KV are both on the host (write-back: backed up first) is demoted, as device KV eviction demotes:
        its device pages go, the node stays a host hit that load back brings back with its window's SWA
        KV. Otherwise an internal node becomes an SWA tombstone (its full KV stays) and a leaf goes
        whole. -> tokens."""
        return self.tree.evict_each("swa", num, self._evict_one)

    def _evict_one(self, x: TreeNode, f: Frees) -> int:
        host = self.host
        if host.enabled and not any(c.value is not None or c.value_pending is not None for c in x.children.values()):
            if not self._backed(x) and host.conf.write_policy == "write_back":
                host.backup_sync(x)  # write-back: written first, then demoted
            if self._backed(x):
                self.eviction.demote(x, f)
                self.tree.stats["swa_demotes"] += 1
                return len(x.key)
        if not x.children:
            self.tree.drop_leaf(x, f)
            return len(x.key)
        p = x.payload  # internal: an SWA tombstone; its full KV stays
        f.put("swa", p.swa_value)
        if p.swa_host is not None:
            f.put_pages("swa_host", p.swa_host)
        p.swa_value, p.swa_host, p.swa_tomb = None, None, True
        self.tree.freed["swa"] += len(x.key)
        self.tree.sync(x)
        return len(x.key)

    # ----------------------------------------------------------------------------- load back
    def check_load_req(self, req: Any) -> None:
        """Any request (or none) can receive SWA pages."""

    def loadable(self, best: TreeNode) -> bool:
        return True

    def state_on_host(self, best: TreeNode) -> bool:
        return False

    def prepare_load(self, best: TreeNode, req: Any) -> Optional[tuple]:
        return ()  # the SWA pages are a stream of the load: their room is the KV's

    def start_load(self, op: Op, prepared: tuple, best: TreeNode, req: Any) -> None:
        """Nothing beside the streams."""

    def loaded(self, y: TreeNode) -> None:
        y.payload.swa_tomb = y.payload.swa_value is None

    def load_finished(self, op: Op, f: Frees) -> bool:
        return True

    def emptied(self, y: TreeNode) -> None:
        """Nothing is counted per node."""

    def loaded_handle(self, handle: Any) -> None:
        """The SWA ids of the returned tokens, in ``handle.swa_indices`` (sink ids under tombstones)."""
        parts, x, n = [], handle.last_node, 0
        while n < len(handle.device_indices):
            p = x.payload
            s = p.swa_value if p.swa_value is not None else p.swa_pending
            parts.append(s if s is not None else self.sink_ids(len(x.key)))
            n += len(x.key)
            x = x.parent
        handle.swa_indices = torch.cat(parts[::-1])


def _tombstone(leaf: TreeNode) -> None:
    leaf.payload.swa_tomb = True  # until the caller's SWA ids are taken
