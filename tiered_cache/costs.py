"""FLOP and byte models of a hybrid model's prefill, from its geometry: the formulas, in one place.

What a cached prefix is worth is the compute it saves; what it costs is the bytes it holds. Both come
from the layer shapes alone, so the eviction policies (``radix.policies``) and the capacity
simulations (``benchmarks/bench_policy.py``) read them from here and nowhere else spells them out.

Counts are multiply-adds x 2 (a FLOP each), per layer, for ``n`` new tokens after ``ctx`` cached ones::

    attention  projections 2 n d (q + 2 kv) + 2 n q d        q = heads x head_dim (x2 when gated:
               scores+values 4 q (n ctx + n (n + 1) / 2)         Qwen3-Next's output gate), kv likewise
    Mamba2     in_proj 2 n d (2 di + 2 g N + nh)            di = expand x d (the expand factor is part
               conv 2 n k (di + 2 g N), scan 5 n di N,          of the SSM state, [nh, P, N] = di x N)
               out_proj 2 n di d
    GDN        in_proj 2 n d (2 qk + 2 v + 2 hv)            qk = key heads x d_k, v = value heads x d_v
               conv 2 n k (2 qk + v), delta rule 7 n hv d_k d_v, out_proj 2 n v d
    MLP        2 n d d_ff x matrices (2: up/down, 3: SwiGLU)
    MoE        router 2 n d E + (active + shared) x 3 x 2 n d d_expert

The scan counts the recurrent form (decay, outer-product update: 3 per state element; read-out: 2);
the delta rule per value head: decay 1, S^T k 2, rank-1 update 2, read-out 2 per state element.
Bytes: KV per token = attention layers x 2 x kv_heads x head_dim x the KV dtype; a state is the
mixer layers' recurrent states (native dtype) + their conv windows (``conv - 1`` positions); int8 (T1
and T2) keeps one byte per state element plus one scale (state dtype) per (head, key channel), conv
windows as they are (``tiers.checkpoint_pool``'s codec).
"""

from __future__ import annotations

import dataclasses
from typing import Union

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.validate import int_arg


@dataclasses.dataclass(frozen=True)
class Attention:
    heads: int
    kv_heads: int
    head_dim: int
    gated: bool = False  # an output gate from the q projection (Qwen3-Next): q's projection is doubled


@dataclasses.dataclass(frozen=True)
class Mamba2:
    d_state: int  # N
    expand: int = 2
    head_dim: int = 64  # P
    n_groups: int = 1
    conv: int = 4


@dataclasses.dataclass(frozen=True)
class GatedDeltaNet:
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv: int = 4


@dataclasses.dataclass(frozen=True)
class MLP:
    d_ff: int
    matrices: int = 2


@dataclasses.dataclass(frozen=True)
class MoE:
    experts: int
    active: int
    d_expert: int
    shared: int = 0  # shared experts of d_expert, always on


