"""``TreeNode``: one span of a radix tree of token pages.

A node says where its data lives; it decides nothing. Data of a span can be in several tiers at once
(a host copy stays when the device copy is loaded back), and data *in flight* is kept apart from data
the node owns, because the tree changes where a node lives only when the ticket completes::

    akey           token ids of the span, an int64 ``array`` (``len`` a multiple of page_size, > 0 except
                   the root); ``bkey`` its bytes, which walks compare with a slice of the query's bytes (one
                   memcmp: ~3x faster than comparing array slices, for 8 bytes a token); ``key`` the same as a
                   list, made on first read (an insert of an ``array`` key makes no Python int per token)
    value          T0 virtual KV ids of the span (LongTensor) or None: not on the device
    value_pending  T0 ids a load back is writing (owned by the load until its ticket completes)
    host_kv        T2 host pages of the span, one slot per page (a list: a split partitions it)
    host_pending   T2 host pages a backup is writing (owned by the backup until it completes)
    payload        what the hybrid kind needs to resume at the span's end (its resume rule's payload:
                   ``mamba.MambaPayload``, a recurrent state; ``swa.SWAPayload``, the span's SWA KV).
                   ``payload.resumable`` False: a *tombstone* (a hybrid model cannot resume here)
    tickets        in-flight operations (``host.Op``) reading or writing this node's data; a node
                   with one is never dropped and never a victim
    full_lock_ref  locks on this node or any descendant (the lock covers the path to the root)
    mamba_lock_ref locks taken on this node itself; they protect its payload. full >= mamba.
    resumes        matches that resumed at this node's end (from its state): what the eviction policies read
                   (``policies.facts``). A split's new upper node has none: no request resumed there
    leaf_resumes   those of them made while the node had no child: each request moved on past it (made a child);
                   one made with a child there is a reuse past the child (``policies.tiered``'s one-child rule)
    hit_count      matches that passed through this node, SGLang's count (write_through_selective backs a node
                   up at ``write_through_threshold`` of them); a split copies it: every match through the
                   lower part passed through the upper one

A node with KV nowhere (no ``value``, no ``host_kv``, nothing pending) is *dead*: a load back found
its host copy corrupt while a request held it locked. It matches nothing and goes with its last lock.
"""

from __future__ import annotations

import itertools
from array import array
from typing import Any, Optional

import torch

_ids = itertools.count()


class TreeNode:
    __slots__ = (
        "id", "parent", "children", "ck", "_key", "akey", "bkey", "value", "value_pending", "host_kv", "host_pending",
        "payload", "tickets", "full_lock_ref", "mamba_lock_ref", "owner", "alive", "resumes", "leaf_resumes",
        "hit_count", "__weakref__",
    )

    def __init__(self, owner: Any, parent: Optional[TreeNode], key: Optional[list[int]], value: Optional[torch.Tensor],
                 payload: Any, akey: Optional[array] = None) -> None:
        """``key`` (a list) or ``akey`` (an int64 array) gives the span's tokens; both: the same tokens."""
        self.id = next(_ids)
        self.owner = owner  # the (tree, epoch) that made it: a node of another cache or of a reset tree is refused
        self.parent: TreeNode = parent  # type: ignore[assignment]  # None at the root only: walks stop there
        self.children: dict[Any, TreeNode] = {}
        self.ck: Any = None  # this node's key in parent.children (``RadixTree.child_key``)
        self._key = key
        self.akey: array = array("q", key) if akey is None else akey  # type: ignore[arg-type]  # one is given
        self.bkey = self.akey.tobytes()
        self.value = value
        self.value_pending: Optional[torch.Tensor] = None
        self.host_kv: Optional[list[int]] = None
        self.host_pending: Optional[list[int]] = None
        self.payload = payload
        self.tickets: list = []
        self.full_lock_ref = 0
        self.mamba_lock_ref = 0
        self.alive = True
        self.resumes = self.leaf_resumes = 0
        self.hit_count = 0

    @property
    def key(self) -> list[int]:
        """The span's token ids as a list (made from ``akey`` once, on first read)."""
        k = self._key
        if k is None:
            k = self._key = self.akey.tolist()
        return k

    def set_akey(self, akey: array) -> None:
        """The span's tokens are now ``akey`` (a split keeps a part): the list is made again when read."""
        self.akey, self.bkey, self._key = akey, akey.tobytes(), None

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_tombstone(self) -> bool:
        """A model cannot resume at this node's end from any tier."""
        return self.parent is not None and not self.payload.resumable

    @property
    def evicted(self) -> bool:
        """Not on the device (SGLang's name)."""
        return self.value is None

    @property
    def backuped(self) -> bool:
        """Its KV has a complete host copy (SGLang's name)."""
        return self.host_kv is not None

    @property
    def dead(self) -> bool:
        return self.parent is not None and self.value is None and self.host_kv is None and self.value_pending is None

    def __repr__(self) -> str:
        k = self.key if len(self.key) <= 8 else self.key[:8] + ["..."]
        where = ("dev" if self.value is not None else "") + ("+host" if self.host_kv is not None else "")
        return (f"TreeNode(id={self.id}, key={k}, {where or 'dead'}, {self.payload!r}, full={self.full_lock_ref}, "
                f"mamba={self.mamba_lock_ref}, ops={len(self.tickets)})")
