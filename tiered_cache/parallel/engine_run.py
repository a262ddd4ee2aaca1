"""``python -m tiered_cache.parallel.engine_run --tp N``: the reference engine on N processes (gloo, CPU).

Each process is one tensor-parallel rank: it builds the same tiny Qwen3-Next (its KV and state heads
divide N), runs the seeded multi-turn workload through ``Engine(model, cfg, tp=group)`` (tiers holding
its share of the heads, trees agreeing each step) and rank 0 writes the answers. The same workload runs
first at TP 1 in this process; the run succeeds (exit 0) when every answer of the TP N run equals the
TP 1 one, token for token. The model's weights are not sharded: every rank computes the whole forward,
and a resume gathers the K/V and state shares of all ranks (``engine/adapters.py``), so equal tokens
mean every rank's cache served its share of the same prefix at the same step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, Optional

import torch


def model_and_config(args: dict) -> tuple[Any, Any, Any]:
    """The tiny model (4 KV heads, 4 state heads: TP 1, 2 and 4 divide them), the engine config, the workload."""
    from tiered_cache.config import CacheConfig
    from tiered_cache.engine.config import EngineConfig
    from tiered_cache.engine.models import tiny_qwen3_next
    from tiered_cache.engine.workload import WorkloadConfig

    model = tiny_qwen3_next(seed=args["seed"], long_memory=True, num_hidden_layers=4, num_key_value_heads=4,
                            device="cpu")
    cache = CacheConfig(page_size=4, kv_pages=args["kv_pages"], t0_states=3, t1_states=args["t1_states"],
                        host_kv_pages=args["host_kv_pages"], host_states=args["host_states"], codec=args["codec"],
                        storage_url=args.get("storage_url"), write_policy=args["write_policy"],
                        prefetch_policy=args["prefetch_policy"], backend="torch", check_memory=False)
    cfg = EngineConfig(cache=cache, chunk_size=8, prefill_budget=16, max_running=3)
    wl = WorkloadConfig(clients=args["clients"], rounds=args["rounds"], question_len=6, system_len=8,
                        max_new_tokens=args["max_new_tokens"], seed=args["seed"])
    return model, cfg, wl


def run_engine(args: dict, tp: Any = None, on_engine: Any = None, on_step: Any = None) -> list[list[int]]:
    """One rank's run (``tp`` None: TP 1): the answers in (client, round) order. ``on_engine(engine)``
    runs before the workload (fault injection), ``on_step(engine)`` after every step."""
    from tiered_cache.engine.scheduler import Engine
    from tiered_cache.engine.workload import run_workload

    torch.manual_seed(args["seed"])
    model, cfg, wl = model_and_config(args)
    engine = Engine(model, cfg, tp=tp)
    try:
        if on_engine is not None:
            on_engine(engine)
        turns = run_workload(engine, wl, abort_prob=args["abort_prob"], abort_seed=args["seed"],
                             on_step=None if on_step is None else (lambda: on_step(engine)))
        return [t.output for t in turns]
    finally:
        engine.close()


def _rank_main(rank: int, world: int, init_file: str, args: dict, out: str) -> None:
    import torch.distributed as dist

    from tiered_cache.parallel.group import TPGroup

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        group = TPGroup.from_distributed(check_digest=args["check_digest"])
        answers = run_engine(args, group)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(answers, f)
    finally:
        dist.destroy_process_group()


def run_tp(args: dict, tp: int) -> list[list[int]]:
    """The workload on ``tp`` spawned processes (gloo); rank 0's answers."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "answers.json")
        mp.spawn(_rank_main, args=(tp, os.path.join(tmp, "rdzv"), args, out), nprocs=tp, join=True)
        with open(out) as f:
            return json.load(f)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_cache.parallel.engine_run", description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2, choices=(1, 2, 4), help="tensor-parallel processes")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument("--codec", default="lossless", choices=("int8", "lossless"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-digest", action="store_true", help="compare the ranks' tree digests every step")
    a = p.parse_args(argv)
    args = dict(seed=a.seed, clients=a.clients, rounds=a.rounds, max_new_tokens=a.max_new_tokens, codec=a.codec,
                kv_pages=24, t1_states=4, host_kv_pages=48, host_states=8, write_policy="write_through",
                prefetch_policy="best_effort", abort_prob=0.0, check_digest=a.check_digest)
    ref = run_engine(args)
    got = ref if a.tp == 1 else run_tp(args, a.tp)
    same = sum(x == y for x, y in zip(ref, got))
    print(f"TP {a.tp}: {same}/{len(ref)} answers equal to TP 1's ({sum(len(x) for x in ref)} tokens)")
    return 0 if same == len(ref) and len(got) == len(ref) else 1


if __name__ == "__main__":
    sys.exit(main())
