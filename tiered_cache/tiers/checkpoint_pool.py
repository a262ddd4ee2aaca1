"""``Int8CheckpointPool`` (T1): the recurrent states the radix tree owns, int8 on the GPU.

A running request's state is quantized once when it is cached (``store_from_active``) and
dequantized once into a fresh T0 slot on a hit (``load_to_active``; copy-on-write, the checkpoint
stays). It never re-enters the recurrence as a quantize/dequantize loop, so the error is one rounding.
The math is in ``kernels/_ref_quant.py``; the fused kernels in ``kernels/quant.py``.

Storage is one ``uint8`` buffer of slot envelopes, slot-major, so one slot's bytes are one contiguous
range: T2 (the host mirror) copies a slot byte for byte and a promoted state is bit-identical to the
demoted one. Inside an envelope each field holds all layers and starts on a 16-byte boundary::

    raw:      | slot 0 (reserved sink) | slot 1 | slot 2 | ...            slot_bytes each
    int8:     | qdata [L, H, a, b] int8 | scale [L, H, 1, d_k] state dtype | conv0 [L, *c0] | conv1 ..
    lossless: | data  [L, H, a, b] state dtype (T0's axis order)          | conv0 [L, *c0] | conv1 ..
    conv only (a ``StateSpec`` without a temporal state, either codec):   | conv0 [L, *c0] | conv1 ..

The codes keep the state's own axis order (``[H, a, b]``, T0's: ``[d_v, d_k]`` for value axis 1, ``[d_k, d_v]``
for value axis 2), so a store and a load read and write both sides along the same innermost axis and the kernels
move no tile between layouts: with the codes in ``[d_v, d_k]``, a ``[d_k, d_v]`` state's store went through an 8 KiB
shared-memory transpose and reduced its amax across lanes (sm_90, one 8,192-element program: 856 instructions a
thread for bf16, 1,296 for fp32; in the state's order 656 and 816, 128-256 B of shared memory).
Typed strided views ``qdata [L, S, H, d_v, d_k]`` (for value axis 2 a transposed view: swapped strides),
``scale [L, S, H, 1, d_k]``, ``data [L, S, H, a, b]`` and ``conv[i] [L, S, *conv_shape]`` alias the buffer
(layer stride: one layer's field; slot stride: ``slot_bytes``); ``fields`` gives each field's byte offset,
size, dtype and shape inside an envelope (the stored order: ``qdata``'s is ``[L, H, a, b]``).

Non-finite states: every store also marks a per-slot flag when a value it reads is NaN or +-inf, nearly
free, without a sync or a launch of its own (``finite_flags.py``); ``poll_nonfinite`` reports the non-finite
slots, which the owner must not serve.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.config import BACKENDS, CODECS
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, MemoryBudgetError
from tiered_cache.kernels import use_triton
from tiered_cache.specs import StateSpec, align_up
from tiered_cache.tiers import t1_args
from tiered_cache.tiers.finite_flags import FiniteFlags
from tiered_cache.tiers.protocols import StateSide
from tiered_cache.tiers.slots import SlotAllocator
from tiered_cache.tiers.t1_args import ActiveViews
from tiered_cache.validate import choice_arg, int_arg

IdsLike = Union[torch.Tensor, Sequence[int]]


@dataclass(frozen=True)
class EnvelopeField:
    """One field of a slot envelope: ``nbytes`` at byte ``offset``, read as ``dtype`` of ``shape`` (all layers)."""

    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


# Where T0 states are read from / written to: a T0 side (virtual ids) or plain views (physical rows).
ActiveLike = Union[StateSide, ActiveViews, torch.Tensor]


def envelope_layout(spec: StateSpec, codec: str = "int8") -> tuple[tuple[EnvelopeField, ...], int]:
    """The fields of one slot envelope and its size in bytes (a multiple of 16)."""
    if not isinstance(spec, StateSpec):
        raise InvalidTypeError("spec", "a StateSpec", type(spec).__name__)
    choice_arg("codec", codec, CODECS)
    L = spec.num_layers
    parts: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    if not spec.has_temporal:
        pass  # conv windows only (Lfm2): every codec keeps them in conv_dtype
    elif codec == "int8":
        parts = [("qdata", torch.int8, (L, *spec.temporal_shape)),  # the state's order: [H, a, b]
                 ("scale", spec.temporal_dtype, (L, spec.num_heads, 1, spec.d_k))]
    else:
        parts = [("data", spec.temporal_dtype, (L, *spec.temporal_shape))]
    parts += [(f"conv{i}", spec.conv_dtype, (L, *shape)) for i, shape in enumerate(spec.conv_shapes)]
    fields, off = [], 0
    for name, dtype, shape in parts:
        nbytes = math.prod(shape) * dtype.itemsize
        fields.append(EnvelopeField(name, off, nbytes, dtype, shape))
        off += align_up(nbytes)
    return tuple(fields), off


class Int8CheckpointPool:
    """T1: ``num_slots`` checkpoint slots (ids ``1..num_slots``; slot 0 is a reserved sink).

    Args:
        spec: the state of one request (``StateSpec``); ``value_axis`` picks the scale's reduction axis.
        num_slots: checkpoints held at once. The pool allocates ``estimate_bytes(spec, num_slots, codec)``.
        device: where the buffer lives (default: the GPU if there is one).
        codec: ``int8`` (qdata + per-(layer, slot, head, k-channel) scale) or ``lossless`` (the state dtype).
        check_memory: compare the size with free device memory first (``MemoryBudgetError`` names num_slots).
        backend: ``auto`` | ``triton`` | ``torch`` (see ``kernels.use_triton``).
    """

    def __init__(self, spec: StateSpec, num_slots: int, device: dev.DeviceLike = None, codec: str = "int8",
                 check_memory: bool = True, backend: str = "auto") -> None:
        num_slots = int_arg("num_slots", num_slots, lo=1)
        if not isinstance(check_memory, bool):
            raise InvalidTypeError("check_memory", "a bool", check_memory)
        choice_arg("backend", backend, BACKENDS)
        self.fields, self.slot_bytes = envelope_layout(spec, codec)
        self.spec, self.codec, self.num_slots = spec, codec, num_slots
        self.device = dev.resolve(device)
        self._cpu = self.device.type == "cpu"
        use_triton(self.device, backend)  # validates backend
        self.backend = backend
        self.capacity = num_slots + 1
        # T0 <-> T1 moves: "stores" / "loads" (slots) and "store_bytes" / "load_bytes" (envelopes written
        # or read), so an owner reports T1 traffic without wrapping the pool.
        self.stats: collections.Counter[str] = collections.Counter()
        need = self.estimate_bytes(spec, num_slots, codec)
        if check_memory:
            free = dev.free_memory(self.device)
            if need > free:
                raise MemoryBudgetError("Int8CheckpointPool", need, free, "num_slots")
        # Zeros: the sink and never-written slots dequantize to an all-zero state, never to garbage.
        self.raw = torch.zeros(need, dtype=torch.uint8, device=self.device)
        views = {f.name: self._view(f) for f in self.fields}
        if "qdata" in views and spec.value_axis == 2:  # stored [L, S, H, d_k, d_v]: seen as [.., d_v, d_k]
            views["qdata"] = views["qdata"].transpose(3, 4)
        self.qdata: Optional[torch.Tensor] = views.get("qdata")
        self.scale: Optional[torch.Tensor] = views.get("scale")
        self.data: Optional[torch.Tensor] = views.get("data")
        self.conv: list[torch.Tensor] = [views[f"conv{i}"] for i in range(len(spec.conv_shapes))]
        # the temporal field's views, in either codec: (qdata, scale) or (data,); () for a conv-only state
        self._temporal = tuple(views[n] for n in (("qdata", "scale") if codec == "int8" else ("data",)) if n in views)
        # Host-side slot bookkeeping (alloc/free never touch the device), with the busy guard that keeps
        # slots under an in-flight T2 transfer from being freed.
        self.allocator = SlotAllocator(num_slots, name="checkpoint")
        self.flags = FiniteFlags(self.capacity, self.device)
        self._args = t1_args.CallArgs(self)  # per-call checks; each T0 side's layout checked once

    # ---------------------------------------------------------------------------- sizes, bytes
    @staticmethod
    def estimate_bytes(spec: StateSpec, num_slots: int, codec: str = "int8") -> int:
        """Device bytes the pool allocates: ``(num_slots + 1) * slot_bytes`` (slot 0 included)."""
        num_slots = int_arg("num_slots", num_slots, lo=1)
        return (num_slots + 1) * envelope_layout(spec, codec)[1]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    @property
    def envelopes(self) -> torch.Tensor:
        """``[capacity, slot_bytes]`` uint8: row ``s`` is every byte of slot ``s`` (what T2 copies)."""
        return self.raw.view(self.capacity, self.slot_bytes)

    def envelope(self, slot: int) -> torch.Tensor:
        """The ``slot_bytes`` uint8 bytes of one slot (a view: writing it writes the slot)."""
        return self.envelopes[int_arg("slot", slot, lo=0, hi=self.capacity - 1)]

    def field(self, name: str) -> EnvelopeField:
        choice_arg("name", name, [f.name for f in self.fields])
        for f in self.fields:
            if f.name == name:
                return f
        raise InvalidArgumentError("name", f"one of {[f.name for f in self.fields]}", name)

    def _view(self, f: EnvelopeField) -> torch.Tensor:
        it = f.dtype.itemsize
        inner = f.shape[1:]
        strides = [1]
        for d in reversed(inner[1:]):
            strides.insert(0, strides[0] * d)
        shape = (f.shape[0], self.capacity, *inner)
        return self.raw.view(f.dtype).as_strided(
            shape, (math.prod(inner), self.slot_bytes // it, *strides), f.offset // it)

    # ------------------------------------------------------------------------------- slots
    def alloc(self, n: int = 1) -> Optional[torch.Tensor]:
        """``n`` free slot ids (int64 on ``device``), or ``None`` if fewer are free (nothing changes)."""
        ids = self.allocator.alloc(n)
        return None if ids is None else self._ids_tensor(ids)

    def alloc_ids(self, n: int = 1) -> Optional[tuple[torch.Tensor, list[int]]]:
        """``alloc`` that also returns the ids on the host (the caller keeps them without a read back)."""
        ids = self.allocator.alloc(n)
        return None if ids is None else (self._ids_tensor(ids), ids)

    def _ids_tensor(self, ids: list[int]) -> torch.Tensor:
        """Slot ids as an int64 tensor on ``device``; one id (an insert's state) by ``torch.full``, about half
        the host time of ``torch.tensor``'s list parse, and on the CPU by ``from_numpy`` of a fresh array (the
        tensor owns it), about 70 % of ``torch.full``'s (7.5 k against 10.8 k instructions, callgrind)."""
        if len(ids) == 1:
            if self._cpu:
                return torch.from_numpy(np.array(ids, dtype=np.int64))
            return torch.full((1,), ids[0], dtype=torch.int64, device=self.device)
        return torch.tensor(ids, dtype=torch.int64, device=self.device)

    def free(self, ids: IdsLike) -> None:
        """Return slots from ``alloc``. Unknown, free or repeated ids raise ``SlotStateError``; a slot a
        transfer still reads or writes raises ``SlotBusyError``; nothing changes."""
        host = t1_args.host_ids("ids", ids, self.device)
        self.allocator.free(host)
        self.flags.forget(host)

    def free_owned(self, ids: list[int]) -> None:
        """Trusted ``free`` of host ids an owner took from ``alloc_ids`` (``SlotAllocator.free_owned``)."""
        self.allocator.free_owned(ids)
        self.flags.forget(ids)

    def available_size(self) -> int:
        return self.allocator.available_size()

    def is_allocated(self, slot: int) -> bool:
        return self.allocator.is_allocated(int_arg("slot", slot))

    def clear(self) -> None:
        """Free every slot (the bytes stay as they are)."""
        self.allocator.clear()
        self.flags.clear()

    # ----------------------------------------------------------------------------- finiteness
    def poll_nonfinite(self, wait_for: Optional[Iterable[int]] = None) -> list[int]:
        """Slots whose last store read a NaN or an inf, among the stores whose flags have reached the
        host; ``wait_for``: slot ids whose flags to wait for now (a sync on that small copy, normally
        long finished). Each slot is reported once; it stays allocated (its owner frees it)."""
        return [s for s, ok in self.poll_flags(wait_for).items() if not ok]

    def poll_flags(self, wait_for: Optional[Iterable[int]] = None) -> dict[int, bool]:
        """``poll_nonfinite`` with every slot resolved: slot -> whether its last store was all finite."""
        return self.flags.poll(wait_for)

    def flags_pending(self, slot: int) -> bool:
        """Whether the finiteness of ``slot``'s last store is not known on the host yet."""
        return self.flags.pending(int_arg("slot", slot))

    # ----------------------------------------------------------------------- T0 <-> T1 moves
    def store_from_active(self, side: ActiveLike, active_ids: IdsLike, ckpt_slots: IdsLike) -> None:
        """Checkpoint: quantize (or copy) the T0 states ``active_ids`` into slots ``ckpt_slots``.

        ``side``: a T0 ``StateSide`` (``active_ids`` are its *virtual* ids, translated on its host table),
        or ``ActiveViews`` / a temporal tensor (``active_ids`` are physical rows). Every check runs before
        the first launch: a bad argument raises and writes nothing (``t1_args.py`` says what is checked
        once per side and what per call). Host id lists cost no device sync; device tensors are read back.
        """
        lay = self._args.layout(side)
        rows = self._args.rows(side, lay, active_ids, unique=False)
        host_slots = self._args.slots("ckpt_slots", ckpt_slots, unique=True)
        if rows.size != host_slots.size:
            raise InvalidArgumentError("ckpt_slots", f"{rows.size} ids, as many as active_ids", host_slots.size)
        self.store_rows(side, rows, host_slots)

    def store_rows(self, side: ActiveLike, rows: np.ndarray, slots: np.ndarray) -> None:
        """``store_from_active`` past its checks, for an owner that made them once (the radix tree: its
        T0 slot checked at insert, a T1 slot it just allocated): physical ``rows`` of ``side`` into
        allocated, distinct ``slots``, as many (host int64 arrays). Nothing is checked again."""
        lay = self._args.layout(side)
        self.stats["stores"] += rows.size
        self.stats["store_bytes"] += rows.size * self.slot_bytes
        if rows.size == 0:
            return
        rows_t, slots_t = self._args.to_device(rows, slots)
        mark = self.flags.arm(slots)
        try:
            t1_args.kernels_store(self, lay, rows_t, slots_t, mark, rows.size)
        finally:  # even after a launch that raised: the ids' buffer is guarded, the slots' flags awaited
            # on the ring entry's event, recorded after the kernels and lent: never recorded again (None for
            # ids passed as arguments or past the ring's width: the flags record their own)
            self.flags.sent(slots, mark, self._args.sent(rows_t, lend=True))

    def load_to_active(self, ckpt_slots: IdsLike, side: ActiveLike, active_ids: IdsLike) -> None:
        """Hit: dequantize (or copy) checkpoints ``ckpt_slots`` into the T0 states ``active_ids``.

        The checkpoints stay (copy-on-write); one slot may be loaded into several active states.
        ``side`` and ``active_ids`` as in ``store_from_active``; ``active_ids`` must be distinct.
        """
        host_slots = self._args.slots("ckpt_slots", ckpt_slots, unique=False)
        lay = self._args.layout(side)
        rows = self._args.rows(side, lay, active_ids, unique=True)
        if rows.size != host_slots.size:
            raise InvalidArgumentError("active_ids", f"{host_slots.size} ids, as many as ckpt_slots", rows.size)
        self.load_rows(host_slots, side, rows)

    def load_rows(self, slots: np.ndarray, side: ActiveLike, rows: np.ndarray) -> None:
        """``load_to_active`` past its checks (``store_rows``' terms): allocated ``slots`` into distinct
        physical ``rows`` of ``side``. Nothing is checked again."""
        lay = self._args.layout(side)
        self.stats["loads"] += rows.size
        self.stats["load_bytes"] += rows.size * self.slot_bytes
        if rows.size == 0:
            return
        slots_t, rows_t = self._args.to_device(slots, rows)  # (source, destination): packed in that order
        try:
            t1_args.kernels_load(self, lay, slots_t, rows_t, rows.size)
        finally:  # the ids' buffer stays guarded until the launches that read it ran
            self._args.sent(slots_t)

    def __repr__(self) -> str:
        return (f"Int8CheckpointPool({self.codec}, {self.num_slots} slots x {self.slot_bytes} B = "
                f"{self.nbytes / 2**20:.1f} MiB on {self.device}, {self.available_size()} free)")
