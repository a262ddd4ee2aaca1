"""Shared by the storage tests: real redis-server processes on free loopback ports, T2 regions, patterns.

The fixtures skip (with the reason) only when the ``redis-server`` binary is absent; ``.ci/run``
installs it, so CI always runs them. Every server runs in its own temp dir, without persistence,
and is stopped when its fixture ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import torch

from tiered_cache.storage import StorageBackend, StorageFingerprint
from tiered_cache.testing.local_redis import REDIS_BIN, LocalRedis, free_cluster_port
from tiered_cache.tiers.host_mirror import HostMirror, HostRegion, RegionSpec

NO_REDIS = "redis-server binary not found (apt-get install -y redis-server; .ci/run installs it)"

FP = StorageFingerprint("test/tiny-qwen3-next", (0, 4), ("kv=bfloat16", "state=int8"), "int8", 4)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One server for the session's Redis tests (each test uses its own key prefix)."""
    if REDIS_BIN is None:
        pytest.skip(NO_REDIS)
    srv = LocalRedis(str(tmp_path_factory.mktemp("redis"))).start()
    yield srv
    srv.stop()


@pytest.fixture
def own_redis(tmp_path):
    """A server of this test's own, which it may kill."""
    if REDIS_BIN is None:
        pytest.skip(NO_REDIS)
    srv = LocalRedis(str(tmp_path / "redis")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A three-master Redis Cluster (no replicas); yields its ``[(host, port)]``."""
    if REDIS_BIN is None:
        pytest.skip(NO_REDIS)
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli not found (it comes with redis-server's package, redis-tools)")
    base = tmp_path_factory.mktemp("redis-cluster")
    servers = []
    try:
        for i in range(3):
            d = str(base / f"n{i}")
            servers.append(LocalRedis(d, free_cluster_port(), "--cluster-enabled", "yes", "--cluster-config-file",
                                       os.path.join(d, "nodes.conf"), "--cluster-node-timeout", "2000").start())
        nodes = [("127.0.0.1", s.port) for s in servers]
        subprocess.run([cli, "--cluster", "create", *[f"{h}:{p}" for h, p in nodes], "--cluster-replicas", "0",
                        "--cluster-yes"], check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # wait until every node agrees the slots are covered
            states = [subprocess.run([cli, "-p", str(p), "cluster", "info"], capture_output=True, text=True,
                                     timeout=5).stdout for _, p in nodes]
            if all("cluster_state:ok" in s for s in states):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("redis cluster did not reach cluster_state:ok")
        yield nodes
    finally:
        for s in servers:
            s.stop()


def make_region(slot_bytes: int, num_slots: int, name: str = "full") -> HostRegion:
    """A T2 region in ordinary host memory (no CUDA here)."""
    return HostMirror([RegionSpec(name, slot_bytes, num_slots)], check_memory=False).region(name)


def pattern(key: bytes, nbytes: int) -> np.ndarray:
    """Bytes derived from a key: every entry has its own content, and a test can recompute it anywhere."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def fill_slots(region: HostRegion, slots, keys) -> None:
    """Fill ``slots`` with each key's pattern, as a completed demote would (bytes, checksum, valid)."""
    for s, k in zip(slots, keys):
        region.slot(s).copy_(torch.from_numpy(pattern(k, region.slot_bytes)))
        region.checksums[s] = int.from_bytes(k[8:16], "little", signed=True)
        region.valid[s] = True


def check_slots(region: HostRegion, slots, keys) -> None:
    for s, k in zip(slots, keys):
        assert region.valid[s]
        assert np.array_equal(region.slot(s).numpy(), pattern(k, region.slot_bytes)), f"slot {s} bytes differ"
        assert region.checksums[s] == int.from_bytes(k[8:16], "little", signed=True)


def wait_done(tier, op, timeout_s: float = 30.0):
    assert tier.wait(op, timeout_s), f"{op.op} not done in {timeout_s} s"
    return op


class WrapBackend(StorageBackend):
    """A backend in front of another, for fault tests: records every call's method in ``calls``,
    sleeps ``delay_s`` in the methods named in ``slow`` (``"get"``, ``"exists"``, ``"put"``,
    ``"delete"``: a slow store), and calls ``before(method, n)`` ahead of call number ``n`` (0-based,
    all methods counted together), e.g. to kill the server mid-run. Install it under a live tier with
    ``tier.backend = WrapBackend(tier.backend, ...)`` (the tier reads ``backend`` at every call)."""

    def __init__(self, inner: StorageBackend, *, delay_s: float = 0.0, slow=("get",), before=None) -> None:
        self.inner, self.delay_s, self.slow, self.before = inner, delay_s, tuple(slow), before
        self.name = f"wrapped {inner.name}"
        self.calls: list[str] = []
        self._lock = threading.Lock()

    def _enter(self, method: str) -> None:
        with self._lock:
            n = len(self.calls)
            self.calls.append(method)
        if self.before is not None:
            self.before(method, n)
        if self.delay_s and method in self.slow:
            time.sleep(self.delay_s)

    def get_many(self, keys, sizes=None, stop=None):
        self._enter("get")
        return self.inner.get_many(keys, sizes, stop)

    def exists_many(self, keys):
        self._enter("exists")
        return self.inner.exists_many(keys)

    def put_many(self, items):
        self._enter("put")
        return self.inner.put_many(items)

    def delete_many(self, keys):
        self._enter("delete")
        return self.inner.delete_many(keys)

    def close(self) -> None:
        self.inner.close()


# ------------------------------------------------------------------------------ radix caches over T3
def make_t3_cache(tier, *, kv_pages: int = 64, states: int = 8, t1_slots: int = 16, host_pages: int = 64,
                  host_states: int = 16):
    """A CPU ``HiMambaRadixCache`` with T0-T3 (lossless T1, write-through to T2 and T3, ``wait_complete``
    prefetch so one match already sees what T3 holds). Page size: the tier's fingerprint's. The caller
    closes ``tier``."""
    from tests.support.radix_util import KV_SPEC, STATE_SPEC
    from tiered_cache.config import CacheConfig
    from tiered_cache.stack import TieredCache

    cfg = CacheConfig(page_size=tier.fingerprint.page_size, kv_pages=kv_pages, t0_states=states, t1_states=t1_slots,
                      codec="lossless", host_kv_pages=host_pages, host_states=host_states,
                      prefetch_policy="wait_complete", check_memory=False, backend="torch")
    return TieredCache.build(cfg, kv=KV_SPEC, state=STATE_SPEC, device="cpu", storage=tier).tree


def settle(cache, timeout_s: float = 20.0) -> None:
    """Drive ``check_hicache_events`` until T2 backups have landed and every T3 op of the cache's tier
    is done (the writes they start go to T3 when they land)."""
    tier = cache.t3.tier
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cache.check_hicache_events()
        if not cache.host_tier.busy and tier.pending() == 0 and not cache.t3.fetches:
            return
        time.sleep(0.005)
    raise AssertionError(f"T2/T3 ops not done in {timeout_s} s")


def stored_names(backend) -> set:
    """Every entry name a backend holds: file names under a ``FileStore`` root (temp files aside), or
    the entry keys of a ``RedisStore``'s prefix (each chunked value counted once, by its chunk 0)."""
    from tiered_cache.storage import FileStore, RedisStore

    if isinstance(backend, FileStore):
        out = set()
        for _d, subdirs, files in os.walk(backend.root):
            subdirs[:] = [s for s in subdirs if s != ".tmp"]
            out |= set(files)
        return out
    assert isinstance(backend, RedisStore)
    import redis

    r = redis.Redis(host=backend.host, port=backend.port)
    try:
        return {k.decode() for k in r.scan_iter(match=f"{backend.prefix}*:0", count=1000)}
    finally:
        r.close()
