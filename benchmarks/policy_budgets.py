"""Where the eviction policies decide differently in the engine's own setup: a budget grid on the CPU (issue 23).

    python benchmarks/policy_budgets.py          # CPU, a few minutes (nice -n 10): writes policy-budgets-cpu

The H200's engine runs of ``tiered`` against ``lru`` (``bench_workload.py --eviction-policies lru tiered``)
showed the same hit rates and state hits for both: at their budgets every configuration reaches what the
replayed requests share, so no policy can differ there. This finds the GPU budgets where they do, for the
same requests and tiers, without the model's compute, so that the engine runs can go there.

Each run of ``RUNS`` is a ``bench_workload.py`` command line (its options, parsed by its own parser); the setup
comes from the code bench_workload runs: the workload section (``--scale``, ``--set``, ``--answers``,
``--gpu-mib`` / ``--host-mib``), the model built as it builds it (``build_model`` on the CPU) and its pool specs
(``engine.model_specs.spec_for``) giving the slot bytes (``workload_common.TierBytes``: at ``--scale full`` 38.93
MB of state native, 10.91 MB int8, a 768 KiB KV page of 64 tokens), the requests (``workload_common.make_clients``
in the driver's client order, or ``bench_workload.trace_plan`` for ``--trace``), the longest request's pages,
the split (``workload_common.split_budget`` at each GPU budget of the grid: (4) ``int8_t1_t2`` with the run's
host budget, (3) ``int8_t1`` where the host budget is 0) and each policy's eviction and admission
(``bench_workload.policy_cache``). Each request then goes through ``capacity_sim.serve`` on a ``TieredCache``
of those slot counts (the real tree and policies over byte-sized stand-in slots, one tree token per KV page;
``capacity_sim`` says what it does per request), one request at a time, with the state cuts the engine makes
(``engine.kinds.StateKind.cuts``): each prefill chunk end, the branch point, every admission block boundary under
``--admission block``, the prompt's last page boundary; the turn's end at the last page boundary of prompt +
answer - 1 tokens. A scored policy is built as the stack builds it for the engine (``radix.policies.stack_costs``
of the engine's cost model over the real KV-token and T1-slot bytes), in tree tokens of a page.

Prompts are the engine's tokens: each whole page of a prompt is one tree token (the same tokens the same id), a
prompt's partial last page is not cached by the engine, so it goes with the answer; answers (the workload's
seeded tokens, teacher-forced in the engine) are fresh ids either way: what the engine caches of them no later
prompt starts with, as there. Counted as the engine counts: hit rate = reused prompt tokens / prompt tokens
(a hit of ``p`` pages reuses ``min(p x page, prompt)``), state hits T1 / T2 / miss per request.

What this does not model:

- the engine's concurrency and timing: up to ``max_running`` requests in flight (each holding its locked
  prefix and reserved KV while others are admitted and evict), the arrivals (Poisson for the workloads, the
  trace's scaled timestamps) and finish order, which set the order requests reach the tree, and the prefill
  budget shared by a step's chunks (a chunk cut short by it ends, and caches, elsewhere); here requests arrive
  in the driver's order (each client's rounds in turn, in its shuffled client order; the trace in its order) and
  each finishes before the next starts;
- the model's outputs: the engine's answers are teacher-forced with the same seeded tokens, and random tokens
  here or there share nothing with any prompt, so the prompts' sharing is the same either way;
- time itself: Marconi's alpha tuner never fires in runs this short (a window is 500 requests), as in the engine.

Rows: one per run, GPU budget, host budget and policy; ``info.differ``: the points where a policy's hit rate or
state hits differ from LRU's. Budgets below the running reservation (``split_budget`` refuses them) are rows
with ``error`` and no counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_workload as bw  # noqa: E402
from benchmarks import capacity_sim as cs  # noqa: E402
from benchmarks import workload_common as wc  # noqa: E402
from benchmarks.common import write_results  # noqa: E402
from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.radix.policies import make_policy, stack_costs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACE = os.path.join(os.path.dirname(ROOT), "shared", "traces", "mooncake_conversation_trace.jsonl")
# The H200 policy runs' own bench_workload options (benchmarks/results/README.md, "Policies", "On the H200"),
# less what only times them (--decode-batch, --repeats, --configs, --eviction-policies, --tag, --no-progress).
RUNS = {"multi_turn_ans64": ["--workloads", "multi_turn", "--answers", "64", "--set", "clients=6", "rounds=3",
                             "prefix_len=4096", "--gpu-mib", "768", "--host-mib", "1024"],
        "mooncake": ["--workloads", "multi_turn", "--trace", TRACE, "--trace-sample", "0.01", "--trace-limit", "48",
                     "--trace-block", "64", "--trace-max-blocks", "8", "--trace-max-answer", "64", "--admission",
                     "block"]}
POLICIES = ("lru", "tiered", "marconi")
GPU_MIB = (384.0, 512.0, 768.0, 1024.0, 1536.0, 2048.0, 3072.0)
COUNTS = ("hit_rate", "state_hits_t1", "state_hits_t2", "state_misses")
# a row's columns after run, gpu_mib, host_mib, policy (``replay``'s keys; None where the budget was refused)
COLUMNS = ("config", "eviction", "admission", "kv_pages", "t1_states", "host_kv_pages", "host_states", *COUNTS,
           "t2_kv_pages_loaded", "t2_states_loaded", "evictions", "requests", "wall_s", "error")


@dataclasses.dataclass(frozen=True)
class Setup:
    """One bench_workload run's engine setup: what its tiers and requests are made of."""

    name: str
    scale: str
    page: int  # tokens per KV page
    chunk: int  # prefill chunk, tokens
    max_running: int
    kv_fraction: float
    write_policy: str
    cache: dict  # the tiers' shared settings (bench_workload's ``cache``, with --admission)
    tb: wc.TierBytes
    gpu_mib: float  # the run's budgets
    host_mib: float
    requests: tuple  # (prompt tokens, answer tokens) in the order they reach the tree
    cost_model: str = CacheConfig.cost_model

    @property
    def request_pages(self) -> int:
        return -(-max(len(p) + len(a) for p, a in self.requests) // self.page)


def setup(name: str, argv: Sequence[str], scale: str, models: dict) -> Setup:
    """The setup of bench_workload run ``argv`` at ``scale`` (``models``: TierBytes by model, built once)."""
    args = bw.parse_args(["--scale", scale, *argv])
    if len(args.workloads) != 1 or len(args.answers or [None]) != 1:
        raise ValueError(f"run {name!r}: expected one workload and at most one answer length, got {args.workloads} "
                         f"and {args.answers}")
    sec = bw._load(args.workloads[0], args, (args.answers or [None])[0])
    w, m, e = sec["workload"], sec["model"], sec["engine"]
    key = repr(sorted(m.items()))
    if key not in models:
        from tiered_cache.engine.model_specs import spec_for

        model = bw.build_model(m, torch.device("cpu"))
        specs = spec_for(model, e["page_size"])
        models[key] = (wc.TierBytes.from_specs(specs.full, specs.state, e["page_size"]), model.config.vocab_size)
        del model
        gc.collect()
    tb, vocab = models[key]
    if args.trace:
        reqs = [(it.prompt, it.answer) for it in bw.trace_plan(args, vocab, 1.0)]
    else:
        clients = wc.make_clients(w, vocab)
        order = list(range(len(clients)))
        random.Random(w.get("seed", 0) + 1).shuffle(order)  # the driver's client order (wc._drive)
        prev: dict[int, list[int]] = {}
        reqs = []
        for rnd in range(w["rounds"]):
            for c in order:
                prev[c] = clients[c].prompt(rnd, prev.get(c))
                reqs.append((prev[c], clients[c].answers[rnd]))
    block = bw.admission_block(args)
    cache = dict(page_size=e["page_size"], write_policy=e["write_policy"], state_admission=args.admission,
                 **({"admission_block": block} if args.admission == "block" else {}))
    return Setup(name, scale, e["page_size"], e["chunk_size"], e["max_running"], e["kv_fraction"], e["write_policy"],
                 cache, tb, float(sec["gpu_budget_mib"]), float(sec["host_budget_mib"]), tuple(reqs))


def sim_requests(s: Setup) -> list[cs.SimRequest]:
    """``s``'s requests in tree tokens (module docstring): whole prompt pages by content, the rest fresh ids."""
    ids: dict[tuple, int] = {}
    out = []
    nxt = 1 << 40  # answers' ids: above every page id
    for prompt, answer in s.requests:
        n, whole = len(prompt), len(prompt) // s.page
        pages = [ids.setdefault(tuple(prompt[i * s.page:(i + 1) * s.page]), len(ids) + 1) for i in range(whole)]
        if n % s.page:  # a partial last page: no later prompt matches it (the engine never caches it as it is)
            pages.append(nxt)
            nxt += 1
        # the turn's end: the last page boundary of the tokens fed (prompt + answer - 1); one id more, as the
        # last of serve's answer is never fed (none: the turn ends at the prompt's last whole page)
        n_ans = (n + len(answer) - 1) // s.page - len(pages) + 1
        out.append(cs.SimRequest(pages, list(range(nxt, nxt + n_ans)), n))
        nxt += n_ans
    return out


def engine_cuts(block: Optional[int], aligned: bool) -> Optional[Callable[[int, int, set[int]], list[int]]]:
    """``serve``'s extra cuts for the engine's (``StateKind.cuts``), in pages: every ``block`` boundary (block
    admission, else None) and, where the prompt's last page is partial (``aligned`` False: its end is no cut),
    its last whole page (the tree's mid-chunk position; ``serve`` keeps only those past the reused prefix)."""
    if block is None and aligned:
        return None

    def cuts(p: int, n: int, have: set[int]) -> list[int]:
        return [*(range((p // block + 1) * block, n, block) if block else ()), *(() if aligned else (n - 1,))]

    return cuts


def replay(s: Setup, reqs: Sequence[cs.SimRequest], policy: str, gpu_mib: float, host_mib: float) -> dict:
    """``reqs`` (``sim_requests(s)``) through ``s``'s tiers at these budgets under ``policy``; the counts."""
    config = "int8_t1_t2" if host_mib > 0 else "int8_t1"
    tiers = wc.split_budget(s.tb, int(gpu_mib * wc.MiB), int(host_mib * wc.MiB), s.max_running, s.request_pages,
                            s.kv_fraction)[config]
    pc = bw.policy_cache(s.cache, policy)
    block = pc.get("admission_block")
    cfg = CacheConfig(page_size=1, write_policy=s.write_policy, state_admission=pc["state_admission"],
                      **({"admission_block": block // s.page} if block else {}), validate=False, check_memory=False,
                      backend="torch", **tiers)
    sim = cs.Sim(cfg, cs.tiny_state(s.tb), page=s.page, fast=True)
    tree = sim.stack.tree.tree
    if policy != "lru":  # as the stack builds it for the engine, over the real bytes, in tree tokens of a page
        t1_bytes = s.tb.t1_int8 if cfg.codec == "int8" else s.tb.t1_lossless
        costs = dataclasses.replace(stack_costs(s.cost_model, s.tb.kv_page, t1_bytes), tokens_per_key=s.page)
        tree.policy = make_policy(policy, costs, tiered=cfg.host_tier, budget=(cfg.kv_pages, cfg.t1_states))
    blk = block // s.page if pc["state_admission"] == "block" else None

    c = dict.fromkeys(("prompt", "reused", "t1", "t2", "miss", "kv_loaded", "states_loaded"), 0)
    t = time.perf_counter()
    for r in reqs:
        aligned = r.tokens % s.page == 0
        got = cs.serve(sim.stack, r.prompt, r.answer, max(1, s.chunk // s.page), engine_cuts(blk, aligned),
                       cut_end=aligned)
        c["prompt"] += r.tokens
        c["reused"] += min(got.reused * s.page, r.tokens)
        c[("t2" if got.state_from_host else "t1") if got.reused else "miss"] += 1
        c["kv_loaded"] += got.host_kv_pages
        c["states_loaded"] += got.state_from_host
    sim.check()
    return {"config": config, "eviction": policy, "admission": pc["state_admission"],
            **{k: tiers.get(k, 0) for k in ("kv_pages", "t1_states", "host_kv_pages", "host_states")},
            "hit_rate": c["reused"] / max(1, c["prompt"]), "state_hits_t1": c["t1"], "state_hits_t2": c["t2"],
            "state_misses": c["miss"], "t2_kv_pages_loaded": c["kv_loaded"], "t2_states_loaded": c["states_loaded"],
            "evictions": dict(sim.evictions()), "requests": len(reqs), "wall_s": time.perf_counter() - t,
            "error": None}


def grid(s: Setup, policies: Sequence[str], gpu_mibs: Sequence[float]) -> list[dict]:
    """Every policy at every GPU budget, with host 0 and the run's; a budget below the reservation: ``error``."""
    reqs = sim_requests(s)
    rows = []
    for g in gpu_mibs:
        for h in dict.fromkeys((0.0, s.host_mib)):
            for p in policies:
                row: dict[str, Any] = {"run": s.name, "gpu_mib": float(g), "host_mib": float(h), "policy": p,
                                       **dict.fromkeys(COLUMNS)}
                try:
                    row.update(replay(s, reqs, p, g, h))
                except ValueError as err:  # split_budget: the budget is below the running reservation
                    row["error"] = str(err)
                rows.append(row)
                print(f"  {s.name:>16} GPU {g:6g} MiB host {h:6g} MiB {p:>8}: " + (
                    row["error"] or f"hit {row['hit_rate']:.3f} states T1/T2/miss {row['state_hits_t1']} / "
                    f"{row['state_hits_t2']} / {row['state_misses']}"), flush=True)
    return rows


def differ(rows: Sequence[dict]) -> list[dict]:
    """The points (run, GPU, host) where a policy's hit rate or state hits differ from LRU's there."""
    pts: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        if r["error"] is None:
            pts.setdefault((r["run"], r["gpu_mib"], r["host_mib"]), {})[r["policy"]] = r
    out = []
    for (run, g, h), by in pts.items():
        base = by.get("lru")
        if base is None:
            continue
        diff = {p: {k: r[k] for k in COUNTS} for p, r in by.items()
                if p != "lru" and any(r[k] != base[k] for k in COUNTS)}
        if diff:
            out.append({"run": run, "gpu_mib": g, "host_mib": h, "lru": {k: base[k] for k in COUNTS}, **diff})
    return out


def metrics(rows: Sequence[dict], policies: Sequence[str]) -> dict[str, Optional[float]]:
    """``<run>_gpu<MIB>_host<MIB>_hit_rate_<policy>`` and ``..._<policy>_vs_lru`` (None where LRU's is 0)."""
    out: dict[str, Optional[float]] = {}
    lru = {(r["run"], r["gpu_mib"], r["host_mib"]): r["hit_rate"] for r in rows if r["policy"] == "lru"
           and r["error"] is None}
    for r in rows:
        if r["error"] is not None:
            continue
        key = (r["run"], r["gpu_mib"], r["host_mib"])
        pre = f"{r['run']}_gpu{r['gpu_mib']:g}_host{r['host_mib']:g}"
        out[f"{pre}_hit_rate_{r['policy']}"] = r["hit_rate"]
        if r["policy"] != "lru" and "lru" in policies and key in lru:
            out[f"{pre}_hit_rate_{r['policy']}_vs_lru"] = r["hit_rate"] / lru[key] if lru[key] else None
    return out


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS), help="the bench_workload runs")
    p.add_argument("--scale", default="full", choices=["small", "full"], help="bench_workload's --scale")
    p.add_argument("--trace", default=TRACE, help="the Mooncake trace of the mooncake run")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--gpu-budgets", nargs="+", type=float, default=list(GPU_MIB), metavar="MIB")
    p.add_argument("--name", default="policy-budgets", help="the results' name (<name>-<device>.json)")
    p.add_argument("--out", default=None, help="folder for the JSON and md (default benchmarks/results)")
    a = p.parse_args(argv)
    if "lru" not in a.policies:
        p.error(f"--policies: include lru (every comparison is against it), got {a.policies}")
    if any(not g > 0 for g in a.gpu_budgets):
        p.error(f"--gpu-budgets: MiB > 0, got {a.gpu_budgets}")
    return a


def main(argv: Optional[list[str]] = None) -> dict:
    a = parse_args(argv)
    t0 = time.perf_counter()
    models: dict = {}
    rows: list[dict] = []
    setups = {}
    for name in a.runs:
        run_argv = [a.trace if x == TRACE else x for x in RUNS[name]]
        s = setups[name] = setup(name, run_argv, a.scale, models)
        print(f"== {name} ({a.scale}): {len(s.requests)} requests, longest {s.request_pages} pages of {s.page}; state "
              f"{s.tb.state_native / 1e6:.2f} MB native, {s.tb.t1_int8 / 1e6:.2f} MB int8, KV page "
              f"{s.tb.kv_page / 1024:.0f} KiB; the run's budgets GPU {s.gpu_mib:g} MiB, host {s.host_mib:g} MiB",
              flush=True)
        rows += grid(s, a.policies, a.gpu_budgets)
    d = differ(rows)
    bounds = {}
    for name, s in setups.items():
        items = [wc.TraceItem(0.0, list(p), list(ans)) for p, ans in s.requests]
        bounds[name] = wc.shared_prefix_bound(items, s.page) / sum(len(p) for p, _ in s.requests)
    info = {"what": "each run's requests through capacity_sim.serve on the engine's tiers at each budget, one request "
                    "at a time (module docstring: what it does not model)",
            "runs": {n: {"bench_workload_args": RUNS[n], "scale": s.scale, "requests": len(s.requests),
                         "page": s.page, "chunk": s.chunk, "max_running": s.max_running, "gpu_mib": s.gpu_mib,
                         "host_mib": s.host_mib, "request_pages": s.request_pages, "cost_model": s.cost_model,
                         "tier_bytes": dataclasses.asdict(s.tb), "reuse_bound": bounds[n]} for n, s in setups.items()},
            "differ": d, "total_s": time.perf_counter() - t0}
    notes = ("Points where a policy differs from LRU (hit rate, state hits T1 / T2 / miss): "
             + ("; ".join(f"{x['run']} GPU {x['gpu_mib']:g} host {x['host_mib']:g}: lru {x['lru']['hit_rate']:.3f}, "
                          + ", ".join(f"{p} {v['hit_rate']:.3f} ({v['state_hits_t1']}/{v['state_hits_t2']}/"
                                      f"{v['state_misses']})" for p, v in x.items() if p in a.policies and p != "lru")
                          for x in d) or "none"))
    path = write_results(a.name, metrics(rows, a.policies), rows=rows, notes=notes, out_dir=a.out, info=info)
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")
    return {"rows": rows, "differ": d, "info": info, "path": path}


if __name__ == "__main__":
    main()
