"""Frozen specs: what one slot of each kind of data holds, and its bytes.

A slot's bytes for all its layers are contiguous (envelope-major), so freeing one slot frees a
whole envelope the peer side of a ``UnifiedPool`` can grow into. Every field inside an envelope
starts on a ``ALIGN``-byte boundary, so typed views of any dtype can be cut from the raw bytes and
kernels may use 16-byte loads.

KV envelope of one page (``page_size`` tokens), layer-major inside the page::

    | L0 K [ps, H, D] | L0 V [ps, H, Dv] | L1 K | L1 V | ... |  (each field padded to ALIGN)

State envelope of one request, layer-major (no temporal field for a conv-only state)::

    | L0 temporal [H, a, b] | L0 conv0 [...] | L0 conv1 [...] | L1 temporal | ... |
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.validate import index_arg, int_arg

ALIGN = 16

FP8_DTYPES = tuple(
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp8 is stored as bytes (kernels and copies treat it as uint8); other dtypes as themselves."""
    return torch.uint8 if dtype in FP8_DTYPES else dtype


# Sizes above this are refused: no real layer has more, and byte counts of a slot (products of
# them) must stay exact ints far below what any buffer can hold.
MAX_DIM = 1 << 24


def _positive(name: str, value: int) -> None:
    int_arg(name, value, lo=1, hi=MAX_DIM)


def _shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    # a str is a sequence too ("44" would read as (4, 4)), and floats truncate: ints only
    if not isinstance(shape, (tuple, list)):
        raise InvalidTypeError(name, "a tuple of positive ints", shape)
    out = tuple(int_arg(name, s, lo=1, hi=MAX_DIM) for s in shape)
    if not out:
        raise InvalidArgumentError(name, "a non-empty tuple of positive ints", shape)
    return out


def _dtype(name: str, value: object) -> None:
    if not isinstance(value, torch.dtype):
        raise InvalidTypeError(name, "a real torch.dtype", value)
    if value.is_complex or value == torch.bool:
        raise InvalidArgumentError(name, "a real torch.dtype", value)


