"""T2 transfer benchmark: scattered demote / promote against a contiguous pinned copy, on one GPU.

Data: Qwen3-Next-80B-like int8 state envelopes (36 layers x [32, 128, 128] + scales + conv windows,
~21 MB each) and full-attention KV pages (12 layers, 2 KV heads x 256, bf16, 16 tokens: 384 KiB).
All in one run:
- baseline: contiguous pinned copies of the same number of bytes, each direction and both at once;
- ours: scattered T1 -> T2 demote, T2 -> T1 promote (checksummed), both directions at once, for the
  ``copy``, ``staging``, ``kernel`` and ``auto`` methods; KV pages the same way, and KV pages whose
  host slots are consecutive ("kv-runs");
- each timed two ways against the baseline timed the same way: one call then a wait ("single
  call"), and ``PIPELINE`` calls in flight then one wait ("sustained");
- the headline state metrics (``d2h_GBps``, ``h2d_GBps``, ``bidir_GBps`` and their ``*_vs_contiguous``):
  sustained state moves timed in ``--rounds`` rounds, each round the baseline then ours back to back
  (medians; the ratio is the median of the rounds' ratios);
- the mapped-memory kernel's settings swept (programs x words per step x warps);
- a bf16 GEMM on the compute stream alone, then while transfers run (``gemm_slowdown``: GPU time by
  CUDA events; ``gemm_slowdown_wall``: wall clock);
- the checksum's cost: the same state moves with checksums switched off, in interleaved rounds
  (``checksum_overhead``: the median round's time with / without - 1), the same for KV pages
  (``checksum_overhead_kv``: sustained both ways; ``checksum_overhead_kv_single_call`` beside it), and
  a diagnostic of which direction's checksums slow sustained both-ways moves (``diag_bidir_*``);
- pinning 1 GiB with ``pin_memory`` against ``cudaHostRegister``.
GB/s counts bytes crossing PCIe (one side of each copy).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_results  # noqa: E402
from tiered_cache import KVSpec, StateSpec, UnifiedPool  # noqa: E402
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool  # noqa: E402
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec  # noqa: E402
from tiered_cache.transfer.engine import TransferEngine  # noqa: E402
from tiered_cache.transfer.moves import demote_kv, demote_states, load_kv, promote_states  # noqa: E402


def _off(eng, fn):
    """``fn()`` with ``eng``'s checksums switched off."""
    eng.checksums = False
    try:
        return fn()
    finally:
        eng.checksums = True


def _sync() -> None:
    if torch.cuda.is_available():  # the CPU smoke test times the same helpers without a device
        torch.cuda.synchronize()


def timed(fn, reps: int) -> float:
    """Median wall seconds of ``fn`` (which must end synchronized)."""
    out = []
    fn()
    for _ in range(reps):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


PIPELINE = 4  # calls in flight for the sustained numbers (an engine keeps several tickets queued)


