"""Plain-torch twins of ``tiered_cache.kernels.quant`` (re-exported by ``kernels.reference``).

The int8 math of a T1 checkpoint, the reference the Triton kernels are bit-exact against:

- ``amax`` over the value axis in fp32, clamped to ``>= 1e-8``;
- ``scale = amax / 127`` rounded to the state dtype *before* dividing, so quantize and dequantize
  use the identical scale (and ``scale`` is stored in the state dtype);
- ``q = round_half_even(x_fp32 / scale_fp32)`` clamped to ``+-127``;
- dequantize: ``(q.float() * scale.float()).to(dtype)``.

One guard beyond that: an fp16 scale underflows to 0 when ``amax < ~7.6e-6`` (``1e-8 / 127`` is
below fp16's smallest subnormal), and ``x / 0`` is NaN. The rounded scale is therefore raised to the
dtype's smallest positive value (``MIN_SCALE``: fp16 ``2**-24``; fp32 and bf16 never reach it because
of the ``1e-8`` clamp, so their math is untouched). With that scale ``|x / scale| < 127`` still holds.

Finiteness flags (``finite``, optional, integers ``[slots]``): a store sets ``finite[dst]`` to ``mark`` (0 by
default) when any value it reads for that destination is NaN or +-inf, and leaves it otherwise (the caller
sets the flags of a store's slots to 1 first, or gives each store its own ``mark``: ``FiniteFlags``). A NaN
would spread through its int8 scale group, so such a state must never be served.

Canonical layout: ``[..., d_v, d_k]`` (value axis second to last). Stores take sources ``[L, R, H, a, b]``
with ``value_axis`` 1 (``a`` is d_v) or 2 (``b`` is d_v) and write ``qdata [L, S, H, d_v, d_k]``.
"""

from __future__ import annotations

from typing import Optional

import torch

from tiered_cache.validate import int_arg

__all__ = [
    "QMAX",
    "AMAX_EPS",
    "min_scale",
    "quantize_reference",
    "dequantize_reference",
    "quantize_store_reference",
    "dequantize_load_reference",
    "copy_rows_reference",
    "FLAG_DTYPES",
    "check_mark",
]

QMAX = 127
AMAX_EPS = 1e-8
# Dtypes whose copies are checked for NaN/inf (others, e.g. fp8 without an inf, are copied unchecked).
FLAG_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def min_scale(dtype: torch.dtype) -> float:
    """Smallest scale kept (see the module docstring): only fp16 can underflow to 0."""
    return 2.0**-24 if dtype == torch.float16 else 0.0


def quantize_reference(state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``state [..., d_v, d_k]`` (fp32/bf16/fp16) -> ``(q int8 [..., d_v, d_k], scale [..., 1, d_k])``."""
    x = state.to(torch.float32)
    amax = x.abs().amax(dim=-2, keepdim=True).clamp(min=AMAX_EPS)
    # Divide by a 0-dim tensor on the state's device, not the Python number: for a scalar divisor
    # PyTorch's CUDA kernel multiplies by the reciprocal (off by an ulp at times), and the math is
    # IEEE amax / 127 on every device, like the kernel's div_rn.
    scale = (amax / amax.new_tensor(float(QMAX))).to(state.dtype)
    floor = min_scale(state.dtype)
    if floor > 0.0:
        scale = scale.clamp(min=floor)
    # torch.round rounds half to even, as the kernel does (cvt.rni on the GPU, the fp32 add-subtract trick in the
    # interpreter); the clamp is a no-op but for fp16 scales (quant._codes).
    q = torch.round(x / scale.to(torch.float32)).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q [..., d_v, d_k]`` int8, ``scale [..., 1, d_k]`` -> state of ``dtype`` (math in fp32)."""
    return (q.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def _canonical(t: torch.Tensor, value_axis: int) -> torch.Tensor:
    # [L, R, H, a, b] -> [L, R, H, d_v, d_k] as a view: value_axis 2 means b is d_v.
    return t.transpose(3, 4) if value_axis == 2 else t


def check_mark(mark: int, finite: Optional[torch.Tensor]) -> int:
    """A store's ``mark`` as a plain int that ``finite``'s dtype holds (uint8: 0 to 255): a wider one would be
    truncated into another store's mark (the kernels cast it), so it is refused before anything is written;
    a 0-d tensor or a numpy int comes back as its int (a launch given the tensor itself would pass its
    pointer). Any ``mark`` goes without flags (it is not used: 0)."""
    if finite is None:
        return 0
    info = torch.iinfo(finite.dtype)
    return int_arg("mark", mark, lo=info.min, hi=info.max)


def _clear_nonfinite(finite: torch.Tensor, dst: torch.Tensor, values: torch.Tensor, mark: int = 0) -> None:
    """``finite[dst[i]] = mark`` unless ``all(isfinite(values[:, i]))``, for ``values [L, n, ...]``, on the
    device (no sync)."""
    if values.dtype not in FLAG_DTYPES:
        return
    ok = torch.isfinite(values).transpose(0, 1).reshape(values.shape[1], -1).all(dim=1)
    finite[dst] = torch.where(ok, finite[dst], torch.full_like(finite[dst], mark))


def quantize_store_reference(src: torch.Tensor, src_rows: torch.Tensor, qdata: torch.Tensor,
                             scale: torch.Tensor, dst_slots: torch.Tensor, value_axis: int = 1,
                             finite: Optional[torch.Tensor] = None, mark: int = 0) -> None:
    """Twin of ``quant.quantize_store``: quantize ``src[:, src_rows]`` into ``qdata/scale[:, dst_slots]``.

    ``src [L, R, H, a, b]``, ``qdata [L, S, H, d_v, d_k]`` int8, ``scale [L, S, H, 1, d_k]`` (src dtype);
    ``finite [S]``: set to ``mark`` for a slot whose state holds a NaN or an inf (see the module docstring);
    a ``mark`` the flags' dtype does not hold raises ``InvalidArgumentError`` (``check_mark``), nothing written.
    """
    mark = check_mark(mark, finite)
    state = _canonical(src, value_axis)[:, src_rows.long()]
    q, s = quantize_reference(state)
    slots = dst_slots.long()
    qdata[:, slots] = q
    scale[:, slots] = s
    if finite is not None:
        _clear_nonfinite(finite, slots, state, mark)


def dequantize_load_reference(qdata: torch.Tensor, scale: torch.Tensor, src_slots: torch.Tensor,
                              dst: torch.Tensor, dst_rows: torch.Tensor, value_axis: int = 1) -> None:
    """Twin of ``quant.dequantize_load``: dequantize ``qdata/scale[:, src_slots]`` into ``dst[:, dst_rows]``."""
    slots = src_slots.long()
    state = dequantize_reference(qdata[:, slots], scale[:, slots], dst.dtype)
    _canonical(dst, value_axis)[:, dst_rows.long()] = state


def copy_rows_reference(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor,
                        dst_rows: torch.Tensor, finite: Optional[torch.Tensor] = None, mark: int = 0) -> None:
    """Twin of ``quant.copy_rows``: ``dst[:, dst_rows] = src[:, src_rows]`` for ``[L, rows, ...]`` tensors;
    ``finite [dst rows]`` is set to ``mark`` for a destination row that received a NaN or an inf (a ``mark``
    the flags' dtype does not hold: ``check_mark``)."""
    mark = check_mark(mark, finite)
    vals = src[:, src_rows.long()]
    dst[:, dst_rows.long()] = vals
    if finite is not None:
        _clear_nonfinite(finite, dst_rows.long(), vals, mark)
