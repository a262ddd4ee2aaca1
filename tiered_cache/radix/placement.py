"""Where a prefill may export an intermediate recurrent state (the idea of vLLM's "align" mode).

A hybrid model resumes only from a state saved at exactly the resume position, and the kernels
produce states only at chunk ends unless asked for one inside a chunk. During a prefill chunk
covering positions ``[start, end)`` the engine may export one state at the last multiple of the
checkpoint ``unit`` strictly before ``end``::

    start (hash-block aligned)                     pos = last multiple of unit < end      end
    |----- >= block_size -----|--- ... ---|---------|------------------------------------|
                                          ^ (pos - start) % alignment == 0

It is valid only if the chunk starts on a hash-block boundary (so the position's prefix is
addressable), the position lies strictly inside the chunk and at least one block past its start
(the kernel emits states per block), and its offset from the start is a multiple of the kernel's
alignment (``None``: the kernel cannot export mid-chunk). The cache only computes positions; the
engine writes the states and then inserts them; the cache never publishes a state it was not handed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tiered_cache.errors import InvalidArgumentError


def _int(name: str, v, lo: int) -> int:
    from tiered_cache.validate import int_arg

    return int_arg(name, v, lo=lo)  # InvalidTypeError for a str / float / bool, as everywhere


def checkpoint_position(end: int, unit: int) -> int:
    """The last multiple of ``unit`` strictly before ``end`` (0 when there is none)."""
    _int("end", end, 0)
    _int("unit", unit, 1)
    return max(0, (end - 1) // unit * unit)


def is_checkpoint_valid(start: int, end: int, position: int, *, hash_block_size: int, block_size: int,
                        alignment: Optional[int]) -> bool:
    """Whether a state exported at ``position`` during the chunk ``[start, end)`` may be published."""
    _int("start", start, 0)
    _int("end", end, 0)
    _int("position", position, 0)
    _int("hash_block_size", hash_block_size, 1)
    _int("block_size", block_size, 1)
    if end < start:
        raise InvalidArgumentError("end", f">= start ({start})", end)
    if alignment is None:
        return False
    _int("alignment", alignment, 1)
    offset = position - start
    return (start % hash_block_size == 0 and start < position < end and offset >= block_size
            and offset % alignment == 0)


def prefill_checkpoint_positions(start: int, end: int, *, unit: int, hash_block_size: int, block_size: int,
                                 alignment: Optional[int]) -> list[int]:
    """Positions (0 or 1 of them) where the engine may export a state while prefilling ``[start, end)``."""
    pos = checkpoint_position(end, unit)
    ok = is_checkpoint_valid(start, end, pos, hash_block_size=hash_block_size, block_size=block_size,
                             alignment=alignment)
    return [pos] if ok else []


@dataclass(frozen=True)
class CheckpointPlacement:
    """The placement rule with its settings fixed (the cache holds one).

    unit: checkpoint unit in tokens (cache-hit alignment; a multiple of the page size).
    hash_block_size: tokens per hash block (chunks must start on one).
    block_size: the kernel's state block; a checkpoint lies at least one block past the chunk start.
    alignment: the kernel's export alignment in tokens, or None if it cannot export mid-chunk.
    """

    unit: int
    hash_block_size: int
    block_size: int
    alignment: Optional[int]

    def __post_init__(self) -> None:
        _int("unit", self.unit, 1)
        _int("hash_block_size", self.hash_block_size, 1)
        _int("block_size", self.block_size, 1)
        if self.alignment is not None:
            _int("alignment", self.alignment, 1)

    def positions(self, start: int, end: int) -> list[int]:
        return prefill_checkpoint_positions(start, end, unit=self.unit, hash_block_size=self.hash_block_size,
                                            block_size=self.block_size, alignment=self.alignment)
