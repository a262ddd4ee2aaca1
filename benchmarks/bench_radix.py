"""Radix cache benchmark (CPU): our tree against SGLang's ``RadixCache`` on one trace, side by side.

Ours: ``TieredCache.build(...).tree`` (a ``HiMambaRadixCache`` over T0 and an int8 T1, KV ids validated
as the caller's: the defaults an engine gets). Baseline: SGLang 0.5.23's pure-Python
``sglang.srt.mem_cache.radix_cache.RadixCache`` built as SGLang's scheduler builds it (``CacheInitParams``
with its real ``ReqToTokenPool`` and ``PagedTokenToKVPoolAllocator`` over an ``MHATokenToKVPool``, on
CPU), the strongest thing a user of SGLang runs instead. Both serve the same turns in the same order.

Trace: chats opened by one of 8 shared system prompts (1024 tokens), then turns of a user message and
an answer (64-320 tokens each). A turn is cached as an engine caches it: match, lock, allocate KV for
the new tokens, insert with the hit as ``prev_prefix_len`` (ours: and the match's node as ``last_node``, where
the walk may start, as our request flows pass ``req.last_node``; SGLang: insert, then free the duplicates
``value[hit:prefix_len]`` as its ``_insert_cache`` does), unlock. Both trees are grown to the target
(10^5 and 10^6 cached tokens); before timing, every match of a check set must find the same number of
tokens on both sides. Then ``--rounds`` interleaved rounds (the side that goes first alternates), each:

- match: ``--ops`` queries (a random chat's history plus a fresh user message); ours with ``cow_mamba``
  (the state is loaded into the request's T0 slot, as an engine resumes), SGLang's ``match_prefix`` plus
  ``path_device_indices`` (the ids the engine reads off the match, ``prefix_device_indices``).
- insert: ``--ops`` next turns (KV allocated outside the timer).
- evict: ``evict(num_tokens=256)`` until what the round's inserts added is gone again; tokens evicted
  per second.

Keys are made inside the timer, on both sides from the ids as SGLang's ``Req`` holds them (an
``array("q")``: what our SGLang backend gets too), as each tree is called per request. A round's inputs are
made before its timers as such arrays too, not lists of Python ints: an array is not tracked by Python's
cycle collector, while a young list of 10^4 ints is walked item by item by every young-generation collection
that an allocation inside a timed call triggers (2-20 ms a collection at 10^5 cached tokens, charged to
whichever side made the 700th allocation). Each ratio is
SGLang's time over ours per round (> 1: ours is faster), reported as median, min and max over rounds.
``*_tree_only``: our time less the time spent inside the T1 pool (``Int8CheckpointPool``: the state's
store, load, slot alloc/free and flag reads), i.e. the tree's bookkeeping alone; SGLang's tree holds
no state, so the plain ratios carry our T1 cost and SGLang's carry none.

State spec is tiny on purpose: the host-side cost per call is measured, not the int8 kernels
(``bench_kernels.py``). Without sglang the script says so and measures nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time
from array import array
from typing import Any, Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.common import write_results  # noqa: E402
from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.radix import EvictParams, InsertParams, MatchPrefixParams, RadixKey  # noqa: E402
from tiered_cache.specs import KVSpec, StateSpec  # noqa: E402
from tiered_cache.stack import TieredCache  # noqa: E402

PS = 16
EVICT_TOKENS = 256
KV = KVSpec(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)
ST = StateSpec(num_layers=1, temporal_shape=(1, 4, 4), conv_shapes=((4, 3),), conv_dtype=torch.float32)
T1_CALLS = ("store_from_active", "load_to_active", "store_rows", "load_rows", "free", "free_owned", "alloc",
            "alloc_ids", "poll_flags")
SKIP = ("bench_radix: sglang is not installed (pip install --no-deps -r constraints/sglang-test.txt): "
        "the side-by-side benchmark needs SGLang's RadixCache; skipped, nothing measured")


def load_sglang() -> Optional[dict[str, Any]]:
    """SGLang's cache modules, or None where sglang is absent. SGLang's import chain needs torchvision:
    the stand-in of the SGLang tests (tests/integrations/sglang/conftest.py) is installed first."""
    if importlib.util.find_spec("sglang") is None:
        return None
    spec = importlib.util.spec_from_file_location(
        "_sglang_stand_in", os.path.join(ROOT, "tests", "integrations", "sglang", "conftest.py"))
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    from sglang.srt.mem_cache import allocator, base_prefix_cache, cache_init_params, memory_pool, radix_cache

    return {"radix": radix_cache, "allocator": allocator, "pool": memory_pool, "params": cache_init_params,
            "base": base_prefix_cache}


class Trace:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.systems = [[self.rng.randrange(1, 50000) for _ in range(1024)] for _ in range(8)]
        self.chats: list[list[int]] = []

    def turn(self) -> list[int]:
        return [self.rng.randrange(1, 50000) for _ in range(self.rng.randrange(64, 320))]

    def next_turn(self) -> list[int]:
        """A random chat grown by one exchange (a new chat 15 % of the time): its whole history."""
        if not self.chats or self.rng.random() < 0.15:
            self.chats.append(list(self.rng.choice(self.systems)))
        c = self.rng.randrange(len(self.chats))
        self.chats[c] += self.turn() + self.turn()
        return self.chats[c]

    def query(self) -> list[int]:
        return self.chats[self.rng.randrange(len(self.chats))] + self.turn()


def pool_pages(tokens: int, ops: int) -> int:
    """KV pages for ``tokens`` cached plus a round of ``ops`` turns (each at most a system prompt and two
    turns new), so no side evicts but where the benchmark times it."""
    return (int(tokens * 1.25) + ops * 1700) // PS + 64


class T1Timer:
    """Seconds spent inside the T1 pool's calls (instance attributes wrap its methods; a call made inside
    another, ``store_from_active``'s ``store_rows``, is counted once, in the outer)."""

    def __init__(self, ckpt: Any):
        self.s = 0.0
        self.depth = 0
        for name in T1_CALLS:
            setattr(ckpt, name, self._wrap(getattr(ckpt, name)))

    def _wrap(self, fn):
        def timed(*a, **kw):
            self.depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.depth -= 1
                if not self.depth:
                    self.s += time.perf_counter() - t0
        return timed


