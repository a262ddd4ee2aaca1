"""Tensor parallelism on CPU (gloo): every rank holds its heads' share, every rank makes the same decision.

``tp_worker.py`` runs in each spawned process: a seeded random sequence of requests and evictions over
T0/T1/T2/T3 with per-rank faults (a checksum that fails on one rank, a ticket one rank finishes late, a
T3 read one rank misses). The ranks' canonical dumps must be equal after every ``check_hicache_events``,
equal to a TP 1 twin suffering every rank's faults after every operation, invariants hold on each rank,
what a hit serves (the shares gathered) is TP 1's bytes, and nothing leaks after the drain. The faults
must have happened, and been overruled by the agreement, for the run to count.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.parallel import tp_worker
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.parallel import TPGroup


def _spawn(tmp_path, size: int, seed: int, n_ops: int, policy: str) -> list[dict]:
    out = str(tmp_path / "result.json")
    mp.spawn(tp_worker.main, args=(size, str(tmp_path), seed, n_ops, policy, out), nprocs=size, join=True)
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("size,seed", [(2, 0), (4, 1)])
def test_ranks_agree_under_faults(tmp_path, size, seed):
    # wait_complete: a T3 hit is served by the match that asked for it (the agreement inside its wait)
    res = _spawn(tmp_path, size, seed, n_ops=36 if size == 2 else 24, policy="wait_complete")
    r0 = res[0]
    assert all(r["outcome"] == r0["outcome"] and r["tree"] == r0["tree"] for r in res), "ranks counted apart"
    faults = {k: sum(r["faults"].get(k, 0) for r in res) for k in ("checksum", "late", "storage")}
    assert faults == {k: r0["twin_faults"].get(k, 0) for k in faults}, "the twin did not suffer every fault"
    assert all(faults.values()), f"a kind of fault never happened: {faults}"
    # the faults were one rank's, and every rank acted on them
    assert r0["tree"].get("corrupt_host_kv_dropped", 0) + r0["tree"].get("corrupt_host_state_dropped", 0) > 0
    assert sum(r["agreement"].get("overruled_checksums", 0) for r in res) > 0
    assert r0["tree"].get("t3_hits", 0) > 0 and r0["tree"].get("t3_miss", 0) > 0
    assert sum(r["agreement"].get("overruled_storage_hits", 0) for r in res) > 0
    assert r0["outcome"].get("hit", 0) > 0 and r0["outcome"].get("load_failed", 0) > 0
    # one reduction per check_hicache_events (a few more where the tree waits in place), each counted
    assert all(r["collectives"] == r["agreement"]["rounds"] for r in res)


def test_tp1_costs_no_collective():
    from tiered_cache import CacheConfig, TieredCache

    g = TPGroup.single()
    cfg = CacheConfig(page_size=4, kv_pages=8, t0_states=2, t1_states=2, host_kv_pages=8, host_states=2,
                      backend="torch", check_memory=False)
    with TieredCache.build(cfg, kv=tp_worker.KV, state=tp_worker.STATE, device="cpu", tp=g) as c:
        assert c.tree.agreement is None and c.tree.host_tier.agree is None and c.tree.rule.flags.agree is None
        assert c.kv.spec == tp_worker.KV  # whole heads
        c.tree.check_hicache_events()
    assert g.all_min([3, 1]) == [3, 1] and g.collectives == 0
    x = torch.randn(2, 3, 4)
    assert g.split(x, 2) is x or torch.equal(g.split(x, 2), x)
    assert g.gather(x, 1) is x


def test_shards_and_refusals():
    kv, st = tp_worker.KV, tp_worker.STATE
    assert kv.shard(2).kv_heads == 2 and kv.shard(2).bytes_per_slot(4) * 2 == kv.bytes_per_slot(4)
    s4 = st.shard(4)
    assert s4.temporal_shape == (1, 2, 4) and s4.conv_shapes == ((2, 4),) and s4.value_axis == st.value_axis
    assert s4.bytes_per_slot() * 4 == st.bytes_per_slot()
    with pytest.raises(InvalidArgumentError, match="tp: expected a divisor of kv_heads=4, got 3"):
        kv.shard(3)
    with pytest.raises(InvalidArgumentError, match=r"conv channels \(conv_shapes\[0\]\[0\]\)=8, got 16"):
        st.__class__(num_layers=1, temporal_shape=(16, 2, 2), conv_shapes=((8, 2),)).shard(16)
    with pytest.raises(InvalidArgumentError, match="rank"):
        TPGroup(2, 2)
    g = TPGroup(1, 2)
    x = torch.arange(12.0).view(3, 4)
    assert torch.equal(g.split(x, 1), x[:, 2:])
    with pytest.raises(InvalidArgumentError, match="divisible by tp=2"):
        g.split(torch.zeros(3, 3), 1)


@pytest.mark.slow  # two processes import transformers and run a tiny Qwen3-Next: about a minute on 2 cores
def test_engine_tp2_tokens_equal_tp1():
    """The reference engine at TP 2 (two processes, gloo) gives the TP 1 answers token for token; its
    resumes gather K/V and states from both ranks' shares (``parallel.engine_run``)."""
    pytest.importorskip("transformers")
    from tiered_cache.parallel import engine_run

    args = dict(seed=0, clients=2, rounds=2, max_new_tokens=4, codec="lossless", kv_pages=16, t1_states=3,
                host_kv_pages=32, host_states=6, write_policy="write_through", prefetch_policy="best_effort",
                abort_prob=0.0, check_digest=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ref = engine_run.run_engine(args)
    assert engine_run.run_tp(args, 2) == ref and sum(len(x) for x in ref) == 16
