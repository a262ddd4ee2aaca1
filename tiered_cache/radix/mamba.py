"""The Mamba resume rule: a prefix is resumable where a node has a recurrent state (in T1 or T2).

Each node may hold the state at its span's end (``MambaPayload``): a T1 int8 slot the tree owns
(``Int8CheckpointPool``) and/or a T2 host slot; a node without one is a *tombstone*: its KV can be
reused only by a longer match that ends at a state::

    root ── [1 2]* ── [3 4] ── [5 6]°          * = state in T1, ° = state in T2
       │    device     host      host          matching [1..6, 99]: 2 tokens usable from the device,
       └── [10 11 12]*                          4 more loadable from the host (init_load_back)

``MambaRule`` answers the tree's questions about states and runs match and insert (ownership in
``HiMambaRadixCache``); ``mamba_states.MambaStates`` evicts, demotes and loads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from tiered_cache.errors import IntegrityError, InvalidArgumentError, InvalidTypeError
from tiered_cache.radix.checks import (
    check_callers_kv,
    check_state_allocated,
    insert_args,
    one_id,
    parse_key_array,
    req_slot,
    state_slot,
)
from tiered_cache.radix.frees import Frees
from tiered_cache.radix.invariants import Seen, ids
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.nonfinite import StateFlags
from tiered_cache.radix.params import InsertParams, InsertResult, MatchPrefixParams, MatchResult
from tiered_cache.radix.policies.admission import StateAdmission, is_branch_point
from tiered_cache.radix.tree import RadixTree
from tiered_cache.radix.walks import mamba_walk, remember
from tiered_cache.tiers.protocols import StateSide

if TYPE_CHECKING:
    from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool


class MambaPayload:
    """The state at a node's end: ``mamba_value`` (T1 slot, a 1-element LongTensor; ``t1_slot`` its host id,
    valid while it is set) and/or ``state_host`` (T2 slot); ``t1_unverified``: host id of ``mamba_value``
    until its store's NaN/inf flag was read."""

    __slots__ = ("mamba_value", "t1_slot", "state_host", "t1_unverified")

    def __init__(self) -> None:
        self.mamba_value: Optional[torch.Tensor] = None
        self.t1_slot = 0
        self.state_host: Optional[int] = None
        self.t1_unverified: Optional[int] = None

    @property
    def resumable(self) -> bool:
        return self.mamba_value is not None or self.state_host is not None

    def release(self, f: Frees) -> None:
        if self.mamba_value is not None:
            f.put_t1(self.t1_slot)  # by host id: no tensor read back, no second check
        if self.state_host is not None:
            f.put_pages("state_host", [self.state_host])
        self.mamba_value = self.state_host = None

    def split(self, m: int, k: int) -> MambaPayload:
        """The upper half of a split span ends where no state was saved: a tombstone."""
        return MambaPayload()

    def __repr__(self) -> str:
        return "T1" if self.mamba_value is not None else ("T2" if self.state_host is not None else "tomb")


