"""Checkpoint placement (vLLM "align" mode rules) and the LRU policy object, on their own."""

from __future__ import annotations

import pytest

from tests.support.radix_util import make_cache
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix import (
    CheckpointPlacement,
    LRUPolicy,
    checkpoint_position,
    is_checkpoint_valid,
    prefill_checkpoint_positions,
)


def test_position_is_last_unit_multiple_strictly_before_end():
    assert checkpoint_position(17, 8) == 16
    assert checkpoint_position(16, 8) == 8  # strictly before: 16 itself is the chunk end
    assert checkpoint_position(8, 8) == 0
    assert checkpoint_position(1, 8) == 0


@pytest.mark.parametrize("start,end,want", [
    (0, 40, [32]),      # chunk [0, 40): 32 is inside, >= one block past 0, offset 32 % 16 == 0
    (16, 40, [32]),     # offset 16: one block exactly
    (24, 40, []),       # 24 is not on a hash-block boundary (16)
    (32, 40, []),       # 32 is the start itself: not strictly inside
    (16, 33, [32]),
    (16, 32, []),       # position 24: offset 8 is less than one block (16)
    (0, 8, []),         # position 0 == start
    (0, 48, [40]),      # offset 40 is not a multiple of alignment 16
])
def test_prefill_positions(start, end, want):
    got = prefill_checkpoint_positions(start, end, unit=8, hash_block_size=16, block_size=16, alignment=8)
    if want == [40]:  # alignment 8 admits 40; alignment 16 would not
        assert got == [40]
        assert prefill_checkpoint_positions(start, end, unit=8, hash_block_size=16, block_size=16,
                                            alignment=16) == []
    else:
        assert got == want


def test_no_alignment_means_no_mid_chunk_checkpoint():
    assert not is_checkpoint_valid(0, 64, 32, hash_block_size=16, block_size=16, alignment=None)
    assert CheckpointPlacement(8, 16, 16, None).positions(0, 64) == []


def test_placement_bad_arguments():
    with pytest.raises(InvalidArgumentError):
        CheckpointPlacement(0, 16, 16, 8)
    with pytest.raises(InvalidArgumentError):
        is_checkpoint_valid(10, 5, 7, hash_block_size=1, block_size=1, alignment=1)
    with pytest.raises(InvalidArgumentError):
        checkpoint_position(-1, 4)


def test_cache_uses_its_placement():
    cache = make_cache(page_size=2, checkpoint_unit=4, placement=CheckpointPlacement(4, 2, 4, 2))
    assert cache.checkpoint_positions(0, 10) == [8]
    assert cache.checkpoint_positions(2, 6) == []  # 4 is only 2 past the start: less than a block
    assert cache.checkpoint_positions(1, 10) == []  # not on a hash block


def test_lru_policy_orders_candidates_and_skips_stale_entries():
    p = LRUPolicy()
    a, b, c = object(), object(), object()
    for x in (a, b, c):
        p.touch("kv", x)
        p.add("kv", x)
    p.touch("kv", a)  # a is now the most recent
    p.discard("kv", b)  # b is locked
    assert p.pop("kv") is c
    p.add("kv", b)  # unlocked again, keeps its old recency
    assert p.pop("kv") is b
    assert p.pop("kv") is a
    assert p.pop("kv") is None
    p.add("state", a)
    p.forget(a)
    assert p.pop("state") is None and p.candidates("state") == set()


def test_lru_heap_rebuild_keeps_order():
    p = LRUPolicy()
    nodes = [object() for _ in range(10)]
    for x in nodes:
        p.touch("kv", x)
        p.add("kv", x)
    for _ in range(50):  # many stale entries: forces rebuilds
        for x in nodes[:5]:
            p.touch("kv", x)
    order = [p.pop("kv") for _ in range(10)]
    assert order == nodes[5:] + nodes[:5]
