"""Per-row checksums of slot envelopes, computed on the device where the bytes are.

Twin: ``reference.row_checksums_reference``. A row of ``E`` bytes (``E % 16 == 0``) is read as
``n = E/4`` little-endian uint32 words ``w_i``, ``n <= 2**26``. Its checksum is one int64:
``S | H << 32``, ``S`` a 32-bit extended-Hamming syndrome and ``H`` a keyed universal hash below 2**31.

S: write the row's bits at global positions ``t = 32 i + b`` (word ``i``, bit ``b``; ``t < 2**31``).
``S = P | B << 1 | I << 6`` where, with ``X`` the XOR of all words, ``P = parity(X)`` (of all set bits),
``B`` has bit ``k`` = ``parity(X & M_k)`` for the masks ``M_k`` of bit positions whose bit ``k`` is set
(``0xAAAAAAAA, 0xCCCCCCCC, 0xF0F0F0F0, 0xFF00FF00, 0xFFFF0000``), and ``I`` is the XOR of the indices
``i`` of the words with an odd popcount. Together ``(P, I << 5 | B)`` is the XOR, over every set bit,
of ``(1, t)``: the syndrome of an extended Hamming code, linear over GF(2). So an error pattern ``e``
changes ``S`` by ``S(e)``, and ``S(e) != 0`` for every ``e`` of 1, 2 or 3 bits: odd weight flips
``P``; two bits leave ``P`` and change the position XOR by ``t1 ^ t2 != 0``. That is the property
asked for, whatever the row's length up to 2**26 words (beyond it positions would alias: refused).
The old checksum, ``sum_i w_i (2i + 1) mod 2**64``, missed 3-bit errors such as +1 (bit 0 of word 0),
+3 (bit 0 of word 1) and -4 (bit 2 of word 0), which sum to 0.

H: with ``p = 2**31 - 1``, ``T = 2048`` words a tile, word ``i = g T + j`` and ``lo, hi`` its 16-bit
halves, ``H = sum_g s_g * sum_{j<T} (lo_{g,j} a_j + hi_{g,j} b_j) mod p``, for fixed tables
``a_j, b_j`` (``j < T``) and ``s_g`` (``g < 2**26 / T``) uniform in ``[0, p)`` (``_checksum_tables``:
splitmix64 from a constant seed, the same on every device and torch version). For an error that does
not depend on the tables, ``P(H unchanged) <= 2/p = 2**-30 (1 + 2**-31)``: take a tile ``g*`` where a half
changed; each change ``|d| < 2**16 < p`` is nonzero mod p, so the tile's inner sum of changes is a
nonzero linear form in ``a, b`` and is 0 with probability ``1/p``; given it is not, the total is 0
with probability ``1/p`` over ``s_{g*}`` (the other tiles' terms do not involve ``s_{g*}``).

Together: ``S`` is a function of the error pattern alone and the bound on ``H`` holds for every fixed
pattern, so ``P(miss) <= P(S(e) = 0) * 2/p``: 0 for 1-3 bits and every odd weight; for random
corruption ``S(e) = 0`` needs an even weight of at least 4 whose positions XOR to 0, which a random
replacement of any aligned word hits with probability ``< 2**-6`` (of a single byte ``1/17``; of any
k >= 4 bit positions ``< 2**-3``, as their syndromes span at least 3 dimensions), and random flips of
``w >= 4`` distinct positions among ``N >= w + 4`` with probability ``<= 1/(N - w + 1) <= 1/5`` (the
last position must be the XOR of the others); each gives ``P(miss) <= 2/(5p) < 2**-32`` (with room
for ``2/p`` being a hair above ``2**-30``).

Bytes moved: each row read once (``len(rows) * E``), plus the tables from L1/L2 (8 bytes a word, 16 KiB
for every program); 24 bytes written per (row, part), read once more, and 8 bytes written per row.
The transfer engine runs it beside the copy on its own stream.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.kernels import use_triton
from tiered_cache.kernels._checksum_tables import MAX_WORDS, TILE, P, checksum_tables
from tiered_cache.kernels.reference import row_checksums_reference
from tiered_cache.validate import int_arg


@triton.jit
def _parity(x):
    """Bit 0: the parity of ``x``'s low 32 bits. Works on int32 although ``>>`` shifts arithmetically:
    sign copies land only above the bits that reach bit 0."""
    x = x ^ (x >> 16)
    x = x ^ (x >> 8)
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return x & 1


@triton.jit
def _pack(x, idx, hsh):
    """``S | H << 32`` from the row's word XOR ``x`` (int32), index XOR ``idx`` and hash ``hsh`` (< p).
    The masks as int32 bit patterns (0xAAAAAAAA, 0xCCCCCCCC, 0xF0F0F0F0, 0xFF00FF00, 0xFFFF0000)."""
    s = (_parity(x) | _parity(x & -0x55555556) << 1 | _parity(x & -0x33333334) << 2
         | _parity(x & -0x0F0F0F10) << 3 | _parity(x & -0x00FF0100) << 4 | _parity(x & -0x00010000) << 5)
    return s.to(tl.int64) | (idx & 0x3FFFFFF) << 6 | (hsh << 32)


@triton.jit
def _checksum_kernel(words_ptr, rows_ptr, a_ptr, b_ptr, s_ptr, parts_ptr, out_ptr, row_stride_words, row_words,
                     n_parts, part_stride, n_items, iters, BLOCK: tl.constexpr, TILE: tl.constexpr,
                     PRIME: tl.constexpr, FUSED: tl.constexpr):
    """Items ``pid, pid + programs, ...`` of the ``n_items = rows * n_parts`` (row, part) items, each
    ``iters`` blocks of ``BLOCK`` words. A block lies inside one tile (``BLOCK`` divides ``TILE``), so
    its hash needs one tile weight. Writes each part's word XOR, index XOR and hash at
    ``parts[0|1|2][row, part]``, or (``FUSED``: one part a row) the row's packed checksum at ``out[row]``:
    then no combine kernel runs. (A grid of fewer programs than items leaves SMs to other work.)"""
    lane = tl.arange(0, BLOCK)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        r = item // n_parts
        part = item % n_parts
        row = tl.load(rows_ptr + r).to(tl.int64)
        base = words_ptr + row * row_stride_words
        acc_x = tl.zeros([BLOCK], dtype=tl.int32)
        acc_i = tl.zeros([BLOCK], dtype=tl.int32)
        h = tl.zeros([], dtype=tl.int64)
        for it in range(iters):
            start = (part * iters + it) * BLOCK
            offs = start + lane
            w = tl.load(base + offs, mask=offs < row_words, other=0)  # masked words are 0: they add nothing
            j = start % TILE + lane
            a = tl.load(a_ptr + j).to(tl.int64)
            b = tl.load(b_ptr + j).to(tl.int64)
            v = (w & 0xFFFF).to(tl.int64) * a + ((w >> 16) & 0xFFFF).to(tl.int64) * b  # < 2**48
            sg = tl.load(s_ptr + start // TILE, mask=start < row_words, other=0).to(tl.int64)
            h = (h + (tl.sum(v, axis=0) % PRIME) * sg) % PRIME  # block sum < 2**59, product < 2**62
            acc_x = acc_x ^ w
            acc_i = acc_i ^ tl.where(_parity(w) != 0, offs, 0)
        if FUSED:
            tl.store(out_ptr + r, _pack(tl.xor_sum(acc_x, axis=0), tl.xor_sum(acc_i, axis=0).to(tl.int64), h))
        else:
            out = parts_ptr + r * n_parts + part
            tl.store(out, tl.xor_sum(acc_x, axis=0).to(tl.int64))
            tl.store(out + part_stride, tl.xor_sum(acc_i, axis=0).to(tl.int64))
            tl.store(out + 2 * part_stride, h)


@triton.jit
def _combine_kernel(parts_ptr, out_ptr, n_parts, part_stride, PRIME: tl.constexpr, BLOCK: tl.constexpr):
    """One row: XOR the parts' word and index XORs, add their hashes mod p, pack ``S | H << 32``."""
    r = tl.program_id(0)
    acc_x = tl.zeros([BLOCK], dtype=tl.int64)
    acc_i = tl.zeros([BLOCK], dtype=tl.int64)
    acc_h = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n_parts, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n_parts
        p = parts_ptr + r * n_parts + offs
        acc_x = acc_x ^ tl.load(p, mask=mask, other=0)
        acc_i = acc_i ^ tl.load(p + part_stride, mask=mask, other=0)
        acc_h += tl.load(p + 2 * part_stride, mask=mask, other=0)  # each < 2**31
    x = tl.xor_sum(acc_x, axis=0).to(tl.int32)
    tl.store(out_ptr + r, _pack(x, tl.xor_sum(acc_i, axis=0), tl.sum(acc_h, axis=0) % PRIME))


