"""``HostMirror`` (T2): host memory for states and KV pages evicted from the GPU tiers.

Allocated once at start, in chunks of at most ``chunk_bytes`` (1 GiB by default: single pins of more
than ~4 GB fail on some systems), pinned when CUDA exists so copies run as DMA at full PCIe speed.
The mirror has named *regions*, one per kind of slot, each of fixed-size slots that never move:

- a state region: one slot = one T1 envelope (int8 qdata, scales and conv windows of one state, all
  layers), byte-identical to the T1 slot it came from, so demote and promote never re-quantize;
- a KV region: one slot = one T0 KV page envelope, page-first (all layers of one page contiguous,
  ``L0 K | L0 V | L1 K | ...``), so one page is one transfer and a layer is one sub-range of it.

Each slot carries the checksum taken on the GPU when its bytes left; ``valid`` says a slot's bytes
and checksum are complete (set by the transfer engine when the demote ticket finishes).

Pinning: ``register`` allocates ordinary memory and pins it with ``cudaHostRegister``; ``pin_memory``
uses torch's pinned allocator. docs/platform.md: 8 GiB registered in 2.9 s (0.36 s/GiB) against
0.45 s for one 1 GiB ``pin_memory``; ``bench_transfer.py`` measures both again and records the choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, MemoryBudgetError
from tiered_cache.tiers.slots import SlotAllocator
from tiered_cache.validate import bool_arg, choice_arg, float_arg, index_arg, int_arg, str_arg

PIN_METHODS = ("auto", "register", "pin_memory", "none")


@dataclass(frozen=True)
class RegionSpec:
    """A region of ``num_slots`` host slots of ``slot_bytes`` each (a multiple of 16)."""

    name: str
    slot_bytes: int
    num_slots: int

    def __post_init__(self) -> None:
        str_arg("name", self.name)
        object.__setattr__(self, "slot_bytes", int_arg("slot_bytes", self.slot_bytes, lo=16, hi=1 << 40))
        if self.slot_bytes % 16:
            raise InvalidArgumentError("slot_bytes", "a positive multiple of 16", self.slot_bytes)
        object.__setattr__(self, "num_slots", int_arg("num_slots", self.num_slots, lo=1))

    @property
    def nbytes(self) -> int:
        return (self.num_slots + 1) * self.slot_bytes  # slot 0 reserved, as everywhere


class HostRegion:
    """Fixed-size host slots ``1..num_slots`` in pinned chunks; no slot straddles two chunks."""

    def __init__(self, spec: RegionSpec, chunk_bytes: int, pin: str) -> None:
        self.spec = spec
        self.name = spec.name
        self.slot_bytes = spec.slot_bytes
        self.capacity = spec.num_slots + 1
        self.per_chunk = max(1, chunk_bytes // spec.slot_bytes)
        self.chunks: list[torch.Tensor] = []
        self._registered: list[torch.Tensor] = []
        left = self.capacity
        while left:
            n = min(left, self.per_chunk)
            self.chunks.append(_host_alloc(n * spec.slot_bytes, pin, self._registered))
            left -= n
        self.pinned = pin != "none"
        self._chunk_ptrs: Optional[np.ndarray] = None  # chunks' addresses, made on first use (they never move)
        self.allocator = SlotAllocator(spec.num_slots, name=f"host {spec.name}")
        self.checksums = np.zeros(self.capacity, dtype=np.int64)
        self.valid = np.zeros(self.capacity, dtype=bool)

    def alloc(self, n: int = 1) -> Optional[list[int]]:
        return self.allocator.alloc(n)

    def free(self, ids) -> None:
        lst = self.allocator.check("ids", ids)
        if any(self.allocator.is_busy(i) for i in lst):
            self.allocator.free(lst)  # raises SlotBusyError, before anything changes
        self.allocator.free(lst)
        self.valid[lst] = False

    def available_size(self) -> int:
        return self.allocator.available_size()

    def slot(self, i: int) -> torch.Tensor:
        """The ``slot_bytes`` bytes of slot ``i`` (a view into its chunk)."""
        i = index_arg("i", i, self.capacity)
        c, r = divmod(i, self.per_chunk)
        return self.chunks[c][r * self.slot_bytes: (r + 1) * self.slot_bytes]

    def runs(self, slots: Sequence[int]) -> list[tuple[int, int, int]]:
        """Group positions of ``slots`` into runs of consecutive slots inside one chunk.

        Returns ``(first_position, first_slot, length)``; a run is one contiguous host range.
        """
        s = np.asarray(slots, dtype=np.int64).reshape(-1)
        if s.size == 0:
            return []
        starts = np.ones(s.size, dtype=bool)  # a run starts where the next slot is not the one after
        starts[1:] = (s[1:] != s[:-1] + 1) | (s[1:] // self.per_chunk != s[:-1] // self.per_chunk)
        first = np.flatnonzero(starts)
        lengths = np.diff(np.append(first, s.size))
        return list(zip(first.tolist(), s[first].tolist(), lengths.tolist()))

    def slot_addresses(self, slots: Sequence[int]) -> np.ndarray:
        """The host address of each slot's first byte (int64), for DMA calls that take raw pointers."""
        c, k = np.divmod(np.asarray(slots, dtype=np.int64), self.per_chunk)
        if self._chunk_ptrs is None:
            self._chunk_ptrs = np.array([t.data_ptr() for t in self.chunks], dtype=np.int64)
        return self._chunk_ptrs[c] + k * self.slot_bytes

    def run_view(self, first_slot: int, n: int) -> torch.Tensor:
        c, r = divmod(first_slot, self.per_chunk)
        return self.chunks[c][r * self.slot_bytes: (r + n) * self.slot_bytes]

    def flip_bit(self, slot: int, byte: int, bit: int) -> None:
        """Test hook: flip one bit of a slot's host bytes, as a failing DIMM or a stray write would."""
        slot = index_arg("slot", slot, self.capacity)
        byte = index_arg("byte", byte, self.slot_bytes)
        bit = index_arg("bit", bit, 8)
        view = self.slot(slot)
        view[byte] = int(view[byte]) ^ (1 << bit)

    def close(self) -> None:
        """Unpin registered memory (the slots stay readable, as ordinary memory; copies to them are no
        longer DMA and no kernel may map them)."""
        for t in self._registered:
            dev.host_unregister(t)
        if self._registered:
            self.pinned = False
        self._registered.clear()

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        # The region unpins its own memory when it goes, not its mirror: a region kept past its
        # HostMirror (HostMirror.region's result held alone) stays pinned while it lives.
        try:
            self.close()
        except Exception:
            pass

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        free = np.ones(self.capacity, dtype=bool)
        free[self.allocator.allocated_ids()] = False
        assert not (self.valid & free).any(), f"host {self.name}: a free slot is marked valid"


