"""The walks on a key's bytes: ``RadixTree.probe``'s (an insert's, any kind) and the Mamba match's.

A key that comes as an int64 ``array`` (SGLang's ``Req`` holds one) is walked on byte offsets into its
``tobytes()`` (8 bytes a token): a child key is the next page's bytes (``RadixTree.child_key``, inlined;
the root's under the salt), and a node matches whole when its ``bkey`` equals the next ``len(bkey)``
bytes (``bytes.startswith`` at an offset, bounded by the walk's end: one memcmp, ~3x faster than comparing
array slices, and no slice of the query is made).
``common_len`` runs only inside the node where a match ends. A list key (the SWA tree's) takes
``probe_list``: the same walk on lists. ``tests/radix/test_tree_fast_checks.py`` holds the two to the
same answers.

An insert that follows its request's match starts at the matched node (``InsertParams.last_node``) where
``hinted`` proves the path (``remember``: the match saw its tokens; a live node's path never changes): the
path is read up through the parents (``climb``), the walk goes on below. ``tests/radix/test_tree_hint.py``
holds hinted and plain inserts to the same trees.
"""

from __future__ import annotations

from array import array
from typing import Any, Optional

import torch

from tiered_cache.radix.checks import common_len
from tiered_cache.radix.node import TreeNode

HINTS = 256  # paths remembered for a later insert's walk (``remember``): about an engine's running requests
HINT_BYTES = 64 << 20  # and the key bytes they may hold at most (8 a token: 256 prompts of 32K tokens)


class Hints(dict):
    """``tree.seen``: node -> (salt, a key's bytes, tokens) (``remember``), bounded by ``HINTS`` entries and
    ``HINT_BYTES`` of key bytes held (``nbytes``); a removed node is forgotten at once (``forget``), so a hint
    never keeps a dead node or its key alive."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def clear(self) -> None:
        super().clear()
        self.nbytes = 0

    def forget(self, node: TreeNode) -> None:
        got = self.pop(node, None)
        if got is not None:
            self.nbytes -= len(got[1])


def remember(tree: Any, node: TreeNode, salt: Optional[str], kb: bytes, end: int) -> None:
    """A walk just found the path from the root to the end of ``node`` (``end`` tokens) to hold ``kb[:8 * end]``
    under ``salt`` (``tree.seen``). That stays true while ``node`` lives: keys change only in ``split``, which
    keeps every node's end and the path's tokens, and a node is removed only childless, so ``node`` alive means
    its path is whole (``clear`` forgets all, ``RadixTree.remove`` the node it unlinks). At most ``HINTS`` are
    kept, holding at most ``HINT_BYTES`` of keys (``kb`` is held, not copied), the first remembered going first
    (a node remembered again keeps its place: no reordering per call)."""
    seen = tree.seen
    old = seen.get(node)
    if old is not None:
        seen.nbytes -= len(old[1])
    seen[node] = (salt, kb, end)
    seen.nbytes += len(kb)
    while len(seen) > HINTS or seen.nbytes > HINT_BYTES:
        seen.forget(next(iter(seen)))


def hinted(tree: Any, hint: TreeNode, kb: bytes, salt: Optional[str], aligned: int) -> int:
    """Tokens from the root to the end of ``hint`` when ``tree`` proves they are the first of ``kb`` (a key's
    bytes) under ``salt`` and at most ``aligned``, else 0 (the walk starts at the root): ``hint`` is alive and a
    walk remembered its path (``remember``) for a key whose first that many tokens are ``kb``'s (one compare)."""
    got = tree.seen.get(hint)
    if got is None or not hint.alive:
        return 0
    hsalt, hkb, end = got
    if hsalt != salt or end > aligned or not kb.startswith(memoryview(hkb)[:8 * end]):
        return 0
    return end


def probe_bytes(tree: Any, toks: array, salt: Optional[str], aligned: int, kb: Optional[bytes] = None,
                at: Optional[TreeNode] = None, at_end: int = 0):
    """``probe``'s walk of an array key to ``aligned`` tokens (``kb``: its bytes, when the caller has them).
    -> (path, matched tokens, device-matched tokens, whether a load is in flight on the path, whether the last
    node matched whole, how many leading nodes of the path hold device KV (``value`` set), the token where the
    path's last node starts). A node on the device costs one test (``value`` and ``value_pending`` are never
    both set: ``check_invariants``). ``at``: a node the tree proved the key's first ``at_end`` tokens end at
    (``hinted``): its path is read up from it (``climb``), the walk goes on below it."""
    ps = tree.page_size
    kb = toks.tobytes() if kb is None else kb
    w, bend = 8 * ps, 8 * aligned
    if at is None:
        b, dev_b, dev_n = 0, -1, -1
        path: list[TreeNode] = []
        pending = False
        child = tree.root.children.get(kb[:w] if salt is None else (salt, kb[:w])) if aligned else None
    else:
        b = 8 * at_end
        path, dev_b, dev_n, pending = climb(tree.root, at)
        child = at.children.get(kb[b:b + w]) if b < bend else None
    while child is not None:
        path.append(child)
        if child.value is None:
            if dev_n < 0:
                dev_n = len(path) - 1
            if child.value_pending is not None:
                pending = True  # being loaded: on the device for the caller
            elif dev_b < 0:
                dev_b = b  # neither: the device part ends where it starts
        bk = child.bkey
        if not kb.startswith(bk, b, bend):  # the match ends inside it (or past aligned)
            i = b >> 3
            j = i + common_len(child.akey, toks, i, aligned, ps)
            return path, j, j if dev_b < 0 else dev_b >> 3, pending, False, len(path) if dev_n < 0 else dev_n, i
        b += len(bk)
        child = child.children.get(kb[b:b + w]) if b < bend else None
    start = (b - len(path[-1].bkey)) >> 3 if path else 0
    return path, b >> 3, (b if dev_b < 0 else dev_b) >> 3, pending, True, len(path) if dev_n < 0 else dev_n, start


