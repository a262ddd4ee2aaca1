"""Benchmark: fused int8 quantize-store / dequantize-load vs the torch reference and a device copy.

    python benchmarks/bench_kernels.py                 # H200: 36 layers x 32 heads x 128 x 128, 16 and 64 states
    python benchmarks/bench_kernels.py --small         # CPU smoke run (Triton interpreter), tiny shapes
    python benchmarks/bench_kernels.py --parts api sweep   # H200: the engine's path and the store's formulations
    python benchmarks/bench_kernels.py --parts host    # CPU: that path's host work, the launch stubbed (bench_host)

For each state dtype (fp32, bf16) and states per call (16, 64): states sit scattered in a T0-like
slot-major buffer (twice as many rows as states, random rows) and go to random T1 slots of an
``Int8CheckpointPool``. Correctness is checked first (int8 codes, scales and dequantized states
bit-exact against the reference). Then, in the same run, three timings of the same bytes:

- the fused Triton kernel (``quant.quantize_store`` / ``quant.dequantize_load``, ids pre-translated);
- the reference torch path (``reference.quantize_store_reference`` / ``dequantize_load_reference``);
- a device copy (``Tensor.copy_``) of as many bytes as the kernel reads plus writes, halved.

The engine's path (``--parts api``, GPU): ``store_from_active`` / ``load_to_active`` over a T0 ``UnifiedPool``
state side with virtual ids (host lists), 1, 4, 16 and 64 states a call, ``k`` calls back to back between
two CUDA events against as many device copies of the same bytes (``api_store_fp32_n16_vs_copy`` ...: host
time the GPU waits for counts), the host microseconds of one call (``api_host_us_per_call_n1`` ...; per
op and dtype ``api_store_fp32_n1_host_us`` ...: the median of ``10 k`` calls back to back, so a call running ahead
of the GPU pays what that costs; ``..._host_us_idle``: each call after a sync, its own host work), the device
operations one call
enqueues as CUPTI records them
(``api_device_ops_per_call_n1`` ...: kernels, copies, fills), the share of launches that took the bound path
(``..._bound_launch_share``, ``kernels/launch.py``), device-id variants at 16 (a read-back each call), and for
bf16 the store's other formulation. The
store's formulations (``--parts sweep``, GPU): one-pass tiles and the two-pass kernel, 16 states.

GB/s = 1e9 bytes/s counting bytes read plus written: store reads ``N*E*isz`` and writes ``N*E`` int8
plus ``N*L*H*d_k*isz`` of scales (``E = L*H*d_v*d_k``); load the reverse. The named metrics
(``store_fp32_GBps``, ``store_fp32_vs_torch``, ...) take the worse of the state counts; per-count
values are kept as ``store_fp32_16_GBps`` etc. Writes ``benchmarks/results/kernels-<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

if not torch.cuda.is_available():
    # Kernels must be decorated under the interpreter: set it before the package is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import commit, device_tag  # noqa: E402
from tiered_cache.kernels import launch, quant  # noqa: E402
from tiered_cache.kernels.reference import dequantize_load_reference, quantize_store_reference  # noqa: E402
from tiered_cache.specs import StateSpec  # noqa: E402
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool, envelope_layout  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def time_ms(fn: Callable[[], None], device: torch.device, reps: int) -> float:
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` on the GPU, a wall clock on CPU."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
    fn()  # warm-up (the interpreter's first call is slower)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_case(dt_name: str, n: int, shape: dict[str, int], device: torch.device, reps: int,
               value_axis: int = 1) -> dict[str, float]:
    """The kernels called directly on ``n`` states (``value_axis`` 2: states stored ``[H, d_k, d_v]``, the value
    axis innermost, as the engine path's Qwen3-Next layout; its keys end in ``_va2``)."""
    dtype = DTYPES[dt_name]
    L, H, dv, dk = shape["layers"], shape["heads"], shape["dv"], shape["dk"]
    gen = torch.Generator(device="cpu").manual_seed(n)
    rows_total = 2 * n
    # T0-like source: slot-major storage [R, L, H, d_v, d_k] seen as [L, R, ...] (strided like a pool view).
    inner = (H, dv, dk) if value_axis == 1 else (H, dk, dv)
    src = torch.randn((rows_total, L, *inner), device=device, dtype=dtype).transpose(0, 1)
    dst = torch.empty_like(src.transpose(0, 1)).transpose(0, 1)
    rows = torch.randperm(rows_total, generator=gen)[:n].to(device)
    spec = StateSpec(L, inner, dtype, value_axis=value_axis)
    va = value_axis
    pool = Int8CheckpointPool(spec, n, device)
    slots = pool.alloc(n)[torch.randperm(n, generator=gen).to(device)]
    q, s = pool.qdata, pool.scale

    # Correctness before timing: bit-exact against the reference on the very tensors timed below.
    q_ref, s_ref = torch.empty_like(q), torch.empty_like(s)
    quant.quantize_store(src, rows, q, s, slots, va, backend="triton")
    quantize_store_reference(src, rows, q_ref, s_ref, slots, va)
    assert torch.equal(q[:, slots], q_ref[:, slots]) and torch.equal(s[:, slots], s_ref[:, slots]), "store mismatch"
    dst.fill_(float("nan"))
    quant.dequantize_load(q, s, slots, dst, rows, va, backend="triton")
    want = torch.empty_like(dst)
    dequantize_load_reference(q_ref, s_ref, slots, want, rows, va)
    assert torch.equal(dst[:, rows], want[:, rows]), "load mismatch"
    del q_ref, s_ref, want

    isz = dtype.itemsize
    elems = n * L * H * dv * dk
    moved = elems * isz + elems + n * L * H * dk * isz  # same for store and load (read + write)
    copy_a = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    copy_b = torch.empty_like(copy_a)
    ms = {
        "store": time_ms(lambda: quant.quantize_store(src, rows, q, s, slots, va, backend="triton", check_ids=False),
                         device, reps),
        "load": time_ms(lambda: quant.dequantize_load(q, s, slots, dst, rows, va, backend="triton", check_ids=False),
                        device, reps),
        "store_torch": time_ms(lambda: quantize_store_reference(src, rows, q, s, slots, va), device, reps),
        "load_torch": time_ms(lambda: dequantize_load_reference(q, s, slots, dst, rows, va), device, reps),
        "copy": time_ms(lambda: copy_b.copy_(copy_a), device, reps),
    }
    copy_gbps = 2 * copy_a.numel() / ms["copy"] / 1e6
    c = f"{n}_va2" if value_axis == 2 else f"{n}"
    out: dict[str, float] = {f"copy_{dt_name}_{c}_GBps": copy_gbps}
    for op in ("store", "load"):
        gbps, torch_gbps = moved / ms[op] / 1e6, moved / ms[f"{op}_torch"] / 1e6
        out.update({
            f"{op}_{dt_name}_{c}_ms": ms[op], f"{op}_{dt_name}_{c}_GBps": gbps,
            f"{op}_{dt_name}_{c}_torch_ms": ms[f"{op}_torch"], f"{op}_{dt_name}_{c}_torch_GBps": torch_gbps,
            f"{op}_{dt_name}_{c}_vs_torch": gbps / torch_gbps, f"{op}_{dt_name}_{c}_vs_copy": gbps / copy_gbps,
        })
    return out


def gpu_ms_per_call(fn: Callable[[], None], k: int, reps: int) -> float:
    """Median GPU milliseconds per call of ``k`` calls submitted back to back between two CUDA events:
    host time the GPU waits for (launch gaps, a sync) counts, as it would in an engine."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(k):
            fn()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) / k)
    return statistics.median(out)


def host_us_per_call(fn: Callable[[], None], k: int) -> float:
    """Median host microseconds of one call (no sync inside: what the submitting thread spends)."""
    out = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def host_us_per_call_idle(fn: Callable[[], None], k: int) -> float:
    """Median host microseconds of one call made with the GPU idle (a sync before each, outside the timer):
    the call's own host work, without what running ahead of the GPU adds (a growing id ring, a full
    launch queue)."""
    out = []
    for _ in range(k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def device_ops_per_call(fn: Callable[[], None], k: int = 10) -> Optional[float]:
    """Device operations (kernels, copies, fills) one call enqueues, as CUPTI records them (``torch.profiler``);
    None where the profiler records nothing or cannot run (reported as undefined, not as a count)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(k):
                fn()
            torch.cuda.synchronize()
    except RuntimeError as err:
        print(f"device ops per call: the profiler did not run ({err})")
        return None
    ops = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(ops) / k if ops else None


