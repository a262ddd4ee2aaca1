"""T0 over SGLang's own memory: ``SGLangKVSide`` (SGLang's paged token-to-KV allocator and its MHA KV
pool, seen through the members of ``tiered_cache.tiers.protocols.ActiveSide`` that the radix tree uses)
and ``SGLangStateSide`` (SGLang's mamba pool and slot allocator as a ``StateSide``), handed to the
tree by name through ``SGLangT0``.

The radix tree takes ``SGLangT0`` (``tiers.protocols.T0Pool``) and ``factory`` builds the tiers above
it through ``TieredCache.build_on``: T1, T2 and T3 as the backend config asks, and the tree;
``tests/integrations/sglang/test_sglang_factory.py`` and ``test_sglang_t2.py`` run it on SGLang's real
pools on CPU.

Ids. SGLang's token ids are physical (``page * page_size + offset``, page 0 reserved for padded
writes, like our sink), so ``translate`` is the identity and a page id is its row. The allocator
knows which pages are free (``get_all_free_pages``); every other page of ``[1, capacity)`` is
allocated, by the scheduler for a running request or by a request for what the tree now holds. The
side adds what SGLang's allocator does not check: freeing a free, unknown or repeated page (typed
errors, nothing freed) and busy marks (a T2 transfer in flight), so the tree's contract holds.

Layout. SGLang's ``MHATokenToKVPool`` keeps one ``[size + page_size, heads, head_dim]`` tensor per
layer, so a page's bytes lie in ``2 * num_layers`` places and neither a ``[L, pages, ...]`` tensor nor
a ``[pages, entry_bytes]`` row view of them exists: no ``k_view_all`` / ``v_view_all``, and
``rows_bytes`` is a typed error (kept so the side is an ``ActiveSide``). It is a
``tiers.protocols.LayeredKVSide``: ``layer_rows`` gives each layer's K and V as page rows, and the T2
moves gather them into our page envelope on the device (and scatter a loaded one back).

The state side is whole: SGLang's ``MambaPool`` keeps ``temporal`` ``[L, size + 1, HV, V, K]`` and
each ``conv[i]`` ``[L, size + 1, ...]`` (slot 0 its padding slot, our sink), which are exactly the
views T1's quantize and dequantize read and write; with ``envelope_layout=True`` its bytes are one
envelope per slot, so ``rows_bytes`` is a view too (without it there is none, and ``rows_bytes``
raises; the T2 moves copy T1's envelopes for states, never T0 rows, so a state side is not asked).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, Union

import numpy as np
import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, SlotBusyError, SlotStateError
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.validate import int_arg


class _RowIds:
    """Ids, rows and busy marks shared by both sides: SGLang's ids are its buffers' rows (``translate``
    is the identity), rows ``[1, capacity)`` not free are allocated, and a transfer's rows are marked
    busy. A subclass sets ``_name``, ``_capacity``, ``_unit`` (what a row is called in errors),
    ``_tokens`` (ids per row: the KV page size, 1 for states) and gives ``_free_tensor()``."""

    _name: str
    _capacity: int
    _unit: str
    _tokens: int
    _busy: Counter
    _fences: list[Callable[[], None]]

    def _init_rows(self, name: str, capacity: int, tokens: int, unit: str) -> None:
        self._name, self._capacity, self._tokens, self._unit = name, capacity, tokens, unit
        self._busy = Counter()
        self._fences = []

    @property
    def name(self) -> str:
        return self._name

    def _free_tensor(self) -> torch.Tensor:
        raise NotImplementedError

    def _free_rows(self) -> np.ndarray:
        """The free rows, copied to the host once (SGLang keeps them in a tensor, maybe on the GPU):
        every check below is one vectorized look-up in it, not a Python set of the whole pool."""
        return self._free_tensor().to("cpu", torch.int64).numpy()

    def translate(self, ids: torch.Tensor) -> torch.Tensor:
        """Identity: SGLang's ids are rows of its buffers."""
        return ids

    def translate_host(self, ids: np.ndarray) -> np.ndarray:
        """Identity for allocated rows' ids; a free row's ids map to -1."""
        out = np.asarray(ids, dtype=np.int64).copy()
        rows = out // self._tokens
        mask = np.isin(rows, self._free_rows())
        out[mask | (rows <= 0) | (rows >= self._capacity)] = -1
        return out

    def physical_rows(self, vids: Sequence[int], arg: str = "vids") -> list[int]:
        rows = [int(v) for v in vids]
        arr = np.asarray(rows, dtype=np.int64)
        bad = arr[(arr <= 0) | (arr >= self._capacity) | np.isin(arr, self._free_rows())].tolist()
        if bad:
            raise SlotStateError(arg, f"allocated {self._name} {self._unit}s in [1, {self._capacity})", bad[:16])
        if len(set(rows)) != len(rows):
            raise SlotStateError(arg, f"distinct {self._unit}s", rows[:16])
        return rows

    def live_virtual_ids(self) -> list[int]:
        return np.setdiff1d(np.arange(1, self._capacity, dtype=np.int64), self._free_rows()).tolist()

    def mark_busy(self, ids: Iterable[int]) -> None:
        for x in self.physical_rows(list(ids), "ids"):
            self._busy[x] += 1

    def unmark_busy(self, ids: Iterable[int]) -> None:
        lst = [int(x) for x in ids]
        unmarked = [x for x in lst if not self._busy[x]]
        if unmarked:
            raise SlotStateError("ids", f"{self._unit}s marked busy", unmarked[:16])
        for x in lst:
            self._busy[x] -= 1

    def add_fence(self, fence: Callable[[], None]) -> None:
        """Kept for the protocol: SGLang's pools never move a row (no compaction), so no fence is ever
        called."""
        if fence not in self._fences:
            self._fences.append(fence)


