"""T2 transfer benchmark: scattered demote / promote against a contiguous pinned copy, on one GPU.

Data: Qwen3-Next-80B-like int8 state envelopes (36 layers x [32, 128, 128] + scales + conv windows,
~21 MB each) and full-attention KV pages (12 layers, 2 KV heads x 256, bf16) of three sizes: 16 tokens
(384 KiB, the engine's page; keys without suffix), 32 tokens (768 KiB, ``_768k``) and 64 tokens
(1.5 MiB, ``_1536k``: an SGLang-sized page), the same bytes per call for each size.
All in one run:
- baseline: contiguous pinned copies of the same number of bytes, each direction and both at once;
- ours: scattered T1 -> T2 demote, T2 -> T1 promote (checksummed), both directions at once, for the
  ``copy``, ``staging``, ``kernel`` (``kernel-1w`` beside it: one word a lane, the kernel before 2026-12-07),
  ``batch`` (``cudaMemcpyBatchAsync``, where present) and ``auto``
  methods, and for KV pages the mixes ``kernel`` one way / ``batch`` the other; KV pages whose host
  slots are consecutive ("kv-runs");
- correctness before timing, per method and page size: the landed bytes equal the demoted ones (compared
  on the device, not only through the checksum), and every checksum passes;
- each timed two ways against the baseline timed the same way: one call then a wait ("single
  call"), and ``PIPELINE`` calls in flight then one wait ("sustained");
- the headline metrics (``d2h_GBps``, ``h2d_GBps``, ``bidir_GBps`` for states, ``kv_d2h_GBps``,
  ``kv_h2d_GBps``, ``kv_bidir_GBps`` and their size suffixes for KV pages, each with ``*_vs_contiguous``):
  sustained moves by the default method (``auto``), checksums on, timed in ``--rounds`` rounds, each
  round the baseline then ours back to back (medians; the ratio is the median of the rounds' ratios);
- the mapped-memory kernel's settings swept (programs x words per step x warps), 384 KiB pages;
- a bf16 GEMM on the compute stream alone, then while transfers run (``gemm_slowdown``: GPU time by
  CUDA events; ``gemm_slowdown_wall``: wall clock), and the rate those transfers reached meanwhile
  (``transfer_GBps_during_gemm``);
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


PAGE_SIZES = {"": 16, "_768k": 32, "_1536k": 64}  # tokens per KV page: 384 KiB, 768 KiB, 1.5 MiB
KV = KVSpec(num_layers=12, kv_heads=2, head_dim=256, dtype=torch.bfloat16)  # Qwen3-Next-80B's full attention
STATE = StateSpec(num_layers=36, temporal_shape=(32, 128, 128), temporal_dtype=torch.float32,
                  conv_shapes=((8192, 3),), conv_dtype=torch.bfloat16, value_axis=2)
MIXES = {"kernel+batch": {"d2h": "kernel", "h2d": "batch"}, "batch+kernel": {"d2h": "batch", "h2d": "kernel"},
         "staging+batch": {"d2h": "staging", "h2d": "batch"}}


def _engine(dev, method: str, staging: int, tune=None) -> TransferEngine:
    """``kernel-1w``: the mapped-memory kernel at one word a lane (``copy_items(vector=False)``, the kernel before
    2026-12-07), beside ``kernel`` (four words a lane where every range is 16-byte aligned, as KV pages are)."""
    one_word = method == "kernel-1w"
    method = "kernel" if one_word else method
    m = MIXES.get(method, {"d2h": method, "h2d": method})
    eng = TransferEngine(dev, method=m, staging_bytes=staging)
    if tune is not None:
        c = eng.copier
        c.kernel_programs, c.kernel_block_words, c.kernel_warps = tune
    eng.copier.kernel_vector = not one_word
    return eng


HOST_SLOTS = ("scattered", "churn")
NODE_PAGES_MEAN = 32  # pages a tree node backs up at once in the churned pattern (512 tokens at 16 a page)


def churned_host_slots(region, n: int, g: torch.Generator, mean: int = NODE_PAGES_MEAN) -> list[int]:
    """``n`` host slots as backups of whole nodes get them from ``region``'s allocator (one ``alloc`` per
    node of ``mean`` pages on average, lowest free ids first, as ``HostCache.backup_path`` allocates a
    chain), after churn. Not every engine pattern: the reference engine's stress job (write-through, 512-token
    questions) backs up a page or two per call, runs of 1.2-1.4 pages, and its loads of a path read runs of
    1.9 pages (write-through) to 19 pages (write-back) (a probe of ``ScatterCopier.copy_rows``, 2026-12-07);
    the random order (``scattered``) is the closer model of its demotes. The region is filled with nodes of
    1 to ``2 mean - 1`` pages and a random half of them freed, so the free slots lie in node-sized holes
    between live ones (more than half freed where ``region`` holds under ``2 n`` slots; ``5 n`` keep it half)."""
    nodes = []
    while region.available_size():
        k = min(int(torch.randint(1, 2 * mean, (1,), generator=g)), region.available_size())
        nodes.append(region.alloc(k))
    for j, i in enumerate(torch.randperm(len(nodes), generator=g).tolist()):
        if j >= len(nodes) // 2 and region.available_size() >= n:
            break
        region.free(nodes[i])  # a random half, more if fewer than n slots are free then
    out: list[int] = []
    while len(out) < n:
        k = min(int(torch.randint(1, 2 * mean, (1,), generator=g)), n - len(out))
        out += region.alloc(k)
    return out


def mean_run_pages(region, slots: list[int]) -> float:
    """Mean length of the runs of consecutive host slots in ``slots`` (what one DMA copy can move)."""
    runs = region.runs(slots)
    return len(slots) / max(1, len(runs))


class KVCase:
    """Scattered KV pages of one size: ``n`` source pages, ``n`` destination pages (random order on the
    device: no two neighbours adjacent), random bytes, and ``2 n`` host slots: ``scattered``, in random
    order (the worst case: every page its own host range), or ``churn``, as the tree's backups get them
    from the host allocator after churn (``churned_host_slots``: runs as long as the holes they fill)."""

    def __init__(self, dev, page_size: int, n: int, g: torch.Generator, host: str = "scattered") -> None:
        self.pool = UnifiedPool(KV, STATE, low_slots=2 * n, high_slots=1, page_size=page_size, device=dev)
        self.full = self.pool.side("full")
        self.host = host
        nslots = 2 * n if host == "scattered" else 6 * n
        self.mirror = HostMirror([RegionSpec("full", self.full.entry_bytes, nslots)])
        self.region = self.mirror.region("full")
        toks = self.full.alloc(page_size * 2 * n)
        rb = self.full.rows_bytes()
        # random bytes made on the device (GBs on the CPU would take seconds), seeded
        rb.copy_(torch.randint(0, 256, rb.shape, dtype=torch.uint8, device=dev,
                               generator=torch.Generator(device=dev).manual_seed(page_size)))
        pages = toks.view(-1, page_size)
        perm = torch.randperm(2 * n, generator=g)
        self.src, self.dst = pages[perm[:n]].reshape(-1), pages[perm[n:]].reshape(-1)
        if host == "scattered":
            got = self.region.alloc(2 * n)
            self.hs = [got[i] for i in torch.randperm(2 * n, generator=g).tolist()]
        else:  # pages per node scale with the page: the same tokens a node
            self.hs = churned_host_slots(self.region, 2 * n, g, max(1, NODE_PAGES_MEAN * 16 // page_size))
        self.run_pages = mean_run_pages(self.region, self.hs[:n])
        self.n, self.nbytes = n, n * self.full.entry_bytes
        self.src_rows = self.full.translate(self.src[::page_size]) // page_size
        self.dst_rows = self.full.translate(self.dst[::page_size]) // page_size

    def submit(self, eng, direction: str, layerwise: bool = False):
        if direction == "d2h":
            return demote_kv(eng, self.full, self.src, self.region, self.hs[:self.n])
        if direction == "d2h_b":
            return demote_kv(eng, self.full, self.src, self.region, self.hs[self.n:])
        return load_kv(eng, self.region, self.hs[:self.n], self.full, self.dst, layerwise=layerwise)

    def run(self, eng, direction: str) -> None:
        if direction == "bidir":
            a_, b_ = self.submit(eng, "d2h_b"), self.submit(eng, "h2d")
            eng.wait(a_)
            eng.wait(b_)
        else:
            eng.wait(self.submit(eng, direction))

    def pipelined(self, eng, direction: str, layerwise: bool = False) -> None:
        for _ in range(PIPELINE):
            if direction == "bidir":
                self.submit(eng, "d2h_b")
                self.submit(eng, "h2d", layerwise)
            else:
                self.submit(eng, direction, layerwise)
        eng.wait_all()

    def check(self, eng, layerwise: bool = False) -> None:
        """Correctness before timing: demote, poison the destination pages, load; the landed bytes equal
        the source pages' byte for byte (on the device) and every checksum passed."""
        rb = self.full.rows_bytes()
        eng.wait(self.submit(eng, "d2h"))
        eng.wait(self.submit(eng, "d2h_b"))
        rb[self.dst_rows] = 0xA5
        t = self.submit(eng, "h2d", layerwise)
        eng.wait(t)
        assert all(t.ok), "kv round trip: a checksum failed"
        assert torch.equal(rb[self.dst_rows], rb[self.src_rows]), "kv round trip: landed bytes differ"

    def close(self) -> None:
        self.mirror.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--states", type=int, default=32, help="state envelopes per call")
    p.add_argument("--pages", type=int, default=2048, help="384 KiB KV pages per call (larger pages: as many bytes)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds of the headline moves")
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the copy kernel's settings sweep")
    p.add_argument("--host-slots", choices=(*HOST_SLOTS, "both"), default="both",
                   help="KV host slots: scattered (random order; keys kv_*), churn (whole nodes as one allocation "
                        "each after churn; keys kv_churn_*) or both")
    p.add_argument("--kv-only", action="store_true",
                   help="KV pages only: no state moves, pinning or checksum rows (the GEMM runs beside KV moves)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("bench_transfer needs a GPU; nothing measured")
        return
    dev = torch.device("cuda")
    n_st = a.states
    t1 = Int8CheckpointPool(STATE, 2 * n_st, device=dev)
    metrics: dict = {}

    # pinning: pin_memory vs cudaHostRegister, 1 GiB each
    for method in ("pin_memory", "register") if not a.kv_only else ():
        t0 = time.perf_counter()
        m = HostMirror([RegionSpec("x", 1 << 20, 1023)], pin=method)
        metrics[f"pin_1GiB_{method}_s"] = time.perf_counter() - t0
        m.close()
        del m

    smirror = HostMirror([RegionSpec("state", t1.slot_bytes, 2 * n_st)])
    sreg = smirror.region("state")
    g = torch.Generator().manual_seed(0)
    t1_ids = t1.alloc(2 * n_st).tolist()
    t1.envelopes.copy_(torch.randint(0, 256, t1.envelopes.shape, dtype=torch.uint8, device=dev,
                                     generator=torch.Generator(device=dev).manual_seed(0)))
    src_st = [t1_ids[i] for i in torch.randperm(2 * n_st, generator=g)[:n_st].tolist()]
    dst_st = [i for i in t1_ids if i not in set(src_st)]
    got = sreg.alloc(2 * n_st)
    hs_st = [got[i] for i in torch.randperm(2 * n_st, generator=g).tolist()]
    st_bytes = n_st * t1.slot_bytes
    staging = max(st_bytes, a.pages * KV.bytes_per_slot(16))
    probe = TransferEngine(dev).copier.batch
    metrics["batch_dma_available"] = float(probe.available)
    if not probe.available:
        print("batch DMA unavailable:", probe.error)
    methods = ["copy", "staging", "kernel", "kernel-1w", "auto"] + (["batch", *MIXES] if probe.available else [])

    def st_submit(eng, direction):
        if direction == "d2h":
            return demote_states(eng, t1, src_st, sreg, hs_st[:n_st])
        if direction == "d2h_b":
            return demote_states(eng, t1, src_st, sreg, hs_st[n_st:])
        return promote_states(eng, sreg, hs_st[:n_st], t1, dst_st)

    def run_states(eng, direction):
        if direction == "bidir":
            a_, b_ = st_submit(eng, "d2h_b"), st_submit(eng, "h2d")
            eng.wait(a_)
            eng.wait(b_)
        else:
            eng.wait(st_submit(eng, direction))

    def st_pipelined(eng, direction):
        for _ in range(PIPELINE):
            if direction == "bidir":
                st_submit(eng, "d2h_b")
                st_submit(eng, "h2d")
            else:
                st_submit(eng, direction)
        eng.wait_all()

    if not a.kv_only:
        metrics.update(contiguous_baseline("state", st_bytes, dev, a.reps))
    rows: list[dict] = []

    def timed_rows(what, method, one, sustained, nbytes, base):
        for d in ("d2h", "h2d", "bidir"):
            k = 2 if d == "bidir" else 1
            gbps = k * nbytes / timed(lambda d=d: one(d), a.reps) / 1e9
            rows.append({"method": method, "data": what, "direction": d, "GBps": round(gbps, 2),
                         "vs_contiguous": round(gbps / base[f"contig_{d}_GBps"], 3)})
            gbps = k * PIPELINE * nbytes / timed(lambda d=d: sustained(d), a.reps) / 1e9
            rows.append({"method": method, "data": f"{what} sustained", "direction": d, "GBps": round(gbps, 2),
                         "vs_contiguous": round(gbps / base[f"contig_{d}_sustained_GBps"], 3)})

    def layerwise_row(what, method, eng, case, base) -> float:
        """Sustained H2D loads layer by layer (one event per layer, as the engine loads), checked first."""
        case.check(eng, layerwise=True)
        gbps = PIPELINE * case.nbytes / timed(lambda: case.pipelined(eng, "h2d", True), a.reps) / 1e9
        rows.append({"method": method, "data": f"{what} sustained layerwise", "direction": "h2d",
                     "GBps": round(gbps, 2), "vs_contiguous": round(gbps / base["contig_h2d_sustained_GBps"], 3)})
        return round(gbps, 2)

    def interleaved_headline(pre, sfx, nbytes, ours):
        """``{pre}{d}_GBps{sfx}`` and ``{pre}{d}_vs_contiguous{sfx}``: sustained, interleaved rounds."""
        base = contiguous_fns(nbytes, dev)
        for d in ("d2h", "h2d", "bidir"):
            k = (2 if d == "bidir" else 1) * PIPELINE * nbytes / 1e9
            b, o, ratio, low = interleaved(base[f"{d}_sustained"], lambda d=d: ours(d), a.rounds)
            metrics[f"contig_{pre}{d}_interleaved_GBps{sfx}"] = k / b
            metrics[f"{pre}{d}_GBps{sfx}"] = round(k / o, 2)
            metrics[f"{pre}{d}_vs_contiguous{sfx}"] = round(ratio, 3)
            metrics[f"{pre}{d}_vs_contiguous_lowest_round{sfx}"] = round(low, 3)

    # ---- KV pages, each host pattern and size: the kernel sweep (scattered 384 KiB), every method checked
    # then timed, the headline
    tune = (16, 2048, 4)  # the kernel's settings unless the sweep runs (its pick on the H200, 2026-12-01)
    patterns = HOST_SLOTS if a.host_slots == "both" else (a.host_slots,)
    bases: dict = {}
    kv_cases: dict = {}  # the 384 KiB case of each pattern, kept for the checksum overheads and the GEMM
    for host in patterns:
        hp = "" if host == "scattered" else f"{host}_"  # key part: kv_d2h_GBps, kv_churn_d2h_GBps
        label = "kv" if host == "scattered" else f"kv-{host}"
        for sfx, ps in PAGE_SIZES.items():
            case = KVCase(dev, ps, a.pages * 16 // ps, g, host)
            if sfx not in bases:  # the baseline moves the same bytes whatever the host pattern
                bases[sfx] = {k.replace(f"contig_kv{sfx}_", "contig_"): v
                              for k, v in contiguous_baseline(f"kv{sfx}", case.nbytes, dev, a.reps).items()}
                metrics.update({k.replace("contig_", f"contig_kv{sfx}_"): v for k, v in bases[sfx].items()})
            base = bases[sfx]
            if sfx == "" and host == "scattered" and a.sweep:
                eng = _engine(dev, "kernel", staging)
                case.check(eng)
                sweep = {}
                for progs in (8, 16, 32, 132):
                    for block, warps in ((2048, 4), (4096, 8), (8192, 16)):
                        c = eng.copier
                        c.kernel_programs, c.kernel_block_words, c.kernel_warps = progs, block, warps
                        d = case.nbytes / timed(lambda eng=eng, case=case: case.run(eng, "d2h"), a.reps) / 1e9
                        h = case.nbytes / timed(lambda eng=eng, case=case: case.run(eng, "h2d"), a.reps) / 1e9
                        metrics[f"kv_kernel_{progs}prog_{block}w_{warps}warps_d2h_GBps"] = d
                        metrics[f"kv_kernel_{progs}prog_{block}w_{warps}warps_h2d_GBps"] = h
                        sweep[(progs, block, warps)] = d + h
                # the best setting with at most 32 programs (a quarter of the SMs at most)
                tune = max((k for k in sweep if k[0] <= 32), key=sweep.get)
                metrics.update(kernel_programs=tune[0], kernel_block_words=tune[1], kernel_warps=tune[2])
            for method in methods:
                eng = _engine(dev, method, staging, tune)
                try:
                    case.check(eng)
                except (AssertionError, RuntimeError) as exc:  # reported, never timed; auto failing ends the run
                    print(f"{label}{sfx} {method}: {exc}")
                    metrics[f"{label}{sfx}_{method}_round_trip_failed"] = 1.0
                    if method == "auto":
                        raise
                    continue
                timed_rows(f"{label}{sfx}", method, lambda d, eng=eng, case=case: case.run(eng, d),
                           lambda d, eng=eng, case=case: case.pipelined(eng, d), case.nbytes, base)
                layerwise_row(f"{label}{sfx}", method, eng, case, base)
            eng = _engine(dev, "auto", staging, tune)
            case.check(eng)
            interleaved_headline(f"kv_{hp}", sfx, case.nbytes, lambda d, eng=eng, case=case: case.pipelined(eng, d))
            # the engine's loads go layer by layer (``load_kv``'s default: compute waits per layer)
            metrics[f"kv_{hp}h2d_layerwise_GBps{sfx}"] = layerwise_row(f"{label}{sfx}", "auto", eng, case, base)
            metrics[f"kv{sfx}_page_bytes"] = case.full.entry_bytes
            metrics[f"kv_{hp}host_run_pages{sfx}"] = case.run_pages
            if sfx == "":
                kv_cases[host] = case
            else:
                case.close()
                del case
                torch.cuda.empty_cache()
    kv = kv_cases.get("scattered", kv_cases.get("churn"))  # the closer model of the engine's demotes where run

    # ---- states: every method checked then timed, then the interleaved headline
    sbase = {k.replace("contig_state_", "contig_"): v for k, v in metrics.items() if k.startswith("contig_state_")}
    for method in [m for m in methods if m not in MIXES] if not a.kv_only else []:
        eng = _engine(dev, method, staging, tune)
        eng.wait(st_submit(eng, "d2h"))
        eng.wait(st_submit(eng, "d2h_b"))
        t = st_submit(eng, "h2d")
        eng.wait(t)
        assert all(t.ok) and torch.equal(t1.envelopes[dst_st], t1.envelopes[src_st]), "state round trip broke"
        timed_rows("state", method, lambda d, eng=eng: run_states(eng, d), lambda d, eng=eng: st_pipelined(eng, d),
                   st_bytes, sbase)
    if not a.kv_only:
        eng_i = _engine(dev, "auto", staging, tune)
        interleaved_headline("", "", st_bytes, lambda d: st_pipelined(eng_i, d))
    for r in rows:
        metrics[f"{r['data'].replace(' ', '_')}_{r['direction']}_{r['method']}_GBps"] = r["GBps"]

    # checksum overhead: the same scattered state moves and KV pages, both ways, against themselves
    # with the checksum kernels switched off, in interleaved rounds (``checksum_overheads``).
    eng = _engine(dev, "auto", staging, tune)
    moves = {"checksum_overhead_kv": lambda: kv.pipelined(eng, "bidir"),
             "checksum_overhead_kv_single_call": lambda: kv.run(eng, "bidir")}
    if not a.kv_only:
        moves.update(checksum_overhead=lambda: st_pipelined(eng, "bidir"),
                     checksum_overhead_single_call=lambda: run_states(eng, "bidir"))
    metrics.update(checksum_overheads(eng, moves, a.rounds))

    # GEMM alone vs with transfers running on the copy streams (a thread keeps them going), and the
    # rate those transfers reached while the GEMMs ran
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
    moved = [0]

    def mover():
        while not stop.is_set():  # both kinds: DMA copies for states, KV pages by the default method
            if not a.kv_only:
                run_states(eng, "bidir")
                moved[0] += 2 * st_bytes
            kv.run(eng, "bidir")
            moved[0] += 2 * kv.nbytes

    th = threading.Thread(target=mover)
    th.start()
    time.sleep(0.2)
    b0, t0 = moved[0], time.perf_counter()
    busy = timed(gemms, a.reps)
    busy_gpu = gpu_ms()
    b1, t1_ = moved[0], time.perf_counter()
    stop.set()
    th.join()
    metrics["gemm_alone_ms"] = alone_gpu
    metrics["gemm_with_transfers_ms"] = busy_gpu
    metrics["gemm_slowdown"] = busy_gpu / alone_gpu - 1
    metrics["gemm_slowdown_wall"] = busy / alone - 1  # wall clock: includes the GIL the mover thread holds
    metrics["transfer_GBps_during_gemm"] = (b1 - b0) / (t1_ - t0) / 1e9  # both ways, moves finished meanwhile
    metrics["state_envelope_bytes"] = t1.slot_bytes
    metrics["gemm_kv_host_slots_churn"] = float(kv.host == "churn")
    path = write_results("transfer", metrics, rows=rows, out_dir=a.out,
                         notes=(f"{n_st} scattered state envelopes, " if not a.kv_only else "KV pages only: ")
                         + f"{a.pages} scattered 384 KiB KV pages per call (as many bytes of 768 KiB and 1.5 MiB "
                         f"pages), host slots {' and '.join(patterns)} (kv_* scattered in random order, kv_churn_* "
                         f"whole nodes of {NODE_PAGES_MEAN} pages on average as one allocation each from the host "
                         f"allocator after churn). The GEMM ran beside the "
                         f"{kv.host} KV moves{'' if a.kv_only else ' and state moves'}.")
    for r in rows:
        print(r)
    for k, v in metrics.items():
        print(f"{k:36s} {v:,.4f}")
    print("wrote", path)
    for c in kv_cases.values():
        c.close()
    smirror.close()


if __name__ == "__main__":
    main()
