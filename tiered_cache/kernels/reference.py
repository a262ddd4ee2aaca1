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
    """Twin of ``kernels.checksum.row_checksums``: ``sum_i w_i * (2i + 1) mod 2**64``, ``w_i`` the row's
    bytes read as unsigned 32-bit words."""
    data = rows_view[rows].contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    weights = torch.arange(data.shape[1], dtype=torch.int64, device=data.device) * 2 + 1
    return (data * weights).sum(dim=1)


def copy_items_reference(src_words: torch.Tensor, src_offsets: torch.Tensor, dst_words: torch.Tensor,
                         dst_offsets: torch.Tensor, n_words: int) -> None:
    """Twin of ``kernels.hostcopy.copy_items``: copy ``n_words`` int32 words per item."""
    for s, d in zip(src_offsets.tolist(), dst_offsets.tolist()):
        dst_words[d: d + n_words].copy_(src_words[s: s + n_words])


# --- int8 checkpoint (T1) twins: defined in _ref_quant.py (kept apart so two authors never clobber) ---
from tiered_cache.kernels._ref_quant import *  # noqa: E402,F401,F403
