"""T0 benchmark: allocator operations per second, and the compaction move against a device copy.

ops: 10^6 mixed operations (alloc 1-4 pages, free, translate a batch) on a KV + state pool, random
but seeded; counts operations per second of wall time (the allocator is host code).
compaction (GPU only): a state side with every other slot freed, compacted by the Triton move
kernel; GB/s counts bytes read + written, next to ``torch`` copying the same number of bytes
between two contiguous buffers in the same run.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import bench_gpu, write_results  # noqa: E402
from tiered_cache import KVSpec, StateSpec, UnifiedPool  # noqa: E402
from tiered_cache.kernels.move import move_rows  # noqa: E402
from tiered_cache.kernels.reference import move_rows_reference  # noqa: E402


def bench_ops(n_ops: int, device: str) -> dict:
    kv = KVSpec(num_layers=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    st = StateSpec(num_layers=4, temporal_shape=(4, 32, 32), conv_shapes=((256, 3),))
    pool = UnifiedPool(kv, st, low_slots=4096, high_slots=256, page_size=16, device=device, lazy_compaction=True)
    full, mamba = pool.side("full"), pool.side("mamba")
    rng = random.Random(0)
    held_kv, held_st = [], []
    batch = torch.arange(0, 64 * 16, 16, device=device)
    counts = {"alloc": 0, "free": 0, "translate": 0, "none": 0}
    t0 = time.perf_counter()
    for _ in range(n_ops):
        r = rng.random()
        if r < 0.4:
            if rng.random() < 0.8:
                got = full.alloc(16 * rng.randint(1, 4))
                held = held_kv
            else:
                got = mamba.alloc(1)
                held = held_st
            counts["alloc"] += 1
            if got is None:
                counts["none"] += 1
            else:
                held.append(got)
        elif r < 0.8:
            held = held_kv if (held_kv and rng.random() < 0.8) or not held_st else held_st
            if held:
                side = full if held is held_kv else mamba
                side.free(held.pop(rng.randrange(len(held))))
                counts["free"] += 1
        else:
            full.translate(batch)
            counts["translate"] += 1
    if device != "cpu":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    pool.check_invariants()
    return {"ops_per_s": n_ops / dt, **{f"ops_{k}": float(v) for k, v in counts.items()}}


def bench_compaction(n_slots: int) -> dict:
    # A Qwen3-Next-like state envelope, 8 layers of [32, 128, 128] fp32 per slot (~16.8 MB).
    st = StateSpec(num_layers=8, temporal_shape=(32, 128, 128), conv_shapes=((8192, 3),))
    kv = KVSpec(num_layers=1, kv_heads=1, head_dim=64)
    pool = UnifiedPool(kv, st, low_slots=1, high_slots=n_slots, device="cuda")
    side = pool.side("mamba")
    side.alloc(n_slots)
    side.rows_bytes()[:] = torch.randint(0, 256, side.rows_bytes().shape, dtype=torch.uint8, device="cuda")
    cap = side.capacity
    # Free every other slot: compaction moves the upper half's live slots into the lower half's holes.
    half = n_slots // 2
    src = torch.tensor([cap - 1 - r for r in range(half + 1, n_slots + 1) if r % 2 == 1], device="cuda")
    dst = torch.tensor([cap - 1 - r for r in range(2, half + 1, 2)], device="cuda")[: src.numel()]
    src = src[: dst.numel()]
    # correctness before timing
    ref = pool.raw.clone()
    move_rows_reference(ref, side.base, side.entry_bytes, cap, src, dst)
    move_rows(pool.raw, side.base, side.entry_bytes, cap, src, dst, backend="triton")
    assert torch.equal(ref, pool.raw), "move kernel disagrees with its reference"
    nbytes = src.numel() * side.entry_bytes
    ms_move = bench_gpu(lambda: move_rows(pool.raw, side.base, side.entry_bytes, cap, src, dst, backend="triton"))
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms_copy = bench_gpu(lambda: b.copy_(a))
    ms_ref = bench_gpu(lambda: move_rows_reference(pool.raw, side.base, side.entry_bytes, cap, src, dst))
    gbps = 2 * nbytes / ms_move / 1e6
    copy_gbps = 2 * nbytes / ms_copy / 1e6
    return {"compaction_GBps": gbps, "copy_GBps": copy_gbps, "compaction_vs_copy": gbps / copy_gbps,
            "compaction_torch_GBps": 2 * nbytes / ms_ref / 1e6, "compaction_bytes_moved": float(nbytes),
            "compaction_slots_moved": float(src.numel())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ops", type=int, default=1_000_000)
    p.add_argument("--slots", type=int, default=256, help="state slots in the compaction test (GPU)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    metrics = bench_ops(args.ops, device)
    if device == "cuda":
        metrics.update(bench_compaction(args.slots))
    path = write_results("pool", metrics, out_dir=args.out)
    for k, v in metrics.items():
        print(f"{k:28s} {v:,.3f}")
    print("wrote", path)


if __name__ == "__main__":
    main()
