"""Fused int8 quantize-store and dequantize-load of recurrent states, plus the row copy for conv windows.

Twins: ``reference.quantize_store_reference``, ``reference.dequantize_load_reference``,
``reference.copy_rows_reference`` (defined in ``kernels/_ref_quant.py``, which also states the math).

Shapes (``[L, rows, ...]`` tensors may have any strides, e.g. ``UnifiedPool`` views whose slot and
layer strides are an envelope apart)::

    src/dst state  [L, R, H, a, b]   fp32 | bf16 | fp16; value_axis 1: a = d_v, 2: b = d_v
    qdata          [L, S, H, d_v, d_k]  int8
    scale          [L, S, H, 1,  d_k]   the state dtype (one per layer, slot, head, k-channel)

Bytes per call, N states of ``E = L*H*d_v*d_k`` elements of ``isz`` bytes:
store reads ``N*E*isz`` and writes ``N*E + N*L*H*d_k*isz``; load the reverse. One launch moves all
layers of all N states: grid ``(L*N*H, k-blocks)``; each program holds a whole ``[d_v, BLOCK_K]`` tile,
so the amax over the value axis is one in-register reduction and every byte is read once.
``value_axis == 2`` is a transposed view (swapped strides), so one kernel serves GDN and Mamba2 orders.

Portability notes (Triton interpreter on CPU, see docs/platform.md): rounding half-to-even is one ``cvt.rni`` on the GPU
and, in the interpreter, which has no libdevice, the fp32 trick ``(y + 1.5*2**23) - 1.5*2**23`` (exact for ``|y| <
2**22``; ``|y| <= 127`` here, clamped first); fp32 -> bf16 rounding is done on the bits in the interpreter, which
truncates (``cvt.rn`` on the GPU); there values are clamped before the float -> int8 cast, which wraps otherwise.
Triton's ``/`` on fp32 is the approximate ``div.full.f32`` on NVIDIA GPUs, and the int8 codes must be bit-exact with
IEEE ``x / scale``: the scale's ``amax / 127`` and ``x / scale`` are ``div_rn`` in the interpreter and correctly rounded
multiply-and-correct steps on the GPU (``_div127``, ``_quotients``); bf16 states, whose 8-bit significands leave room,
take cheaper steps there that give the same scales and codes, checked exhaustively (``_scale_of``, ``_reciprocal``,
``_quotients``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.kernels import launch, use_triton
from tiered_cache.kernels._ref_quant import (
    check_mark,
    copy_rows_reference,
    dequantize_load_reference,
    min_scale,
    quantize_store_reference,
)
from tiered_cache.specs import STATE_DTYPES

_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# Same-size integer dtypes: copies move bits, never values, so any dtype (fp8 too) copies exactly.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# GPU tiles (elements per program) and warps, swept on an H200 (36 x 32 x 128 x 128 states, 16 and 64
# a call, fp32 and bf16, both value axes): the store peaks at 8192 / 4 warps (fp32 3.7 TB/s; 4096: 2.4,
# 16384 / 8: 3.0), the load at 16384 / 8 warps (3.9 TB/s; 8192: 3.7, 4096: 2.7). Big tiles keep enough
# bytes in flight per SM; more warps on the store split its amax reduction over more shared memory.
_STORE_TILE, _STORE_WARPS = 8192, 4
# The two-pass store (``_quantize_store_stream_kernel``) per state dtype: (rows a step, k-channels a
# program, warps), or None for the one-pass kernel. The one-pass store of 2-byte states ran at 0.59 of a
# device copy on the H200 (as many elements a second as fp32: its registers bound the bytes in flight);
# bench_kernels.py --sweep measures both formulations there.
_STREAM_STORE: dict[torch.dtype, Optional[tuple[int, int, int]]] = {
    torch.float32: None, torch.bfloat16: None, torch.float16: None}
_LOAD_TILE, _LOAD_WARPS = 16384, 8
_COPY_TILE = 4096
# Exponent bits of the float dtypes whose copies are checked for NaN/inf (FLAG_DTYPES), read as integers.
_EXP_MASK = {torch.float32: 0x7F800000, torch.bfloat16: 0x7F80, torch.float16: 0x7C00,
             torch.float64: 0x7FF0000000000000}
# A move of at most PACKED states passes its ids as kernel arguments (``pack_ids``), not as device arrays: no
# host-to-device copy before the launch and no id buffer to guard after it (a T1 move of 1-16 states: an engine
# checkpoints one to a few states a step). Each argument holds one (source, destination) pair, ``src << 31 |
# dst`` above ``_PACK_MARK``, so every value is in Triton's 64-bit class (one compiled kernel per argument count).
PACKED = 16
_PACK_MARK = 1 << 62
_ID_LIMIT = 1 << 31
_PACK_COUNTS = (1, 2, 4, 8, 16)  # the compiled argument counts: a call of n states uses the least >= n
_MARKS = [(_PACK_MARK,) * (PACKED - n) for n in range(PACKED + 1)]  # the unused arguments after n pairs
_PARAMS = [f"P{i}" for i in range(PACKED)]  # the kernels' packed-id parameters, which never specialize
_NO_SPEC_MARK = [*_PARAMS, "MARK"]


def pack_ids(src: list[int], dst: list[int]) -> Optional[tuple[int, ...]]:
    """The ``PACKED`` kernel arguments of a move of ``src[i] -> dst[i]`` (host ints, as many, checked by the
    caller), or None where the move does not fit them (more than ``PACKED`` ids, or an id ``>= 2**31``). The
    arguments past ``len(src)`` repeat the marker: a kernel never reads them (they are past its ``N``)."""
    n = len(src)
    if n > PACKED:
        return None
    if n == 1:  # the commonest move (an engine checkpoints a state or two a step): no loop
        a, b = src[0], dst[0]
        return None if a >= _ID_LIMIT or b >= _ID_LIMIT else (_PACK_MARK | a << 31 | b, *_MARKS[1])
    if n and max(max(src), max(dst)) >= _ID_LIMIT:
        return None
    return (*[_PACK_MARK | a << 31 | b for a, b in zip(src, dst)], *_MARKS[n])


def _unpack(ids: tuple[int, ...], n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_ids``' arguments back to the id tensors (the torch twins' path)."""
    src = [(p >> 31) & (_ID_LIMIT - 1) for p in ids[:n]]
    dst = [p & (_ID_LIMIT - 1) for p in ids[:n]]
    return torch.tensor(src, dtype=torch.int64, device=device), torch.tensor(dst, dtype=torch.int64, device=device)


def _count(n: int) -> int:
    """The compiled argument count a packed call of ``n`` states uses."""
    for c in _PACK_COUNTS:
        if n <= c:
            return c
    raise AssertionError(n)  # pack_ids refuses more than PACKED


