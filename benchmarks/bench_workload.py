"""Offload stress benchmark: named workloads through the reference engine, four configurations side by
side at one GPU memory budget (``workload_common.py`` says which and how the budget is split).

    python benchmarks/bench_workload.py --scale small            # CPU: the tiny model, ~2 minutes
    python benchmarks/bench_workload.py --scale full             # GPU: a ~1.7 B Qwen3-Next-shaped model

Per workload (``benchmarks/workloads/<name>.json``) and configuration: token hit rate per tier (KV
tokens reused from T0 / loaded back from T2, as a share of prompt tokens), where resumed states came
from (T1 / T2 / miss), prefill tokens saved, time to first token p50/p90 (from arrival, and from
admission), requests per second, bytes over PCIe (T2 copies both ways). Every configuration sees the
same tokens: answers are teacher-forced from the workload's seed, and the model's own argmax is
compared with the no-cache run's (``argmax_agreement_vs_nocache``: the correctness check; int8
states may flip near-ties). Writes ``workload-<device>.json`` / ``.md`` and one PNG chart per
workload (``workload-<name>-<device>.png``). On a GPU, says which gated-delta implementation
``transformers`` runs (flash-linear-attention when it imports, else its torch fallback).

Order: before any timed run, every run that will be timed (each configuration, each ``--eviction-policies``
run) serves the same requests once, untimed, on a fresh engine of its own (the warm pass; off with
``--no-warm-each``): the first run of a kind pays compiles and autotuning at its own shapes, which a fixed
order left to the same configuration in every repeat (the H200's Mooncake policy replay, 2026-12-02: LRU,
run first, 54.6 s; the same configuration as (4) of the main replay 38.3 s). The timed runs' order then
rotates between repeats (``wc.rotated``), written into the JSON (each row's ``order``: its position in each
repeat; ``info.workloads.<w>.repeat_orders``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Collection
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import workload_common as wc  # noqa: E402
from benchmarks.common import RESULTS, device_tag, write_results  # noqa: E402
from tiered_cache import device as dev  # noqa: E402
from tiered_cache.config import EVICTION_POLICIES  # noqa: E402
from tiered_cache.engine.stats import percentile  # noqa: E402

METRICS = ("hit_rate", "hit_rate_t0", "hit_rate_t2", "state_hit_rate", "prefill_tokens_saved", "computed_tokens",
           "ttft_p50_s", "ttft_p90_s", "ttft_admitted_p50_s", "ttft_admitted_p90_s", "ttft_p50_round3plus_s",
           "requests_per_s", "requests_per_s_round3plus", "pcie_bytes", "hits_t1_states", "hits_t2_states",
           "state_misses", "argmax_agreement_vs_nocache", "wall_s")


# ------------------------------------------------------------------------------------------ model
def build_model(m: dict, device: torch.device):
    """The tiny seeded Qwen3-Next (``tiny``), or one scaled by ``Qwen3NextConfig`` overrides."""
    from tiered_cache.engine.models import tiny_qwen3_next

    kw = {k: v for k, v in m.items() if k not in ("tiny", "dtype", "long_memory")}
    return tiny_qwen3_next(seed=0, long_memory=bool(m.get("long_memory")), dtype=getattr(torch, m["dtype"]),
                           device=device, **kw)


def gated_delta_impl(model) -> str:
    """Which chunked gated-delta function the model's linear layers call (module.name)."""
    import importlib

    from tiered_cache.engine.runner.split_forward import hub_function

    mod = importlib.import_module(type(model).__module__)
    layer = next((m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")), None)
    # 5.17: the layer holds ``chunk_gated_delta_rule`` (fla's, or the torch one); 5.24: the module-level
    # ``torch_chunk_gated_delta_rule`` is a wrapper that picked its implementation at import (5.25 with the
    # ``kernels`` package: inside an nn.Module standing for it).
    fn = (getattr(layer, "chunk_gated_delta_rule", None) or getattr(mod, "chunk_gated_delta_rule", None)
          or getattr(mod, "torch_chunk_gated_delta_rule", None))
    if fn is None:
        return "unknown"
    while hasattr(fn, "__tiered_cache_split__"):  # the split forward's wrapper (engine.runner.split_forward)
        fn = fn.__tiered_cache_split__
    fn = hub_function(fn) or fn  # 5.25 with ``kernels``: the function under its nn.Module
    try:
        import inspect

        fn = inspect.getclosurevars(fn).nonlocals.get("implementation", fn)  # transformers' hub wrapper
    except (TypeError, ValueError):
        pass
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}"


def fla_status() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        import fla.ops.gated_delta_rule  # noqa: F401

        out["fla_importable"] = True
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable"
        out["fla_importable"] = False
        out["fla_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    try:
        from transformers.utils import is_flash_linear_attention_available

        out["transformers_fla_available"] = bool(is_flash_linear_attention_available())
    except ImportError:
        out["transformers_fla_available"] = None
    return out


def check_fla(device: torch.device) -> int:
    """Exit status for ``--check-fla``: 0 when transformers' Qwen3-Next runs its gated delta through
    flash-linear-attention on ``device`` (a tiny model's forward through the fla path succeeds)."""
    try:
        from tiered_cache.engine.models import tiny_qwen3_next
        from tiered_cache.engine.runner.forward import forward_chunk, new_cache

        model = tiny_qwen3_next(seed=0, dtype=torch.bfloat16, device=device)
        impl = gated_delta_impl(model)
        forward_chunk(model, new_cache(model), torch.arange(3, 140, device=device), 0)
        dev.synchronize(device)
        print(f"gated delta: {impl}")
        return 0 if impl.startswith("fla") else 1
    except Exception as e:  # noqa: BLE001 - any failure means "do not use fla"
        print(f"flash-linear-attention unusable: {type(e).__name__}: {str(e)[:300]}")
        return 1


def check_prefill_graphs(model, tokens: int = 520) -> dict:
    """The model's chunk rule through ``GraphChunkRule`` against the same call run eagerly, on random
    inputs of one of its linear layers' shapes (``tokens`` long, padded inside): largest absolute
    differences of the output and the final state (CUDA graphs of fla's kernels on a GPU)."""
    import importlib

    from tiered_cache.engine.runner.graph_prefill import GraphChunkRule

    cfg = model.config.get_text_config(decoder=True)
    mod = importlib.import_module(type(model).__module__)
    rule = mod.torch_chunk_gated_delta_rule
    rule = getattr(rule, "__tiered_cache_split__", rule)
    d = model.device
    g = torch.Generator(device="cpu").manual_seed(0)

    def r(*shape, dtype=model.dtype):
        return torch.randn(*shape, generator=g).to(d, dtype)

    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    q, k, v = r(1, tokens, hk, dk), r(1, tokens, hk, dk), r(1, tokens, hv, dv)
    kw = dict(g=-torch.rand(1, tokens, hv, generator=g).to(d),
              beta=torch.rand(1, tokens, hv, generator=g).to(d, model.dtype),
              initial_state=r(1, hv, dk, dv, dtype=torch.float32), output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    with torch.no_grad():
        want = rule(q, k, v, **kw)
        gr = GraphChunkRule(d)
        got = [gr(rule, q, k, v, **kw) for _ in range(2)][-1]
    return {"tokens": tokens, "out_max_abs_diff": (got[0].float() - want[0].float()).abs().max().item(),
            "state_max_abs_diff": (got[1] - want[1]).abs().max().item(), "replays": gr.stats["replays"],
            "capture_error": gr.capture_error}


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------ runs
def run_config(model, ecfg, drive, total: int, label: str, progress: bool, timeline: bool = False) -> dict:
    """One configuration through a workload: ``drive(engine, done)`` hands its ``total`` requests over
    (``wc.drive`` or ``wc.drive_trace``). ``timeline``: also record every step (start and length, what the
    running requests were doing, how many waited) and every turn (``st["timeline"]``)."""
    from tiered_cache.engine.scheduler import Engine

    engine = Engine(model, ecfg)
    steps: list[tuple] = []
    if timeline:
        step = engine.step

        def timed_step():
            t = time.perf_counter()
            doing = collections.Counter(r.status.value for r in engine.running)
            waiting = len(engine.waiting)
            out = step()
            steps.append((t - t0, time.perf_counter() - t, dict(doing), waiting, len(out)))
            return out

        engine.step = timed_step
    turns: list[wc.Finished] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, desc=f"{label:>24}", unit="req", leave=True)

    def done(f: wc.Finished) -> None:
        turns.append(f)
        if bar is not None:
            bar.update(1)

    t0 = time.perf_counter()
    drive(engine, done)
    dev.synchronize(engine.device)
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    st = engine.stats_dict()
    # forwards by kind: prefill chunks run as one forward with states taken inside (split_forwards, taking
    # split_states in all)
    st["engine_counts"] = {k: int(engine.stats.c[k]) for k in ("split_forwards", "split_states", "mid_checkpoints",
                                                               "branch_checkpoints", "end_checkpoints",
                                                               "block_checkpoints",
                                                               "decode_forwards", "decode_checkpoints")}
    gd = engine.runner.graph_decoder
    if gd is not None:  # CUDA graphs: how many captured and replayed, and why they stopped if they did
        st["graph_decoder"] = dict(gd.stats, capture_error=gd.capture_error)
        if gd.capture_error:
            print(f"   warning: {label}: graph capture failed, decoded eagerly: {gd.capture_error}")
    gp = st.get("graph_prefill")
    if gp is not None and gp["capture_error"]:
        print(f"   warning: {label}: chunk-rule graph capture failed, ran it eagerly: {gp['capture_error']}")
    if engine.cache is not None:
        engine.check_invariants()
        # the eviction policy and admission the engine's tree ran (a policy run's proof that it differed)
        pol, rule = engine.cache.tree.policy, getattr(engine.cache, "rule", None)
        tuned = getattr(pol, "TUNED", None)
        st["cache_policy"] = {"eviction_policy": ecfg.cache.eviction_policy, "policy_class": type(pol).__name__,
                              "state_admission": getattr(getattr(rule, "admission", None), "name", None),
                              "tuned_value": getattr(pol, tuned) if tuned else None,
                              "tunings": getattr(pol, "tunings", None)}
        # what the tree kept of the states offered, and how T1 turned over
        st["tree"] = {**engine.cache.stats, "checkpoints": st["checkpoints"],
                      **{f"t1_{k}": v for k, v in engine.tiers.t1.stats.items()}}
        after = engine.reset_cache()
        if after != engine.initial_free:
            raise AssertionError(f"{label}: pools not back to their initial free sets: {after} != "
                                 f"{engine.initial_free}")
    st["wall_s"] = wall
    st["turns"] = turns
    if timeline:
        st["timeline"] = {
            "steps": [{"start_s": a, "length_s": b, "running": c, "waiting": d, "finished": e}
                      for a, b, c, d, e in steps],
            "turns": [{"client": f.client, "round": f.round, "prompt_len": f.prompt_len, "due_s": f.submitted_s,
                       "finished_s": f.finished_s, "ttft_s": f.summary.get("ttft_s")} for f in turns]}
    return st


def steady_throughput(turns: list) -> float:
    """Requests per second once rounds >= 3 began: every request (of any round) that finished after the
    first round-3 request was sent, over the time from that send to the last finish. Rounds 1-2 are the
    warm-up that fills the cache; without round 3 (one- or two-round workloads) it is the whole run."""
    late = [t.submitted_s for t in turns if t.round >= 2]
    start = min(late) if late else 0.0
    n = sum(1 for t in turns if t.finished_s > start)
    span = max(t.finished_s for t in turns) - start if turns else 0.0
    return n / span if span > 0 else 0.0


def summarize(st: dict, base: Optional[dict]) -> dict[str, float]:
    tok, hits, by = st["tokens"], st["hits"], st["bytes"]
    prompt = max(1, tok["prompt"])
    late = [t.summary["ttft_s"] for t in st["turns"] if t.round >= 2]
    agree: Optional[float] = None  # undefined without a no-cache run to compare with
    if base is not None:
        ref = {(t.client, t.round): t.argmax for t in base["turns"]}
        n = same = 0
        for t in st["turns"]:
            r = ref[(t.client, t.round)]
            n += len(r)
            same += sum(a == b for a, b in zip(t.argmax, r))
        agree = same / max(1, n)
    return {
        "hit_rate": tok["reused"] / prompt, "hit_rate_t0": hits["T0_kv_tokens"] / prompt,
        "hit_rate_t2": hits["T2_kv_tokens"] / prompt, "state_hit_rate": hits["state_hit_rate"],
        "prefill_tokens_saved": tok["reused"], "computed_tokens": tok["computed"],
        "ttft_p50_s": st["ttft_s"]["p50"], "ttft_p90_s": st["ttft_s"]["p90"],
        "ttft_admitted_p50_s": st["ttft_s"]["from_admission_p50"],
        "ttft_admitted_p90_s": st["ttft_s"]["from_admission_p90"],
        "ttft_p50_round3plus_s": percentile(late, 50) if late else st["ttft_s"]["p50"],
        "requests_per_s": len(st["turns"]) / st["wall_s"],
        "requests_per_s_round3plus": steady_throughput(st["turns"]),
        "pcie_bytes": by.get("T2_d2h", 0) + by.get("T2_h2d", 0),
        "hits_t1_states": hits["T1_states"], "hits_t2_states": hits["T2_states"], "state_misses": hits["misses"],
        "argmax_agreement_vs_nocache": agree, "wall_s": st["wall_s"],
        **{f"phase_{k}_s": v for k, v in sorted(st.get("phase_s", {}).items())},
    }


# Every comparison the results carry: name -> (configuration, its baseline, metric, "speedup" (baseline /
# configuration: TTFT) or "gain" (configuration / baseline: throughput, hit rate)). int8's own share is
# (4) vs (2b) and (3) vs (2): equal GPU and host bytes on both sides; (4) vs (1) is what the cache gives.
RATIOS = {
    "ttft_p50_speedup_vs_nocache": ("int8_t1_t2", "no_cache", "ttft_p50_s", "speedup"),
    "ttft_p50_round3plus_speedup_vs_nocache": ("int8_t1_t2", "no_cache", "ttft_p50_round3plus_s", "speedup"),
    "throughput_vs_nocache": ("int8_t1_t2", "no_cache", "requests_per_s", "gain"),
    "throughput_round3plus_vs_nocache": ("int8_t1_t2", "no_cache", "requests_per_s_round3plus", "gain"),
    "throughput_2b_vs_nocache": ("gpu_only_host", "no_cache", "requests_per_s", "gain"),
    "ttft_p50_speedup_vs_2b": ("int8_t1_t2", "gpu_only_host", "ttft_p50_s", "speedup"),
    "ttft_p50_round3plus_speedup_vs_2b": ("int8_t1_t2", "gpu_only_host", "ttft_p50_round3plus_s", "speedup"),
    "throughput_vs_2b": ("int8_t1_t2", "gpu_only_host", "requests_per_s", "gain"),
    "throughput_round3plus_vs_2b": ("int8_t1_t2", "gpu_only_host", "requests_per_s_round3plus", "gain"),
    "hit_rate_vs_2b": ("int8_t1_t2", "gpu_only_host", "hit_rate", "gain"),
    "hit_rate_vs_gpu_only": ("int8_t1_t2", "gpu_only", "hit_rate", "gain"),
    "int8_hit_rate_vs_gpu_only": ("int8_t1", "gpu_only", "hit_rate", "gain"),
    "int8_throughput_vs_gpu_only": ("int8_t1", "gpu_only", "requests_per_s", "gain"),
}
RAW = ("ttft_p50_s", "ttft_p50_round3plus_s", "requests_per_s", "requests_per_s_round3plus", "hit_rate")


# --eviction-policies: each policy against LRU in the same configuration (same budgets): name -> (metric,
# "speedup" (LRU / policy: TTFT) or "gain" (policy / LRU)); keys ``<name>_<policy>_vs_lru``
POLICY_RATIOS = {"throughput": ("requests_per_s", "gain"),
                 "throughput_round3plus": ("requests_per_s_round3plus", "gain"),
                 "ttft_p50_speedup": ("ttft_p50_s", "speedup"),
                 "ttft_p50_round3plus_speedup": ("ttft_p50_round3plus_s", "speedup"),
                 "hit_rate": ("hit_rate", "gain")}


def policy_cache(cache: dict, policy: str) -> dict:
    """The tiers' shared settings ``cache`` (the run's ``--admission`` in them) under eviction policy
    ``policy`` with its admission, as bench_policy pairs them: Marconi keeps the leaf and branch points (its
    own admission); ours (``tiered``) too, or the run's block admission under ``--admission block`` (block
    reuse: bench_policy's Mooncake scenario); LRU and SegLen keep the run's ``--admission``."""
    adm = cache["state_admission"]
    if policy == "marconi" or (policy == "tiered" and adm != "block"):
        adm = "leaf_branch"
    out = dict(cache, eviction_policy=policy, state_admission=adm)
    if adm != "block":
        out.pop("admission_block", None)
    return out


def policy_ratios(s: dict[str, dict[str, float]], configs: list[str], policies: list[str],
                  fell_back: Collection[str] = ()) -> dict[str, Any]:
    """Each policy of ``policies`` against LRU in each configuration of ``configs`` (``s``: summaries by
    ``<config>_<policy>``): ``<config>_<ratio>_<policy>_vs_lru`` (``POLICY_RATIOS``), the first
    configuration's also as ``<ratio>_<policy>_vs_lru``, with the raw values behind them
    (``<metric>_<config>_<policy>``). None where a side did not run (no lru among ``policies``), the
    denominator is zero, or a side fell back to eager calls (that one named in ``invalid``)."""
    out: dict[str, Any] = {}
    invalid = []
    for i, c in enumerate(configs):
        for p in policies:
            if p == "lru":
                continue
            top, base = s.get(f"{c}_{p}"), s.get(f"{c}_lru")
            for name, (metric, kind) in POLICY_RATIOS.items():
                k, v = f"{name}_{p}_vs_lru", None
                if {f"{c}_{p}", f"{c}_lru"} & set(fell_back):
                    invalid += [f"{c}_{k}"] + ([k] if i == 0 else [])
                elif top is not None and base is not None and top[metric] is not None and base[metric] is not None:
                    num, den = wc.ratio_sides(kind, top[metric], base[metric])
                    v = num / den if den else None  # undefined: JSON has no inf
                out[f"{c}_{k}"] = v
                if i == 0:
                    out[k] = v
    for key in s:
        out.update({f"{m}_{key}": s[key][m] for m in RAW})
    out["invalid"] = invalid
    return out


def budget_policy_ratios(s: dict[str, dict[str, float]], budgets: list[float], configs: list[str],
                         policies: list[str], fell_back: Collection[str] = ()) -> dict[str, Any]:
    """``policy_ratios`` at each ``--policy-gpu-budgets`` point (``s``: summaries by ``gpu<MIB>_<config>_<policy>``):
    ``gpu<MIB>_<ratio>_<policy>_vs_lru`` (the first configuration's) and ``gpu<MIB>_<config>_<ratio>_<policy>_vs_lru``,
    the raw values as ``<metric>_gpu<MIB>_<config>_<policy>``."""
    out: dict[str, Any] = {"invalid": []}
    heads = {f"{name}_{p}_vs_lru" for name in POLICY_RATIOS for p in policies}
    for mib in budgets:
        tag = f"gpu{mib:g}"
        pr = policy_ratios({k: v for k, v in s.items() if k.startswith(f"{tag}_")}, [f"{tag}_{c}" for c in configs],
                           policies, fell_back)
        out.update({f"{tag}_{k}" if k in heads else k: v for k, v in pr.items() if k != "invalid"})
        out["invalid"] += [f"{tag}_{k}" if k in heads else k for k in pr["invalid"]]
    return out


def undefined_ratios(results: list[dict]) -> dict[str, dict]:
    """The ratios that have no value because their denominator is zero (left out of the metrics), by
    ``<workload>_<ratio>``, with the raw values behind them. A ratio refused because a side fell back
    (``ratios()["invalid"]``) is not undefined: it is listed there instead."""
    out = {}
    for r in results:
        rt = r["ratios"]
        for k, (top, base, metric, kind) in RATIOS.items():
            if k in rt and rt[k] is None and k not in rt.get("invalid", []):
                num, den = wc.ratio_sides(kind, f"{metric}_{top}", f"{metric}_{base}")
                out[f"{r['name']}_{k}"] = {"numerator": rt.get(num), "denominator": rt.get(den)}
        pol = r.get("policies") or {}
        budget_configs = [f"gpu{m:g}_{c}" for m in pol.get("gpu_budgets", []) for c in pol.get("configs", [])]
        for c in pol.get("configs", []) + budget_configs:  # --eviction-policies: each policy against LRU
            for p in r["policies"]["policies"]:
                for name, (metric, kind) in POLICY_RATIOS.items():
                    k = f"{c}_{name}_{p}_vs_lru"
                    if p != "lru" and rt.get(k, 0) is None and k not in rt.get("invalid", []):
                        num, den = wc.ratio_sides(kind, f"{metric}_{c}_{p}", f"{metric}_{c}_lru")
                        out[f"{r['name']}_{k}"] = {"numerator": rt.get(num), "denominator": rt.get(den)}
    return out


def ratios(s: dict[str, dict[str, float]], fell_back: Collection[str] = ()) -> dict[str, Any]:
    """The comparisons (``RATIOS``) between the configurations that ran (``--configs`` may leave some
    out), with the raw values behind them (``<metric>_<config>``; ``hit_rate_2b`` for (2b)'s). A zero
    denominator leaves a ratio undefined (None: left out of the metrics, listed by ``undefined_ratios``);
    a side in ``fell_back`` (a CUDA-graph capture failed and it ran eagerly) makes every ratio it is in
    None too, named in ``invalid``: a comparison with one side slower for a reason of its own is refused."""
    out: dict[str, Any] = {}
    invalid = []
    for k, (top, base, metric, kind) in RATIOS.items():
        if top not in s or base not in s:
            continue
        num, den = wc.ratio_sides(kind, s[top][metric], s[base][metric])
        if top in fell_back or base in fell_back:
            out[k] = None
            invalid.append(k)
        else:
            out[k] = num / den if den else None  # undefined: JSON has no inf
    if not out:
        return {}
    for c in s:
        out.update({f"{m}_{c}": s[c][m] for m in RAW})
    if "gpu_only_host" in s:
        out["hit_rate_2b"] = s["gpu_only_host"]["hit_rate"]
    if "gpu_only" in s and "int8_t1_t2" in s:
        # the gain is defined where the ratio is not: (2) reusing nothing (a cyclic working set larger than
        # its GPU budget) leaves the ratio without a value, and the results say so (``undefined``)
        out["hit_rate_gain_vs_gpu_only"] = s["int8_t1_t2"]["hit_rate"] - s["gpu_only"]["hit_rate"]
    out["invalid"] = invalid
    return out


def aggregate(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """``ratios()`` of several repeats as one: each value the median of the repeats' with ``<key>_min`` /
    ``<key>_max`` beside it (``repeats``: how many); None where any repeat's is None (undefined or
    refused); ``invalid``: refused in any repeat."""
    if not reps or not reps[0]:
        return {}
    out: dict[str, Any] = {"invalid": sorted({k for r in reps for k in r.get("invalid", [])})}
    for k in reps[0]:
        if k == "invalid":
            continue
        vals = [r.get(k) for r in reps]
        if any(v is None for v in vals) or k in out["invalid"]:
            out[k] = None
            continue
        out[k] = statistics.median(vals)
        if len(reps) > 1:
            out[f"{k}_min"], out[f"{k}_max"] = min(vals), max(vals)
    out["repeats"] = len(reps)
    return out


def fell_back(st: dict) -> Optional[str]:
    """Why configuration run ``st`` (``run_config``'s) fell back from a CUDA graph to eager calls (its
    graph decoder's or chunk rule's capture error), or None: it ran as configured."""
    for key in ("graph_decoder", "graph_prefill"):
        err = (st.get(key) or {}).get("capture_error")
        if err:
            return f"{key}: {err}"
    return None


def engine_config(serve: dict, cache: dict, tier: dict):
    """One configuration's ``EngineConfig``: the serving knobs ``serve``, the tiers' shared settings
    ``cache`` and the configuration's budgets ``tier`` (``wc.split_budget``'s; ``use_cache=False``: none)."""
    from tiered_cache.config import CacheConfig
    from tiered_cache.engine.config import EngineConfig

    budgets = {k: v for k, v in tier.items() if k != "use_cache"}
    return EngineConfig(use_cache=tier.get("use_cache", True), cache=CacheConfig(**cache, **budgets), **serve)


# dense bf16 tensor-core peak per GPU (SXM parts, no sparsity), the MFU denominator; None elsewhere
PEAK_FLOPS = {"h200": 989e12, "h100": 989e12, "a100": 312e12, "b200": 2.25e15}


def prefill_flops(model, start: int, n: int) -> float:
    """Model FLOPs of prefilling positions ``[start, start + n)``: 2 x the matrix parameters per token
    (every parameter but the input embedding, whose lookup is free; the LM head counts, as the forward
    computes logits at every position; the model's MLPs are dense), causal attention in each full layer
    (QK and PV: 4 x heads x head_dim per attended position) and the delta rule's state read and update
    in each linear layer (4 x value heads x d_k x d_v per token). Padding and masked work do not count."""
    from tiered_cache.engine.models import KV_KINDS, STATE_KINDS, layer_kinds

    cfg = model.config.get_text_config(decoder=True)
    emb = model.get_input_embeddings().weight.numel()
    matrix = n_params(model) - (0 if getattr(cfg, "tie_word_embeddings", False) else emb)
    kinds = layer_kinds(model.config)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attended = n * start + n * (n + 1) / 2
    attn = 4 * cfg.num_attention_heads * head_dim * attended * sum(k in KV_KINDS for k in kinds)
    rec = 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * n
    return 2.0 * matrix * n + attn + rec * sum(k in STATE_KINDS for k in kinds)


def prefill_probe(model, ecfg, prompt: list[int], repeats: int = 2) -> dict[str, Any]:
    """The no-cache baseline's own prefill efficiency: ``prompt`` computed whole through (1)'s path
    (``ModelRunner`` of its config: ``chunk_size`` pieces, the chunk rule as configured), best of
    ``repeats``, device synchronized: tokens/s, model FLOP/s (``prefill_flops``) and their share of the
    device's peak (``PEAK_FLOPS``; None where no peak is known, e.g. a CPU)."""
    from tiered_cache.engine.runner.model_runner import ModelRunner

    runner = ModelRunner(model, None, ecfg)
    chunk = ecfg.chunk_size
    best = float("inf")
    for _ in range(repeats):
        cache = runner.new_cache()
        dev.synchronize(model.device)
        t = time.perf_counter()
        with torch.no_grad():
            for s in range(0, len(prompt), chunk):
                runner.prefill(cache, prompt[s:s + chunk], s)
        dev.synchronize(model.device)
        best = min(best, time.perf_counter() - t)
    flops = sum(prefill_flops(model, s, len(prompt[s:s + chunk])) for s in range(0, len(prompt), chunk))
    peak = PEAK_FLOPS.get(device_tag())
    return {"prompt_tokens": len(prompt), "seconds": best, "prefill_tokens_per_s": len(prompt) / best,
            "model_flops": flops, "model_flops_per_s": flops / best, "peak_flops": peak,
            "mfu": flops / best / peak if peak else None}


def median_summary(sums: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per configuration and metric, the median over repeats (None where no repeat has a value)."""
    out: dict[str, dict[str, float]] = {}
    for c in sums[0]:
        out[c] = {}
        for k in sums[0][c]:
            vals = [s[c][k] for s in sums if s[c].get(k) is not None]
            out[c][k] = statistics.median(vals) if vals else None
    return out


def _load(name: str, args: argparse.Namespace, answer: Optional[int]) -> dict:
    over = dict(args.set)
    if answer is not None:
        over["max_new_tokens"] = answer
    sec = wc.load_workload(name, args.scale, over)
    for key, val in (("gpu_budget_mib", args.gpu_mib), ("host_budget_mib", args.host_mib)):
        if val is not None:
            sec[key] = val
    if getattr(args, "max_running", None) is not None:  # every configuration alike: T0's running reservation too
        sec["engine"]["max_running"] = args.max_running
    return sec


def trace_plan(args: argparse.Namespace, vocab: int, rate: float) -> list:
    """``--trace``'s requests as the engine replays them (``wc.trace_items``) at ``rate`` requests/s: a
    ``--trace-sample`` of its conversations (``wc.sample_conversations``; 1: all), from the
    ``--trace-start``-th request of that on, ``--trace-limit`` of them.

    A window (``--trace-start`` > 0) starts with an empty cache: a prefix first sent before it is a miss
    at its first use inside it (in every configuration alike), and the reuse bound
    (``wc.shared_prefix_bound``, reported beside the hit rates) counts only what the window shares."""
    from benchmarks import traces

    whole = args.trace_sample >= 1.0
    trace = traces.load_trace(args.trace, limit=args.trace_start + args.trace_limit if whole else None)
    trace = wc.sample_conversations(trace, args.trace_sample)[args.trace_start:args.trace_start + args.trace_limit]
    if not trace:
        raise ValueError(f"--trace-start {args.trace_start}: past the end of the (sampled) trace")
    return wc.trace_items(trace, vocab=vocab, block=args.trace_block, max_blocks=args.trace_max_blocks,
                          max_answer=args.trace_max_answer, rate=rate)


def run_workload(name: str, args: argparse.Namespace, device: torch.device, models: dict,
                 answer: Optional[int] = None, on_repeat: Optional[Callable[[dict], Any]] = None) -> dict:
    """One workload (its model, engine and budgets from ``workloads/<name>.json``) under every
    configuration, ``--repeats`` times (the configurations interleaved within each repeat, the order rotated
    between repeats; before the first, each timed run's warm pass unless ``--no-warm-each``), plus the
    ``--rates`` and ``--gpu-budgets`` sweeps (one run a point, after the repeats). ``answer``: its answers'
    length instead of the file's. ``on_repeat``: called with the result so far after each repeat (``main``
    writes it). With ``--trace``: the trace's requests instead of the file's clients (model, engine and
    budgets still the file's)."""
    from tiered_cache.engine.model_specs import spec_for

    sec = _load(name, args, answer)
    w, m, e = sec["workload"], sec["model"], sec["engine"]
    key = json.dumps(m, sort_keys=True)
    if key not in models:
        t = time.perf_counter()
        model = build_model(m, device)
        models[key] = (model, {"params": n_params(model), "build_s": time.perf_counter() - t,
                               "gated_delta": gated_delta_impl(model)})
        if args.prefill_graphs:  # the replayed rule against the eager one, once per model
            chk = models[key][1]["prefill_graph_check"] = check_prefill_graphs(model)
            print(f"   prefill graphs: chunk rule replayed against eager at {chk['tokens']} tokens: output max |diff| "
                  f"{chk['out_max_abs_diff']:.3g}, state {chk['state_max_abs_diff']:.3g}"
                  + (f"; capture failed: {chk['capture_error']}" if chk["capture_error"] else ""))
        models[key][1]["warm"] = False
    model, minfo = models[key]
    vocab = model.config.vocab_size
    specs = spec_for(model, e["page_size"])
    tb = wc.TierBytes.from_specs(specs.full, specs.state, e["page_size"])
    serve = dict(chunk_size=e["chunk_size"], prefill_budget=e["prefill_budget"], max_running=e["max_running"],
                 decode_batch=bool(args.decode_batch or e.get("decode_batch", False)),
                 decode_graphs=bool(args.decode_graphs), prefill_graphs=bool(args.prefill_graphs),
                 phase_timing=args.phase_timing)
    # every cached configuration keeps the same offered states (``--admission``; recorded in the JSON)
    block = admission_block(args)
    cache = dict(page_size=e["page_size"], write_policy=e["write_policy"], state_admission=args.admission,
                 **({"admission_block": block} if args.admission == "block" else {}))
    trace_info: Optional[dict] = None
    if args.trace and args.trace_block % e["page_size"]:
        raise ValueError(f"--trace-block {args.trace_block}: expected a multiple of the engine's page size "
                         f"{e['page_size']} (a shared block would end inside a page, where nothing is cached)")
    if args.trace:
        items = trace_plan(args, vocab, 1.0)  # lengths only: the rate is set below
        label = args.tag or "trace"
        longest = max(len(it.prompt) + len(it.answer) for it in items)
        n_req = len(items)
        first_prompt = max((it.prompt for it in items), key=len)
        print(f"\n== {label}: {n_req} requests of {args.trace} (blocks of {args.trace_block} tokens, at most "
              f"{args.trace_max_blocks} a prompt, answers <= {args.trace_max_answer}); longest {longest} tokens")
    else:
        clients = wc.make_clients(w, vocab)
        label = name if answer is None else f"{name}_ans{answer}"
        longest = wc.longest_request(clients, w["max_new_tokens"])
        n_req = sum(len(c.questions) for c in clients)
        first_prompt = max((c.prompt(0, None) for c in clients), key=len)
        print(f"\n== {label} ({args.scale}): {w['clients']} clients x {w['rounds']} rounds, prefix {w['prefix_len']} "
              f"({'own' if not w['prefix_groups'] else str(w['prefix_groups']) + ' shared'}), question "
              f"{w['question_len']}, answer {w['max_new_tokens']}"
              + (" (the prefill-node case)" if w["max_new_tokens"] <= 8 else "")
              + f", think time {w.get('think_time_s', 0.0):g} s; {n_req} requests, longest {longest} tokens")
    req_pages = -(-longest // e["page_size"])
    host = int(sec["host_budget_mib"] * wc.MiB)

    def tiers_at(gpu_mib: float) -> dict:
        return wc.split_budget(tb, int(gpu_mib * wc.MiB), host, e["max_running"], req_pages, e["kv_fraction"])

    tiers = tiers_at(sec["gpu_budget_mib"])
    print(f"   state per request: {tb.state_native / 1e6:.2f} MB native (fp32 temporal), T1 slot lossless "
          f"{tb.t1_lossless / 1e6:.2f} MB / int8 {tb.t1_int8 / 1e6:.2f} MB ({tb.t1_lossless / tb.t1_int8:.2f}x); "
          f"KV page {tb.kv_page / 1024:.1f} KiB ({e['page_size']} tokens)")
    print(f"   budget: GPU {sec['gpu_budget_mib']} MiB, host {sec['host_budget_mib']} MiB -> "
          + "; ".join(f"{c}: {', '.join(f'{k}={v}' for k, v in t.items() if k != 'codec')}"
                      for c, t in tiers.items() if c != "no_cache"))
    if not minfo["warm"] and not args.warm_each:
        # --no-warm-each: first-call costs (kernel compiles and autotuning, allocator growth) paid once per
        # model, outside every configuration's clock, at the workload's own shapes: Triton kernels autotune
        # per shape, and a warm-up on short prompts left fla's first full-size chunk to the first
        # configuration's clock (10 s of the no-cache run on the H200, 2026-11-30). As many requests as run
        # at once, twice (misses, then hits through every tier), two tokens each. Through (4) only: the
        # first timed run of another kind still pays its own (the warm pass below, on by default, does not
        # need this one).
        if args.trace:
            few = [wc.TraceItem(0.0, it.prompt, it.answer[:2]) for it in items[:e["max_running"]]]
            warm = lambda eng, done: wc.drive_trace(eng, few + few, done)  # noqa: E731
            n_warm = 2 * len(few)
        else:
            wcl = wc.make_clients(dict(w, clients=min(w["clients"], e["max_running"]), rounds=min(2, w["rounds"]),
                                       max_new_tokens=2), vocab)
            ww = dict(w, request_rate=0, max_new_tokens=2, think_time_s=0.0)
            warm = lambda eng, done: wc.drive(eng, wcl, ww, done)  # noqa: E731
            n_warm = sum(len(c.questions) for c in wcl)
        run_config(model, engine_config(serve, cache, tiers["int8_t1_t2"]), warm, n_warm, "warm-up", False)
        minfo["warm"] = True
    if args.trace:
        rate = args.trace_rate
        calibration = None
        if rate <= 0:  # the engine's capacity: (1) on the first requests, all at once, timed on a second pass
            k = min(len(items), max(2 * e["max_running"], 8))
            burst = [wc.TraceItem(0.0, it.prompt, it.answer) for it in items[:k]]
            # the first pass compiles and autotunes (1)'s own shapes (whole prompts, decode batches of up to
            # max_running), which the warm-up through (4) did not: 18.8 s of a one-pass calibration on the H200
            cal = [run_config(model, engine_config(serve, cache, tiers["no_cache"]),
                              lambda eng, done: wc.drive_trace(eng, burst, done), k, "capacity (1)", False)["wall_s"]
                   for _ in range(2)]
            rate = args.trace_load * k / cal[1]
            calibration = {"requests": k, "first_pass_s": cal[0], "timed_pass_s": cal[1]}
            print(f"   (1) served {k} requests sent at once in {cal[1]:.2f} s (first pass, compiling: {cal[0]:.2f} s): "
                  f"arrivals scaled to {args.trace_load:g} x {k / cal[1]:.2f} = {rate:.2f} requests/s")
        items = trace_plan(args, vocab, rate)
        bound = wc.shared_prefix_bound(items, e["page_size"])
        print(f"   the window shares {bound} of its {sum(len(it.prompt) for it in items)} prompt tokens (page-aligned "
              "prefixes an earlier request of it began with: the ceiling of every hit rate below)")
        # an open loop: each configuration takes at least the arrivals' span, whatever its speed
        print(f"   arrivals span {items[-1].at_s:.1f} s per configuration (--trace-limit / rate)")
        trace_info = {"file": os.path.basename(args.trace), "requests": n_req, "rate_per_s": rate,
                      "load": args.trace_load if args.trace_rate <= 0 else None, "block_tokens": args.trace_block,
                      "max_blocks": args.trace_max_blocks, "max_answer": args.trace_max_answer,
                      "start": args.trace_start, "sample": args.trace_sample, "calibration": calibration,
                      "prompt_tokens_mean": statistics.mean(len(it.prompt) for it in items),
                      "answer_tokens_mean": statistics.mean(len(it.answer) for it in items),
                      "prompt_tokens": sum(len(it.prompt) for it in items),
                      "reuse_bound_tokens": bound, "reuse_bound": bound / sum(len(it.prompt) for it in items)}

        def drive_for(wd: dict):
            return lambda eng, done: wc.drive_trace(eng, items, done)
    else:
        def drive_for(wd: dict):
            return lambda eng, done: wc.drive(eng, clients, wd, done)

    def result(reps: list[dict], last: dict, last_p: dict, sweep: list, budget_sweep: list,
               eff: Optional[dict]) -> dict:
        s = median_summary([r["summary"] for r in reps])
        pol = {"configs": pol_configs, "policies": list(args.eviction_policies),
               "gpu_budgets": list(args.policy_gpu_budgets),
               "gpu_budget_tiers": {f"{m:g}": {c: tiers_at(m)[c] for c in pol_configs}
                                    for m in args.policy_gpu_budgets},
               "summary": median_summary([r["policy_summary"] for r in reps]) if pol_runs else {},
               "labels": {k: lab for k, (_, _, lab) in runs.items() if k not in configs},
               "cache_policy": {k: st.get("cache_policy") for k, st in last_p.items()},
               "tree_stats": {k: st.get("tree", {}) for k, st in last_p.items()}} if pol_runs else {}
        return {"name": label, "workload": name, "answer": int(w["max_new_tokens"]) if not args.trace else None,
                "policies": pol,
                "summary": s, "ratios": aggregate([r["ratios"] for r in reps]), "repeats": len(reps),
                "fell_back": {c: why for r in reps for c, why in r["fell_back"].items()}, "tiers": tiers,
                "tier_bytes": dataclasses.asdict(tb), "longest_request": longest, "requests": n_req, "section": sec,
                "model": minfo, "trace": trace_info, "efficiency": eff,
                "tree_stats": {c: last[c].get("tree", {}) for c in configs},
                "graph_decoder": {c: last[c].get("graph_decoder") for c in configs},
                "graph_prefill": {c: last[c].get("graph_prefill") for c in configs},
                "engine_counts": {c: last[c].get("engine_counts") for c in configs}, "sweep": sweep,
                "budget_sweep": budget_sweep, "orders": list(orders), "warm_pass_s": warm_s}

    configs = [c for c in wc.CONFIGS if c in args.configs]
    # --eviction-policies: each of --policy-configs once per policy in every repeat, beside the configurations
    pol_configs = list(dict.fromkeys(args.policy_configs)) if args.eviction_policies else []
    pol_runs = [(c, p) for c in pol_configs for p in args.eviction_policies]
    # every timed run of a repeat by key (a configuration, ``<config>_<policy>``, or ``gpu<MIB>_<config>_<policy>``
    # at a --policy-gpu-budgets point): its tiers, the tiers' shared settings (a policy run: the same requests,
    # eviction policy and admission changed) and its label
    runs = {c: (tiers[c], cache, wc.LABELS[c]) for c in configs}
    runs.update({f"{c}_{p}": (tiers[c], policy_cache(cache, p), f"{wc.LABELS[c]} [{p}]") for c, p in pol_runs})
    for mib in args.policy_gpu_budgets:  # the policy runs again at each of these GPU budgets, alike
        at = tiers_at(mib)
        runs.update({f"gpu{mib:g}_{c}_{p}": (at[c], policy_cache(cache, p), f"{wc.LABELS[c]} [{p}] @ GPU {mib:g} MiB")
                     for c, p in pol_runs})
    keys = list(runs)

    def timed(key: str, lab: str, progress: bool, timeline: bool = False) -> dict:
        tier, cc, _ = runs[key]
        return run_config(model, engine_config(serve, cc, tier), drive_for(w), n_req, lab, progress, timeline)

    warm_s: dict[str, float] = {}
    if args.warm_each:  # first-call costs (module docstring), each run's own shapes, outside every clock
        for key in keys:
            lab = f"{label} {runs[key][2]} (warm pass)"
            warm_s[key] = timed(key, lab, False)["wall_s"]
            print(f"   {lab}: {warm_s[key]:.1f} s, untimed")
    reps: list[dict] = []
    orders: list[list[str]] = []
    for rep in range(args.repeats):
        raw: dict[str, dict] = {}
        tag = f" #{rep + 1}" if args.repeats > 1 else ""
        orders.append(wc.rotated(keys, rep))
        for key in orders[-1]:
            lab = f"{label} {runs[key][2]}{tag}"
            timeline = bool(args.timeline) and rep == 0
            if args.profile and rep == 0:  # where the time goes: cProfile per configuration (a development aid)
                import cProfile
                import pstats

                prof = cProfile.Profile()
                raw[key] = prof.runcall(timed, key, lab, False, timeline)
                os.makedirs(args.profile, exist_ok=True)
                with open(os.path.join(args.profile, f"profile-{label}-{key}.txt"), "w") as f:
                    for k in ("tottime", "cumulative"):
                        pstats.Stats(prof, stream=f).sort_stats(k).print_stats(45)
            else:
                raw[key] = timed(key, lab, args.progress, timeline)
            ran(lab, raw[key])
            if timeline:
                os.makedirs(args.timeline, exist_ok=True)
                with open(os.path.join(args.timeline, f"timeline-{label}-{key}.json"), "w") as f:
                    json.dump(raw[key]["timeline"], f)
        raw_p = {k: raw.pop(k) for k in keys if k not in configs}
        s_rep = {c: summarize(raw[c], raw.get("no_cache")) for c in configs}  # (1) against itself: 1
        s_pol = {k: summarize(st, raw.get("no_cache")) for k, st in raw_p.items()}
        fb = {c: why for c, st in {**raw, **raw_p}.items() if (why := fell_back(st))}
        for c, why in fb.items():
            print(f"   REFUSED: {wc.LABELS.get(c, c)}{tag} fell back to eager ({why}): every comparison it is in is "
                  "left out (null, info.invalid_comparisons)")
        rt = ratios(s_rep, fb)
        if pol_runs:
            pr = policy_ratios({f"{c}_{p}": s_pol[f"{c}_{p}"] for c, p in pol_runs}, pol_configs,
                               args.eviction_policies, fb)
            pb = budget_policy_ratios(s_pol, args.policy_gpu_budgets, pol_configs, args.eviction_policies, fb)
            rt = {**rt, **pr, **pb, "invalid": rt.get("invalid", []) + pr["invalid"] + pb["invalid"]}
        reps.append({"summary": s_rep, "policy_summary": s_pol, "ratios": rt, "fell_back": fb})
        if on_repeat is not None:  # what is measured so far, written: a run cut short keeps its repeats
            on_repeat(result(reps, raw, raw_p, [], [], None))
    s = median_summary([r["summary"] for r in reps])
    for c in configs:
        if c != "no_cache" and (s[c]["prefill_tokens_saved"] or 0) <= 0:
            print(f"   warning: {c} reused no tokens")
    sweep = []
    for rate_r in args.rates or []:  # the same requests at other arrival rates: TTFT and throughput against load
        wr = dict(w, request_rate=float(rate_r))
        raw_r = {c: run_config(model, engine_config(serve, cache, tiers[c]), drive_for(wr), n_req,
                               f"{label} {wc.LABELS[c]} @ {rate_r:g}/s", args.progress)
                 for c in wc.CONFIGS if c in args.sweep_configs}
        sr = {c: summarize(raw_r[c], raw_r.get("no_cache")) for c in raw_r}
        fb = {c: why for c in raw_r if (why := fell_back(raw_r[c]))}
        sweep.append({"rate": float(rate_r), "summary": sr, "ratios": ratios(sr, fb), "fell_back": fb})
    budget_sweep = []
    for mib in args.gpu_budgets or []:  # the GPU budget swept: (1) needs no pools, so the main run's (1) stands
        tb_at = tiers_at(mib)
        raw_b = {c: run_config(model, engine_config(serve, cache, tb_at[c]), drive_for(w), n_req,
                               f"{label} {wc.LABELS[c]} @ GPU {mib:g} MiB", args.progress)
                 for c in wc.CONFIGS if c in args.budget_configs and c != "no_cache"}
        sb = {c: summarize(raw_b[c], None) for c in raw_b}
        if "no_cache" in s:
            sb = {"no_cache": s["no_cache"], **sb}
        fb = {c: why for c in raw_b if (why := fell_back(raw_b[c]))}
        budget_sweep.append({"gpu_mib": float(mib), "tiers": tb_at, "summary": sb, "ratios": ratios(sb, fb),
                             "fell_back": fb})
    eff = None
    if "no_cache" in configs:
        eff = prefill_probe(model, engine_config(serve, cache, tiers["no_cache"]), first_prompt)
        eff["run_computed_tokens_per_s"] = s["no_cache"]["computed_tokens"] / s["no_cache"]["wall_s"]
        print(f"   (1)'s own efficiency: prefill of {eff['prompt_tokens']} tokens at "
              f"{eff['prefill_tokens_per_s']:,.0f} tokens/s, {eff['model_flops_per_s'] / 1e12:.2f} model TFLOP/s"
              + (f" = {100 * eff['mfu']:.1f} % of {eff['peak_flops'] / 1e12:.0f} TFLOP/s" if eff["mfu"] else
                 " (no peak known for this device: MFU undefined)")
              + f"; whole run {eff['run_computed_tokens_per_s']:,.0f} computed tokens/s")
    return result(reps, raw, raw_p, sweep, budget_sweep, eff)


def ran(label: str, st: dict) -> None:
    """One line as a run ends, so a run cut short by a time limit still shows what it measured."""
    print(f"   {label}: {len(st['turns'])} requests in {st['wall_s']:.1f} s ({len(st['turns']) / st['wall_s']:.2f} "
          f"req/s), reused {st['tokens']['reused']} of {st['tokens']['prompt']} prompt tokens"
          + (f"; FELL BACK: {fell_back(st)}" if fell_back(st) else ""))


# ------------------------------------------------------------------------------------------ report
def chart(path: str, res: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pol = res.get("policies") or {}
    s = {**res["summary"], **pol.get("summary", {})}  # --eviction-policies' runs beside the configurations
    configs = list(s)
    names = [pol["labels"][c].split(" ", 1)[0] + " " + c.rsplit("_", 1)[1] if c in pol.get("labels", {})
             else wc.LABELS[c].split(" ", 1)[0] for c in configs]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    fig.suptitle(f"{res['name']}: {res['requests']} requests, same GPU budget "
                 f"({res['section']['gpu_budget_mib']} MiB; host {res['section']['host_budget_mib']} MiB)")
    x = range(len(configs))
    p50 = [1000 * (s[c]["ttft_p50_s"] or 0) for c in configs]
    p90 = [1000 * (s[c]["ttft_p90_s"] or 0) for c in configs]
    ax[0, 0].bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    ax[0, 0].bar([i + 0.2 for i in x], p90, 0.4, label="p90")
    ax[0, 0].set(title="time to first token", ylabel="ms", xticks=list(x), xticklabels=names)
    ax[0, 0].legend()
    ax[0, 1].bar(names, [s[c]["requests_per_s"] for c in configs], color="tab:green")
    ax[0, 1].set(title="throughput", ylabel="requests / s")
    t0 = [s[c]["hit_rate_t0"] for c in configs]
    t2 = [s[c]["hit_rate_t2"] for c in configs]
    ax[1, 0].bar(names, t0, label="KV from T0 (GPU)")
    ax[1, 0].bar(names, t2, bottom=t0, label="KV loaded back from T2 (host)")
    ax[1, 0].set(title="prompt tokens reused (hit rate)", ylim=(0, 1))
    ax[1, 0].legend()
    ax[1, 1].bar(names, [s[c]["pcie_bytes"] / 2**20 for c in configs], color="tab:purple")
    ax[1, 1].set(title="bytes over PCIe (T2, both ways)", ylabel="MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


SWEEP_METRICS = ("ttft_p50_s", "ttft_p50_round3plus_s", "ttft_admitted_p50_s", "requests_per_s",
                 "requests_per_s_round3plus", "hit_rate")


def sweep_from_record(rec: dict, name: str) -> dict:
    """``chart_sweep``'s input rebuilt from a result file's metrics (``plot_results.py``)."""
    m = rec["metrics"]
    sec = rec["info"]["workloads"][name]
    keys = ("ttft_p50_round3plus_s", "requests_per_s_round3plus")

    def summ(prefix: str) -> dict:
        return {c: {k: m[f"{prefix}{c}_{k}"] for k in keys} for c in wc.CONFIGS
                if all(f"{prefix}{c}_{k}" in m for k in keys)}

    rates = sorted({float(k[len(name) + 5:].split("_", 1)[0]) for k in m if k.startswith(f"{name}_rate")})
    return {"name": name, "section": sec, "summary": summ(f"{name}_"),
            "sweep": [{"rate": r, "summary": summ(f"{name}_rate{r:g}_")} for r in rates]}


def chart_sweep(path: str, res: dict) -> None:
    """TTFT p50 and throughput at rounds >= 3 against the arrival rate, one line per configuration (the
    sweep's runs and the main run at the workload's own rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = list(res["sweep"])
    main_rate = float(res["section"]["workload"].get("request_rate", 0))
    if all(p["rate"] != main_rate for p in pts):  # the main run is a point of the curve too
        pts.append({"rate": main_rate, "summary": res["summary"]})
    pts.sort(key=lambda p: p["rate"])
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    fig.suptitle(f"{res['name']}: against the arrival rate (requests / s)")
    for c in wc.CONFIGS:
        have = [p for p in pts if c in p["summary"]]
        if not have:
            continue
        x = [p["rate"] for p in have]
        ax[0].plot(x, [1000 * (p["summary"][c]["ttft_p50_round3plus_s"] or 0) for p in have], "o-",
                   label=wc.LABELS[c])
        ax[1].plot(x, [p["summary"][c]["requests_per_s_round3plus"] for p in have], "o-", label=wc.LABELS[c])
    ax[0].set(title="TTFT p50, rounds >= 3", xlabel="arrival rate", ylabel="ms", yscale="log")
    ax[1].set(title="throughput, rounds >= 3", xlabel="arrival rate", ylabel="requests / s")
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _row(workload: str, c: str, s: dict, fell: Optional[dict] = None, answer: Optional[int] = None,
         label: Optional[str] = None, orders: Optional[list[list[str]]] = None) -> dict:
    """One table row: configuration ``c``'s summary ``s`` (a main run's or a sweep point's; ``label``: a
    policy run's name, else the configuration's); ``valid`` is "no" where it fell back to eager calls
    (``fell``: the fallbacks of its run); ``order``: its place among the timed runs of each repeat
    (``orders``: each repeat's keys in the order they ran; 1 = first), "-" for a sweep point (one run,
    after the repeats)."""
    return {"workload": workload, "answer": "-" if answer is None else (f"{answer} (prefill-node)" if answer <= 8
                                                                        else answer),
            "config": label or wc.LABELS[c], "valid": "no (fell back)" if fell and c in fell else "yes",
            "order": ",".join(str(o.index(c) + 1) for o in orders) if orders else "-",
            "hit_rate": s["hit_rate"], "T0_kv": s["hit_rate_t0"], "T2_kv": s["hit_rate_t2"],
            "states T1/T2/miss": f"{s['hits_t1_states']:g}/{s['hits_t2_states']:g}/{s['state_misses']:g}",
            "saved_tokens": s["prefill_tokens_saved"], "ttft_p50_ms": 1000 * (s["ttft_p50_s"] or 0),
            "ttft_p90_ms": 1000 * (s["ttft_p90_s"] or 0), "req_per_s": s["requests_per_s"],
            "req_per_s_r3+": s["requests_per_s_round3plus"], "pcie_MiB": s["pcie_bytes"] / 2**20,
            "argmax_agree": s["argmax_agreement_vs_nocache"]}


def _fmt3(v: Optional[float]) -> str:
    """A value to 3 places, or ``n/a`` where it is undefined."""
    return "n/a" if v is None else f"{v:.3f}"


def _values(r: dict) -> dict[str, float]:
    """A ratios dict's numbers (its ``invalid`` list and undefined entries left out)."""
    return {k: v for k, v in r.items() if k != "invalid" and v is not None}


def collect(results: list[dict]) -> tuple[dict[str, float], list[dict]]:
    """Metrics and table rows of every result. The first result's ratios also go in unprefixed: the
    headline (the first of ``--workloads`` at the first of ``--answers``, or the trace)."""
    metrics: dict[str, float] = {}
    rows = []
    for i, res in enumerate(results):
        name = res["name"]
        r = _values(res["ratios"])
        if i == 0:
            metrics.update(r)
        metrics.update({f"{name}_{k}": v for k, v in r.items()})
        for c in res["summary"]:
            for k, v in res["summary"][c].items():
                if v is not None and (k in METRICS or k.startswith("phase_")):
                    metrics[f"{name}_{c}_{k}"] = v
            rows.append(_row(name, c, res["summary"][c], res["fell_back"], res.get("answer"), orders=res["orders"]))
        pol = res.get("policies") or {}
        for c, s in pol.get("summary", {}).items():  # --eviction-policies: <workload>_<config>_<policy>_*
            metrics.update({f"{name}_{c}_{k}": v for k, v in s.items()
                            if v is not None and (k in METRICS or k.startswith("phase_"))})
            rows.append(_row(name, c, s, res["fell_back"], res.get("answer"), pol["labels"][c], res["orders"]))
        eff = res.get("efficiency")
        if eff:
            metrics.update({f"{name}_no_cache_{k}": eff[k] for k in ("prefill_tokens_per_s", "model_flops_per_s",
                                                                   "mfu", "peak_flops", "run_computed_tokens_per_s")
                            if eff[k] is not None})
        for p in res.get("sweep", []):
            at = f"{name}_rate{p['rate']:g}"
            metrics.update({f"{at}_{k}": v for k, v in _values(p["ratios"]).items()})
            for c, s in p["summary"].items():
                metrics.update({f"{at}_{c}_{k}": s[k] for k in SWEEP_METRICS if s[k] is not None})
                rows.append(_row(f"{name} @ {p['rate']:g}/s", c, s, p["fell_back"], res.get("answer")))
        for p in res.get("budget_sweep", []):
            at = f"{name}_gpu{p['gpu_mib']:g}"
            metrics.update({f"{at}_{k}": v for k, v in _values(p["ratios"]).items()})
            for c, s in p["summary"].items():
                if c == "no_cache":  # the main run's: it needs no pools
                    continue
                metrics.update({f"{at}_{c}_{k}": s[k] for k in SWEEP_METRICS if s[k] is not None})
                rows.append(_row(f"{name} @ GPU {p['gpu_mib']:g} MiB", c, s, p["fell_back"], res.get("answer")))
    return metrics, rows


def save(results: list[dict], models: dict, env: dict, args: argparse.Namespace, t_start: float):
    """Write what is measured so far (after every workload: a run cut short keeps its finished ones)."""
    model_info = [v for _, v in models.values()]
    gd = sorted({m["gated_delta"] for m in model_info})
    metrics, rows = collect(results)
    metrics["fla_used"] = float(any(g.startswith("fla") for g in gd))
    chk = [m["prefill_graph_check"] for m in model_info if "prefill_graph_check" in m]
    if chk:
        metrics["prefill_graph_out_max_abs_diff"] = max(c["out_max_abs_diff"] for c in chk)
        metrics["prefill_graph_state_max_abs_diff"] = max(c["state_max_abs_diff"] for c in chk)
    metrics["model_params"] = float(model_info[0]["params"])
    metrics["state_bytes_per_request_native"] = float(results[0]["tier_bytes"]["state_native"])
    repeats = min(r["repeats"] for r in results)  # fewer than asked in a file written part way
    metrics["repeats"] = float(repeats)
    metrics["warm_each"] = float(args.warm_each)
    metrics["total_s"] = time.perf_counter() - t_start
    invalid = {r["name"]: r["ratios"].get("invalid", []) for r in results if r["ratios"].get("invalid")}
    for r in results:
        for p in r["sweep"] + r["budget_sweep"]:
            at = f"{r['name']} @ {p['rate']:g}/s" if "rate" in p else f"{r['name']} @ GPU {p['gpu_mib']:g} MiB"
            if p["ratios"].get("invalid"):
                invalid[at] = p["ratios"]["invalid"]
    peak = PEAK_FLOPS.get(device_tag())
    notes = (f"Scale `{args.scale}`; model {model_info[0]['params'] / 1e6:,.1f} M params, recurrent state "
             f"{results[0]['tier_bytes']['state_native'] / 1e6:.2f} MB per request (native); gated-delta "
             f"implementation: {', '.join(gd)}. Configurations: (1) no cache, (2) GPU-only radix cache with "
             "states in their own dtype, (2b) (2) + a lossless host tier of (4)'s host bytes (SGLang's HiCache "
             "for a hybrid model), (3) (2) with int8 T1, (4) (3) + T2 host mirror, at the same GPU budget per "
             "workload (split in benchmarks/workload_common.py). hit_rate = prompt tokens reused / prompt "
             "tokens; TTFT from arrival (Poisson, asyncio-throttle) incl. queueing. Throughput "
             "(`throughput_vs_*`, req_per_s) is the whole run's: requests / wall time, as SGLang's bench_multiturn "
             "reports it; `*_round3plus_*` (req_per_s_r3+) is the steady window beside it. "
             f"{repeats} repeat(s), configurations interleaved, repeat r starting at the (r mod n)-th timed run "
             "(rows' `order`: the place in each repeat): each ratio is the median of the repeats' "
             "with `_min` / `_max`; table rows are per-metric medians. "
             + ("Warm pass (warm_each true): every timed run first served the same requests once, untimed, on a "
                "fresh engine (info.workloads.<w>.warm_pass_s). " if args.warm_each else
                "No warm pass (warm_each false, --no-warm-each): one warm-up through (4) per model; a timed run "
                "that is the first of its kind pays its first-call costs (order effects remain). ")
             + "(1)'s own efficiency: "
             "`<workload>_no_cache_prefill_tokens_per_s` and `_mfu` (model FLOPs from the geometry, "
             "benchmarks/bench_workload.py prefill_flops; peak "
             + (f"{peak / 1e12:.0f} TFLOP/s dense bf16). " if peak else "unknown here, MFU undefined). ")
             + (f"--eviction-policies {' '.join(args.eviction_policies)}: each of {', '.join(args.policy_configs)} "
                "run once per policy in every repeat, same budgets (`<workload>_<config>_<policy>_*`; "
                "`<ratio>_<policy>_vs_lru`: of the first configuration, `<config>_<ratio>_<policy>_vs_lru` each; "
                "null where a side did not run); admission: marconi leaf + branch, tiered leaf + branch (block "
                f"under --admission block), lru and seglen --admission ({args.admission}); info.workloads.<w>."
                "policies.cache_policy: what each run's tree ran. " if args.eviction_policies else "")
             + (f"--policy-gpu-budgets {' '.join(f'{m:g}' for m in args.policy_gpu_budgets)}: the policy runs again at "
                "each GPU budget, warmed and rotated with the others (`<workload>_gpu<MIB>_<config>_<policy>_*`, "
                "`gpu<MIB>_<ratio>_<policy>_vs_lru`; tiers in info.workloads.<w>.policies.gpu_budget_tiers). "
                if args.policy_gpu_budgets else "")
             + (f"Refused (a side fell back to eager: null, info.invalid_comparisons): {invalid}." if invalid
                else "No configuration fell back to eager calls: every comparison is valid."))
    bench = "workload" + (f"-{args.tag}" if args.tag else "")
    path = write_results(bench, metrics, rows=rows, notes=notes, out_dir=args.out)
    with open(path) as f:
        record = json.load(f)
    keep = ("workload", "engine", "model", "gpu_budget_mib", "host_budget_mib")
    record["info"] = {"undefined_ratios": undefined_ratios(results), "invalid_comparisons": invalid,
                      "fell_back": {r["name"]: r["fell_back"] for r in results if r["fell_back"]},
                      "scale": args.scale, "environment": env, "repeats": repeats, "warm_each": bool(args.warm_each),
                      "gated_delta": gd, "models": model_info,
                      "decode_batch_flag": bool(args.decode_batch),
                      "state_admission": args.admission,
                      "admission_block": admission_block(args),
                      "eviction_policies": list(args.eviction_policies), "policy_configs": list(args.policy_configs),
                      "decode_graphs_flag": bool(args.decode_graphs),
                      "prefill_graphs_flag": bool(args.prefill_graphs),
                      "workloads": {r["name"]: {**{k: r["section"][k] for k in keep}, "tiers": r["tiers"],
                                                "tier_bytes": r["tier_bytes"], "longest_request": r["longest_request"],
                                                "answer": r["answer"], "trace": r["trace"],
                                                "repeat_orders": r["orders"], "warm_pass_s": r["warm_pass_s"],
                                                "no_cache_efficiency": r["efficiency"],
                                                "budget_sweep_tiers": {f"{p['gpu_mib']:g}": p["tiers"]
                                                                       for p in r["budget_sweep"]},
                                                "tree_stats": r["tree_stats"],
                                                "graph_decoder": r["graph_decoder"],
                                                "graph_prefill": r["graph_prefill"],
                                                "engine_counts": r["engine_counts"],
                                                "policies": {k: v for k, v in (r.get("policies") or {}).items()
                                                             if k != "summary"}} for r in results}}
    with open(path, "w") as f:
        json.dump(record, f, indent=2, default=str)
        f.write("\n")
    return path, record, metrics


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=wc.list_workloads(), choices=wc.list_workloads())
    p.add_argument("--scale", default="small", choices=["small", "full"],
                   help="small: the tiny model (CPU); full: a ~1.7 B Qwen3-Next-shaped model (GPU)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--out", default=RESULTS, help="folder for the JSON, md and PNGs")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override a workload param in every selected workload (e.g. clients=2 rounds=2)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 on the shared 2-core machines)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--decode-batch", action="store_true",
                   help="every configuration decodes its running requests in one batched forward per step")
    p.add_argument("--decode-graphs", action="store_true",
                   help="every configuration decodes through the static-buffer graph decoder (CUDA graphs on a GPU)")
    p.add_argument("--prefill-graphs", action="store_true",
                   help="every configuration runs the gated-delta chunk rule of its prefill forwards through CUDA "
                        "graphs (EngineConfig.prefill_graphs; checked against eager calls first)")
    p.add_argument("--configs", nargs="*", default=list(wc.CONFIGS), choices=wc.CONFIGS,
                   help="run only these configurations (the (4)-vs-(1) ratios need both; hit rate vs (2) needs it; "
                        "none: only the --eviction-policies runs)")
    p.add_argument("--eviction-policies", nargs="+", default=[], choices=EVICTION_POLICIES, metavar="P",
                   help="also run each of --policy-configs once per eviction policy (CacheConfig.eviction_policy, "
                        "with its admission: policy_cache), same budgets, interleaved in every repeat: metrics "
                        "<workload>_<config>_<policy>_* and throughput_<policy>_vs_lru, "
                        "ttft_p50_speedup_<policy>_vs_lru (give lru among them)")
    p.add_argument("--policy-configs", nargs="+", default=["int8_t1_t2"], choices=wc.CONFIGS[1:],
                   help="the configurations of the --eviction-policies runs (the first is the headline)")
    p.add_argument("--policy-gpu-budgets", nargs="+", type=float, default=[], metavar="MIB",
                   help="also run the --eviction-policies runs at each of these GPU budgets (MiB, split as at the "
                        "file's, the host budget kept), warmed and rotated with the others: metrics "
                        "<workload>_gpu<MIB>_<config>_<policy>_*, ratios gpu<MIB>_throughput_<policy>_vs_lru etc.")
    p.add_argument("--rates", nargs="*", type=float, default=[], metavar="R",
                   help="also run each workload at these arrival rates (requests/s; 0: no gaps), with "
                        "--sweep-configs: TTFT and throughput against load (metrics <workload>_rate<R>_*)")
    p.add_argument("--sweep-configs", nargs="+", default=["no_cache", "int8_t1_t2"], choices=wc.CONFIGS,
                   help="the configurations of the --rates runs")
    p.add_argument("--repeats", type=int, default=3,
                   help="run every configuration this many times, interleaved; each ratio is the median with "
                        "_min / _max (default 3: the headline). Repeat r starts at the (r mod n)-th of the n "
                        "timed runs (the configurations, then the policy runs): with >= 2 repeats no run is first "
                        "in every repeat (with 1, the order is fixed: the policies' in the given order)")
    p.add_argument("--no-warm-each", dest="warm_each", action="store_false",
                   help="skip the warm pass: by default every timed run (each --configs entry and each "
                        "--eviction-policies run) first serves the same requests once, untimed, on a fresh engine, "
                        "so that no timed run pays first-call costs (compiles, autotuning at its own shapes, "
                        "pinned allocations) that another was spared. Halves the run time; order effects then "
                        "remain (only a warm-up through (4) runs first)")
    p.add_argument("--answers", nargs="+", type=int, default=None, metavar="N",
                   help="run each workload with answers of these lengths instead of its file's (e.g. 64 8 256: the "
                        "first is the headline; 8 is labelled the prefill-node case); results <workload>_ans<N>_*")
    p.add_argument("--gpu-mib", type=float, default=None, help="the GPU budget (MiB) instead of the file's")
    p.add_argument("--host-mib", type=float, default=None, help="the host budget (MiB) of (2b) and (4) instead of "
                                                                 "the file's")
    p.add_argument("--max-running", type=int, default=None, metavar="N",
                   help="requests the engine runs at once (decoded in one batch) instead of the file's max_running, "
                        "in every configuration alike; T0 reserves a state slot and the longest request's KV pages "
                        "for each (workload_common.split_budget), so the GPU budget must cover N of them")
    p.add_argument("--gpu-budgets", nargs="*", type=float, default=[], metavar="MIB",
                   help="also run each workload at these GPU budgets (MiB, split as at the file's budget) with "
                        "--budget-configs (metrics <workload>_gpu<MIB>_*; (1) needs no pools: the main run's)")
    p.add_argument("--budget-configs", nargs="+", default=["gpu_only", "gpu_only_host", "int8_t1", "int8_t1_t2"],
                   choices=wc.CONFIGS, help="the configurations of the --gpu-budgets runs")
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="replay a Mooncake-format trace (benchmarks/traces.py) instead of the workloads' clients, "
                        "with the first --workloads entry's model, engine and budgets")
    p.add_argument("--trace-limit", type=int, default=64, help="replay N requests (from --trace-start on)")
    p.add_argument("--trace-start", type=int, default=0,
                   help="skip the (sampled) trace's first S requests: a window, its cache empty at its start "
                        "(prefixes first seen before it are misses)")
    p.add_argument("--trace-sample", type=float, default=1.0,
                   help="replay this share of the trace's conversations, each whole (seeded; 1: all): their turns "
                        "come closer, the other conversations' traffic between them is gone")
    p.add_argument("--trace-block", type=int, default=32,
                   help="tokens per 512-token block of the trace (its prefix sharing kept, lengths scaled)")
    p.add_argument("--trace-max-blocks", type=int, default=16, help="most blocks of one prompt (the rest cut)")
    p.add_argument("--trace-max-answer", type=int, default=64, help="answers capped at this many tokens")
    p.add_argument("--trace-rate", type=float, default=0.0,
                   help="arrivals scaled to this many requests/s (0: --trace-load x (1)'s measured capacity)")
    p.add_argument("--trace-load", type=float, default=1.0,
                   help="with --trace-rate 0: the arrival rate as a multiple of (1)'s capacity (its throughput "
                        "on the trace's first requests sent at once)")
    p.add_argument("--admission", default="chunk", choices=["chunk", "leaf_branch", "block"],
                   help="the tree's state admission in every cached configuration (CacheConfig.state_admission): "
                        "every offered state, the leaf and branch points, or those and every --admission-block "
                        "tokens (the engine then offers a state at each block boundary)")
    p.add_argument("--admission-block", type=int, default=None,
                   help="tokens between kept states for --admission block (default with --trace: --trace-block)")
    p.add_argument("--tag", default=None,
                   help="results named workload-<tag>-<device> (default: workload-<device>; 'mooncake' with --trace)")
    p.add_argument("--phase-timing", action="store_true",
                   help="EngineConfig.phase_timing: seconds per engine phase (syncs the device at each boundary, "
                        "so the run is slower; a development aid)")
    p.add_argument("--timeline", default=None, metavar="DIR",
                   help="write every step and turn of each configuration to DIR/timeline-<workload>-<config>.json "
                        "(where the time goes, without the syncs of --phase-timing)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a cProfile report per configuration to DIR (timings then include its overhead)")
    p.add_argument("--check-fla", action="store_true",
                   help="only check that Qwen3-Next runs through flash-linear-attention here (exit status 0/1)")
    args = p.parse_args(argv)
    if any(not r >= 0 for r in args.rates):  # NaN fails too
        p.error(f"--rates: arrival rates >= 0 (requests/s; 0: no gaps), got {args.rates}")
    if args.repeats < 1:
        p.error(f"--repeats: an int >= 1, got {args.repeats}")
    if not args.configs and not args.eviction_policies:
        p.error("--configs: at least one configuration (or --eviction-policies)")
    if args.eviction_policies and "lru" not in args.eviction_policies:
        p.error(f"--eviction-policies: include lru (every ratio is against it), got {args.eviction_policies}")
    if args.answers and any(a < 1 for a in args.answers):
        p.error(f"--answers: lengths >= 1, got {args.answers}")
    if any(not b > 0 for b in args.gpu_budgets):
        p.error(f"--gpu-budgets: MiB > 0, got {args.gpu_budgets}")
    if args.policy_gpu_budgets and not args.eviction_policies:
        p.error("--policy-gpu-budgets: only with --eviction-policies (it runs them at other budgets)")
    if any(not b > 0 for b in args.policy_gpu_budgets):
        p.error(f"--policy-gpu-budgets: MiB > 0, got {args.policy_gpu_budgets}")
    if any(v is not None and not v > 0 for v in (args.gpu_mib, args.host_mib)):
        p.error(f"--gpu-mib / --host-mib: MiB > 0, got {args.gpu_mib} / {args.host_mib}")
    if args.max_running is not None and args.max_running < 1:
        p.error(f"--max-running: at least 1, got {args.max_running}")
    if args.trace_start < 0 or args.trace_limit < 1 or not 0.0 < args.trace_sample <= 1.0:
        p.error(f"--trace-start >= 0, --trace-limit >= 1, --trace-sample in (0, 1] expected, got {args.trace_start}, "
                f"{args.trace_limit}, {args.trace_sample}")
    if args.trace and args.answers:
        p.error("--answers: the trace gives the answer lengths (capped by --trace-max-answer)")
    if args.admission_block is not None and args.admission_block < 1:
        p.error(f"--admission-block: tokens >= 1, got {args.admission_block}")
    if args.admission_block is not None and args.admission != "block":
        p.error(f"--admission-block: only with --admission block, got --admission {args.admission}")
    if args.admission == "block" and admission_block(args) is None:
        p.error("--admission block: give --admission-block (tokens; with --trace: the trace's block by default)")
    if args.trace and args.tag is None:
        args.tag = "mooncake"
    args.set = dict(kv.split("=", 1) for kv in args.set)
    return args


def admission_block(args: argparse.Namespace) -> Optional[int]:
    """Tokens between kept states under ``--admission block`` (``--admission-block``, or the trace's block)."""
    if args.admission != "block":
        return None
    return args.admission_block if args.admission_block is not None else (args.trace_block if args.trace else None)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    device = dev.resolve(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    if args.check_fla:
        raise SystemExit(check_fla(device))
    t_start = time.perf_counter()
    env = fla_status()
    print(f"bench_workload on {dev.device_name(device)} ({args.scale}); flash-linear-attention importable: "
          f"{env['fla_importable']}")
    models: dict = {}
    results = []
    runs = ([(args.workloads[0], None)] if args.trace
            else [(n, a) for n in args.workloads for a in args.answers or [None]])
    for name, answer in runs:
        res = run_workload(name, args, device, models, answer,
                           on_repeat=lambda part: save(results + [part], models, env, args, t_start))
        results.append(res)
        name = res["name"]
        os.makedirs(args.out, exist_ok=True)
        chart(os.path.join(args.out, f"workload-{name}-{device_tag()}.png"), res)
        if res["sweep"]:
            chart_sweep(os.path.join(args.out, f"workload-{name}-rates-{device_tag()}.png"), res)
            for p in res["sweep"]:
                r = p["ratios"]
                line = ", ".join(f"{wc.LABELS[c].split(' ', 1)[0]} TTFT p50 (r>=3) "
                                 f"{1000 * (s['ttft_p50_round3plus_s'] or 0):.0f} ms, "
                                 f"{s['requests_per_s_round3plus']:.2f} req/s" for c, s in p["summary"].items())
                extra = (f"; (4) vs (1) TTFT {r['ttft_p50_round3plus_speedup_vs_nocache']:.2f}x, throughput "
                         f"{r['throughput_round3plus_vs_nocache']:.2f}x"
                         if r.get("ttft_p50_round3plus_speedup_vs_nocache") and
                         r.get("throughput_round3plus_vs_nocache") else "")
                print(f"   @ {p['rate']:g}/s: {line}{extra}")
        for c, s in res["summary"].items():
            print(f"   {wc.LABELS[c]:>24}: hit {s['hit_rate']:.3f} (T0 {s['hit_rate_t0']:.3f}, "
                  f"T2 {s['hit_rate_t2']:.3f}), "
                  f"TTFT p50 {1000 * (s['ttft_p50_s'] or 0):.1f} ms p90 {1000 * (s['ttft_p90_s'] or 0):.1f} ms, "
                  f"{s['requests_per_s']:.2f} req/s, PCIe {s['pcie_bytes'] / 2**20:.1f} MiB, "
                  f"argmax agree {_fmt3(s['argmax_agreement_vs_nocache'])}")
            phases = sorted(((k[6:-2], v) for k, v in s.items() if k.startswith("phase_")), key=lambda kv: -kv[1])
            if phases:
                print(f"   {'':>24}  phases (s, of {s['wall_s']:.1f} s): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in phases))
        rt = res["ratios"]
        r = {k: ("refused" if k in rt.get("invalid", []) else "n/a" if v is None else f"{v:.2f}x")
             for k, v in rt.items() if k in RATIOS}
        if {"ttft_p50_speedup_vs_nocache", "throughput_vs_nocache"} <= set(r):
            spread = (f" [{rt['throughput_vs_nocache_min']:.2f}-{rt['throughput_vs_nocache_max']:.2f}]"
                      if "throughput_vs_nocache_min" in rt else "")
            print(f"   (4) vs (1): TTFT p50 {r['ttft_p50_speedup_vs_nocache']} (rounds >= 3: "
                  f"{r['ttft_p50_round3plus_speedup_vs_nocache']}), throughput (whole run) {r['throughput_vs_nocache']}"
                  f"{spread} (rounds >= 3: {r['throughput_round3plus_vs_nocache']}); (4) vs (2) hit rate "
                  f"{r.get('hit_rate_vs_gpu_only', 'not run')}"
                  + (f" (undefined: (2) reused nothing; (4) {rt['hit_rate_int8_t1_t2']:.3f})"
                     if r.get("hit_rate_vs_gpu_only") == "n/a" else ""))
        if "throughput_vs_2b" in r:
            print(f"   (4) vs (2b): throughput {r['throughput_vs_2b']} (rounds >= 3: "
                  f"{r['throughput_round3plus_vs_2b']}), "
                  f"TTFT p50 {r['ttft_p50_speedup_vs_2b']}, hit rate {r['hit_rate_vs_2b']} ((2b) reuses "
                  f"{rt['hit_rate_2b']:.3f}); (2b) vs (1) throughput {r.get('throughput_2b_vs_nocache', 'n/a')}")
        for c in (res.get("policies") or {}).get("configs", []):
            for pol in res["policies"]["policies"]:
                if pol != "lru":
                    got = {k: rt.get(f"{c}_{k}_{pol}_vs_lru") for k in ("throughput", "ttft_p50_speedup", "hit_rate")}
                    print(f"   {wc.LABELS[c]} [{pol}] vs [lru]: " + ", ".join(
                        f"{k} {'n/a' if v is None else f'{v:.2f}x'}" for k, v in got.items()))
        for p in res["budget_sweep"]:
            pr = p["ratios"]
            print(f"   @ GPU {p['gpu_mib']:g} MiB: " + ", ".join(
                f"{wc.LABELS[c].split(' ', 1)[0]} hit {q['hit_rate']:.3f} {q['requests_per_s']:.2f} req/s"
                for c, q in p["summary"].items() if c != "no_cache")
                + (f"; (4) vs (2b) throughput {pr['throughput_vs_2b']:.2f}x" if pr.get("throughput_vs_2b") else ""))
        path, record, metrics = save(results, models, env, args, t_start)
    print(f"\nwrote {path} (+ .md, {len(results)} charts) in {metrics['total_s']:.1f} s")
    return record


if __name__ == "__main__":
    main()