class SGLangKVSide(_RowIds):
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
        self._init_rows(name, int(k0.shape[0]) // self._page, self._page, "page")

    # ----------------------------------------------------------------------------- what it is
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
        self.free_pages(self._pages_of(ids, "ids"))

    def free_pages(self, pages: list[int]) -> None:
        """Trusted ``free`` of pages the tree took from ``alloc`` (``KVSide.free_pages``): busy marks only."""
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

    def _free_tensor(self) -> torch.Tensor:
        return self._alloc.get_all_free_pages()

    def rows_bytes(self) -> torch.Tensor:
        """Not a view of SGLang's layout (a page's bytes lie in one buffer per layer): a typed error.
        The T2 moves use ``layer_rows`` instead (this side is a ``LayeredKVSide``)."""
        raise InvalidArgumentError("allocator", "a KV pool with one envelope per page (SGLang's MHA pool keeps "
                                   "one buffer per layer: use layer_rows)", type(self._pool).__name__)

    def layer_rows(self) -> list[tuple[int, torch.Tensor]]:
        """``tiers.protocols.LayeredKVSide``: K, then V, of each layer as ``[capacity, page bytes]`` uint8
        views of SGLang's own buffers (a page's rows of ``k_buffer[l]`` are contiguous), each with its
        byte offset in our page envelope; the T2 moves gather and scatter through them."""
        ps, cap, out = self._page, self._capacity, []
        for (ko, vo), k, v in zip(self._spec.field_offsets(ps), self._pool.k_buffer, self._pool.v_buffer):
            for off, buf in ((ko, k), (vo, v)):
                if not buf.is_contiguous():
                    raise InvalidArgumentError("allocator", "an MHA KV pool of contiguous per-layer buffers",
                                               tuple(buf.stride()))
                out.append((off, buf[:cap * ps].reshape(cap, -1).view(torch.uint8)))
        return out


class SGLangStateSide(_RowIds):
    """SGLang's recurrent states of running requests (``pool``: a ``MambaPool``; ``allocator``: its
    ``MambaSlotAllocator``, ``HybridReqToTokenPool.mamba_allocator``) as a T0 state side."""

    def __init__(self, pool: Any, allocator: Any, name: str = "mamba") -> None:
        cache = getattr(pool, "mamba_cache", None)
        if cache is None or not hasattr(cache, "temporal") or not hasattr(cache, "conv"):
            raise InvalidTypeError("pool", "SGLang's MambaPool", type(pool).__name__)
        if not hasattr(allocator, "free_slots") or not hasattr(allocator, "alloc"):
            raise InvalidTypeError("allocator", "SGLang's MambaSlotAllocator", type(allocator).__name__)
        t, convs = cache.temporal, list(cache.conv)
        if int(allocator.size) + 1 != int(t.shape[1]):
            raise InvalidArgumentError("allocator", f"the slot allocator of this pool ({t.shape[1] - 1} slots)",
                                       allocator.size)
        self._pool, self._alloc, self._name = pool, allocator, name
        # Lfm2's short convs come as a Mamba2 shape with state_size 0: a temporal buffer of no elements,
        # which is what a conv-only spec (temporal_shape ()) says
        temporal = tuple(t.shape[2:]) if t[0, 0].numel() else ()
        self._spec = StateSpec(num_layers=int(t.shape[0]), temporal_shape=temporal, temporal_dtype=t.dtype,
                               conv_shapes=tuple(tuple(c.shape[2:]) for c in convs), conv_dtype=convs[0].dtype,
                               value_axis=1)  # SGLang's temporal is (HV, V, K): V is axis 1
        self._init_rows(name, int(t.shape[1]), 1, "slot")

    @property
    def device(self) -> torch.device:
        return self._pool.mamba_cache.temporal.device

    @property
    def page_size(self) -> int:
        return 1

    @property
    def spec(self) -> StateSpec:
        return self._spec

    @property
    def capacity(self) -> int:
        """Slots of SGLang's buffers, slot 0 (its padding slot, our sink) included."""
        return self._capacity

    @property
    def entry_bytes(self) -> int:
        """One request's state over every layer, as SGLang's buffers hold it (no padding)."""
        c = self._pool.mamba_cache
        per = [x[0, 0].numel() * x.element_size() for x in (c.temporal, *c.conv)]
        return self._spec.num_layers * sum(per)

    def available_size(self) -> int:
        return int(self._alloc.available_size())

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        n = int_arg("n", n, lo=0)
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        ids = self._alloc.alloc(n)
        return None if ids is None else ids.to(torch.int64)

    def free(self, ids: torch.Tensor) -> None:
        """Give slots back to SGLang's allocator; a free, unknown, repeated or busy slot raises first."""
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
            raise InvalidTypeError("ids", "an int tensor of state slots", type(ids).__name__)
        slots = self.physical_rows(ids.reshape(-1).tolist(), "ids")
        busy = [x for x in slots if self._busy[x]]
        if busy:
            raise SlotBusyError(f"side {self._name!r}: slots {busy[:16]} are read or written by a transfer in flight")
        if slots:
            self._alloc.free(torch.tensor(slots, dtype=torch.int64, device=self._alloc.free_slots.device))

    def _free_tensor(self) -> torch.Tensor:
        return self._alloc.free_slots

    def temporal_view_all(self) -> torch.Tensor:
        """SGLang's own temporal buffer: ``[L, capacity, HV, V, K]``."""
        return self._pool.mamba_cache.temporal

    def conv_view_all(self, i: int = 0) -> torch.Tensor:
        convs = self._pool.mamba_cache.conv
        i = int_arg("i", i, lo=0, hi=len(convs) - 1)
        return convs[i]

    def rows_bytes(self) -> torch.Tensor:
        raw = getattr(self._pool, "_raw", None)
        if raw is None:
            raise InvalidArgumentError("pool", "a MambaPool built with envelope_layout=True (one envelope per "
                                       "slot); this one keeps per-layer buffers", type(self._pool).__name__)
        return raw.view(self._capacity, -1)




class NamedSides:
    """What a T0 over SGLang's memory shares: its sides by name (``side``) and the check that busy marks
    sit only on allocated ids (a transfer reads or writes a live row)."""

    _sides: dict[str, Any]

    def side(self, name: str) -> Any:
        if not isinstance(name, str):
            raise InvalidTypeError("name", f"one of {sorted(self._sides)}", name)
        if name not in self._sides:
            raise InvalidArgumentError("name", f"one of {sorted(self._sides)}", name)
        return self._sides[name]

    def check_invariants(self) -> None:
        """Busy marks only on allocated ids. Raises AssertionError."""
        for name, side in self._sides.items():
            live = set(side.live_virtual_ids())
            busy = {i for i, n in side._busy.items() if n}
            assert busy <= live, f"side {name!r}: busy ids that are free: {sorted(busy - live)[:8]}"


class SGLangT0(NamedSides):
    """The two sides as the radix tree asks for them (``side(name)``, ``check_invariants()``): SGLang's
    KV memory under ``kv_name`` and its mamba memory under ``state_name``. Unlike ``UnifiedPool`` the two
    share no bytes: evicting KV frees no state slot (``sides_share_bytes`` False tells the tree so)."""

    sides_share_bytes = False

    def __init__(self, kv: SGLangKVSide, states: SGLangStateSide, kv_name: str = "full",
                 state_name: str = "mamba") -> None:
        if not isinstance(kv, SGLangKVSide):
            raise InvalidTypeError("kv", "an SGLangKVSide", type(kv).__name__)
        if not isinstance(states, SGLangStateSide):
            raise InvalidTypeError("states", "an SGLangStateSide", type(states).__name__)
        if kv.device != states.device:
            raise InvalidArgumentError("states", f"a side on {kv.device}", states.device)
        self._sides: dict[str, Union[SGLangKVSide, SGLangStateSide]] = {kv_name: kv, state_name: states}
