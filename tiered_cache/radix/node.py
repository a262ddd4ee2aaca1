"""``TreeNode``: one span of a radix tree of token pages.

A node says where its data lives; it decides nothing. Fields that belong to the host tier and the
transfer engine (issue 6) are present and empty, so adding them changes no layout:

    key         token ids of the span (a list; ``len`` a multiple of page_size, > 0 except the root)
    value       T0 virtual KV ids of the span (LongTensor on the pool's device) or None once the
                KV lives on the host only
    host_kv     T2 host page ids (issue 6)
    mamba_value T1 checkpoint slot of the state at the span's end (1-element LongTensor) or None:
                a *tombstone* (no state here; a hybrid model cannot resume at this node)
    state_host  T2 host state slot (issue 6)
    tickets     in-flight transfers reading or writing this node's data (issue 6); a node with a
                ticket is never dropped
    full_lock_ref   locks on this node or any descendant (the lock covers the path to the root)
    mamba_lock_ref  locks taken on this node itself; they protect its state. full >= mamba.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import torch

_ids = itertools.count()


class TreeNode:
    __slots__ = (
        "id", "parent", "children", "ck", "key", "value", "host_kv", "mamba_value", "state_host", "tickets",
        "full_lock_ref", "mamba_lock_ref", "owner", "alive", "hit_count", "__weakref__",
    )

    def __init__(self, owner: Any, parent: Optional[TreeNode], key: list[int],
                 value: Optional[torch.Tensor]) -> None:
        self.id = next(_ids)
        self.owner = owner  # the (cache, epoch) that made it: a node of another cache or of a reset tree is refused
        self.parent = parent
        self.children: dict[Any, TreeNode] = {}
        self.ck: Any = None  # this node's key in parent.children (first token or page, salted at the root)
        self.key = key
        self.value = value
        self.host_kv: Optional[torch.Tensor] = None
        self.mamba_value: Optional[torch.Tensor] = None
        self.state_host: Optional[torch.Tensor] = None
        self.tickets: Optional[list] = None
        self.full_lock_ref = 0
        self.mamba_lock_ref = 0
        self.alive = True
        self.hit_count = 0

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_tombstone(self) -> bool:
        return self.mamba_value is None and self.parent is not None

    @property
    def evicted(self) -> bool:
        return self.value is None

    def __repr__(self) -> str:
        k = self.key if len(self.key) <= 8 else self.key[:8] + ["..."]
        st = "tomb" if self.mamba_value is None else "state"
        return f"TreeNode(id={self.id}, key={k}, {st}, full={self.full_lock_ref}, mamba={self.mamba_lock_ref})"