class _Launches:
    """A plan's bound launches: one per ``NA`` (0, ids from device arrays; else the packed argument count),
    bound on first use to the same fixed arguments, the varying ones named in ``vary`` (the ids, or the
    packed arguments in their place)."""

    def __init__(self, kernel, args: list, meta: dict, ids: tuple[str, str], tail: tuple[str, ...],
                 plain: tuple[str, ...]) -> None:
        self.kernel, self.args, self.meta, self.ids, self.tail, self.plain = kernel, args, meta, ids, tail, plain
        self.by_count: dict[int, launch.Bound] = {}

    def get(self, na: int) -> launch.Bound:
        b = self.by_count.get(na)
        if b is None:
            names = launch.param_names(self.kernel)
            args = list(self.args)
            if na:  # the id pointers are not read: bound to the first argument (one class, whatever the call)
                for name in self.ids:
                    args[names.index(name)] = self.args[0]
                vary, plain, fixed = (*_PARAMS, *self.tail), (*_PARAMS, *self.plain), PACKED
            else:
                vary, plain, fixed = (*self.ids, *self.tail), self.plain, 0
            # pack_ids' values are all in the 64-bit class: never keyed per call (``launch.Bound``'s fixed)
            b = self.by_count[na] = launch.Bound(self.kernel, args, {**self.meta, "NA": na}, vary, plain=plain,
                                                 fixed=fixed)
        return b



@triton.jit
def _to_fp32(x, FMA_DIV: tl.constexpr, KIND: tl.constexpr):
    """Loaded states -> fp32. bf16 on the GPU: a pair of bf16 in one 32-bit register becomes two fp32 by one
    shift (the low half) and one mask (the high half), where the compiler's widening spends a byte permute
    and a shift on the high half."""
    if FMA_DIV and KIND == 1 and x.numel >= 2:  # pairs: a one-element tile (d_v = d_k = 1) takes the cast
        x = tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                      dtype=tl.float32, is_pure=True, pack=2)
    else:
        x = x.to(tl.float32)
    return x


@triton.jit
def _round_to_dtype(x, KIND: tl.constexpr, CVT: tl.constexpr = False):
    """fp32 -> the nearest value of the state dtype (ties to even), still held in fp32. ``CVT`` (GPU only):
    the hardware's conversion (``cvt.rn``), one instruction; the interpreter's cast truncates."""
    if CVT and KIND != 0:
        x = x.to(tl.bfloat16 if KIND == 1 else tl.float16).to(tl.float32)
    elif KIND == 1:
        # bf16 is the top 16 bits of fp32: add half an ulp (plus the tie-to-even bit) and truncate.
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        x = ((b >> 16) << 16).to(tl.float32, bitcast=True)
    elif KIND == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


# RN(1/127) in fp32, 0x1.020408p-7: the exact reciprocal's nearest float (tests/kernels check it)
_RCP_127 = tl.constexpr(0.007874015718698502)


@triton.jit
def _div127(amax, FMA_DIV: tl.constexpr):
    """``amax / 127`` correctly rounded. On the GPU without a division: with ``y = RN(1/127)`` and ``q0 =
    RN(amax * y)``, ``q0 + y * fma(-q0, 127, amax)`` rounds to ``RN(amax / 127)`` (Markstein), checked for
    every fp32 ``amax`` from 1e-8 (the smallest the kernels pass) to the largest finite one; ``div_rn``'s
    range check and branch per channel cost more than the whole per-element math of a row. The
    interpreter, which has no exact fma, divides."""
    if FMA_DIV:
        q0 = amax * _RCP_127
        q = tl.fma(tl.fma(-q0, 127.0, amax), _RCP_127, q0)
    else:
        q = tl.math.div_rn(amax, 127.0)
    return q


@triton.jit
def _scale_of(amax, FMA_DIV: tl.constexpr, KIND: tl.constexpr):
    """A channel's scale: ``amax / 127`` correctly rounded (``_div127``), rounded to the state dtype, in fp32.
    bf16 states on the GPU: ``amax`` is a bf16 value (the largest ``|x|``) or the 1e-8 floor, and for every
    one of those (19,797) ``bf16(RN(amax * RN(1/127)))`` is ``bf16(RN(amax / 127))``
    (tests/kernels/test_bf16_codes.py checks them all): one multiply instead of the multiply and two fmas."""
    if FMA_DIV and KIND == 1:
        q = amax * _RCP_127
    else:
        q = _div127(amax, FMA_DIV)
    return _round_to_dtype(q, KIND, FMA_DIV)


@triton.jit
def _reciprocal(scale, FMA_DIV: tl.constexpr, KIND: tl.constexpr):
    """Per k-channel: what ``_quotients`` multiplies by, ``(hi, lo)``. fp32 and fp16 states on the GPU: ``hi =
    RN(1 / scale)`` (``div_rn``), ``lo`` unused. bf16 states on the GPU: ``hi`` the hardware's approximate
    reciprocal (``rcp.approx``, within 1 ulp) and ``lo = RN(fma(-scale, hi, 1) * hi)``, the rest of ``1 /
    scale``: ``hi + lo`` is ``1 / scale`` to ~2**-46, and ``div_rn``'s range check and slow-path branch, the
    costliest per-channel step, are gone (the scale is a normal number: ``amax >= 1e-8``)."""
    if not FMA_DIV:  # the interpreter divides (``_quotients``)
        hi = scale
        lo = scale
    elif KIND == 1:
        hi = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [scale], dtype=tl.float32,
                                       is_pure=True, pack=1)
        lo = tl.fma(-scale, hi, 1.0) * hi
    else:
        hi = tl.math.div_rn(1.0, scale)
        lo = hi
    return hi, lo


@triton.jit
def _quotients(x, scale, hi, lo, FMA_DIV: tl.constexpr, KIND: tl.constexpr):
    """``x / scale`` for ``_codes``: ``x [rows, BLOCK_K]``, the per-channel ``scale`` and ``(hi, lo)`` (from
    ``_reciprocal``) ``[BLOCK_K]``.

    - fp32 and fp16 states on the GPU: ``RN(x / scale)`` without a per-element division (Markstein): with
      ``hi = RN(1/s)`` and ``q0 = RN(x * hi)`` within an ulp, ``q0 + hi * fma(-q0, s, x)`` rounds to ``RN(x /
      s)``: the store runs ~1.5x faster on an H200 and stays bit-exact (checked on 4e8 random and near-tie
      cases against IEEE division, and by the GPU tests).
    - bf16 states on the GPU: ``fma(x, hi, RN(x * lo))``, one multiply and one fma, not always ``RN(x / s)`` but
      always the same code. x and s have 8 significant bits, so ``x / s`` is a half-integer exactly (a tie) or at least
      2**-11 from every half-integer where ``|x / s| <= 128``; before its one rounding the two-float product is within
      2**-35 of ``x / s``, so it lands on the tie exactly and, elsewhere, on the same side as IEEE division (ulp 2**-16
      at 128). Checked exhaustively, once, by the steps of tests/kernels/test_bf16_codes.py (which run 5 binades at 1
      ulp each time): every bf16 ``amax >= 1e-8``, every bf16 ``x`` with ``|x| <= amax`` (9.0e8 pairs), every ``hi``
      within 3 ulps of ``RN(1 / s)``: no code differs from ``rint(RN(x / s))``; with ``lo = 0`` (the product alone)
      2,170 ties differ. It needs subnormals kept: ``lo`` is subnormal for scales above ~2**103, and flushed, ties of
      amaxes above ~1e33 differ. Triton's fp32 multiply and fma keep them (sm_90's FMUL / FFMA here carry no ``.FTZ``);
      the GPU test stores such amaxes.
    - The interpreter, which has no exact fma (numpy), divides."""
    scale = tl.broadcast_to(scale[None, :], x.shape)
    hi = tl.broadcast_to(hi[None, :], x.shape)
    lo = tl.broadcast_to(lo[None, :], x.shape)
    if FMA_DIV:
        if KIND == 1:
            y = tl.fma(x, hi, x * lo)
        else:
            q0 = x * hi
            y = tl.fma(tl.fma(-q0, scale, x), hi, q0)
    else:
        y = tl.math.div_rn(x, scale)
    return y


