"""The block-level model of the capacity simulation: the radix tree's decisions with no tensor in sight.

``simulate_tiers(..., mode="model")`` (``capacity_sim``) serves a trace through ``TreeModel`` instead
of a ``TieredCache``: the same tiers (T0 as a ``UnifiedPool``'s two bands of bytes, T1 slots, T2 KV
pages and state slots, counted), the same LRU (``NodeLRU``: ``stack.CountingLRUPolicy``'s stamps and
heaps on the nodes themselves, fed the same touches in the same order, so it pops the same victims),
and the same flows, ported step for step from ``radix/{mamba,mamba_states,tree,evict,host,loadback,
requests}.py`` for what the simulation uses: page_size 1, LRU, ``chunk`` admission, ``write_through``,
no T3, finite states, transfers that finish by the next ``check_hicache_events`` (every ticket on the
CPU is done when submitted).
A node holds flags (on the device, on the host, a backup in flight, a T1 / T2 state) instead of ids,
since which slot holds a page decides nothing. tests/bench/test_capacity_sim.py runs it against the
real tree (fast and full mode) on traces that evict in every tier: every request's hit must agree.

What it is for: 10^6-request points in minutes; the real tree (``mode="fast"``) spends ~1-2 ms per
call on tensors, checks and tickets; here a call is dictionary work. Where the model's own time went
before ``NodeLRU`` (cProfile, 6 x 10^4 Mooncake requests at GPU 32 / host 1024 GiB): a fifth of it in
``_reclaimable`` copying the set of host leaves on every backup that needed room (O(host leaves): why
larger runs went slower), a quarter in the policy's dictionaries of stamps; the rest the tree's flows.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Any, Optional

from tiered_cache.config import CacheConfig
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix.policies.ghost import descendants
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.tiers.unified_pool import UnifiedPool

# a node's candidate sets, one bit each (Node.cand: the sets it is in)
_BITS = {"kv": 1, "state": 2, "kv_host": 4, "state_host": 8}
_NAMES = {b: r for r, b in _BITS.items()}
_KV_BASE = 1 | 4  # the resources ranked by the KV's last use (policy.RECENCY); the others by the state's


class Node:
    __slots__ = ("parent", "children", "key", "dev", "host", "hpend", "t1", "t2", "full", "mlock", "tickets",
                 "alive", "cand", "ndev", "nhost", "skv", "sst", "__weakref__")

    def __init__(self, parent: Optional[Node], key: list[int]) -> None:
        self.parent: Node = parent  # type: ignore[assignment]  # None at the root only
        self.children: dict[int, Node] = {}
        self.key = key
        self.dev = self.host = self.hpend = self.t1 = self.t2 = False
        self.full = self.mlock = self.tickets = self.cand = 0
        self.ndev = self.nhost = 0  # children on the device / on the host or being copied there
        self.skv = self.sst = 0  # the LRU stamps of its KV's / its state's last use (0: none)
        self.alive = True

    @property
    def resumable(self) -> bool:
        return self.t1 or self.t2


class NodeLRU:
    """``stack.CountingLRUPolicy`` for ``Node``s, faster: the same stamps from one clock (a touch, or an
    add of a node with no stamp, takes the next), the same lazy-deletion min-heaps, so ``pop`` returns the
    same victim in every state (tests/bench/test_capacity_sim.py drives both with random operations).
    What it saves: the stamps live on the node (``skv`` for ``kv`` / ``kv_host``, ``sst`` for ``state`` /
    ``state_host``) and its candidate sets in ``Node.cand`` bits beside a set per resource, so a touch is
    two attribute writes and a push per set the node is in, and a heap entry ``(stamp, node)`` needs no
    tie-breaker (a stamp names one node). Resources are bits (``_BITS``); ``counts`` are by name."""

    def __init__(self) -> None:
        self.clock = 0
        self.sets: dict[int, set[Node]] = {b: set() for b in _NAMES}
        self.heaps: dict[int, list[tuple[int, Node]]] = {b: [] for b in _NAMES}
        self.counts: dict[str, int] = {}

    def touch_kv(self, x: Node) -> None:
        self.clock = t = self.clock + 1
        x.skv = t
        if x.cand & 1:
            self._push(1, t, x)
        if x.cand & 4:
            self._push(4, t, x)

    def touch_state(self, x: Node) -> None:
        self.clock = t = self.clock + 1
        x.sst = t
        if x.cand & 2:
            self._push(2, t, x)
        if x.cand & 8:
            self._push(8, t, x)

    def update(self, x: Node, want: int) -> None:
        """``x`` a candidate of exactly the resources in ``want`` (``add`` / ``discard`` of each change)."""
        diff = want ^ x.cand
        x.cand = want
        for b in (1, 2, 4, 8):
            if diff & b:
                if want & b:
                    self.sets[b].add(x)
                    if b & _KV_BASE:
                        t = x.skv
                        if not t:
                            self.clock = x.skv = t = self.clock + 1
                    else:
                        t = x.sst
                        if not t:
                            self.clock = x.sst = t = self.clock + 1
                    self._push(b, t, x)
                else:
                    self.sets[b].discard(x)

    def forget(self, x: Node) -> None:
        self.update(x, 0)
        x.skv = x.sst = 0

    def pop(self, b: int) -> Optional[Node]:
        """The least recently used candidate of resource ``b``, no longer one; None when there is none."""
        heap = self.heaps[b]
        kv = b & _KV_BASE
        while heap:
            t, x = heappop(heap)
            if x.cand & b and (x.skv if kv else x.sst) == t:
                x.cand &= ~b
                self.sets[b].discard(x)
                r = _NAMES[b]
                self.counts[r] = self.counts.get(r, 0) + 1
                return x
        return None

    def _push(self, b: int, t: int, x: Node) -> None:
        heap = self.heaps[b]
        heappush(heap, (t, x))
        if len(heap) > 64 and len(heap) > 3 * len(self.sets[b]):
            self.heaps[b] = heap = [(y.skv if b & _KV_BASE else y.sst, y) for y in self.sets[b]]
            heapify(heap)

    def check(self) -> None:
        """Every candidate has its bit and its current stamp in its heap (``TreeModel.check_idle`` checks the
        bits against the sets). Raises AssertionError."""
        for b, cand in self.sets.items():
            live = {(t, id(x)) for t, x in self.heaps[b]}
            for x in cand:
                assert x.cand & b, f"a {_NAMES[b]!r} candidate without its bit"
                assert ((x.skv if b & _KV_BASE else x.sst), id(x)) in live, f"a {_NAMES[b]!r} candidate off its heap"


class TreeModel:
    """A ``HiMambaRadixCache`` over ``kv_pages`` T0 pages of ``kv`` + ``t0_states`` T0 state slots of
    ``state`` (one ``UnifiedPool``: either band may take the other's free bytes), ``t1_states`` T1 slots,
    and, with ``host_kv_pages``, a T2 of that many KV pages and ``host_states`` state slots. Counts
    slots; ``request`` serves one SimRequest as ``capacity_sim.Sim.request`` does."""

    def __init__(self, *, kv: KVSpec, state: StateSpec, kv_pages: int, t0_states: int, t1_states: int,
                 host_kv_pages: int = 0, host_states: int = 0) -> None:
        self.total = UnifiedPool.bytes_for(kv, state, kv_pages, t0_states)
        self.ekv, self.est = kv.bytes_per_slot(1), state.bytes_per_slot()
        self.cap_kv, self.cap_st = self.total // self.ekv, self.total // self.est
        self.kv_live = self.st_live = 0  # T0 slots allocated (the tree's and the request's)
        self.t1_free = self.t1_cap = t1_states
        self.host_on = host_kv_pages > 0
        self.hkv_free, self.hst_free = self.hkv_cap, self.hst_cap = host_kv_pages, host_states
        self.lru = NodeLRU()
        self.root = Node(None, [])
        self.ops: list[list[Node]] = []  # backups in flight: their nodes, top-down
        self.freed_kv = 0
        self.stats = dict.fromkeys(("backups", "backup_no_room", "state_demotes", "load_backs", "load_back_no_room",
                                    "state_promotes"), 0)

    @classmethod
    def of_config(cls, cfg: CacheConfig, *, kv: KVSpec, state: StateSpec) -> TreeModel:
        """The model of ``TieredCache.build(cfg, kv=kv, state=state)``; a ``cfg`` asking for what the model
        does not know raises (``InvalidArgumentError`` naming the field): use the real tree there."""
        want = dict(page_size=1, lazy_compaction=False, eviction_policy="lru", state_admission="chunk",
                    storage_url=None, load_back_threshold=0, checkpoint_unit=None)
        if cfg.host_kv_pages:
            want["write_policy"] = "write_through"
        for f, v in want.items():
            if getattr(cfg, f) != v:
                raise InvalidArgumentError(f"cfg.{f}", f"{v!r} (what capacity_model knows; mode='fast' runs the "
                                           f"real tree)", getattr(cfg, f))
        return cls(kv=kv, state=state, kv_pages=cfg.kv_pages, t0_states=cfg.t0_states, t1_states=cfg.t1_states,
                   host_kv_pages=cfg.host_kv_pages, host_states=cfg.host_states)

    def check_idle(self) -> None:
        """No request running: every slot is free or the tree's, and the counts and candidate sets match
        the nodes (what ``check_invariants`` checks of the real tree). Raises AssertionError."""
        assert not self.ops and self.st_live == 0, "a request or a backup is still running"
        kv = hkv = t1 = t2 = 0
        want: dict[str, set] = {r: set() for r in ("kv", "state", "kv_host", "state_host")}
        stack = list(self.root.children.values())
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            assert x.full == 0 and x.mlock == 0 and not x.tickets and x.alive, f"{x} is locked or busy"
            assert x.children or x.resumable, "a tombstone leaf"
            assert x.dev or x.host, "a node with its KV nowhere"
            assert not x.dev or x.parent is self.root or x.parent.dev, "device KV not upward closed"
            assert not x.host or x.parent is self.root or x.parent.host, "host copies not upward closed"
            kv += len(x.key) * x.dev
            hkv += len(x.key) * x.host
            t1, t2 = t1 + x.t1, t2 + x.t2
            kids = x.children.values()
            assert x.ndev == sum(c.dev for c in kids) and x.nhost == sum(c.host or c.hpend for c in kids), \
                "a node's child counts disagree with its children"
            if x.dev and (not kids or (self.host_on and not any(c.dev for c in kids))):
                want["kv"].add(x)
            if x.t1:
                want["state"].add(x)
            if self.host_on and x.host and not any(c.host for c in kids):
                want["kv_host"].add(x)
            if self.host_on and x.t2:
                want["state_host"].add(x)
        assert kv == self.kv_live, f"T0 KV pages: {self.kv_live} allocated, the tree holds {kv}"
        assert t1 + self.t1_free == self.t1_cap and hkv + self.hkv_free == self.hkv_cap \
            and t2 + self.hst_free == self.hst_cap, "T1 / T2 slots leaked"
        for r, nodes in want.items():
            got = self.lru.sets[_BITS[r]]
            assert got == nodes, f"the {r!r} candidates are not the nodes that may give it up"
            assert {x for x in self._nodes() if x.cand & _BITS[r]} == got, f"Node.cand disagrees with {r!r}"
        self.lru.check()

    def _nodes(self) -> list[Node]:
        return descendants(self.root)

    # ------------------------------------------------------------------------------------------ T0 room
    def kv_avail(self) -> int:
        return max(0, min(self.cap_kv, (self.total - (self.st_live + 1) * self.est) // self.ekv) - self.kv_live - 1)

    def st_avail(self) -> int:
        return max(0, min(self.cap_st, (self.total - (self.kv_live + 1) * self.ekv) // self.est) - self.st_live - 1)

    def alloc_kv_pages(self, n: int) -> bool:
        if n > self.kv_avail():
            return False
        self.kv_live += n
        return True

    def alloc_state_slot(self) -> bool:
        if self.st_avail() < 1:
            return False
        self.st_live += 1
        return True

    # ------------------------------------------------------------------------------------------ candidates
    def sync(self, x: Node) -> None:
        """``RadixTree.sync`` + ``MambaRule.sync``: ``x`` in exactly the candidate sets it belongs to."""
        if x is self.root or not x.alive:
            return
        want = 0
        if not x.tickets:
            if x.full == 0:
                if x.dev and (not x.children or (self.host_on and not x.ndev)):
                    want = 1
                if x.host and self.host_on and not x.nhost:
                    want |= 4
            if x.mlock == 0:
                if x.t1:
                    want |= 2
                if x.t2 and self.host_on:
                    want |= 8
        if want != x.cand:
            self.lru.update(x, want)

    def _discard(self, x: Node, bits: int) -> None:
        if x.cand & bits:
            self.lru.update(x, x.cand & ~bits)

    # ------------------------------------------------------------------------------------------ locks
    def lock(self, node: Node) -> None:
        if node is self.root:
            return
        if node.mlock == 0:
            self._discard(node, 2 | 8)
        node.mlock += 1
        x = node
        while x is not self.root:
            if x.full == 0:
                self._discard(x, 1 | 4)
            x.full += 1
            x = x.parent

    def unlock(self, node: Node, prune: bool = True) -> None:
        if node is self.root:
            return
        node.mlock -= 1
        x = node
        while x is not self.root:
            x.full -= 1
            parent = x.parent
            if x.full == 0:
                if prune and not x.children and not x.tickets and not x.resumable:
                    self.remove(x)
                else:
                    self.sync(x)
            elif x is node:
                self.sync(x)
            x = parent

    # ------------------------------------------------------------------------------------------ removal
    def remove(self, x: Node) -> None:
        """``RadixTree.remove`` + ``Frees.take``: unlink ``x``, give back everything it holds."""
        parent = x.parent
        del parent.children[x.key[0]]
        parent.ndev -= x.dev
        parent.nhost -= x.host or x.hpend
        self.lru.forget(x)
        n = len(x.key)
        if x.dev:
            self.freed_kv += n
            self.kv_live -= n
        if x.host or x.hpend:
            self.hkv_free += n
        if x.t1:
            self.t1_free += 1
        if x.t2:
            self.hst_free += 1
        x.dev = x.host = x.hpend = x.t1 = x.t2 = False
        x.alive = False

    def after_child_removed(self, p: Node) -> int:
        tok = 0
        while p is not self.root:
            if p.children or p.full or p.tickets or p.resumable:
                self.sync(p)
                break
            q = p.parent
            tok += len(p.key) if p.dev else 0
            self.remove(p)
            p = q
        return tok

    def drop_leaf(self, x: Node) -> int:
        tok = len(x.key) if x.dev else 0
        p = x.parent
        self.remove(x)
        return tok + self.after_child_removed(p)

    def prune_up(self, x: Node) -> None:
        if x is self.root or not x.alive:
            return
        if not x.children and x.full == 0 and not x.tickets and not x.resumable:
            self.drop_leaf(x)
        else:
            self.sync(x)

    def evict_each(self, resource: str, num: int, one: Any) -> int:
        got = 0
        while got < num:
            x = self.lru.pop(_BITS[resource])
            if x is None:
                break  # no backup is ever in flight at a pop: settle() would find none
            got += one(x)
        return got

    # ------------------------------------------------------------------------------------------ eviction
    def evict_kv(self, num: int) -> int:
        return self.evict_each("kv", num, self._evict_kv_one)

    def _evict_kv_one(self, x: Node) -> int:
        if x.host:  # write_through: a backed-up victim is demoted
            x.dev = False
            x.parent.ndev -= 1
            n = len(x.key)
            self.kv_live -= n
            self.freed_kv += n
            self.sync(x)
            self.sync(x.parent)
            return n
        return self.drop_leaf(x)

    def evict_states(self, num: int) -> int:
        return self.evict_each("state", num, self._evict_state)

    def _evict_state(self, x: Node) -> int:
        if self.host_on and not x.t2:
            self.demote_sync(x)
        x.t1 = False
        self.t1_free += 1
        if x.children or x.t2:
            self.sync(x)
        else:
            self.drop_leaf(x)
        return 1

    def demote_sync(self, x: Node) -> None:
        if self.hst_free == 0 and self.lru.sets[8]:
            self.evict_each("state_host", 1, self._evict_host_state)
        if self.hst_free:
            self.hst_free -= 1
            x.t2 = True
            self.stats["state_demotes"] += 1

    def _evict_host_state(self, x: Node) -> int:
        x.t2 = False
        self.hst_free += 1
        if not x.children and not x.resumable and not x.full:
            self.drop_leaf(x)
        else:
            self.sync(x)
        return 1

    def evict_host_kv(self, num: int) -> int:
        return self.evict_each("kv_host", num, self._evict_host_kv_one)

    def _evict_host_kv_one(self, x: Node) -> int:
        x.host = False
        x.parent.nhost -= 1
        self.hkv_free += len(x.key)
        if x.dev:
            self.sync(x)
            self.sync(x.parent)
        else:
            self.drop_leaf(x)
        return len(x.key)

    def evict_tokens(self, num: int) -> int:
        """``evict(EvictParams(num_tokens=num))``: device KV tokens freed (drops included)."""
        before = self.freed_kv
        self.evict_kv(num)
        return self.freed_kv - before

    def alloc_kv_evicting(self, n: int) -> bool:
        """``Eviction.alloc_side`` (load back) and ``TieredCache.alloc_kv``: the same loop."""
        while not self.alloc_kv_pages(n):
            if not self.evict_tokens(max(1, n - self.kv_avail())):
                return False
        return True

    def alloc_state_protected(self, protect: Node) -> bool:
        """``Eviction.alloc_protected``: a T0 state slot, evicting KV a page at a time."""
        if self.alloc_state_slot():
            return True
        self.lock(protect)
        ok = False
        while not ok and self.evict_kv(1):
            ok = self.alloc_state_slot()
        self.unlock(protect)
        return ok

    def alloc_t1(self, protect: Optional[Node]) -> bool:
        """``ckpt.alloc_ids(1) or MambaStates.alloc_ckpt_protected(protect)``."""
        if self.t1_free:
            self.t1_free -= 1
            return True
        if protect is not None:
            self.lock(protect)
        ok = False
        while not ok and self.evict_states(1):
            if self.t1_free:
                self.t1_free -= 1
                ok = True
        if protect is not None:
            self.unlock(protect, prune=False)
            if not ok:
                self.prune_up(protect)
        return ok

    # ------------------------------------------------------------------------------------------ structure
    def split(self, child: Node, m: int) -> Node:
        parent = child.parent
        new = Node(parent, child.key[:m])
        new.dev, new.host, new.hpend = child.dev, child.host, child.hpend
        new.ndev, new.nhost = int(child.dev), int(child.host or child.hpend)
        new.full, new.tickets = child.full, child.tickets
        child.key = child.key[m:]
        child.parent = new
        new.children[child.key[0]] = child
        parent.children[new.key[0]] = new
        self.lru.touch_kv(child)
        self.sync(new)
        self.sync(child)
        return new

    def set_state(self, node: Node) -> None:
        node.t1 = True
        self.lru.touch_state(node)
        self.sync(node)

    # ------------------------------------------------------------------------------------------ match
    def match(self, toks: list[int], has_slot: bool) -> tuple:
        """``MambaRule.match`` with cow_mamba. -> (device pages, dev node, best node, host pages, branching,
        whether match allocated the request's T0 state slot)."""
        root, end = self.root, len(toks)
        node, path, i = root, [], 0
        dev, dev_len, best, best_len, on_dev = root, 0, root, 0, True
        kv_len = None
        while i < end:
            child = node.children.get(toks[i])
            if child is None:
                break
            key = child.key
            n = min(len(key), end - i)
            if n == len(key) and toks[i:i + n] == key:
                m = n
            else:
                m = 0
                while m < n and toks[i + m] == key[m]:
                    m += 1
            path.append(child)
            if m < len(key):
                kv_len = i + m
                break
            i += m
            node = child
            if not child.dev:
                on_dev = False
            if child.t1:
                best, best_len = child, i
                if on_dev:
                    dev, dev_len = child, i
            elif child.t2:
                best, best_len = child, i
        if kv_len is None:
            kv_len = i
        touch_kv = self.lru.touch_kv
        for x in path:
            touch_kv(x)
        branching = kv_len if kv_len > best_len else None
        if best is root:
            return 0, root, root, 0, branching, False
        got_slot = False
        unserved = None
        if dev is not root and not has_slot:
            if self.alloc_state_protected(dev):
                got_slot = True
            else:
                unserved, dev, dev_len = dev, root, 0
                if best.t1:
                    best, best_len = root, 0
        if best is not unserved and best is not root:
            self.lru.touch_state(best)
        if dev is not best and dev is not root:
            self.lru.touch_state(dev)
        return dev_len, dev, best, best_len - dev_len, branching, got_slot

    def load_back(self, dev: Node, best: Node, hl: int, has_slot: bool) -> Optional[tuple[int, bool, bool]]:
        """``init_load_back`` + the ``check_hicache_events`` that applies it. -> (host KV pages loaded,
        state from T2, whether the load allocated the request's T0 slot), or None: nothing loaded."""
        chain, y, n = [], best, 0
        while n < hl and y is not self.root:
            chain.append(y)
            n += len(y.key)
            y = y.parent
        chain.reverse()
        if any(not y.dev and (not y.host or y.tickets) for y in chain) or not best.resumable:
            return None
        load = [y for y in chain if not y.dev]
        ntok = sum(len(y.key) for y in load)
        self.lock(best)
        if ntok and not self.alloc_kv_evicting(ntok):
            self.unlock(best)
            self.stats["load_back_no_room"] += 1
            return None
        own = not has_slot
        if own and not self.alloc_state_protected(best):
            self.kv_live -= ntok
            self.unlock(best)
            self.stats["load_back_no_room"] += 1
            return None
        scratch = not best.t1
        if scratch and not self.alloc_t1(best):
            if own:
                self.st_live -= 1
            self.kv_live -= ntok
            self.unlock(best)
            self.stats["load_back_no_room"] += 1
            return None
        self.stats["load_backs"] += 1
        # applied at once: the op's tickets are done by the next check_hicache_events
        for y in load:
            y.dev = True
            y.parent.ndev += 1
        if scratch:
            if best.alive and best.dev and not best.t1:
                self.set_state(best)
                self.stats["state_promotes"] += 1
            else:
                self.t1_free += 1
        for y in load:
            if y.alive:
                self.sync(y)
                self.sync(y.parent)
        self.unlock(best)
        return ntok, scratch, own

    # ------------------------------------------------------------------------------------------ insert
    def insert(self, toks: list[int], prev: int, last: Optional[Node] = None) -> tuple[int, int, Optional[Node]]:
        """``MambaRule.insert`` with the request's state offered (chunk admission keeps every one).
        -> (prefix_len, cached_len, last node or None), the KV it frees and takes counted. ``last``: the
        request's locked node, whose path from the root spells ``toks[:prev]`` (a walk would match it
        whole: the probe takes it from the parent links)."""
        root, aligned = self.root, len(toks)
        if aligned == 0:
            return 0, 0, root
        node, path, steps, i = root, [], [], 0
        end_node = None
        total = 0
        if last is not None and last is not root and prev <= aligned:
            y = last
            while y is not root:
                path.append(y)
                y = y.parent
            path.reverse()
            steps = [len(y.key) for y in path]
            node, i = last, prev
            total = prev
        while i < aligned:  # probe: read-only
            child = node.children.get(toks[i])
            if child is None:
                break
            key = child.key
            m = _common(key, toks, i, aligned)
            path.append(child)
            steps.append(m)
            i += m
            total += len(key)
            if m < len(key):
                break
            node = child
        if path and i == aligned == total:
            end_node = path[-1]
        mamba_exist = end_node is not None and end_node.resumable
        t1 = False
        if not mamba_exist:
            if not self.alloc_t1(path[-1] if path else None):
                return prev, prev, None
            t1 = True
        # The insert walk takes the probe's path: alloc_t1 locked it (path[-1] and so its ancestors) while it
        # evicted, so no node of it went, split or changed its key, and a walk would find the same nodes.
        touch_kv = self.lru.touch_kv
        node, i, prefix = root, 0, None
        dups = 0
        split_suffix = None
        for child, m in zip(path, steps):
            if m < len(child.key):
                split_suffix = child
                child = self.split(child, m)
            touch_kv(child)
            if not child.dev:
                prefix = i if prefix is None else prefix
                child.dev = True  # takes the caller's pages for its span
                child.parent.ndev += 1
                self.sync(child)
                self.sync(child.parent)
            elif prefix is None:
                lo = max(prev, i)
                if lo < i + m:
                    dups += i + m - lo
            i += m
            node = child
        prefix = i if prefix is None else prefix
        stored = False
        if i < aligned:
            if t1:
                leaf = Node(node, toks[i:aligned])
                node.children[leaf.key[0]] = leaf
                leaf.dev = True
                node.ndev += 1
                touch_kv(leaf)
                self.set_state(leaf)
                self.sync(leaf)
                self.sync(node)
                node = leaf
                stored, i = True, aligned
        elif node is not root:
            if not node.resumable and t1:
                self.set_state(node)
                stored = True
            elif mamba_exist:
                self.lru.touch_state(node)
        if t1 and not stored:
            self.t1_free += 1
        self.kv_live -= dups
        if split_suffix is not None and split_suffix.alive:
            self.prune_up(split_suffix)
        if node is not root and node.alive and self.host_on:
            self.backup_path(node)
        return prefix, i, node

    # ------------------------------------------------------------------------------------------ host
    def backup_path(self, x: Node) -> None:
        chain, y = [], x
        while y is not self.root and not y.host and not y.hpend:
            if not y.dev or y.tickets:
                return
            chain.append(y)
            y = y.parent
        if not chain:
            return
        chain.reverse()
        need = sum(len(n.key) for n in chain)
        if need > self.hkv_free:
            self.lock(x)
            ok = self._reclaimable(need - self.hkv_free)
            while ok and need > self.hkv_free:
                if not self.evict_host_kv(need - self.hkv_free):
                    ok = False
            self.unlock(x, prune=False)
            if not ok:
                self.stats["backup_no_room"] += 1
                return
        self.hkv_free -= need
        for n in chain:
            n.hpend = True
            n.parent.nhost += 1
            n.tickets += 1
            self.sync(n)
        self.sync(chain[0].parent)
        self.ops.append(chain)
        self.stats["backups"] += 1

    def _reclaimable(self, want: int) -> bool:
        """``HostTier._reclaimable``: would evicting host KV free ``want`` > 0 pages? Counts host leaves, then
        parents all of whose host children would go, until enough. The answer is the same in any order, so
        the candidates are read in place (the tree copies the set: O(host leaves) per backup)."""
        root, got = self.root, 0
        seen: dict[int, int] = {}
        for leaf in self.lru.sets[4]:
            queue = [leaf]
            while queue:
                y = queue.pop()
                got += len(y.key)
                if got >= want:
                    return True
                p = y.parent
                if p is root or not p.host or p.full or p.tickets:
                    continue
                seen[id(p)] = k = seen.get(id(p), 0) + 1
                if k == p.nhost:
                    queue.append(p)
        return False

    def check_events(self) -> None:
        """``check_hicache_events``: every backup in flight lands (``HostTier.apply_backup``)."""
        ops, self.ops = self.ops, []
        for nodes in ops:
            for y in nodes:
                y.tickets -= 1
                if y.hpend:
                    y.host, y.hpend = True, False
            for y in nodes:
                self.sync(y)
            self.sync(nodes[0].parent)
            for y in reversed(nodes):
                if y.alive:
                    self.prune_up(y)

    # ------------------------------------------------------------------------------------------ a request
    def request(self, prompt: list[int], answer: list[int], chunk: int) -> tuple[int, int, bool]:
        """``capacity_sim.Sim.request``'s calls. -> (pages reused, of them loaded from T2, state from T2)."""
        n = len(prompt)
        p, dev, best, hl, branching, has_slot = self.match(prompt[:n - 1], False)
        node, host_pages, from_t2 = dev, 0, False
        if hl > 0:
            got = self.load_back(dev, best, hl, has_slot)
            if got is not None:
                host_pages, from_t2, own = got
                has_slot = has_slot or own
                p, node = p + hl, best
        self.lock(node)
        if not has_slot and not self._alloc_states():
            raise RuntimeError("no T0 state slot even after evicting: the reservation is too small")
        total = n + len(answer)
        if not self.alloc_kv_evicting(total - p):
            raise RuntimeError("a request's KV does not fit T0 even after evicting: raise the GPU budget")
        last = node  # positions [prev, total) hold the request's own pages
        cuts = set(range(p + chunk, n, chunk)) | {n}
        if branching is not None and p < branching < n:
            cuts.add(branching)
        full = prompt + answer
        prev = p
        for pos in sorted(cuts):
            _, cached, res = self.insert(full[:pos], prev, last)
            if cached > prev:
                self.lock(res)
                self.unlock(last)
                last, prev = res, cached
            self.check_events()
        _, cached, _ = self.insert(full[:total - 1], prev, last)
        keep = max(cached, prev)
        self.kv_live -= total - keep
        self.st_live -= 1
        self.unlock(last)
        self.check_events()
        return p, host_pages, from_t2

    def _alloc_states(self) -> bool:
        pages = max(1, -(-self.est // self.ekv))
        while not self.alloc_state_slot():
            if self.evict_tokens(pages) == 0:
                return False
        return True


def _common(key: list[int], toks: list[int], i: int, end: int) -> int:
    n = min(len(key), end - i)
    if n == len(key) and toks[i:i + n] == key:
        return n
    m = 0
    while m < n and toks[i + m] == key[m]:
        m += 1
    return m