class MambaRule:
    """Match and insert for a tree of KV + recurrent states; ``states`` is the T0 state side, ``ckpt``
    the T1 pool, ``unit`` the checkpoint unit (``mamba_branching_seqlen`` is aligned to it)."""

    path_resources: tuple[str, ...] = ()

    def __init__(self, tree: RadixTree, states: StateSide, ckpt: Int8CheckpointPool, unit: int) -> None:
        self.tree, self.states, self.ckpt, self.unit = tree, states, ckpt, unit
        self.flags = StateFlags(tree, ckpt)
        self.host: Any = None  # HostTier
        self.t1: Any = None  # MambaStates
        self.admission = StateAdmission()  # which states a prefill chunk offers are kept (the cache sets it)
        # T0 state slots a failed load back wrote garbage into -> (salt, bytes of the loaded prefix): a state
        # computed on it is never cached (``check_failed_load``), whether the caller read ``LoadBack.ok`` or not
        self.failed_loads: dict[int, tuple[Optional[str], bytes]] = {}

    def bind(self, host: Any, t1: Any) -> None:
        self.host, self.t1 = host, t1

    def clear(self) -> None:
        """The tree was cleared: no store's flag is awaited any more."""
        self.flags.clear()
        self.failed_loads.clear()

    def fresh_slot(self, slot: Any) -> None:
        """The T0 state slot ``slot`` was allocated, written or released by the tree: no failed load's garbage."""
        if self.failed_loads:
            self.failed_loads.pop(int(slot), None)

    def check_failed_load(self, slot: Optional[torch.Tensor], toks: Any, salt: Optional[str], prev: int) -> bool:
        """An insert of ``toks`` whose state ``slot`` a failed load back filled (``LoadBack.ok`` False: all computed
        on it is garbage), its ``prev_prefix_len`` covering the loaded prefix: ``IntegrityError`` naming the load,
        nothing changed. Any other insert with that slot shows it holds another computation: True, the mark is
        stale (the insert drops it once all its checks passed: a refused insert changes nothing)."""
        got = None if slot is None or not self.failed_loads else self.failed_loads.get(int(slot))
        if got is None or slot is None:
            return False
        fsalt, pre = got
        end = len(pre) >> 3
        if fsalt == salt and prev >= end and toks.tobytes().startswith(pre):
            raise IntegrityError(
                f"mamba_value {int(slot)}: its state came from a load back (init_load_back, req.load_back) of the "
                f"tokens up to {end} that failed its checksum (ok False): the KV or state it brought was garbage, "
                "and so is all computed on it: nothing is cached; release the request (cache_finished_req(req, "
                "is_insert=False)) and recompute")
        return True

    def on_events(self) -> None:
        """Every engine step: NaN/inf flags of earlier stores have landed; read them without waiting."""
        self.flags.poll()

    # ----------------------------------------------------------------------------- tree hooks
    def payload(self) -> MambaPayload:
        return MambaPayload()

    def sync(self, x: TreeNode, idle: bool, unlocked: bool) -> None:
        pol, p = self.tree.policy, x.payload
        free_state = idle and x.mamba_lock_ref == 0
        (pol.add if p.mamba_value is not None and free_state else pol.discard)("state", x)
        if self.tree.host_on:
            (pol.add if p.state_host is not None and free_state else pol.discard)("state_host", x)

    def own_lock_changed(self, x: TreeNode, locked: bool) -> None:
        tree, p = self.tree, x.payload
        if p.mamba_value is not None:
            tree.state_evictable += -1 if locked else 1
            tree.state_protected += 1 if locked else -1
            if locked:
                tree.policy.discard("state", x)
        if locked and p.state_host is not None:
            tree.policy.discard("state_host", x)

    def removed(self, x: TreeNode) -> None:
        if x.payload.mamba_value is not None:
            self.tree.state_evictable -= 1
            self.tree.freed["state"] += 1

    def check_node(self, x: TreeNode, seen: Seen, idle: bool, unlocked: bool) -> None:
        """``check_invariants``: ``x``'s state slots, counts and candidate sets."""
        p = x.payload
        if p.mamba_value is not None:
            seen.add("t1", [int(p.mamba_value)], "T1 slot")
            u = p.t1_unverified  # set until its store's NaN/inf flag is read, then dropped if it was not finite
            assert u is None or (u == p.t1_slot and self.flags.owner.get(u) is x), (
                f"{x}: its state's NaN/inf flag is awaited for slot {u}, it holds {p.t1_slot} (owner "
                f"{self.flags.owner.get(u) if u is not None else None})")
            assert u is not None or not self.ckpt.flags_pending(p.t1_slot), (
                f"{x}: its state counts as finite but its store's NaN/inf flag was never read (slot {p.t1_slot})")
            if x.mamba_lock_ref:
                seen.state_pr += 1
            else:
                seen.state_ev += 1
            if idle and x.mamba_lock_ref == 0:
                seen.want["state"].add(x)
        if p.state_host is not None:
            seen.add("state_host", [p.state_host], "host state slot")
            if self.tree.host_on and idle and x.mamba_lock_ref == 0:
                seen.want["state_host"].add(x)

    def check_slots(self, seen: Seen, request_states: Optional[torch.Tensor]) -> None:
        """``check_invariants``: every T0 state slot is a request's, every T1 slot cached or a load's scratch."""
        live_states = set(self.states.live_virtual_ids())
        if request_states is not None:
            rs = ids(request_states)
            assert len(set(rs)) == len(rs), "a T0 state slot is held by two requests"
            assert live_states == set(rs), (f"T0 state slots allocated but no request's: "
                                            f"{sorted(live_states - set(rs))}; a request's but free: "
                                            f"{sorted(set(rs) - live_states)}")
        t1, scratch = seen.sets["t1"], seen.sets["scratch"]
        alloc = set(self.ckpt.allocator.allocated_ids())
        assert not (t1 & scratch), "a T1 slot is both cached and a scratch slot"
        assert alloc == t1 | scratch, (f"T1 slots neither free, cached nor in flight: {sorted(alloc - t1 - scratch)}; "
                                       f"free but held: {sorted((t1 | scratch) - alloc)}")
        unread = [i for i in range(self.ckpt.capacity) if i not in alloc and self.ckpt.flags_pending(i)]
        assert not unread, f"free T1 slots with a store's NaN/inf flag still awaited: {unread[:8]}"
        if self.tree.host_on:
            seen.host.append((self.tree.sinks["state_host"], seen.sets["state_host"], set()))

    def set_state(self, node: TreeNode, t1: torch.Tensor, t1_id: int, sync: bool = True) -> None:
        """``node`` takes the T1 slot ``t1`` (host id ``t1_id``); ``sync`` False: the caller syncs ``node`` next."""
        tree = self.tree
        node.payload.mamba_value, node.payload.t1_slot = t1, t1_id
        tree.policy.touch("state", node)
        if node.mamba_lock_ref:  # a locked tombstone got its state: protected at once
            tree.state_protected += 1
        else:
            tree.state_evictable += 1
        if sync:
            tree.sync(node)

    # ----------------------------------------------------------------------------- match
    def match(self, params: MatchPrefixParams) -> MatchResult:
        """Longest cached prefix of ``params.key`` that ends at a state (see ``MatchResult``).

        With ``cow_mamba`` and no T0 state slot for the request even after evicting KV, the device part
        is a miss (a value, not an error: see ``HiMambaRadixCache``); a bad argument raises first."""
        tree, host = self.tree, self.host
        if not isinstance(params, MatchPrefixParams):
            raise InvalidTypeError("params", "a MatchPrefixParams", type(params).__name__)
        toks, salt = parse_key_array(params.key)  # an int64 array: no Python int made per token
        req: Any = params.req
        cow = params.cow_mamba
        if not isinstance(cow, bool):
            raise InvalidTypeError("cow_mamba", "a bool", cow)
        dst: Any = None
        dst_vid = None  # validate checked it is allocated (its host id): the load then takes the trusted path
        if cow:
            if req is None or not hasattr(req, "mamba_pool_idx"):
                raise InvalidArgumentError("req", "a request with .mamba_pool_idx when cow_mamba is set", req)
            if req.mamba_pool_idx is not None:
                dst, dst_vid = req_slot(self.states, tree.validate, req)
        # Every check is done: what follows may change the tree.
        if host.t3 is not None:  # T3 -> T2 for pages past the tree's match (wait policies: before the walk)
            host.t3.maybe_prefetch(toks.tolist(), salt, req)
        self.flags.poll()
        kb = toks.tobytes()
        while True:
            path, values, kv_len, dev, dev_len, dev_k, best, best_len = mamba_walk(tree, toks, salt, len(toks), kb)
            # Neither state may be reported before its NaN/inf flag is read: a drop changes the walk.
            if self.flags.verify(dev) and self.flags.verify(best):
                break
        root, touch = tree.root, tree.policy.touch
        tree.policy.touch_all("kv", path)
        branching = None
        if kv_len > best_len:
            b = kv_len // self.unit * self.unit
            branching = b if b > best_len else None
        if best is root:
            return tree.match_result(tree.empty, root, root, 0, 0, branching, kv_len)
        unserved = None
        if cow and dev is not root and dst is None:
            dst = self.t1.alloc_active_state(dev)  # evicts KV (dev's path locked meanwhile)
            if dst is None:  # no room for the request's state: the device part is unusable, a miss
                unserved, dev, dev_k, dev_len = dev, root, 0, 0
                if best.payload.mamba_value is not None:  # best's state is on the device too: no host hit
                    best, best_len = root, 0
            else:
                req.mamba_pool_idx = dst
        if best is not unserved and best is not root:  # a state not served is not a hit
            touch("state", best)
            best.resumes += 1
            best.leaf_resumes += not best.children  # the request moves on past best (``TreeNode``)
        if dev is not best and dev is not root:
            touch("state", dev)
        host.count_hits(path, best)
        if dev is not root:  # the request's insert may start its walk at dev (``InsertParams.last_node``)
            remember(tree, dev, salt, kb, dev_len)
        if cow and dev is not root:
            self.fresh_slot(dst)  # overwritten with dev's state next
        if cow and dev is not root and dst_vid is not None:  # both ids checked: no second check in T1
            # dst's row read again now: the walk's drops (NaN states) free KV, and a side may compact on a free
            row = self.states.translate_host(dst_vid)
            self.ckpt.load_rows(one_id(dev.payload.t1_slot), self.states, row)
        elif cow and dev is not root:
            self.ckpt.load_to_active(dev.payload.mamba_value, self.states, dst)
        idx = tree.empty if dev_k == 0 else values[0] if dev_k == 1 else torch.cat(values[:dev_k])
        mamba_host = int(best is not dev and best.payload.mamba_value is None)
        return tree.match_result(idx, dev, best, best_len - dev_len, mamba_host, branching, kv_len)

    # ----------------------------------------------------------------------------- insert
    def insert(self, params: InsertParams) -> InsertResult:
        """Cache ``key`` -> ``value`` with the state ``mamba_value`` at its end (ownership: ``HiMambaRadixCache``).

        Only whole pages are cached; a state is stored only when ``len(key)`` is page-aligned (it is
        valid at that position alone). New KV is taken only together with a state (a leaf is never a
        tombstone). With no T1 room even after evicting states, nothing is cached:
        ``prefix_len == cached_len == prev_prefix_len`` and the caller keeps ``value[prev_prefix_len:]``.
        A load back under the first ``prev_prefix_len`` tokens still in flight is settled first; one that failed its
        checksum: ``IntegrityError``, nothing cached (``HostTier.settle_loads``).
        """
        tree = self.tree
        toks, salt, prev, aligned = insert_args(params, tree.page_size, tree.device, ("value",), as_array=True)
        n, value = len(toks), params.value  # a tensor: insert_args checked it
        assert value is not None
        slot = None if params.mamba_value is None else state_slot(self.states, "mamba_value", params.mamba_value)
        stale_mark = self.check_failed_load(slot, toks, salt, prev)
        if aligned == 0:
            return InsertResult(prefix_len=0, cached_len=0, last_device_node=tree.root)
        kb, hint = toks.tobytes(), params.last_node  # insert_args checked it
        path, end_node, lead, pending = tree.probe(toks, salt, aligned, prev, kb, hint)
        # the caller's pages, checked once: duplicates and new leaves use them without another check
        vh = value.numpy() if value.is_cpu else None  # the ids' host view, made once: the check and the new leaf
        pages = check_callers_kv(tree, value, lo=prev, hi=aligned, host=vh) if tree.validate and prev < aligned \
            else None
        # the slot checked now, before anything changes; its physical row is read only at the store: the T1
        # allocation between may evict, and a state side may compact (move rows) on any free or alloc
        vid = check_state_allocated(self.states, slot) if tree.validate and slot is not None else None
        if self.host.settle_loads(path, prev, pending):  # the caller computed on what a load brings: done, or nearly
            path, end_node, lead, _ = tree.probe(toks, salt, aligned, prev, kb, hint)
        if stale_mark:  # every check passed: the slot holds another computation than the failed load's
            self.failed_loads.pop(int(slot), None)  # type: ignore[arg-type]
        if (slot is not None and params.chunked and not self.admission.keeps_every_chunk and aligned == n
                and not self.admission.admit(n, is_branch_point(path, end_node, toks, aligned, tree.page_size))):
            slot = None  # not admitted: inserted as a chunk without a state (nothing new is cached)
        mamba_exist = aligned == n and end_node is not None and end_node.payload.resumable
        t1: Optional[torch.Tensor] = None
        t1_id: Optional[int] = None
        if slot is not None and aligned == n and not mamba_exist:
            got = self.ckpt.alloc_ids(1) or self.t1.alloc_ckpt_protected(path[-1] if path else None)
            if got is None:
                return InsertResult(prefix_len=prev, cached_len=prev, last_device_node=None)
            t1, (t1_id,) = got
            try:
                if vid is not None:  # checked above, and a slot just allocated: the trusted store, at today's row
                    self.ckpt.store_rows(self.states, self.states.translate_host(vid), one_id(t1_id))
                else:
                    self.ckpt.store_from_active(self.states, slot, t1)
            except BaseException:
                self.ckpt.free(t1)
                raise
        # path[-1] was locked while states were evicted for room: the probed path is the tree's still
        res = self._insert_walk(toks, salt, value, aligned, prev, t1, t1_id, mamba_exist, slot is not None, pages,
                                vh, path, lead)
        node = res.last_device_node
        if node is not tree.root:  # the request's next insert (a chunk) may start here
            remember(tree, node, salt, kb, res.cached_len)
        if res.mamba_stored:
            self.flags.stored(node, t1_id)  # type: ignore[arg-type]  # stored: t1 and its id were taken
        self.host.after_insert(node)
        if self.host.t3 is not None and res.mamba_stored and node.alive and self.flags.verify(node):
            self.host.t3.on_state(node, demoted=False)  # T3 is shared: a NaN state never goes there
        return res

    def _insert_walk(self, toks, salt, value, aligned, prev, t1, t1_id, mamba_exist, offered, pages, vh,
                     path, lead) -> InsertResult:
        """``pages``: the page ids of ``value[prev:aligned]`` as ``check_callers_kv`` checked them, or None
        (``validate`` off: the duplicates go back through the checked ``free``). ``path``: ``probe``'s: each
        node matched whole but the last, so the walk looks up no child and compares no key again; ``lead``: its
        (leading nodes with device KV, the token where the last node starts, whether the last matched whole);
        ``vh``: ``value.numpy()`` on the CPU (the new leaf's ids are copied from it), or None."""
        tree = self.tree
        root, touch, ps = tree.root, tree.policy.touch, tree.page_size
        node, i, prefix = root, 0, None
        dups: list[tuple[int, int]] = []  # token ranges of value the tree already holds: freed at the end
        split_suffix = None
        dev_n, start, whole = lead
        ahead = len(path) if whole else len(path) - 1  # matched whole by probe: nothing to split
        k0 = 0
        if ahead > 0:  # only their recency changes (``insert_step`` without the call)
            tree.policy.touch_all("kv", path if whole else path[:ahead])
            if dev_n >= ahead:  # all of them on the device: their duplicates are one range, no step per node
                i, node, k0 = start + len(path[-1].akey) if whole else start, path[ahead - 1], ahead
                if prev < i:
                    dups.append((prev, i))
        for k in range(k0, len(path)):
            child = path[k]
            if k < ahead:
                m = len(child.akey)
            else:
                child, m, split_suffix = tree.insert_step(node, toks, i, aligned, salt, child)
            if child.value is None:  # on the host only (or dead): take the caller's ids for its span
                prefix = i if prefix is None else prefix
                tree.reattach(child, value[i:i + m])
            elif prefix is None:
                lo = max(prev, i)
                if lo < i + m:
                    dups.append((lo, i + m))
            i += m
            node = child
        prefix = i if prefix is None else prefix
        stored = False
        if i < aligned:
            if t1 is not None:
                node = tree.new_leaf(node, toks[i:aligned], value, salt,
                                     lambda leaf: self.set_state(leaf, t1, t1_id, sync=False),
                                     None if pages is None else pages[(i - prev) // ps:], lo=i, host=vh)
                stored, i = True, aligned
        elif node is not root:
            if not node.payload.resumable and t1 is not None:
                self.set_state(node, t1, t1_id)
                stored = True
            elif mamba_exist and offered:
                touch("state", node)
        if t1 is not None and not stored:
            self.ckpt.free(t1)
        if dups and pages is not None:  # checked above: the trusted free
            tree.kv.free_pages([p for lo, hi in dups for p in pages[(lo - prev) // ps:(hi - prev) // ps].tolist()])
        elif dups:
            tree.kv.free(torch.cat([value[lo:hi] for lo, hi in dups]))
        if split_suffix is not None and split_suffix.alive:
            tree.prune_up(split_suffix)  # states evicted for room may have taken its children
        return InsertResult(prefix_len=prefix, cached_len=i, mamba_exist=mamba_exist, mamba_stored=stored,
                            last_device_node=node)
