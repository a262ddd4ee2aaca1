"""The main job: ``python -m tiered_cache stress`` (also ``tiered-cache stress``).

Runs a seeded multi-turn conversation workload through the reference engine twice in one process:
with the tiered cache (T0 unified pool, T1 checkpoint pool, T2 host mirror) and without any cache,
then prints hits per tier, tokens computed and reused, bytes moved per tier and time to first token,
side by side, and writes ``report.json`` and ``report.png`` into ``--out``. The defaults (a tiny
Qwen3-Next, 16 clients x 4 rounds, tier budgets small enough that states and KV move between every
tier) finish in well under 2 minutes on a 2-core CPU; flags scale it up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from typing import Any, Optional

import torch

from tiered_cache import device as dev


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--device", default="auto", help="auto (the GPU when there is one) | cpu | cuda[:N]")
    g.add_argument("--model", default="qwen3-next-long", choices=["qwen3-next", "qwen3-next-long"],
                   help="tiny Qwen3-Next with random weights; -long: the long-memory variant (states matter)")
    g.add_argument("--hidden", type=int, default=64, help="hidden size (model size)")
    g.add_argument("--layers", type=int, default=8, help="layers (every 4th is full attention)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    g.add_argument("--seed", type=int, default=0, help="model weights and workload")
    g.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (the tiny model gains nothing from more; on 2 shared cores "
                        "2 threads made a forward 3-10x slower)")
    g = p.add_argument_group("workload")
    g.add_argument("--clients", type=int, default=16)
    g.add_argument("--rounds", type=int, default=4)
    g.add_argument("--question-len", type=int, default=32, help="tokens of each new question")
    g.add_argument("--system-len", type=int, default=64, help="tokens of the system prompt")
    g.add_argument("--no-shared-system", action="store_true", help="a different system prompt per client")
    g.add_argument("--max-new-tokens", type=int, default=32, help="answer length")
    g.add_argument("--abort-prob", type=float, default=0.0,
                   help="per step, abort a request in prefill with this probability (it is sent again)")
    g = p.add_argument_group("engine and tiers")
    g.add_argument("--page-size", type=int, default=16)
    g.add_argument("--chunk-size", type=int, default=32, help="prefill chunk (a multiple of --page-size)")
    g.add_argument("--max-running", type=int, default=8, help="requests admitted at once")
    g.add_argument("--decode-batch", action="store_true",
                   help="decode the running requests in one batched forward per step (both runs)")
    g.add_argument("--decode-graphs", action="store_true",
                   help="decode through static buffers, replayed as CUDA graphs on a GPU (both runs)")
    g.add_argument("--prefill-graphs", action="store_true",
                   help="run the gated-delta chunk rule of prefill forwards on padded static buffers, replayed as "
                        "CUDA graphs on a GPU (both runs; EngineConfig.prefill_graphs)")
    g.add_argument("--kv-pages", type=int, default=176, help="T0: KV pages")
    g.add_argument("--t0-states", type=int, default=8, help="T0: state slots (>= --max-running)")
    g.add_argument("--t1-states", type=int, default=24, help="T1: checkpoint slots")
    g.add_argument("--codec", default="int8", choices=["int8", "lossless"], help="T1 codec")
    g.add_argument("--host-kv-pages", type=int, default=512, help="T2: KV pages (0 with --host-states 0: no T2)")
    g.add_argument("--host-states", type=int, default=64, help="T2: states")
    g.add_argument("--write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"])
    g.add_argument("--storage", default=None, metavar="URL",
                   help="T3 below T2: file:///dir, redis://host:port or redis-cluster://h:p,h:p (needs T2)")
    g.add_argument("--prefetch-policy", default="best_effort", choices=["best_effort", "wait_complete", "timeout"],
                   help="T3 -> T2 prefetch on a T2 miss")
    p.add_argument("--out", default="stress-out", help="folder for report.json and report.png")
    p.add_argument("--no-baseline", action="store_true", help="skip the no-cache run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _model(args: argparse.Namespace, device: torch.device):
    from tiered_cache.engine.models import tiny_qwen3_next

    dtype = getattr(torch, args.dtype)
    kw: dict[str, Any] = {}
    if (args.hidden, args.layers) != (64, 8):
        heads = max(2, args.hidden // 32)
        kw = dict(hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  linear_num_value_heads=heads, linear_num_key_heads=max(1, heads // 2))
    return tiny_qwen3_next(seed=args.seed, long_memory=args.model.endswith("-long"), dtype=dtype,
                           device=device, **kw)


def _run(model, cfg, wl, label: str, args: argparse.Namespace) -> dict:
    from tiered_cache.engine.scheduler import Engine
    from tiered_cache.engine.workload import run_workload

    engine = Engine(model, cfg)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=wl.clients * wl.rounds, desc=f"{label:>8}", unit="turn", leave=True)
    t0 = time.perf_counter()
    turns = run_workload(engine, wl, progress=(lambda t: bar.update(1)) if bar else None,
                         abort_prob=args.abort_prob, abort_seed=args.seed)
    dev.synchronize(engine.device)
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    stats = engine.stats_dict()
    if engine.cache is not None:
        engine.check_invariants()
        stats["tree"] = dict(engine.cache.stats) if hasattr(engine.cache, "stats") else {}
        after = engine.reset_cache()
        if after != engine.initial_free:
            raise AssertionError(f"pools not back to their initial free sets: {after} != {engine.initial_free}")
    engine.close()
    stats["wall_s"] = wall
    stats["ttft_by_round_s"] = [
        sum(t.summary["ttft_s"] for t in turns if t.round == r) / max(1, sum(1 for t in turns if t.round == r))
        for r in range(wl.rounds)]
    stats["outputs"] = {f"c{t.client}r{t.round}": t.output for t in turns}
    return stats


def _fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{1000 * x:.1f} ms"


def report_lines(cached: dict, base: Optional[dict]) -> list[str]:
    b = base or {}

    def g(d: dict, *path, default=None):
        for k in path:
            if not isinstance(d, dict) or k not in d:
                return default
            d = d[k]
        return d

    rows = [
        ("turns finished", g(cached, "requests", "finished"), g(b, "requests", "finished")),
        ("requests aborted (sent again)", g(cached, "requests", "aborted"), g(b, "requests", "aborted")),
        ("prompt tokens", g(cached, "tokens", "prompt"), g(b, "tokens", "prompt")),
        ("  computed", g(cached, "tokens", "computed"), g(b, "tokens", "computed")),
        ("  reused from the cache", g(cached, "tokens", "reused"), g(b, "tokens", "reused")),
        ("  reuse rate", f"{100 * g(cached, 'tokens', 'reuse_rate', default=0):.1f} %",
         f"{100 * g(b, 'tokens', 'reuse_rate', default=0):.1f} %" if base else "-"),
        ("hits: KV tokens on the device (T0)", g(cached, "hits", "T0_kv_tokens"), "-"),
        ("hits: KV tokens loaded back (T2)", g(cached, "hits", "T2_kv_tokens"), "-"),
        ("hits: states from T1", g(cached, "hits", "T1_states"), "-"),
        ("hits: states from T2", g(cached, "hits", "T2_states"), "-"),
        ("misses", g(cached, "hits", "misses"), g(b, "hits", "misses")),
        ("states checkpointed (inserted)", g(cached, "checkpoints", "inserted"), "-"),
        ("bytes T0 KV written / read", f"{_fmt_bytes(g(cached, 'bytes', 'T0_kv_written'))} / "
                                       f"{_fmt_bytes(g(cached, 'bytes', 'T0_kv_read'))}", "-"),
        ("bytes T0 states written / read", f"{_fmt_bytes(g(cached, 'bytes', 'T0_state_written'))} / "
                                           f"{_fmt_bytes(g(cached, 'bytes', 'T0_state_read'))}", "-"),
        ("bytes T1 stored / loaded", f"{_fmt_bytes(g(cached, 'bytes', 'T1_stored'))} / "
                                     f"{_fmt_bytes(g(cached, 'bytes', 'T1_loaded'))}", "-"),
        ("bytes T2 D2H / H2D", f"{_fmt_bytes(g(cached, 'bytes', 'T2_d2h'))} / "
                               f"{_fmt_bytes(g(cached, 'bytes', 'T2_h2d'))}", "-"),
        ("T2 checksum failures", g(cached, "hits", "T2_checksum_failures", default="-"), "-"),
        ("TTFT p50", _ms(g(cached, "ttft_s", "p50")), _ms(g(b, "ttft_s", "p50"))),
        ("TTFT p90", _ms(g(cached, "ttft_s", "p90")), _ms(g(b, "ttft_s", "p90"))),
        ("TTFT from admission p50 (no queueing)", _ms(g(cached, "ttft_s", "from_admission_p50")),
         _ms(g(b, "ttft_s", "from_admission_p50"))),
        ("TTFT from admission p90", _ms(g(cached, "ttft_s", "from_admission_p90")),
         _ms(g(b, "ttft_s", "from_admission_p90"))),
        ("wall time", f"{g(cached, 'wall_s'):.1f} s", f"{g(b, 'wall_s'):.1f} s" if base else "-"),
    ]
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':<{w}}  {'tiered cache':>22}  {'no cache':>12}"]
    lines += [f"{name:<{w}}  {str(c if c is not None else '-'):>22}  {str(n if n is not None else '-'):>12}"
              for name, c, n in rows]
    return lines


def write_chart(path: str, cached: dict, base: Optional[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    rounds = range(1, len(cached["ttft_by_round_s"]) + 1)
    ax[0, 0].plot(rounds, [1000 * x for x in cached["ttft_by_round_s"]], "o-", label="tiered cache")
    if base:
        ax[0, 0].plot(rounds, [1000 * x for x in base["ttft_by_round_s"]], "s--", label="no cache")
    ax[0, 0].set(title="mean time to first token per round", xlabel="round", ylabel="ms", xticks=list(rounds))
    ax[0, 0].legend()
    runs = [("tiered cache", cached)] + ([("no cache", base)] if base else [])
    names = [n for n, _ in runs]
    comp = [r["tokens"]["computed"] for _, r in runs]
    reu = [r["tokens"]["reused"] for _, r in runs]
    ax[0, 1].bar(names, comp, label="computed")
    ax[0, 1].bar(names, reu, bottom=comp, label="reused")
    ax[0, 1].set(title="prompt tokens", ylabel="tokens")
    ax[0, 1].legend()
    h = cached["hits"]
    ax[1, 0].bar(["states T1", "states T2", "misses"], [h["T1_states"], h["T2_states"], h["misses"]],
                 color=["tab:green", "tab:orange", "tab:red"])
    ax[1, 0].set(title=f"where resumed states came from (KV tokens: T0 {h['T0_kv_tokens']}, "
                 f"T2 {h['T2_kv_tokens']})", ylabel="requests")
    by = cached["bytes"]
    keys = [k for k in ("T0_kv_written", "T0_state_written", "T1_stored", "T1_loaded", "T2_d2h", "T2_h2d")
            if k in by]
    ax[1, 1].barh(keys, [by[k] / 2**20 for k in keys])
    ax[1, 1].set(title="bytes moved per tier", xlabel="MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def stress(args: argparse.Namespace) -> int:
    from tiered_cache.engine.scheduler import HOST_TIER_AVAILABLE, EngineConfig
    from tiered_cache.engine.workload import WorkloadConfig

    if not HOST_TIER_AVAILABLE and args.host_kv_pages:
        print("note: this radix cache has no host tier (T2) yet: running on T0 + T1")
        args.host_kv_pages = args.host_states = 0
    device = dev.resolve(args.device)
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    wl = WorkloadConfig(clients=args.clients, rounds=args.rounds, question_len=args.question_len,
                        system_len=args.system_len, shared_system=not args.no_shared_system,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
    common = dict(page_size=args.page_size, chunk_size=args.chunk_size, prefill_budget=max(256, args.chunk_size),
                  max_running=args.max_running, decode_batch=args.decode_batch,
                  decode_graphs=args.decode_graphs, prefill_graphs=args.prefill_graphs)
    cached_cfg = EngineConfig(use_cache=True, kv_pages=args.kv_pages, t0_states=args.t0_states,
                              t1_states=args.t1_states, codec=args.codec, host_kv_pages=args.host_kv_pages,
                              host_states=args.host_states, write_policy=args.write_policy,
                              storage_url=args.storage, prefetch_policy=args.prefetch_policy, **common)
    base_cfg = EngineConfig(use_cache=False, **common)
    t_start = time.perf_counter()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its "falling back to the torch implementation" notes, on the CPU
    model = _model(args, device)
    print(f"tiered-cache stress on {dev.device_name(device)}: {args.model} (hidden {args.hidden}, "
          f"{args.layers} layers, {args.dtype}); {wl.clients} clients x {wl.rounds} rounds, question "
          f"{wl.question_len}, system {wl.system_len}{' shared' if wl.shared_system else ''}, answer "
          f"{wl.max_new_tokens} tokens")
    print(f"tiers: T0 {args.kv_pages} KV pages of {args.page_size} tokens + {args.t0_states} states; "
          f"T1 {args.t1_states} states ({args.codec}); T2 {args.host_kv_pages} KV pages + {args.host_states} "
          f"states ({args.write_policy})")
    # Warm up (first-call costs of the model and the kernels) so neither run pays them in its TTFT.
    _run(model, dataclasses.replace(cached_cfg, max_running=1, storage_url=None),
         WorkloadConfig(clients=1, rounds=2, question_len=8, system_len=8, max_new_tokens=2),
         "warm-up", argparse.Namespace(**dict(vars(args), no_progress=True, abort_prob=0.0)))
    cached = _run(model, cached_cfg, wl, "cached", args)
    base = None if args.no_baseline else _run(model, base_cfg, wl, "no cache", args)
    same = None
    if base is not None:
        same = sum(cached["outputs"][k] == base["outputs"][k] for k in cached["outputs"])
    print()
    for line in report_lines(cached, base):
        print(line)
    if same is not None:
        print(f"identical answers (cached vs no cache): {same} / {len(cached['outputs'])} turns"
              + ("" if args.codec == "lossless" else " (int8 states: near-ties may flip)"))
    os.makedirs(args.out, exist_ok=True)
    out = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "device": dev.device_name(device),
           "host": platform.node(), "torch": torch.__version__, "cached": cached, "no_cache": base,
           "identical_answers": same, "total_s": time.perf_counter() - t_start}
    jpath, ppath = os.path.join(args.out, "report.json"), os.path.join(args.out, "report.png")
    with open(jpath, "w") as f:
        json.dump(out, f, indent=1, default=str)
    write_chart(ppath, cached, base)
    print(f"wrote {jpath} and {ppath} ({time.perf_counter() - t_start:.1f} s in all)")
    return 0