class Ours:
    """Our tree as an engine drives it (``TieredCache`` built with the engine's defaults)."""

    name = "ours"

    def __init__(self, tokens: int, ops: int):
        pages = pool_pages(tokens, ops)
        cfg = CacheConfig(page_size=PS, kv_pages=pages, t0_states=64, t1_states=pages // 4 + 64, codec="int8",
                          lazy_compaction=True, check_memory=False, backend="torch")
        self.stack = TieredCache.build(cfg, kv=KV, state=ST, device="cpu")
        self.cache = self.stack.tree
        self.t1 = T1Timer(self.cache.ckpt)

    @property
    def size(self) -> int:
        """Cached tokens."""
        return self.cache.total_size()[0]

    def held(self, toks: Any) -> Any:
        """Token ids (a list or an array) as SGLang's ``Req`` holds them (an ``array("q")``), which our SGLang
        backend makes keys of (``integrations.sglang.backend.tree_key``)."""
        return array("q", toks)

    def turn(self, toks: Any) -> tuple[float, float]:
        """One engine turn; -> (insert seconds, of them inside T1)."""
        cache, ps = self.cache, PS
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(toks)))
        cache.inc_lock_ref(m.last_device_node)
        hit, aligned = len(m.device_indices), len(toks) // ps * ps
        # the engine's allocation: evicts cached KV for room when T0 is full (lazy compaction leaves holes)
        new, slot = self.stack.alloc_kv(aligned - hit), self.stack.alloc_states(1)
        assert new is not None and slot is not None, "the benchmark's pools are sized for the trace"
        value = torch.cat([m.device_indices, new])
        t1, t0 = self.t1.s, time.perf_counter()
        res = cache.insert(InsertParams(key=RadixKey(toks[:aligned]), value=value, mamba_value=slot,
                                        prev_prefix_len=hit, last_node=m.last_device_node))
        dt = time.perf_counter() - t0
        if res.cached_len < aligned:
            cache.kv.free(value[max(res.cached_len, hit):])
        cache.states.free(slot)
        cache.dec_lock_ref(m.last_device_node)
        return dt, self.t1.s - t1

    def match(self, toks: Any, req: Any) -> int:
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(toks), req=req, cow_mamba=True))
        return int(m.kv_hit_length)

    def evict(self) -> int:
        return self.cache.evict(EvictParams(num_tokens=EVICT_TOKENS)).num_tokens_evicted


