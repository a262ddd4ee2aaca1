"""What a cost-aware policy needs to know about a node, read in one place (``NodeFacts``).

The policies rank victims by what a node's data saves and holds; the tree tells them only which nodes
are candidates and when they were used (``policy.EvictionPolicy``). These few facts are read off a
``TreeNode`` here, so no policy reaches into a node and the tree needs no change to report them:

    prefix(x)   tokens from the root to x's end (fixed for x's life: a split makes a new upper node)
    anchor(x)   prefix of x's nearest ancestor a model can resume from (0: the root): evicting x's
                state or KV makes its next hit recompute ``[anchor, prefix)``
    span(x)     tokens of x's own span; children(x); hits(x) (matches that resumed at x: ``resumes``, not
                SGLang's path-match ``hit_count``); leaf_resumes(x): those made while x had no child
    dropped_with(x): device tokens of the tombstones that go with the leaf x when it is dropped
    t1(x) / t2(x) / host_kv(x) / on_device(x): where x's data lives
"""

from __future__ import annotations

from typing import Any


class NodeFacts:
    """Facts of the nodes of a radix tree; ``prefix`` is remembered until ``forget``."""

    def __init__(self) -> None:
        self._prefix: dict[Any, int] = {}

    def prefix(self, x: Any) -> int:
        p = self._prefix.get(x)
        if p is None:
            p, y = 0, x
            while y.parent is not None:
                p += len(y.key)
                y = y.parent
            self._prefix[x] = p
        return p

    def anchor(self, x: Any) -> int:
        y = x.parent
        while y.parent is not None and not y.payload.resumable:
            y = y.parent
        return 0 if y.parent is None else self.prefix(y)

    @staticmethod
    def dropped_with(x: Any) -> int:
        """Device tokens of the ancestors that go when the leaf ``x`` is dropped: the unlocked idle
        one-child tombstones right above it (``RadixTree.after_child_removed`` removes them)."""
        tok, y = 0, x.parent
        while (y.parent is not None and len(y.children) == 1 and not y.payload.resumable and not y.full_lock_ref
               and not y.tickets):
            tok += len(y.key) if y.value is not None else 0
            y = y.parent
        return tok

    @staticmethod
    def span(x: Any) -> int:
        return len(x.key)

    @staticmethod
    def children(x: Any) -> int:
        return len(x.children)

    @staticmethod
    def hits(x: Any) -> int:
        return x.resumes

    @staticmethod
    def leaf_resumes(x: Any) -> int:
        return x.leaf_resumes

    @staticmethod
    def t1(x: Any) -> bool:
        return getattr(x.payload, "mamba_value", None) is not None

    @staticmethod
    def t2(x: Any) -> bool:
        return getattr(x.payload, "state_host", None) is not None

    @staticmethod
    def host_kv(x: Any) -> bool:
        return x.host_kv is not None

    @staticmethod
    def on_device(x: Any) -> bool:
        return x.value is not None

    def forget(self, x: Any) -> None:
        self._prefix.pop(x, None)

    def clear(self) -> None:
        self._prefix.clear()
