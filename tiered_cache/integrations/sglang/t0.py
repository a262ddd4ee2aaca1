"""T0 over SGLang's own memory: ``SGLangKVSide``, SGLang's paged token-to-KV allocator and its MHA KV
pool seen through the members of ``tiered_cache.tiers.protocols.ActiveSide`` that the radix tree uses.

Ids. SGLang's token ids are physical (``page * page_size + offset``, page 0 reserved for padded
writes, like our sink), so ``translate`` is the identity and a page id is its row. The allocator
knows which pages are free (``get_all_free_pages``); every other page of ``[1, capacity)`` is
allocated, by the scheduler for a running request or by a request for what the tree now holds. The
side adds what SGLang's allocator does not check: freeing a free, unknown or repeated page (typed
errors, nothing freed) and busy marks (a T2 transfer in flight), so the tree's contract holds.

Not here (and why this is not a ``KVSide`` yet): ``k_view_all`` / ``v_view_all`` and ``rows_bytes``.
SGLang's ``MHATokenToKVPool`` keeps one ``[size + page_size, heads, head_dim]`` tensor per layer, so a
page's bytes lie in ``num_layers`` places and neither a ``[L, pages, ...]`` tensor nor a
``[pages, entry_bytes]`` row view of them exists; the T2 moves, which copy ``rows_bytes`` rows, need a
per-layer gather/scatter for this layout first. SGLang's mamba pool (the state side) is not adapted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, SlotBusyError, SlotStateError
from tiered_cache.specs import KVSpec
from tiered_cache.validate import int_arg


class SGLangKVSide:
    """SGLang's full-attention KV memory (``allocator``: a ``PagedTokenToKVPoolAllocator``; its
    ``get_kvcache()``: an ``MHATokenToKVPool``) as a T0 side named ``name``."""

    def __init__(self, allocator: Any, name: str = "full") -> None:
        pool = allocator.get_kvcache() if hasattr(allocator, "get_kvcache") else None
        if pool is None or not hasattr(pool, "k_buffer") or not hasattr(allocator, "get_all_free_pages"):
            raise InvalidTypeError("allocator", "SGLang's paged token-to-KV allocator over an MHA KV pool",
                                   type(allocator).__name__)
        k0, v0 = pool.k_buffer[0], pool.v_buffer[0]
        self._alloc, self._pool, self._name = allocator, pool, name
        self._page = int(allocator.page_size)
        self._spec = KVSpec(num_layers=len(pool.k_buffer), kv_heads=int(k0.shape[1]), head_dim=int(k0.shape[2]),
                            dtype=k0.dtype, v_head_dim=int(v0.shape[2]))
        self._capacity = int(k0.shape[0]) // self._page
        self._busy: Counter = Counter()
        self._fences: list[Callable[[], None]] = []

    # ----------------------------------------------------------------------------- what it is
    @property
    def name(self) -> str:
        return self._name

    @property
    def device(self) -> torch.device:
        return self._pool.k_buffer[0].device

    @property
    def page_size(self) -> int:
        return self._page

    @property
    def spec(self) -> KVSpec:
        return self._spec

    @property
    def entry_bytes(self) -> int:
        """One page of every layer, K and V (what a T2 copy of the page holds)."""
        return self._spec.bytes_per_slot(self._page)

    @property
    def capacity(self) -> int:
        """Pages of SGLang's buffers, page 0 (SGLang's padding page, our sink) included."""
        return self._capacity

    # ----------------------------------------------------------------------------- room
    def available_size(self) -> int:
        return int(self._alloc.available_size())

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """``n`` token ids (whole pages) from SGLang's allocator, int64; None when it has no room."""
        n = int_arg("n", n, lo=0)
        if n % self._page:
            raise InvalidArgumentError("n", f"a multiple of page_size={self._page}", n)
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        ids = self._alloc.alloc(n)
        return None if ids is None else ids.to(torch.int64)

    def free(self, ids: torch.Tensor) -> None:
        """Give whole pages back to SGLang's allocator; a free, unknown, repeated or busy page raises
        before anything is freed."""
        pages = self._pages_of(ids, "ids")
        if not pages:
            return
        busy = [p for p in pages if self._busy[p]]
        if busy:
            raise SlotBusyError(f"side {self._name!r}: pages {busy[:16]} are read or written by a transfer in flight")
        self._alloc.free_page_ids(torch.tensor(pages, dtype=torch.int64, device=self.device))

    def _pages_of(self, ids: Any, arg: str) -> list[int]:
        if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
            raise InvalidTypeError(arg, "a 1-D int tensor of token ids (whole pages)", type(ids).__name__)
        if ids.numel() % self._page:
            raise InvalidArgumentError(arg, f"whole pages of {self._page} tokens", ids.numel())
        toks = ids.to(torch.int64).cpu().view(-1, self._page)
        first = toks[:, 0]
        if not torch.equal(toks, first[:, None] + torch.arange(self._page)) or bool((first % self._page).any()):
            raise InvalidArgumentError(arg, "whole pages (page * page_size + 0..page_size-1)", toks[:2].tolist())
        return self.physical_rows((first // self._page).tolist(), arg)

    # ----------------------------------------------------------------------------- ids
    def translate(self, ids: torch.Tensor) -> torch.Tensor:
        """Identity: SGLang's token ids are rows of its buffers."""
        return ids

    def translate_host(self, ids: np.ndarray) -> np.ndarray:
        """Identity for allocated pages' tokens; a free page's tokens map to -1."""
        out = np.asarray(ids, dtype=np.int64).copy()
        free = self._free_pages()
        mask = np.isin(out // self._page, np.fromiter(free, dtype=np.int64, count=len(free)))
        out[mask | (out // self._page <= 0) | (out // self._page >= self._capacity)] = -1
        return out

    def physical_rows(self, vids: Sequence[int], arg: str = "vids") -> list[int]:
        rows = [int(v) for v in vids]
        free = self._free_pages()
        bad = [v for v in rows if v <= 0 or v >= self._capacity or v in free]
        if bad:
            raise SlotStateError(arg, f"allocated {self._name} pages in [1, {self._capacity})", bad[:16])
        if len(set(rows)) != len(rows):
            raise SlotStateError(arg, "distinct pages", rows[:16])
        return rows

    def live_virtual_ids(self) -> list[int]:
        free = self._free_pages()
        return [p for p in range(1, self._capacity) if p not in free]

    def _free_pages(self) -> set[int]:
        return set(self._alloc.get_all_free_pages().tolist())

    # ----------------------------------------------------------------------------- transfers
    def mark_busy(self, ids: Iterable[int]) -> None:
        for p in self.physical_rows(list(ids), "ids"):
            self._busy[p] += 1

    def unmark_busy(self, ids: Iterable[int]) -> None:
        lst = [int(p) for p in ids]
        unmarked = [p for p in lst if not self._busy[p]]
        if unmarked:
            raise SlotStateError("ids", "pages marked busy", unmarked[:16])
        for p in lst:
            self._busy[p] -= 1

    def add_fence(self, fence: Callable[[], None]) -> None:
        """Kept for the protocol: SGLang's KV pool never moves a page (no compaction), so no fence is
        ever called."""
        if fence not in self._fences:
            self._fences.append(fence)
