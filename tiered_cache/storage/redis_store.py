"""``RedisStore``: T3 values in one Redis server or a Redis Cluster (redis-py; extra ``storage``).

A value is split into chunks of ``chunk_bytes`` (4 MiB by default) under keys that share one hash tag,
so in a cluster all chunks of a value live on one node and one pipeline reaches them::

    <prefix>{<key>}:0   frame (b"TCRC", u32 chunk count, u64 total bytes) + the value's first bytes
    <prefix>{<key>}:1   next chunk_bytes of the value
    ...

Why chunks: a reply of tens of MB blocks the single-threaded server for everyone else while it is
written out and makes the client buffer it whole; 4 MiB pieces interleave with other clients' work
and are each read with one large ``socket_read_size`` (PLATFORM.md: the pure-Python parser reaches
~1k GETs/s of 1 MiB only with a read size of MBs).

Order gives atomicity without MULTI: a write pipelines chunks ``1..n-1`` first and chunk 0 last on one
connection, and Redis runs one connection's commands in order, so a reader that finds chunk 0 finds
the others (unless the server evicted one under ``maxmemory``: the value comes back short and the
format's checks make it a counted miss). A read is two round trips per batch: every chunk 0, then
every remaining chunk, each one pipeline; the chunks go up as parts, never joined.

Timeouts bound every call (``socket_timeout``, ``connect_timeout``), with at most one immediate retry
(a pooled connection gone stale after a server restart), so a dead server costs one timeout, not a
backoff series. Failures raise ``StorageUnavailableError``.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import Any, Optional

from tiered_cache.errors import InvalidArgumentError, StorageUnavailableError
from tiered_cache.storage.backend import Buffer, StorageBackend, Value

_FRAME = struct.Struct("<4sIQ")
_FRAME_MAGIC = b"TCRC"


class RedisStore(StorageBackend):
    """Args:
        host, port: one server (ignored when ``cluster_nodes`` is given).
        cluster_nodes: ``[(host, port), ...]`` startup nodes of a Redis Cluster (``RedisCluster``).
        prefix: key prefix (namespaces several caches in one server).
        chunk_bytes: largest piece of a value stored under one Redis key.
        pipeline_bytes: a batch is sent in pipelines of about this many bytes (bounds client memory).
        ttl_s: expire values after this many seconds (``None``: keep; the server's maxmemory policy evicts).
        socket_timeout, connect_timeout: seconds; every call is bounded by them.
        socket_read_size: bytes per socket read of the reply parser.
    """

    name = "redis"

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, *,
                 cluster_nodes: Optional[Sequence[tuple[str, int]]] = None, prefix: str = "tc:",
                 chunk_bytes: int = 4 << 20, pipeline_bytes: int = 64 << 20, ttl_s: Optional[int] = None,
                 socket_timeout: float = 2.0, connect_timeout: float = 1.0, socket_read_size: int = 4 << 20,
                 password: Optional[str] = None, db: int = 0) -> None:
        try:
            import redis  # noqa: F401
        except ImportError:
            raise ImportError("RedisStore needs redis-py: pip install 'tiered-cache[storage]'") from None
        if not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
            raise InvalidArgumentError("chunk_bytes", "an int >= 4096", chunk_bytes)
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s <= 0):
            raise InvalidArgumentError("ttl_s", "None or a positive int", ttl_s)
        for arg, v in (("socket_timeout", socket_timeout), ("connect_timeout", connect_timeout)):
            if not isinstance(v, (int, float)) or v <= 0:
                raise InvalidArgumentError(arg, "a positive number of seconds", v)
        self.cluster_nodes = [(str(h), int(p)) for h, p in cluster_nodes] if cluster_nodes else None
        self.host, self.port = host, int(port)
        self.name = (f"redis cluster {self.cluster_nodes[0][0]}:{self.cluster_nodes[0][1]}+" if self.cluster_nodes
                     else f"redis {host}:{port}")
        self.prefix = prefix
        self.chunk_bytes = chunk_bytes
        self.pipeline_bytes = pipeline_bytes
        self.ttl_s = ttl_s
        self._conn_kw = dict(socket_timeout=socket_timeout, socket_connect_timeout=connect_timeout,
                             socket_read_size=socket_read_size, password=password)
        self._db = db
        self._client_obj: Any = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------ client
    def _client(self):
        with self._lock:
            if self._client_obj is None:
                from redis.backoff import NoBackoff
                from redis.retry import Retry

                retry = Retry(NoBackoff(), 1)
                try:
                    if self.cluster_nodes:
                        from redis.cluster import ClusterNode, RedisCluster

                        self._client_obj = RedisCluster(
                            startup_nodes=[ClusterNode(h, p) for h, p in self.cluster_nodes], retry=retry,
                            **self._conn_kw)
                    else:
                        import redis

                        self._client_obj = redis.Redis(host=self.host, port=self.port, db=self._db, retry=retry,
                                                       **self._conn_kw)
                except Exception as e:  # cluster discovery connects at once
                    raise StorageUnavailableError(self.name, e) from e
            return self._client_obj

    def _run(self, fill) -> list:
        """One pipeline filled by ``fill(pipe)``, executed; redis and socket errors -> unavailable."""
        import redis

        client = self._client()
        try:
            pipe = client.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute()
        except (redis.exceptions.RedisError, OSError) as e:
            if self.cluster_nodes:  # rediscover the slot map next time (a node may have moved or died)
                with self._lock:
                    self._client_obj = None
            raise StorageUnavailableError(self.name, e) from e

    def _ck(self, key: str, i: int) -> str:
        return f"{self.prefix}{{{key}}}:{i}"

    # ------------------------------------------------------------------------------ batches
    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        batch: list[tuple[str, Buffer]] = []
        size = 0
        for key, parts in items:
            for ck, buf in self._chunks(key, parts):
                batch.append((ck, buf))
                size += memoryview(buf).nbytes
            if size >= self.pipeline_bytes:
                self._set_all(batch)
                batch, size = [], 0
        if batch:
            self._set_all(batch)

    def _set_all(self, batch: list[tuple[str, Buffer]]) -> None:
        def fill(pipe):
            for ck, buf in batch:
                pipe.set(ck, buf, ex=self.ttl_s)
        self._run(fill)

    def _chunks(self, key: str, parts: Sequence[Buffer]) -> list[tuple[str, Buffer]]:
        """Chunks 1..n-1, then chunk 0 (the order a reader relies on)."""
        views = [memoryview(p).cast("B") for p in parts]
        total = sum(v.nbytes for v in views)
        first = self.chunk_bytes - _FRAME.size
        n = 1 + max(0, -(-(total - first) // self.chunk_bytes))
        bounds = [(0, min(total, first))] + [(first + (i - 1) * self.chunk_bytes,
                                              min(total, first + i * self.chunk_bytes)) for i in range(1, n)]
        pieces = [_slice(views, a, b) for a, b in bounds]
        frame = _FRAME.pack(_FRAME_MAGIC, n, total)
        out = [(self._ck(key, i), pieces[i]) for i in range(1, n)]
        out.append((self._ck(key, 0), b"".join((frame, pieces[0]))))
        return out

    def get_many(self, keys: Sequence[str]) -> list[Optional[Value]]:
        out: list[Optional[Value]] = [None] * len(keys)
        # Round 1: every chunk 0 (in pipelines of a bounded reply size).
        per = max(1, self.pipeline_bytes // self.chunk_bytes)
        heads: list[Optional[bytes]] = []
        for s in range(0, len(keys), per):
            part = keys[s:s + per]
            heads += self._run(lambda pipe, part=part: [pipe.get(self._ck(k, 0)) for k in part])
        rest: list[tuple[int, int]] = []  # (key index, chunk index) still to fetch
        frames: dict[int, tuple[int, int]] = {}
        for i, h in enumerate(heads):
            if h is None:
                continue
            if len(h) < _FRAME.size or h[:4] != _FRAME_MAGIC:
                out[i] = h  # not ours: hand it up as is, the format check counts it
                continue
            _, n, total = _FRAME.unpack_from(h)
            frames[i] = (n, total)
            rest += [(i, c) for c in range(1, n)]
        got: dict[tuple[int, int], Optional[bytes]] = {}
        for s in range(0, len(rest), per):
            part = rest[s:s + per]
            vals = self._run(lambda pipe, part=part: [pipe.get(self._ck(keys[i], c)) for i, c in part])
            got.update(zip(part, vals))
        for i, (n, _total) in frames.items():  # the format checks the length
            parts: list[Buffer] = [memoryview(heads[i])[_FRAME.size:]]
            for c in range(1, n):
                v = got.get((i, c))
                if v is None:  # a chunk evicted: hand up what is there, the format check counts it short
                    break
                parts.append(v)
            out[i] = parts
        return out

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [bool(x) for x in self._run(lambda pipe: [pipe.exists(self._ck(k, 0)) for k in keys])]

    def delete_many(self, keys: Sequence[str]) -> None:
        heads = self._run(lambda pipe: [pipe.getrange(self._ck(k, 0), 0, _FRAME.size - 1) for k in keys])
        doomed = []
        for k, h in zip(keys, heads):
            n = _FRAME.unpack_from(h)[1] if h and len(h) == _FRAME.size and h[:4] == _FRAME_MAGIC else 1
            doomed += [self._ck(k, i) for i in range(n)]
        if doomed:
            self._run(lambda pipe: [pipe.delete(ck) for ck in doomed])

    def flush_prefix(self) -> int:
        """Delete every key under this store's prefix (tests, tools). Not for a shared production server."""
        n = 0
        client = self._client()
        try:
            for ck in client.scan_iter(match=f"{self.prefix}*", count=1000):
                n += client.delete(ck)
        except Exception as e:
            raise StorageUnavailableError(self.name, e) from e
        return n

    def close(self) -> None:
        with self._lock:
            c, self._client_obj = self._client_obj, None
        if c is not None:
            try:
                c.close()
            except Exception:
                pass


def _slice(views: list[memoryview], a: int, b: int) -> Buffer:
    """Bytes ``[a, b)`` of the concatenation of ``views``: a view when inside one part, else joined."""
    pieces = []
    off = 0
    for v in views:
        lo, hi = max(a, off), min(b, off + v.nbytes)
        if lo < hi:
            pieces.append(v[lo - off:hi - off])
        off += v.nbytes
    if len(pieces) == 1:
        return pieces[0]
    return b"".join(pieces)