@dataclass(frozen=True)
class KVSpec:
    """Full-attention or sliding-window KV of ``num_layers`` layers.

    Per token and layer: K ``[kv_heads, head_dim]`` and V ``[kv_heads, v_head_dim]`` of ``dtype``.
    ``window`` is set for sliding-window layers (tokens needed before a position to resume there).
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    v_head_dim: int = 0  # 0: same as head_dim
    window: int = 0  # 0: full attention

    def __post_init__(self) -> None:
        # numpy ints are taken and stored as Python ints, so two equal specs compare and hash equal
        for name in ("num_layers", "kv_heads", "head_dim"):
            object.__setattr__(self, name, int_arg(name, getattr(self, name), lo=1, hi=MAX_DIM))
        v = int_arg("v_head_dim", self.v_head_dim, lo=0, hi=MAX_DIM)
        object.__setattr__(self, "v_head_dim", v or self.head_dim)
        _dtype("dtype", self.dtype)
        object.__setattr__(self, "window", int_arg("window", self.window, lo=0))

    @property
    def store_dtype(self) -> torch.dtype:
        return storage_dtype(self.dtype)

    @property
    def k_token_bytes(self) -> int:
        return self.kv_heads * self.head_dim * self.store_dtype.itemsize

    @property
    def v_token_bytes(self) -> int:
        return self.kv_heads * self.v_head_dim * self.store_dtype.itemsize

    def field_offsets(self, page_size: int) -> tuple[tuple[int, int], ...]:
        """Byte offset of (K, V) of each layer inside one page envelope."""
        _positive("page_size", page_size)
        k_bytes = align_up(page_size * self.k_token_bytes)
        v_bytes = align_up(page_size * self.v_token_bytes)
        return tuple((layer * (k_bytes + v_bytes), layer * (k_bytes + v_bytes) + k_bytes)
                     for layer in range(self.num_layers))

    def bytes_per_slot(self, page_size: int = 1) -> int:
        """Bytes of one page envelope (``page_size`` tokens, all layers)."""
        _positive("page_size", page_size)
        return self.num_layers * (align_up(page_size * self.k_token_bytes) + align_up(page_size * self.v_token_bytes))

    def bytes_per_token(self) -> int:
        """Payload bytes of one token over all layers (no padding)."""
        return self.num_layers * (self.k_token_bytes + self.v_token_bytes)

    def shard(self, tp: int) -> KVSpec:
        """One tensor-parallel rank's share of ``tp``: ``kv_heads // tp`` heads (``parallel.shard`` says
        which). A ``tp`` that does not divide ``kv_heads`` is a typed error naming it."""
        tp = _divisor("tp", tp, self.kv_heads, "kv_heads")
        return dataclasses.replace(self, kv_heads=self.kv_heads // tp)


@dataclass(frozen=True)
class StateSpec:
    """The recurrent state of one request over ``num_layers`` linear-attention layers.

    ``temporal_shape`` is the per-layer SSM state, 3-D ``[H, a, b]``; ``value_axis`` (1 or 2) names
    which of ``a``/``b`` is the value axis, the one the int8 scale reduces over:
    GDN/KDA in SGLang order ``[H, d_v, d_k]`` -> 1; transformers' Qwen3-Next ``[H, d_k, d_v]`` -> 2;
    Mamba2 ``[H, head_dim, d_state]`` -> 1 (head_dim plays d_v, d_state plays d_k).
    ``temporal_shape=()``: no temporal state, only conv windows (Lfm2's short-conv layers keep a window
    of the last tokens and nothing else); then at least one conv window, no field of 0 bytes in the
    envelope, and every codec keeps the windows in ``conv_dtype`` (int8 quantizes temporal states only).
    ``conv_shapes`` are the conv windows per layer (e.g. ``((conv_dim, kernel - 1),)``) at ``conv_dtype``.
    """

    num_layers: int
    temporal_shape: tuple[int, ...]
    temporal_dtype: torch.dtype = torch.float32
    conv_shapes: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    conv_dtype: torch.dtype = torch.bfloat16
    value_axis: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_layers", int_arg("num_layers", self.num_layers, lo=1, hi=MAX_DIM))
        none = isinstance(self.temporal_shape, (tuple, list)) and len(self.temporal_shape) == 0
        shape = () if none else _shape("temporal_shape", self.temporal_shape)
        if len(shape) not in (0, 3):
            raise InvalidArgumentError("temporal_shape", "3 dims [H, a, b], or () for none", self.temporal_shape)
        object.__setattr__(self, "temporal_shape", shape)
        if not isinstance(self.conv_shapes, (tuple, list)):
            raise InvalidTypeError("conv_shapes", "a tuple of shapes (tuples of positive ints)", self.conv_shapes)
        convs = tuple(_shape("conv_shapes", s) for s in self.conv_shapes)
        if none and not convs:
            raise InvalidArgumentError("conv_shapes", "at least one conv window (temporal_shape is (): none)", convs)
        object.__setattr__(self, "conv_shapes", convs)
        _dtype("temporal_dtype", self.temporal_dtype)
        if self.temporal_dtype not in STATE_DTYPES:
            raise InvalidArgumentError("temporal_dtype", "float32, bfloat16 or float16", self.temporal_dtype)
        _dtype("conv_dtype", self.conv_dtype)
        object.__setattr__(self, "value_axis", int_arg("value_axis", self.value_axis, lo=1, hi=2))

    @property
    def has_temporal(self) -> bool:
        """False for a state of conv windows only (``temporal_shape=()``)."""
        return bool(self.temporal_shape)

    def require_temporal(self) -> tuple[int, ...]:
        """``temporal_shape``, or a typed error for a conv-only spec (what needs a temporal state asks)."""
        if not self.temporal_shape:
            raise InvalidArgumentError("spec", "a StateSpec with a temporal state", "temporal_shape=() (conv only)")
        return self.temporal_shape

    @property
    def num_heads(self) -> int:
        return self.require_temporal()[0]

    @property
    def d_v(self) -> int:
        return self.require_temporal()[self.value_axis]

    @property
    def d_k(self) -> int:
        return self.require_temporal()[3 - self.value_axis]

    @property
    def temporal_bytes(self) -> int:
        return math.prod(self.temporal_shape) * self.temporal_dtype.itemsize if self.temporal_shape else 0

    def conv_bytes(self, i: int) -> int:
        i = index_arg("i", i, len(self.conv_shapes))
        return math.prod(self.conv_shapes[i]) * self.conv_dtype.itemsize

    def _layer_bytes(self) -> int:
        return align_up(self.temporal_bytes) + sum(align_up(self.conv_bytes(i)) for i in range(len(self.conv_shapes)))

    def field_offsets(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """Per layer: (temporal byte offset, (conv byte offsets...)) inside one envelope."""
        out = []
        for layer in range(self.num_layers):
            base = layer * self._layer_bytes()
            off = base + align_up(self.temporal_bytes)
            convs = []
            for i in range(len(self.conv_shapes)):
                convs.append(off)
                off += align_up(self.conv_bytes(i))
            out.append((base, tuple(convs)))
        return tuple(out)

    def bytes_per_slot(self, page_size: int = 1) -> int:
        """Bytes of one state envelope (all layers). ``page_size`` is ignored: one state per slot."""
        return self.num_layers * self._layer_bytes()

    def shard(self, tp: int) -> StateSpec:
        """One tensor-parallel rank's share of ``tp``: ``H // tp`` heads of the temporal state and
        ``channels // tp`` of each conv window (its first dim, the heads' channels). A ``tp`` that
        does not divide them is a typed error naming it and the dimension."""
        t = self.temporal_shape
        tp = int_arg("tp", tp, lo=1, hi=MAX_DIM)
        if t:
            _divisor("tp", tp, t[0], "state heads (temporal_shape[0])")
        for i, c in enumerate(self.conv_shapes):
            _divisor("tp", tp, c[0], f"conv channels (conv_shapes[{i}][0])")
        return dataclasses.replace(self, temporal_shape=(t[0] // tp, *t[1:]) if t else (),
                                   conv_shapes=tuple((c[0] // tp, *c[1:]) for c in self.conv_shapes))


def _divisor(name: str, tp: int, n: int, what: str) -> int:
    tp = int_arg(name, tp, lo=1, hi=MAX_DIM)
    if n % tp:
        raise InvalidArgumentError(name, f"a divisor of {what}={n}", tp)
    return tp
