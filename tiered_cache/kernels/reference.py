"""Plain-torch twins of every kernel in ``tiered_cache.kernels``. They run on CPU and are what tests
and benchmarks compare the kernels against.
"""

from __future__ import annotations

import torch


def move_rows_reference(buf: torch.Tensor, base: int, entry_bytes: int, num_rows: int,
                        src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Twin of ``kernels.move.move_rows``: copy row ``src_rows[i]`` over ``dst_rows[i]``.

    Rows are ``entry_bytes`` wide and start at byte ``base`` of the ``uint8`` buffer ``buf``. Source
    and destination rows must be disjoint sets (compaction moves live rows into holes).
    """
    rows = buf[base: base + num_rows * entry_bytes].view(num_rows, entry_bytes)
    rows[dst_rows] = rows[src_rows]



def row_checksums_reference(rows_view: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Twin of ``kernels.checksum.row_checksums``, from the definition there (bit-exact): per row of
    ``n`` uint32 words ``w_i``, ``S | H << 32`` with ``S = P | B << 1 | I << 6`` (the extended-Hamming
    syndrome of the row's bits) and ``H`` the keyed hash mod ``2**31 - 1``. Vectorized over rows, so
    tests can push millions of corrupted rows through it."""
    from tiered_cache.kernels import _checksum_tables as ct

    if rows_view.shape[-1] // 4 > ct.MAX_WORDS:
        from tiered_cache.errors import InvalidArgumentError

        raise InvalidArgumentError("rows_view", f"rows of at most {4 * ct.MAX_WORDS} bytes", rows_view.shape[-1])
    w = rows_view[rows].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # [N, n]
    n = w.shape[1]
    idx = torch.arange(n, dtype=torch.int64, device=w.device)

    def parity(x: torch.Tensor) -> torch.Tensor:  # of values below 2**32, elementwise
        x = x ^ (x >> 16)
        x = x ^ (x >> 8)
        x = x ^ (x >> 4)
        return (0x6996 >> (x & 0xF)) & 1

    def xor_all(x: torch.Tensor) -> torch.Tensor:  # XOR over dim 1, folding halves onto each other
        while x.shape[1] > 1:
            half = x.shape[1] // 2
            folded = x[:, :half] ^ x[:, half: 2 * half]
            x = torch.cat([folded, x[:, 2 * half:]], dim=1) if x.shape[1] % 2 else folded
        return x[:, 0] if x.shape[1] else torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)

    x_all = xor_all(w)
    s = parity(x_all)
    for k, m in enumerate(ct.MASKS):
        s |= parity(x_all & m) << (k + 1)
    s |= xor_all(torch.where(parity(w) == 1, idx, 0)) << 6
    a, b, sg = (t.to(device=w.device, dtype=torch.int64) for t in ct.checksum_tables(w.device))
    v = (w & 0xFFFF) * a[idx % ct.TILE] + (w >> 16) * b[idx % ct.TILE]  # < 2**48 a word
    full = n // ct.TILE  # whole tiles, then the last partial one (no padding: rows are often tiny)
    sums = [v[:, : full * ct.TILE].reshape(w.shape[0], full, ct.TILE).sum(dim=2)] if full else []
    if n % ct.TILE:
        sums.append(v[:, full * ct.TILE:].sum(dim=1, keepdim=True))
    tile_sums = torch.cat(sums, dim=1) if sums else v.new_zeros(w.shape[0], 1)
    h = ((tile_sums % ct.P) * sg[: tile_sums.shape[1]]) % ct.P  # tile sums < 2**59; products < 2**62
    return s | ((h.sum(dim=1) % ct.P) << 32)


def copy_items_reference(src_words: torch.Tensor, src_offsets: torch.Tensor, dst_words: torch.Tensor,
                         dst_offsets: torch.Tensor, n_words: int) -> None:
    """Twin of ``kernels.hostcopy.copy_items``: copy ``n_words`` int32 words per item."""
    for s, d in zip(src_offsets.tolist(), dst_offsets.tolist()):
        dst_words[d: d + n_words].copy_(src_words[s: s + n_words])


# --- int8 checkpoint (T1) twins: defined in _ref_quant.py (kept apart so two authors never clobber) ---
from tiered_cache.kernels._ref_quant import *  # noqa: E402,F401,F403
