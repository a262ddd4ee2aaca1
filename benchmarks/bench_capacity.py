"""Capacity simulation: hit rate against GPU and host memory, on the real cache structures, no model.

    python benchmarks/bench_capacity.py                  # CPU, ~2-3 minutes
    python benchmarks/bench_capacity.py --requests 1000000 --gpu-gib 16 --host-gib 256   # one point, long

A ``TieredCache`` (the radix tree over a real ``UnifiedPool`` (T0), ``Int8CheckpointPool`` (T1) and
``HostMirror`` + ``TransferEngine`` (T2)) is built with slot COUNTS that come from byte budgets of a
Qwen3-Next-80B-like model (KV: 12 full layers x 2 heads x 256, bf16; state: 36 linear layers x
[32, 128, 128] fp32 + a bf16 conv window; int8 in T1/T2), split as ``workload_common.split_budget``
splits the GPU budget for the engine benchmark. The slots themselves are tiny byte-sized stand-ins
(their T0 KV : state byte ratio kept, so the two sides of T0 trade bytes at the real rate). One sim
token is one KV page of ``--page`` real tokens (page_size 1 in the tree; checkpoints on page
boundaries, as the engine places them).

The trace: ``--active`` conversations live at once (the working set); each request picks one at
random and sends its next turn (history + previous answer + a new question); a conversation that
has done its rounds is replaced by a new one. Every conversation starts with one of ``--systems``
shared system prompts (Zipf popularity). Each request does what the reference engine does with the
cache, minus the compute: ``match_prefix`` (cow_mamba), ``init_load_back`` of a host hit (tickets
finish on ``check_hicache_events``), lock, a T0 state slot and the KV reserved (``TieredCache.alloc_states``
/ ``alloc_kv``: evicting for room), ``cache_unfinished_req`` at the
branch point, every prefill chunk end and the prompt end, ``cache_finished_req`` at the last page
written. Requests run one at a time (no concurrency: running requests' KV is in the reservation).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import workload_common as wc  # noqa: E402
from benchmarks.common import RESULTS, device_tag, write_results  # noqa: E402
from tiered_cache.config import WRITE_POLICIES, CacheConfig  # noqa: E402
from tiered_cache.radix import CacheReq, InitLoadBackParams, MatchPrefixParams, RadixKey  # noqa: E402
from tiered_cache.specs import KVSpec, StateSpec  # noqa: E402
from tiered_cache.stack import TieredCache  # noqa: E402

GiB = 1 << 30
# Qwen3-Next-80B-A3B: 48 layers, every 4th full attention.
REAL_KV = KVSpec(num_layers=12, kv_heads=2, head_dim=256, dtype=torch.bfloat16)
REAL_STATE = StateSpec(num_layers=36, temporal_shape=(32, 128, 128), temporal_dtype=torch.float32,
                       conv_shapes=((8192, 3),), conv_dtype=torch.bfloat16, value_axis=2)
TINY_KV = KVSpec(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)  # 32 B per sim token


def tiny_state(real: wc.TierBytes) -> StateSpec:
    """A state spec whose bytes : TINY_KV page bytes ~ the real state : KV page ratio."""
    kv = TINY_KV.bytes_per_slot(1)
    want = real.state_native / real.kv_page * kv
    dk = max(1, round((want - 64) / (4 * 16)))
    return StateSpec(num_layers=1, temporal_shape=(1, dk, 16), temporal_dtype=torch.float32,
                     conv_shapes=((4, 4),), conv_dtype=torch.float32, value_axis=2)


# ------------------------------------------------------------------------------------------ trace
class Trace:
    """Seeded multi-turn / shared-prefix trace in sim tokens (pages). ``next()`` -> (prompt, answer)."""

    def __init__(self, a: argparse.Namespace, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.a = a
        self.next_tok = 1
        self.systems = [self._fresh(a.system_pages) for _ in range(a.systems)]
        w = [1.0 / (i + 1) ** a.zipf for i in range(a.systems)]
        self.cum = [sum(w[:i + 1]) / sum(w) for i in range(len(w))]
        self.active = [self._new_conv() for _ in range(a.active)]

    def _fresh(self, n: int) -> list[int]:
        out = list(range(self.next_tok, self.next_tok + n))
        self.next_tok += n
        return out

    def _new_conv(self) -> dict:
        r = self.rng.random()
        sys_i = next(i for i, c in enumerate(self.cum) if r <= c)
        rounds = self.rng.randint(self.a.min_rounds, self.a.max_rounds)
        return {"history": list(self.systems[sys_i]), "left": rounds}

    def next(self) -> tuple[list[int], list[int]]:
        i = self.rng.randrange(len(self.active))
        c = self.active[i]
        q = self._fresh(self.rng.randint(*self.a.question_pages))
        ans = self._fresh(self.rng.randint(*self.a.answer_pages))
        prompt = c["history"] + q
        c["history"] = prompt + ans
        c["left"] -= 1
        if c["left"] == 0:
            self.active[i] = self._new_conv()
        return prompt, ans

    def longest(self) -> int:
        a = self.a
        return a.system_pages + a.max_rounds * (a.question_pages[1] + a.answer_pages[1])


# ------------------------------------------------------------------------------------------ sim
class Sim:
    """One configuration's tiers, sized in slots, and the engine's cache calls for one request."""

    def __init__(self, tiers: dict[str, Any], state: StateSpec, write_policy: str) -> None:
        cfg = CacheConfig(page_size=1, write_policy=write_policy, validate=False, check_memory=False, backend="torch",
                          **tiers)  # tiers: split_budget's tier sizes and codec
        self.stack = TieredCache.build(cfg, kv=TINY_KV, state=state, device="cpu")
        self.cache, self.kv = self.stack.tree, self.stack.kv
        self.c = {"prompt": 0, "reused": 0, "reused_host": 0, "t1": 0, "t2": 0, "miss": 0, "requests": 0,
                  "load_fail": 0}

    def request(self, prompt: list[int], answer: list[int], chunk: int) -> None:
        cache, c = self.cache, self.c
        n = len(prompt)
        req = CacheReq(token_ids=[], kv_indices=torch.empty(0, dtype=torch.int64))
        req.load_back = None
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt[:n - 1]), cow_mamba=True, req=req))
        prefix, node, host_tok, tier = m.device_indices, m.last_device_node, 0, "t1"
        if m.host_hit_length > 0:
            ids, node2 = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
            if len(ids):
                while not req.load_back.done:
                    cache.check_hicache_events()
                if req.load_back.ok:
                    t = req.load_back.tickets
                    host_tok = t["kv"].nbytes // self.kv.entry_bytes if "kv" in t else 0
                    tier = "t2" if "state" in t else "t1"
                    prefix, node = torch.cat([prefix, ids]), node2
                else:
                    c["load_fail"] += 1
        cache.inc_lock_ref(node)
        p = len(prefix)
        req.last_node, req.cache_protected_len, req.prefix_indices = node, p, prefix
        if req.mamba_pool_idx is None:
            req.mamba_pool_idx = self.stack.alloc_states(1)
            if req.mamba_pool_idx is None:
                raise RuntimeError("no T0 state slot even after evicting: the reservation is too small")
        new = self.stack.alloc_kv(n + len(answer) - p)
        if new is None:
            raise RuntimeError("a request's KV does not fit T0 even after evicting: raise the GPU budget")
        req.kv_indices = torch.cat([prefix, new])
        c["requests"] += 1
        c["prompt"] += n
        c["reused"] += p
        c["reused_host"] += host_tok
        c[tier if p else "miss"] += 1
        cuts = set(range(p + chunk, n, chunk)) | {n}
        b = m.mamba_branching_seqlen
        if b is not None and p < b < n:
            cuts.add(b)
        full = prompt + answer
        for pos in sorted(cuts):
            req.token_ids = full[:pos]
            cache.cache_unfinished_req(req, chunked=True)
        req.token_ids = full[:n + len(answer) - 1]  # the last answer token is emitted, never fed
        cache.cache_finished_req(req)
        cache.check_hicache_events()


def run_point(tiers: dict, state: StateSpec, args: argparse.Namespace, n_req: int, label: str) -> dict:
    sim = Sim(tiers, state, args.write_policy)
    trace = Trace(args, seed=args.seed)
    for _ in range(args.warm):
        sim.request(*trace.next(), args.chunk_pages)
    sim.c = dict.fromkeys(sim.c, 0)  # measure after the cache has filled
    it = range(n_req)
    if args.progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=f"{label:>34}", unit="req", leave=False, mininterval=1.0)
    t = time.perf_counter()
    for _ in it:
        sim.request(*trace.next(), args.chunk_pages)
    wall = time.perf_counter() - t
    sim.cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    c = sim.c
    return {"hit_rate": c["reused"] / max(1, c["prompt"]), "hit_rate_t2": c["reused_host"] / max(1, c["prompt"]),
            "state_hit_rate": (c["t1"] + c["t2"]) / max(1, c["requests"]), "state_hits_t1": c["t1"],
            "state_hits_t2": c["t2"], "state_misses": c["miss"], "requests": c["requests"], "req_per_s": n_req / wall,
            "load_failures": c["load_fail"]}


def chart(path: str, rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.6))
    fig.suptitle(f"capacity: Qwen3-Next-80B-like bytes, {args.active} live conversations, "
                 f"{args.requests} requests per point")
    for cfg, style in (("gpu_only", "o-"), ("int8_t1", "s-"), ("int8_t1_t2", "^-")):
        pts = [r for r in rows if r["config"] == cfg and r["sweep"] == "gpu"]
        ax[0].plot([r["gpu_gib"] for r in pts], [r["hit_rate"] for r in pts], style, label=wc.LABELS[cfg])
    ax[0].set(title=f"hit rate vs GPU budget (host {args.host_gib[0]:g} GiB for (4))", xlabel="GPU GiB",
              ylabel="prompt tokens reused", ylim=(0, 1))
    ax[0].legend()
    pts = [r for r in rows if r["sweep"] == "host"]
    ax[1].plot([r["host_gib"] for r in pts], [r["hit_rate"] for r in pts], "^-", color="tab:green",
               label=f"(4), GPU {args.host_sweep_gpu:g} GiB")
    go = [r for r in rows if r["config"] == "gpu_only" and r["gpu_gib"] == args.host_sweep_gpu and r["sweep"] == "gpu"]
    if go:
        ax[1].axhline(go[0]["hit_rate"], ls="--", color="tab:blue", label="(2) at the same GPU budget")
    ax[1].set(title="hit rate vs host budget", xlabel="host GiB", ylim=(0, 1))
    if pts:
        ax[1].set_xscale("log")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="measured requests per point (up to 10^6)")
    p.add_argument("--warm", type=int, default=2000, help="requests run before measuring (cache fills)")
    p.add_argument("--gpu-gib", type=float, nargs="+", default=[8, 16, 32, 48])
    p.add_argument("--host-gib", type=float, nargs="+", default=[256, 32, 64, 128],
                   help="first: the host budget of (4) in the GPU sweep; all: the host sweep")
    p.add_argument("--host-sweep-gpu", type=float, default=16, help="GPU GiB of the host sweep")
    p.add_argument("--ratio-at", type=float, nargs=2, default=[16, 32], help="GPU GiB of hit_rate_vs_gpu_only")
    p.add_argument("--page", type=int, default=64, help="real tokens per sim token (KV page)")
    p.add_argument("--active", type=int, default=256, help="conversations live at once (the working set)")
    p.add_argument("--systems", type=int, default=32, help="shared system prompts")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity skew of the system prompts")
    p.add_argument("--system-pages", type=int, default=32)
    p.add_argument("--question-pages", type=int, nargs=2, default=[2, 16])
    p.add_argument("--answer-pages", type=int, nargs=2, default=[2, 8])
    p.add_argument("--min-rounds", type=int, default=2)
    p.add_argument("--max-rounds", type=int, default=12)
    p.add_argument("--chunk-pages", type=int, default=128, help="prefill chunk in pages (8192 tokens)")
    p.add_argument("--max-running", type=int, default=4)
    p.add_argument("--kv-fraction", type=float, default=0.6)
    p.add_argument("--write-policy", default="write_through", choices=WRITE_POLICIES)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(1)
    t_start = time.perf_counter()
    real = wc.TierBytes.from_specs(REAL_KV, REAL_STATE, args.page)
    state = tiny_state(real)
    tiny_kv = TINY_KV.bytes_per_slot(1)
    print(f"real bytes: KV page ({args.page} tokens) {real.kv_page / 2**20:.2f} MiB; state fp32 "
          f"{real.state_native / 1e6:.1f} MB, T1 lossless {real.t1_lossless / 1e6:.1f} MB, int8 "
          f"{real.t1_int8 / 1e6:.1f} MB ({real.t1_lossless / real.t1_int8:.2f}x); stand-in state : KV page = "
          f"{state.bytes_per_slot() / tiny_kv:.1f} (real {real.state_native / real.kv_page:.1f})")
    trace_pages = Trace(args).longest()
    host0 = args.host_gib[0]
    points = [("gpu", g, host0, cfg) for g in sorted(set(args.gpu_gib) | set(args.ratio_at)) for cfg in wc.CONFIGS[1:]]
    points += [("host", args.host_sweep_gpu, h, "int8_t1_t2") for h in sorted(set(args.host_gib)) if h != host0]
    rows = []
    for sweep, g, h, cfg in points:
        tiers = wc.split_budget(real, int(g * GiB), int(h * GiB), args.max_running, trace_pages, args.kv_fraction)[cfg]
        r = run_point(tiers, state, args, args.requests, f"{wc.LABELS[cfg]} GPU {g:g} host {h:g}")
        row = {"sweep": sweep, "config": cfg, "gpu_gib": g, "host_gib": h if cfg == "int8_t1_t2" else 0,
               **{k: tiers.get(k, 0) for k in ("kv_pages", "t1_states", "host_kv_pages", "host_states")}, **r}
        rows.append(row)
        print(f"  {wc.LABELS[cfg]:>24} GPU {g:5g} GiB host {row['host_gib']:5g} GiB: T0 {tiers['kv_pages']} pages, "
              f"T1 {tiers['t1_states']} states -> hit {r['hit_rate']:.3f} (T2 {r['hit_rate_t2']:.3f}), state hits "
              f"{r['state_hit_rate']:.3f}, {r['req_per_s']:.0f} req/s")
    metrics: dict[str, float] = {}
    for r in rows:
        tag = f"{r['config']}_gpu{r['gpu_gib']:g}" + (f"_host{r['host_gib']:g}" if r["config"] == "int8_t1_t2" else "")
        metrics[f"hit_rate_{tag}"] = r["hit_rate"]
        metrics[f"state_hit_rate_{tag}"] = r["state_hit_rate"]
    for g in args.ratio_at:
        got = {r["config"]: r["hit_rate"] for r in rows if r["sweep"] == "gpu" and r["gpu_gib"] == g}
        if got["gpu_only"]:  # (omitted when (2) hits nothing: JSON has no inf)
            metrics[f"hit_rate_vs_gpu_only_{g:g}GiB"] = got["int8_t1_t2"] / got["gpu_only"]
            metrics[f"int8_hit_rate_vs_gpu_only_{g:g}GiB"] = got["int8_t1"] / got["gpu_only"]
    metrics["requests_per_point"] = args.requests
    metrics["total_s"] = time.perf_counter() - t_start
    os.makedirs(args.out, exist_ok=True)
    chart(os.path.join(args.out, f"capacity-{device_tag()}.png"), rows, args)
    notes = (f"Real structures, Qwen3-Next-80B-like byte budgets (KV page {real.kv_page / 2**20:.2f} MiB of "
             f"{args.page} tokens; state {real.state_native / 1e6:.1f} MB fp32 / {real.t1_int8 / 1e6:.1f} MB int8); "
             f"{args.active} live conversations, {args.systems} shared system prompts of "
             f"{args.system_pages * args.page} tokens, {args.min_rounds}-{args.max_rounds} rounds; {args.warm} "
             f"warm-up + {args.requests} measured requests per point; GPU split as workload_common.split_budget "
             f"(max_running {args.max_running}, "
             f"kv_fraction {args.kv_fraction}); (4) host {host0:g} GiB in the GPU sweep. "
             "hit_rate = prompt tokens reused.")
    path = write_results("capacity", metrics, rows=rows, notes=notes, out_dir=args.out)
    print(f"wrote {path} (+ .md, .png) in {metrics['total_s']:.1f} s")
    return path


if __name__ == "__main__":
    main()