def contiguous_fns(nbytes: int, dev: torch.device) -> dict:
    """One pinned host buffer <-> one device buffer: callables for each way and both ways at once, one
    call (``d2h``, ...) and ``PIPELINE`` calls back to back (``d2h_sustained``, ...)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    devb = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    devb2 = torch.empty_like(devb)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(s1):
            host.copy_(devb, non_blocking=True)
        with torch.cuda.stream(s2):
            devb2.copy_(host2, non_blocking=True)

    def many(fn, k=PIPELINE):
        def run():
            for _ in range(k):
                fn()
        return run

    one = {"d2h": lambda: host.copy_(devb, non_blocking=True), "h2d": lambda: devb.copy_(host, non_blocking=True),
           "bidir": both}
    return {**one, **{f"{d}_sustained": many(fn) for d, fn in one.items()}}


def contiguous_baseline(name: str, nbytes: int, dev: torch.device, reps: int) -> dict:
    """The baseline, each way and both ways at once, one call and sustained."""
    fns = contiguous_fns(nbytes, dev)
    out = {}
    for d in ("d2h", "h2d", "bidir"):
        k = 2 if d == "bidir" else 1
        out[f"contig_{name}_{d}_sustained_GBps"] = k * PIPELINE * nbytes / timed(fns[f"{d}_sustained"], reps) / 1e9
    for d in ("d2h", "h2d", "bidir"):
        k = 2 if d == "bidir" else 1
        out[f"contig_{name}_{d}_GBps"] = k * nbytes / timed(fns[d], reps) / 1e9
    return out


def interleaved(base, ours, rounds: int) -> tuple[float, float, float, float]:
    """Time ``base`` and ``ours`` back to back, ``rounds`` times. Returns the median seconds of each,
    and the median and the lowest of the per-round ratios base / ours (1.0: as fast as the baseline)."""
    b, o = [], []
    for _ in range(rounds):
        b.append(timed(base, 1))
        o.append(timed(ours, 1))
    ratios = [x / y for x, y in zip(b, o)]
    return statistics.median(b), statistics.median(o), statistics.median(ratios), min(ratios)


def checksum_overheads(eng, moves: dict, rounds: int) -> dict:
    """What checksums cost each named move (a callable that ends synchronized): its time with checksums
    / without - 1, timed in ``rounds`` interleaved rounds (``name``: the median round's ratio;
    ``name_worst_round``: the lowest). The PCIe rate drifts between measurements; timed one after the
    other, the same overhead measured -0.005 and 0.10 on two calls."""
    out = {}
    for name, fn in moves.items():
        _, _, ratio, low = interleaved(lambda fn=fn: _off(eng, fn), fn, rounds)
        out[name] = 1 / ratio - 1
        out[f"{name}_worst_round"] = 1 / low - 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--states", type=int, default=32, help="state envelopes per call")
    p.add_argument("--pages", type=int, default=2048, help="KV pages per call")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds of the headline state moves")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_transfer needs a GPU; nothing measured")
        return
    dev = torch.device("cuda")
    st = StateSpec(num_layers=36, temporal_shape=(32, 128, 128), temporal_dtype=torch.float32,
                   conv_shapes=((8192, 3),), conv_dtype=torch.bfloat16, value_axis=2)
    kv = KVSpec(num_layers=12, kv_heads=2, head_dim=256, dtype=torch.bfloat16)
    n_st, n_pg = a.states, a.pages
    t1 = Int8CheckpointPool(st, 2 * n_st, device=dev)
    pool = UnifiedPool(kv, st, low_slots=2 * n_pg, high_slots=1, page_size=16, device=dev)
    full = pool.side("full")
    metrics: dict = {}

    # pinning: pin_memory vs cudaHostRegister, 1 GiB each
    for method in ("pin_memory", "register"):
        t0 = time.perf_counter()
        m = HostMirror([RegionSpec("x", 1 << 20, 1023)], pin=method)
        metrics[f"pin_1GiB_{method}_s"] = time.perf_counter() - t0
        m.close()
        del m

    mirror = HostMirror([RegionSpec("state", t1.slot_bytes, 2 * n_st), RegionSpec("full", full.entry_bytes, 2 * n_pg)])
    sreg, kreg = mirror.region("state"), mirror.region("full")
    # scattered ids on both sides: a random permutation, so no two neighbours are adjacent in memory
    g = torch.Generator().manual_seed(0)
    t1_ids = t1.alloc(2 * n_st).tolist()
    t1.envelopes.copy_(torch.randint(0, 256, t1.envelopes.shape, dtype=torch.uint8, generator=g).to(dev))
    src_st = [t1_ids[i] for i in torch.randperm(2 * n_st, generator=g)[:n_st].tolist()]
    dst_st = [i for i in t1_ids if i not in set(src_st)]
    got = sreg.alloc(2 * n_st)
    hs_st = [got[i] for i in torch.randperm(2 * n_st, generator=g).tolist()]
    toks = full.alloc(16 * 2 * n_pg)
    full.rows_bytes().copy_(torch.randint(0, 256, full.rows_bytes().shape, dtype=torch.uint8, generator=g).to(dev))
    pages = toks.view(-1, 16)
    perm = torch.randperm(2 * n_pg, generator=g)
    src_pg, dst_pg = pages[perm[:n_pg]].reshape(-1), pages[perm[n_pg:]].reshape(-1)
    got = kreg.alloc(2 * n_pg)
    hs_pg = [got[i] for i in torch.randperm(2 * n_pg, generator=g).tolist()]
    st_bytes, pg_bytes = n_st * t1.slot_bytes, n_pg * full.entry_bytes

    # baseline: contiguous pinned copies of the same bytes
    for name, nbytes in (("state", st_bytes), ("kv", pg_bytes)):
        metrics.update(contiguous_baseline(name, nbytes, dev, a.reps))

    def run_states(eng, direction):
        if direction == "d2h":
            eng.wait(demote_states(eng, t1, src_st, sreg, hs_st[:n_st]))
        elif direction == "h2d":
            eng.wait(promote_states(eng, sreg, hs_st[:n_st], t1, dst_st))
        else:
            a_ = demote_states(eng, t1, src_st, sreg, hs_st[n_st:])
            b_ = promote_states(eng, sreg, hs_st[:n_st], t1, dst_st)
            eng.wait(a_)
            eng.wait(b_)

    def run_kv(eng, direction):
        if direction == "d2h":
            eng.wait(demote_kv(eng, full, src_pg, kreg, hs_pg[:n_pg]))
        elif direction == "h2d":
            eng.wait(load_kv(eng, kreg, hs_pg[:n_pg], full, dst_pg, layerwise=False))
        else:
            a_ = demote_kv(eng, full, src_pg, kreg, hs_pg[n_pg:])
            b_ = load_kv(eng, kreg, hs_pg[:n_pg], full, dst_pg, layerwise=False)
            eng.wait(a_)
            eng.wait(b_)

    def pipelined(fn, eng, direction):
        """``PIPELINE`` submissions of ``fn``'s moves, then one wait for all (the same slots each time:
        the host slots are busy only until each ticket completes, so later calls queue behind)."""
        if direction == "bidir":
            for _ in range(PIPELINE):
                submit(fn, eng, "d2h_b")
                submit(fn, eng, "h2d")
        else:
            for _ in range(PIPELINE):
                submit(fn, eng, direction)
        eng.wait_all()

    def submit(fn, eng, direction):
        states = fn is run_states
        if direction == "d2h":
            return (demote_states(eng, t1, src_st, sreg, hs_st[:n_st]) if states
                    else demote_kv(eng, full, src_pg, kreg, hs_pg[:n_pg]))
        if direction == "d2h_b":
            return (demote_states(eng, t1, src_st, sreg, hs_st[n_st:]) if states
                    else demote_kv(eng, full, src_pg, kreg, hs_pg[n_pg:]))
        return (promote_states(eng, sreg, hs_st[:n_st], t1, dst_st) if states
                else load_kv(eng, kreg, hs_pg[:n_pg], full, dst_pg, layerwise=False))

    # the mapped-memory kernel's settings: few programs leave SMs to compute; block and warps set how
    # many reads each program keeps in flight over PCIe
    eng = TransferEngine(dev, method={"d2h": "kernel", "h2d": "kernel"})
    run_kv(eng, "d2h")
    sweep = {}
    for progs in (8, 16, 32, 132):
        for block, warps in ((2048, 4), (4096, 8), (8192, 16)):
            c = eng.copier
            c.kernel_programs, c.kernel_block_words, c.kernel_warps = progs, block, warps
            d = pg_bytes / timed(lambda: run_kv(eng, "d2h"), a.reps) / 1e9
            h = pg_bytes / timed(lambda: run_kv(eng, "h2d"), a.reps) / 1e9
            metrics[f"kv_kernel_{progs}prog_{block}w_{warps}warps_d2h_GBps"] = d
            metrics[f"kv_kernel_{progs}prog_{block}w_{warps}warps_h2d_GBps"] = h
            sweep[(progs, block, warps)] = d + h
    # the best setting with at most 32 programs (a quarter of the SMs at most)
    best_progs, best_block, best_warps = max((k for k in sweep if k[0] <= 32), key=sweep.get)
    metrics.update(kernel_programs=best_progs, kernel_block_words=best_block, kernel_warps=best_warps)

    def tuned(eng):
        c = eng.copier
        c.kernel_programs, c.kernel_block_words, c.kernel_warps = best_progs, best_block, best_warps
        return eng

    rows = []
    for method in ("copy", "staging", "kernel", "auto"):
        eng = tuned(TransferEngine(dev, method={"d2h": method, "h2d": method}, staging_bytes=max(st_bytes, pg_bytes)))
        run_states(eng, "d2h")  # first demote makes the host copies valid for the promotes
        run_kv(eng, "d2h")
        eng.wait(demote_states(eng, t1, src_st, sreg, hs_st[n_st:]))
        eng.wait(demote_kv(eng, full, src_pg, kreg, hs_pg[n_pg:]))
        # correctness before timing: promoted bytes equal the demoted ones
        t = promote_states(eng, sreg, hs_st[:n_st], t1, dst_st)
        eng.wait(t)
        assert all(t.ok) and torch.equal(t1.envelopes[dst_st], t1.envelopes[src_st]), "state round trip broke"
        t = load_kv(eng, kreg, hs_pg[:n_pg], full, dst_pg)
        eng.wait(t)
        assert all(t.ok), "kv round trip broke"
        for what, fn, nbytes in (("state", run_states, st_bytes), ("kv", run_kv, pg_bytes)):
            for d in ("d2h", "h2d", "bidir"):
                sec = timed(lambda fn=fn, eng=eng, d=d: fn(eng, d), a.reps)
                gbps = (2 if d == "bidir" else 1) * nbytes / sec / 1e9
                rows.append({"method": method, "data": what, "direction": d, "GBps": round(gbps, 2),
                             "vs_contiguous": round(gbps / metrics[f"contig_{what}_{d}_GBps"], 3)})
                # sustained: PIPELINE calls submitted back to back, then one wait (against the same
                # number of contiguous copies back to back)
                sec = timed(lambda fn=fn, eng=eng, d=d: pipelined(fn, eng, d), a.reps)
                gbps = (2 if d == "bidir" else 1) * PIPELINE * nbytes / sec / 1e9
                rows.append({"method": method, "data": f"{what} sustained", "direction": d, "GBps": round(gbps, 2),
                             "vs_contiguous": round(gbps / metrics[f"contig_{what}_{d}_sustained_GBps"], 3)})
    # KV pages whose host slots are consecutive, as one node's pages get them from the host allocator
    # (lowest free ids first): "auto" moves each run as one DMA copy through the staging buffer.
    eng = tuned(TransferEngine(dev, staging_bytes=max(st_bytes, pg_bytes)))
    run_a, run_b = sorted(hs_pg[:n_pg]), sorted(hs_pg[n_pg:])
    eng.wait(demote_kv(eng, full, src_pg, kreg, run_a))
    t = load_kv(eng, kreg, run_a, full, dst_pg, layerwise=False)
    eng.wait(t)
    assert all(t.ok), "kv round trip (runs) broke"

    def kv_runs(d):
        if d in ("d2h", "bidir"):
            demote_kv(eng, full, src_pg, kreg, run_b)
        if d in ("h2d", "bidir"):
            load_kv(eng, kreg, run_a, full, dst_pg, layerwise=False)
        eng.wait_all()

    for d in ("d2h", "h2d", "bidir"):
        gbps = (2 if d == "bidir" else 1) * pg_bytes / timed(lambda d=d: kv_runs(d), a.reps) / 1e9
        rows.append({"method": "auto", "data": "kv-runs", "direction": d, "GBps": round(gbps, 2),
                     "vs_contiguous": round(gbps / metrics[f"contig_kv_{d}_GBps"], 3)})
        metrics[f"kv_runs_{d}_GBps"] = gbps

    # The headline numbers are what the engine runs by default (method "auto"), sustained: several
    # calls in flight, as the engine keeps them, against as many contiguous copies back to back.
    # The single-call numbers (one call, then a wait) are kept beside them.
    def row(data, d, method="auto"):
        return next(r for r in rows if r["data"] == data and r["direction"] == d and r["method"] == method)

    for d in ("d2h", "h2d", "bidir"):
        for data, key in (("state", ""), ("kv", "kv_")):
            r, one = row(f"{data} sustained", d), row(data, d)
            metrics[f"{key}{d}_GBps"] = r["GBps"]
            metrics[f"{key}{d}_vs_contiguous"] = r["vs_contiguous"]
            metrics[f"{key}{d}_single_call_GBps"] = one["GBps"]
            metrics[f"{key}{d}_single_call_vs_contiguous"] = one["vs_contiguous"]

    # The headline state numbers, sustained, timed again with the baseline interleaved: on these
    # machines the PCIe rate drifts between measurements taken seconds apart (the same sustained
    # both-ways state moves measured 79-97 GB/s across calls, and 86-98 GB/s within one process), so
    # each round times the contiguous copies and then ours back to back, and the ratio is the median
    # of the rounds' ratios (the lowest round's ratio is kept beside it). The sequential numbers above
    # stay in the JSON as ``state_sustained_*_auto_GBps``.
    base = contiguous_fns(st_bytes, dev)
    eng_i = tuned(TransferEngine(dev, staging_bytes=max(st_bytes, pg_bytes)))
    run_states(eng_i, "d2h")
    for d in ("d2h", "h2d", "bidir"):
        k = (2 if d == "bidir" else 1) * PIPELINE * st_bytes / 1e9
        b, o, ratio, low = interleaved(base[f"{d}_sustained"], lambda d=d: pipelined(run_states, eng_i, d), a.rounds)
        metrics[f"contig_state_{d}_interleaved_GBps"] = k / b
        metrics[f"state_{d}_interleaved_GBps"] = k / o
        metrics[f"state_{d}_interleaved_vs_contiguous"] = ratio
        metrics[f"state_{d}_interleaved_vs_contiguous_lowest"] = low
        metrics[f"{d}_GBps"] = round(k / o, 2)
        metrics[f"{d}_vs_contiguous"] = round(ratio, 3)
    del base
    for r in rows:
        metrics[f"{r['data'].replace(' ', '_')}_{r['direction']}_{r['method']}_GBps"] = r["GBps"]

    # checksum overhead: the same scattered state moves and KV pages, both ways, against themselves
    # with the checksum kernels switched off, in interleaved rounds (``checksum_overheads``).
    eng = tuned(TransferEngine(dev, staging_bytes=max(st_bytes, pg_bytes)))
    metrics.update(checksum_overheads(eng, {
        "checksum_overhead": lambda: pipelined(run_states, eng, "bidir"),
        "checksum_overhead_single_call": lambda: run_states(eng, "bidir"),
        "checksum_overhead_kv": lambda: pipelined(run_kv, eng, "bidir"),
        "checksum_overhead_kv_single_call": lambda: run_kv(eng, "bidir"),
    }, a.rounds))

    # Diagnostic: which direction's checksums stall sustained both-ways moves. Demotes and promotes go
    # through two engines (each its own in-flight bound), checksums on or off per direction.
    e_d, e_p = eng, tuned(TransferEngine(dev, staging_bytes=max(st_bytes, pg_bytes)))

    def split_bidir():
        for _ in range(PIPELINE):
            demote_states(e_d, t1, src_st, sreg, hs_st[n_st:])
            promote_states(e_p, sreg, hs_st[:n_st], t1, dst_st)
        e_d.wait_all()
        e_p.wait_all()

    try:  # a diagnostic: should it break, say so and keep the run's other numbers
        for d_on, h_on in ((True, True), (True, False), (False, True), (False, False)):
            e_d.checksums, e_p.checksums = d_on, h_on
            gbps = 2 * PIPELINE * st_bytes / timed(split_bidir, a.reps) / 1e9
            metrics[f"diag_bidir_two_engines_checksums_d2h_{'on' if d_on else 'off'}_h2d_{'on' if h_on else 'off'}"
                    "_GBps"] = gbps
    except Exception as exc:  # noqa: BLE001
        print(f"diag_bidir failed: {exc!r}")
        metrics["diag_bidir_failed"] = 1.0
    finally:
        e_d.checksums = e_p.checksums = True

    # GEMM alone vs with transfers running on the copy streams
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def gemms(n=20):
        for _ in range(n):
            torch.mm(x, y)

    def gpu_ms(n=20) -> float:
        """Median GPU time of ``n`` GEMMs on the compute stream (CUDA events: what the GPU spends,
        not when a Python thread got to launch them)."""
        out = []
        gemms(2)
        for _ in range(a.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            gemms(n)
            e1.record()
            e1.synchronize()
            out.append(e0.elapsed_time(e1) / n)
        return statistics.median(out)

    alone = timed(gemms, a.reps)
    alone_gpu = gpu_ms()
    stop = threading.Event()

    def mover():
        while not stop.is_set():  # both kinds: DMA copies for states, the few-program kernel for pages
            run_states(eng, "bidir")
            run_kv(eng, "bidir")

    th = threading.Thread(target=mover)
    th.start()
    time.sleep(0.2)
    busy = timed(gemms, a.reps)
    busy_gpu = gpu_ms()
    stop.set()
    th.join()
    metrics["gemm_alone_ms"] = alone_gpu
    metrics["gemm_with_transfers_ms"] = busy_gpu
    metrics["gemm_slowdown"] = busy_gpu / alone_gpu - 1
    metrics["gemm_slowdown_wall"] = busy / alone - 1  # wall clock: includes the GIL the mover thread holds
    metrics["state_envelope_bytes"] = t1.slot_bytes
    metrics["kv_page_bytes"] = full.entry_bytes
    path = write_results("transfer", metrics, rows=rows, out_dir=a.out,
                         notes=f"{n_st} scattered state envelopes, {n_pg} scattered KV pages per call.")
    for r in rows:
        print(r)
    for k, v in metrics.items():
        print(f"{k:36s} {v:,.4f}")
    print("wrote", path)


if __name__ == "__main__":
    main()
