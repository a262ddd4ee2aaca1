"""T3 storage benchmark: read and write GB/s of the file store and loopback Redis, next to T2 copies.

What is timed is the path the radix tree will use: ``StorageTier.write`` from T2 host slots (header +
CRC-32, backend put) and ``StorageTier.prefetch`` into T2 host slots (backend get, header and CRC
checks, copy into the slot), for two entry sizes:

- ``kv``: one KV page envelope of Qwen3-Next-80B (~384 KiB: 16 tokens x 12 layers x K and V x 2 heads x 256 x bf16),
- ``state``: one int8 recurrent-state envelope of it (~21 MB; ``--small``: 4 MiB).

GB/s = payload bytes / wall time of the whole batch, submitted as ``--ops`` ops in flight at once
(the tier's ``--workers`` threads run them). Baseline, same run: ``t2_copy`` copies the same slots
between two host regions with one memcpy per slot (numpy: on the 2-core CPU machines torch's ``copy_``
of a host slice runs at 0.03-0.05 GB/s with its default 2 intra-op threads and ~3 GB/s with one, so
it would not be a fair baseline). Before timing, one round trip is checked byte for byte. Writes
overwrite the same keys (``skip_existing`` off, so every byte goes).

The file store reads come from the page cache (the files were just written), as a warm store would;
``file_read_cold`` first drops each file from the page cache (fsync + ``posix_fadvise(DONTNEED)``) and
so reads from the disk. Redis: a ``redis-server`` of this script's own on 127.0.0.1 (no persistence),
or ``--redis-port`` for one already running; pure-Python reply parser (no hiredis) with a 4 MiB
``socket_read_size``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import write_results  # noqa: E402
from tiered_cache.storage import FileStore, Kind, RedisStore, StorageFingerprint, StorageTier  # noqa: E402
from tiered_cache.testing.local_redis import LocalRedis  # noqa: E402
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec  # noqa: E402

FP = StorageFingerprint("bench/qwen3-next-80b", (0, 48), ("kv=bfloat16", "state=int8"), "int8", 16)
KV_PAGE = 384 << 10
STATE = 21 * 10**6 // 16 * 16


def _regions(slot_bytes: int, n: int):
    m = HostMirror([RegionSpec("src", slot_bytes, n), RegionSpec("dst", slot_bytes, n)], check_memory=True)
    src, dst = m.region("src"), m.region("dst")
    s_slots, d_slots = src.alloc(n), dst.alloc(n)
    rng = np.random.default_rng(0)
    for i, s in enumerate(s_slots):
        src.slot(s).numpy()[:] = rng.integers(0, 256, slot_bytes, dtype=np.uint8)
        src.checksums[s] = i
        src.valid[s] = True
    return m, src, dst, s_slots, d_slots


def _split(xs, k):
    step = -(-len(xs) // k)
    return [xs[i:i + step] for i in range(0, len(xs), step)]


def _run_ops(tier, submit, keys, slots, n_ops: int, timeout_s: float = 600.0) -> float:
    t0 = time.perf_counter()
    ops = [submit(k, s) for k, s in zip(_split(keys, n_ops), _split(slots, n_ops))]
    for op in ops:
        if not tier.wait(op, timeout_s) or not all(op.hits):
            raise RuntimeError(f"{op.op} failed: stats {dict(tier.stats)}")
    return time.perf_counter() - t0


def bench_backend(name, backend, kind, src, dst, s_slots, d_slots, reps, n_ops, workers, cold_files=None):
    tier = StorageTier(backend, FP, salt="bench", workers=workers, skip_existing=False)
    keys = tier.keys(list(range(FP.page_size * len(s_slots))))
    nbytes = src.slot_bytes * len(s_slots)
    write = lambda k, s: tier.write(k, kind, src, s)
    read = lambda k, s: tier.prefetch(k, kind, dst, s)
    # Correctness first: one round trip, byte for byte, checksums carried.
    _run_ops(tier, write, keys, s_slots, n_ops)
    _run_ops(tier, read, keys, d_slots, n_ops)
    for a, b in zip(s_slots, d_slots):
        assert np.array_equal(src.slot(a).numpy(), dst.slot(b).numpy()) and src.checksums[a] == dst.checksums[b]
    w = [nbytes / _run_ops(tier, write, keys, s_slots, n_ops) / 1e9 for _ in range(reps)]
    r = [nbytes / _run_ops(tier, read, keys, d_slots, n_ops) / 1e9 for _ in range(reps)]
    out = {"write": statistics.median(w), "read": statistics.median(r)}
    if cold_files is not None:
        cold = []
        for _ in range(reps):
            cold_files(tier, keys, kind)
            cold.append(nbytes / _run_ops(tier, read, keys, d_slots, n_ops) / 1e9)
        out["read_cold"] = statistics.median(cold)
    assert tier.stats["error"] == 0 and not any(k.startswith("bad_") for k in tier.stats)
    tier.close()
    return out


def bench_t2(src, dst, s_slots, d_slots, reps) -> float:
    nbytes = src.slot_bytes * len(s_slots)
    runs = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for a, b in zip(s_slots, d_slots):
            dst.slot(b).numpy()[:] = src.slot(a).numpy()  # memcpy; see the module docstring on torch copy_
        runs.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(runs[1:])


def _drop_cache(store: FileStore):
    def drop(tier, keys, kind):
        for k in keys:
            fd = os.open(store.path(tier.storage_key(kind, k)), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return drop


def _start_redis(workdir: str):
    return LocalRedis(workdir, None, "--maxmemory", "0").start()


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="~20 MB per case, one rep (a smoke run)")
    ap.add_argument("--total-mb", type=int, default=1024, help="payload MB per case (default 1024)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ops", type=int, default=2, help="ops in flight per batch")
    ap.add_argument("--workers", type=int, default=2, help="StorageTier worker threads")
    ap.add_argument("--dir", default=None, help="file store folder (default: a temp dir, removed after)")
    ap.add_argument("--redis-port", type=int, default=None, help="use a running server (default: start one)")
    ap.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    args = ap.parse_args(argv)
    total = (20 << 20) if args.small else args.total_mb << 20
    reps = 1 if args.small else args.reps
    cases = [("kv", Kind.KV, KV_PAGE), ("state", Kind.STATE, (4 << 20) if args.small else STATE)]

    tmp = tempfile.mkdtemp(prefix="bench-storage-")
    server = None
    notes = []
    try:
        if args.redis_port is None and shutil.which("redis-server"):
            server = _start_redis(os.path.join(tmp, "redis"))
        port = args.redis_port or (server.port if server else None)
        if port is None:
            notes.append("redis-server not found: Redis not measured.")
        rows, metrics = [], {}
        for name, kind, slot_bytes in cases:
            n = max(2, total // slot_bytes)
            mirror, src, dst, s_slots, d_slots = _regions(slot_bytes, n)
            row = {"entry": name, "entry_bytes": slot_bytes, "entries": n,
                   "t2_copy_GBps": bench_t2(src, dst, s_slots, d_slots, reps)}
            store = FileStore(args.dir or os.path.join(tmp, "files"))
            f = bench_backend("file", store, kind, src, dst, s_slots, d_slots, reps, args.ops, args.workers,
                              cold_files=_drop_cache(store))
            row.update(file_write_GBps=f["write"], file_read_GBps=f["read"], file_read_cold_GBps=f["read_cold"])
            if port is not None:
                rs = RedisStore("127.0.0.1", port, prefix="bench:", socket_timeout=30.0)
                r = bench_backend("redis", rs, kind, src, dst, s_slots, d_slots, reps, args.ops, args.workers)
                RedisStore("127.0.0.1", port, prefix="bench:").flush_prefix()
                row.update(redis_write_GBps=r["write"], redis_read_GBps=r["read"])
            rows.append(row)
            for k, v in row.items():
                if k.endswith("GBps"):
                    metrics[f"{k[:-5]}_{name}_GBps"] = v
            mirror.close()
            del mirror, src, dst
        # Headline metrics: the state envelopes, the entries T3 exists for (75 MB fp32 / 21 MB int8 each).
        top = rows[-1]
        for k in ("redis_read_GBps", "redis_write_GBps", "file_read_GBps", "file_write_GBps",
                  "file_read_cold_GBps", "t2_copy_GBps"):
            if k in top:
                metrics[k] = top[k]
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    notes.append(f"{os.cpu_count()} CPU cores; StorageTier workers {args.workers}, {args.ops} ops in flight; "
                 f"{total >> 20} MB payload per case, median of {reps}. Headline metrics = the state case. "
                 "See the script's docstring.")
    if server is not None:
        ver = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
        notes.append(f"redis-server {ver.removeprefix('v=')} on loopback, redis-py pure-Python parser.")
    return write_results("storage", metrics, rows=rows, out_dir=args.out, notes=" ".join(notes))


if __name__ == "__main__":
    print(main())
