"""T3 through the reference engine: restart warm start (file store), two processes sharing one Redis,
damaged stored values. Lossless codec, so every cached run must produce the no-cache run's tokens.

The radix cache prefetches with ``wait_complete`` here, so a restarted engine's very first match
already finds what T3 holds (``best_effort`` would only help later matches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from tests.support.storage_util import redis_server  # noqa: E402,F401  (fixture)
from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.engine.config import EngineConfig  # noqa: E402
from tiered_cache.engine.scheduler import Engine  # noqa: E402
from tiered_cache.engine.workload import WorkloadConfig, run_workload  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WL = WorkloadConfig(clients=2, rounds=2, question_len=12, system_len=24, max_new_tokens=8)
COMMON = dict(chunk_size=16, prefill_budget=64, max_running=2)
TIERS = dict(page_size=4, codec="lossless", kv_pages=48, t0_states=2, t1_states=6, host_kv_pages=200, host_states=40,
             prefetch_policy="wait_complete")


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def baseline(qwen_long):
    base = EngineConfig(use_cache=False, cache=CacheConfig(**TIERS), **COMMON)
    return [t.output for t in run_workload(Engine(qwen_long, base), WL)]


def run(model, url):
    e = Engine(model, EngineConfig(cache=CacheConfig(storage_url=url, **TIERS), **COMMON))
    try:
        outs = [t.output for t in run_workload(e, WL, on_step=e.check_invariants)]
        stats = e.stats_dict()
        assert e.reset_cache() == e.initial_free, "a slot, page or host slot was left behind"
    finally:
        e.close()
    return outs, stats["T3"]


def test_restart_warm_start_from_file_store(qwen_long, baseline, tmp_path):
    url = f"file://{tmp_path / 'store'}"
    outs, t3 = run(qwen_long, url)
    assert outs == baseline
    assert t3.get("hits", 0) == 0 and t3["kv_pages_written"] > 0 and t3["states_written"] > 0
    outs, t3 = run(qwen_long, url)  # a new engine, fresh pools, same directory
    assert outs == baseline
    assert t3["hits"] > 0 and t3["hit_tokens"] > 0 and t3["tier"]["hit"] > 0, t3


def test_damaged_values_are_misses(qwen_long, baseline, tmp_path):
    store = tmp_path / "store"
    url = f"file://{store}"
    outs, _ = run(qwen_long, url)
    assert outs == baseline
    files = sorted(p for p in store.rglob("*") if p.is_file())
    assert files
    for i, p in enumerate(files):
        b = bytearray(p.read_bytes())
        if i % 2:
            p.write_bytes(bytes(b[:len(b) // 2]))  # truncated
        else:
            b[-1] ^= 0xFF  # a flipped payload byte
            p.write_bytes(bytes(b))
    outs, t3 = run(qwen_long, url)
    assert outs == baseline
    assert t3.get("hits", 0) == 0
    bad = {k: v for k, v in t3["tier"].items() if k.startswith("bad_")}
    assert sum(bad.values()) > 0, t3


CHILD = """
import json, sys, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[2])
import test_storage_engine as t
from tiered_cache.engine import tiny_qwen3_next
m = tiny_qwen3_next(seed=0, long_memory=True, device="cpu")  # the qwen_long fixture's model
outs, t3 = t.run(m, sys.argv[1])
print(json.dumps({"outs": outs, "t3": t3}))
"""


def test_two_processes_share_one_redis(qwen_long, baseline, redis_server):  # noqa: F811
    url = f"redis://127.0.0.1:{redis_server.port}"
    outs, t3 = run(qwen_long, url)
    assert outs == baseline
    assert t3["kv_pages_written"] > 0
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", CHILD, url, os.path.join(ROOT, "tests", "storage")], capture_output=True,
                       text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["outs"] == baseline
    assert got["t3"]["hits"] > 0 and got["t3"]["tier"]["hit"] > 0, got["t3"]


def test_abort_cancels_prefetch(qwen_long, baseline, tmp_path):
    """best_effort: the prefetch a request's match started is cancelled when the request is aborted;
    its T2 slots come back, and a later run still equals the no-cache run."""
    from tiered_cache.engine.request import Request

    url = f"file://{tmp_path / 'store'}"
    run(qwen_long, url)  # fill the store
    cfg = EngineConfig(cache=CacheConfig(storage_url=url, **dict(TIERS, prefetch_policy="best_effort")), **COMMON)
    e = Engine(qwen_long, cfg)
    try:
        prompt = list(range(3, 3 + 40))
        e.submit(Request("r", prompt, 4))
        e.step()  # admitted: its match started a T3 lookup in the background
        assert e.cache.t3.fetches, "no prefetch in flight"
        assert e.abort("r")
        assert e.cache.stats["t3_cancelled"] == 1
        import time

        deadline = time.monotonic() + 30
        while e.cache.t3.fetches and time.monotonic() < deadline:  # dropped once its ops are done
            e.cache.check_hicache_events()
            time.sleep(0.001)
        assert not e.cache.t3.fetches
        assert e.reset_cache() == e.initial_free
    finally:
        e.close()
