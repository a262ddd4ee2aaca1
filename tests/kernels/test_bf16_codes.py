"""The GPU store's bf16 codes without a division (``quant._reciprocal`` / ``quant._quotients``).

On the GPU a bf16 state's code is ``rint(fma(x, hi, RN(x * lo)))`` with ``hi`` the hardware's approximate
reciprocal of the scale (``rcp.approx``, within 1 ulp) and ``lo = RN(fma(-s, hi, 1) * hi)``; the reference
is ``rint(RN(x / s))`` (IEEE division). Here the GPU's steps are emulated exactly in numpy (each fma
rounded once: the float64 sum rounded to odd, then to fp32) for every ``hi`` within 1 ulp of ``RN(1/s)``;
the GPU test feeds the kernel the ties and the extreme scales.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_cache.kernels import quant
from tiered_cache.kernels.reference import quantize_store_reference

gpu = pytest.mark.gpu


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """``RN32(a * b + c)``, one rounding: ``a * b`` of two fp32 is exact in float64; the float64 sum is
    rounded to odd (TwoSum's error moves an even result one ulp toward the exact sum), so rounding it to fp32
    rounds the exact sum."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = np.broadcast_to(c.astype(np.float64), p.shape)
    s = p + c64
    bb = s - p
    err = (p - (s - bb)) + (c64 - bb)
    fix = (err != 0) & ((s.view(np.int64) & 1) == 0)
    return np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s).astype(np.float32)


def bf16_scale(amax: np.ndarray) -> np.ndarray:
    """The store's scale: ``RN32(amax / 127)`` (float64 holds the quotient's rounding: 127 is odd, no
    float64 tie) rounded to bf16, in fp32."""
    s32 = torch.from_numpy((amax.astype(np.float64) / 127).astype(np.float32))
    return s32.to(torch.bfloat16).to(torch.float32).numpy()


def positive_bf16() -> np.ndarray:
    b = (np.arange(1, 0x7F80, dtype=np.uint32) << 16).view(np.float32)  # +0 excluded, up to the largest finite
    return b


def gpu_codes(x: np.ndarray, s: np.float32, ulps: int, lo_term: bool = True) -> np.ndarray:
    """The kernel's bf16 codes for ``x`` with scale ``s`` and ``hi`` ``ulps`` from ``RN(1/s)``."""
    hi = np.array([(np.float32(1) / s).view(np.uint32) + np.uint32(ulps) if ulps >= 0
                   else (np.float32(1) / s).view(np.uint32) - np.uint32(-ulps)], np.uint32).view(np.float32)
    e = fma32(-np.array([s], np.float32), hi, np.array([1.0], np.float32))
    lo = (e * hi) if lo_term else np.zeros(1, np.float32)
    return np.rint(fma32(x, np.broadcast_to(hi, x.shape), x * lo))


def test_bf16_codes_from_the_two_float_reciprocal_equal_ieee_division():
    """The 1e-8 amax floor, every bf16 amax mantissa in the lowest binade the kernels see, at 1 and in the
    two highest (where ``lo`` is subnormal: a flush-to-zero multiply would lose it), every bf16 ``|x| <=
    amax`` down to ``amax * 2**-12`` (below, ``|x / s| < 2**-5``: code 0 for any quotient within 2**-10),
    both signs, every ``hi`` within 1 ulp: the codes equal the reference's. The whole range (every bf16
    amax >= 1e-8, 9.0e8 pairs, ``hi`` within 3 ulps) was checked once by the same steps: no code differs.
    Without ``lo`` (the product ``x * hi`` alone) ties differ, which this set must show."""
    pos = positive_bf16()
    lows = pos[(pos >= np.float32(1e-8)) & (pos < np.float32(2.0**-26))]
    floor = np.array([1e-8], np.float32)  # the kernels' amax floor, an fp32 constant
    amaxes = np.concatenate([floor, lows, pos[(pos >= 1) & (pos < 2)], pos[pos >= np.float32(2.0**126)]])
    wrong_without_lo = 0
    for a, s in zip(amaxes.tolist(), bf16_scale(amaxes).tolist()):
        a, s = np.float32(a), np.float32(s)
        x = pos[(pos <= a) & (pos >= a * np.float32(2.0**-12))]
        x = np.concatenate([x, -x])
        ref = np.clip(np.rint(x / s), -127, 127)  # numpy's fp32 division is IEEE
        for ulps in (-1, 0, 1):
            assert np.array_equal(gpu_codes(x, s, ulps), ref), (a, s, ulps)
        wrong_without_lo += int((gpu_codes(x, s, 0, lo_term=False) != ref).sum())
    assert wrong_without_lo > 0