# (row, part) items the GPU split aims for: about 8 a streaming multiprocessor on an H200 (132).
TARGET_ITEMS = 1024
# Blocks (BLOCK words each) a part holds at the least once a row is split.
MIN_PART_BLOCKS = 8


def _iters(row_words: int, block: int, n_rows: int, cuda: bool) -> int:
    """Blocks a (row, part) item. On the GPU a row is split only as far as needed for ``TARGET_ITEMS``
    items in all (parts of at least ``MIN_PART_BLOCKS`` blocks): many rows (KV pages) are one item each,
    checksummed by one kernel with no combine; a few big state envelopes are split so they still fill
    the chip. In the interpreter: one item per row. (Tests on CPU replace it to run the GPU's splits.)"""
    blocks = triton.cdiv(row_words, block)
    if not cuda:
        return blocks
    parts = max(1, min(triton.cdiv(TARGET_ITEMS, n_rows), triton.cdiv(blocks, MIN_PART_BLOCKS)))
    return triton.cdiv(blocks, parts)


def row_checksums(rows_view: torch.Tensor, rows: torch.Tensor, backend: str = "auto",
                  out: Optional[torch.Tensor] = None, programs: Optional[int] = None) -> torch.Tensor:
    """Checksums (int64) of ``rows_view[rows]``, on the view's device or written into ``out``.

    ``rows_view``: ``[R, E]`` uint8 with ``E % 16 == 0``, ``E <= 2**28`` and a unit inner stride (a
    pool's rows view); ``rows``: 1-D int64 row ids on the same device, or (GPU) in page-locked host
    memory, which the kernel reads through mapped memory: no copy on any stream.
    ``out``: a 1-D int64 tensor of ``len(rows)``, on the view's device or (GPU) in page-locked host
    memory, which the last kernel writes through mapped memory: the sums reach the host without a
    copy-engine transfer (one would queue behind every large copy already in that engine). Returned.
    ``programs``: the most programs the kernel runs at once (default: one per (row, part) item; fewer
    leave SMs to other work, each program looping over its share); the result does not depend on it.
    """
    if not isinstance(rows_view, torch.Tensor):
        raise InvalidTypeError("rows_view", "a 2-D uint8 tensor [rows, bytes]", type(rows_view).__name__)
    if rows_view.dtype != torch.uint8 or rows_view.dim() != 2:
        raise InvalidArgumentError("rows_view", "a 2-D uint8 tensor [rows, bytes]",
                                   (tuple(rows_view.shape), rows_view.dtype))
    if rows_view.stride(1) != 1 or rows_view.shape[1] % 16 or rows_view.stride(0) % 16:
        raise InvalidArgumentError("rows_view", "rows of a multiple of 16 bytes, 16-byte aligned, unit inner stride",
                                   (tuple(rows_view.shape), rows_view.stride()))
    if rows_view.shape[1] > 4 * MAX_WORDS:
        # Past 2**26 words the bit positions t = 32 i + b no longer fit the syndrome's 31 bits.
        raise InvalidArgumentError("rows_view", f"rows of at most {4 * MAX_WORDS} bytes", tuple(rows_view.shape))
    if not isinstance(rows, torch.Tensor):
        raise InvalidTypeError("rows", "a 1-D int32/int64 tensor", type(rows).__name__)
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError("rows", "a 1-D int32/int64 tensor", (tuple(rows.shape), rows.dtype))
    mapped = rows_view.is_cuda and rows.device.type == "cpu" and rows.is_pinned()
    if rows.device != rows_view.device and not mapped:
        raise InvalidArgumentError("rows", f"a tensor on {rows_view.device} (or page-locked host memory)",
                                   rows.device)
    if out is not None:
        want = (f"a contiguous int64 tensor of shape ({rows.numel()},) on {rows_view.device} "
                "(or page-locked host memory)")
        if not isinstance(out, torch.Tensor):
            raise InvalidTypeError("out", want, type(out).__name__)
        out_mapped = rows_view.is_cuda and out.device.type == "cpu" and out.is_pinned()
        if (out.dtype != torch.int64 or out.shape != (rows.numel(),) or not out.is_contiguous()
                or (out.device != rows_view.device and not out_mapped)):
            raise InvalidArgumentError("out", want, (out.dtype, tuple(out.shape), out.device))
    if programs is not None:
        programs = int_arg("programs", programs, lo=1)
    if rows.numel() == 0:
        return out if out is not None else torch.zeros(0, dtype=torch.int64, device=rows_view.device)
    if not use_triton(rows_view.device, backend):
        res = row_checksums_reference(rows_view, rows.to(rows_view.device))
        return res if out is None else out.copy_(res)
    if rows_view.data_ptr() % 16:
        raise InvalidArgumentError("rows_view", "a 16-byte aligned start", rows_view.data_ptr())
    a, b, s = checksum_tables(rows_view.device)  # cached per device: a dict look-up after the first call
    row_words = rows_view.shape[1] // 4
    # A power of two <= TILE, so a block never straddles two tiles.
    block = min(TILE, triton.next_power_of_2(row_words))
    iters = _iters(row_words, block, rows.numel(), rows_view.is_cuda)
    n_parts = triton.cdiv(row_words, block * iters)
    part_stride = rows.numel() * n_parts
    fused = n_parts == 1
    if out is None:
        out = torch.empty(rows.numel(), dtype=torch.int64, device=rows_view.device)
    parts = out if fused else torch.empty(3, rows.numel(), n_parts, dtype=torch.int64, device=rows_view.device)
    # A plain dtype view (no set_ on the storage: the CUDA sanitizer counts that as a write).
    words = rows_view.view(torch.int32)
    n_items = rows.numel() * n_parts
    grid = (n_items if programs is None else min(programs, n_items),)
    _checksum_kernel[grid](words, rows, a, b, s, parts, out, words.stride(0), row_words, n_parts, part_stride,
                           n_items, iters, BLOCK=block, TILE=TILE, PRIME=P, FUSED=fused)
    if not fused:
        _combine_kernel[(rows.numel(),)](parts, out, n_parts, part_stride, PRIME=P,
                                         BLOCK=min(1024, triton.next_power_of_2(n_parts)))
    return out
