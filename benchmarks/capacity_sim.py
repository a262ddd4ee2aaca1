"""The capacity simulation's core: one configuration's real cache structures driven by a request trace.

``simulate(trace, gpu_bytes=, host_bytes=, config_name=)`` builds a ``TieredCache`` (the radix tree over
a real ``UnifiedPool`` (T0), ``Int8CheckpointPool`` (T1) and ``HostMirror`` + ``TransferEngine`` (T2);
in the model mode, below, its model) whose slot COUNTS come from byte budgets of Qwen3-Next-80B (KV: 12
full layers x 2 heads x 256, bf16; state: 36 linear layers x [32, 128, 128] fp32 + a bf16 conv window;
T1 / T2 states int8 or lossless as the configuration says), split as ``workload_common.split_budget``
splits the GPU budget for the engine benchmark. The slots themselves are tiny byte-sized stand-ins
(their T0 KV : state byte ratio kept, so the two sides of T0 trade bytes at the real rate). One sim
token is one KV page of ``page`` real tokens (page_size 1 in the tree; checkpoints on page boundaries,
as the engine places them).

Each request does what the reference engine does with the cache, minus the compute (``serve``, which
bench_policy.py can call too): ``match_prefix`` (cow_mamba), ``init_load_back`` of a host hit, lock, a
T0 state slot and the KV reserved (``TieredCache.alloc_states`` / ``alloc_kv``: evicting for room),
``cache_unfinished_req`` at the branch point, every prefill chunk end and the prompt end, each followed
by ``check_hicache_events`` (a chunk is an engine step), ``cache_finished_req`` at the last page
written. Requests run one at a time (no concurrency: running requests' KV is in the reservation).

Modes (``MODES``): ``full`` copies and checksums every transfer; ``fast`` keeps the real tree and the
transfer engine's tickets, busy marks and counts but copies no byte (``TransferEngine.checksums`` off,
a copier that copies nothing); ``model`` (the default) runs ``capacity_model.TreeModel``, the tree's
flows ported to flags and counts at block granularity (byte accounting, instant tickets), the same
``CountingLRUPolicy`` victims (``capacity_model.NodeLRU``) from the same touches. Every decision is the
same in all three, so the hits are (tests/bench/test_capacity_sim.py checks it on traces that evict in
every tier); the model serves 10^6 Mooncake requests in a few minutes of one core (the results page
has the timing) where the real tree takes hours. The model knows what this simulation uses (LRU, chunk
admission, write-through, no T3): other ``cache_overrides`` need ``fast``.

A trace is any iterable of ``SimRequest`` (prompt and answer in sim tokens, and the prompt's real token
count, which the hit rate is counted in). ``mooncake_requests`` turns a Mooncake trace into one: a sim
token per 512-token block, the answer's pages fresh ids that no prompt names.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Optional

import torch

from benchmarks import workload_common as wc
from benchmarks.capacity_model import TreeModel
from benchmarks.traces import BLOCK, TraceRequest
from tiered_cache.config import CacheConfig
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix import CacheReq, InitLoadBackParams, MatchPrefixParams, RadixKey
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.stack import TieredCache

GiB = 1 << 30
# Qwen3-Next-80B-A3B: 48 layers, every 4th full attention.
REAL_KV = KVSpec(num_layers=12, kv_heads=2, head_dim=256, dtype=torch.bfloat16)
REAL_STATE = StateSpec(num_layers=36, temporal_shape=(32, 128, 128), temporal_dtype=torch.float32,
                       conv_shapes=((8192, 3),), conv_dtype=torch.bfloat16, value_axis=2)
TINY_KV = KVSpec(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)  # 32 B per sim token
# The cached configurations (1) has no cache to simulate: its hit rate is 0 by construction.
SIM_CONFIGS = ("gpu_only", "gpu_only_host", "int8_t1", "int8_t1_t2")
MODES = ("model", "fast", "full")
TAGS = {"no_cache": "1", "gpu_only": "2", "gpu_only_host": "2b", "int8_t1": "3", "int8_t1_t2": "4"}
_CFG_FIELDS = {f.name for f in dataclasses.fields(CacheConfig)}


@dataclasses.dataclass(frozen=True)
class SimRequest:
    """One request in sim tokens (KV pages). ``tokens``: the prompt's real token count; a hit of ``p``
    pages reuses ``min(p * page, tokens)`` of them."""

    prompt: list[int]
    answer: list[int]
    tokens: int


def real_bytes(page: int) -> wc.TierBytes:
    """Qwen3-Next-80B's slot bytes with ``page`` tokens per KV page."""
    return wc.TierBytes.from_specs(REAL_KV, REAL_STATE, page)


