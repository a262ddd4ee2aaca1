"""T0 over SGLang's memory for a sliding-window hybrid (full-attention + SWA layers: gpt-oss, Gemma3-style):
``SGLangSWASide`` (the SWA half of SGLang's ``SWATokenToKVPoolAllocator``) and ``SGLangSWAT0`` (the full
half as an ``SGLangKVSide`` and the SWA half), for a ``HiSWARadixCache`` built by ``factory``.

SGLang keeps one id per token, the full one: a request's row and every id SGLang hands around are full
ids, and a token's SWA id is ``full_to_swa_index_mapping[full id]`` (0, SGLang's padding slot, once its
SWA KV is freed). The two halves page in step (``alloc_extend`` gives a full page and an SWA page to
the same tokens), so the mapping pairs whole pages. The tree keeps both ids per node, and the rule the
backend keeps is that they agree with SGLang: for every cached full id, the node's SWA id is what the
mapping says, and an SWA tombstone's full ids map to 0. So:

- ``SGLangSWASide.free_pages`` (the tree evicting, tombstoning or dropping duplicate SWA KV) clears the
  mapping entries that point into the freed pages, then frees the pages through SGLang's SWA allocator.
  It finds them in O(pages freed), not by scanning the mapping: the side keeps a reverse index (SWA page
  -> the full page paired with it), which the backend feeds (``pair``) wherever SGLang's mapping pairs
  pages the tree may free: the request's pages an insert offers (read off the mapping) and the path it
  writes after an insert or a load. Every SWA page the tree frees came to it through one of those, and
  a full page is paired with one SWA page at a time, so the entries of the indexed full page that still
  point into a freed page are all the entries that do (an entry gone stale, its full page since freed
  or paired elsewhere, points elsewhere and is left alone);
  the full side frees full pages through SGLang's full allocator (their mapping entries already 0, as
  SGLang's own ``free_full`` expects);
- what a running request frees itself (SGLang's ``free_swa_out_of_window_slots``: ids above its
  ``cache_protected_len`` only) is never the tree's, and the backend reads the request's SWA ids off the
  mapping when it inserts, so an SWA id SGLang freed is never handed to the tree.

``alloc`` gives SWA pages with no full id mapped to them: the tree asks for them only to load back from
T2 beside the full pages, and the backend's ``init_load_back`` maps the loaded full ids to them before it
returns. Not built: SGLang's per-request SWA ring and its all-SWA allocator (refused by the factory).
"""

from __future__ import annotations

from typing import Any, Union

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.integrations.sglang.t0 import NamedSides, SGLangKVSide
from tiered_cache.specs import KVSpec
from tiered_cache.validate import int_arg


class SGLangSWASide(SGLangKVSide):
    """SGLang's SWA KV (``allocator.swa_attn_allocator`` over ``allocator``'s SWA pool) as a T0 side whose
    ``spec`` has ``window`` set (``window``: tokens of SWA KV a resume needs, SGLang's retain window)."""

    is_kv = True

    def __init__(self, allocator: Any, window: int, name: str = "swa") -> None:
        if not hasattr(allocator, "full_to_swa_index_mapping") or not hasattr(allocator, "swa_attn_allocator"):
            raise InvalidTypeError("allocator", "SGLang's SWATokenToKVPoolAllocator", type(allocator).__name__)
        super().__init__(allocator.swa_attn_allocator, name)
        self._spec = KVSpec(num_layers=self._spec.num_layers, kv_heads=self._spec.kv_heads,
                            head_dim=self._spec.head_dim, dtype=self._spec.dtype, v_head_dim=self._spec.v_head_dim,
                            window=int_arg("window", window, lo=1))
        self._mapping = m = allocator.full_to_swa_index_mapping
        # SWA page -> the full page last paired with it (-1: none); row 0, SGLang's padding page, takes
        # the writes of unmapped (0) SWA ids and is never freed
        self._rev = torch.full((self._capacity,), -1, dtype=torch.int64, device=m.device)
        self._offsets = torch.arange(self._page, dtype=torch.int64, device=m.device)

    def pair(self, full: torch.Tensor, swa: torch.Tensor) -> None:
        """SGLang's mapping pairs the full ids ``full`` with the SWA ids ``swa`` (whole pages, in step, on
        the mapping's device; an SWA id 0: none): noted for ``free_pages``. No host sync."""
        ps = self._page
        if full.numel():
            self._rev[swa[::ps] // ps] = full[::ps].to(torch.int64) // ps

    def free_pages(self, pages: list[int]) -> None:
        """Give SWA pages back: the full ids mapped into them are unmapped first (SGLang reads a freed
        token's SWA through the mapping), then SGLang's SWA allocator frees the pages. O(pages): the
        full page ``pair`` noted for each is the one whose entries can point into it."""
        if not pages:
            return
        ps, m = self._page, self._mapping
        p = torch.tensor(pages, dtype=torch.int64, device=m.device)
        f = self._rev[p]
        ids = f.clamp(min=0)[:, None] * ps + self._offsets[None, :]  # [pages, ps]: each noted full page's ids
        mapped = m[ids]
        hit = (mapped > 0) & (mapped // ps == p[:, None]) & (f[:, None] >= 0)
        super().free_pages(pages)  # busy pages raise here, before the mapping changes
        m[torch.where(hit, ids, 0)] = 0  # misses write 0 to the padding page's entry, which is 0: order-free
        self._rev[p] = -1


class SGLangSWAT0(NamedSides):
    """The sides of an SWA hybrid as the radix tree asks for them: SGLang's full KV under ``"full"`` and
    its SWA KV under ``"swa"`` (the names ``HiSWARadixCache`` and ``TieredCache`` read). They share no
    bytes: evicting one frees nothing of the other."""

    sides_share_bytes = False

    def __init__(self, allocator: Any, window: int) -> None:
        if not hasattr(allocator, "full_attn_allocator"):
            raise InvalidTypeError("allocator", "SGLang's SWATokenToKVPoolAllocator", type(allocator).__name__)
        kv, swa = SGLangKVSide(allocator.full_attn_allocator), SGLangSWASide(allocator, window)
        if kv.page_size != swa.page_size:
            raise InvalidArgumentError("allocator", f"full and SWA pages of one size ({kv.page_size})",
                                       swa.page_size)
        self._sides: dict[str, Union[SGLangKVSide, SGLangSWASide]] = {"full": kv, "swa": swa}
        self.mapping = allocator.full_to_swa_index_mapping

    def check_invariants(self) -> None:
        """Busy marks only on allocated pages, and no free full page mapped to an SWA id. Raises
        AssertionError."""
        super().check_invariants()
        kv = self._sides["full"]
        m = self.mapping[:-1]
        mapped = set((torch.nonzero(m > 0).reshape(-1) // kv.page_size).tolist())
        free = set(kv._free_rows().tolist())
        assert not mapped & free, f"free full pages mapped to SWA ids: {sorted(mapped & free)[:8]}"
