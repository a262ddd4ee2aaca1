"""Capacity simulation: hit rate against GPU and host memory, the cache's decisions without a model.

    python benchmarks/bench_capacity.py                  # synthetic multi-turn trace, CPU, a few minutes
    python benchmarks/bench_capacity.py --trace ../shared/traces/mooncake_conversation_trace.jsonl --million 1000000
    python benchmarks/bench_capacity.py --requests 1000000 --gpu-gib 16 --host-gib 256   # synthetic, one point

The simulation itself (the configurations' tiers at Qwen3-Next-80B byte budgets, the engine's cache
calls per request, the model / fast / full modes) is ``capacity_sim.simulate``; this script drives it.

Synthetic trace (default; writes ``capacity-<device>``): ``--active`` conversations live at once (the
working set); each request picks one at random and sends its next turn (history + previous answer + a
new question); a conversation that has done its rounds is replaced by a new one. Every conversation
starts with one of ``--systems`` shared system prompts (Zipf popularity). One sim token is a KV page
of ``--page`` tokens. A GPU sweep of (2), (3), (4) and (2b) (host ``--host-gib[0]``) and a host sweep
of (4) and (2b) at ``--host-sweep-gpu``.

Mooncake trace (``--trace FILE``; writes ``capacity-mooncake-<device>``): the trace's requests in
arrival order, one sim token per 512-token block (``capacity_sim.mooncake_requests``), over a grid:
(2) and (3) at every ``--grid-gpu-only``, (2b) and (4) at every (``--grid-gpu``, ``--grid-host``) pair,
the points spread over ``--workers`` processes. The ceiling is the same simulation with every tier
unbounded (``unbounded_tiers``): a hybrid resumes only where the engine's checkpoint placement left a
state, so it is below the trace's prefix-reuse bound (``traces.unbounded_reuse``, reported beside it).
The three modes run the trace's first ``--check-requests`` requests at ``--check-at`` (their hits
compared request by request); ``--million N`` times one point of N requests (the trace replayed).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import random
import sys
import time
from collections.abc import Iterator
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import capacity_sim as cs  # noqa: E402
from benchmarks import workload_common as wc  # noqa: E402
from benchmarks.capacity_sim import SimRequest, simulate  # noqa: E402
from benchmarks.common import RESULTS, device_tag, write_results  # noqa: E402
from benchmarks.traces import BLOCK, load_trace, unbounded_reuse  # noqa: E402
from tiered_cache.config import WRITE_POLICIES  # noqa: E402

GiB = cs.GiB
HOST_CONFIGS = ("gpu_only_host", "int8_t1_t2")  # (2b), (4): the ones with a host tier
_RUN: dict[str, Any] = {}  # the arguments (and the parsed trace), set before the workers fork


# ------------------------------------------------------------------------------------------ trace
class Trace:
    """Seeded multi-turn / shared-prefix trace in sim tokens (pages). ``next()`` -> a ``SimRequest``."""

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

    def next(self) -> SimRequest:
        i = self.rng.randrange(len(self.active))
        c = self.active[i]
        q = self._fresh(self.rng.randint(*self.a.question_pages))
        ans = self._fresh(self.rng.randint(*self.a.answer_pages))
        prompt = c["history"] + q
        c["history"] = prompt + ans
        c["left"] -= 1
        if c["left"] == 0:
            self.active[i] = self._new_conv()
        return SimRequest(prompt, ans, len(prompt) * self.a.page)

    def take(self, n: int) -> Iterator[SimRequest]:
        return (self.next() for _ in range(n))

    def longest(self) -> int:
        a = self.a
        return a.system_pages + a.max_rounds * (a.question_pages[1] + a.answer_pages[1])


def synthetic_point(args: argparse.Namespace, cfg: str, gpu_gib: float, host_gib: float, *, mode: str,
                    requests: Optional[int] = None, keep_hits: bool = False) -> dict:
    """One configuration on the synthetic trace: ``--warm`` requests, then ``requests`` measured."""
    n = args.requests if requests is None else requests
    label = f"{wc.LABELS[cfg]} GPU {gpu_gib:g} host {host_gib:g}" if args.progress and args.workers <= 1 else None
    return simulate(Trace(args, seed=args.seed).take(args.warm + n), gpu_bytes=int(gpu_gib * GiB),
                       host_bytes=int(host_gib * GiB), config_name=cfg, mode=mode, page=args.page,
                       max_running=args.max_running, kv_fraction=args.kv_fraction, request_pages=Trace(args).longest(),
                       chunk_pages=args.chunk_pages, warm=args.warm, write_policy=args.write_policy,
                       keep_hits=keep_hits, progress=label)


def _synthetic_job(sweep: str, g: float, h: float, cfg: str) -> dict:
    """One point of the synthetic sweep (in a worker: reads ``_RUN``)."""
    a = _RUN["args"]
    r = synthetic_point(a, cfg, g, h, mode=a.mode)
    r.pop("evictions")
    return {"sweep": sweep, "config": cfg, "gpu_gib": g, "host_gib": h, **r}


def chart(path: str, rows: list[dict], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(12, 4.6))
    fig.suptitle(f"capacity: Qwen3-Next-80B-like bytes, {args.active} live conversations, "
                 f"{args.requests} requests per point")
    for cfg, style in (("gpu_only", "o-"), ("int8_t1", "s-"), ("gpu_only_host", "v--"), ("int8_t1_t2", "^-")):
        pts = [r for r in rows if r["config"] == cfg and r["sweep"] == "gpu"]
        ax[0].plot([r["gpu_gib"] for r in pts], [r["hit_rate"] for r in pts], style, label=wc.LABELS[cfg])
    ax[0].set(title=f"hit rate vs GPU budget (host {args.host_gib[0]:g} GiB for (2b), (4))", xlabel="GPU GiB",
              ylabel="prompt tokens reused", ylim=(0, 1))
    ax[0].legend()
    for cfg, style in (("gpu_only_host", "v--"), ("int8_t1_t2", "^-")):
        pts = sorted((r for r in rows if r["config"] == cfg and r["gpu_gib"] == args.host_sweep_gpu),
                     key=lambda r: r["host_gib"])
        ax[1].plot([r["host_gib"] for r in pts], [r["hit_rate"] for r in pts], style,
                   label=f"{wc.LABELS[cfg]}, GPU {args.host_sweep_gpu:g} GiB")
    go = [r for r in rows if r["config"] == "gpu_only" and r["gpu_gib"] == args.host_sweep_gpu]
    if go:
        ax[1].axhline(go[0]["hit_rate"], ls=":", color="tab:blue", label="(2) at the same GPU budget")
    ax[1].set(title="hit rate vs host budget", xlabel="host GiB", ylim=(0, 1), xscale="log")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_synthetic(args: argparse.Namespace) -> str:
    t_start = time.perf_counter()
    real = cs.real_bytes(args.page)
    print(f"real bytes: KV page ({args.page} tokens) {real.kv_page / 2**20:.2f} MiB; state fp32 "
          f"{real.state_native / 1e6:.1f} MB, T1 lossless {real.t1_lossless / 1e6:.1f} MB, int8 "
          f"{real.t1_int8 / 1e6:.1f} MB ({real.t1_lossless / real.t1_int8:.2f}x)")
    host0 = args.host_gib[0]
    gpus = sorted(set(args.gpu_gib) | set(args.ratio_at))
    points = [("gpu", g, host0 if cfg in HOST_CONFIGS else 0, cfg) for g in gpus for cfg in cs.SIM_CONFIGS]
    points += [("host", args.host_sweep_gpu, h, cfg) for h in sorted(set(args.host_gib)) if h != host0
               for cfg in HOST_CONFIGS]
    _RUN.update(args=args)
    rows = run_jobs([(_synthetic_job, *p) for p in points], args.workers, t_start)
    metrics: dict[str, Optional[float]] = {}
    for r in rows:
        tag = f"{r['config']}_gpu{r['gpu_gib']:g}" + (f"_host{r['host_gib']:g}" if r["config"] in HOST_CONFIGS else "")
        metrics[f"hit_rate_{tag}"] = r["hit_rate"]
        metrics[f"state_hit_rate_{tag}"] = r["state_hit_rate"]
    hit = {(r["config"], r["gpu_gib"], r["host_gib"]): r["hit_rate"] for r in rows}
    for g in args.ratio_at:
        two = hit[("gpu_only", g, 0)]
        metrics[f"hit_rate_vs_gpu_only_{g:g}GiB"] = _ratio(hit[("int8_t1_t2", g, host0)], two)
        metrics[f"int8_hit_rate_vs_gpu_only_{g:g}GiB"] = _ratio(hit[("int8_t1", g, 0)], two)
    for (cfg, g, h), v in hit.items():
        if cfg == "int8_t1_t2":  # int8's own gain where there is a host tier: (4) / (2b), equal bytes
            metrics[f"hit_rate_4_vs_2b_gpu{g:g}_host{h:g}"] = _ratio(v, hit[("gpu_only_host", g, h)])
    metrics["requests_per_point"] = args.requests
    metrics["total_s"] = time.perf_counter() - t_start
    os.makedirs(args.out, exist_ok=True)
    chart(os.path.join(args.out, f"capacity-{device_tag()}.png"), rows, args)
    notes = (f"Real structures, Qwen3-Next-80B-like byte budgets (KV page {real.kv_page / 2**20:.2f} MiB of "
             f"{args.page} tokens; state {real.state_native / 1e6:.1f} MB fp32 / {real.t1_int8 / 1e6:.1f} MB int8); "
             f"{args.active} live conversations, {args.systems} shared system prompts of "
             f"{args.system_pages * args.page} tokens, {args.min_rounds}-{args.max_rounds} rounds; {args.warm} "
             f"warm-up + {args.requests} measured requests per point; GPU split as workload_common.split_budget "
             f"(max_running {args.max_running}, kv_fraction {args.kv_fraction}); (2b) and (4) host {host0:g} GiB in "
             f"the GPU sweep; {args.mode} mode. hit_rate = prompt tokens reused.")
    path = write_results("capacity", metrics, rows=rows, notes=notes, out_dir=args.out)
    print(f"wrote {path} (+ .md, .png) in {metrics['total_s']:.1f} s")
    return path


def _ratio(a: float, b: float) -> Optional[float]:
    """a / b, undefined (None) where b is 0."""
    return a / b if b else None


def _ratio_or_none(a: Optional[float], b: Optional[float]) -> Optional[float]:
    """a / b, undefined (None) where either is undefined."""
    return a / b if a is not None and b is not None and b else None


# ------------------------------------------------------------------------------------------ real trace


def _trace_point(cfg: str, gpu_gib: float, host_gib: float, host_kv: Optional[float] = None) -> dict:
    """One grid point of the real trace (in a worker: reads ``_RUN``); ``host_kv``: the host's KV share
    (None: ``--kv-fraction``, the split of every other benchmark)."""
    a = _RUN["args"]
    r = simulate(_RUN["trace"], gpu_bytes=int(gpu_gib * GiB), host_bytes=int(host_gib * GiB), config_name=cfg,
                 mode=a.mode, page=BLOCK, max_running=a.max_running, kv_fraction=a.kv_fraction,
                 host_kv_fraction=host_kv, request_pages=_RUN["request_pages"], write_policy=a.write_policy)
    r.pop("evictions")
    f = (a.kv_fraction if host_kv is None else host_kv) if cfg in HOST_CONFIGS else None
    return {"config": cfg, "gpu_gib": gpu_gib, "host_gib": host_gib, "host_kv_fraction": f, **r}


def _ceiling_point() -> dict:
    a = _RUN["args"]
    tiers = unbounded_tiers(_RUN["trace"], a.max_running, BLOCK)
    r = cs.simulate_tiers(_RUN["trace"], tiers, page=BLOCK, mode=a.mode, write_policy=a.write_policy)
    r.pop("evictions")
    sizes = {k: tiers.get(k, 0) for k in ("kv_pages", "t1_states", "host_kv_pages", "host_states")}
    return {"config": "unbounded", "gpu_gib": None, "host_gib": 0, "host_kv_fraction": None, **sizes,
            **r}  # the grid rows' columns


def _check_point(cfg: str, mode: str) -> dict:
    """One mode on the first ``--check-requests`` requests of the trace at ``--check-at`` (a budget where
    every tier evicts), every request's hit kept: the model and the fast mode are compared to the full one."""
    a = _RUN["args"]
    g, h = a.check_at[0], a.check_at[1] if cfg in HOST_CONFIGS else 0.0
    trace = _RUN["trace"][:a.check_requests]
    r = simulate(trace, gpu_bytes=int(g * GiB), host_bytes=int(h * GiB),
                 config_name=cfg, mode=mode, page=BLOCK, max_running=a.max_running, kv_fraction=a.kv_fraction,
                 request_pages=_RUN["request_pages"], write_policy=a.write_policy, keep_hits=True)
    return {"config": cfg, "mode": mode, "gpu_gib": g, "host_gib": h, "hits": r["hits"], "req_per_s": r["req_per_s"],
            "wall_s": r["wall_s"], "hit_rate": r["hit_rate"], "evictions": r["evictions"]}