@triton.jit
def _codes(y, FMA_DIV: tl.constexpr, KIND: tl.constexpr):
    """``x / scale`` (``y``) -> its int8 code: rounded half to even within +-127 (clamped where it could
    pass them, see below; clamping first gives the same codes as rounding first: both bounds are integers
    and rounding is monotone). On the GPU
    (``FMA_DIV``) one ``cvt.rni`` rounds and converts; the interpreter, which lacks it, adds and subtracts
    ``1.5 * 2**23`` (exact for ``|y| < 2**22``) and converts the integral value. fp32 and bf16 states skip the
    clamp on the GPU: there ``y = RN(x / scale)`` (correctly rounded; bf16: within an ulp of ``x / scale``,
    see ``_quotients``) and the scale is ``amax / 127`` rounded to
    nearest in fp32 or bf16 (24 or 8 significant bits: never a subnormal above the 1e-8 amax floor), so
    ``|y| <= 127 / (1 - 2**-8) = 127.498...``, which rounds to 127. An fp16 scale can be subnormal (11 bits
    at most, fewer below 2**-14), so ``|y|`` can pass 127.5 there and keeps the clamp."""
    if FMA_DIV:
        if KIND == 2:
            y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        code = libdevice.float2int_rn(y).to(tl.int8)
    else:
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        code = ((y + 12582912.0) - 12582912.0).to(tl.int8)
    return code


@triton.jit
def _pair(n, src_ids_ptr, dst_ids_ptr,
          P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15, NA: tl.constexpr):
    """State ``n``'s source and destination ids (int64): from the id arrays (``NA == 0``), or picked from the
    ``NA`` packed arguments ``P0 ...`` (``pack_ids``: ``src << 31 | dst`` above a marker bit), so a move of a
    few states needs no id copy to the device before its launch."""
    if NA == 0:
        a = tl.load(src_ids_ptr + n).to(tl.int64)
        b = tl.load(dst_ids_ptr + n).to(tl.int64)
    else:
        p = P0 + tl.zeros((), dtype=tl.int64)
        if NA > 1:
            p = tl.where(n == 1, P1, p)
        if NA > 2:
            p = tl.where(n == 2, P2, p)
        if NA > 3:
            p = tl.where(n == 3, P3, p)
        if NA > 4:
            p = tl.where(n == 4, P4, p)
        if NA > 5:
            p = tl.where(n == 5, P5, p)
        if NA > 6:
            p = tl.where(n == 6, P6, p)
        if NA > 7:
            p = tl.where(n == 7, P7, p)
        if NA > 8:
            p = tl.where(n == 8, P8, p)
        if NA > 9:
            p = tl.where(n == 9, P9, p)
        if NA > 10:
            p = tl.where(n == 10, P10, p)
        if NA > 11:
            p = tl.where(n == 11, P11, p)
        if NA > 12:
            p = tl.where(n == 12, P12, p)
        if NA > 13:
            p = tl.where(n == 13, P13, p)
        if NA > 14:
            p = tl.where(n == 14, P14, p)
        if NA > 15:
            p = tl.where(n == 15, P15, p)
        a = (p >> 31) & 0x7FFFFFFF
        b = p & 0x7FFFFFFF
    return a, b


@triton.jit
def _non_finite(amax):
    """Whether a NaN-keeping amax ``[BLOCK_K]`` (each ``>= 0`` or NaN, the NaN's sign bit clear: it comes
    from ``|x|``) holds a NaN or an inf: its largest bit pattern as an int32 reaches the exponent mask. One
    integer max over the block (a warp's is one ``redux`` on sm_90), where a per-channel ``amax - amax != 0``
    took three instructions a channel, repeated by every thread that shares the channel."""
    return tl.max(amax.to(tl.int32, bitcast=True), axis=0) >= 0x7F800000


@triton.jit
def _mark(MARK, fin_ptr):
    """The value a non-finite store writes into its slot's flag: ``MARK`` in the flags' dtype."""
    return (tl.zeros((), dtype=tl.int64) + MARK).to(fin_ptr.dtype.element_ty)


@triton.jit
def _head_state_layer(H, N):
    """Program ``(layer * N + n) * H + h`` of axis 0 -> ``(h, n, layer)``, int64 for the address math: two
    unsigned 32-bit divisions (axis 0 has fewer than 2**31 programs), where ``%`` and ``//`` on int64 took
    three signed ones (~20 instructions each, once per program)."""
    pid = tl.program_id(0).to(tl.uint32)
    t = pid // tl.cast(H, tl.uint32)  # tl.cast: Triton passes an int argument equal to 1 as a plain constant
    layer = t // tl.cast(N, tl.uint32)
    return (pid - t * H).to(tl.int64), (t - layer * N).to(tl.int64), layer.to(tl.int64)


@triton.jit(do_not_specialize=_NO_SPEC_MARK)
def _quantize_store_kernel(src_ptr, rows_ptr, q_ptr, s_ptr, slots_ptr, fin_ptr, MARK, N, H, D_V, D_K,
                           P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                           s_l, s_r, s_h, s_v, s_k,
                           q_l, q_s, q_h, q_v, q_k,
                           c_l, c_s, c_h, c_k,
                           BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, KIND: tl.constexpr,
                           MIN_SCALE: tl.constexpr, FMA_DIV: tl.constexpr, EVEN: tl.constexpr,
                           FLAG: tl.constexpr, NA: tl.constexpr):
    # Heads innermost: neighbouring programs read neighbouring bytes of one state's envelope.
    h, n, layer = _head_state_layer(H, N)
    row, slot = _pair(n, rows_ptr, slots_ptr, P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15, NA)
    offs_v = tl.arange(0, BLOCK_V)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < D_K
    mask = (offs_v[:, None] < D_V) & mask_k[None, :]
    src = src_ptr + layer * s_l + row * s_r + h * s_h
    # Upcast right after the load: all math in fp32 (bf16 arithmetic is wrong in the interpreter).
    src = src + offs_v[:, None] * s_v + offs_k[None, :] * s_k
    if EVEN:  # the tile covers d_v and divides d_k: no masks, so every access is a full-width vector
        x = _to_fp32(tl.load(src), FMA_DIV, KIND)
    else:
        x = _to_fp32(tl.load(src, mask=mask, other=0.0), FMA_DIV, KIND)
    if FLAG:
        # A NaN-keeping amax: a NaN or inf anywhere in a column shows in the column's amax, so the check is
        # one per block of columns (``_non_finite``), not one per element (that cost ~14 % of the store's
        # instructions on sm_90). A flagged slot's codes are not the twin's; a finite slot's are.
        amax = tl.reduce(tl.abs(x), 0, _max_nan)
        tl.store(fin_ptr + slot, _mark(MARK, fin_ptr), mask=_non_finite(amax))
        amax = tl.maximum(amax, 1e-8)
    else:
        amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-8)
    scale = _scale_of(amax, FMA_DIV, KIND)
    if MIN_SCALE > 0.0:
        scale = tl.maximum(scale, MIN_SCALE)
    hi, lo = _reciprocal(scale, FMA_DIV, KIND)
    y = _quotients(x, scale, hi, lo, FMA_DIV, KIND)
    code = _codes(y, FMA_DIV, KIND)
    q_dst = q_ptr + layer * q_l + slot * q_s + h * q_h
    q_dst = q_dst + offs_v[:, None] * q_v + offs_k[None, :] * q_k
    s_dst = s_ptr + layer * c_l + slot * c_s + h * c_h + offs_k * c_k
    if EVEN:
        tl.store(q_dst, code)
        tl.store(s_dst, scale.to(s_ptr.dtype.element_ty))
    else:
        tl.store(q_dst, code, mask=mask)
        tl.store(s_dst, scale.to(s_ptr.dtype.element_ty), mask=mask_k)


