"""``GhostCache``: a hybrid prefix cache of token spans and counts, no data, for replaying a window of
requests under another weight of a policy (``tuning.AlphaTuner``).

Marconi tunes alpha by replaying recent requests over a grid of values; a live engine cannot build a
second cache of its own size on the GPU to do it, so the replay runs here: a radix tree of the tokens
the tree cached, a budget of ``kv_tokens`` device KV tokens and ``states`` T1 states, and the policy
object itself (a ``ScoredPolicy`` of the live one's class and costs, over these nodes: the victims are
chosen by the same code as the live tree's). One finished sequence at a time (``request``):

    match    the longest prefix ending at a node with a state (the hit: what a model resumes from)
    admit    Marconi's leaf + branch rule: a state at the sequence's end, and one where it leaves a
             cached path (inside a span, which is split there, or at the end of a node with children)
    evict    while the budget is exceeded: a KV victim (a leaf) goes with its state and the stateless
             nodes above it that are left childless; a state victim leaves a stateless node (removed
             when it is a leaf)

What it leaves out, on purpose: the running requests' KV (outside the tree: the tuner sizes the ghost by
what the live tree held, ``tuning``), locks, pages, the host tiers and the prompt / answer split (a
finished sequence is matched whole, so an identical repeat counts its answer too). It ranks weights of
one policy against each other on the same requests, which these leave alike; it predicts no hit rate.
Nodes offer what ``facts.NodeFacts`` reads of a ``TreeNode``; keys are int64 arrays, shared by copies
(a split makes new ones).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Sequence
from typing import Any, Optional

from tiered_cache.validate import int_arg

_ids = itertools.count()



def descendants(root: Any) -> list:
    """Every node below ``root`` (anything whose ``children`` is a dict of nodes), depth first, each after
    its parent."""
    out, stack = [], list(root.children.values())
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(x.children.values())
    return out

class GhostNode:
    """A span of the ghost tree; ``payload`` is the node itself (``resumable``, ``mamba_value``)."""

    __slots__ = ("id", "parent", "key", "children", "mamba_value", "resumes", "leaf_resumes",
                 "__weakref__")
    value = True  # its KV is on the device (the ghost keeps nothing else)
    host_kv = state_host = None
    full_lock_ref = 0
    tickets = ()

    def __init__(self, parent: Optional[GhostNode], key: array, state: bool) -> None:
        self.id = next(_ids)
        self.parent = parent
        self.key = key
        self.children: dict[int, GhostNode] = {}
        self.mamba_value: Optional[bool] = True if state else None
        self.resumes = self.leaf_resumes = 0

    @property
    def payload(self) -> GhostNode:
        return self

    @property
    def resumable(self) -> bool:
        return self.mamba_value is not None


class GhostCache:
    """A ghost of ``kv_tokens`` device KV tokens and ``states`` T1 states, evicting through ``policy`` (a
    fresh ``ScoredPolicy``: the ghost tells it touches and candidates as the tree does)."""

    def __init__(self, policy: Any, kv_tokens: int, states: int) -> None:
        self.policy = policy
        self.kv_cap = int_arg("kv_tokens", kv_tokens, lo=1)
        self.st_cap = int_arg("states", states, lo=1)
        self.root = GhostNode(None, array("q"), False)
        self.kv = self.st = 0

    # ----------------------------------------------------------------------------- requests
    def request(self, seq: Sequence[int]) -> int:
        """Serve the finished sequence ``seq``: returns the tokens of its hit, then caches it (module docstring)."""
        seq = seq if isinstance(seq, array) else array("q", seq)
        pol, node, pos, hit, hit_node = self.policy, self.root, 0, 0, None
        split: Optional[tuple[GhostNode, int]] = None
        while pos < len(seq):
            child = node.children.get(seq[pos])
            if child is None:
                break
            k = _common(child.key, seq, pos)
            if k < len(child.key):
                split = (child, k)
                break
            pos += k
            node = child
            pol.touch("kv", node)
            if node.mamba_value is not None:
                hit, hit_node = pos, node
        if hit_node is not None:
            hit_node.resumes += 1
            hit_node.leaf_resumes += not hit_node.children
            pol.touch("state", hit_node)
        if split is not None:  # the sequence leaves the cached path inside a span: a branch point
            node = self._split(*split)
            pos += split[1]
        elif pos < len(seq) and node.children and node.parent is not None:  # ... at the end of a node
            self._give_state(node)
        if pos < len(seq):
            leaf = GhostNode(node, seq[pos:], True)
            node.children[seq[pos]] = leaf
            pol.discard("kv", node)
            self.kv += len(leaf.key)
            self.st += 1
            pol.touch("kv", leaf)
            pol.touch("state", leaf)
            pol.add("kv", leaf)
            pol.add("state", leaf)
        elif node.parent is not None:
            self._give_state(node)
        self._evict()
        return hit

    def _split(self, child: GhostNode, k: int) -> GhostNode:
        """``child``'s span cut after ``k`` tokens: the upper part is a new node with a state (a branch point)."""
        parent = child.parent
        assert parent is not None
        mid = GhostNode(parent, child.key[:k], False)
        parent.children[mid.key[0]] = mid
        child.key = child.key[k:]
        child.parent = mid
        mid.children[child.key[0]] = child
        self._give_state(mid)
        return mid

    def _give_state(self, x: GhostNode) -> None:
        if x.mamba_value is None:
            x.mamba_value = True
            self.st += 1
            self.policy.touch("state", x)
            self.policy.add("state", x)

    # ----------------------------------------------------------------------------- eviction
    def _evict(self) -> None:
        pol = self.policy
        while self.kv > self.kv_cap:
            x = pol.pop("kv")
            if x is None:
                break
            self._drop(x)
        while self.st > self.st_cap:
            x = pol.pop("state")
            if x is None:
                break
            x.mamba_value = None
            self.st -= 1
            if not x.children:
                self._drop(x)

    def _drop(self, x: GhostNode) -> None:
        """Remove the leaf ``x`` with its state, and the stateless ancestors left childless."""
        pol = self.policy
        while True:
            parent = x.parent
            assert parent is not None and not x.children
            del parent.children[x.key[0]]
            self.kv -= len(x.key)
            if x.mamba_value is not None:
                self.st -= 1
            pol.forget(x)
            if parent.parent is None or parent.children:
                break
            if parent.mamba_value is not None:
                pol.add("kv", parent)
                break
            x = parent

    def nodes(self) -> list[GhostNode]:
        return descendants(self.root)

    def copy(self, policy: Any, kv_tokens: Optional[int] = None) -> GhostCache:
        """This ghost with its nodes, stamps and candidates copied under ``policy`` (a fresh one); ``kv_tokens``:
        its budget of KV tokens from now on (None: this one's; the copy evicts down to it at its next request)."""
        g = GhostCache(policy, self.kv_cap if kv_tokens is None else kv_tokens, self.st_cap)
        g.kv, g.st = self.kv, self.st
        twin: dict[Any, GhostNode] = {self.root: g.root}
        for x in descendants(self.root):  # each node after its parent
            y = GhostNode(twin[x.parent], x.key, x.mamba_value is not None)  # keys are never changed in place
            y.resumes, y.leaf_resumes = x.resumes, x.leaf_resumes
            twin[x] = y
            y.parent.children[y.key[0]] = y  # type: ignore[union-attr]
        policy.adopt(self.policy, twin)
        return g


def _common(key: array, seq: array, pos: int) -> int:
    n = min(len(key), len(seq) - pos)
    if key[:n] == seq[pos:pos + n]:  # the whole span (or the rest of the sequence): one compare in C
        return n
    i = 0
    while i < n and key[i] == seq[pos + i]:
        i += 1
    return i
