"""Radix cache benchmark (CPU): match, insert and evict operations per second on a multi-turn trace.

Trace: ``conversations`` chats, each opened by one of 8 shared system prompts (1024 tokens), then
turns of a user message and an answer (64-320 tokens each). Turns are cached as an engine would:
match the history (``cow_mamba``, lock), allocate KV for the new tokens, ``insert`` with
``prev_prefix_len`` = the hit, unlock. The tree is grown until it holds the target number of cached
tokens (10^5 and 10^6), then timed:

- match: the history of a random chat plus a fresh user message (a miss past the history); p99 of
  single calls in microseconds. Baseline in the same run: chained page hashes looked up in a dict
  (vLLM's block-hash scheme), the same matches, checked equal first.
- insert: the next turn of a random chat (KV ids allocated outside the timer, T1 copy inside).
- evict: ``evict(num_tokens=256)`` until a quarter of the cache is gone (T0 with lazy compaction, as an
  engine runs it: eager compaction moves rows on every free and would time the allocator).

State spec is tiny on purpose: the tree's host-side cost is measured, not the int8 kernels
(``bench_kernels.py``). KV ids are validated as the caller's (the default) on every insert.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_results  # noqa: E402
from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.radix import EvictParams, HiMambaRadixCache, InsertParams, MatchPrefixParams, RadixKey  # noqa: E402
from tiered_cache.specs import KVSpec, StateSpec  # noqa: E402
from tiered_cache.stack import TieredCache  # noqa: E402

PS = 16
KV = KVSpec(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)
ST = StateSpec(num_layers=1, temporal_shape=(1, 4, 4), conv_shapes=((4, 3),), conv_dtype=torch.float32)


class Trace:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.systems = [[self.rng.randrange(1, 50000) for _ in range(1024)] for _ in range(8)]
        self.chats: list[list[int]] = []

    def turn(self) -> list[int]:
        return [self.rng.randrange(1, 50000) for _ in range(self.rng.randrange(64, 320))]

    def new_chat(self) -> int:
        self.chats.append(list(self.rng.choice(self.systems)))
        return len(self.chats) - 1


def build(target_tokens: int, seed: int = 0):
    pages = int(target_tokens * 1.6) // PS + 64
    cfg = CacheConfig(page_size=PS, kv_pages=pages, t0_states=64, t1_states=pages // 4 + 64, codec="int8",
                      lazy_compaction=True, check_memory=False, backend="torch")
    return TieredCache.build(cfg, kv=KV, state=ST, device="cpu").tree, Trace(seed)


def cache_turn(cache: HiMambaRadixCache, toks: list[int], timer: list | None = None) -> bool:
    """One engine turn: match + lock, new KV, insert, unlock. ``timer`` collects insert seconds."""
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(toks)))
    cache.inc_lock_ref(m.last_device_node)
    hit = len(m.device_indices)
    aligned = len(toks) // PS * PS
    new = cache.kv.alloc(aligned - hit)
    slot = cache.states.alloc(1)
    ok = new is not None and slot is not None
    if ok:
        value = torch.cat([m.device_indices, new])
        t0 = time.perf_counter()
        res = cache.insert(InsertParams(key=RadixKey(toks[:aligned]), value=value, mamba_value=slot,
                                        prev_prefix_len=hit))
        if timer is not None:
            timer.append(time.perf_counter() - t0)
        if value[res.cached_len:].numel():
            cache.kv.free(value[max(res.cached_len, hit):])
    for x, side in ((new, cache.kv), (slot, cache.states)):
        if x is not None and (side is cache.states or not ok):
            side.free(x)
    cache.dec_lock_ref(m.last_device_node)
    return ok


def grow(cache, trace, target_tokens):
    while cache.total_size()[0] < target_tokens:
        if not trace.chats or trace.rng.random() < 0.15:
            trace.new_chat()
        c = trace.rng.randrange(len(trace.chats))
        trace.chats[c] += trace.turn() + trace.turn()
        if not cache_turn(cache, trace.chats[c]):
            break


class HashBaseline:
    """Chained page hashes in a dict: what a block-hash prefix cache does per lookup."""

    def __init__(self):
        self.table: dict[int, int] = {}

    def add(self, toks):
        h = 0
        for p in range(0, len(toks) // PS * PS, PS):
            h = hash((h, tuple(toks[p:p + PS])))
            self.table[h] = 1

    def match(self, toks) -> int:
        h, n = 0, 0
        for p in range(0, len(toks) // PS * PS, PS):
            h = hash((h, tuple(toks[p:p + PS])))
            if h not in self.table:
                break
            n += PS
        return n


def run_size(target: int, n_ops: int, seed: int = 0) -> dict:
    cache, trace = build(target, seed)
    grow(cache, trace, target)
    cached = cache.total_size()[0]
    rng = random.Random(seed + 1)
    queries = [trace.chats[rng.randrange(len(trace.chats))] + trace.turn() for _ in range(n_ops)]
    base = HashBaseline()
    stack = [(cache.root, [])]
    while stack:  # the baseline holds exactly what the tree holds
        x, pre = stack.pop()
        for c in x.children.values():
            stack.append((c, pre + c.key))
            if not c.children:
                base.add(pre + c.key)
    for q in queries[:50]:  # correctness before timing
        assert cache.match_prefix(MatchPrefixParams(key=q)).kv_hit_length == base.match(q)
    lat = []
    t_all = time.perf_counter()
    for q in queries:
        t0 = time.perf_counter_ns()
        cache.match_prefix(MatchPrefixParams(key=q))
        lat.append(time.perf_counter_ns() - t0)
    match_s = time.perf_counter() - t_all
    t0 = time.perf_counter()
    for q in queries:
        base.match(q)
    base_s = time.perf_counter() - t0
    lat.sort()
    ins = []
    for _ in range(n_ops):
        c = rng.randrange(len(trace.chats))
        trace.chats[c] += trace.turn() + trace.turn()
        cache_turn(cache, trace.chats[c], ins)
    goal = cache.total_size()[0] * 3 // 4
    n_ev, t0 = 0, time.perf_counter()
    while cache.total_size()[0] > goal and n_ev < n_ops:
        cache.evict(EvictParams(num_tokens=256))
        n_ev += 1
    ev_s = time.perf_counter() - t0
    cache.check_invariants()
    return {
        "cached_tokens": cached,
        "nodes": _count_nodes(cache),
        "match_ops_per_s": n_ops / match_s,
        "match_p99_us": lat[int(0.99 * (len(lat) - 1))] / 1e3,
        "match_p50_us": lat[len(lat) // 2] / 1e3,
        "match_vs_hash_baseline": base_s / match_s,
        "insert_ops_per_s": len(ins) / max(sum(ins), 1e-12),
        "evict_ops_per_s": n_ev / max(ev_s, 1e-12),
    }


def _count_nodes(cache) -> int:
    n, stack = 0, [cache.root]
    while stack:
        x = stack.pop()
        n += 1
        stack.extend(x.children.values())
    return n - 1


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="10^3 and 10^4 tokens, few ops (a smoke run)")
    ap.add_argument("--ops", type=int, default=2000)
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    sizes = [(1e3, "1e3"), (1e4, "1e4")] if args.small else [(1e5, "1e5"), (1e6, "1e6")]
    ops = 50 if args.small else args.ops
    metrics, rows = {}, []
    for size, tag in sizes:
        r = run_size(int(size), ops)
        rows.append({"size": tag, **{k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}})
        for k, v in r.items():
            metrics[f"{k}_{tag}"] = v
        print(tag, r, flush=True)
    metrics["page_size"] = PS
    return write_results("radix", metrics, rows=rows, out_dir=args.out,
                         notes=f"page_size {PS}; CPU host code; ops per size: {ops}. See the script's docstring.")


if __name__ == "__main__":
    print(main())