@triton.jit
def _max_nan(a, b):
    """``max`` that keeps NaN (the hardware max drops it): a non-finite input then shows in the amax."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit(do_not_specialize=_NO_SPEC_MARK)
def _quantize_store_stream_kernel(src_ptr, rows_ptr, q_ptr, s_ptr, slots_ptr, fin_ptr, MARK, N, H, D_V, D_K,
                                  P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                                  s_l, s_r, s_h, s_v, s_k,
                                  q_l, q_s, q_h, q_v, q_k,
                                  c_l, c_s, c_h, c_k,
                                  SUB_V: tl.constexpr, BLOCK_K: tl.constexpr, KIND: tl.constexpr,
                                  MIN_SCALE: tl.constexpr, FMA_DIV: tl.constexpr, EVEN: tl.constexpr,
                                  FLAG: tl.constexpr, NA: tl.constexpr):
    """The store in two passes over a ``[d_v, BLOCK_K]`` column block, ``SUB_V`` rows a step: the amax
    first (only ``BLOCK_K`` running maxima live), then the codes from a second read, which the L2 cache
    serves. Few registers per element, so many programs per SM keep many bytes in flight: the one-pass
    kernel holds its whole tile in registers and, with 2-byte states, half the bytes per SM. The math is
    the one-pass kernel's, step for step: the codes are bit-identical. Non-finite inputs show as a NaN
    or inf amax of their column (NaN-keeping max), which marks the slot's flag."""
    h, n, layer = _head_state_layer(H, N)
    row, slot = _pair(n, rows_ptr, slots_ptr, P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15, NA)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < D_K
    src = src_ptr + layer * s_l + row * s_r + h * s_h + offs_k[None, :] * s_k
    q_dst = q_ptr + layer * q_l + slot * q_s + h * q_h + offs_k[None, :] * q_k
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for v0 in range(0, D_V, SUB_V):
        offs_v = v0 + tl.arange(0, SUB_V)
        if EVEN:
            x = _to_fp32(tl.load(src + offs_v[:, None] * s_v), FMA_DIV, KIND)
        else:
            m = (offs_v[:, None] < D_V) & mask_k[None, :]
            x = _to_fp32(tl.load(src + offs_v[:, None] * s_v, mask=m, other=0.0), FMA_DIV, KIND)
        amax = _max_nan(amax, tl.reduce(tl.abs(x), 0, _max_nan))
    if FLAG:
        tl.store(fin_ptr + slot, _mark(MARK, fin_ptr), mask=_non_finite(amax))  # NaN or inf in some column
    amax = tl.maximum(amax, 1e-8)
    scale = _scale_of(amax, FMA_DIV, KIND)
    if MIN_SCALE > 0.0:
        scale = tl.maximum(scale, MIN_SCALE)
    s_dst = s_ptr + layer * c_l + slot * c_s + h * c_h + offs_k * c_k
    if EVEN:
        tl.store(s_dst, scale.to(s_ptr.dtype.element_ty))
    else:
        tl.store(s_dst, scale.to(s_ptr.dtype.element_ty), mask=mask_k)
    hi, lo = _reciprocal(scale, FMA_DIV, KIND)
    for v0 in range(0, D_V, SUB_V):
        offs_v = v0 + tl.arange(0, SUB_V)
        if EVEN:
            x = _to_fp32(tl.load(src + offs_v[:, None] * s_v), FMA_DIV, KIND)
        else:
            m = (offs_v[:, None] < D_V) & mask_k[None, :]
            x = _to_fp32(tl.load(src + offs_v[:, None] * s_v, mask=m, other=0.0), FMA_DIV, KIND)
        y = _quotients(x, scale, hi, lo, FMA_DIV, KIND)
        if EVEN:
            tl.store(q_dst + offs_v[:, None] * q_v, _codes(y, FMA_DIV, KIND))
        else:
            tl.store(q_dst + offs_v[:, None] * q_v, _codes(y, FMA_DIV, KIND), mask=m)


@triton.jit(do_not_specialize=_PARAMS)
def _dequantize_load_kernel(q_ptr, s_ptr, slots_ptr, dst_ptr, rows_ptr, N, H, D_V, D_K,
                            P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                            q_l, q_s, q_h, q_v, q_k,
                            c_l, c_s, c_h, c_k,
                            d_l, d_r, d_h, d_v, d_k,
                            BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, KIND: tl.constexpr, EVEN: tl.constexpr,
                            NA: tl.constexpr):
    h, n, layer = _head_state_layer(H, N)
    slot, row = _pair(n, slots_ptr, rows_ptr, P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15, NA)
    offs_v = tl.arange(0, BLOCK_V)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_k = offs_k < D_K
    mask = (offs_v[:, None] < D_V) & mask_k[None, :]
    q_src = q_ptr + layer * q_l + slot * q_s + h * q_h + offs_v[:, None] * q_v + offs_k[None, :] * q_k
    s_src = s_ptr + layer * c_l + slot * c_s + h * c_h + offs_k * c_k
    if EVEN:
        q = tl.load(q_src).to(tl.float32)
        scale = tl.load(s_src).to(tl.float32)
    else:
        q = tl.load(q_src, mask=mask, other=0).to(tl.float32)
        scale = tl.load(s_src, mask=mask_k, other=0.0).to(tl.float32)
    out = _round_to_dtype(q * tl.broadcast_to(scale[None, :], (BLOCK_V, BLOCK_K)), KIND)
    out = out.to(dst_ptr.dtype.element_ty)
    dst = dst_ptr + layer * d_l + row * d_r + h * d_h + offs_v[:, None] * d_v + offs_k[None, :] * d_k
    if EVEN:
        tl.store(dst, out)
    else:
        tl.store(dst, out, mask=mask)


