"""Admission: which of the states an engine offers the tree keeps.

A hybrid model resumes only where a state was saved, and a state costs as much memory as hundreds of
tokens of KV, so keeping one at every prefill chunk end fills T1 with states no request resumes from.
The insert asks the admission about each state a prefill chunk offers (``chunked`` inserts); a
finished request's state (the leaf: where the conversation's next turn resumes) is always kept::

    chunk        every offered state (every chunk end: what the tree did before admission existed)
    leaf_branch  the leaf, and branch points: positions inside a cached node or at the end of a cached
                 node with children (where another request's path continues: a shared prefix)
    block        leaf_branch, and every ``block`` tokens (the block boundaries other requests are likely
                 to share: Mooncake-like traces reuse whole 512-token blocks)

The engine must offer the states the rule keeps: the branch point comes with ``match_prefix``'s
``mamba_branching_seqlen``, block boundaries with its mid-prefill checkpoints (``placement.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix.checks import common_len
from tiered_cache.validate import int_arg

# CacheConfig.state_admission's names (config.STATE_ADMISSIONS spells the same tuple)
ADMISSIONS = ("chunk", "leaf_branch", "block")


class StateAdmission:
    """The rule ``name`` (one of ``ADMISSIONS``); ``block``: tokens between kept states for ``block``."""

    def __init__(self, name: str = "chunk", block: Optional[int] = None) -> None:
        if name not in ADMISSIONS:
            raise InvalidArgumentError("state_admission", f"one of {', '.join(ADMISSIONS)}", name)
        if name == "block":
            if block is None:
                raise InvalidArgumentError("admission_block", "a block size in tokens for state_admission='block'",
                                           block)
            int_arg("admission_block", block, lo=1)
        self.name, self.block = name, block

    @property
    def keeps_every_chunk(self) -> bool:
        return self.name == "chunk"

    def admit(self, position: int, branch: bool) -> bool:
        """Whether a prefill chunk's state at ``position`` is kept (``branch``: it is a branch point)."""
        if self.name == "chunk" or branch:
            return True
        return self.name == "block" and position % self.block == 0  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"StateAdmission({self.name!r}" + (f", block={self.block})" if self.block else ")")


def is_branch_point(path: Sequence[Any], end: Any, toks: list[int], aligned: int, page_size: int) -> bool:
    """Whether ``toks[:aligned]`` ends where a cached path continues: inside the last node of ``path``
    (the insert walk of ``RadixTree.probe``), or at the end of ``end`` (the node ending there) when it
    has children."""
    if end is not None:
        return bool(end.children)
    if not path:
        return False
    last = path[-1]
    before = sum(len(x.key) for x in path[:-1])
    m = common_len(last.key, toks, before, aligned, page_size)
    return before + m == aligned and m < len(last.key)