def tiny_state(real: wc.TierBytes) -> StateSpec:
    """A state spec whose bytes : TINY_KV page bytes ~ the real state : KV page ratio."""
    kv = TINY_KV.bytes_per_slot(1)
    want = real.state_native / real.kv_page * kv
    dk = max(1, round((want - 64) / (4 * 16)))
    return StateSpec(num_layers=1, temporal_shape=(1, dk, 16), temporal_dtype=torch.float32,
                     conv_shapes=((4, 4),), conv_dtype=torch.float32, value_axis=2)


def tier_sizes(config_name: str, gpu_bytes: int, host_bytes: int, *, page: int, max_running: int,
               request_pages: int, kv_fraction: float, host_kv_fraction: Optional[float] = None) -> dict[str, Any]:
    """``config_name``'s tier sizes (``CacheConfig`` fields) at these budgets: ``workload_common.split_budget``'s
    ((2b): (2)'s GPU tiers plus (4)'s host bytes split alike, its T2 state slots lossless envelopes).
    ``host_kv_fraction``: the host's KV share when it is not ``kv_fraction`` (the GPU split stays)."""
    if config_name not in SIM_CONFIGS:
        raise InvalidArgumentError("config_name", f"one of {SIM_CONFIGS}", config_name)
    real = real_bytes(page)
    out = wc.split_budget(real, gpu_bytes, host_bytes, max_running, request_pages, kv_fraction)[config_name]
    if host_kv_fraction is not None and "host_kv_pages" in out:
        host = wc.split_budget(real, gpu_bytes, host_bytes, max_running, request_pages, host_kv_fraction)[config_name]
        out = {**out, "host_kv_pages": host["host_kv_pages"], "host_states": host["host_states"]}
    return out


def mooncake_requests(trace: Sequence[TraceRequest], *, block: int = BLOCK) -> list[SimRequest]:
    """A Mooncake trace in sim tokens: hash id h is sim token h + 1; the answer's pages are fresh ids
    above every hash id (no later prompt names them: the next turn's blocks have their own hash ids),
    one more than the pages the KV grows by, ``ceil((input + output - 1) / block)`` minus the prompt's
    (``Sim.request`` feeds all but the answer's last sim token, as the engine never feeds its last token).
    """
    nxt = max(h for r in trace for h in r.hash_ids) + 2
    out = []
    for r in trace:
        n_ans = math.ceil((r.input_length + r.output_length - 1) / block) - len(r.hash_ids) + 1
        out.append(SimRequest([h + 1 for h in r.hash_ids], list(range(nxt, nxt + n_ans)), r.input_length))
        nxt += n_ans
    return out


def replayed(trace: Sequence[SimRequest], n: int) -> Iterator[SimRequest]:
    """``n`` requests: ``trace`` over and over, copy k with every sim token t as ``t + k * span`` (``span``:
    the largest token of ``trace`` + 1), so each copy is new sessions (its own system prompts too) with
    the trace's statistics, sharing nothing with the other copies. Lazy: 10^6 requests never live at once."""
    if not trace:
        raise InvalidArgumentError("trace", "at least one request", trace)
    if not isinstance(n, int) or n < 1:
        raise InvalidArgumentError("n", "an int >= 1", n)
    span = max(max(r.prompt + r.answer) for r in trace) + 1
    for i in range(n):
        k, j = divmod(i, len(trace))
        r, off = trace[j], k * span
        yield r if off == 0 else SimRequest([t + off for t in r.prompt], [t + off for t in r.answer], r.tokens)


