"""One tensor-parallel rank of ``test_sglang_tp.py``: the backend built by SGLang's own registry over this
rank's SGLang pools (its share of the KV and state heads), agreeing with the other ranks over a gloo group
standing in for SGLang's ``GroupCoordinator.cpu_group``.

Every rank runs the same scheduler calls in the same order, as SGLang's ranks do: two turns of a
conversation, then everything evicted to T2; a host hit whose copy is damaged on one rank only (rank
``bad``); then the same host hit again, intact. What each rank saw (what ``init_load_back`` reported, the
canonical dump of its tree, its counters) goes to ``out/<rank>.json`` for the test to compare.
"""

from __future__ import annotations

import json
import os
import sys
import types
from array import array


def main(rank: int, size: int, tmp: str, bad: int) -> None:
    sys.path.insert(0, os.getcwd())
    import pytest
    import torch.distributed as dist

    import tests.integrations.sglang.conftest  # noqa: F401  (the stand-ins, before SGLang imports)

    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=size)
    from sglang.srt.mem_cache import base_prefix_cache as B

    from tests.support import sglang_util as u
    from tiered_cache.parallel import tree_dump
    from tiered_cache.radix import EvictParams
    out: dict = {"rank": rank}
    with pytest.MonkeyPatch.context() as mp:
        rows, alloc, kv_pool = u._pools("mamba2", rank=rank, tp=size)
        ctx_kw = dict(tp_size=size, tp_rank=rank, tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD))
        mp.setattr(u, "_ctx", _with(u._ctx, ctx_kw))
        backend = u._build(mp, rows, alloc, {"t1_states": 6, "codec": "lossless", "host_kv_pages": 32,
                                             "host_states": 6})
        tree = backend.stack.tree
        a = [100 + i for i in range(48)]
        out["resumed"] = [u._serve(backend, rows, alloc, kv_pool, "t0", a),
                          u._serve(backend, rows, alloc, kv_pool, "t1", a + [300 + i for i in range(16)])]
        for _ in range(3):  # the write-through backups land (every rank polls alike: one vote each)
            backend.check_hicache_events()
        backend.evict(B.EvictParams(num_tokens=u.TOKENS))
        tree.evict(EvictParams(mamba_num=8))
        out["dumps"] = [repr(tree_dump(tree))]
        loads = []
        for attempt in ("damaged", "intact"):
            toks = a + [7] * 16
            params = u.sampling_params.SamplingParams(max_new_tokens=1)
            req = u.schedule_batch.Req(attempt, "", array("q", toks), params)
            req.init_next_round_input(backend)
            best = req.best_match_node
            if attempt == "damaged" and rank == bad:
                backend.stack.host.region("full").slot(best.host_kv[-1])[5] ^= 0xFF
            n, node = backend.init_load_back(B.InitLoadBackParams(best, req.host_hit_length, req=req))
            loads.append([req.host_hit_length, n])
            if n:
                req.prefix_len, req.last_node, req.kv.cache_protected_len = n, node, 0
                ids = backend.path_device_indices(node)
                mp.setattr(backend, "prefix_device_indices", lambda r, ids=ids: ids)
                u._check_prefix(backend, kv_pool, rows.mamba_pool.mamba_cache, req, toks)  # this rank's share
            if req.kv.mamba_pool_idx is not None:
                rows.mamba_allocator.free(req.kv.mamba_pool_idx.reshape(1))
            out["dumps"].append(repr(tree_dump(tree)))
        out["loads"] = loads
        out["tree"] = {k: v for k, v in tree.stats.items() if v}
        out["agreement"] = dict(getattr(tree.agreement, "stats", {}) or {})
        backend.check_invariants()
        backend.close()
    with open(os.path.join(tmp, f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _with(ctx_fn, extra: dict):
    """``sglang_util._ctx`` with the TP fields of this rank."""
    def ctx(rows, alloc, **kw):
        return ctx_fn(rows, alloc, **{**extra, **kw})
    return ctx