def bench_api(dt_name: str, n: int, shape: dict[str, int], conv: tuple, device: torch.device,
              reps: int, k: int) -> dict[str, float]:
    """T1 through the paths an engine calls: ``store_from_active`` / ``load_to_active`` over a T0
    ``UnifiedPool`` state side with virtual ids given as host lists, against a device copy of as many
    bytes (read + written, halved), both timed as ``k`` calls back to back (GPU time per call). Checked
    first against the reference on the same tensors; ``api_host_us_per_call``: the host time of a store."""
    from tiered_cache.specs import KVSpec
    from tiered_cache.tiers.unified_pool import UnifiedPool

    dtype = DTYPES[dt_name]
    L, H, dv, dk = shape["layers"], shape["heads"], shape["dv"], shape["dk"]
    spec = StateSpec(L, (H, dk, dv), dtype, conv_shapes=conv, conv_dtype=torch.bfloat16, value_axis=2)
    kv = KVSpec(num_layers=1, kv_heads=1, head_dim=16, dtype=torch.bfloat16)
    t0 = UnifiedPool(kv, spec, low_slots=1, high_slots=2 * n, device=device)
    side = t0.side("mamba")
    gen = torch.Generator(device="cpu").manual_seed(100 + n)
    vids = side.alloc(2 * n).tolist()
    temporal, convs = side.temporal_view_all(), [side.conv_view_all(i) for i in range(len(conv))]
    rows_all = side.translate(torch.tensor(vids, device=device))
    gdev = torch.Generator(device=device).manual_seed(n)  # GBs of random states: made on the device
    temporal[:, rows_all] = torch.randn(temporal[:, rows_all].shape, generator=gdev, device=device).to(dtype)
    for c in convs:
        c[:, rows_all] = torch.randn(c[:, rows_all].shape, generator=gdev, device=device).to(c.dtype)
    pick = torch.randperm(2 * n, generator=gen)
    src = [vids[i] for i in pick[:n].tolist()]
    dst = [vids[i] for i in pick[n:].tolist()]
    pool = Int8CheckpointPool(spec, n, device)
    got = pool.alloc_ids(n)
    assert got is not None
    slots = [got[1][i] for i in torch.randperm(n, generator=gen).tolist()]

    # correctness before timing: the store's codes and scales, the loaded states and conv windows, against
    # the reference on the physical rows
    pool.store_from_active(side, src, slots)
    r_src, r_dst = side.translate(torch.tensor(src, device=device)), side.translate(torch.tensor(dst, device=device))
    sl = torch.tensor(slots, device=device)
    q_ref, s_ref = torch.empty_like(pool.qdata), torch.empty_like(pool.scale)
    quantize_store_reference(temporal, r_src, q_ref, s_ref, sl, value_axis=2)
    assert torch.equal(pool.qdata[:, sl], q_ref[:, sl]) and torch.equal(pool.scale[:, sl], s_ref[:, sl]), "api store"
    temporal[:, r_dst] = float("nan")
    pool.load_to_active(slots, side, dst)
    want = torch.empty_like(temporal)
    dequantize_load_reference(q_ref, s_ref, sl, want, r_dst, value_axis=2)
    assert torch.equal(temporal[:, r_dst], want[:, r_dst]), "api load"
    assert all(torch.equal(c[:, r_dst], c[:, r_src]) for c in convs), "api conv"
    del q_ref, s_ref, want

    isz, elems = dtype.itemsize, n * L * H * dv * dk
    conv_bytes = n * L * sum(math.prod(c) for c in conv) * 2  # bf16 windows
    moved = elems * isz + elems + n * L * H * dk * isz + 2 * conv_bytes  # read + written, either way
    copy_a = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    copy_b = torch.empty_like(copy_a)
    copy_ms = gpu_ms_per_call(lambda: copy_b.copy_(copy_a), k, reps)
    p = f"{dt_name}_n{n}"
    out: dict[str, float] = {f"api_copy_{p}_ms": copy_ms}
    calls = {"store": lambda: pool.store_from_active(side, src, slots),
             "load": lambda: pool.load_to_active(slots, side, dst)}
    for op, fn in calls.items():
        bound0, ordinary0 = launch.stats["fast"], launch.stats["ordinary"]
        ms = gpu_ms_per_call(fn, k, reps)
        out[f"api_{op}_{p}_ms"] = ms
        out[f"api_{op}_{p}_vs_copy"] = copy_ms / ms
        out[f"api_{op}_{p}_host_us"] = host_us_per_call(fn, 10 * k)
        out[f"api_{op}_{p}_host_us_idle"] = host_us_per_call_idle(fn, 10 * k)
        bound, ordinary = launch.stats["fast"] - bound0, launch.stats["ordinary"] - ordinary0
        # kernels.launch.Bound's path; undefined where no launch went through Bound (a torch path)
        out[f"api_{op}_{p}_bound_launch_share"] = bound / (bound + ordinary) if bound + ordinary else None
        ops = device_ops_per_call(fn)
        if ops is not None:
            out[f"api_{op}_{p}_device_ops_per_call"] = ops
    if dt_name != "fp32":  # the store's other formulation, for the choice of the default
        alt = None if quant._STREAM_STORE[dtype] is not None else (32, 64, 4)
        saved = quant._STREAM_STORE[dtype]
        quant._STREAM_STORE[dtype] = alt
        try:
            ms = gpu_ms_per_call(calls["store"], k, reps)
        finally:
            quant._STREAM_STORE[dtype] = saved
        out[f"api_store_{p}_{'one_pass' if alt is None else 'two_pass'}_vs_copy"] = copy_ms / ms
    if n == 16:  # the same with ids as device tensors (read back for their checks: a sync per call)
        src_t, dst_t, sl_t = (torch.tensor(x, device=device) for x in (src, dst, slots))
        out[f"api_store_{p}_devids_vs_copy"] = copy_ms / gpu_ms_per_call(
            lambda: pool.store_from_active(side, src_t, sl_t), k, reps)
        out[f"api_load_{p}_devids_vs_copy"] = copy_ms / gpu_ms_per_call(
            lambda: pool.load_to_active(sl_t, side, dst_t), k, reps)
    return out


