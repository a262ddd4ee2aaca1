"""Scattered row copies between device memory and mapped pinned host memory, by a few programs.

Twin: ``reference.host_copy_rows_reference``. Pinned host memory is mapped into the GPU's address
space (UVA), so a kernel can load from or store to it directly: each program walks a share of the
items (``item = pid, pid + P, ...``) and moves one row sub-range ``[sub_off, sub_off + n)`` per item
in ``BLOCK``-word steps. One launch moves any number of scattered small rows (KV pages of a few
hundred KiB), where one ``cudaMemcpyAsync`` per row pays a fixed cost each (docs/platform.md: 64 KiB
per call reaches 5 GB/s). Few programs keep PCIe busy while leaving the SMs to compute (a full-grid
copy kernel slowed a concurrent GEMM by 144 %).

Bytes moved per call: ``len(items) * n`` over PCIe (read on one side, written on the other).

Where every item's range starts and ends on a 16-byte boundary (both tensors 16-byte aligned, every offset
and ``n_words`` a multiple of 4: KV pages and their layers always are) the kernel moves four words a lane
per instruction (``VEC`` 4: 128-bit loads and stores, sm_90 SASS 104-120 instructions against 280 a
program); ``_vec_width`` decides from the host offsets, and any other case keeps one word a lane.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError


@triton.jit
def _copy_items_kernel(src_ptr, dst_ptr, src_off_ptr, dst_off_ptr, n_items, n_words,
                       NUM_PROGS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr):
    pid = tl.program_id(0)
    n_vec = n_words // VEC  # n_words is a multiple of VEC: the mask compares whole groups of VEC words
    for item in range(pid, n_items, NUM_PROGS):
        s = tl.multiple_of(tl.load(src_off_ptr + item), VEC)
        d = tl.multiple_of(tl.load(dst_off_ptr + item), VEC)
        for start in range(0, n_words, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs // VEC < n_vec  # constant over each group: one vector access, not VEC masked ones
            vals = tl.load(src_ptr + s + offs, mask=mask)
            tl.store(dst_ptr + d + offs, vals, mask=mask)


def _vec_width(src_words: torch.Tensor, src_offsets: torch.Tensor, dst_words: torch.Tensor,
               dst_offsets: torch.Tensor, n_words: int) -> int:
    """4 when every item's range is 16-byte aligned on both sides (a 128-bit access of a misaligned address
    faults on a GPU, so this is checked, never assumed): both tensors' first words, ``n_words`` and every
    offset; the offsets read on the host (CPU or pinned tensors, as the callers keep them). Offsets on a
    GPU, or any misaligned value: 1."""
    if n_words % 4 or src_words.data_ptr() % 16 or dst_words.data_ptr() % 16:
        return 1
    for offs in (src_offsets, dst_offsets):
        if not offs.is_cpu or np.bitwise_or.reduce(offs.numpy().ravel() & 3):
            return 1
    return 4


def copy_items(src_words: torch.Tensor, src_offsets: torch.Tensor, dst_words: torch.Tensor,
               dst_offsets: torch.Tensor, n_words: int, num_programs: int = 16, block_words: int = 2048,
               num_warps: int = 4, vector: bool = True) -> None:
    """For each item ``i``: ``dst_words[dst_offsets[i] : +n_words] = src_words[src_offsets[i] : +n_words]``.

    ``src_words`` / ``dst_words``: int32 tensors, one on the GPU and one in pinned host memory (or both
    on CPU under the interpreter); offsets: int64 word offsets on the launching device or, on a GPU, in
    pinned host memory (each program reads its items' offsets through mapped memory).
    ``block_words`` (a power of two) and ``num_warps``: words each program moves per step and the warps
    that move them (more of either puts more reads in flight over PCIe). ``vector``: four words a lane where
    ``_vec_width`` finds every range 16-byte aligned (False: one word a lane always, the kernel before
    2026-12-07, kept for the benchmark's comparison).
    """
    if not isinstance(num_programs, int) or isinstance(num_programs, bool) or num_programs < 1:
        raise InvalidArgumentError("num_programs", "an int >= 1", num_programs)
    if block_words < 1 or block_words & (block_words - 1):
        raise InvalidArgumentError("block_words", "a power of two >= 1", block_words)
    if not isinstance(vector, bool):
        raise InvalidTypeError("vector", "a bool", vector)
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise InvalidArgumentError("num_warps", "one of 1, 2, 4, 8, 16, 32", num_warps)
    if src_offsets.numel() != dst_offsets.numel():
        raise InvalidArgumentError("dst_offsets", f"{src_offsets.numel()} offsets", dst_offsets.numel())
    n = src_offsets.numel()
    if n == 0 or n_words == 0:
        return
    progs = max(1, min(num_programs, n))
    block = min(block_words, triton.next_power_of_2(n_words))
    _copy_items_kernel[(progs,)](src_words, dst_words, src_offsets, dst_offsets, n, n_words,
                                 NUM_PROGS=progs, BLOCK=block,
                                 VEC=_vec_width(src_words, src_offsets, dst_words, dst_offsets, n_words) if vector
                                 else 1,
                                 num_warps=num_warps)