def climb(root: TreeNode, x: TreeNode) -> tuple[list[TreeNode], int, int, bool]:
    """The path from the root to ``x``, every node of it matched whole, and what ``probe_bytes``' walk down it
    would have noted: (path, the byte where its first node with neither device KV nor a load starts or -1, the
    index of its first node without device KV or -1, whether a load is in flight on it). Reading parents costs
    no child lookup and no key compare: the caller proved the path's tokens (``hinted``)."""
    path: list[TreeNode] = []
    hole: Optional[TreeNode] = None
    dev_r = 0
    pending = False
    while x is not root:
        path.append(x)
        if x.value is None:  # the shallowest such node is the last one seen going up
            dev_r = len(path)
            if x.value_pending is not None:
                pending = True
            else:
                hole = x
        x = x.parent
    path.reverse()
    dev_b = -1
    if hole is not None:  # where it starts: the keys above it (rare: a host-only or dead node on the path)
        dev_b, y = 0, hole.parent
        while y is not root:
            dev_b += len(y.bkey)
            y = y.parent
    return path, dev_b, len(path) - dev_r if dev_r else -1, pending


def probe_list(tree: Any, toks: list[int], salt: Optional[str], aligned: int):
    """``probe_bytes`` for a list key: child keys by ``child_key``, nodes compared as lists."""
    ps, node = tree.page_size, tree.root
    path, i, dev, on_dev, pending, dev_n, start = [], 0, 0, True, False, -1, 0
    while i < aligned:
        child = node.children.get(tree.child_key(toks, i, node is tree.root, salt))
        if child is None:
            break
        key = child.key
        n = len(key)
        m = n if i + n <= aligned and toks[i:i + n] == key else common_len(key, toks, i, aligned, ps)
        path.append(child)
        pending = pending or child.value_pending is not None
        if child.value is None and dev_n < 0:
            dev_n = len(path) - 1
        on_dev = on_dev and (child.value is not None or child.value_pending is not None)
        start = i
        i += m
        dev = i if on_dev else dev
        if m < n:
            return path, i, dev, pending, False, len(path) if dev_n < 0 else dev_n, start
        node = child
    return path, i, dev, pending, True, len(path) if dev_n < 0 else dev_n, start


def mamba_walk(tree: Any, toks: array, salt: Optional[str], end: int, kb: bytes):
    """The Mamba match's read-only walk (``MambaRule.match``). -> (nodes on the path, device values of fully
    matched nodes, page-aligned tokens whose KV matched in any tier, deepest node with a T1 state reachable on
    the device, its depth, its #values, deepest node with a state in any tier, its depth).

    A node without KV in any tier (dead) ends it. ``kb``: ``toks.tobytes()``."""
    ps = tree.page_size
    root = tree.root
    path: list[TreeNode] = []
    values: list[torch.Tensor] = []
    dev, dev_b, dev_k = root, 0, 0
    best, best_b = root, 0
    w, bend, b = 8 * ps, 8 * (end // ps * ps), 0
    child = root.children.get(kb[:w] if salt is None else (salt, kb[:w])) if bend else None
    while child is not None:  # on the device: every node's KV is a hit
        v = child.value
        if v is None:
            break
        path.append(child)
        bk = child.bkey
        if not kb.startswith(bk, b, bend):
            i = b >> 3
            return path, values, i + common_len(child.akey, toks, i, bend >> 3, ps), dev, dev_b >> 3, dev_k, \
                best, best_b >> 3
        b += len(bk)
        values.append(v)
        p = child.payload
        if p.mamba_value is not None:
            best = dev = child
            best_b = dev_b = b
            dev_k = len(values)
        elif p.state_host is not None:
            best, best_b = child, b
        child = child.children.get(kb[b:b + w]) if b < bend else None
    while child is not None:  # past the device part: host hits only
        if child.value is None and child.host_kv is None:
            break  # dead: matches nothing
        path.append(child)
        bk = child.bkey
        if not kb.startswith(bk, b, bend):
            i = b >> 3
            return path, values, i + common_len(child.akey, toks, i, bend >> 3, ps), dev, dev_b >> 3, dev_k, \
                best, best_b >> 3
        b += len(bk)
        p = child.payload
        if p.mamba_value is not None or p.state_host is not None:
            best, best_b = child, b
        child = child.children.get(kb[b:b + w]) if b < bend else None
    return path, values, b >> 3, dev, dev_b >> 3, dev_k, best, best_b >> 3