class _StubCompiled:
    """A compiled kernel whose launcher does nothing but keep its last arguments (``--parts host``)."""

    function = packed_metadata = None
    last: tuple = ()

    def run(self, *args: object) -> None:
        self.last = args


class _StubKernel:
    """A Triton kernel as ``launch.Bound`` sees it (signature, constexprs, ``warmup``) whose ordinary launch runs
    nothing and returns ``_StubCompiled``: the bound path's host work without the kernel (``--parts host``)."""

    def __init__(self, kernel: object) -> None:
        from triton.runtime.jit import JITFunction

        self.fn = kernel.fn  # type: ignore[attr-defined]
        self.params = JITFunction(self.fn).params
        self.compiled = _StubCompiled()

    def warmup(self) -> None:
        pass

    def __getitem__(self, grid: object) -> Callable[..., _StubCompiled]:
        return lambda *args, **meta: self.compiled


def _stub_launches(launches: Any) -> _StubCompiled:
    """A plan's ``quant._Launches`` with its kernel a ``_StubKernel`` and each ``launch.Bound`` it makes on the
    bound path (the interpreter's switch turned off): the stub's compiled kernel, which keeps its last call."""
    launches.kernel = _StubKernel(launches.kernel)
    get = launches.get

    def bound(na: int) -> launch.Bound:
        b = get(na)
        b._off = False
        return b

    launches.get = bound
    return launches.kernel.compiled