class _NoCopy:
    """The fast mode's copier: the transfer engine's tickets, busy marks and byte counts stay; no byte
    moves (``ScatterCopier.copy_rows``'s arguments, ignored)."""

    def copy_rows(self, *args: Any, **kwargs: Any) -> None:
        return None


@dataclasses.dataclass(frozen=True)
class Served:
    """What ``serve`` did for one request: ``reused`` pages (device + host), ``loaded`` of them through a
    load back from T2 (its whole chain), ``host_kv_pages`` of those copied from T2, ``state_from_host``:
    the resume state came from T2 (else T1, or none when ``reused`` is 0); ``load_failed``: a load back
    whose checksum failed (served as a miss of its host part)."""

    reused: int
    loaded: int
    host_kv_pages: int
    state_from_host: bool
    load_failed: bool


def serve(stack: TieredCache, prompt: Sequence[int], answer: Sequence[int], chunk: int,
          extra_cuts: Optional[Callable[[int, int, set[int]], Iterable[int]]] = None, cut_end: bool = True) -> Served:
    """One request through ``stack``'s tree as the reference engine drives it, minus the compute (module
    docstring): match (cow_mamba), load back of a host hit, lock, a T0 state slot and the KV (evicting),
    ``cache_unfinished_req`` at every prefill chunk end, the branch point, the prompt end and
    ``extra_cuts(reused, len(prompt), cuts)`` (more checkpoint positions, e.g. block boundaries), a
    ``check_hicache_events`` after each (every chunk is an engine step), ``cache_finished_req`` at the
    last page written. ``cut_end`` False: no state at the prompt end (a prompt whose last page is partial:
    the engine caches none there). Raises RuntimeError when T0 cannot hold the request even after evicting."""
    cache, kv = stack.tree, stack.kv
    n = len(prompt)
    req = CacheReq(token_ids=[], kv_indices=torch.empty(0, dtype=torch.int64))
    req.load_back = None
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(prompt[:n - 1])), cow_mamba=True, req=req))
    prefix, node, loaded, host_pages, from_host, failed = m.device_indices, m.last_device_node, 0, 0, False, False
    if m.host_hit_length > 0:
        ids, node2 = cache.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
        if len(ids):
            while not req.load_back.done:
                cache.check_hicache_events()
            if req.load_back.ok:
                t = req.load_back.tickets
                host_pages = t["kv"].nbytes // kv.entry_bytes if "kv" in t else 0
                from_host, loaded = "state" in t, len(ids)
                prefix, node = torch.cat([prefix, ids]), node2
            else:
                failed = True
    cache.inc_lock_ref(node)
    p = len(prefix)
    req.last_node, req.cache_protected_len, req.prefix_indices = node, p, prefix
    if req.mamba_pool_idx is None:
        req.mamba_pool_idx = stack.alloc_states(1)
        if req.mamba_pool_idx is None:
            raise RuntimeError("no T0 state slot even after evicting: the reservation is too small")
    new = stack.alloc_kv(n + len(answer) - p)
    if new is None:
        raise RuntimeError("a request's KV does not fit T0 even after evicting: raise the GPU budget")
    req.kv_indices = torch.cat([prefix, new])
    cuts = set(range(p + chunk, n, chunk)) | ({n} if cut_end else set())
    b = m.mamba_branching_seqlen
    if b is not None and p < b < n:
        cuts.add(b)
    if extra_cuts is not None:
        cuts |= {q for q in extra_cuts(p, n, set(cuts)) if p < q < n}
    full = list(prompt) + list(answer)
    for pos in sorted(cuts):
        req.token_ids = full[:pos]
        cache.cache_unfinished_req(req, chunked=True)
        cache.check_hicache_events()
    req.token_ids = full[:n + len(answer) - 1]  # the last answer token is emitted, never fed
    cache.cache_finished_req(req)
    cache.check_hicache_events()
    return Served(p, loaded, host_pages, from_host, failed)


_COUNTS = ("prompt", "reused", "reused_host", "pages", "reused_pages", "t1", "t2", "miss", "requests", "kv_loaded",
           "states_loaded", "load_fail")


