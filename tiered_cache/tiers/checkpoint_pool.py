"""``Int8CheckpointPool`` (T1): the recurrent states the radix tree owns, int8 on the GPU.

A running request's state is quantized once when it is cached (``store_from_active``) and
dequantized once into a fresh T0 slot on a hit (``load_to_active``; copy-on-write, the checkpoint
stays). It never re-enters the recurrence as a quantize/dequantize loop, so the error is one rounding.
The math is in ``kernels/_ref_quant.py``; the fused kernels in ``kernels/quant.py``.

Storage is one ``uint8`` buffer of slot envelopes, slot-major, so one slot's bytes are one contiguous
range: T2 (the host mirror) copies a slot byte for byte and a promoted state is bit-identical to the
demoted one. Inside an envelope each field holds all layers and starts on a 16-byte boundary::

    raw:      | slot 0 (reserved sink) | slot 1 | slot 2 | ...            slot_bytes each
    int8:     | qdata [L, H, d_v, d_k] int8 | scale [L, H, 1, d_k] state dtype | conv0 [L, *c0] | conv1 ..
    lossless: | data  [L, H, a, b] state dtype (T0's axis order)          | conv0 [L, *c0] | conv1 ..

Typed strided views ``qdata [L, S, H, d_v, d_k]``, ``scale [L, S, H, 1, d_k]``, ``data [L, S, H, a, b]``
and ``conv[i] [L, S, *conv_shape]`` alias the buffer (layer stride: one layer's field; slot stride:
``slot_bytes``); ``fields`` gives each field's byte offset, size, dtype and shape inside an envelope.

Non-finite states: every store also clears a per-slot flag when a value it reads is NaN or +-inf,
nearly free and without a sync (``finite_flags.py``); ``poll_nonfinite`` reports the non-finite slots,
which the owner must not serve.
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
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, MemoryBudgetError, SlotStateError
from tiered_cache.kernels import quant, use_triton
from tiered_cache.specs import StateSpec, align_up
from tiered_cache.tiers.finite_flags import FiniteFlags
from tiered_cache.tiers.protocols import StateSide
from tiered_cache.tiers.slots import SlotAllocator
from tiered_cache.validate import _INT_TORCH, choice_arg, int_arg, int_list

IdsLike = Union[torch.Tensor, Sequence[int]]


@dataclass(frozen=True)
class EnvelopeField:
    """One field of a slot envelope: ``nbytes`` at byte ``offset``, read as ``dtype`` of ``shape`` (all layers)."""

    name: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ActiveViews:
    """T0-like views indexed by *physical* row, for callers without a ``StateSide`` (tests, adapters).

    ``temporal [L, R, *spec.temporal_shape]`` and one ``[L, R, *conv_shape]`` per conv window.
    """

    temporal: torch.Tensor
    convs: tuple[torch.Tensor, ...] = ()


# Where T0 states are read from / written to: a T0 side (virtual ids) or plain views (physical rows).
ActiveLike = Union[StateSide, ActiveViews, torch.Tensor]


def envelope_layout(spec: StateSpec, codec: str = "int8") -> tuple[tuple[EnvelopeField, ...], int]:
    """The fields of one slot envelope and its size in bytes (a multiple of 16)."""
    if not isinstance(spec, StateSpec):
        raise InvalidTypeError("spec", "a StateSpec", type(spec).__name__)
    choice_arg("codec", codec, CODECS)
    L, (H, a, b) = spec.num_layers, spec.temporal_shape
    parts: list[tuple[str, torch.dtype, tuple[int, ...]]]
    if codec == "int8":
        parts = [("qdata", torch.int8, (L, H, spec.d_v, spec.d_k)),
                 ("scale", spec.temporal_dtype, (L, H, 1, spec.d_k))]
    else:
        parts = [("data", spec.temporal_dtype, (L, H, a, b))]
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
        self.qdata: Optional[torch.Tensor] = views.get("qdata")
        self.scale: Optional[torch.Tensor] = views.get("scale")
        self.data: Optional[torch.Tensor] = views.get("data")
        self.conv: list[torch.Tensor] = [views[f"conv{i}"] for i in range(len(spec.conv_shapes))]
        # the temporal field's views, present in either codec: (qdata, scale) or (data,)
        self._temporal = tuple(views[f.name] for f in self.fields[: 2 if codec == "int8" else 1])
        # Host-side slot bookkeeping (alloc/free never touch the device), with the busy guard that keeps
        # slots under an in-flight T2 transfer from being freed.
        self.allocator = SlotAllocator(num_slots, name="checkpoint")
        self.flags = FiniteFlags(self.capacity, self.device)

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
        return None if ids is None else torch.tensor(ids, dtype=torch.int64, device=self.device)

    def alloc_ids(self, n: int = 1) -> Optional[tuple[torch.Tensor, list[int]]]:
        """``alloc`` that also returns the ids on the host (the caller keeps them without a read back)."""
        ids = self.allocator.alloc(n)
        return None if ids is None else (torch.tensor(ids, dtype=torch.int64, device=self.device), ids)

    def free(self, ids: IdsLike) -> None:
        """Return slots from ``alloc``. Unknown, free or repeated ids raise ``SlotStateError``; a slot a
        transfer still reads or writes raises ``SlotBusyError``; nothing changes."""
        host = self._host_ids("ids", ids)
        self.allocator.free(host)
        self.flags.forget(host.tolist())

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

        ``side``: a T0 ``StateSide`` (``active_ids`` are its *virtual* ids, translated once), or
        ``ActiveViews`` / a temporal tensor (``active_ids`` are physical rows). Every check runs before
        the first launch: a bad argument raises and writes nothing.
        """
        temporal, convs, rows = self._resolve_active(side, active_ids, unique=False)
        slots, host_slots = self._checked_slots("ckpt_slots", ckpt_slots, unique=True)
        if rows.numel() != slots.numel():
            raise InvalidArgumentError("ckpt_slots", f"{rows.numel()} ids, as many as active_ids", slots.numel())
        va = self.spec.value_axis
        if self.codec == "int8":
            qdata, scale = self._temporal
            quant.validate_quantize_store(temporal, rows, qdata, scale, slots, va, check_ids=False)
        else:
            (data,) = self._temporal
            quant.validate_copy_rows(temporal, rows, data, slots, check_ids=False, names=("side", "data"))
        for c_src, c_dst in zip(convs, self.conv):
            quant.validate_copy_rows(c_src, rows, c_dst, slots, check_ids=False, names=("side", "conv"))
        self.stats["stores"] += rows.numel()
        self.stats["store_bytes"] += rows.numel() * self.slot_bytes
        if rows.numel() == 0:
            return
        fin = self.flags.arm(slots)
        if self.codec == "int8":
            quant.quantize_store(temporal, rows, qdata, scale, slots, va, backend=self.backend, check_ids=False,
                                 finite=fin)
        else:
            quant.copy_rows(temporal, rows, data, slots, backend=self.backend, check_ids=False, finite=fin)
        for c_src, c_dst in zip(convs, self.conv):
            quant.copy_rows(c_src, rows, c_dst, slots, backend=self.backend, check_ids=False, finite=fin)
        self.flags.sent(host_slots.tolist())

    def load_to_active(self, ckpt_slots: IdsLike, side: ActiveLike, active_ids: IdsLike) -> None:
        """Hit: dequantize (or copy) checkpoints ``ckpt_slots`` into the T0 states ``active_ids``.

        The checkpoints stay (copy-on-write); one slot may be loaded into several active states.
        ``side`` and ``active_ids`` as in ``store_from_active``; ``active_ids`` must be distinct.
        """
        slots, _ = self._checked_slots("ckpt_slots", ckpt_slots, unique=False)
        temporal, convs, rows = self._resolve_active(side, active_ids, unique=True)
        if rows.numel() != slots.numel():
            raise InvalidArgumentError("active_ids", f"{slots.numel()} ids, as many as ckpt_slots", rows.numel())
        va = self.spec.value_axis
        if self.codec == "int8":
            qdata, scale = self._temporal
            quant.validate_dequantize_load(qdata, scale, slots, temporal, rows, va, check_ids=False)
        else:
            (data,) = self._temporal
            quant.validate_copy_rows(data, slots, temporal, rows, check_ids=False, names=("data", "side"))
        for c_src, c_dst in zip(self.conv, convs):
            quant.validate_copy_rows(c_src, slots, c_dst, rows, check_ids=False, names=("conv", "side"))
        self.stats["loads"] += rows.numel()
        self.stats["load_bytes"] += rows.numel() * self.slot_bytes
        if rows.numel() == 0:
            return
        if self.codec == "int8":
            quant.dequantize_load(qdata, scale, slots, temporal, rows, va, backend=self.backend, check_ids=False)
        else:
            quant.copy_rows(data, slots, temporal, rows, backend=self.backend, check_ids=False)
        for c_src, c_dst in zip(self.conv, convs):
            quant.copy_rows(c_src, slots, c_dst, rows, backend=self.backend, check_ids=False)

    # ----------------------------------------------------------------------------- checks
    def _host_ids(self, name: str, ids: IdsLike) -> np.ndarray:
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype not in _INT_TORCH:
                raise InvalidTypeError(name, "a 1-D integer tensor", (ids.dtype, tuple(ids.shape)))
            return ids.detach().to("cpu", torch.int64).numpy()
        vals = int_list(name, ids)  # strings, floats, bools, None, nested sequences: InvalidTypeError
        if vals and (min(vals) < -2**63 or max(vals) >= 2**63):
            raise InvalidArgumentError(name, "ids in the int64 range", [v for v in vals if abs(v) >= 2**63][:16])
        return np.asarray(vals, dtype=np.int64)

    def _device_ids(self, name: str, ids: IdsLike) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            if ids.dim() != 1 or ids.dtype not in _INT_TORCH:
                raise InvalidTypeError(name, "a 1-D integer tensor", (ids.dtype, tuple(ids.shape)))
            if ids.device != self.device:
                raise InvalidArgumentError(name, f"a tensor on {self.device}", ids.device)
            return ids if ids.dtype in (torch.int32, torch.int64) else ids.to(torch.int64)
        return dev.host_to_device(torch.from_numpy(self._host_ids(name, ids)), self.device)

    def _checked_slots(self, name: str, ids: IdsLike, unique: bool) -> tuple[torch.Tensor, np.ndarray]:
        # Host ids (lists) are checked where they are and sent once, without blocking (pinned memory);
        # device tensors are read back for the check.
        if isinstance(ids, torch.Tensor):
            slots = self._device_ids(name, ids)
            host = slots.detach().to("cpu", torch.int64).numpy()
        else:
            host = self._host_ids(name, ids)
            slots = None
        out = host[(host < 1) | (host > self.num_slots)]
        if out.size:
            raise InvalidArgumentError(name, f"checkpoint slot ids in [1, {self.num_slots}]", out.tolist())
        unalloc = host[~self.allocator._allocated[host]]
        if unalloc.size:
            raise SlotStateError(name, "allocated checkpoint slots", unalloc.tolist())
        if unique and np.unique(host).size != host.size:
            raise InvalidArgumentError(name, "distinct destination slots", host.tolist())
        return slots if slots is not None else dev.host_to_device(torch.from_numpy(host), self.device), host

    def _resolve_active(self, side: ActiveLike, active_ids: IdsLike, unique: bool
                        ) -> tuple[torch.Tensor, Sequence[torch.Tensor], torch.Tensor]:
        """-> (temporal view, conv views, physical rows), all checked against the spec and device."""
        spec, n_conv = self.spec, len(self.spec.conv_shapes)
        host_ids = not isinstance(active_ids, torch.Tensor)
        ids = None if host_ids else self._device_ids("active_ids", active_ids)
        host: Optional[np.ndarray] = None
        if isinstance(side, StateSide):
            if side.spec != spec:
                raise InvalidArgumentError("side", f"a T0 side whose spec is {spec}", side.spec)
            temporal = side.temporal_view_all()
            convs: Sequence[torch.Tensor] = [side.conv_view_all(i) for i in range(n_conv)]
            what = "live virtual ids of the T0 side"  # translate maps a free id to -1
            # Translated on the host (the allocator's table): a device tensor is read back once, as its
            # rows would be for the range check.
            vids = self._host_ids("active_ids", active_ids)
            if vids.size and not vids.all():
                raise InvalidArgumentError("active_ids", "active state ids (slot 0 is the sink, never active)",
                                           vids.tolist())
            try:
                host = side.translate_host(vids)
            except InvalidArgumentError:
                raise InvalidArgumentError("active_ids", "virtual ids of the T0 side", vids.tolist()) from None
            host_ids = True
        elif isinstance(side, ActiveViews) or isinstance(side, torch.Tensor):
            temporal = side.temporal if isinstance(side, ActiveViews) else side
            convs = tuple(side.convs) if isinstance(side, ActiveViews) else ()
            what = "physical rows"
            if host_ids:
                host = self._host_ids("active_ids", active_ids)
        else:
            raise InvalidTypeError("side", "a T0 state side (StateSide), ActiveViews or a temporal tensor",
                                   type(side).__name__)
        self._check_view("side.temporal", temporal, spec.temporal_shape, spec.temporal_dtype)
        if len(convs) != n_conv:
            raise InvalidArgumentError("side", f"{n_conv} conv views (spec.conv_shapes)", len(convs))
        for i, c in enumerate(convs):
            self._check_view(f"side.convs[{i}]", c, spec.conv_shapes[i], spec.conv_dtype, temporal.shape[1])
        if host is None:  # physical rows given as a device tensor
            assert ids is not None
            rows = ids
            host = rows.detach().to("cpu", torch.int64).numpy()
        if host.size and (host.min() < 0 or host.max() >= temporal.shape[1]):
            raise InvalidArgumentError("active_ids", f"{what} (rows in [0, {temporal.shape[1]}))", host.tolist())
        if unique and np.unique(host).size != host.size:
            raise InvalidArgumentError("active_ids", "distinct destination states", host.tolist())
        if host_ids:
            rows = dev.host_to_device(torch.from_numpy(np.ascontiguousarray(host, dtype=np.int64)), self.device)
        return temporal, convs, rows

    def _check_view(self, name: str, t: object, inner: tuple[int, ...], dtype: torch.dtype,
                    rows: Optional[int] = None) -> None:
        if not isinstance(t, torch.Tensor):
            raise InvalidTypeError(name, "a tensor", type(t).__name__)
        want = (self.spec.num_layers, t.shape[1] if rows is None else rows, *inner) if t.dim() >= 2 else None
        if want is None or tuple(t.shape) != want:
            raise InvalidArgumentError(name, f"shape [L={self.spec.num_layers}, rows, *{inner}]", tuple(t.shape))
        if t.dtype != dtype:
            raise InvalidArgumentError(name, f"dtype {dtype}", t.dtype)
        if t.device != self.device:
            raise InvalidArgumentError(name, f"a tensor on {self.device}", t.device)

    def __repr__(self) -> str:
        return (f"Int8CheckpointPool({self.codec}, {self.num_slots} slots x {self.slot_bytes} B = "
                f"{self.nbytes / 2**20:.1f} MiB on {self.device}, {self.available_size()} free)")