Mixer = Union[Mamba2, GatedDeltaNet]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """One hybrid model: ``attention_layers`` of ``attention``, ``mixer_layers`` of ``mixer`` (Mamba2 or
    gated delta-net) and ``mlp_layers`` of ``mlp``; dtype sizes in bytes."""

    name: str
    d_model: int
    attention: Attention
    attention_layers: int
    mixer: Mixer
    mixer_layers: int
    mlp: Union[MLP, MoE]
    mlp_layers: int
    kv_bytes: int = 2
    state_bytes_per_elem: int = 2
    conv_bytes: int = 2

    def __post_init__(self) -> None:
        int_arg("d_model", self.d_model, lo=1)
        for name in ("attention_layers", "mixer_layers", "mlp_layers"):
            int_arg(name, getattr(self, name), lo=0)
        if isinstance(self.mixer, Mamba2) and (self.mixer.expand * self.d_model) % self.mixer.head_dim:
            raise InvalidArgumentError("mixer", f"a Mamba2 whose head_dim divides expand x d_model "
                                       f"({self.mixer.expand * self.d_model})", self.mixer.head_dim)

    # ------------------------------------------------------------------------------ FLOPs per layer
    def attention_flops(self, n: int, ctx: int = 0) -> int:
        a, d = self.attention, self.d_model
        q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
        proj = 2 * n * d * (q * (2 if a.gated else 1) + 2 * kv) + 2 * n * q * d
        return proj + 2 * q * (2 * n * ctx + n * (n + 1))  # 4 q (n ctx + n (n + 1) / 2), kept integral

    def mixer_flops(self, n: int) -> int:
        m, d = self.mixer, self.d_model
        if isinstance(m, Mamba2):
            di = m.expand * d
            gn = 2 * m.n_groups * m.d_state
            return (2 * n * d * (2 * di + gn + di // m.head_dim) + 2 * n * m.conv * (di + gn)
                    + 5 * n * di * m.d_state + 2 * n * di * d)
        qk, v = m.key_heads * m.key_dim, m.value_heads * m.value_dim
        return (2 * n * d * (2 * qk + 2 * v + 2 * m.value_heads) + 2 * n * m.conv * (2 * qk + v)
                + 7 * n * m.value_heads * m.key_dim * m.value_dim + 2 * n * v * d)

    def mlp_flops(self, n: int) -> int:
        m, d = self.mlp, self.d_model
        if isinstance(m, MLP):
            return 2 * n * d * m.d_ff * m.matrices
        return 2 * n * d * m.experts + (m.active + m.shared) * 3 * 2 * n * d * m.d_expert

    # ------------------------------------------------------------------------------ totals
    def prefill_flops(self, n: int, ctx: int = 0) -> int:
        """FLOPs of prefilling ``n`` tokens after ``ctx`` cached ones (every layer)."""
        int_arg("n", n, lo=0)
        int_arg("ctx", ctx, lo=0)
        return (self.attention_layers * self.attention_flops(n, ctx) + self.mixer_layers * self.mixer_flops(n)
                + self.mlp_layers * self.mlp_flops(n))

    def saved_flops(self, start: int, end: int) -> int:
        """What a hit at prefix length ``end`` saves over one at ``start``: tokens ``[start, end)`` with the
        first ``start`` cached (their attention still reads all ``start`` keys)."""
        int_arg("start", start, lo=0)
        if end < start:
            raise InvalidArgumentError("end", f">= start ({start})", end)
        return self.prefill_flops(end - start, start)

    @property
    def kv_bytes_per_token(self) -> int:
        a = self.attention
        return self.attention_layers * 2 * a.kv_heads * a.head_dim * self.kv_bytes

    def _state_shape(self) -> tuple[int, int, int]:
        """-> (state elements per layer, (head, key channel) scales per layer, conv channels per layer)."""
        m = self.mixer
        if isinstance(m, Mamba2):
            di = m.expand * self.d_model
            nh = di // m.head_dim
            return di * m.d_state, nh * m.d_state, di + 2 * m.n_groups * m.d_state
        return (m.value_heads * m.key_dim * m.value_dim, m.value_heads * m.key_dim,
                2 * m.key_heads * m.key_dim + m.value_heads * m.value_dim)

    @property
    def state_bytes(self) -> int:
        """One cached state in its native dtype: every mixer layer's recurrent state + conv window."""
        elems, _, conv = self._state_shape()
        return self.mixer_layers * (elems * self.state_bytes_per_elem + conv * (self.mixer.conv - 1) * self.conv_bytes)

    @property
    def state_bytes_int8(self) -> int:
        """One state as T1 / T2 keep it under the int8 codec: 1 B per element + scales, conv as is."""
        elems, scales, conv = self._state_shape()
        per_layer = elems + self.state_bytes_per_elem * scales + conv * (self.mixer.conv - 1) * self.conv_bytes
        return self.mixer_layers * per_layer


# Qwen3-Next-80B-A3B: 48 layers (every 4th full attention, gated), a 512-expert MoE in every layer.
QWEN3_NEXT_80B = Geometry(
    "qwen3-next-80b", d_model=2048, attention=Attention(heads=16, kv_heads=2, head_dim=256, gated=True),
    attention_layers=12, mixer=GatedDeltaNet(key_heads=16, value_heads=32, key_dim=128, value_dim=128),
    mixer_layers=36, mlp=MoE(experts=512, active=10, d_expert=512, shared=1), mlp_layers=48,
    kv_bytes=2, state_bytes_per_elem=4, conv_bytes=2)
# Marconi's Attention-Mamba2 7B (arXiv 2411.19379): 24 Mamba2, 4 attention, 28 MLP layers, bf16 states.
MARCONI_7B = Geometry(
    "marconi-7b", d_model=4096, attention=Attention(heads=32, kv_heads=32, head_dim=128), attention_layers=4,
    mixer=Mamba2(d_state=128, expand=2, head_dim=64), mixer_layers=24, mlp=MLP(d_ff=4 * 4096), mlp_layers=28,
    kv_bytes=2, state_bytes_per_elem=2, conv_bytes=2)
GEOMETRIES = {g.name: g for g in (QWEN3_NEXT_80B, MARCONI_7B)}


def geometry(name: str) -> Geometry:
    """The geometry called ``name`` (one of ``GEOMETRIES``)."""
    if name not in GEOMETRIES:
        raise InvalidArgumentError("geometry", f"one of {', '.join(GEOMETRIES)}", name)
    return GEOMETRIES[name]
