"""``UnifiedPool`` (T0): one ``uint8`` GPU buffer shared by two sub-pools.

Pairings: full KV + recurrent states (Mamba / GDN / KDA hybrids) and full KV + sliding-window KV
(SWA hybrids). The ``low`` side grows up from byte 0, the ``high`` side down from the last byte, so
whichever side the workload needs takes the bytes: no static split. Each side is a ``SubPool`` with
its own ``MultiEndedAllocator`` (virtual ids, translate, compaction) and typed strided views::

    raw: | low sink | low rows ... ->          free          <- ... high rows | high sink |
    a low row:  | L0 K | L0 V | L1 K | L1 V | ...            (KVSpec envelope of one page)
    a high row: | L0 temporal | L0 conv.. | L1 temporal | .. (StateSpec envelope of one request)

Views are indexed by *physical* row (``translate`` first); they alias the buffer, so a model or a
kernel reads and writes slots in place, and after a compaction a slot's data is at its new row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Optional, TypeVar, Union, cast

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.config import BACKENDS
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, MemoryBudgetError
from tiered_cache.kernels import use_triton
from tiered_cache.kernels.move import move_rows
from tiered_cache.specs import KVSpec, StateSpec, align_up
from tiered_cache.tiers.allocator import MultiEndedAllocator
from tiered_cache.validate import bool_arg, choice_arg, index_arg, int_arg

MAX_SLOTS = 1 << 40  # slot counts past this are typos; the memory check refuses far smaller ones

Spec = Union[KVSpec, StateSpec]
S = TypeVar("S", bound=Spec)


class SubPool(Generic[S]):
    """One side of a ``UnifiedPool``: its spec, allocator and typed views. Rows are physical ids.

    A ``SubPool[KVSpec]`` is a ``tiers.protocols.KVSide``, a ``SubPool[StateSpec]`` a ``StateSide``:
    the members those protocols name are what the tree, T1 and the T2 moves use.
    """

    def __init__(self, pool: UnifiedPool, name: str, spec: S, grows: str, page_size: int,
                 lazy: bool, backend: str) -> None:
        self.pool = pool
        self.name = name
        self.spec = spec
        self.is_kv = isinstance(spec, KVSpec)
        self.page_size = page_size if self.is_kv else 1
        self.entry_bytes = spec.bytes_per_slot(self.page_size)
        self.capacity = pool.total_bytes // self.entry_bytes
        # Byte offset of row 0. Down sides keep ascending rows in their views: their sink is the top row.
        self.base = 0 if grows == "up" else pool.total_bytes - self.capacity * self.entry_bytes
        self.backend = backend
        self.allocator = MultiEndedAllocator(
            name=name, entry_bytes=self.entry_bytes, total_bytes=pool.total_bytes, grows=grows,
            page_size=self.page_size, lazy=lazy, device=pool.device, mover=self._move,
        )

    @property
    def device(self) -> torch.device:
        return self.pool.device

    # ----------------------------------------------------------------- allocator, delegated
    def alloc(self, n: int) -> Optional[torch.Tensor]:
        return self.allocator.alloc(n)

    def free(self, ids: torch.Tensor) -> None:
        self.allocator.free(ids)

    def free_pages(self, pages: list[int]) -> None:
        self.allocator.free_pages(pages)

    def translate(self, ids: torch.Tensor) -> torch.Tensor:
        return self.allocator.translate(ids)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def schedulable_available_size(self) -> int:
        return self.allocator.schedulable_available_size()

    def compact(self) -> int:
        return self.allocator.compact()

    def translate_host(self, ids: np.ndarray) -> np.ndarray:
        return self.allocator.translate_host(ids)

    def physical_rows(self, vids: Sequence[int], arg: str = "vids") -> list[int]:
        return self.allocator.physical_rows(vids, arg)

    def live_virtual_ids(self) -> list[int]:
        return self.allocator.live_virtual_ids()

    def mark_busy(self, ids: Iterable[int]) -> None:
        self.allocator.mark_busy(ids)

    def unmark_busy(self, ids: Iterable[int]) -> None:
        self.allocator.unmark_busy(ids)

    def add_fence(self, fence: Callable[[], None]) -> None:
        if fence not in self.allocator.fences:
            self.allocator.fences.append(fence)

    def _move(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        move_rows(self.pool.raw, self.base, self.entry_bytes, self.capacity, src_rows, dst_rows, self.backend)

    # ------------------------------------------------------------------------------ views
    def rows_bytes(self) -> torch.Tensor:
        """``[capacity, entry_bytes]`` uint8 view: one row per slot envelope."""
        return self.pool.raw[self.base: self.base + self.capacity * self.entry_bytes].view(
            self.capacity, self.entry_bytes)

    def _typed(self, dtype: torch.dtype, shape, strides_bytes, offset_bytes: int) -> torch.Tensor:
        it = dtype.itemsize
        return self.pool.raw.view(dtype).as_strided(
            shape, tuple(s // it for s in strides_bytes), (self.base + offset_bytes) // it)

    def _need(self, kv: bool) -> None:
        if self.is_kv != kv:
            what = "KV" if kv else "state"
            raise InvalidArgumentError("side", f"a {what} side", f"{self.name!r} ({type(self.spec).__name__})")

    def k_view_all(self) -> torch.Tensor:
        """K of every layer: ``[L, capacity, page_size, kv_heads, head_dim]``."""
        return self._kv_view_all(0)

    def v_view_all(self) -> torch.Tensor:
        """V of every layer: ``[L, capacity, page_size, kv_heads, v_head_dim]``."""
        return self._kv_view_all(1)

    def k_view(self, layer: int) -> torch.Tensor:
        """K of one layer: ``[capacity, page_size, kv_heads, head_dim]``; token t of physical token
        id ``p`` is ``[p // page_size, p % page_size]``."""
        return self.k_view_all()[self._layer(layer)]

    def v_view(self, layer: int) -> torch.Tensor:
        return self.v_view_all()[self._layer(layer)]

    def _kv_view_all(self, which: int) -> torch.Tensor:
        self._need(True)
        s = cast(KVSpec, self.spec)
        ps = self.page_size
        d = s.head_dim if which == 0 else s.v_head_dim
        it = s.store_dtype.itemsize
        offs = s.field_offsets(ps)
        layer_stride = offs[1][0] if s.num_layers > 1 else self.entry_bytes
        shape = (s.num_layers, self.capacity, ps, s.kv_heads, d)
        strides = (layer_stride, self.entry_bytes, s.kv_heads * d * it, d * it, it)
        return self._typed(s.store_dtype, shape, strides, offs[0][which])

    def temporal_view_all(self) -> torch.Tensor:
        """Temporal states of every layer: ``[L, capacity, H, a, b]`` (``spec.temporal_shape``)."""
        self._need(False)
        s = cast(StateSpec, self.spec)
        h, a, b = s.require_temporal()  # a conv-only spec (temporal_shape=()) has none: a typed error
        it = s.temporal_dtype.itemsize
        offs = s.field_offsets()
        layer_stride = offs[1][0] if s.num_layers > 1 else self.entry_bytes
        shape = (s.num_layers, self.capacity, h, a, b)
        strides = (layer_stride, self.entry_bytes, a * b * it, b * it, it)
        return self._typed(s.temporal_dtype, shape, strides, offs[0][0])

    def conv_view_all(self, i: int = 0) -> torch.Tensor:
        """Conv window ``i`` of every layer: ``[L, capacity, *spec.conv_shapes[i]]``."""
        self._need(False)
        s = cast(StateSpec, self.spec)
        i = index_arg("i", i, len(s.conv_shapes))
        shape = s.conv_shapes[i]
        it = s.conv_dtype.itemsize
        inner = [it]
        for d in reversed(shape[1:]):
            inner.insert(0, inner[0] * d)
        offs = s.field_offsets()
        layer_stride = offs[1][0] if s.num_layers > 1 else self.entry_bytes
        return self._typed(s.conv_dtype, (s.num_layers, self.capacity, *shape),
                           (layer_stride, self.entry_bytes, *inner), offs[0][1][i])

    def temporal_view(self, layer: int) -> torch.Tensor:
        return self.temporal_view_all()[self._layer(layer)]

    def conv_view(self, layer: int, i: int = 0) -> torch.Tensor:
        return self.conv_view_all(i)[self._layer(layer)]

    def _layer(self, layer: int) -> int:
        return index_arg("layer", layer, self.spec.num_layers)


class UnifiedPool:
    """T0: one byte buffer, two sub-pools growing towards each other.

    Give either ``total_bytes`` or the slot counts ``low_slots`` and ``high_slots`` (pages for KV,
    states for a ``StateSpec``) the pool must be able to hold at once; ``bytes_for`` says how many
    bytes that takes. The size is checked against free device memory before allocating.

    Args:
        low: spec of the side growing up (full-attention KV).
        high: spec of the side growing down (recurrent states, or SWA KV).
        page_size: tokens per KV page.
        lazy_compaction: keep holes until the peer needs the bytes (else compact on every free).
        names: the sides' names; default ``("full", "mamba")`` or ``("full", "swa")``.
        backend: ``auto`` | ``triton`` | ``torch`` for the compaction move (see ``kernels.use_triton``).
    """

    def __init__(self, low: Spec, high: Spec, *, total_bytes: Optional[int] = None,
                 low_slots: Optional[int] = None, high_slots: Optional[int] = None, page_size: int = 1,
                 device: dev.DeviceLike = None, lazy_compaction: bool = False,
                 names: Optional[tuple[str, str]] = None, backend: str = "auto",
                 check_memory: bool = True) -> None:
        if not isinstance(low, KVSpec):  # the low side is full-attention KV in both pairings
            raise InvalidTypeError("low", "a KVSpec", type(low).__name__)
        if not isinstance(high, (KVSpec, StateSpec)):
            raise InvalidTypeError("high", "a KVSpec or StateSpec", type(high).__name__)
        page_size = int_arg("page_size", page_size, lo=1, hi=1 << 20)
        lazy_compaction = bool_arg("lazy_compaction", lazy_compaction)
        check_memory = bool_arg("check_memory", check_memory)
        choice_arg("backend", backend, BACKENDS)
        self.device = dev.resolve(device)
        use_triton(self.device, backend)  # backend allowed on this device
        if total_bytes is None:
            if low_slots is None and high_slots is None:
                raise InvalidTypeError("total_bytes", "an int, or both low_slots and high_slots", None)
            if low_slots is None or high_slots is None:
                arg = "low_slots" if low_slots is None else "high_slots"
                raise InvalidTypeError(arg, "an int >= 1 (with the other side's slots, or total_bytes)", None)
            total_bytes = self.bytes_for(low, high, low_slots, high_slots, page_size)
        elif low_slots is not None or high_slots is not None:
            raise InvalidArgumentError("total_bytes", "either total_bytes or low_slots/high_slots, not both",
                                       (total_bytes, low_slots, high_slots))
        total_bytes = int_arg("total_bytes", total_bytes, lo=16)
        if total_bytes % 16:
            raise InvalidArgumentError("total_bytes", "a positive multiple of 16", total_bytes)
        lo_e, hi_e = low.bytes_per_slot(page_size), high.bytes_per_slot(page_size)
        if total_bytes < 2 * lo_e + hi_e or total_bytes < lo_e + 2 * hi_e:
            raise InvalidArgumentError("total_bytes", f">= both sinks and one slot per side "
                                       f"({max(2 * lo_e + hi_e, lo_e + 2 * hi_e)} bytes)", total_bytes)
        if names is None:
            names = ("full", "mamba" if isinstance(high, StateSpec) else "swa")
        if (not isinstance(names, (tuple, list)) or len(names) != 2
                or not all(isinstance(n, str) and n for n in names)):
            raise InvalidTypeError("names", "two non-empty str names", names)
        if names[0] == names[1]:
            raise InvalidArgumentError("names", "two different names", names)
        low_name, high_name = names
        if check_memory:
            free = dev.free_memory(self.device)
            if total_bytes > free:
                raise MemoryBudgetError("UnifiedPool", total_bytes, free, "total_bytes (or low_slots/high_slots)")
        self.total_bytes = total_bytes
        self.page_size = page_size
        # Unwritten slots read as zeros, so a padded read of the sink is harmless.
        self.raw = torch.zeros(total_bytes, dtype=torch.uint8, device=self.device)
        self.low: SubPool[KVSpec] = SubPool(self, low_name, low, "up", page_size, lazy_compaction, backend)
        self.high: SubPool[Spec] = SubPool(self, high_name, high, "down", page_size, lazy_compaction, backend)
        self.low.allocator.bind_peer(self.high.allocator)
        self.high.allocator.bind_peer(self.low.allocator)
        self._sides: dict[str, SubPool[Any]] = {low_name: self.low, high_name: self.high}

    @staticmethod
    def bytes_for(low: Spec, high: Spec, low_slots: int, high_slots: int, page_size: int = 1) -> int:
        """Bytes for ``low_slots`` and ``high_slots`` live slots at once, plus the two sinks."""
        if not isinstance(low, (KVSpec, StateSpec)):
            raise InvalidTypeError("low", "a KVSpec or StateSpec", type(low).__name__)
        if not isinstance(high, (KVSpec, StateSpec)):
            raise InvalidTypeError("high", "a KVSpec or StateSpec", type(high).__name__)
        low_slots = int_arg("low_slots", low_slots, lo=1, hi=MAX_SLOTS)
        high_slots = int_arg("high_slots", high_slots, lo=1, hi=MAX_SLOTS)
        page_size = int_arg("page_size", page_size, lo=1, hi=1 << 20)
        return align_up((low_slots + 1) * low.bytes_per_slot(page_size)
                        + (high_slots + 1) * high.bytes_per_slot(page_size))

    def side(self, name: str) -> SubPool[Any]:
        if not isinstance(name, str):
            raise InvalidTypeError("name", f"one of {sorted(self._sides)}", name)
        try:
            return self._sides[name]
        except KeyError:
            raise InvalidArgumentError("name", f"one of {sorted(self._sides)}", name) from None

    @property
    def sides(self) -> tuple[SubPool[KVSpec], SubPool[Any]]:
        return (self.low, self.high)

    def clear(self) -> None:
        """Free every slot of both sides (data is left as it is)."""
        self.low.allocator.clear()
        self.high.allocator.clear()

    def check_invariants(self) -> None:
        """Both sides' tables are consistent and their bands disjoint (raises AssertionError)."""
        self.low.allocator.check_invariants()
        self.high.allocator.check_invariants()
        lo_end = self.low.base + self.low.allocator.band_bytes()
        hi_start = self.total_bytes - self.high.allocator.band_bytes()
        assert lo_end <= hi_start, f"bands overlap: low ends at {lo_end}, high starts at {hi_start}"

    def __repr__(self) -> str:
        return (f"UnifiedPool({self.total_bytes / 2**20:.1f} MiB on {self.device}, "
                f"{self.low.name}: {self.low.allocator.num_live} live / {self.low.capacity} rows, "
                f"{self.high.name}: {self.high.allocator.num_live} live / {self.high.capacity} rows)")
