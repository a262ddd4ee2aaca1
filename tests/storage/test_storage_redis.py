"""RedisStore against real redis-server processes: chunked values, two processes sharing one server,
the server killed mid-run, and a three-node Redis Cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest

from tests.support import storage_util
from tests.support.storage_util import FP, check_slots, fill_slots, make_region, pattern, wait_done
from tiered_cache.storage import Kind, RedisStore, StorageTier

# redis-py comes with the storage extra (scripts/setup.sh installs it); the GPU image lacks it.
redis = pytest.importorskip("redis")

# The fixtures this module uses (assigned, not imported, so a test's parameter does not shadow an import).
redis_server, own_redis, redis_cluster = storage_util.redis_server, storage_util.own_redis, storage_util.redis_cluster
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


def test_large_values_go_in_chunks_and_a_lost_chunk_is_a_miss(redis_server):
    store = RedisStore("127.0.0.1", redis_server.port, prefix=_prefix())  # default 4 MiB chunks
    tier = StorageTier(store, FP)
    slot = 9 << 20
    region = make_region(slot, 4)
    keys = tier.keys(list(range(8)))
    src = region.alloc(2)
    fill_slots(region, src, keys)
    assert all(wait_done(tier, tier.write(keys, Kind.KV, region, src)).hits)
    raw = redis.Redis(port=redis_server.port)
    sk = tier.storage_key(Kind.KV, keys[0])
    names = sorted(raw.keys(f"{store.prefix}{{{sk}}}:*"))
    assert len(names) == 3 and max(raw.strlen(n) for n in names) <= store.chunk_bytes
    dst = region.alloc(2)
    assert all(wait_done(tier, tier.prefetch(keys, Kind.KV, region, dst)).hits)
    check_slots(region, dst, keys)
    raw.delete(f"{store.prefix}{{{sk}}}:1")  # evicted under maxmemory, say
    region.free(dst)
    dst = region.alloc(2)
    op = wait_done(tier, tier.prefetch(keys, Kind.KV, region, dst))
    assert op.hits == [False, True] and tier.stats["bad_truncated"] == 1
    tier.close()


CHILD = r"""
import json, sys
from tests.support.storage_util import FP, fill_slots, make_region
from tiered_cache.storage import Kind, RedisStore, StorageTier
port, prefix, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
tier = StorageTier(RedisStore("127.0.0.1", port, prefix=prefix, chunk_bytes=65536), FP, salt="shared")
keys = tier.keys(list(range(4 * n)))
region = make_region(200_000, n)
slots = region.alloc(n)
fill_slots(region, slots, keys)
op = tier.write(keys, Kind.KV, region, slots)
assert tier.wait(op, 60) and all(op.hits)
tier.close()
print(json.dumps(dict(tier.stats)))
"""


def test_two_processes_share_one_redis(redis_server):
    prefix, n = _prefix(), 12
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", CHILD, str(redis_server.port), prefix, str(n)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"written": n}
    tier = StorageTier(RedisStore("127.0.0.1", redis_server.port, prefix=prefix, chunk_bytes=65536), FP,
                       salt="shared")
    keys = tier.keys(list(range(4 * n + 4)))  # one page more than the writer cached
    region = make_region(200_000, n + 1)
    dst = region.alloc(n + 1)
    op = wait_done(tier, tier.prefetch(keys, Kind.KV, region, dst))
    assert op.hit_prefix == n and not op.hits[n]
    check_slots(region, dst[:n], keys[:n])  # the other process's bytes, verified byte for byte
    assert tier.stats["hit"] == n and tier.stats["absent"] == 1
    other_tenant = StorageTier(RedisStore("127.0.0.1", redis_server.port, prefix=prefix), FP, salt="other")
    assert not any(wait_done(other_tenant, other_tenant.lookup(other_tenant.keys(list(range(4 * n))),
                                                               Kind.KV)).hits)
    tier.close()
    other_tenant.close()


def test_redis_killed_mid_run_lookups_become_misses_nothing_hangs(own_redis):
    """An engine loop (submit, poll, use) keeps running while the server dies under it and comes back."""
    store = RedisStore("127.0.0.1", own_redis.port, prefix=_prefix(), chunk_bytes=16384,
                       socket_timeout=1.0, connect_timeout=0.5)
    tier = StorageTier(store, FP, retry_after_s=0.5, batch_bytes=64 << 10)
    slot = 50_000
    region = make_region(slot, 64)
    keys = tier.keys(list(range(4 * 16)))
    src = region.alloc(16)
    fill_slots(region, src, keys)
    assert all(wait_done(tier, tier.write(keys, Kind.KV, region, src)).hits)

    killer = threading.Timer(0.3, own_redis.kill)
    killer.start()
    t_end = time.monotonic() + 1.5
    longest, results = 0.0, []
    while time.monotonic() < t_end:  # the engine: a prefetch per step, each bounded by its timeout
        dst = region.alloc(16)
        op = tier.prefetch(keys, Kind.KV, region, dst, timeout_s=3.0)
        t0 = time.monotonic()
        done = tier.wait(op, 5.0)
        longest = max(longest, time.monotonic() - t0)
        assert done, "a storage op hung past its timeout"
        for s, k, h in zip(dst, keys, op.hits):  # every hit is verified bytes; every miss is not valid
            assert bool(region.valid[s]) == h
            if h:
                assert np.array_equal(region.slot(s).numpy(), pattern(k, slot))
        results.append(sum(op.hits))
        region.free(dst)
    killer.join()
    assert results[0] == 16 and results[-1] == 0, results
    print(f"{len(results)} steps, {sum(r == 16 for r in results)} all hits, then {sum(r == 0 for r in results)} "
          f"all misses; longest op {longest:.3f} s")
    assert longest < 3.5, f"one op took {longest:.2f} s"
    assert tier.stats["unavailable"] > 0 and tier.stats["error"] == 0
    # While down, ops fail fast (the breaker) instead of each paying a connect timeout.
    t0 = time.monotonic()
    op = wait_done(tier, tier.lookup(keys, Kind.KV))
    assert not any(op.hits) and time.monotonic() - t0 < 1.0
    # The server comes back (empty: no persistence): after retry_after_s writes and hits work again.
    own_redis.start()  # same port, same dir; the fixture stops it
    time.sleep(0.6)
    assert all(wait_done(tier, tier.write(keys, Kind.KV, region, src)).hits)
    dst = region.alloc(16)
    assert all(wait_done(tier, tier.prefetch(keys, Kind.KV, region, dst)).hits)
    tier.close()


def test_redis_cluster(redis_cluster):
    store = RedisStore(cluster_nodes=redis_cluster, prefix=_prefix(), chunk_bytes=8192)
    tier = StorageTier(store, FP, salt="c")
    region = make_region(30_000, 48)
    keys = tier.keys(list(range(4 * 24)))
    src = region.alloc(24)
    fill_slots(region, src, keys)
    assert all(wait_done(tier, tier.write(keys, Kind.KV, region, src)).hits)
    sizes = [redis.Redis(host=h, port=p).dbsize() for h, p in redis_cluster]
    assert sum(1 for s in sizes if s) >= 2, sizes  # entries spread over nodes; chunks follow their hash tag
    dst = region.alloc(24)
    op = wait_done(tier, tier.prefetch(keys, Kind.KV, region, dst))
    assert all(op.hits) and tier.stats["error"] == 0
    check_slots(region, dst, keys)
    tier.close()


def test_a_frozen_server_costs_one_bounded_timeout(own_redis):
    """SIGSTOP: connections stay open but nothing answers; only the socket timeouts end the wait."""
    store = RedisStore("127.0.0.1", own_redis.port, prefix=_prefix(), socket_timeout=0.5, connect_timeout=0.5)
    tier = StorageTier(store, FP, retry_after_s=5.0)
    region = make_region(4096, 8)
    keys = tier.keys(list(range(16)))
    src = region.alloc(4)
    fill_slots(region, src, keys)
    assert all(wait_done(tier, tier.write(keys, Kind.KV, region, src)).hits)
    own_redis.proc.send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        op = tier.prefetch(keys, Kind.KV, region, region.alloc(4))
        assert time.monotonic() - t0 < 0.1  # submitting never waits
        assert tier.wait(op, 5.0)
        took = time.monotonic() - t0
        assert not any(op.hits) and tier.stats["unavailable"] == 4
        assert took < 2.0, f"{took:.2f} s"  # socket_timeout, one retry
        t0 = time.monotonic()
        assert not any(wait_done(tier, tier.lookup(keys, Kind.KV)).hits)
        assert time.monotonic() - t0 < 0.2  # the breaker: no second timeout while the server is down
    finally:
        own_redis.proc.send_signal(signal.SIGCONT)
    tier.close()