def _million_point(cfg: str, gpu_gib: float, host_gib: float) -> dict:
    """``--million`` requests of the trace replayed (``capacity_sim.replayed``) through one point, timed."""
    a = _RUN["args"]
    r = simulate(cs.replayed(_RUN["trace"], a.million), gpu_bytes=int(gpu_gib * GiB), host_bytes=int(host_gib * GiB),
                 config_name=cfg, mode=a.mode, page=BLOCK, max_running=a.max_running, kv_fraction=a.kv_fraction,
                 request_pages=_RUN["request_pages"], write_policy=a.write_policy)
    r.pop("evictions")
    return {"config": cfg, "gpu_gib": gpu_gib, "host_gib": host_gib, "million": True, **r}


def _call(fn: Any, *point: Any) -> Any:
    return fn(*point)


def run_jobs(jobs: list[tuple], workers: int, t_start: float) -> list[dict]:
    """``fn(*point)`` for every ``(fn, *point)`` of ``jobs``, in order, over ``workers`` forked processes (they
    inherit ``_RUN``), each point printed as it ends."""
    if workers <= 1:
        return [_call(*j) for j in jobs]
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                initializer=torch.set_num_threads, initargs=(1,)) as ex:
        futs = [ex.submit(_call, *j) for j in jobs]
        for f in cf.as_completed(futs):
            r = f.result()
            share = f" (host KV {r['host_kv_fraction']:g})" if r.get("host_kv_fraction") is not None else ""
            print(f"  {r['config']:>14} GPU {r['gpu_gib']} host {r['host_gib']}{share}: hit {r['hit_rate']:.4f}, "
                  f"{r['req_per_s']:.0f} req/s ({time.perf_counter() - t_start:.0f} s)", flush=True)
        return [f.result() for f in futs]


