"""The main job: ``python -m tiered_cache stress`` (also ``tiered-cache stress``).

Runs a seeded multi-turn conversation workload through the reference engine with the tiered cache
(T0 unified pool, T1 checkpoint pool, T2 host mirror, T3 storage with ``--storage``) and without any
cache, alternating the two ``--repeats`` times so both are timed alike (wall and CPU time, min /
median / max), then once more with the cache fed the no-cache answers (teacher forcing: the same
prompts for both). It prints hits per tier, tokens computed and reused, bytes moved, evictions per
tier and what limited reuse, TTFT, where the time went and how many answers agree, and writes
``report.json`` and ``report.png`` into ``--out``. Every flag is checked before the run starts (the
output folder created, a storage URL tried with one write and read): a bad one is a ``UsageError``
naming the flag. The report is in ``stress_report.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
import uuid
from typing import Any

import torch

from tiered_cache import device as dev
from tiered_cache.config import (
    CODECS,
    COST_MODELS,
    EVICTION_POLICIES,
    PREFETCH_POLICIES,
    STATE_ADMISSIONS,
    WRITE_POLICIES,
    CacheConfig,
)
from tiered_cache.errors import InvalidArgumentError, MemoryBudgetError, UsageError
from tiered_cache.validate import float_arg, int_arg

# EngineConfig / CacheConfig / WorkloadConfig fields whose flag is not the field's name with dashes.
_FLAG_OF = {"storage_url": "--storage", "prefill_budget": "--chunk-size", "shared_system": "--no-shared-system"}


def flag_of(field: str) -> str:
    """The flag for a config field (``kv_pages`` -> ``--kv-pages``; ``"a, b"`` -> ``"--a, --b"``)."""
    return ", ".join(_FLAG_OF.get(f, "--" + f.replace("_", "-")) for f in field.split(", "))


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--device", default="auto", help="auto (the GPU when there is one) | cpu | cuda[:N]")
    g.add_argument("--model", default="qwen3-next-long", choices=["qwen3-next", "qwen3-next-long"],
                   help="tiny Qwen3-Next with random weights; -long: the long-memory variant (states matter)")
    g.add_argument("--hidden", type=int, default=64, help="hidden size (model size), >= 8")
    g.add_argument("--layers", type=int, default=8, help="layers, >= 4 (every 4th is full attention)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="model and cache dtype")
    g.add_argument("--seed", type=int, default=0, help="model weights and workload")
    g.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch, 0: torch's default (the tiny model gains nothing from more; on "
                        "2 shared cores 2 threads made a forward 3-10x slower)")
    g = p.add_argument_group("workload")
    g.add_argument("--clients", type=int, default=16, help="conversations, all sending at once")
    g.add_argument("--rounds", type=int, default=4, help="turns per conversation")
    g.add_argument("--question-len", type=int, default=32, help="tokens of each new question")
    g.add_argument("--system-len", type=int, default=64, help="tokens of the system prompt")
    g.add_argument("--no-shared-system", action="store_true", help="a different system prompt per client")
    g.add_argument("--max-new-tokens", type=int, default=32, help="answer length")
    g.add_argument("--abort-prob", type=float, default=0.0,
                   help="per step, abort a request in prefill with this probability (it is sent again)")
    g = p.add_argument_group("engine and tiers")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    g.add_argument("--chunk-size", type=int, default=32, help="prefill chunk (a multiple of --page-size)")
    g.add_argument("--max-running", type=int, default=8, help="requests admitted at once")
    g.add_argument("--decode-batch", action=argparse.BooleanOptionalAction, default=True,
                   help="decode the running requests in one batched forward per step (both runs); "
                        "--no-decode-batch: one forward per request (3x slower here, and decode then dominates)")
    g.add_argument("--decode-graphs", action="store_true",
                   help="decode through static buffers, replayed as CUDA graphs on a GPU (both runs)")
    g.add_argument("--prefill-graphs", action="store_true",
                   help="run the gated-delta chunk rule of prefill forwards on padded static buffers, replayed as "
                        "CUDA graphs on a GPU (both runs; EngineConfig.prefill_graphs)")
    g.add_argument("--kv-pages", type=int, default=176, help="T0: KV pages")
    g.add_argument("--t0-states", type=int, default=8, help="T0: state slots (>= --max-running)")
    g.add_argument("--t1-states", type=int, default=24, help="T1: checkpoint slots")
    g.add_argument("--codec", default="int8", choices=CODECS, help="T1 codec")
    g.add_argument("--host-kv-pages", type=int, default=512, help="T2: KV pages (0 with --host-states 0: no T2)")
    g.add_argument("--host-states", type=int, default=64, help="T2: states")
    g.add_argument("--write-policy", default="write_through",
                   choices=WRITE_POLICIES,
                   help="when device KV is copied to T2")
    g.add_argument("--storage", default=None, metavar="URL",
                   help="T3 below T2: file:///dir, redis://host:port or redis-cluster://h:p,h:p (needs T2; tried "
                        "with one write and read before the run)")
    g.add_argument("--prefetch-policy", default="best_effort", choices=PREFETCH_POLICIES,
                   help="T3 -> T2 prefetch on a T2 miss")
    g.add_argument("--eviction-policy", default="lru", choices=EVICTION_POLICIES,
                   help="which cached node gives up a resource next (radix.policies: marconi, seglen, tiered)")
    g.add_argument("--cost-model", default="qwen3-next-80b", choices=COST_MODELS,
                   help="the geometry whose FLOPs the cost-aware policies count (tiered_cache.costs)")
    g.add_argument("--state-admission", default="chunk", choices=STATE_ADMISSIONS,
                   help="which offered states the tree keeps: every chunk end, leaf + branch points, or + blocks")
    g.add_argument("--admission-block", type=int, default=512, help="tokens between kept states for block")
    g = p.add_argument_group("runs")
    g.add_argument("--repeats", type=int, default=2,
                   help="cached and no-cache runs, alternated, each timed (wall and CPU: min / median / max)")
    g.add_argument("--no-forced", action="store_true",
                   help="skip the teacher-forced cached run (answer agreement on the same prompts)")
    g.add_argument("--no-baseline", action="store_true", help="skip the no-cache runs")
    g.add_argument("--out", default="stress-out", help="folder for report.json and report.png")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


# ------------------------------------------------------------------------------ checks
_INT_FLAGS = {"hidden": 8, "layers": 4, "seed": 0, "threads": 0, "clients": 1, "rounds": 1, "question_len": 1,
              "system_len": 0, "max_new_tokens": 1, "page_size": 1, "chunk_size": 1, "max_running": 1,
              "kv_pages": 1, "t0_states": 1, "t1_states": 1, "host_kv_pages": 0, "host_states": 0, "repeats": 1}


def check_args(args: argparse.Namespace) -> None:
    """Every flag that needs no model: numbers in range, the T0 budget holding the longest turn."""
    for name, lo in _INT_FLAGS.items():
        try:
            int_arg(flag_of(name), getattr(args, name), lo=lo)
        except InvalidArgumentError as e:
            raise UsageError(e.arg, e.expected, e.got) from None
    try:
        float_arg("--abort-prob", args.abort_prob, lo=0.0, hi=1.0)
        if args.abort_prob == 1.0:
            raise InvalidArgumentError("--abort-prob", "a probability in [0, 1)", args.abort_prob)
        dev.resolve(args.device)
    except InvalidArgumentError as e:
        raise UsageError(flag_of(e.arg.lstrip("-").replace("-", "_")), e.expected, e.got) from None
    if args.storage is not None and not args.storage.startswith(("file://", "redis://", "redis-cluster://")):
        raise UsageError("--storage", "a file:///dir, redis://host:port or redis-cluster://h:p,h:p URL",
                         args.storage)
    longest = args.system_len + args.rounds * (args.question_len + args.max_new_tokens)
    pages = -(-longest // args.page_size)
    if pages >= args.kv_pages:  # page 0 is the pool's reserved sink
        raise UsageError("--kv-pages", f"> {pages}: the last turn holds {longest} tokens in T0 at once",
                         args.kv_pages)


def configs(args: argparse.Namespace, device: torch.device):
    """The workload and the two engine configurations; their own checks' errors name the flags."""
    from tiered_cache.engine.config import EngineConfig
    from tiered_cache.engine.workload import WorkloadConfig

    try:
        wl = WorkloadConfig(clients=args.clients, rounds=args.rounds, question_len=args.question_len,
                            system_len=args.system_len, shared_system=not args.no_shared_system,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
        # Phase timing synchronizes the device at every phase boundary: free on the CPU (nothing to
        # wait for), a cost in overlap on a GPU, so it says where the time goes only on the CPU.
        common = dict(chunk_size=args.chunk_size, prefill_budget=max(256, args.chunk_size),
                      max_running=args.max_running, decode_batch=args.decode_batch,
                      decode_graphs=args.decode_graphs, prefill_graphs=args.prefill_graphs,
                      phase_timing=device.type == "cpu")
        tiers = CacheConfig(page_size=args.page_size, kv_pages=args.kv_pages, t0_states=args.t0_states,
                            t1_states=args.t1_states, codec=args.codec, host_kv_pages=args.host_kv_pages,
                            host_states=args.host_states, write_policy=args.write_policy, storage_url=args.storage,
                            prefetch_policy=args.prefetch_policy, eviction_policy=args.eviction_policy,
                            cost_model=args.cost_model, state_admission=args.state_admission,
                            admission_block=args.admission_block)
        cached = EngineConfig(use_cache=True, cache=tiers, **common)
        base = EngineConfig(use_cache=False, cache=CacheConfig(page_size=args.page_size), **common)
    except InvalidArgumentError as e:
        raise UsageError(flag_of(e.arg), e.expected, e.got) from None
    return wl, cached, base


def check_out(path: str) -> None:
    """Create ``--out`` and write into it now, so a bad folder fails before the run, not after it."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".probe-{uuid.uuid4().hex}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError("--out", "a folder that can be created and written", f"{path} ({e.strerror})") from None


def check_storage(url: str) -> None:
    """One write, read and delete through the backend ``url`` names, so an unreachable store fails now
    (the storage tier would turn every failure into a counted miss and the run would end in warnings)."""
    from tiered_cache.errors import StorageError
    from tiered_cache.storage import open_backend

    key = f"probe-{uuid.uuid4().hex}"
    try:
        backend = open_backend(url)
    except ImportError as e:
        raise UsageError("--storage", "a backend whose client is installed", f"{url} ({e})") from None
    except (InvalidArgumentError, StorageError) as e:
        raise UsageError("--storage", "a reachable store", f"{url} ({e})") from None
    try:
        backend.put_many([(key, [b"tiered-cache probe"])])
        got = backend.get_many([key])[0]
        backend.delete_many([key])
    except Exception as e:  # whatever the client raises: the store cannot serve the run
        raise UsageError("--storage", "a reachable store (one write and read back)", f"{url} ({e})") from None
    finally:
        backend.close()
    if isinstance(got, list):
        data = b"".join(bytes(x) for x in got)
    else:  # a WrongSize (a value of another size than written) reads as nothing
        data = bytes(got) if isinstance(got, (bytes, bytearray, memoryview)) else b""
    if data != b"tiered-cache probe":
        raise UsageError("--storage", "a store that reads back what was written", url)


# ------------------------------------------------------------------------------ runs
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


def _run(model, cfg, wl, label: str, args: argparse.Namespace, forced=None) -> tuple[dict, list]:
    from tiered_cache.engine.scheduler import Engine
    from tiered_cache.engine.workload import run_workload

    engine = Engine(model, cfg)
    bar = None
    if not args.no_progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=wl.clients * wl.rounds, desc=f"{label:>10}", unit="turn", leave=True)
    c0, t0 = time.process_time(), time.perf_counter()
    try:
        turns = run_workload(engine, wl, progress=(lambda t: bar.update(1)) if bar else None, forced=forced,
                             abort_prob=args.abort_prob, abort_seed=args.seed)
        dev.synchronize(engine.device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = engine.stats_dict()
        if engine.cache is not None:
            engine.check_invariants()
            stats["tree"] = dict(engine.cache.stats)
            after = engine.reset_cache()
            if after != engine.initial_free:
                raise AssertionError(f"pools not back to their initial free sets: {after} != {engine.initial_free}")
    finally:
        if bar is not None:
            bar.close()
        engine.close()
    stats["wall_s"], stats["cpu_s"] = wall, cpu
    stats["ttft_by_round_s"] = [
        sum(t.summary["ttft_s"] for t in turns if t.round == r) / max(1, sum(1 for t in turns if t.round == r))
        for r in range(wl.rounds)]
    stats["outputs"] = {f"c{t.client}r{t.round}": t.output for t in turns}
    return stats, turns


def stress(args: argparse.Namespace) -> int:
    from tiered_cache.engine import stress_report as rep
    from tiered_cache.engine.workload import WorkloadConfig

    t_start = time.perf_counter()
    check_args(args)
    device = dev.resolve(args.device)
    wl, cached_cfg, base_cfg = configs(args, device)
    check_out(args.out)
    if args.storage is not None:
        check_storage(args.storage)
    if device.type == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its "falling back to the torch implementation" notes, on the CPU
    model = _model(args, device)
    print(f"tiered-cache stress on {dev.device_name(device)}: {args.model} (hidden {args.hidden}, "
          f"{args.layers} layers, {args.dtype}); {wl.clients} clients x {wl.rounds} rounds, question "
          f"{wl.question_len}, system {wl.system_len}{' shared' if wl.shared_system else ''}, answer "
          f"{wl.max_new_tokens} tokens; decode {'batched' if args.decode_batch else 'one request at a time'}")
    print(f"tiers: T0 {args.kv_pages} KV pages of {args.page_size} tokens + {args.t0_states} states; "
          f"T1 {args.t1_states} states ({args.codec}); T2 {args.host_kv_pages} KV pages + {args.host_states} "
          f"states ({args.write_policy})" + (f"; T3 {args.storage} ({args.prefetch_policy})" if args.storage else ""))
    quiet = argparse.Namespace(**dict(vars(args), no_progress=True, abort_prob=0.0))
    # Warm up (first-call costs of the model and the kernels) so no run pays them; it also builds the
    # tiers once, so a budget that does not fit fails here, before the runs, naming the flags.
    try:
        _run(model, dataclasses.replace(cached_cfg, max_running=1,
                                        cache=dataclasses.replace(cached_cfg.cache, storage_url=None)),
             WorkloadConfig(clients=1, rounds=2, question_len=8, system_len=8, max_new_tokens=2), "warm-up", quiet)
    except MemoryBudgetError as e:
        raise UsageError("--kv-pages, --t0-states, --t1-states, --host-kv-pages, --host-states",
                         "tier budgets that fit this machine", str(e)) from None
    cached, base, cturns = [], [], None
    for i in range(args.repeats):  # alternated, so a change in the machine's load hits both alike
        tag = f" {i + 1}/{args.repeats}" if args.repeats > 1 else ""
        s, turns = _run(model, cached_cfg, wl, "cached" + tag, args)
        cached.append(s)
        cturns = cturns or turns
        if not args.no_baseline:
            base.append(_run(model, base_cfg, wl, "no cache" + tag, args)[0])
    for runs in (cached, base):
        if runs:
            runs[0]["wall"] = rep.spread([r["wall_s"] for r in runs])
            runs[0]["cpu"] = rep.spread([r["cpu_s"] for r in runs])
            runs[0]["repeats_same_outputs"] = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    free = forced = None
    if base:
        free = rep.agreement(cached[0]["outputs"], base[0]["outputs"], wl.rounds)
        if not args.no_forced:
            ref = {(int(k[1:].split("r")[0]), int(k.split("r")[1])): v for k, v in base[0]["outputs"].items()}
            fturns = _run(model, cached_cfg, wl, "forced", quiet, forced=ref)[1]
            forced = rep.forced_agreement(fturns, base[0]["outputs"], wl.rounds)
    reuse, reuse_info = rep.reuse_lines(cached[0], cturns or [], vars(args))
    print()
    lines = rep.report_lines(cached, base)
    lines += [""] + rep.timing_lines(cached[0], base[0] if base else None)
    lines += [""] + reuse
    if free is not None:
        lines += [""] + rep.agreement_lines(free, forced, args.codec)
    for line in lines:
        print(line)
    out = {"config": {k: v for k, v in vars(args).items() if k not in ("func", "check")},
           "device": dev.device_name(device), "host": platform.node(), "torch": torch.__version__, "cached": cached[0],
           "no_cache": base[0] if base else None,
           "repeats": {"cached": cached[1:], "no_cache": base[1:]}, "identical_answers": free and free["identical"],
           "agreement": {"free_running": free, "teacher_forced": forced}, "reuse": reuse_info, "report": lines,
           "total_s": time.perf_counter() - t_start}
    jpath, ppath = os.path.join(args.out, "report.json"), os.path.join(args.out, "report.png")
    with open(jpath, "w") as f:
        json.dump(out, f, indent=1, default=str)
    rep.write_chart(ppath, cached[0], base[0] if base else None)
    print(f"wrote {jpath} and {ppath} ({time.perf_counter() - t_start:.1f} s in all)")
    return 0