class Sgl:
    """SGLang's ``RadixCache`` over its real CPU pools, built as its scheduler builds it."""

    name = "sglang"

    def __init__(self, tokens: int, ops: int, sgl: dict[str, Any]):
        self.sgl = sgl
        size = pool_pages(tokens, ops) * PS
        kv_pool = sgl["pool"].MHATokenToKVPool(size=size, page_size=PS, dtype=torch.float32, head_num=1, head_dim=4,
                                               layer_num=1, device="cpu", enable_memory_saver=False)
        self.alloc = sgl["allocator"].PagedTokenToKVPoolAllocator(size, PS, torch.float32, "cpu", kv_pool,
                                                                   need_sort=False)
        rows = sgl["pool"].ReqToTokenPool(size=8, max_context_len=1 << 16, device="cpu", enable_memory_saver=False)
        params = sgl["params"].CacheInitParams(disable=False, req_to_token_pool=rows,
                                               token_to_kv_pool_allocator=self.alloc, page_size=PS)
        self.cache = sgl["radix"].RadixCache(params)

    @property
    def size(self) -> int:
        return self.cache.evictable_size() + self.cache.protected_size()

    def held(self, toks: Any) -> Any:
        """Token ids (a list or an array) as SGLang's ``Req`` holds them (an ``array("q")``)."""
        return array("q", toks)

    def turn(self, toks: Any) -> tuple[float, float]:
        b, cache, key = self.sgl["base"], self.cache, self.sgl["radix"].RadixKey
        m = cache.match_prefix(b.MatchPrefixParams(key=key(toks)))
        cache.inc_lock_ref(m.last_device_node)
        hit, aligned = m.device_prefix_len, len(toks) // PS * PS
        prefix = cache.path_device_indices(m.last_device_node)[:hit]
        new = self.alloc.alloc(aligned - hit)
        if new is None:  # the scheduler's order: evict for room, then allocate
            cache.evict(b.EvictParams(num_tokens=aligned - hit))
            new = self.alloc.alloc(aligned - hit)
        assert new is not None, "the benchmark's pools are sized for the trace"
        value = torch.cat([prefix, new])
        t0 = time.perf_counter()
        res = cache.insert(b.InsertParams(key=key(toks[:aligned]), value=value))
        self.alloc.free_segment(value[hit:res.prefix_len], start_pos=hit)  # _insert_cache's duplicate free
        dt = time.perf_counter() - t0
        cache.dec_lock_ref(m.last_device_node)
        return dt, 0.0

    def match(self, toks: Any, req: Any) -> int:
        m = self.cache.match_prefix(self.sgl["base"].MatchPrefixParams(key=self.sgl["radix"].RadixKey(toks)))
        self.cache.path_device_indices(m.last_device_node)
        return int(m.device_prefix_len)

    def evict(self) -> int:
        return self.cache.evict(self.sgl["base"].EvictParams(num_tokens=EVICT_TOKENS)).num_tokens_evicted