def unbounded_tiers(trace: list[SimRequest], max_running: int, page: int) -> dict[str, Any]:
    """Tier sizes that never evict on ``trace``: T0 KV for every page it writes (+ the running ones),
    T1 for every state it could cache (each chunk end, the branch point and the prompt end)."""
    chunk = max(1, 8192 // page)
    pages = sum(len(r.prompt) + len(r.answer) for r in trace)
    longest = max(len(r.prompt) + len(r.answer) for r in trace)
    states = sum(-(-len(r.prompt) // chunk) + 2 for r in trace)
    return dict(kv_pages=pages + max_running * longest, t0_states=max_running, t1_states=states + 1, codec="int8")


def bytes_to(rows: list[dict], cfg: str, target: float) -> Optional[float]:
    """The smallest GPU + host bytes of a grid point where ``cfg`` reaches ``target``; None if none does."""
    got = [(r["gpu_gib"] + r["host_gib"]) * GiB for r in rows if r["config"] == cfg and r["hit_rate"] >= target]
    return min(got) if got else None


def bytes_below(rows: list[dict], cfg: str, target: float, at: Optional[float]) -> Optional[float]:
    """A lower bound of ``cfg``'s crossing, ``at`` (``bytes_to``'s) its upper one: per host KV share in
    ``rows``, the largest GPU + host bytes under ``at`` of a point that misses ``target``; the smallest of
    those over the shares (the crossing is the smallest share's). None where some share has no point under
    ``at`` that misses (the grid starts at or past its crossing: ``at`` bounds it from above only)."""
    if at is None:
        return None
    lows = []
    for f in {r["host_kv_fraction"] for r in rows if r["config"] == cfg}:
        got = [(r["gpu_gib"] + r["host_gib"]) * GiB for r in rows if r["config"] == cfg and r["host_kv_fraction"] == f
               and r["hit_rate"] < target and (r["gpu_gib"] + r["host_gib"]) * GiB < at]
        if not got:
            return None
        lows.append(max(got))
    return min(lows)


def crossing_ratio(metrics: dict, rows: list[dict], num: str, den: str, target: float, suffix: str = "") -> None:
    """``bytes_ratio_<num>_vs_<den>_at_90pct<suffix>`` from the configurations' ``bytes_to_90pct_*`` (tags
    ``num`` / ``den``), and its bounds ``_lo`` / ``_hi`` from the brackets (``bytes_below``): all None unless
    both crossings are bracketed by the grid (a ratio of two upper bounds alone is bounded neither way)."""
    key = f"bytes_ratio_{num}_vs_{den}_at_90pct{suffix}"
    a, b = metrics[f"bytes_to_90pct_{num}{suffix}"], metrics[f"bytes_to_90pct_{den}{suffix}"]
    tag = {v: k for k, v in cs.TAGS.items()}
    a_lo, b_lo = bytes_below(rows, tag[num], target, a), bytes_below(rows, tag[den], target, b)
    metrics[f"bytes_below_90pct_{num}{suffix}"], metrics[f"bytes_below_90pct_{den}{suffix}"] = a_lo, b_lo
    ok = a_lo is not None and b_lo is not None
    metrics[key] = _ratio_or_none(a, b) if ok else None
    metrics[f"{key}_lo"] = _ratio_or_none(a_lo, b) if ok else None
    metrics[f"{key}_hi"] = _ratio_or_none(a, b_lo) if ok else None


def run_trace(args: argparse.Namespace) -> str:
    t_start = time.perf_counter()
    raw = load_trace(args.trace, limit=args.limit)
    trace = cs.mooncake_requests(raw)
    _RUN.update(args=args, trace=trace, request_pages=max(len(r.prompt) + len(r.answer) for r in trace))
    real = cs.real_bytes(BLOCK)
    print(f"{len(trace)} requests; KV page of {BLOCK} tokens {real.kv_page / 2**20:.1f} MiB, state "
          f"{real.state_native / 1e6:.1f} MB fp32, T1/T2 lossless {real.t1_lossless / 1e6:.1f} MB, int8 "
          f"{real.t1_int8 / 1e6:.1f} MB")
    jobs: list[tuple] = [(_ceiling_point,)]
    jobs += [(_check_point, cfg, mode) for cfg in cs.SIM_CONFIGS for mode in cs.MODES]
    jobs += [(_million_point, cfg, *args.million_at) for cfg in (args.million_configs if args.million else ())]
    jobs += [(_trace_point, cfg, g, 0.0) for g in args.grid_gpu_only for cfg in ("gpu_only", "int8_t1")]
    splits = [None] + [f for f in args.host_kv_fractions if f != args.kv_fraction]
    jobs += [(_trace_point, cfg, g, h, f) for f in splits for g in args.grid_gpu for h in args.grid_host
             for cfg in HOST_CONFIGS]
    done = run_jobs(jobs, args.workers, t_start)
    n_checks = len(cs.SIM_CONFIGS) * len(cs.MODES)
    ceiling, checks = done[0], done[1:1 + n_checks]
    millions = [r for r in done[1 + n_checks:] if r.get("million")]
    every = done[1 + n_checks + len(millions):]
    rows = [r for r in every if r["host_kv_fraction"] in (None, args.kv_fraction)]  # the one split
    attention = unbounded_reuse(raw)
    target = 0.9 * ceiling["hit_rate"]
    metrics: dict[str, Optional[float]] = {"ceiling_hybrid_hit_rate": ceiling["hit_rate"],
                                           "ceiling_attention_hit_rate": attention, "target_90pct_hit_rate": target}
    hit = {(r["config"], r["gpu_gib"], r["host_gib"]): r["hit_rate"] for r in rows}
    for (cfg, g, h), v in hit.items():
        metrics[f"hit_rate_{cs.TAGS[cfg]}_{g:g}g_{h:g}g"] = v
    for cfg in cs.SIM_CONFIGS:
        metrics[f"bytes_to_90pct_{cs.TAGS[cfg]}"] = bytes_to(rows, cfg, target)
    crossing_ratio(metrics, rows, "2b", "4", target)
    crossing_ratio(metrics, rows, "2", "3", target)
    for cfg in HOST_CONFIGS:  # each configuration at its best host split (what a user would tune)
        tag = cs.TAGS[cfg]
        metrics[f"bytes_to_90pct_{tag}_any_split"] = b = bytes_to(every, cfg, target)
        at = [r["host_kv_fraction"] for r in every if r["config"] == cfg and r["hit_rate"] >= target
              and (r["gpu_gib"] + r["host_gib"]) * GiB == b]
        metrics[f"host_kv_fraction_at_90pct_{tag}_any_split"] = min(at) if at else None
    crossing_ratio(metrics, every, "2b", "4", target, "_any_split")
    for (cfg, g, h), v in hit.items():
        if cfg == "int8_t1" and ("gpu_only", g, 0.0) in hit:
            metrics[f"hit_rate_3_vs_2_{g:g}g"] = _ratio(v, hit[("gpu_only", g, 0.0)])
        if cfg == "int8_t1_t2":
            metrics[f"hit_rate_4_vs_2b_{g:g}g_{h:g}g"] = _ratio(v, hit[("gpu_only_host", g, h)])
            metrics[f"prefill_tokens_1_vs_4_{g:g}g_{h:g}g"] = _ratio(1.0, 1.0 - v)  # (1) computes every token
    for cfg in cs.SIM_CONFIGS:
        by = {c["mode"]: c for c in checks if c["config"] == cfg}
        tag = cs.TAGS[cfg]
        metrics[f"model_same_hits_as_full_{tag}"] = float(by["model"]["hits"] == by["full"]["hits"])
        metrics[f"fast_same_hits_as_full_{tag}"] = float(by["fast"]["hits"] == by["full"]["hits"])
        for mode in cs.MODES:
            metrics[f"{mode}_mode_req_per_s_{tag}"] = by[mode]["req_per_s"]
        metrics[f"model_vs_fast_speed_{tag}"] = _ratio(by["model"]["req_per_s"], by["fast"]["req_per_s"])
    for r in millions:
        tag = f"{cs.TAGS[r['config']]}_{r['gpu_gib']:g}g_{r['host_gib']:g}g"
        metrics[f"wall_s_1e6_requests_{tag}"] = r["wall_s"]
        metrics[f"cpu_s_1e6_requests_{tag}"] = r["cpu_s"]
        metrics[f"req_per_s_1e6_requests_{tag}"] = r["req_per_s"]
        metrics[f"hit_rate_1e6_requests_{tag}"] = r["hit_rate"]
    metrics["requests"] = len(trace)
    metrics["total_s"] = time.perf_counter() - t_start
    info = {"trace": os.path.basename(args.trace), "sim token": f"one {BLOCK}-token block (a KV page of "
            f"{real.kv_page / 2**20:.0f} MiB at Qwen3-Next-80B geometry)",
            "ceiling": "ceiling_hybrid_hit_rate: the same simulation with every tier unbounded (the engine's "
            "checkpoint placement: states at prefill chunk ends, branch points and prompt ends; a hybrid resumes "
            "only there); "
            "ceiling_attention_hit_rate: the trace's prefix-reuse bound (traces.unbounded_reuse), which a hybrid "
            "reaches only with a state at every shared block boundary",
            "bytes_to_90pct": "smallest GPU + host bytes of a grid point where the config's hit rate >= "
            "0.9 x ceiling_hybrid_hit_rate (an upper bound at the grid's resolution); null: no grid point reaches "
            "it; bytes_below_90pct_*: the largest bytes under it of a point that misses (the crossing lies between); "
            "bytes_ratio_*: null unless both crossings are bracketed so, with bounds _lo / _hi from the brackets. "
            f"The hit_rate_* and bytes_to_90pct_* metrics use the split of every other benchmark ("
            f"workload_common.split_budget: kv_fraction {args.kv_fraction} of the GPU cache share and of the host "
            f"to KV); *_any_split: the smallest over host KV shares "
            f"{sorted(set(args.host_kv_fractions) | {args.kv_fraction})} "
            "(each configuration at the share that suits it; host_kv_fraction_at_90pct_*_any_split names it); "
            "the rows hold every share",
            "modes": f"the grid in {args.mode} mode; model (capacity_model.TreeModel: the tree's flows on flags and "
            "counts, byte accounting, instant tickets), fast (the real tree, no byte copied) and full (the real "
            f"tree, every transfer copied and checksummed) compared on the first {args.check_requests} requests of "
            f"the trace at GPU {args.check_at[0]:g} GiB, host {args.check_at[1]:g} GiB ((2), (3): no host): "
            "*_same_hits_as_full 1.0 when every request's hit is the same; req_per_s of each mode on that run",
            "10^6 requests": f"capacity_sim.replayed: the trace {-(-args.million // len(trace))} times over, copy k "
            "with every sim token (hash ids and answer pages) shifted by k x (the largest token + 1), so a copy "
            "is new sessions with the trace's statistics and shares nothing with the others; wall_s_1e6_requests "
            "is that run's wall time, one point, from a cold cache (cpu_s_1e6_requests: the CPU seconds of its "
            "worker process, the measure on a machine the run shares)",
            "hit_rate": "prompt tokens reused / prompt tokens; the whole trace from a cold cache, one request at "
            "a time"}
    notes = (f"{len(trace)} requests of {os.path.basename(args.trace)} in arrival order; Qwen3-Next-80B bytes; GPU "
             f"split as workload_common.split_budget (max_running {args.max_running}, kv_fraction "
             f"{args.kv_fraction}, the reservation sized for the longest request, {_RUN['request_pages']} pages); "
             f"(2b) and (4) get the same host bytes, split alike; {args.mode} mode; "
             f"{args.workers} worker processes.")
    os.makedirs(args.out, exist_ok=True)
    trace_chart(os.path.join(args.out, f"capacity-mooncake-{device_tag()}.png"), rows, every, ceiling["hit_rate"],
                attention, args.kv_fraction)
    path = write_results("capacity-mooncake", metrics, rows=[ceiling, *every], notes=notes, out_dir=args.out,
                         info=info)
    print(f"wrote {path} (+ .md, .png) in {metrics['total_s']:.1f} s")
    return path


def trace_chart(path: str, rows: list[dict], every: list[dict], ceiling: float, attention: float,
                split: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    best: dict[tuple, float] = {}
    for r in every:
        if r["config"] in HOST_CONFIGS:
            k = (r["config"], r["gpu_gib"], r["host_gib"])
            best[k] = max(best.get(k, 0.0), r["hit_rate"])
    for g in sorted({r["gpu_gib"] for r in rows if r["config"] in HOST_CONFIGS}):
        for cfg, style in (("gpu_only_host", "v--"), ("int8_t1_t2", "^-")):
            pts = sorted((r for r in rows if r["config"] == cfg and r["gpu_gib"] == g), key=lambda r: r["host_gib"])
            ax[0].plot([r["host_gib"] for r in pts], [r["hit_rate"] for r in pts], style,
                       label=f"{wc.LABELS[cfg]}, GPU {g:g} GiB")
            hs = sorted(h for c, gg, h in best if c == cfg and gg == g)
            ax[1].plot(hs, [best[(cfg, g, h)] for h in hs], style, label=f"{wc.LABELS[cfg]}, GPU {g:g} GiB")
    for a in ax:
        a.axhline(ceiling, color="k", ls=":", label="unbounded (hybrid, this checkpoint placement)")
        a.axhline(0.9 * ceiling, color="gray", ls=":", label="90 % of it")
        a.axhline(attention, color="tab:red", ls=":", label="prefix-reuse bound of the trace")
        a.set(xlabel="host GiB", xscale="log", ylim=(0, max(0.5, attention * 1.1)))
    ax[0].set(title=f"Mooncake trace: hit rate vs host budget (host KV share {split:g})",
              ylabel="prompt tokens reused")
    ax[1].set(title="the same, each point at its best host KV share")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=None, help="a Mooncake-format trace: run its grid instead of the synthetic trace")
    p.add_argument("--limit", type=int, default=None, help="--trace: only its first N requests")
    p.add_argument("--grid-gpu", type=float, nargs="+", default=[16, 32, 64],
                   help="--trace: GPU GiB of the (2b) and (4) grid")
    p.add_argument("--grid-host", type=float, nargs="+",
                   default=[64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096],
                   help="--trace: host GiB of the (2b) and (4) grid")
    p.add_argument("--grid-gpu-only", type=float, nargs="+",
                   default=[16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096],
                   help="--trace: GPU GiB of (2) and (3)")
    p.add_argument("--host-kv-fractions", type=float, nargs="+", default=[0.6, 0.75, 0.9],
                   help="--trace: host KV shares the (2b) and (4) grid runs at besides --kv-fraction")
    p.add_argument("--workers", type=int, default=2, help="processes the points are spread over")
    p.add_argument("--check-requests", type=int, default=1500,
                   help="--trace: its first N requests run in every mode to compare them")
    p.add_argument("--check-at", type=float, nargs=2, default=[16, 64], metavar=("GPU", "HOST"),
                   help="--trace: GiB of the mode check (a budget where every tier evicts)")
    p.add_argument("--million", type=int, default=0, help="--trace: also run this many requests (the trace "
                   "replayed) through one point, timed (10^6 for the issue's figure)")
    p.add_argument("--million-at", type=float, nargs=2, default=[32, 1024], metavar=("GPU", "HOST"))
    p.add_argument("--million-configs", nargs="+", default=["int8_t1_t2"], choices=cs.SIM_CONFIGS)
    p.add_argument("--requests", type=int, default=2000, help="measured requests per point (up to 10^6)")
    p.add_argument("--warm", type=int, default=2000, help="requests run before measuring (cache fills)")
    p.add_argument("--gpu-gib", type=float, nargs="+", default=[8, 16, 32, 48])
    p.add_argument("--host-gib", type=float, nargs="+", default=[256, 32, 64, 128],
                   help="first: the host budget of (2b) and (4) in the GPU sweep; all: the host sweep")
    p.add_argument("--host-sweep-gpu", type=float, default=16, help="GPU GiB of the host sweep")
    p.add_argument("--ratio-at", type=float, nargs="+", default=[16, 32], help="GPU GiB of hit_rate_vs_gpu_only")
    p.add_argument("--page", type=int, default=64, help="real tokens per sim token (KV page) of the synthetic trace")
    p.add_argument("--active", type=int, default=256, help="conversations live at once (the working set)")
    p.add_argument("--systems", type=int, default=32, help="shared system prompts")
    p.add_argument("--zipf", type=float, default=1.0, help="popularity skew of the system prompts")
    p.add_argument("--system-pages", type=int, default=32)
    p.add_argument("--question-pages", type=int, nargs=2, default=[2, 16])
    p.add_argument("--answer-pages", type=int, nargs=2, default=[2, 8])
    p.add_argument("--min-rounds", type=int, default=2)
    p.add_argument("--max-rounds", type=int, default=12)
    p.add_argument("--chunk-pages", type=int, default=None, help="prefill chunk in pages (None: 8192 tokens)")
    p.add_argument("--max-running", type=int, default=4)
    p.add_argument("--kv-fraction", type=float, default=0.6)
    p.add_argument("--write-policy", default="write_through", choices=WRITE_POLICIES)
    p.add_argument("--mode", default="model", choices=cs.MODES,
                   help="model: capacity_model's tree model; fast: the real tree, no byte copied; full: every "
                   "transfer copied and checksummed (capacity_sim)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    a = p.parse_args(argv)
    if a.chunk_pages is None:
        a.chunk_pages = max(1, 8192 // a.page)
    return a


def main(argv: Optional[list[str]] = None) -> str:
    args = parse_args(argv)
    torch.set_num_threads(1)
    return run_trace(args) if args.trace else run_synthetic(args)


if __name__ == "__main__":
    main()