def bench_host(dt_name: str, n: int, conv: tuple, k: int, reps: int) -> dict[str, float]:
    """CPU emulation of the engine's T1 path's host work (``--parts host``; never a GPU number): a real pool
    and T0 ``UnifiedPool`` side, the Triton plans bound as on a GPU (``launch.Bound``'s bound path) with the
    compiled launcher a no-op (``_StubKernel``), ids through an ``IdRing`` entry and the flags' event path as
    on a GPU (CPU stand-ins: a host copy for the H2D one, null events). Median host microseconds of
    ``store_from_active`` / ``load_to_active`` (host id lists) and the trusted ``store_rows`` / ``load_rows``,
    ``k`` calls back to back, ``reps`` times (min / median / max of the medians); checked first: each call
    takes one bound launch and hands it the translated rows and the slots."""
    from tiered_cache.specs import KVSpec
    from tiered_cache.tiers import t1_args
    from tiered_cache.tiers.unified_pool import UnifiedPool

    cpu = torch.device("cpu")
    spec = StateSpec(36, (32, 16, 16), DTYPES[dt_name], conv_shapes=conv, conv_dtype=torch.bfloat16, value_axis=2)
    side = UnifiedPool(KVSpec(num_layers=1, kv_heads=1, head_dim=16, dtype=torch.bfloat16), spec, low_slots=1,
                       high_slots=2 * n, device=cpu).side("mamba")
    vids = side.alloc(2 * n).tolist()
    pool = Int8CheckpointPool(spec, n, cpu, backend="triton")
    pool._args._ring = launch.IdRing(cpu)  # the GPU's id path: one ring entry a call (a host copy here)
    pool.flags._cpu = False  # the GPU's flags path: an event a store, read at poll
    lay = pool._args.layout(side)
    stubs = {op: [_stub_launches(plan.launches) for plan in t1_args._plans(pool, lay, op)] for op in ("store", "load")}
    got = pool.alloc_ids(n)
    assert got is not None
    slots = got[1][::-1]
    src, dst = vids[:n], vids[n:]
    rows_src, rows_dst = (side.translate_host(np.array(v, dtype=np.int64)) for v in (src, dst))
    host_slots = np.array(slots, dtype=np.int64)
    calls = {"store": lambda: pool.store_from_active(side, src, slots),
             "load": lambda: pool.load_to_active(slots, side, dst),
             "store_rows": lambda: pool.store_rows(side, rows_src, host_slots),
             "load_rows": lambda: pool.load_rows(host_slots, side, rows_dst)}
    out: dict[str, float] = {}
    for op, fn in calls.items():
        fast = launch.stats["fast"]
        fn()
        fn()  # the first call of a class is an ordinary launch (binds it); the second is bound
        # the ids the launch was given, source then destination: as kernel arguments (up to quant.PACKED), or
        # in the ring entry it read
        src_ids, dst_ids = (rows_src.tolist(), slots) if op.startswith("store") else (slots, rows_dst.tolist())
        packed = quant.pack_ids(src_ids, dst_ids)
        if packed is not None:
            got_args = stubs[op.split("_")[0]][0].last
            assert any(got_args[i:i + len(packed)] == packed for i in range(len(got_args))), f"host {op}: ids"
        else:
            ring = pool._args._ring
            ids, w = ring._ring[ring._i - 1].dev.tolist(), ring.width
            assert ids[:n] == src_ids and ids[w:w + n] == dst_ids, f"host {op}: ids"
        assert launch.stats["fast"] - fast >= 1, f"host {op}: no bound launch"
        runs = []
        for _ in range(reps):
            times = []
            for _ in range(k):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            runs.append(statistics.median(times))
        p = f"host_{op}_{dt_name}_n{n}_us"
        out.update({p: statistics.median(runs), p + "_min": min(runs), p + "_max": max(runs)})
    for op in ("store", "load"):
        out[f"host_{op}_{dt_name}_n{n}_vs_trusted"] = (out[f"host_{op}_{dt_name}_n{n}_us"]
                                                       / out[f"host_{op}_rows_{dt_name}_n{n}_us"])
    return out


