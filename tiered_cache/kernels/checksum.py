"""Per-row checksums of slot envelopes, computed on the device where the bytes are.

Twin: ``reference.row_checksums_reference``. A row of ``E`` bytes is read as ``E/4`` unsigned 32-bit
words ``w_i`` and reduced to ``sum_i w_i * (2i + 1) mod 2**64``. Flipping bit ``b`` of word ``i``
changes the sum by ``+-2**b * (2i + 1)``; two flips cancel only if ``2**a (2i + 1) = 2**b (2j + 1)``,
that is the same bit of the same word. So every one- and two-bit flip is detected (an earlier form
with two 32-bit lanes missed two flips of bit 31, which cancel mod 2**32). The position weight also
catches swapped words. Addition mod 2**64 is associative, so block-wise partial sums equal the
reference's whole-row sum exactly. The 32 x 32 -> 64-bit products keep it near memory speed, and the
transfer engine runs it beside the copy on its own stream.

Bytes moved: each row read once (``len(rows) * E``), 8 bytes written per (row, block), then read
once more and 8 bytes written per row by the sum of the parts.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.kernels import use_triton
from tiered_cache.kernels.reference import row_checksums_reference


@triton.jit
def _checksum_kernel(words_ptr, rows_ptr, out_ptr, row_stride_words, row_words, n_blocks,
                     BLOCK: tl.constexpr, ITERS: tl.constexpr):
    i = tl.program_id(0)
    part = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64)
    base = words_ptr + row * row_stride_words
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for it in range(ITERS):
        offs = (part * ITERS + it) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < row_words
        w = tl.load(base + offs, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
        acc += w * (2 * offs.to(tl.int64) + 1)  # int64 arithmetic wraps mod 2**64
    tl.store(out_ptr + i * n_blocks + part, tl.sum(acc, axis=0))


@triton.jit
def _sum_parts_kernel(parts_ptr, out_ptr, n_parts, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n_parts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(parts_ptr + i * n_parts + offs, mask=offs < n_parts, other=0)
    tl.store(out_ptr + i, tl.sum(acc, axis=0))  # wraps mod 2**64, as the reference's sum


def row_checksums(rows_view: torch.Tensor, rows: torch.Tensor, backend: str = "auto",
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Checksums (int64) of ``rows_view[rows]``, on the view's device or written into ``out``.

    ``rows_view``: ``[R, E]`` uint8 with ``E % 16 == 0`` and a unit inner stride (a pool's rows view);
    ``rows``: 1-D int64 row ids on the same device, or (GPU) in page-locked host memory, which the
    kernel reads through mapped memory: no copy on any stream.
    ``out``: a 1-D int64 tensor of ``len(rows)``, on the view's device or (GPU) in page-locked host
    memory, which the last kernel writes through mapped memory: the sums reach the host without a
    copy-engine transfer (one would queue behind every large copy already in that engine). Returned.
    """
    if not isinstance(rows_view, torch.Tensor) or rows_view.dtype != torch.uint8 or rows_view.dim() != 2:
        raise InvalidArgumentError("rows_view", "a 2-D uint8 tensor [rows, bytes]", getattr(rows_view, "shape", None))
    if rows_view.stride(1) != 1 or rows_view.shape[1] % 16 or rows_view.stride(0) % 16:
        raise InvalidArgumentError("rows_view", "rows of a multiple of 16 bytes, 16-byte aligned, unit inner stride",
                                   (tuple(rows_view.shape), rows_view.stride()))
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError("rows", "a 1-D int32/int64 tensor", getattr(rows, "dtype", type(rows)))
    mapped = rows_view.is_cuda and rows.device.type == "cpu" and rows.is_pinned()
    if rows.device != rows_view.device and not mapped:
        raise InvalidArgumentError("rows", f"a tensor on {rows_view.device} (or page-locked host memory)",
                                   rows.device)
    if out is not None:
        out_mapped = rows_view.is_cuda and out.device.type == "cpu" and out.is_pinned()
        if (not isinstance(out, torch.Tensor) or out.dtype != torch.int64 or out.shape != (rows.numel(),)
                or not out.is_contiguous() or (out.device != rows_view.device and not out_mapped)):
            raise InvalidArgumentError("out", f"a contiguous int64 tensor of shape ({rows.numel()},) on "
                                       f"{rows_view.device} (or page-locked host memory)",
                                       (getattr(out, "dtype", type(out)), tuple(getattr(out, "shape", ())),
                                        getattr(out, "device", None)))
    if rows.numel() == 0:
        return out if out is not None else torch.zeros(0, dtype=torch.int64, device=rows_view.device)
    if not use_triton(rows_view.device, backend):
        res = row_checksums_reference(rows_view, rows.to(rows_view.device))
        return res if out is None else out.copy_(res)
    if rows_view.data_ptr() % 16:
        raise InvalidArgumentError("rows_view", "a 16-byte aligned start", rows_view.data_ptr())
    row_words = rows_view.shape[1] // 4
    block = min(2048, triton.next_power_of_2(row_words))
    # On the GPU split long rows over programs (~64 KiB each) so a few big envelopes still fill the
    # chip; in the interpreter, one program per row.
    iters = max(1, min(8, triton.cdiv(row_words, block))) if rows_view.is_cuda else triton.cdiv(row_words, block)
    n_blocks = triton.cdiv(row_words, block * iters)
    parts = torch.empty(rows.numel(), n_blocks, dtype=torch.int64, device=rows_view.device)
    # A plain dtype view (no set_ on the storage: the CUDA sanitizer counts that as a write).
    words = rows_view.view(torch.int32)
    _checksum_kernel[(rows.numel(), n_blocks)](words, rows, parts, words.stride(0), row_words, n_blocks,
                                                BLOCK=block, ITERS=iters)
    if out is None:
        out = torch.empty(rows.numel(), dtype=torch.int64, device=rows_view.device)
    _sum_parts_kernel[(rows.numel(),)](parts, out, n_blocks, BLOCK=min(1024, triton.next_power_of_2(n_blocks)))
    return out