@triton.jit(do_not_specialize=_NO_SPEC_MARK)
def _copy_rows_kernel(src_ptr, rows_ptr, dst_ptr, slots_ptr, fin_ptr, MARK, N, C, s_l, s_r, d_l, d_r, CB,
                      P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                      BLOCK: tl.constexpr, EXP_MASK: tl.constexpr, NA: tl.constexpr):
    """``copy_rows``: program (layer * N + n, blk) copies one ``BLOCK`` of one (layer, row), the body the
    conv-window copy of a store or load launch shares (``_conv_rows``)."""
    _conv_rows(tl.program_id(0).to(tl.int64) * CB + tl.program_id(1), rows_ptr, slots_ptr, src_ptr, dst_ptr, fin_ptr,
               MARK, N, C, s_l, s_r, d_l, d_r, CB,
               P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15, BLOCK, EXP_MASK, NA)


@triton.jit
def _conv_rows(p, src_ids_ptr, dst_ids_ptr, src_ptr, dst_ptr, fin_ptr, MARK, N, C, s_l, s_r, d_l, d_r, CB,
               P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
               BLOCK: tl.constexpr, EXP_MASK: tl.constexpr, NA: tl.constexpr):
    """Block ``p`` of a row copy (``copy_rows``, and the conv-window copy that rides along a store or load
    launch), one ``BLOCK`` of one (layer, state) row per program: ``dst[layer, dst_ids[n]] = src[layer,
    src_ids[n]]``, bits; with ``EXP_MASK`` a NaN / inf sets ``fin[dst_ids[n]]`` to ``MARK``."""
    p = p.to(tl.int64)
    blk = p % CB
    n = (p // CB) % N
    layer = p // (CB * N)
    src_id, dst_id = _pair(n, src_ids_ptr, dst_ids_ptr,
                           P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15, NA)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < C
    vals = tl.load(src_ptr + layer * s_l + src_id * s_r + offs, mask=mask, other=0)
    tl.store(dst_ptr + layer * d_l + dst_id * d_r + offs, vals, mask=mask)
    if EXP_MASK != 0:
        bad = tl.max(((vals & EXP_MASK) == EXP_MASK).to(tl.int32), axis=0)
        tl.store(fin_ptr + dst_id, _mark(MARK, fin_ptr), mask=bad > 0)


@triton.jit(do_not_specialize=_NO_SPEC_MARK)
def _store_with_conv_kernel(src_ptr, rows_ptr, q_ptr, s_ptr, slots_ptr, fin_ptr, MARK, N, H, D_V, D_K,
                            P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                            s_l, s_r, s_h, s_v, s_k, q_l, q_s, q_h, q_v, q_k, c_l, c_s, c_h, c_k,
                            cv_src, cv_dst, C, cv_sl, cv_sr, cv_dl, cv_dr, CB, QP,
                            BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, KIND: tl.constexpr,
                            MIN_SCALE: tl.constexpr, FMA_DIV: tl.constexpr, EVEN: tl.constexpr, FLAG: tl.constexpr,
                            STREAM: tl.constexpr, CONV_BLOCK: tl.constexpr, CONV_MASK: tl.constexpr,
                            NA: tl.constexpr):
    """One launch for a whole store: programs ``< QP`` quantize the temporal state (the one-pass kernel,
    or with ``STREAM`` the two-pass one, ``BLOCK_V`` then being its rows a step), the rest copy the conv
    window. One launch instead of two: each costs tens of microseconds of host time."""
    if tl.program_id(0) < QP:
        if STREAM:
            _quantize_store_stream_kernel(src_ptr, rows_ptr, q_ptr, s_ptr, slots_ptr, fin_ptr, MARK, N, H, D_V, D_K,
                                          P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                                          s_l, s_r, s_h, s_v, s_k, q_l, q_s, q_h, q_v, q_k, c_l, c_s, c_h, c_k,
                                          BLOCK_V, BLOCK_K, KIND, MIN_SCALE, FMA_DIV, EVEN, FLAG, NA)
        else:
            _quantize_store_kernel(src_ptr, rows_ptr, q_ptr, s_ptr, slots_ptr, fin_ptr, MARK, N, H, D_V, D_K,
                                   P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                                   s_l, s_r, s_h, s_v, s_k, q_l, q_s, q_h, q_v, q_k, c_l, c_s, c_h, c_k,
                                   BLOCK_V, BLOCK_K, KIND, MIN_SCALE, FMA_DIV, EVEN, FLAG, NA)
    elif tl.program_id(1) == 0:
        _conv_rows(tl.program_id(0) - QP, rows_ptr, slots_ptr, cv_src, cv_dst, fin_ptr, MARK, N, C, cv_sl, cv_sr,
                   cv_dl, cv_dr, CB, P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                   CONV_BLOCK, CONV_MASK, NA)


@triton.jit(do_not_specialize=_PARAMS)
def _load_with_conv_kernel(q_ptr, s_ptr, slots_ptr, dst_ptr, rows_ptr, N, H, D_V, D_K,
                           P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                           q_l, q_s, q_h, q_v, q_k, c_l, c_s, c_h, c_k, d_l, d_r, d_h, d_v, d_k,
                           cv_src, cv_dst, C, cv_sl, cv_sr, cv_dl, cv_dr, CB, QP,
                           BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, KIND: tl.constexpr, EVEN: tl.constexpr,
                           CONV_BLOCK: tl.constexpr, NA: tl.constexpr):
    """One launch for a whole load: the dequantize, and the conv window copied back."""
    if tl.program_id(0) < QP:
        _dequantize_load_kernel(q_ptr, s_ptr, slots_ptr, dst_ptr, rows_ptr, N, H, D_V, D_K,
                                P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                                q_l, q_s, q_h, q_v, q_k, c_l, c_s, c_h, c_k, d_l, d_r, d_h, d_v, d_k,
                                BLOCK_V, BLOCK_K, KIND, EVEN, NA)
    elif tl.program_id(1) == 0:
        _conv_rows(tl.program_id(0) - QP, slots_ptr, rows_ptr, cv_src, cv_dst, dst_ptr, 0, N, C, cv_sl, cv_sr,
                   cv_dl, cv_dr, CB, P0, P1, P2, P3, P4, P5, P6, P7, P8, P9, P10, P11, P12, P13, P14, P15,
                   CONV_BLOCK, 0, NA)


# ---------------------------------------------------------------------------------------------
# Validation (no launch, no sync unless check_ids): the pool runs every check of a call before the
# first write, so a bad argument leaves nothing half written.
# ---------------------------------------------------------------------------------------------

def _tensor(name: str, t: object, dim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != dim:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise InvalidArgumentError(name, f"a {dim}-D tensor", got)
    return t


def _ids(name: str, ids: object, device: torch.device) -> torch.Tensor:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError(name, "a 1-D int32/int64 tensor", getattr(ids, "dtype", type(ids).__name__))
    if ids.device != device:
        raise InvalidArgumentError(name, f"a tensor on {device}", ids.device)
    return ids


def _writable(name: str, t: torch.Tensor) -> None:
    # A zero (or negative) stride on a dim of size > 1 makes programs race on one address.
    if any(st <= 0 and sz > 1 for st, sz in zip(t.stride(), t.shape)):
        raise InvalidArgumentError(name, "a view with positive strides (no expanded dims)", t.stride())


def check_id_values(name: str, ids: torch.Tensor, limit: int, unique: bool, low: int = 0) -> None:
    """Ids in ``[low, limit)`` and, for destinations, distinct. Reads the ids back (a sync on CUDA)."""
    if ids.numel() == 0:
        return
    host = ids.detach().to("cpu", torch.int64)
    lo, hi = int(host.min()), int(host.max())
    if lo < low or hi >= limit:
        raise InvalidArgumentError(name, f"ids in [{low}, {limit})", (lo, hi))
    if unique and torch.unique(host).numel() != host.numel():
        raise InvalidArgumentError(name, "distinct destination ids", host.tolist())


def _canonical(name: str, t: torch.Tensor, value_axis: int) -> torch.Tensor:
    _tensor(name, t, 5)
    if t.dtype not in STATE_DTYPES:
        raise InvalidArgumentError(name, "float32, bfloat16 or float16", t.dtype)
    return t.transpose(3, 4) if value_axis == 2 else t


def _check_codes(state: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> None:
    """qdata/scale shapes against a canonical ``[L, R, H, d_v, d_k]`` state view."""
    L, _, H, dv, dk = state.shape
    _tensor("qdata", qdata, 5)
    _tensor("scale", scale, 5)
    if qdata.dtype != torch.int8:
        raise InvalidArgumentError("qdata", "int8", qdata.dtype)
    if scale.dtype != state.dtype:
        raise InvalidArgumentError("scale", f"the state dtype {state.dtype}", scale.dtype)
    S = qdata.shape[1]
    if tuple(qdata.shape) != (L, S, H, dv, dk):
        raise InvalidArgumentError("qdata", f"shape [L={L}, S, H={H}, d_v={dv}, d_k={dk}]", tuple(qdata.shape))
    if tuple(scale.shape) != (L, S, H, 1, dk):
        raise InvalidArgumentError("scale", f"shape [{L}, {S}, {H}, 1, {dk}]", tuple(scale.shape))
    for name, t in (("qdata", qdata), ("scale", scale)):
        if t.device != state.device:
            raise InvalidArgumentError(name, f"a tensor on {state.device}", t.device)


def _check_flags(finite: object, rows: int, device: torch.device) -> None:
    """``finite``: None, or a 1-D uint8 or int64 tensor on ``device`` (or, on a GPU, in page-locked host memory)
    with one flag per destination row."""
    if finite is None:
        return
    if not isinstance(finite, torch.Tensor) or finite.dim() != 1 or finite.dtype not in (torch.uint8, torch.int64):
        raise InvalidTypeError("finite", "a 1-D uint8 or int64 tensor of flags",
                               getattr(finite, "dtype", type(finite).__name__))
    # on a GPU, flags in page-locked host memory too: the kernels write them through its mapping
    where = finite.device == device or (device.type == "cuda" and finite.is_pinned())
    if not where or finite.numel() < rows or finite.stride(0) != 1:
        raise InvalidArgumentError("finite", f"a contiguous tensor of >= {rows} flags on {device} or pinned",
                                   (finite.numel(), finite.device))


def _check_pair(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.numel() != b.numel():
        raise InvalidArgumentError(b_name, f"{a.numel()} ids, as many as {a_name}", b.numel())


def validate_quantize_store(src: torch.Tensor, src_rows: torch.Tensor, qdata: torch.Tensor,
                            scale: torch.Tensor, dst_slots: torch.Tensor, value_axis: int = 1,
                            check_ids: bool = True, finite: Optional[torch.Tensor] = None) -> torch.Tensor:
    """All checks of ``quantize_store``; returns the canonical ``[L, R, H, d_v, d_k]`` view of ``src``."""
    if value_axis not in (1, 2):
        raise InvalidArgumentError("value_axis", "1 or 2", value_axis)
    state = _canonical("src", src, value_axis)
    _check_codes(state, qdata, scale)
    _writable("qdata", qdata)
    _writable("scale", scale)
    _ids("src_rows", src_rows, src.device)
    _ids("dst_slots", dst_slots, src.device)
    _check_pair("src_rows", src_rows, "dst_slots", dst_slots)
    _check_flags(finite, qdata.shape[1], src.device)
    if check_ids:
        check_id_values("src_rows", src_rows, src.shape[1], unique=False)
        check_id_values("dst_slots", dst_slots, qdata.shape[1], unique=True)
    return state


def validate_dequantize_load(qdata: torch.Tensor, scale: torch.Tensor, src_slots: torch.Tensor,
                             dst: torch.Tensor, dst_rows: torch.Tensor, value_axis: int = 1,
                             check_ids: bool = True) -> torch.Tensor:
    """All checks of ``dequantize_load``; returns the canonical view of ``dst``."""
    if value_axis not in (1, 2):
        raise InvalidArgumentError("value_axis", "1 or 2", value_axis)
    state = _canonical("dst", dst, value_axis)
    _check_codes(state, qdata, scale)
    _writable("dst", dst)
    _ids("src_slots", src_slots, dst.device)
    _ids("dst_rows", dst_rows, dst.device)
    _check_pair("src_slots", src_slots, "dst_rows", dst_rows)
    if check_ids:
        check_id_values("src_slots", src_slots, qdata.shape[1], unique=False)
        check_id_values("dst_rows", dst_rows, dst.shape[1], unique=True)
    return state


def validate_copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor,
                       check_ids: bool = True, names: tuple[str, str] = ("src", "dst"),
                       finite: Optional[torch.Tensor] = None) -> None:
    """All checks of ``copy_rows``: ``[L, rows, *inner]`` tensors, same dtype and inner shape, inner contiguous."""
    for name, t in zip(names, (src, dst)):
        if not isinstance(t, torch.Tensor) or t.dim() < 3:
            raise InvalidArgumentError(name, "a tensor [L, rows, *inner]", getattr(t, "shape", type(t).__name__))
        if t.device != src.device:
            raise InvalidArgumentError(name, f"a tensor on {src.device}", t.device)
        try:
            t.view(t.shape[0], t.shape[1], -1)  # view() never copies: fails unless inner is contiguous
        except RuntimeError:
            raise InvalidArgumentError(name, "inner dims contiguous", t.stride()) from None
    if dst.dtype != src.dtype:
        raise InvalidArgumentError(names[1], f"dtype {src.dtype}", dst.dtype)
    if dst.shape[0] != src.shape[0] or dst.shape[2:] != src.shape[2:]:
        raise InvalidArgumentError(names[1], f"shape [{src.shape[0]}, rows, *{tuple(src.shape[2:])}]",
                                   tuple(dst.shape))
    _writable(names[1], dst)
    _ids("src_rows", src_rows, src.device)
    _ids("dst_rows", dst_rows, src.device)
    _check_pair("src_rows", src_rows, "dst_rows", dst_rows)
    _check_flags(finite, dst.shape[1], src.device)
    if check_ids:
        check_id_values("src_rows", src_rows, src.shape[1], unique=False)
        check_id_values("dst_rows", dst_rows, dst.shape[1], unique=True)


# ---------------------------------------------------------------------------------------------
# Launch wrappers
# ---------------------------------------------------------------------------------------------

def _tile(d_v: int, d_k: int, device: torch.device, tile: int) -> tuple[int, int]:
    block_v = triton.next_power_of_2(d_v)
    if device.type == "cuda":
        return block_v, max(1, min(triton.next_power_of_2(d_k), tile // block_v))
    # Interpreter: each program instance costs milliseconds, so one program per (layer, state, head).
    return block_v, triton.next_power_of_2(d_k)


def _even(d_v: int, d_k: int, block_v: int, block_k: int) -> bool:
    return d_v == block_v and d_k % block_k == 0


def quantize_store(src: torch.Tensor, src_rows: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                   dst_slots: torch.Tensor, value_axis: int = 1, *, backend: str = "auto",
                   check_ids: bool = True, finite: Optional[torch.Tensor] = None, mark: int = 0) -> None:
    """Quantize states ``src[:, src_rows[i]]`` into ``qdata/scale[:, dst_slots[i]]``, all layers, one launch.

    ``check_ids`` reads the ids back to range-check them (a sync on CUDA); callers that checked
    them already pass ``False``. ``finite`` (integers ``[S]``): ``finite[dst_slots[i]]`` is set to ``mark``
    when state ``i`` holds a NaN or an inf, and left as it is otherwise (see ``_ref_quant``); a ``mark`` the
    flags' dtype does not hold (uint8: 0 to 255) is refused (``check_mark``).
    """
    state = validate_quantize_store(src, src_rows, qdata, scale, dst_slots, value_axis, check_ids, finite)
    mark = check_mark(mark, finite)
    StorePlan(src, state, qdata, scale, value_axis, backend, finite)(src_rows, dst_slots, mark)


def _conv_args(src: torch.Tensor, dst: torch.Tensor) -> tuple[list, int, int]:
    """A conv window's copy as kernel arguments: bit views ``[L, rows, C]``, their strides, and blocks;
    the block size and the programs per state."""
    bits = _BITS[src.element_size()]
    sv = src.view(src.shape[0], src.shape[1], -1).view(bits)
    dv_ = dst.view(dst.shape[0], dst.shape[1], -1).view(bits)
    c = sv.shape[2]
    block = min(_COPY_TILE if src.device.type == "cuda" else 1 << 16, triton.next_power_of_2(c))
    cb = triton.cdiv(c, block)
    return [sv, dv_, c, sv.stride(0), sv.stride(1), dv_.stride(0), dv_.stride(1), cb], block, sv.shape[0] * cb


def _device_flags(finite: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """The flags where the torch twins can index them: host flags of a GPU pool are copied over (the torch
    backend on a GPU, never the engine's path: the round trip waits for the stream)."""
    return finite if finite is None or finite.device == device else finite.to(device)


def _flags_back(finite: Optional[torch.Tensor], used: Optional[torch.Tensor]) -> None:
    if finite is not None and used is not None and used is not finite:
        finite.copy_(used)


class _Plan:
    """What the plans share: a call of ``n`` states given as ``pack_ids``' arguments (``packed``), through the
    plan's launches at that argument count, or unpacked to id tensors on the torch twins' path (``ref``)."""

    ref: bool
    dev: torch.device
    __call__: Callable[..., None]  # each plan's call on id tensors
    _launch: Callable[..., None]  # (argument count or 0, the ids, n, the mark if the plan takes one)

    def packed(self, ids: tuple[int, ...], n: int, *mark: int) -> None:
        """The move of ``n`` states given as ``pack_ids(sources, destinations)`` (a store: rows, slots; a load:
        slots, rows); ``mark`` as the plan's call takes it."""
        if n == 0:
            return
        if self.ref:
            self(*_unpack(ids, n, self.dev), *mark)
            return
        self._launch(_count(n), ids, n, *mark)


class StorePlan(_Plan):
    """``quantize_store`` bound to its tensors, checked by ``validate_quantize_store`` (``state``: what it
    returned), for callers that validated a layout once: ``plan(src_rows, dst_slots, mark)`` (id tensors on
    the device, checked by the caller) is one launch with nothing checked again, and its host work is the
    launch alone (``launch.Bound``). ``conv``: ``(src, dst)`` of a conv window checked by
    ``validate_copy_rows`` for the same ids, copied (and flagged) by the same launch. ``finite`` may be
    page-locked host memory on a GPU (``FiniteFlags``): the kernels write it through its mapping."""

    def __init__(self, src: torch.Tensor, state: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                 value_axis: int, backend: str, finite: Optional[torch.Tensor],
                 conv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        self.src, self.qdata, self.scale, self.value_axis, self.finite, self.conv = (
            src, qdata, scale, value_axis, finite, conv)
        self.dev = src.device
        self.ref = not use_triton(src.device, backend)
        if self.ref:
            return
        L, _, H, dv, dk = state.shape
        stream = _STREAM_STORE.get(src.dtype)
        if stream is not None:
            block_v, block_k, warps = stream
            block_v = min(block_v, triton.next_power_of_2(dv))
            block_k = (min(block_k, triton.next_power_of_2(dk)) if src.device.type == "cuda"
                       else triton.next_power_of_2(dk))
            even = dv % block_v == 0 and dk % block_k == 0
        else:
            block_v, block_k = _tile(dv, dk, src.device, _STORE_TILE)
            warps, even = _STORE_WARPS, _even(dv, dk, block_v, block_k)
        fin = qdata if finite is None else finite
        # rows, slots, the mark and N (and QP) vary per call: placeholders here (0)
        args = [state, 0, qdata, scale, 0, fin, 0, 0, H, dv, dk, *[0] * PACKED, *state.stride(), *qdata.stride(),
                scale.stride(0), scale.stride(1), scale.stride(2), scale.stride(4)]
        self.per_state, self.kb, self.conv_per_state = L * H, triton.cdiv(dk, block_k), 0
        meta = dict(KIND=_KIND[src.dtype], MIN_SCALE=min_scale(src.dtype), FMA_DIV=src.device.type == "cuda",
                    EVEN=even, FLAG=finite is not None, num_warps=warps)
        if conv is not None:
            cargs, cblock, self.conv_per_state = _conv_args(conv[0], conv[1])
            mask = 0 if finite is None else _EXP_MASK.get(conv[0].dtype, 0)
            self.launches = _Launches(
                _store_with_conv_kernel, [*args, *cargs, 0],
                dict(BLOCK_V=block_v, BLOCK_K=block_k, STREAM=stream is not None, CONV_BLOCK=cblock,
                     CONV_MASK=mask, **meta), ("rows_ptr", "slots_ptr"), ("MARK", "N", "QP"), ("MARK",))
        elif stream is not None:
            self.launches = _Launches(_quantize_store_stream_kernel, args, dict(SUB_V=block_v, BLOCK_K=block_k, **meta),
                                      ("rows_ptr", "slots_ptr"), ("MARK", "N"), ("MARK",))
        else:
            self.launches = _Launches(_quantize_store_kernel, args, dict(BLOCK_V=block_v, BLOCK_K=block_k, **meta),
                                      ("rows_ptr", "slots_ptr"), ("MARK", "N"), ("MARK",))

    def __call__(self, src_rows: torch.Tensor, dst_slots: torch.Tensor, mark: int = 0) -> None:
        n = src_rows.shape[0]
        if n == 0:
            return
        if self.ref:
            fin = _device_flags(self.finite, self.src.device)
            quantize_store_reference(self.src, src_rows, self.qdata, self.scale, dst_slots, self.value_axis, fin,
                                     mark)
            if self.conv is not None:
                copy_rows_reference(self.conv[0], src_rows, self.conv[1], dst_slots, fin, mark)
            _flags_back(self.finite, fin)
            return
        self._launch(0, (src_rows, dst_slots), n, mark)

    def _launch(self, na: int, ids: tuple, n: int, mark: int = 0) -> None:
        qp = self.per_state * n
        if self.conv is not None:
            self.launches.get(na)((qp + self.conv_per_state * n, self.kb), *ids, mark, n, qp)
        else:
            self.launches.get(na)((qp, self.kb), *ids, mark, n)


def dequantize_load(qdata: torch.Tensor, scale: torch.Tensor, src_slots: torch.Tensor, dst: torch.Tensor,
                    dst_rows: torch.Tensor, value_axis: int = 1, *, backend: str = "auto",
                    check_ids: bool = True) -> None:
    """Dequantize ``qdata/scale[:, src_slots[i]]`` into ``dst[:, dst_rows[i]]`` (dtype of ``dst``), one launch."""
    state = validate_dequantize_load(qdata, scale, src_slots, dst, dst_rows, value_axis, check_ids)
    LoadPlan(qdata, scale, dst, state, value_axis, backend)(src_slots, dst_rows)


class LoadPlan(_Plan):
    """``dequantize_load`` bound to its tensors (``StorePlan``'s terms), checked by
    ``validate_dequantize_load``: ``plan(src_slots, dst_rows)``; ``conv``: ``(T1 conv field, T0 conv
    view)`` checked by ``validate_copy_rows``, copied back by the same launch."""

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dst: torch.Tensor, state: torch.Tensor,
                 value_axis: int, backend: str, conv: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
        self.qdata, self.scale, self.dst, self.value_axis, self.conv = qdata, scale, dst, value_axis, conv
        self.dev = dst.device
        self.ref = not use_triton(dst.device, backend)
        if self.ref:
            return
        L, _, H, dv, dk = state.shape
        block_v, block_k = _tile(dv, dk, dst.device, _LOAD_TILE)
        args = [qdata, scale, 0, state, 0, 0, H, dv, dk, *[0] * PACKED, *qdata.stride(), scale.stride(0),
                scale.stride(1), scale.stride(2), scale.stride(4), *state.stride()]
        meta = dict(BLOCK_V=block_v, BLOCK_K=block_k, KIND=_KIND[dst.dtype], EVEN=_even(dv, dk, block_v, block_k),
                    num_warps=_LOAD_WARPS)
        self.per_state, self.kb, self.conv_per_state = L * H, triton.cdiv(dk, block_k), 0
        if conv is not None:
            cargs, cblock, self.conv_per_state = _conv_args(conv[0], conv[1])
            self.launches = _Launches(_load_with_conv_kernel, [*args, *cargs, 0], dict(CONV_BLOCK=cblock, **meta),
                                      ("slots_ptr", "rows_ptr"), ("N", "QP"), ())
        else:
            self.launches = _Launches(_dequantize_load_kernel, args, meta, ("slots_ptr", "rows_ptr"), ("N",), ())

    def __call__(self, src_slots: torch.Tensor, dst_rows: torch.Tensor) -> None:
        n = src_slots.shape[0]
        if n == 0:
            return
        if self.ref:
            dequantize_load_reference(self.qdata, self.scale, src_slots, self.dst, dst_rows, self.value_axis)
            if self.conv is not None:
                copy_rows_reference(self.conv[0], src_slots, self.conv[1], dst_rows)
            return
        self._launch(0, (src_slots, dst_rows), n)

    def _launch(self, na: int, ids: tuple, n: int, *mark: int) -> None:
        qp = self.per_state * n
        if self.conv is not None:
            self.launches.get(na)((qp + self.conv_per_state * n, self.kb), *ids, n, qp)
        else:
            self.launches.get(na)((qp, self.kb), *ids, n)


def copy_rows(src: torch.Tensor, src_rows: torch.Tensor, dst: torch.Tensor, dst_rows: torch.Tensor, *,
              backend: str = "auto", check_ids: bool = True, finite: Optional[torch.Tensor] = None,
              mark: int = 0) -> None:
    """``dst[:, dst_rows[i]] = src[:, src_rows[i]]`` bit for bit, all layers, one launch.

    For conv windows (and lossless states): ``[L, rows, *inner]`` with the inner dims contiguous.
    Bytes per call: ``2 * L * n * inner_bytes``. ``finite`` (integers, one per ``dst`` row): set to ``mark``
    for a row that received a NaN or an inf (float dtypes of ``FLAG_DTYPES``; other dtypes are not checked);
    a ``mark`` the flags' dtype does not hold is refused (``check_mark``).
    """
    validate_copy_rows(src, src_rows, dst, dst_rows, check_ids, finite=finite)
    mark = check_mark(mark, finite)
    CopyPlan(src, dst, backend, finite)(src_rows, dst_rows, mark)


class CopyPlan(_Plan):
    """``copy_rows`` bound to its tensors (``StorePlan``'s terms), checked by ``validate_copy_rows``:
    ``plan(src_rows, dst_rows, mark)``."""

    def __init__(self, src: torch.Tensor, dst: torch.Tensor, backend: str, finite: Optional[torch.Tensor]) -> None:
        self.src, self.dst, self.finite = src, dst, finite
        self.dev = src.device
        self.ref = not use_triton(src.device, backend)
        if self.ref:
            return
        cargs, block, _ = _conv_args(src, dst)
        s, d, c, s_l, s_r, d_l, d_r, cb = cargs
        self.layers, self.cb = s.shape[0], cb
        mask = 0 if finite is None else _EXP_MASK.get(src.dtype, 0)
        self.launches = _Launches(_copy_rows_kernel, [s, 0, d, 0, d if finite is None else finite, 0, 0, c, s_l, s_r,
                                                      d_l, d_r, cb, *[0] * PACKED], dict(BLOCK=block, EXP_MASK=mask),
                                  ("rows_ptr", "slots_ptr"), ("MARK", "N"), ("MARK",))

    def __call__(self, src_rows: torch.Tensor, dst_rows: torch.Tensor, mark: int = 0) -> None:
        n = src_rows.shape[0]
        if n == 0:
            return
        if self.ref:
            fin = _device_flags(self.finite, self.src.device)
            copy_rows_reference(self.src, src_rows, self.dst, dst_rows, fin, mark)
            _flags_back(self.finite, fin)
            return
        self._launch(0, (src_rows, dst_rows), n, mark)

    def _launch(self, na: int, ids: tuple, n: int, mark: int = 0) -> None:
        self.launches.get(na)((self.layers * n, self.cb), *ids, mark, n)
