"""Fused int8 quantize-store / dequantize-load and the row copy against their torch twins.

CPU runs go through the Triton interpreter (conftest sets TRITON_INTERPRET=1 without CUDA), with small
L, H and few states so a launch is a handful of program instances. Outputs are poisoned first (the
``poison`` fixture: int8 with -128, which the kernel never writes since it clamps to +-127, and floats with
NaN), so an element the kernel forgot to write fails the comparison.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.kernels import quant
from tiered_cache.kernels.reference import (
    copy_rows_reference,
    dequantize_load_reference,
    dequantize_reference,
    quantize_reference,
    quantize_store_reference,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
gpu = pytest.mark.gpu
# The store's two formulations: the one-pass kernel (None) and the two-pass one at a few step sizes.
FORMULATIONS = [None, (16, 64, 4), (64, 128, 8)]


@pytest.fixture(params=FORMULATIONS, ids=lambda f: "one-pass" if f is None else f"two-pass-{f[0]}x{f[1]}")
def formulation(request, monkeypatch):
    """Runs the test once per store formulation (``quant._STREAM_STORE`` for every dtype)."""
    monkeypatch.setattr(quant, "_STREAM_STORE", {d: request.param for d in DTYPES})
    return request.param


def state_shape(L, R, H, dv, dk, value_axis):
    return (L, R, H, dv, dk) if value_axis == 1 else (L, R, H, dk, dv)


def rand_states(shape, dtype, device="cpu", seed=0, k_axis=-1):
    """``randn`` scaled per state/head and per k-channel (the structure a decay diag(alpha) gives real
    states), so every scale differs. Never zeros."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=device)
    per_head = [1] * len(shape)
    per_head[: len(shape) - 2] = shape[: len(shape) - 2]
    per_k = [1] * len(shape)
    per_k[k_axis] = shape[k_axis]
    x = x * torch.exp(torch.randn(per_head, generator=g, device=device))
    x = x * torch.exp(0.5 * torch.randn(per_k, generator=g, device=device))
    return x.to(dtype)