def test_bf16_scales_from_one_multiply_equal_the_correctly_rounded_ones():
    """``quant._scale_of`` for bf16 states on the GPU: ``bf16(RN(amax * RN(1/127)))`` for every amax the
    kernel can hold (every bf16 value >= 1e-8 and the 1e-8 floor, an fp32 constant): all equal ``bf16(RN(amax
    / 127))``. In fp32 the product alone is not ``RN(amax / 127)`` for all of them, which is why fp32 and fp16
    states keep ``_div127``'s fmas."""
    pos = positive_bf16()
    amax = np.concatenate([pos[pos >= np.float32(1e-8)], np.array([1e-8], np.float32)])
    y = np.float32(quant._RCP_127.value if hasattr(quant._RCP_127, "value") else quant._RCP_127)
    to_bf16 = lambda v: torch.from_numpy(v).to(torch.bfloat16).to(torch.float32).numpy()  # noqa: E731
    assert np.array_equal(to_bf16(amax * y), bf16_scale(amax))
    assert not np.array_equal(amax * y, amax / np.float32(127))


def tie_states(value_axis: int, device: str) -> torch.Tensor:
    """bf16 states ``[1, 1, 1, 128, dk]`` (value axis 1; 2: transposed) whose channels have amaxes over the
    whole range (1e-8 to the largest bf16, every mantissa at some exponent) and hold every bf16 that is an
    exact tie ``(k + 1/2) * scale`` of their scale (63 each sign at most), the rest random below the amax."""
    pos = positive_bf16()
    exps = [-26, -13, 0, 29, 64, 103, 110, 126]
    amaxes = np.concatenate([pos[(pos >= np.float32(2.0**e)) & (pos < np.float32(2.0 ** (e + 1)))] for e in exps])
    amaxes = amaxes[amaxes >= np.float32(1e-8)]
    cols = []
    g = torch.Generator().manual_seed(3)
    for a, s in zip(amaxes.tolist(), bf16_scale(amaxes).tolist()):
        ties = np.array([(k + 0.5) * s for k in range(127)], np.float64)
        ties = ties[(ties == ties.astype(np.float32)) & (ties <= a)].astype(np.float32)
        ties = ties[torch.from_numpy(ties).to(torch.bfloat16).to(torch.float32).numpy() == ties]
        fill = (torch.rand(128, generator=g, dtype=torch.float64) * 2 - 1) * a
        col = fill.to(torch.bfloat16).to(torch.float32)
        col[0] = a
        up, down = torch.from_numpy(ties[:63]), -torch.from_numpy(ties[::-1][:63].copy())
        col[1:1 + up.numel()] = up
        col[64:64 + down.numel()] = down
        cols.append(col)
    x = torch.stack(cols, dim=1).to(torch.bfloat16).reshape(1, 1, 1, 128, len(cols))
    x = x[..., : len(cols) // 64 * 64]
    return (x if value_axis == 1 else x.transpose(-1, -2).contiguous()).to(device)


@pytest.mark.parametrize("value_axis", [1, 2])
def test_tie_states_hold_ties_at_every_scale_range(poison, value_axis):
    """The GPU test's states do reach what it is for: many exact ties, amaxes past 2**103 (subnormal
    ``lo``) and below 1e-7 (run here through the interpreter, which divides)."""
    x = tie_states(value_axis, "cpu")
    xc = x if value_axis == 1 else x.transpose(-1, -2)
    amax = xc.float().abs().amax(dim=-2)
    s = (amax / 127).to(torch.bfloat16).float()
    y = xc.float() / s[..., None, :]
    assert int((y == y.floor() + 0.5).sum()) > 1000
    assert float(amax.max()) > 2.0**126 and float(amax.min()) < 1e-7
    ids = torch.tensor([0])
    q, sc = poison((1, 1, 1, 128, xc.shape[-1]), torch.int8), poison((1, 1, 1, 1, xc.shape[-1]), torch.bfloat16)
    q_ref, s_ref = q.clone(), sc.clone()
    quant.quantize_store(x, ids, q, sc, ids, value_axis, backend="triton")
    quantize_store_reference(x, ids, q_ref, s_ref, ids, value_axis)
    assert torch.equal(q, q_ref) and torch.equal(sc.view(torch.int16), s_ref.view(torch.int16))


@gpu
@pytest.mark.parametrize("stream", [None, (16, 64, 4)], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("value_axis", [1, 2])
def test_gpu_bf16_codes_at_ties_and_extreme_scales(poison, monkeypatch, stream, value_axis):
    monkeypatch.setattr(quant, "_STREAM_STORE", {**quant._STREAM_STORE, torch.bfloat16: stream})
    x = tie_states(value_axis, "cuda")
    dk = x.shape[-1] if value_axis == 1 else x.shape[-2]
    ids = torch.tensor([0], device="cuda")
    q, s = poison((1, 1, 1, 128, dk), torch.int8, "cuda"), poison((1, 1, 1, 1, dk), torch.bfloat16, "cuda")
    q_ref, s_ref = q.clone(), s.clone()
    quant.quantize_store(x, ids, q, s, ids, value_axis, backend="triton")
    quantize_store_reference(x, ids, q_ref, s_ref, ids, value_axis)
    assert torch.equal(s.view(torch.int16), s_ref.view(torch.int16))
    assert torch.equal(q, q_ref)
