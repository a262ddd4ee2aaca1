"""Benchmark: fused int8 quantize-store / dequantize-load vs the torch reference and a device copy.

    python benchmarks/bench_kernels.py                 # H200: 36 layers x 32 heads x 128 x 128, 16 and 64 states
    python benchmarks/bench_kernels.py --small         # CPU smoke run (Triton interpreter), tiny shapes

For each state dtype (fp32, bf16) and states per call (16, 64): states sit scattered in a T0-like
slot-major buffer (twice as many rows as states, random rows) and go to random T1 slots of an
``Int8CheckpointPool``. Correctness is checked first (int8 codes, scales and dequantized states
bit-exact against the reference). Then, in the same run, three timings of the same bytes:

- the fused Triton kernel (``quant.quantize_store`` / ``quant.dequantize_load``, ids pre-translated);
- the reference torch path (``reference.quantize_store_reference`` / ``dequantize_load_reference``);
- a device copy (``Tensor.copy_``) of as many bytes as the kernel reads plus writes, halved.

GB/s = 1e9 bytes/s counting bytes read plus written: store reads ``N*E*isz`` and writes ``N*E`` int8
plus ``N*L*H*d_k*isz`` of scales (``E = L*H*d_v*d_k``); load the reverse. The named metrics
(``store_fp32_GBps``, ``store_fp32_vs_torch``, ...) take the worse of the state counts; per-count
values are kept as ``store_fp32_16_GBps`` etc. Writes ``benchmarks/results/kernels-<device>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

import torch

if not torch.cuda.is_available():
    # Kernels must be decorated under the interpreter: set it before the package is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.common import commit, device_tag  # noqa: E402
from tiered_cache.kernels import quant  # noqa: E402
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


def bench_case(dt_name: str, n: int, shape: dict[str, int], device: torch.device, reps: int) -> dict[str, float]:
    dtype = DTYPES[dt_name]
    L, H, dv, dk = shape["layers"], shape["heads"], shape["dv"], shape["dk"]
    gen = torch.Generator(device="cpu").manual_seed(n)
    rows_total = 2 * n
    # T0-like source: slot-major storage [R, L, H, d_v, d_k] seen as [L, R, ...] (strided like a pool view).
    src = torch.randn((rows_total, L, H, dv, dk), device=device, dtype=dtype).transpose(0, 1)
    dst = torch.empty_like(src.transpose(0, 1)).transpose(0, 1)
    rows = torch.randperm(rows_total, generator=gen)[:n].to(device)
    spec = StateSpec(L, (H, dv, dk), dtype)
    pool = Int8CheckpointPool(spec, n, device)
    slots = pool.alloc(n)[torch.randperm(n, generator=gen).to(device)]
    q, s = pool.qdata, pool.scale

    # Correctness before timing: bit-exact against the reference on the very tensors timed below.
    q_ref, s_ref = torch.empty_like(q), torch.empty_like(s)
    quant.quantize_store(src, rows, q, s, slots, backend="triton")
    quantize_store_reference(src, rows, q_ref, s_ref, slots)
    assert torch.equal(q[:, slots], q_ref[:, slots]) and torch.equal(s[:, slots], s_ref[:, slots]), "store mismatch"
    dst.fill_(float("nan"))
    quant.dequantize_load(q, s, slots, dst, rows, backend="triton")
    want = torch.empty_like(dst)
    dequantize_load_reference(q_ref, s_ref, slots, want, rows)
    assert torch.equal(dst[:, rows], want[:, rows]), "load mismatch"
    del q_ref, s_ref, want

    isz = dtype.itemsize
    elems = n * L * H * dv * dk
    moved = elems * isz + elems + n * L * H * dk * isz  # same for store and load (read + write)
    copy_a = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    copy_b = torch.empty_like(copy_a)
    ms = {
        "store": time_ms(lambda: quant.quantize_store(src, rows, q, s, slots, backend="triton", check_ids=False),
                         device, reps),
        "load": time_ms(lambda: quant.dequantize_load(q, s, slots, dst, rows, backend="triton", check_ids=False),
                        device, reps),
        "store_torch": time_ms(lambda: quantize_store_reference(src, rows, q, s, slots), device, reps),
        "load_torch": time_ms(lambda: dequantize_load_reference(q, s, slots, dst, rows), device, reps),
        "copy": time_ms(lambda: copy_b.copy_(copy_a), device, reps),
    }
    copy_gbps = 2 * copy_a.numel() / ms["copy"] / 1e6
    out: dict[str, float] = {f"copy_{dt_name}_{n}_GBps": copy_gbps}
    for op in ("store", "load"):
        gbps, torch_gbps = moved / ms[op] / 1e6, moved / ms[f"{op}_torch"] / 1e6
        out.update({
            f"{op}_{dt_name}_{n}_ms": ms[op], f"{op}_{dt_name}_{n}_GBps": gbps,
            f"{op}_{dt_name}_{n}_torch_ms": ms[f"{op}_torch"], f"{op}_{dt_name}_{n}_torch_GBps": torch_gbps,
            f"{op}_{dt_name}_{n}_vs_torch": gbps / torch_gbps, f"{op}_{dt_name}_{n}_vs_copy": gbps / copy_gbps,
        })
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
        for n in states:
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
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke run through the interpreter)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions on CPU (GPU: do_bench)")
    args = parser.parse_args(argv)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if args.small:
        shape, conv, states = dict(layers=2, heads=2, dv=64, dk=64), ((16, 3),), args.states or [2, 4]
    else:
        if device.type != "cuda":
            parser.error("full size needs CUDA; use --small on CPU")
        # Qwen3-Next-80B: 36 linear layers, 32 value heads of 128 x 128; conv window [8192, 3] bf16.
        shape, conv, states = dict(layers=36, heads=32, dv=128, dk=128), ((8192, 3),), args.states or [16, 64]
    metrics: dict[str, float] = {}
    for dt in args.dtypes:
        for n in states:
            metrics.update(bench_case(dt, n, shape, device, args.reps))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the case's GBs are garbage now: give them back before the next
    named: dict[str, float] = {}
    for dt in args.dtypes:
        for op in ("store", "load"):
            for what in ("GBps", "vs_torch", "vs_copy"):
                named[f"{op}_{dt}_{what}"] = min(metrics[f"{op}_{dt}_{n}_{what}"] for n in states)
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
    stem = write_results(args.out, record, args.dtypes, states)
    print(f"{'op':6} {'dtype':5} {'states':>6} {'GB/s':>8} {'torch':>8} {'copy':>8} {'x torch':>8} {'x copy':>7}")
    for dt in args.dtypes:
        for n in states:
            for op in ("store", "load"):
                p = f"{op}_{dt}_{n}"
                print(f"{op:6} {dt:5} {n:>6} {metrics[p + '_GBps']:8.0f} {metrics[p + '_torch_GBps']:8.0f} "
                      f"{metrics[f'copy_{dt}_{n}_GBps']:8.0f} {metrics[p + '_vs_torch']:8.2f} "
                      f"{metrics[p + '_vs_copy']:7.3f}")
    print(f"states per GiB, int8 vs fp32: {metrics['states_per_GiB_int8_vs_fp32']:.2f}x "
          f"(temporal only {metrics['states_per_GiB_int8_vs_fp32_temporal_only']:.2f}x)")
    print(f"wrote {stem}.json and {stem}.md")
    return record


if __name__ == "__main__":
    main()
