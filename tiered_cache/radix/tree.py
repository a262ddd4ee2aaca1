"""``RadixTree``: the nodes of a radix cache, their keys, locks and size counters.

The tree maps token pages to nodes and keeps three things true whatever moves data between tiers: every
node is filed under the one child key (``child_key``), the size counters match the nodes, and each node sits
in exactly the eviction candidate sets it belongs to (``sync``). It knows the KV side of T0 (a node's
``value``) and nothing of the hybrid kind: what a node needs to resume is its payload, and the kind's resume
rule (``mamba.MambaRule``, ``swa_rule.SWARule``) answers the few questions the tree asks about it
(``hooks.KindHooks``). Moving data is the host tier's and the eviction's job (``host.py``, ``evict.py``);
both change nodes only through the methods here.

Locks: ``lock(node)`` adds one to ``full_lock_ref`` of every node from ``node`` to the root and one
to ``node.mamba_lock_ref``, which protects the node's payload. A tombstone may be locked (the engine
locks where its prefix ends); a locked tombstone may become a leaf when its children go, and is
removed when its last lock is released. Otherwise no leaf is a tombstone. Dropping a leaf removes it,
then any parents it leaves as childless unlocked idle tombstones. Walks take the tokens as a list or an
int64 ``array`` (its bytes compared with the nodes' ``bkey`` and child keys cut from them: no int per token).
"""

from __future__ import annotations

import collections
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix.checks import common_len
from tiered_cache.radix.frees import Frees, copy_ids, pages_of
from tiered_cache.radix.hooks import KindHooks
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import MatchResult
from tiered_cache.radix.policy import EvictionPolicy, LRUPolicy
from tiered_cache.radix.walks import Hints, hinted, probe_bytes, probe_list
from tiered_cache.tiers.protocols import KVSide