def _sweep_dtype(dt_name: str, shape: dict[str, int], device: torch.device, n: int = 16,
                 quick: bool = False) -> dict[str, float]:
    """One dtype's store formulations in three layouts: ``va1`` (states ``[H, d_v, d_k]``, SGLang's temporal
    order, codes in the pool's ``[d_v, d_k]``), ``va2`` (states ``[H, d_k, d_v]``, FLA / transformers' order,
    codes transposed into ``[d_v, d_k]``: the pool's layout today) and ``va2q`` (the same states, codes kept in
    the states' own ``[d_k, d_v]`` order: a transposed view of ``qdata``, no layout change in the kernel)."""
    dtype = DTYPES[dt_name]
    L, H, dv, dk = shape["layers"], shape["heads"], shape["dv"], shape["dk"]
    elems = n * L * H * dv * dk
    moved = elems * dtype.itemsize + elems + n * L * H * dk * dtype.itemsize
    a_ = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    b_ = torch.empty_like(a_)
    copy_ms = time_ms(lambda: b_.copy_(a_), device, 1)
    configs: list[tuple[str, Optional[tuple[int, int, int]], int, int]] = [
        ("one_pass", None, t, w) for t, w in ((8192, 4), (4096, 4), (4096, 2), (4096, 1), (2048, 1), (2048, 2),
                                               (8192, 8), (16384, 8))]
    configs += [("two_pass", c, 0, 0) for c in ((32, 64, 4), (64, 64, 8))]
    if quick:  # the kernels' own tile only: each formulation at 8,192 / 4 warps
        configs = [c for c in configs if c[0] != "two_pass" and c[2:] == (8192, 4)]
    out: dict[str, float] = {}
    for layout in ("va1", "va2", "va2q"):
        out.update(_sweep_layout(dt_name, layout, shape, device, n, copy_ms, configs))
    return out