class Req:
    """What ``cow_mamba`` needs of a request: the T0 state slot a hit's state is loaded into."""

    def __init__(self, slot: torch.Tensor):
        self.mamba_pool_idx = slot


def check_same_hits(ours: Ours, sgl: Sgl, queries: list[list[int]]) -> int:
    """Every query matches the same number of KV tokens on both sides (raises otherwise); -> tokens hit."""
    total = 0
    for q in queries:
        a = int(ours.cache.match_prefix(MatchPrefixParams(key=RadixKey(ours.held(q)))).kv_hit_length)
        b = sgl.match(sgl.held(q), None)
        if a != b:
            raise AssertionError(f"match of a {len(q)}-token query: ours {a} tokens, SGLang {b}")
        total += a
    return total


def _timed(fn, items) -> float:
    t = 0.0
    for x in items:
        t0 = time.perf_counter()
        fn(*x)
        t += time.perf_counter() - t0
    return t


def run_size(target: int, rounds: int, ops: int, sgl_mods: dict[str, Any], seed: int = 0) -> dict:
    ours, sgl = Ours(target, ops), Sgl(target, ops, sgl_mods)
    trace = Trace(seed)
    while ours.size < target:
        toks = trace.next_turn()
        ours.turn(ours.held(toks))
        sgl.turn(sgl.held(toks))
    if ours.size != sgl.size:
        raise AssertionError(f"grown trees differ: ours {ours.size} tokens cached, SGLang {sgl.size}")
    cached = ours.size
    hit_tokens = check_same_hits(ours, sgl, [trace.query() for _ in range(min(200, ops))])
    ours.cache.check_invariants()
    req = Req(ours.cache.states.alloc(1))
    r: dict[str, list[float]] = {k: [] for k in ("match", "match_tree_only", "insert", "insert_tree_only", "evict",
                                                 "evict_tree_only", "ours_match_us", "sgl_match_us", "ours_insert_us",
                                                 "sgl_insert_us", "ours_evict_tok_s", "sgl_evict_tok_s")}
    for rnd in range(rounds):
        sides = (ours, sgl) if rnd % 2 == 0 else (sgl, ours)
        queries = [array("q", trace.query()) for _ in range(ops)]  # arrays: see the docstring (inputs)
        t: dict[str, float] = {}
        for side in sides:
            keys = [(side.held(q), req) for q in queries]
            t1 = ours.t1.s
            t[side.name] = _timed(side.match, keys)
            t[side.name + "_t1"] = ours.t1.s - t1
        r["match"].append(t["sglang"] / t["ours"])
        r["match_tree_only"].append(t["sglang"] / (t["ours"] - t["ours_t1"]))
        r["ours_match_us"].append(t["ours"] / ops * 1e6)
        r["sgl_match_us"].append(t["sglang"] / ops * 1e6)
        turns = [array("q", trace.next_turn()) for _ in range(ops)]
        start = {s.name: s.size for s in sides}
        for side in sides:
            held = [side.held(toks) for toks in turns]
            got = [side.turn(toks) for toks in held]
            t[side.name] = sum(g[0] for g in got)
            t[side.name + "_t1"] = sum(g[1] for g in got)
        r["insert"].append(t["sglang"] / t["ours"])
        r["insert_tree_only"].append(t["sglang"] / (t["ours"] - t["ours_t1"]))
        r["ours_insert_us"].append(t["ours"] / ops * 1e6)
        r["sgl_insert_us"].append(t["sglang"] / ops * 1e6)
        rate: dict[str, float] = {}
        for side in sides:
            n, el, t1 = 0, 0.0, ours.t1.s
            while side.size > start[side.name]:
                t0 = time.perf_counter()
                got = side.evict()
                el += time.perf_counter() - t0
                n += got
                if not got:
                    break
            rate[side.name] = n / el
            rate[side.name + "_tree_only"] = n / (el - (ours.t1.s - t1)) if side is ours else 0.0
        r["evict"].append(rate["ours"] / rate["sglang"])
        r["evict_tree_only"].append(rate["ours_tree_only"] / rate["sglang"])
        r["ours_evict_tok_s"].append(rate["ours"])
        r["sgl_evict_tok_s"].append(rate["sglang"])
        print(f"  round {rnd}: match {r['match'][-1]:.2f}x insert {r['insert'][-1]:.2f}x "
              f"evict {r['evict'][-1]:.2f}x", flush=True)
    ours.cache.states.free(req.mamba_pool_idx)
    ours.cache.check_invariants()
    out: dict[str, float] = {"cached_tokens": cached, "check_hit_tokens": hit_tokens}
    for k, v in r.items():
        out[k] = statistics.median(v)
        if k in ("match", "match_tree_only", "insert", "insert_tree_only", "evict", "evict_tree_only"):
            out[k + "_min"], out[k + "_max"] = min(v), max(v)
    return out