class RadixTree:
    """Nodes over the KV side ``kv`` of T0, victims ranked by ``policy``. Public state the components read:
    ``root``, ``page_size``, ``device``, ``policy``, ``stats`` (event counts of the whole cache), ``freed``
    (running totals of device units freed, per resource: the eviction reports deltas), ``owned`` (page-level
    "the tree owns this KV page": refuses inserts of ids it already holds), ``sinks`` (``Frees``' pools) and
    ``host_on`` (a T2 tier is attached: a device node whose children are on the host only may give up its KV)."""

    def __init__(self, kv: KVSide, policy: Optional[EvictionPolicy], validate: bool) -> None:
        if policy is not None and not isinstance(policy, EvictionPolicy):
            raise InvalidTypeError("policy", "an EvictionPolicy", type(policy).__name__)
        if not isinstance(validate, bool):
            raise InvalidTypeError("validate", "a bool", validate)
        self.kv = kv
        self.page_size = ps = kv.page_size
        self.device = kv.device
        self.policy = policy or LRUPolicy()
        self.validate = validate
        self.empty = torch.empty(0, dtype=torch.int64, device=self.device)
        # host-side: the tree's bookkeeping is host code, and a page list indexes numpy without a launch
        self.owned = np.zeros(kv.capacity, dtype=bool)
        self.offsets = np.arange(ps, dtype=np.int64)
        self.ps0 = np.array(ps, dtype=np.int64)  # the page size as a 0-d array: numpy's cheaper operand
        self.stats: collections.Counter = collections.Counter()
        self.sinks: dict[str, Any] = {}
        self.host_on = False
        self.rule: KindHooks
        self.root: TreeNode  # set by clear()
        self.epochs = 0  # clear() calls: the first has no old tree to free
        self._path_resources: tuple[str, ...] = ()
        # node -> (salt, a key's bytes, tokens): a walk found the path from the root to node's end to hold that key's
        # first tokens (``walks.remember``); a later insert of the same request may start its walk there
        self.seen = Hints()

    def bind(self, rule: KindHooks) -> None:
        """The resume rule of the tree's hybrid kind (it holds the tree too: bound once, then ``clear``)."""
        self.rule = rule
        self._path_resources = ("kv", "kv_host") + tuple(rule.path_resources)

    def clear(self) -> None:
        """Give every slot the nodes own back (callers wait for transfers first); a new, empty root."""
        if self.epochs:
            f = Frees(self)
            stack = list(self.root.children.values())
            while stack:
                x = stack.pop()
                stack.extend(x.children.values())
                f.take(x)
                x.alive = False
            f.flush()
        self.epochs += 1
        self.token = object()  # new owner tag: nodes of the old tree are refused from now on
        self.root = TreeNode(self.token, None, [], self.empty, self.rule.payload(), array("q"))
        self.policy.clear()
        self.seen.clear()
        self.owned[:] = False
        self.full_evictable = self.full_protected = self.state_evictable = self.state_protected = 0
        self.freed = {"kv": 0, "state": 0, "swa": 0}

    # ----------------------------------------------------------------------------- keys, walks
    def child_key(self, toks: Any, i: int, at_root: bool, salt: Optional[str]) -> Any:
        """THE key of the child holding ``toks[i:]`` in its parent's ``children``: its first page's int64 ids as
        bytes (hashed and compared in C, no Python int per token), under ``(salt, ...)`` at the root when set.
        ``toks``: a list, an int64 array, or such an array's bytes (``tobytes()``: the page cut, no slice made)."""
        if type(toks) is bytes:
            ck = toks[8 * i:8 * (i + self.page_size)]
        else:
            page = toks[i:i + self.page_size]
            ck = (page if type(page) is array else array("q", page)).tobytes()
        return (salt, ck) if at_root and salt is not None else ck

    @staticmethod
    def key_salt(ck: Any) -> Optional[str]:
        """The request key a root child's key was filed under (``child_key``'s inverse; a page is bytes)."""
        return ck[0] if isinstance(ck, tuple) else None

    def child(self, node: TreeNode, toks: Sequence[int], i: int, salt: Optional[str]) -> Optional[TreeNode]:
        return node.children.get(self.child_key(toks, i, node is self.root, salt))

    def path_tokens(self, x: TreeNode) -> tuple[list[int], Optional[str]]:
        """-> (the token ids from the root to the end of ``x``, the request key of its path)."""
        parts, y = [], x
        while y.parent is not self.root:
            parts.append(y.akey)
            y = y.parent
        parts.append(y.akey)
        return [t for p in reversed(parts) for t in p], self.key_salt(y.ck)

    def path_values(self, node: TreeNode) -> torch.Tensor:
        """T0 KV ids from the root to the end of ``node`` (every node on the path on the device)."""
        vals: list[Any] = []
        while node is not self.root:
            vals.append(node.value)
            node = node.parent
        return torch.cat(vals[::-1]) if vals else self.empty

    def probe(self, toks: Any, salt: Optional[str], aligned: int, prev: int, kb: Optional[bytes] = None,
              hint: Optional[TreeNode] = None):
        """Read-only insert walk. -> (path, the node ending exactly at ``aligned`` or None, (how many leading nodes
        of the path hold device KV, the token where its last node starts, whether that node matched whole),
        whether a load is in flight on the path). Tokens a load is writing count as on the device (the caller got
        their ids from ``init_load_back``); a node on the host only, or dead, ends the device part: insert gives it
        the caller's ids. An insert's ``prev_prefix_len`` past that part is an error. ``toks``: an int64 ``array``
        (walked on its bytes ``kb``) or a list. ``hint``: a node the key's request's match (or insert) ended at:
        the walk starts there when ``walks.hinted`` proves the key's path runs through it (the same answer, fewer
        steps), else at the root."""
        if type(toks) is array:
            kb = toks.tobytes() if kb is None else kb
            at_end = 0 if hint is None else hinted(self, hint, kb, salt, aligned)
            path, i, dev, pending, whole, dev_n, start = probe_bytes(
                self, toks, salt, aligned, kb, hint if at_end else None, at_end)
        else:
            path, i, dev, pending, whole, dev_n, start = probe_list(self, toks, salt, aligned)
        end = path[-1] if path and i == aligned and whole else None
        if prev > dev:
            raise InvalidArgumentError("prev_prefix_len", f"<= the cached prefix length ({dev})", prev)
        return path, end, (dev_n, start, whole), pending

    def match_result(self, idx: torch.Tensor, dev: TreeNode, best: TreeNode, host_len: int, mamba_host: int,
                     branching: Optional[int], kv_len: int, **kw: Any) -> MatchResult:
        """A match of ``idx`` device ids ending at ``dev``, resumable at ``best`` (``MatchResult``)."""
        last_host = best
        if self.host_on:
            while last_host is not self.root and last_host.host_kv is None:
                last_host = last_host.parent
        return MatchResult(device_indices=idx, last_device_node=dev, last_host_node=last_host,
                           best_match_node=best, host_hit_length=host_len, mamba_host_hit_length=mamba_host,
                           mamba_branching_seqlen=branching, cache_protected_len=idx.shape[0], kv_hit_length=kv_len,
                           **kw)

    def insert_step(self, node: TreeNode, toks: list[int], i: int, end: int, salt: Optional[str],
                    child: Optional[TreeNode] = None):
        """One step of an insert walk: the child of ``node`` holding ``toks[i:end]`` (``child``: that child, found
        by ``probe``), split where the match ends inside it, its KV recency refreshed. -> (child, tokens
        matched, the lower half of a split or None), or None: no child."""
        child = self.child(node, toks, i, salt) if child is None else child
        if child is None:
            return None
        key = child.akey if type(toks) is array else child.key
        m = common_len(key, toks, i, end, self.page_size)
        lower, child = (child, self.split(child, m)) if m < len(key) else (None, child)
        self.policy.touch("kv", child)
        return child, m, lower

    # ----------------------------------------------------------------------- checks, structure
    def check_node(self, node: Any, arg: str = "node") -> None:
        if not isinstance(node, TreeNode):
            raise InvalidTypeError(arg, "a TreeNode of this cache", type(node).__name__)
        if node.owner is not self.token or not node.alive:
            raise InvalidArgumentError(arg, "a live node of this cache", node)

    def check_locked(self, node: Any, arg: str) -> None:
        """``node`` is a live node of this tree that ``lock`` locked (the root always counts)."""
        self.check_node(node, arg)
        if node is not self.root and node.mamba_lock_ref <= 0:
            raise InvalidArgumentError(arg, "a node locked by inc_lock_ref", node)

    def link(self, parent: TreeNode, key: Any, value: Optional[torch.Tensor], salt: Optional[str]) -> TreeNode:
        """A new node under ``parent`` (nothing counted, listed or touched yet); ``key`` a list or an array."""
        akey = key if type(key) is array else None  # an array key: no list made (``TreeNode.key``)
        x = TreeNode(self.token, parent, key if akey is None else None, value, self.rule.payload(), akey)
        x.ck = self.child_key(key, 0, parent is self.root, salt)
        parent.children[x.ck] = x
        return x

    def new_leaf(self, parent: TreeNode, key: Any, value: torch.Tensor, salt: Optional[str], fill: Any = None,
                 pages: Optional[np.ndarray] = None, lo: int = 0, host: Optional[np.ndarray] = None) -> TreeNode:
        """A device leaf for ``key`` taking a copy of the caller's ids ``value[lo:lo + len(key)]`` (``pages``: theirs,
        if checked; ``host``: ``value.numpy()`` on the CPU, if the caller made it); ``fill(leaf)`` its payload."""
        ids = copy_ids(value, lo, lo + len(key), host)
        leaf = self.link(parent, key, ids, salt)
        self.owned[pages_of(ids, self.page_size) if pages is None else pages] = True
        self.full_evictable += len(key)
        self.policy.touch("kv", leaf)
        if fill is not None:
            fill(leaf)
        self.sync(leaf)
        self.sync(parent)
        return leaf

    def own(self, x: TreeNode) -> None:
        """``x.value`` was just set (a reattach or a finished load): the tree owns and counts its pages."""
        self.owned[pages_of(x.value, self.page_size)] = True  # type: ignore[arg-type]  # just set: a tensor
        if x.full_lock_ref:
            self.full_protected += len(x.akey)
        else:
            self.full_evictable += len(x.akey)

    def reattach(self, x: TreeNode, ids: torch.Tensor) -> None:
        """``x``'s KV was on the host only (or nowhere): it takes the caller's ids for its span."""
        x.value = ids.clone()
        self.own(x)
        self.sync(x)
        self.sync(x.parent)

    def split(self, child: TreeNode, m: int) -> TreeNode:
        """child -> new (key[:m]) -> child (key[m:]); returns new. Sizes do not change. Host pages (one per page),
        data in flight and the payload (``payload.split``) are partitioned at the same page."""
        parent, k = child.parent, m // self.page_size
        new = TreeNode(self.token, parent, None, None if child.value is None else child.value[:m].clone(),
                       child.payload.split(m, k), child.akey[:m])
        new.ck = child.ck
        new.full_lock_ref = child.full_lock_ref  # every lock below child is below new too
        new.hit_count = child.hit_count  # every match through child passed new; none resumed at new (``resumes`` 0)
        child.set_akey(child.akey[m:])
        if child.value is not None:
            child.value = child.value[m:].clone()
        if child.value_pending is not None:
            new.value_pending, child.value_pending = child.value_pending[:m].clone(), child.value_pending[m:].clone()
        for attr in ("host_kv", "host_pending"):
            lst = getattr(child, attr)
            if lst is not None:
                setattr(new, attr, lst[:k])
                setattr(child, attr, lst[k:])
        new.tickets = list(child.tickets)
        for op in child.tickets:  # the op now finishes both halves
            op.nodes.insert(op.nodes.index(child), new)
        child.ck = self.child_key(child.akey, 0, False, None)
        child.parent = new
        new.children[child.ck] = child
        parent.children[new.ck] = new
        self.policy.touch("kv", child)
        self.sync(new)
        self.sync(child)
        return new

    # ----------------------------------------------------------------------- locks, candidates
    def lock(self, node: TreeNode) -> int:
        """-> the change of ``full_evictable`` (<= 0)."""
        if node is self.root:
            return 0
        discard = self.policy.discard
        if node.mamba_lock_ref == 0:
            self.rule.own_lock_changed(node, True)
        node.mamba_lock_ref += 1
        delta, x = 0, node
        while x is not self.root:
            if x.full_lock_ref == 0:
                n = len(x.akey) if x.value is not None else 0
                self.full_evictable -= n
                self.full_protected += n
                delta -= n
                for r in self._path_resources:
                    discard(r, x)
            x.full_lock_ref += 1
            x = x.parent
        return delta

    def unlock(self, node: TreeNode, prune: bool = True) -> int:
        """-> the change of ``full_evictable`` (>= 0 less what a pruned locked tombstone held)."""
        if node is self.root:
            return 0
        node.mamba_lock_ref -= 1
        if node.mamba_lock_ref == 0:
            self.rule.own_lock_changed(node, False)
        f = Frees(self)
        delta, x = 0, node
        while x is not self.root:
            x.full_lock_ref -= 1
            parent = x.parent
            if x.full_lock_ref == 0:
                n = len(x.akey) if x.value is not None else 0
                self.full_evictable += n
                self.full_protected -= n
                delta += n
                if prune and not x.children and not x.tickets and not x.payload.resumable:
                    # a locked tombstone (or dead node) that lost its children: gone with its last lock
                    self.remove(x, f)
                    delta -= n
                else:
                    self.sync(x)
            elif x is node:
                self.sync(x)
            x = parent
        f.flush()
        return delta

    def sync(self, x: TreeNode) -> None:
        """Put ``x`` in exactly the candidate sets it belongs to now, from the node alone (and its children):
        every path that changes a node calls it instead of keeping add/discard pairs in step by hand. A node
        with a transfer in flight is never a candidate."""
        if x is self.root or not x.alive:
            return
        pol = self.policy
        idle = not x.tickets
        unlocked = idle and x.full_lock_ref == 0
        kids = x.children.values()
        if x.value is None:
            pol.discard("kv", x)
        elif unlocked and (not kids or (self.host_on and not any(
                c.value is not None or c.value_pending is not None for c in kids))):
            pol.add("kv", x)  # no child on the device: its device KV can go
        else:
            pol.discard("kv", x)
        if self.host_on:
            host_leaf = x.host_kv is not None and unlocked and not any(
                c.host_kv is not None or c.host_pending is not None for c in kids)
            (pol.add if host_leaf else pol.discard)("kv_host", x)
        self.rule.sync(x, idle, unlocked)

    # ----------------------------------------------------------------------------- removal
    def remove(self, x: TreeNode, f: Frees) -> None:
        """Unlink an unlocked childless node with nothing in flight; its ids go to ``f``."""
        assert not x.tickets, f"{x} is removed with transfers in flight"
        del x.parent.children[x.ck]
        self.policy.forget(x)
        if x.value is not None:
            self.full_evictable -= len(x.akey)
            self.freed["kv"] += len(x.akey)
        self.rule.removed(x)
        f.take(x)
        x.alive = False
        self.seen.forget(x)

    def after_child_removed(self, p: TreeNode, f: Frees) -> int:
        """``p`` lost a child: drop it (and up) while a childless unlocked idle tombstone. -> device tokens."""
        tok = 0
        while p is not self.root:
            if p.children or p.full_lock_ref or p.tickets or p.payload.resumable:
                self.sync(p)
                break
            q = p.parent
            tok += len(p.akey) if p.value is not None else 0
            self.remove(p, f)
            p = q
        return tok

    def drop_leaf(self, x: TreeNode, f: Frees) -> int:
        """Remove the leaf ``x`` and the tombstones it leaves behind. -> device tokens freed."""
        tok = len(x.akey) if x.value is not None else 0
        p = x.parent
        self.remove(x, f)
        return tok + self.after_child_removed(p, f)

    def evict_each(self, resource: str, num: int, one: Callable[[TreeNode, Frees], int],
                   settle: Optional[Callable[[], bool]] = None) -> int:
        """Pop victims of ``resource`` (LRU first) and hand each to ``one``, which frees into a shared ``Frees``
        and returns how much it freed, until ``num``. No victim left: ``settle()`` (backups in flight hold
        candidates: they finish) says whether to look again. -> the amount freed."""
        f = Frees(self)
        got = 0
        while got < num:
            x = self.policy.pop(resource)
            if x is None:
                if settle is not None and settle():
                    continue
                break
            got += one(x, f)
        f.flush()
        return got

    def prune_up(self, x: TreeNode) -> None:
        """``x`` may have become an idle unlocked tombstone leaf: it goes (and up); else it is re-listed."""
        if x is self.root or not x.alive:
            return
        f = Frees(self)
        if not x.children and x.full_lock_ref == 0 and not x.tickets and not x.payload.resumable:
            self.drop_leaf(x, f)
        else:
            self.sync(x)
        f.flush()

