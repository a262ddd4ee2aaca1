"""Compaction move: copy whole slot envelopes between rows of one side of a ``UnifiedPool``.

Twin: ``reference.move_rows_reference``. Bytes moved per call: ``2 * len(src_rows) * entry_bytes``
(each source row read once, each destination row written once).

The buffer is addressed in 16-byte words (``int32`` x 4 lanes): every envelope is 16-byte aligned
(``specs.ALIGN``), so each program moves ``BLOCK`` contiguous int32 words with full-width loads.
Grid: (moves, word blocks per envelope). Sources and destinations are disjoint, so programs never
race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.kernels import use_triton
from tiered_cache.kernels.reference import move_rows_reference


@triton.jit
def _move_rows_kernel(words_ptr, src_ptr, dst_ptr, base_words, row_words, BLOCK: tl.constexpr):
    move = tl.program_id(0)
    blk = tl.program_id(1)
    src = tl.load(src_ptr + move).to(tl.int64)
    dst = tl.load(dst_ptr + move).to(tl.int64)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_words
    vals = tl.load(words_ptr + base_words + src * row_words + offs, mask=mask)
    tl.store(words_ptr + base_words + dst * row_words + offs, vals, mask=mask)


def move_rows(buf: torch.Tensor, base: int, entry_bytes: int, num_rows: int,
              src_rows: torch.Tensor, dst_rows: torch.Tensor, backend: str = "auto") -> None:
    """Copy row ``src_rows[i]`` of ``entry_bytes`` over row ``dst_rows[i]`` inside ``buf``.

    ``buf``: the pool's ``uint8`` buffer; rows start at byte ``base``; ``num_rows`` rows exist.
    """
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise InvalidArgumentError("buf", "a contiguous 1-D uint8 tensor", getattr(buf, "dtype", type(buf)))
    if base % 16 or entry_bytes % 16 or entry_bytes <= 0:
        raise InvalidArgumentError("entry_bytes", "a positive multiple of 16 with base a multiple of 16",
                                   (base, entry_bytes))
    if base + num_rows * entry_bytes > buf.numel():
        raise InvalidArgumentError("num_rows", f"rows inside the {buf.numel()}-byte buffer", num_rows)
    for name, ids in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise InvalidArgumentError(name, "a 1-D int32/int64 tensor", getattr(ids, "dtype", type(ids)))
        if ids.device != buf.device:
            raise InvalidArgumentError(name, f"a tensor on {buf.device}", ids.device)
    if src_rows.numel() != dst_rows.numel():
        raise InvalidArgumentError("dst_rows", f"{src_rows.numel()} ids like src_rows", dst_rows.numel())
    if src_rows.numel() == 0:
        return
    if not use_triton(buf.device, backend):
        move_rows_reference(buf, base, entry_bytes, num_rows, src_rows, dst_rows)
        return
    words = buf.view(torch.int32)
    row_words = entry_bytes // 4
    # Few large programs keep the CPU interpreter fast; on the GPU 4096 words (16 KiB) per program
    # keeps enough loads in flight per SM.
    block = min(4096, triton.next_power_of_2(row_words))
    grid = (src_rows.numel(), triton.cdiv(row_words, block))
    _move_rows_kernel[grid](words, src_rows, dst_rows, base // 4, row_words, BLOCK=block)