def main(argv=None) -> Optional[str]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="10^3 and 10^4 tokens, few ops (a smoke run)")
    ap.add_argument("--ops", type=int, default=300, help="matches and inserts per round")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", nargs="+", default=["1e5", "1e6"], help="cached tokens per tree (default 1e5 1e6)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    if args.ops < 1 or args.rounds < 1:
        ap.error(f"--ops / --rounds: ints >= 1, got {args.ops} / {args.rounds}")
    try:
        bad = [t for t in args.sizes if not float(t) >= 1]
    except ValueError:
        bad = list(args.sizes)
    if bad:
        ap.error(f"--sizes: numbers of cached tokens >= 1 (e.g. 1e5), got {args.sizes}")
    sgl = load_sglang()
    if sgl is None:
        print(SKIP)
        return None
    sizes = [(float(t), t) for t in (["1e3", "1e4"] if args.small else args.sizes)]
    ops, rounds = (20, 3) if args.small else (args.ops, args.rounds)
    metrics: dict[str, float] = {}
    rows = []
    for size, tag in sizes:
        print(tag, flush=True)
        res = run_size(int(size), rounds, ops, sgl)
        for k, v in res.items():
            name = k if k in ("cached_tokens", "check_hit_tokens") or k.startswith(("ours_", "sgl_")) else \
                k.replace("match", "match_vs_sglang").replace("insert", "insert_vs_sglang").replace(
                    "evict", "evict_vs_sglang", 1)
            metrics[f"{name}_{tag}"] = v
        rows.append({"size": tag, "cached tokens": res["cached_tokens"],
                     **{f"{op} vs SGLang (min-max)": f"{res[op]:.2f}x ({res[op + '_min']:.2f}-{res[op + '_max']:.2f})"
                        for op in ("match", "match_tree_only", "insert", "insert_tree_only", "evict",
                                   "evict_tree_only")},
                     "ours / SGLang match us": f"{res['ours_match_us']:.1f} / {res['sgl_match_us']:.1f}",
                     "ours / SGLang insert us": f"{res['ours_insert_us']:.1f} / {res['sgl_insert_us']:.1f}",
                     "ours / SGLang evict tok/s": f"{res['ours_evict_tok_s']:,.0f} / {res['sgl_evict_tok_s']:,.0f}"})
    metrics["page_size"] = PS
    notes = (f"page_size {PS}; CPU host code; {rounds} interleaved rounds of {ops} matches and {ops} inserts, then "
             f"evict(num_tokens={EVICT_TOKENS}) back to the round's start size; ratio = SGLang's time / ours "
             "(median, min-max over rounds); *_tree_only: ours less the time inside the T1 pool. Baseline: SGLang "
             "0.5.23 RadixCache over its CPU pools. See the script's docstring.")
    return write_results("radix", metrics, rows=rows, out_dir=args.out, notes=notes)


if __name__ == "__main__":
    print(main())