def bits(t):
    """Same-size integer view: compares floats bit for bit, NaN poison included."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def poisoned_codes(poison, L, S, H, dv, dk, dtype, device="cpu"):
    return poison((L, S, H, dv, dk), torch.int8, device), poison((L, S, H, 1, dk), dtype, device)


def run_store_load(poison, L, R, S, H, dv, dk, dtype, value_axis, rows, slots, device="cpu", seed=0):
    """Kernel vs reference for one store and one load; asserts bit-exactness and untouched poison."""
    rows = torch.tensor(rows, device=device)
    slots = torch.tensor(slots, device=device)
    src = rand_states(state_shape(L, R, H, dv, dk, value_axis), dtype, device, seed, -1 if value_axis == 1 else -2)
    q, s = poisoned_codes(poison, L, S, H, dv, dk, dtype, device)
    q_ref, s_ref = q.clone(), s.clone()
    quant.quantize_store(src, rows, q, s, slots, value_axis, backend="triton")
    quantize_store_reference(src, rows, q_ref, s_ref, slots, value_axis)
    assert torch.equal(q, q_ref), "int8 codes differ from the reference"
    assert torch.equal(bits(s), bits(s_ref)), "scales differ (bitwise; NaN poison included)"
    assert (q[:, slots] != poison.value(torch.int8)).all() and not s[:, slots].isnan().any(), "unwritten codes"
    others = torch.ones(S, dtype=torch.bool, device=device)
    others[slots] = False
    assert (q[:, others] == poison.value(torch.int8)).all(), "wrote outside dst_slots"

    dst = poison.like(src)
    dst_ref = dst.clone()
    quant.dequantize_load(q, s, slots, dst, rows, value_axis, backend="triton")
    dequantize_load_reference(q_ref, s_ref, slots, dst_ref, rows, value_axis)
    assert torch.equal(dst[:, rows], dst_ref[:, rows]), "dequantized states differ from the reference"
    untouched = torch.ones(R, dtype=torch.bool, device=device)
    untouched[rows] = False
    assert dst[:, untouched].isnan().all(), "wrote outside dst_rows"
    return src, dst, rows


# Head dims: powers of two and not (80, 96 need masks); value_axis 2 is the transposed source.
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value_axis", [1, 2])
@pytest.mark.parametrize("dv,dk", [(80, 96), (128, 64), (64, 256)])
def test_kernels_match_reference(poison, formulation, dtype, value_axis, dv, dk):
    run_store_load(poison, L=2, R=5, S=4, H=2, dv=dv, dk=dk, dtype=dtype, value_axis=value_axis,
                   rows=[3, 0, 4], slots=[2, 1, 3], seed=dv * 7 + dk)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_relative_error(poison, dtype):
    src, dst, rows = run_store_load(poison, L=2, R=3, S=3, H=2, dv=128, dk=128, dtype=dtype, value_axis=1,
                                    rows=[0, 2], slots=[1, 2], seed=11)
    a, b = src[:, rows].float(), dst[:, rows].float()
    rel = ((a - b).norm() / a.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_state_stays_zero(poison, formulation, dtype):
    # The one test with zeros on purpose: amax clamps to 1e-8 (fp16: the scale floor), q = 0, back to 0.
    src = torch.zeros(2, 2, 2, 64, 80, dtype=dtype)
    q, s = poisoned_codes(poison, 2, 2, 2, 64, 80, dtype)
    quant.quantize_store(src, torch.tensor([0, 1]), q, s, torch.tensor([1, 0]), 1, backend="triton")
    assert (q == 0).all() and (s > 0).all()
    dst = poison.like(src)
    quant.dequantize_load(q, s, torch.tensor([0, 1]), dst, torch.tensor([1, 0]), 1, backend="triton")
    assert (dst == 0).all() and not dst.signbit().any()


def test_fp16_tiny_values_do_not_divide_by_zero(poison, formulation):
    # fp16 (amax / 127) underflows to 0 below amax ~7.6e-6; the scale floor keeps x / scale finite.
    src = (rand_states((1, 1, 1, 64, 64), torch.float32, seed=5) * 1e-7).to(torch.float16)
    q, s = poisoned_codes(poison, 1, 1, 1, 64, 64, torch.float16)
    q_ref, s_ref = q.clone(), s.clone()
    ids = torch.tensor([0])
    quant.quantize_store(src, ids, q, s, ids, 1, backend="triton")
    quantize_store_reference(src, ids, q_ref, s_ref, ids, 1)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref) and (s > 0).all()


def test_ties_round_half_to_even(poison, formulation):
    # scale = 2**-4 exactly (amax = 127 / 16); x = (k + 0.5) * scale lands exactly on a tie.
    dk = 8
    col = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]) / 16
    src = col[:, None].expand(8, dk).contiguous().reshape(1, 1, 1, 8, dk)
    q, s = poisoned_codes(poison, 1, 1, 1, 8, dk, torch.float32)
    ids = torch.tensor([0])
    quant.quantize_store(src, ids, q, s, ids, 1, backend="triton")
    assert torch.equal(s[0, 0, 0, 0], torch.full((dk,), 1 / 16))
    assert q[0, 0, 0, :, 0].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    q_ref, s_ref = quantize_reference(src)
    assert torch.equal(q, q_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value_axis", [1, 2])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_store_flags_non_finite_states_in_every_formulation(poison, formulation, dtype, value_axis, value):
    """One bad value anywhere in a state clears that slot's flag and no other; finite states stay bit-exact
    with the reference (the two-pass kernel sees it through a NaN-keeping amax)."""
    gen = torch.Generator().manual_seed(int(value_axis * 10 + DTYPES.index(dtype)))
    dv, dk = 40, 24  # masked tiles, several row steps
    shape = state_shape(2, 5, 2, dv, dk, value_axis)
    src = rand_states(shape, dtype, seed=3, k_axis=-1 if value_axis == 1 else -2)
    bad_row = 3
    idx = tuple(int(torch.randint(n, (1,), generator=gen)) for n in shape[2:])
    src[(1, bad_row, *idx)] = value
    rows, slots = torch.tensor([3, 0, 4, 1]), torch.tensor([2, 5, 1, 6])
    q, s = poisoned_codes(poison, 2, 8, 2, dv, dk, dtype)
    q_ref, s_ref = q.clone(), s.clone()
    fin, fin_ref = torch.ones(8, dtype=torch.uint8), torch.ones(8, dtype=torch.uint8)
    quant.quantize_store(src, rows, q, s, slots, value_axis, backend="triton", finite=fin)
    quantize_store_reference(src, rows, q_ref, s_ref, slots, value_axis, finite=fin_ref)
    assert torch.equal(fin, fin_ref) and fin.tolist() == [1, 1, 0, 1, 1, 1, 1, 1]
    good = slots[rows != bad_row]
    assert torch.equal(q[:, good], q_ref[:, good]) and torch.equal(bits(s[:, good]), bits(s_ref[:, good]))


def test_a_store_writes_its_mark_into_int64_flags(poison, formulation):
    """``finite`` int64 with a ``mark`` (``FiniteFlags``' scheme): the non-finite slot's flag becomes the mark,
    every other keeps its older value, kernel and twin alike, for the quantize store and the row copy."""
    src = rand_states(state_shape(2, 5, 2, 16, 32, 1), torch.float32, seed=4, k_axis=-1)
    src[0, 2, 1, 3, 5] = float("nan")
    rows, slots = torch.tensor([2, 0, 4]), torch.tensor([3, 5, 1])
    q, s = poisoned_codes(poison, 2, 8, 2, 16, 32, torch.float32)
    older = torch.arange(8, dtype=torch.int64) * 100 + 1  # the marks of older non-finite stores
    fin, fin_ref = older.clone(), older.clone()
    quant.quantize_store(src, rows, q, s, slots, backend="triton", finite=fin, mark=4242)
    quantize_store_reference(src, rows, q.clone(), s.clone(), slots, finite=fin_ref, mark=4242)
    want = older.clone()
    want[3] = 4242
    assert torch.equal(fin, want) and torch.equal(fin_ref, want)
    conv = torch.randn(2, 5, 6, 3, generator=torch.Generator().manual_seed(1))
    conv[1, 4, 2, 0] = float("inf")
    dst, dst_ref = poison((2, 8, 6, 3)), poison((2, 8, 6, 3))
    fin, fin_ref = older.clone(), older.clone()
    quant.copy_rows(conv, rows, dst, slots, backend="triton", finite=fin, mark=77)
    copy_rows_reference(conv, rows, dst_ref, slots, finite=fin_ref, mark=77)
    want = older.clone()
    want[1] = 77
    assert torch.equal(fin, want) and torch.equal(fin_ref, want) and torch.equal(bits(dst), bits(dst_ref))


@pytest.mark.parametrize("flag_dtype,mark", [(torch.uint8, 256), (torch.uint8, -1), (torch.uint8, 2**40),
                                             (torch.int64, 2**63), (torch.uint8, True), (torch.uint8, 3.0)])
def test_a_mark_the_flags_cannot_hold_is_refused_before_anything_is_written(poison, flag_dtype, mark):
    """uint8 flags hold marks 0 to 255: a wider one would be truncated (256 -> 0, another store's mark) by the
    kernel and overflow in the twin; the public store and copy and both twins refuse it, naming ``mark``,
    with nothing written. The largest mark the flags hold is written as it is."""
    src = rand_states(state_shape(2, 5, 2, 16, 32, 1), torch.float32, seed=4, k_axis=-1)
    src[0, 2, 1, 3, 5] = float("nan")
    conv = torch.randn(2, 5, 6, 3, generator=torch.Generator().manual_seed(1))
    conv[1, 2, 2, 0] = float("inf")
    rows, slots = torch.tensor([2, 0, 4]), torch.tensor([3, 5, 1])
    q, s = poisoned_codes(poison, 2, 8, 2, 16, 32, torch.float32)
    dst = poison((2, 8, 6, 3))
    fin = torch.arange(8, dtype=flag_dtype) + 1
    before = [t.clone() for t in (q, s, dst, fin)]
    calls = [lambda m: quant.quantize_store(src, rows, q, s, slots, backend="triton", finite=fin, mark=m),
             lambda m: quantize_store_reference(src, rows, q, s, slots, finite=fin, mark=m),
             lambda m: quant.copy_rows(conv, rows, dst, slots, backend="triton", finite=fin, mark=m),
             lambda m: copy_rows_reference(conv, rows, dst, slots, finite=fin, mark=m)]
    for call in calls:
        with pytest.raises(InvalidArgumentError) as e:
            call(mark)
        assert e.value.arg == "mark"
        assert all(torch.equal(bits(t), bits(b)) for t, b in zip((q, s, dst), before)) and torch.equal(fin, before[3])
    top = int(torch.iinfo(flag_dtype).max)
    for call in calls:
        fin.copy_(before[3])
        call(top)
        assert fin[3] == top and torch.equal(fin[[0, 1, 2, 4, 5, 6, 7]], before[3][[0, 1, 2, 4, 5, 6, 7]])


@pytest.mark.parametrize("mark", [torch.tensor(7), np.int64(7)], ids=["tensor", "numpy"])
def test_a_mark_given_as_a_0d_tensor_or_numpy_int_is_written_as_its_value(poison, mark):
    """The launch takes the int ``check_mark`` returns, not the caller's object: given a 0-d tensor the kernel
    path wrote the tensor's pointer into the flag (and a numpy int failed inside the launch) while the twin
    wrote 7."""
    conv = torch.randn(2, 5, 6, 3, generator=torch.Generator().manual_seed(1))
    conv[1, 2, 2, 0] = float("inf")
    rows, slots = torch.tensor([2, 0, 4]), torch.tensor([3, 5, 1])
    src = rand_states(state_shape(2, 5, 2, 16, 32, 1), torch.float32, seed=4, k_axis=-1)
    src[0, 2, 1, 3, 5] = float("nan")
    for store in (lambda q, s, f: quant.quantize_store(src, rows, q, s, slots, backend="triton", finite=f, mark=mark),
                  lambda q, s, f: quantize_store_reference(src, rows, q, s, slots, finite=f, mark=mark),
                  lambda q, s, f: quant.copy_rows(conv, rows, poison((2, 8, 6, 3)), slots, backend="triton",
                                                  finite=f, mark=mark),
                  lambda q, s, f: copy_rows_reference(conv, rows, poison((2, 8, 6, 3)), slots, finite=f, mark=mark)):
        q, s = poisoned_codes(poison, 2, 8, 2, 16, 32, torch.float32)
        fin = torch.zeros(8, dtype=torch.int64)
        store(q, s, fin)
        want = torch.zeros(8, dtype=torch.int64)
        want[3] = 7  # row 2 (-> slot 3) holds the NaN / the inf
        assert torch.equal(fin, want), fin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("value_axis", [1, 2])
@pytest.mark.parametrize("bad", [None, "temporal", "conv"])
def test_store_and_load_with_the_conv_window_in_one_launch(poison, formulation, dtype, value_axis, bad):
    """``quant.StorePlan`` / ``quant.LoadPlan`` with ``conv``: the temporal codes and the conv
    window (its bits) land as the separate kernels' twins put them, into poisoned outputs; a NaN in either
    field clears the slot's flag, and only that slot's."""
    L, R, S, H, dv, dk = 2, 5, 7, 2, 24, 40
    rows, slots = torch.tensor([4, 1, 3]), torch.tensor([6, 2, 5])
    src = rand_states(state_shape(L, R, H, dv, dk, value_axis), dtype, seed=9, k_axis=-1 if value_axis == 1 else -2)
    conv_src = torch.randn(R, L, 10, 3, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).transpose(0, 1)
    if bad == "temporal":
        src[1, 3, 0, 2, 1] = float("nan")
    elif bad == "conv":
        conv_src[0, 3, 7, 2] = float("inf")
    q, s = poisoned_codes(poison, L, S, H, dv, dk, dtype)
    conv_t1 = poison((L, S, 10, 3), torch.bfloat16)
    q_ref, s_ref, conv_ref = q.clone(), s.clone(), conv_t1.clone()
    fin, fin_ref = torch.ones(S, dtype=torch.uint8), torch.ones(S, dtype=torch.uint8)
    state = quant.validate_quantize_store(src, rows, q, s, slots, value_axis, finite=fin)
    quant.StorePlan(src, state, q, s, value_axis, "triton", fin, conv=(conv_src, conv_t1))(rows, slots)
    quantize_store_reference(src, rows, q_ref, s_ref, slots, value_axis, fin_ref)
    copy_rows_reference(conv_src, rows, conv_ref, slots, fin_ref)
    assert torch.equal(fin, fin_ref) and fin.tolist() == [1 if bad is None or i != 5 else 0 for i in range(S)]
    good = slots if bad is None else slots[rows != 3]
    assert torch.equal(q[:, good], q_ref[:, good]) and torch.equal(bits(s[:, good]), bits(s_ref[:, good]))
    assert torch.equal(bits(conv_t1), bits(conv_ref))  # the conv bits, poison elsewhere included
    others = torch.ones(S, dtype=torch.bool)
    others[slots] = False
    assert (q[:, others] == poison.value(torch.int8)).all()

    dst, conv_dst = poison.like(src), poison.like(conv_src)
    dst_ref, conv_dst_ref = dst.clone(), conv_dst.clone()
    state = quant.validate_dequantize_load(q_ref, s_ref, slots, dst, rows, value_axis)
    quant.LoadPlan(q_ref, s_ref, dst, state, value_axis, "triton", conv=(conv_ref, conv_dst))(slots, rows)
    dequantize_load_reference(q_ref, s_ref, slots, dst_ref, rows, value_axis)
    copy_rows_reference(conv_ref, slots, conv_dst_ref, rows)
    keep = torch.ones(R, dtype=torch.bool)
    keep[3] = bad != "temporal"  # a NaN scale's NaNs need not agree bit for bit
    assert torch.equal(bits(dst[:, keep]), bits(dst_ref[:, keep])) and torch.equal(bits(conv_dst), bits(conv_dst_ref))
    assert torch.equal(bits(conv_dst[:, rows]), bits(conv_src[:, rows]))


def test_reference_math_is_the_documented_one():
    # amax in fp32, scale rounded to the state dtype before dividing, dequantize in fp32 then cast.
    x = rand_states((3, 48, 40), torch.bfloat16, seed=2)
    q, s = quantize_reference(x)
    amax = x.float().abs().amax(dim=-2, keepdim=True).clamp(min=1e-8)
    assert torch.equal(s, (amax / 127).to(torch.bfloat16))
    assert torch.equal(q, torch.round(x.float() / s.float()).clamp(-127, 127).to(torch.int8))
    assert torch.equal(dequantize_reference(q, s, torch.bfloat16), (q.float() * s.float()).to(torch.bfloat16))


def test_the_gpu_s_division_by_127_is_correctly_rounded():
    """The store's scale on the GPU is ``amax / 127`` without a division (``quant._div127``): with ``y =
    RN(1/127)``, ``q0 = RN(amax * y)`` and ``q = RN(q0 + y * (amax - 127 q0))`` (fmas; the interpreter divides).
    Here the same steps in exact arithmetic (float64 holds each product and difference exactly; the last
    sum is rounded once, to fp32, from the Fraction) on random fp32 amaxes over the kernels' whole range and
    the ones beside powers of two and near ties, against IEEE division. The full fp32 range from 1e-8 was
    checked once by the same steps (about 1.3e9 values, none wrong)."""
    from fractions import Fraction

    y = quant._RCP_127.value if hasattr(quant._RCP_127, "value") else quant._RCP_127
    assert np.float32(y) == y and abs(Fraction(y) - Fraction(1, 127)) <= abs(
        Fraction(float(np.nextafter(np.float32(y), np.float32(1)))) - Fraction(1, 127))
    assert abs(Fraction(y) - Fraction(1, 127)) <= abs(
        Fraction(float(np.nextafter(np.float32(y), np.float32(0)))) - Fraction(1, 127))
    rng = np.random.default_rng(7)
    lo, hi = int(np.float32(1e-8).view(np.uint32)), int(np.finfo(np.float32).max.view(np.uint32))
    bits = rng.integers(lo, hi, 20000, dtype=np.int64)
    ties = np.array([np.float32(127 * (2 * k + 1)) * np.float32(2.0) ** e for k in range(1, 60) for e in (-30, -3, 20)])
    pow2 = np.float32(2.0) ** np.arange(-26, 120, dtype=np.float32)
    around = np.concatenate([pow2, np.nextafter(pow2, np.float32(0)), np.nextafter(pow2, np.float32(np.inf))])
    amax = np.concatenate([bits.astype(np.uint32).view(np.float32), ties.astype(np.float32), around])
    amax = amax[(amax >= np.float32(1e-8)) & np.isfinite(amax)]

    def rn32(fr: Fraction) -> float:  # nearest fp32, ties to even
        f = np.float32(float(fr))
        near = [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
        return float(min(near, key=lambda c: (abs(Fraction(float(c)) - fr), int(np.float32(c).view(np.uint32)) & 1)))

    for a in amax.tolist():
        q0 = float(np.float32(a * y))  # the product is exact in float64, then rounded once to fp32
        r = a - 127.0 * q0  # exact
        assert float(np.float32(r)) == r
        assert rn32(Fraction(q0) + Fraction(r) * Fraction(y)) == rn32(Fraction(a) / 127), a


def test_fp32_and_bf16_codes_need_no_clamp_on_the_gpu():
    """The GPU's store skips the +-127 clamp for fp32 and bf16 states (``quant._codes``): with ``y = RN(x /
    scale)`` correctly rounded and the scale ``amax / 127`` rounded to nearest in the state dtype (never
    subnormal above the 1e-8 amax floor), ``|x| <= amax`` gives ``|y| <= 127 / (1 - 2**-8)``, which rounds to
    127. Checked at the worst element (``x = amax``) for random and edge amaxes; an fp16 scale, subnormal for
    small amaxes, does give codes past 127, which is why fp16 keeps the clamp."""
    rng = np.random.default_rng(11)
    lo, hi = int(np.float32(1e-8).view(np.uint32)), int(np.finfo(np.float32).max.view(np.uint32))
    amax = rng.integers(lo, hi, 200000, dtype=np.int64).astype(np.uint32).view(np.float32)
    amax = np.concatenate([amax, np.float32(2.0) ** np.arange(-26, 127, dtype=np.float32),
                           np.float32(127.0) * (np.float32(1) + np.arange(1, 2000, dtype=np.float32) / 256)])
    a64 = amax.astype(np.float64)
    scale = (a64 / 127).astype(np.float32)  # RN(amax / 127): no float64 tie is possible (127 is odd)

    def worst(s32: np.ndarray) -> float:
        return float(np.abs(np.rint((a64 / s32.astype(np.float64)).astype(np.float32))).max())

    assert worst(scale) == 127
    assert worst(torch.from_numpy(scale).to(torch.bfloat16).to(torch.float32).numpy()) == 127
    small = amax[amax < 1e-2]
    s16 = torch.from_numpy((small.astype(np.float64) / 127).astype(np.float32)).to(torch.float16)
    s16 = s16.clamp(min=2.0**-24).to(torch.float32).numpy()
    assert float(np.abs(np.rint((small.astype(np.float64) / s16).astype(np.float32))).max()) > 127


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_copy_rows_bitwise(poison, dtype):
    L, R, S = 2, 5, 4
    src = rand_states((L, R, 24, 3), dtype, seed=3)
    dst = poison((L, S, 24, 3), dtype)
    dst_ref = dst.clone()
    quant.copy_rows(src, torch.tensor([4, 1]), dst, torch.tensor([3, 0]), backend="triton")
    copy_rows_reference(src, torch.tensor([4, 1]), dst_ref, torch.tensor([3, 0]))
    assert torch.equal(dst[:, [3, 0]], dst_ref[:, [3, 0]]) and dst[:, [1, 2]].isnan().all()


def test_strided_source_like_a_pool_view(poison):
    # Slot-major envelopes: [R, L, H, a, b] storage viewed as [L, R, ...] (neither stride contiguous),
    # plus padding between slots, like UnifiedPool.temporal_view_all().
    L, R, H, a, b = 2, 4, 2, 96, 80
    env = torch.randn(R, L * H * a * b + 64)
    src = env[:, : L * H * a * b].reshape(R, L, H, a, b).transpose(0, 1)
    q, s = poisoned_codes(poison, L, 3, H, b, a, torch.float32)
    q_ref, s_ref = q.clone(), s.clone()
    rows, slots = torch.tensor([2, 3]), torch.tensor([0, 2])
    quant.quantize_store(src, rows, q, s, slots, 2, backend="triton")
    quantize_store_reference(src, rows, q_ref, s_ref, slots, 2)
    assert torch.equal(q, q_ref) and torch.equal(s[:, slots], s_ref[:, slots])


# ------------------------------------------------------------------------------ bad inputs
def _bad_setup(poison):
    src = rand_states((2, 4, 2, 64, 32), torch.float32, seed=9)
    q, s = poisoned_codes(poison, 2, 3, 2, 64, 32, torch.float32)
    return src, q, s


@pytest.mark.parametrize("case,arg", [
    ("scale_dtype", "scale"), ("q_dtype", "qdata"), ("q_shape", "qdata"), ("axis", "value_axis"),
    ("rows_range", "src_rows"), ("slots_range", "dst_slots"), ("dup_slots", "dst_slots"),
    ("lengths", "dst_slots"), ("ids_float", "src_rows"), ("device", "src_rows"), ("expanded", "qdata"),
])
def test_quantize_store_bad_input_writes_nothing(poison, case, arg):
    src, q, s = _bad_setup(poison)
    rows, slots, va = torch.tensor([0, 1]), torch.tensor([1, 2]), 1
    if case == "scale_dtype":
        s = s.to(torch.float16)
    elif case == "q_dtype":
        q = q.to(torch.int16)
    elif case == "q_shape":
        q = q[..., :16]
    elif case == "axis":
        va = 3
    elif case == "rows_range":
        rows = torch.tensor([0, 4])
    elif case == "slots_range":
        slots = torch.tensor([1, 3])
    elif case == "dup_slots":
        slots = torch.tensor([2, 2])
    elif case == "lengths":
        slots = torch.tensor([1])
    elif case == "ids_float":
        rows = rows.float()
    elif case == "device":
        rows = rows.to("meta")
    elif case == "expanded":
        q = q[:, :1].expand(2, 3, 2, 64, 32)
    q0, s0 = q.clone(), s.clone()
    with pytest.raises(InvalidArgumentError) as err:
        quant.quantize_store(src, rows, q, s, slots, va, backend="triton")
    assert err.value.arg == arg
    assert torch.equal(q, q0) and torch.equal(bits(s), bits(s0))


def test_dequantize_load_bad_input_writes_nothing(poison):
    src, q, s = _bad_setup(poison)
    quantize_store_reference(src, torch.tensor([0, 1, 2]), q, s, torch.tensor([0, 1, 2]), 1)
    dst = poison.like(src)
    for kwargs, arg in [
        (dict(dst=dst.to(torch.bfloat16)), "scale"),              # scale dtype must match the state dtype
        (dict(dst_rows=torch.tensor([1, 1])), "dst_rows"),        # duplicate destinations
        (dict(src_slots=torch.tensor([0, 3])), "src_slots"),      # out of range
        (dict(dst_rows=torch.tensor([0, 1, 2])), "dst_rows"),     # lengths
        (dict(dst=dst[:, :, :, :, :16]), "qdata"),                # shape mismatch
    ]:
        args = dict(qdata=q, scale=s, src_slots=torch.tensor([0, 1]), dst=dst, dst_rows=torch.tensor([2, 3]))
        args.update(kwargs)
        with pytest.raises(InvalidArgumentError) as err:
            quant.dequantize_load(**args, value_axis=1, backend="triton")
        assert err.value.arg == arg, kwargs
        assert dst.isnan().all()


def test_copy_rows_bad_input(poison):
    src = rand_states((2, 3, 8, 3), torch.float32)
    dst = poison((2, 3, 8, 3))
    with pytest.raises(InvalidArgumentError, match="dst"):
        quant.copy_rows(src, torch.tensor([0]), dst.to(torch.bfloat16), torch.tensor([1]), backend="triton")
    with pytest.raises(InvalidArgumentError, match="inner dims contiguous"):
        quant.copy_rows(src.transpose(2, 3), torch.tensor([0]), dst.transpose(2, 3), torch.tensor([1]),
                        backend="triton")
    with pytest.raises(InvalidArgumentError, match="dst_rows"):
        quant.copy_rows(src, torch.tensor([0, 1]), dst, torch.tensor([2, 2]), backend="triton")
    assert dst.isnan().all()


# ------------------------------------------------------------------------------ GPU, realistic sizes
@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value_axis", [1, 2])
def test_gpu_qwen3_next_sized(poison, formulation, dtype, value_axis):
    # 36 layers x 32 heads x 128 x 128, 16 scattered states out of 40 rows, into 20 slots.
    perm = torch.randperm(40)[:16].tolist()
    slots = torch.randperm(20)[:16].tolist()
    src, dst, rows = run_store_load(poison, L=36, R=40, S=20, H=32, dv=128, dk=128, dtype=dtype,
                                    value_axis=value_axis, rows=perm, slots=slots, device="cuda", seed=1)
    a, b = src[:, rows].float(), dst[:, rows].float()
    assert ((a - b).norm() / a.norm()).item() < 1e-2


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dv,dk", [(80, 96), (96, 80), (256, 64), (64, 256), (256, 256)])
def test_gpu_head_dims(poison, formulation, dtype, dv, dk):
    for value_axis in (1, 2):
        run_store_load(poison, L=4, R=70, S=66, H=8, dv=dv, dk=dk, dtype=dtype, value_axis=value_axis,
                       rows=torch.randperm(70)[:64].tolist(), slots=torch.randperm(66)[:64].tolist(),
                       device="cuda", seed=dv + dk)


@gpu
def test_gpu_copy_rows_and_zero_state(poison):
    src = rand_states((36, 40, 8192, 3), torch.bfloat16, device="cuda")
    dst = poison((36, 20, 8192, 3), torch.bfloat16, "cuda")
    rows, slots = torch.arange(0, 32, 2, device="cuda"), torch.arange(1, 17, device="cuda")
    quant.copy_rows(src, rows, dst, slots, backend="triton")
    assert torch.equal(dst[:, slots], src[:, rows])
    for dtype in DTYPES:
        z = torch.zeros(4, 3, 8, 128, 128, dtype=dtype, device="cuda")
        q, s = poisoned_codes(poison, 4, 3, 8, 128, 128, dtype, "cuda")
        ids = torch.arange(3, device="cuda")
        quant.quantize_store(z, ids, q, s, ids, 1, backend="triton")
        out = poison.like(z)
        quant.dequantize_load(q, s, ids, out, ids, 1, backend="triton")
        assert (q == 0).all() and (out == 0).all()