def _count(c: dict, r: SimRequest, page: int, p: int, host_pages: int, from_host: bool) -> None:
    c["requests"] += 1
    c["prompt"] += r.tokens
    c["reused"] += min(p * page, r.tokens)
    c["reused_host"] += min(host_pages * page, r.tokens)
    c["pages"] += len(r.prompt)
    c["reused_pages"] += p
    c["kv_loaded"] += host_pages
    c[("t2" if from_host else "t1") if p else "miss"] += 1
    c["states_loaded"] += from_host


class Sim:
    """One configuration's tiers (a ``TieredCache``, sized in slots), ``serve``'s calls per request."""

    def __init__(self, cfg: CacheConfig, state: StateSpec, *, page: int, fast: bool) -> None:
        self.stack = TieredCache.build(cfg, kv=TINY_KV, state=state, device="cpu")
        self.cache, self.page = self.stack.tree, page
        if fast and self.stack.transfer is not None:
            self.stack.transfer.checksums = False
            self.stack.transfer.copier = _NoCopy()
        self.reset()

    def reset(self) -> None:
        self.c = dict.fromkeys(_COUNTS, 0)

    def request(self, r: SimRequest, chunk: int) -> int:
        """Serve ``r``; returns the pages reused (device + host)."""
        s = serve(self.stack, r.prompt, r.answer, chunk)
        _count(self.c, r, self.page, s.reused, s.host_kv_pages, s.state_from_host)
        self.c["load_fail"] += s.load_failed
        return s.reused

    def check(self) -> None:
        self.cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))

    def evictions(self) -> dict:
        return dict(self.stack.stats()["evictions"])


class ModelSim:
    """The same, through ``capacity_model.TreeModel`` (the model mode)."""

    def __init__(self, cfg: CacheConfig, state: StateSpec, *, page: int) -> None:
        self.model = TreeModel.of_config(cfg, kv=TINY_KV, state=state)
        self.page = page
        self.reset()

    def reset(self) -> None:
        self.c = dict.fromkeys(_COUNTS, 0)

    def request(self, r: SimRequest, chunk: int) -> int:
        p, host_pages, from_host = self.model.request(r.prompt, r.answer, chunk)
        _count(self.c, r, self.page, p, host_pages, from_host)
        return p

    def check(self) -> None:
        self.model.check_idle()

    def evictions(self) -> dict:
        return dict(self.model.lru.counts)