class HostMirror:
    """T2: named host regions allocated once, checked against a budget and the machine's RAM.

    Args:
        regions: one ``RegionSpec`` per kind of slot (e.g. ``state``, ``full``, ``swa``).
        pin: ``auto`` (``register`` with CUDA, ``none`` without), ``register``, ``pin_memory``, ``none``.
        chunk_bytes: largest single allocation (and pin).
        budget_bytes: refuse to allocate more than this (``MemoryBudgetError`` names the setting).
        check_memory: also refuse more than the host's available memory.
    """

    def __init__(self, regions: Sequence[RegionSpec], *, pin: str = "auto", chunk_bytes: int = 1 << 30,
                 budget_bytes: Optional[float] = None, check_memory: bool = True) -> None:
        choice_arg("pin", pin, PIN_METHODS)
        if isinstance(regions, RegionSpec) or not isinstance(regions, (list, tuple)):
            raise InvalidTypeError("regions", "a list or tuple of RegionSpec", regions)
        if not regions or not all(isinstance(r, RegionSpec) for r in regions):
            raise InvalidTypeError("regions", "a non-empty sequence of RegionSpec", regions)
        names = [r.name for r in regions]
        if len(set(names)) != len(names):
            raise InvalidArgumentError("regions", "distinct region names", names)
        chunk_bytes = int_arg("chunk_bytes", chunk_bytes, lo=16)
        if budget_bytes is not None:
            # an int (or a finite real) of bytes: NaN compares false with everything, so a NaN budget
            # would let any size through
            budget_bytes = float_arg("budget_bytes", budget_bytes, lo=0)
        check_memory = bool_arg("check_memory", check_memory)
        if pin == "auto":
            pin = "register" if dev.cuda_available() else "none"
        if pin != "none" and not dev.cuda_available():
            raise InvalidArgumentError("pin", "'none' or 'auto' on a machine without CUDA", pin)
        need = self.estimate_bytes(regions)
        setting = "num_slots of " + " / ".join(names)
        if budget_bytes is not None and need > budget_bytes:
            raise MemoryBudgetError("HostMirror", need, budget_bytes, f"{setting} (or raise budget_bytes)")
        if check_memory:
            avail = dev.host_available_memory()
            if need > avail:
                raise MemoryBudgetError("HostMirror", need, avail, setting)
        self.pin = pin
        self.regions: dict[str, HostRegion] = {}
        try:
            for r in regions:
                self.regions[r.name] = HostRegion(r, chunk_bytes, pin)
        except Exception:
            self.close()
            raise

    @staticmethod
    def estimate_bytes(regions: Sequence[RegionSpec]) -> int:
        if not isinstance(regions, (list, tuple)) or not all(isinstance(r, RegionSpec) for r in regions):
            raise InvalidTypeError("regions", "a list or tuple of RegionSpec", regions)
        return sum(r.nbytes for r in regions)

    @property
    def nbytes(self) -> int:
        return sum(sum(c.numel() for c in r.chunks) for r in self.regions.values())

    def region(self, name: str) -> HostRegion:
        if not isinstance(name, str):
            raise InvalidTypeError("name", f"one of {sorted(self.regions)}", name)
        try:
            return self.regions[name]
        except KeyError:
            raise InvalidArgumentError("name", f"one of {sorted(self.regions)}", name) from None

    def check_invariants(self) -> None:
        for r in self.regions.values():
            r.check_invariants()

    def close(self) -> None:
        """Unpin registered memory (pinned-allocator memory is returned when the tensors go). Each region
        also unpins its own when it is collected, so one still held outlives its mirror pinned."""
        for r in self.regions.values():
            r.close()


def _host_alloc(nbytes: int, pin: str, registered: list[torch.Tensor]) -> torch.Tensor:
    if pin == "pin_memory":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    try:
        t = torch.empty(nbytes, dtype=torch.uint8)
    except (RuntimeError, MemoryError):  # check_memory=False and more than the host has
        raise MemoryBudgetError("HostMirror chunk", nbytes, dev.host_available_memory(),
                                "num_slots (or chunk_bytes)") from None
    if pin == "register":
        err = dev.host_register(t)
        if err != 0:
            raise MemoryBudgetError(f"cudaHostRegister of {nbytes} bytes failed (error {err}); HostMirror",
                                    nbytes, 0, "chunk_bytes (or use pin='pin_memory')")
        registered.append(t)
    return t
