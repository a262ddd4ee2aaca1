"""Command line (also installed as ``tiered-cache``):

``python -m tiered_cache stress``: the main job, a multi-turn workload through the reference engine,
with the tiered cache and without, side by side (``tiered_cache/engine/stress.py``).
``python -m tiered_cache demo``: a short tour of the T0 unified pool.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Optional

import torch

from tiered_cache import device as dev
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.tiers.unified_pool import UnifiedPool


def _alloc(side, n: int) -> torch.Tensor:
    """``side.alloc(n)``: the demo's pool is sized for everything the tour takes, so no room is a bug."""
    ids = side.alloc(n)
    if ids is None:
        raise RuntimeError(f"the demo pool has no room for {n} on side {side.name!r}")
    return ids


def demo(args: argparse.Namespace) -> int:
    """A short tour of T0: one buffer, full KV pages growing up, recurrent states growing down."""
    device = dev.resolve(args.device)
    kv = KVSpec(num_layers=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    # Qwen3-Next-shaped state, scaled down: [H, d_k, d_v] as transformers keeps it (value axis last).
    st = StateSpec(num_layers=12, temporal_shape=(4, 64, 64), temporal_dtype=torch.float32,
                   conv_shapes=((768, 3),), conv_dtype=torch.bfloat16, value_axis=2)
    pool = UnifiedPool(kv, st, low_slots=args.pages, high_slots=args.states, page_size=args.page_size,
                       device=device, lazy_compaction=args.lazy)
    full, mamba = pool.side("full"), pool.side("mamba")
    print(f"device: {dev.device_name(device)}")
    print(f"pool: {pool.total_bytes / 2**20:.2f} MiB; KV page {full.entry_bytes} B "
          f"({args.page_size} tokens), state {mamba.entry_bytes / 2**20:.2f} MiB")
    print(f"empty: full can take {full.available_size()} tokens, mamba {mamba.available_size()} states")

    t0 = time.perf_counter()
    states = [_alloc(mamba, 1) for _ in range(args.states)]
    views = mamba.temporal_view_all()
    for i, sid in enumerate(states):
        views[:, mamba.translate(sid)] = float(i + 1)  # each state filled with its own number
    print(f"{args.states} states allocated; full can now take {full.available_size()} tokens "
          f"(the states took the bytes from the high end)")
    for sid in states[::2]:
        mamba.free(sid)
    kept = states[1::2]
    print(f"freed every other state: {mamba.allocator.num_holes} holes, "
          f"{mamba.allocator.num_moves} slots moved by compaction so far; "
          f"full can schedule {full.schedulable_available_size()} tokens")
    pages = _alloc(full, full.schedulable_available_size())
    print(f"full took {pages.numel()} tokens; mamba slots moved in total: {mamba.allocator.num_moves}")
    ok = all(bool((mamba.temporal_view_all()[:, mamba.translate(sid)] == 2 * i + 2).all())
             for i, sid in enumerate(kept))
    pool.check_invariants()
    print(f"kept states read back intact through their new physical rows: {ok}")
    print(f"done in {time.perf_counter() - t0:.3f} s; {pool}")
    return 0 if ok else 1


def stress(args: argparse.Namespace) -> int:
    from tiered_cache.engine.stress import stress as run_stress  # needs the `engine` extra (transformers)

    return run_stress(args)


class _Parser(argparse.ArgumentParser):
    """A usage error is one line naming the flag (``tiered-cache stress: error: --clients: ...``), exit 2:
    argparse's own errors too, without the usage block above them."""

    def error(self, message: str):  # noqa: D401 - argparse's hook
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def _check_demo(args: argparse.Namespace) -> None:
    from tiered_cache.errors import UsageError
    from tiered_cache.validate import int_arg

    for flag, lo in (("--pages", 1), ("--states", 1), ("--page-size", 1)):
        try:
            int_arg(flag, getattr(args, flag[2:].replace("-", "_")), lo=lo)
        except InvalidArgumentError as e:
            raise UsageError(e.arg, e.expected, e.got) from None
    try:
        dev.resolve(args.device)
    except InvalidArgumentError as e:
        raise UsageError("--device", e.expected, e.got) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _Parser(prog="tiered-cache", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stress", help="the main job: a multi-turn workload, tiered cache vs no cache",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from tiered_cache.engine.stress import add_arguments  # argparse only: imports no transformers
    from tiered_cache.errors import UsageError

    add_arguments(p)
    p.set_defaults(func=stress)
    p = sub.add_parser("demo", help="a short tour of the unified T0 pool",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    p.add_argument("--pages", type=int, default=64, help="KV pages the pool is sized for")
    p.add_argument("--states", type=int, default=8, help="recurrent states the pool is sized for")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--lazy", action="store_true", help="lazy compaction (holes kept until needed)")
    p.set_defaults(func=demo, check=_check_demo)
    args = parser.parse_args(argv)
    try:
        if getattr(args, "check", None) is not None:
            args.check(args)
        return args.func(args)
    except UsageError as e:  # raised before any work: the flag, what it takes and what was given
        print(f"tiered-cache {args.command}: error: {e}", file=sys.stderr)
        return 2