def _sweep_layout(dt_name: str, layout: str, shape: dict[str, int], device: torch.device, n: int, copy_ms: float,
                  configs: list[tuple[str, Optional[tuple[int, int, int]], int, int]]) -> dict[str, float]:
    dtype = DTYPES[dt_name]
    L, H, dv, dk = shape["layers"], shape["heads"], shape["dv"], shape["dk"]
    inner = (H, dv, dk) if layout == "va1" else (H, dk, dv)
    src = torch.randn((2 * n, L, *inner), device=device, dtype=dtype).transpose(0, 1)
    va = 1 if layout == "va1" else 2
    rows = torch.randperm(2 * n, device=device)[:n]
    pool = Int8CheckpointPool(StateSpec(L, (H, dv, dk), dtype), n, device)
    slots = pool.alloc(n)
    q_ref, s_ref = torch.empty_like(pool.qdata), torch.empty_like(pool.scale)
    quantize_store_reference(src, rows, q_ref, s_ref, slots, va)
    # va2q: the codes' storage [L, S, H, d_k, d_v], seen as [L, S, H, d_v, d_k] (strides swapped)
    qdata = (pool.qdata if layout != "va2q" else
             torch.zeros((L, n + 1, H, dk, dv), dtype=torch.int8, device=device).transpose(3, 4))
    out: dict[str, float] = {}
    for kind, stream, tile, warps in configs:
        quant._STREAM_STORE[dtype] = stream
        if stream is None:
            quant._STORE_TILE, quant._STORE_WARPS = tile, warps
        tag = f"{layout}_{tile}_w{warps}" if stream is None else f"{layout}_{stream[0]}x{stream[1]}_w{stream[2]}"
        qdata[:, slots] = 0
        quant.quantize_store(src, rows, qdata, pool.scale, slots, va, backend="triton")
        exact = torch.equal(qdata[:, slots], q_ref[:, slots]) and torch.equal(pool.scale[:, slots], s_ref[:, slots])
        out[f"sweep_store_{dt_name}_{kind}_{tag}_bit_exact"] = float(exact)
        if not exact:  # reported, not timed: a formulation that differs from the reference is no candidate
            print(f"sweep: {dt_name} {kind} {tag} differs from the reference")
            continue
        ms = time_ms(lambda: quant.quantize_store(src, rows, qdata, pool.scale, slots, va, backend="triton",
                                                  check_ids=False), device, 1)
        out[f"sweep_store_{dt_name}_{kind}_{tag}_vs_copy"] = copy_ms / ms
    return out


def store_sweep(shape: dict[str, int], device: torch.device, dtypes: Optional[list[str]] = None,
                quick: bool = False) -> dict[str, float]:
    """The store's formulations (one-pass tile / warps, two-pass rows a step / warps), 16 states, each
    checked bit-exact against the reference first, timed against a device copy of its bytes."""
    out: dict[str, float] = {}
    saved = quant._STORE_TILE, quant._STORE_WARPS, dict(quant._STREAM_STORE)

    def restore() -> None:
        quant._STORE_TILE, quant._STORE_WARPS = saved[0], saved[1]
        quant._STREAM_STORE.update(saved[2])

    try:
        for dt_name in dtypes or list(DTYPES):
            out.update(_sweep_dtype(dt_name, shape, device, quick=quick))
            restore()
            torch.cuda.empty_cache()
    finally:
        restore()
    return out


def capacity_metrics(shape: dict[str, int], conv: tuple) -> dict[str, float]:
    """States per GiB of a T1 pool: int8 envelopes vs lossless fp32 / bf16 ones (same conv window)."""
    def slot(dtype: torch.dtype, codec: str, convs: tuple) -> int:
        spec = StateSpec(shape["layers"], (shape["heads"], shape["dv"], shape["dk"]), dtype,
                         conv_shapes=convs, conv_dtype=torch.bfloat16)
        return envelope_layout(spec, codec)[1]

    int8 = slot(torch.float32, "int8", conv)
    return {
        "states_per_GiB_int8": 2**30 / int8,
        "states_per_GiB_int8_vs_fp32": slot(torch.float32, "lossless", conv) / int8,
        "states_per_GiB_int8_vs_bf16": slot(torch.bfloat16, "lossless", conv) / slot(torch.bfloat16, "int8", conv),
        "states_per_GiB_int8_vs_fp32_temporal_only":
            slot(torch.float32, "lossless", ()) / slot(torch.float32, "int8", ()),
    }


