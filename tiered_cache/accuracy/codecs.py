"""Torch twins of the state codecs measured on the recall models: what each does to a recurrent state, and
its bytes per state.

Every codec takes a state in the canonical layout ``[..., d_v, d_k]`` (``kernels._ref_quant``: the value
axis second to last; ``canonical`` transposes a gated delta-net state ``[..., d_k, d_v]`` there) and
returns it as a resume would see it: encoded, then decoded to the state's dtype. Scales are stored in
the state's dtype, as T1 stores them.

- ``int8``: T1's codec, one scale per (head, k-channel) over the ``d_v`` values (``_ref_quant``'s
  ``quantize_reference`` / ``dequantize_reference``: bit-exact with the Triton kernels);
- ``int8_g32``: int8 with one scale per 32 consecutive values of the value axis (``d_v / 32`` scales per
  k-channel: finer, more scale bytes);
- ``fp8_e4m3``: fp8 e4m3 (torch ``float8_e4m3fn``, max 448) with the same scale layout as ``int8``,
  ``amax / 448``: the same bytes, so the two compare at equal size;
- ``bf16``: a plain cast (what SGLang's ``mamba_ssm_dtype=bfloat16`` keeps), no scales;
- ``fp32``: the state as it is (T1's ``lossless`` codec for an fp32 state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.kernels._ref_quant import AMAX_EPS, dequantize_reference, quantize_reference

GROUP = 32
FP8_MAX = 448.0


@dataclass(frozen=True)
class Codec:
    name: str
    roundtrip: Callable[[torch.Tensor], torch.Tensor]  # canonical [..., d_v, d_k] -> decoded, same dtype
    bytes_per_element: float  # payload bytes per state element (scales not counted)
    scales_per_k_channel: Callable[[int], int]  # d_v -> scales stored per (head, k-channel)

    def state_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Bytes of one stored state of canonical ``shape`` ``[..., d_v, d_k]`` (payload + scales)."""
        d_v = shape[-2]
        n = 1
        for s in shape:
            n *= s
        lines = n // d_v  # (head, k-channel) lines, over every leading axis
        isz = torch.empty((), dtype=dtype).element_size()
        return int(n * self.bytes_per_element) + lines * self.scales_per_k_channel(d_v) * isz


def canonical(state: torch.Tensor, value_axis: int) -> torch.Tensor:
    """``[..., a, b]`` with the value axis at ``value_axis`` (1: ``a`` is d_v, 2: ``b`` is d_v, counted in a
    ``[H, a, b]`` state) -> the ``[..., d_v, d_k]`` view."""
    if value_axis not in (1, 2):
        raise InvalidArgumentError("value_axis", "1 or 2", value_axis)
    return state.transpose(-1, -2) if value_axis == 2 else state


def _int8(x: torch.Tensor) -> torch.Tensor:
    q, s = quantize_reference(x)
    return dequantize_reference(q, s, x.dtype)


def _int8_groups(x: torch.Tensor) -> torch.Tensor:
    d_v = x.shape[-2]
    if d_v % GROUP:
        raise InvalidArgumentError("state", f"d_v a multiple of {GROUP}", d_v)
    g = x.reshape(*x.shape[:-2], d_v // GROUP, GROUP, x.shape[-1])  # each group: [32, d_k], amax over the 32
    return _int8(g).reshape(x.shape)


def _fp8(x: torch.Tensor) -> torch.Tensor:
    f = x.to(torch.float32)
    amax = f.abs().amax(dim=-2, keepdim=True).clamp(min=AMAX_EPS)
    scale = (amax / amax.new_tensor(FP8_MAX)).to(x.dtype).to(torch.float32)
    q = (f / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale).to(x.dtype)


CODECS: dict[str, Codec] = {c.name: c for c in (
    Codec("int8", _int8, 1.0, lambda d_v: 1),
    Codec("int8_g32", _int8_groups, 1.0, lambda d_v: d_v // GROUP),
    Codec("fp8_e4m3", _fp8, 1.0, lambda d_v: 1),
    Codec("bf16", lambda x: x.to(torch.bfloat16).to(x.dtype), 2.0, lambda d_v: 0),
    Codec("fp32", lambda x: x.clone(), 4.0, lambda d_v: 0),
)}


def roundtrip(name: str, state: torch.Tensor, value_axis: int) -> torch.Tensor:
    """``state`` (any layout with its value axis at ``value_axis``) through codec ``name``, same layout."""
    if name not in CODECS:
        raise InvalidArgumentError("codec", f"one of {sorted(CODECS)}", name)
    out = CODECS[name].roundtrip(canonical(state, value_axis).contiguous())
    return canonical(out, value_axis)
