"""A canonical dump of a radix cache: what two ranks' trees must agree on, node by node.

The dump walks the tree depth first, children in the order of their keys, and lists for each node
what it holds and where (T0 ids, ids in flight, T2 pages, the payload's slots), its locks and how
many operations are in flight on it, then the free room of every pool. Node ids (a process-wide
counter) are left out; slot ids are in: the ranks' allocators see the same calls, so they hand out
the same ids, and a dump that differs in one is a real divergence. ``digest`` folds it into one
63-bit int for the agreement's divergence check.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return tuple(v.reshape(-1).tolist())
    if isinstance(v, list):
        return tuple(v)
    return v


def tree_dump(cache: Any) -> list[tuple]:
    """``cache`` (a ``HiMambaRadixCache`` or ``HiSWARadixCache``) as a list of plain tuples."""
    out: list[tuple] = []
    stack = [(cache.tree.root, 0)]
    while stack:
        x, depth = stack.pop()
        p = x.payload
        payload = tuple((name, _plain(getattr(p, name))) for name in type(p).__slots__) if p is not None else ()
        out.append((depth, tuple(x.key), repr(x.ck), _plain(x.value), _plain(x.value_pending), _plain(x.host_kv),
                    _plain(x.host_pending), payload, x.full_lock_ref, x.mamba_lock_ref, len(x.tickets), x.resumes,
                    x.leaf_resumes, x.hit_count))
        kids = sorted(x.children.values(), key=lambda c: repr(c.ck), reverse=True)
        stack.extend((c, depth + 1) for c in kids)
    sizes = [("t0_kv", cache.kv.available_size())]
    for name in ("states", "swa"):
        side = getattr(cache, name, None)
        if side is not None:
            sizes.append((name, side.available_size()))
    ckpt = getattr(cache, "ckpt", None)
    if ckpt is not None:
        sizes.append(("t1", ckpt.available_size()))
    host = cache.host_tier.mirror
    if host is not None:
        sizes.extend((f"t2_{n}", r.available_size()) for n, r in sorted(host.regions.items()))
    out.append(("free", tuple(sizes), len(cache.host_tier.ops)))
    return out


def digest(cache: Any) -> int:
    """A 63-bit hash of ``tree_dump(cache)`` (non-negative, so ``-digest`` fits an int64 too)."""
    h = hashlib.blake2b(repr(tree_dump(cache)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1