def write_results(out_dir: Path, record: dict, dtypes: list[str], states: list[int]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"kernels-{record['dev_short']}"
    m = record["metrics"]
    public = {k: v for k, v in record.items() if k not in ("dev_short", "named")}
    stem.with_suffix(".json").write_text(json.dumps(public, indent=2) + "\n")
    lines = [
        "# Kernels: int8 quantize-store / dequantize-load", "",
        f"- device: {record['device']}", f"- date: {record['date']}", f"- commit: {record['commit']}",
        f"- command: `{record['command']}`", f"- state: {record['shape']}", "",
        "GB/s = 1e9 bytes/s, read + written. `torch`: the reference path; `copy`: a device copy of the same bytes.",
        "", "| op | dtype | states | ms | GB/s | torch GB/s | copy GB/s | vs torch | vs copy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for dt in dtypes:
        for n in [*states, *(f"{x}_va2" for x in states)]:
            for op in ("store", "load"):
                p = f"{op}_{dt}_{n}"
                lines.append(f"| {op} | {dt} | {n} | {m[p + '_ms']:.3f} | {m[p + '_GBps']:.0f} | "
                             f"{m[p + '_torch_GBps']:.0f} | {m[f'copy_{dt}_{n}_GBps']:.0f} | "
                             f"{m[p + '_vs_torch']:.2f} | {m[p + '_vs_copy']:.3f} |")
    lines += ["", "Named metrics (the worse of the state counts):", "", "| metric | value |", "|---|---|"]
    lines += [f"| `{k}` | {m[k]:.3f} |" for k in record["named"]]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return stem


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", type=int, nargs="+", default=None, help="states per call (default 16 64)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--sweep-quick", action="store_true",
                        help="--parts sweep at the kernels' own tile only (each formulation and layout at 8,192 / 4)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run through the interpreter)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions on CPU (GPU: do_bench)")
    parser.add_argument("--parts", nargs="+", choices=["kernels", "api", "sweep", "host"], default=["kernels", "api"],
                        help="what to run: the kernels called directly, the engine's path (api, GPU only), the "
                             "store formulations' sweep (GPU only), the engine's path's host work with the launch "
                             "stubbed (host, CPU only, alone: kernels-host-cpu.json); each prints its numbers as it "
                             "finishes")
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if "host" in args.parts:
        if device.type == "cuda" or args.parts != ["host"]:
            parser.error("--parts host runs alone, on CPU (on a GPU, --parts api reports api_*_host_us)")
        return main_host(args, argv)
    if args.small:
        shape, conv, states = dict(layers=2, heads=2, dv=64, dk=64), ((16, 3),), args.states or [2, 4]
    else:
        if device.type != "cuda":
            parser.error("full size needs CUDA; use --small on CPU")
        # Qwen3-Next-80B: 36 linear layers, 32 value heads of 128 x 128; conv window [8192, 3] bf16.
        shape, conv, states = dict(layers=36, heads=32, dv=128, dk=128), ((8192, 3),), args.states or [16, 64]
    metrics: dict[str, float] = {}
    t_start = time.perf_counter()

    def progress(what: str, got: dict[str, float]) -> None:  # a run cut short still shows what it measured
        print(f"[{time.perf_counter() - t_start:6.1f} s] {what}: " + ", ".join(
            f"{k} {v:.3f}" for k, v in got.items() if k.endswith(("vs_copy", "host_us", "host_us_idle", "bit_exact",
                                                                 "_per_call", "_share"))), flush=True)

    if "kernels" in args.parts:
        for dt in args.dtypes:
            for n in states:
                for va in (1, 2):  # the value axis outer (the kernels' own layout), and innermost (the engine's)
                    got = bench_case(dt, n, shape, device, args.reps, va)
                    metrics.update(got)
                    progress(f"kernels {dt} {n}{'' if va == 1 else ' va2'}", got)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()  # the case's GBs are garbage now: give them back before the next
    if device.type == "cuda" and not args.small:
        if "api" in args.parts:
            for dt in args.dtypes:
                for n in (1, 4, 16, 64):
                    got = bench_api(dt, n, shape, conv, device, 5, 20)
                    metrics.update(got)
                    progress(f"api {dt} n{n}", got)
                    torch.cuda.empty_cache()
        if "sweep" in args.parts:
            got = store_sweep(shape, device, args.dtypes, args.sweep_quick)
            metrics.update(got)
            progress("sweep", got)
    named: dict[str, float] = {}
    if "kernels" in args.parts:
        for dt in args.dtypes:
            for op in ("store", "load"):
                for what in ("GBps", "vs_torch", "vs_copy"):
                    named[f"{op}_{dt}_{what}"] = min(metrics[f"{op}_{dt}_{n}_{what}"] for n in states)
                    named[f"{op}_{dt}_va2_{what}"] = min(metrics[f"{op}_{dt}_{n}_va2_{what}"] for n in states)
    if any(k.startswith("api_") for k in metrics):
        for dt in args.dtypes:
            for n in (1, 4, 16, 64):
                for op in ("store", "load"):
                    named[f"api_{op}_{dt}_n{n}_vs_copy"] = metrics[f"api_{op}_{dt}_n{n}_vs_copy"]
        for n in (1, 4, 16, 64):
            named[f"api_host_us_per_call_n{n}"] = max(metrics[f"api_{op}_{dt}_n{n}_host_us"]
                                                      for dt in args.dtypes for op in ("store", "load"))
            ops = [metrics.get(f"api_{op}_{dt}_n{n}_device_ops_per_call") for dt in args.dtypes
                   for op in ("store", "load")]
            if None not in ops:  # undefined where the profiler recorded nothing
                named[f"api_device_ops_per_call_n{n}"] = max(ops)
    named.update(capacity_metrics(shape, conv))
    metrics = {**named, **metrics}
    record = {
        "bench": "kernels",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dev_short": device_tag(),
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "command": "python benchmarks/bench_kernels.py" + "".join(f" {a}" for a in (argv if argv is not None
                                                                                      else sys.argv[1:])),
        "shape": f"{shape['layers']} layers x {shape['heads']} heads x {shape['dv']} x {shape['dk']}, conv {conv}",
        "metrics": metrics,
        "named": list(named),
    }
    stem = write_results(args.out, record, args.dtypes, states if "kernels" in args.parts else [])
    print(f"{'op':6} {'dtype':5} {'states':>6} {'GB/s':>8} {'torch':>8} {'copy':>8} {'x torch':>8} {'x copy':>7}")
    for dt in args.dtypes:
        for n in [*states, *(f"{x}_va2" for x in states)] if "kernels" in args.parts else []:
            for op in ("store", "load"):
                p = f"{op}_{dt}_{n}"
                print(f"{op:6} {dt:5} {n:>7} {metrics[p + '_GBps']:8.0f} {metrics[p + '_torch_GBps']:8.0f} "
                      f"{metrics[f'copy_{dt}_{n}_GBps']:8.0f} {metrics[p + '_vs_torch']:8.2f} "
                      f"{metrics[p + '_vs_copy']:7.3f}")
    print(f"states per GiB, int8 vs fp32: {metrics['states_per_GiB_int8_vs_fp32']:.2f}x "
          f"(temporal only {metrics['states_per_GiB_int8_vs_fp32_temporal_only']:.2f}x)")
    print(f"wrote {stem}.json and {stem}.md")
    return record


def main_host(args: argparse.Namespace, argv: Optional[list[str]]) -> dict:
    """``--parts host``: ``bench_host`` for each dtype and 1, 4, 16 and 64 states (``--states``), written to
    ``kernels-host-cpu.{json,md}``, labelled a CPU emulation with the launch stubbed."""
    metrics: dict[str, float] = {}
    getters = launch._driver_getters
    launch._driver_getters = lambda: ((lambda device: 0), (lambda: 0))  # no driver: stream 0 of device 0
    try:
        for dt in args.dtypes:
            for n in args.states or [1, 4, 16, 64]:
                got = bench_host(dt, n, ((64, 3),), 400 if args.small else 2000, max(args.reps, 3))
                metrics.update(got)
                print(f"host {dt} n{n}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items()
                                                      if k.endswith(("_us", "trusted"))), flush=True)
    finally:
        launch._driver_getters = getters
    record = {
        "bench": "kernels-host", "device": "cpu (emulation: the compiled launcher stubbed, not a GPU number)",
        "date": datetime.date.today().isoformat(), "commit": commit(),
        "command": "python benchmarks/bench_kernels.py" + "".join(f" {a}" for a in (argv if argv is not None
                                                                                      else sys.argv[1:])),
        "method": bench_host.__doc__, "metrics": metrics,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "kernels-host-cpu"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2) + "\n")
    lines = ["# T1 host work per call (CPU emulation, launch stubbed)", "", f"- device: {record['device']}",
             f"- date: {record['date']}", f"- commit: {record['commit']}", f"- command: `{record['command']}`", "",
             "| call | dtype | states | median us | min | max |", "|---|---|---|---|---|---|"]
    for key, v in metrics.items():
        if key.endswith("_us"):
            op, dt, n = key[5:-3].rsplit("_", 2)
            lines.append(f"| {op} | {dt} | {n[1:]} | {v:.1f} | {metrics[key + '_min']:.1f} | "
                         f"{metrics[key + '_max']:.1f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {stem}.json and {stem}.md")
    return record


if __name__ == "__main__":
    main()