def simulate_tiers(trace: Iterable[SimRequest], tiers: Mapping[str, Any], *, cache_overrides: Optional[Mapping[
        str, Any]] = None, mode: str = "model", page: int = BLOCK, chunk_pages: Optional[int] = None, warm: int = 0,
        write_policy: str = "write_through", keep_hits: bool = False, progress: Optional[str] = None) -> dict:
    """``trace`` through a cache of these tier sizes (``CacheConfig`` fields) in ``mode`` (``MODES``);
    ``simulate``'s body. The first ``warm`` requests fill the cache and are not counted. Returns the
    counts and rates (``simulate``)."""
    if mode not in MODES:
        raise InvalidArgumentError("mode", f"one of {MODES}", mode)
    over = dict(cache_overrides or {})
    unknown = sorted(set(over) - _CFG_FIELDS)
    if unknown:
        raise InvalidArgumentError("cache_overrides", f"CacheConfig fields ({sorted(_CFG_FIELDS)})", unknown)
    chunk = chunk_pages if chunk_pages is not None else max(1, 8192 // page)
    if not isinstance(chunk, int) or chunk < 1:
        raise InvalidArgumentError("chunk_pages", "None or an int >= 1", chunk_pages)
    fields = dict(page_size=1, write_policy=write_policy, validate=False, check_memory=False, backend="torch")
    cfg = CacheConfig(**{**fields, **tiers, **over})
    state = tiny_state(real_bytes(page))
    sim: Any = ModelSim(cfg, state, page=page) if mode == "model" else Sim(cfg, state, page=page, fast=mode == "fast")
    hits: list[int] = []
    it: Iterable[SimRequest] = trace
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(trace, desc=f"{progress:>34}", unit="req", leave=False, mininterval=1.0)
    # The model makes no reference cycle (a removed node is unreachable and freed at once), while the
    # cyclic collector's full passes over its millions of live nodes and heap entries took most of the
    # time of a large point: off while it runs.
    gc_on = mode == "model" and gc.isenabled()
    if gc_on:
        gc.disable()
    try:
        t0 = t = time.perf_counter()
        c0 = time.process_time()
        for i, r in enumerate(it):
            if i == warm:
                sim.reset()  # measure after the cache has filled
                t, c0 = time.perf_counter(), time.process_time()
            p = sim.request(r, chunk)
            if keep_hits and i >= warm:
                hits.append(p)
        wall, cpu = time.perf_counter() - t, time.process_time() - c0
    finally:
        if gc_on:
            gc.enable()
    sim.check()
    c, n = sim.c, max(1, sim.c["requests"])
    out = {"hit_rate": c["reused"] / max(1, c["prompt"]), "hit_rate_t2": c["reused_host"] / max(1, c["prompt"]),
           "page_hit_rate": c["reused_pages"] / max(1, c["pages"]), "state_hit_rate": (c["t1"] + c["t2"]) / n,
           "state_hits_t1": c["t1"], "state_hits_t2": c["t2"], "state_misses": c["miss"], "requests": c["requests"],
           "prompt_tokens": c["prompt"], "reused_tokens": c["reused"], "t2_kv_pages_loaded": c["kv_loaded"],
           "t2_states_loaded": c["states_loaded"], "load_failures": c["load_fail"], "wall_s": wall,
           "cpu_s": cpu, "total_s": time.perf_counter() - t0,
           "req_per_s": c["requests"] / wall if wall > 0 else float("nan"), "evictions": sim.evictions()}
    if keep_hits:
        out["hits"] = hits
    return out


def simulate(trace: Iterable[SimRequest], *, gpu_bytes: int, host_bytes: int, config_name: str,
             cache_overrides: Optional[Mapping[str, Any]] = None, mode: str = "model", page: int = BLOCK,
             max_running: int = 4, kv_fraction: float = 0.6, host_kv_fraction: Optional[float] = None,
             request_pages: Optional[int] = None, chunk_pages: Optional[int] = None, warm: int = 0,
             write_policy: str = "write_through", keep_hits: bool = False, progress: Optional[str] = None) -> dict:
    """``trace`` (``SimRequest``s) through ``config_name`` (one of ``SIM_CONFIGS``) at these GPU / host
    byte budgets of Qwen3-Next-80B, split as ``workload_common.split_budget`` does (``max_running``,
    ``kv_fraction``, ``host_kv_fraction``: ``tier_sizes``; ``request_pages``: the longest request's
    pages, taken from ``trace`` when it is a sequence). ``cache_overrides``: ``CacheConfig`` fields set on
    top (an eviction policy, admission, a write policy, even tier sizes): how another policy drives the
    same simulation. ``mode``: the real tree with or without copies, or the model (``MODES``, module
    docstring). ``page``: real tokens per sim token; ``chunk_pages``: the prefill chunk (None: 8192
    tokens). Returns ``simulate_tiers``' dict plus the tier sizes used.

    hit_rate: prompt tokens reused / prompt tokens (real tokens); hit_rate_t2: of them, loaded from T2;
    state_hit_rate: requests that resumed from a cached state; req_per_s: simulated requests a second
    (of wall time; cpu_s: the CPU seconds this process spent on them, the measure on a shared machine).
    """
    if request_pages is None:
        if not isinstance(trace, Sequence):
            raise InvalidArgumentError("request_pages", "an int when trace is not a sequence", request_pages)
        request_pages = max(len(r.prompt) + len(r.answer) for r in trace)
    tiers = tier_sizes(config_name, gpu_bytes, host_bytes, page=page, max_running=max_running,
                       request_pages=request_pages, kv_fraction=kv_fraction, host_kv_fraction=host_kv_fraction)
    out = simulate_tiers(trace, tiers, cache_overrides=cache_overrides, mode=mode, page=page, chunk_pages=chunk_pages,
                         warm=warm, write_policy=write_policy, keep_hits=keep_hits, progress=progress)
    return {**{k: tiers.get(k, 0) for k in ("kv_pages", "t1_states", "host_kv_pages", "host_states")}, **out}
