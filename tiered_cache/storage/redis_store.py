"""``RedisStore``: T3 values in one Redis server or a Redis Cluster (redis-py; extra ``storage``).

A value is split into chunks of ``chunk_bytes`` (4 MiB by default) under keys that share one hash tag,
so in a cluster all chunks of a value live on one node and one pipeline reaches them::

    <prefix>{<key>}:0   frame (b"TCRC", u32 chunk count, u64 total bytes) + the value's first bytes
    <prefix>{<key>}:1   next chunk_bytes of the value
    ...

Why chunks: a reply of tens of MB blocks the single-threaded server for everyone else while it is
written out and makes the client buffer it whole; 4 MiB pieces interleave with other clients' work
and are each read with one large ``socket_read_size`` (docs/platform.md: the pure-Python parser reaches
~1k GETs/s of 1 MiB only with a read size of MBs).

Order gives atomicity without MULTI: a write pipelines chunks ``1..n-1`` first and chunk 0 last on one
connection, and Redis runs one connection's commands in order, so a reader that finds chunk 0 finds
the others (unless the server evicted one under ``maxmemory``: the value comes back short and the
format's checks make it a counted miss). A read is two rounds per batch: every chunk 0, then every
remaining chunk, in pipelines of at most ``pipeline_bytes`` of reply (``stop`` is asked between
them); the chunks go up as parts, never joined. Counts and lengths are never trusted: each chunk is
read with ``GETRANGE`` bounded by the length it must have, and a frame whose count, total and chunk 0
length do not make a layout a writer produces, or whose total is not the expected size, is
a ``WrongSize`` before any further chunk is asked for.

Timeouts bound every call (``socket_timeout``, ``connect_timeout``), with at most one immediate retry
(a pooled connection gone stale after a server restart), so a dead server costs one timeout, not a
backoff series. Failures raise ``StorageUnavailableError``.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from typing import Any, Optional

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, StorageUnavailableError
from tiered_cache.storage.backend import (
    DEFAULT_MAX_VALUE_BYTES,
    WRONG_SIZE,
    Buffer,
    Read,
    Stop,
    StorageBackend,
    WrongSize,
)
from tiered_cache.validate import float_arg, int_arg

_FRAME = struct.Struct("<4sIQ")
_FRAME_MAGIC = b"TCRC"
_MIN_CHUNK = 4096


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
        max_value_bytes: the largest value a read of unknown expected size accepts.
    """

    name = "redis"

    def __init__(self, host: str = "127.0.0.1", port: int = 6379, *,
                 cluster_nodes: Optional[Sequence[tuple[str, int]]] = None, prefix: str = "tc:",
                 chunk_bytes: int = 4 << 20, pipeline_bytes: int = 64 << 20, ttl_s: Optional[int] = None,
                 socket_timeout: float = 2.0, connect_timeout: float = 1.0, socket_read_size: int = 4 << 20,
                 password: Optional[str] = None, db: int = 0,
                 max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> None:
        try:
            import redis  # noqa: F401
        except ImportError:
            raise ImportError("RedisStore needs redis-py: pip install 'tiered-cache[storage]'") from None
        # Every setting checked before anything is kept (NaN compares false: a NaN timeout never expires).
        chunk_bytes = int_arg("chunk_bytes", chunk_bytes, lo=_MIN_CHUNK, hi=512 << 20)  # Redis: 512 MiB a value
        pipeline_bytes = int_arg("pipeline_bytes", pipeline_bytes, lo=1)
        max_value_bytes = int_arg("max_value_bytes", max_value_bytes, lo=1)
        if ttl_s is not None:
            ttl_s = int_arg("ttl_s", ttl_s, lo=1)
        socket_timeout = float_arg("socket_timeout", socket_timeout, lo=0, lo_open=True)
        connect_timeout = float_arg("connect_timeout", connect_timeout, lo=0, lo_open=True)
        socket_read_size = int_arg("socket_read_size", socket_read_size, lo=1)
        db = int_arg("db", db, lo=0)
        for arg, v in (("host", host), ("prefix", prefix)):
            if not isinstance(v, str):
                raise InvalidTypeError(arg, "a str", v)
        if password is not None and not isinstance(password, str):
            raise InvalidTypeError("password", "None or a str", password)
        port = int_arg("port", port, lo=1, hi=65535)
        if cluster_nodes is not None:
            if not isinstance(cluster_nodes, (list, tuple)) or not all(
                    isinstance(x, (list, tuple)) and len(x) == 2 and isinstance(x[0], str) for x in cluster_nodes):
                raise InvalidArgumentError("cluster_nodes", "a list of (host, port) pairs", cluster_nodes)
            cluster_nodes = [(h, int_arg("cluster_nodes", p, lo=1, hi=65535)) for h, p in cluster_nodes]
        self.cluster_nodes = list(cluster_nodes) if cluster_nodes else None
        self.host, self.port = host, port
        self.name = (f"redis cluster {self.cluster_nodes[0][0]}:{self.cluster_nodes[0][1]}+" if self.cluster_nodes
                     else f"redis {host}:{port}")
        self.prefix = prefix
        self.chunk_bytes = chunk_bytes
        self.pipeline_bytes = pipeline_bytes
        self.max_value_bytes = max_value_bytes
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

    def get_many(self, keys: Sequence[str], sizes: Optional[Sequence[Optional[int]]] = None,
                 stop: Stop = None) -> list[Optional[Read]]:
        n_keys = len(keys)
        if sizes is not None and len(sizes) != n_keys:
            raise InvalidArgumentError("sizes", f"{n_keys} sizes (one per key)", len(sizes))
        given: Sequence[Optional[int]] = [None] * n_keys if sizes is None else sizes
        want = [self.max_value_bytes if s is None else s for s in given]
        exact = [s is not None for s in given]
        out: list[Optional[Read]] = [None] * n_keys
        # Round 1: every chunk 0, each read with GETRANGE up to one byte past the largest chunk 0 the
        # expected size allows (a longer one is refused without being read whole).
        heads: list[Optional[bytes]] = [None] * n_keys
        caps = [w + _FRAME.size + 1 for w in want]
        for part in self._groups(list(range(n_keys)), [min(c, self.chunk_bytes) for c in caps]):
            if stop is not None and stop():
                return out
            vals = self._run(lambda pipe, part=part: [pipe.getrange(self._ck(keys[i], 0), 0, caps[i] - 1)
                                                      for i in part])
            for i, v in zip(part, vals):
                heads[i] = v or None  # GETRANGE of an absent key is b""
        rest: list[tuple[int, int, int]] = []  # (key index, chunk index, its expected length) still to fetch
        counts: dict[int, tuple[int, bytes]] = {}  # key index -> (chunk count, chunk 0)
        for i, h in enumerate(heads):
            if h is None:
                continue
            if len(h) < _FRAME.size or h[:4] != _FRAME_MAGIC:
                out[i] = h  # not ours: hand it up as is (bounded by the cap), the format check counts it
                continue
            _, n, total = _FRAME.unpack_from(h)
            lens = _chunk_lengths(n, total, len(h))
            if lens is None:
                out[i] = WRONG_SIZE  # a count that disagrees with the lengths: nothing more is fetched
                continue
            if (total != want[i]) if exact[i] else (total > want[i]):
                out[i] = WrongSize(total)  # not this entry's size: nothing more is fetched
                continue
            counts[i] = (n, h)
            rest += [(i, c, ln) for c, ln in enumerate(lens) if c]
        got: dict[tuple[int, int], bytes] = {}
        for part in self._groups(rest, [ln for _, _, ln in rest]):
            if stop is not None and stop():  # the op's cancel / deadline, between round trips
                return [None] * n_keys
            # One byte past the expected length: a longer chunk is seen as such without reading it all.
            vals = self._run(lambda pipe, part=part: [pipe.getrange(self._ck(keys[i], c), 0, ln) for i, c, ln in part])
            for (i, c, ln), v in zip(part, vals):
                got[(i, c)] = v
                if len(v) > ln:  # longer than its layout says
                    out[i] = WRONG_SIZE
        for i, (n, h) in counts.items():
            if isinstance(out[i], WrongSize):
                continue
            parts: list[Buffer] = [memoryview(h)[_FRAME.size:]]
            for c in range(1, n):
                v = got.get((i, c))
                if not v:  # a chunk evicted: hand up what is there, the format check counts it short
                    break
                parts.append(v)
            out[i] = parts
        return out

    def _groups(self, items: list, nbytes: list[int]) -> list[list]:
        """``items`` in runs of at most ``pipeline_bytes`` of reply (at least one item per run)."""
        runs: list[list] = []
        size = 0
        for it, b in zip(items, nbytes):
            if not runs or size + b > self.pipeline_bytes:
                runs.append([])
                size = 0
            runs[-1].append(it)
            size += b
        return runs

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [bool(x) for x in self._run(lambda pipe: [pipe.exists(self._ck(k, 0)) for k in keys])]

    def delete_many(self, keys: Sequence[str]) -> None:
        def fill(pipe):
            for k in keys:
                pipe.getrange(self._ck(k, 0), 0, _FRAME.size - 1)
                pipe.strlen(self._ck(k, 0))
        res = self._run(fill)
        doomed = []
        for j, k in enumerate(keys):
            h, ln = res[2 * j], res[2 * j + 1]
            lens = None
            if h and len(h) == _FRAME.size and h[:4] == _FRAME_MAGIC:
                _, n, total = _FRAME.unpack_from(h)
                lens = _chunk_lengths(n, total, int(ln)) if total <= self.max_value_bytes else None
            # A frame whose count disagrees with its lengths is damaged: only chunk 0 goes (that makes
            # the value unreadable; orphaned chunks expire with ``ttl_s`` or stay as garbage), never
            # a count read from the store on trust.
            doomed += [self._ck(k, i) for i in range(len(lens) if lens else 1)]
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


def _chunk_lengths(n: int, total: int, len0: int) -> Optional[list[int]]:
    """The byte length of each chunk of a value whose frame says ``n`` chunks and ``total`` bytes and
    whose chunk 0 is ``len0`` bytes long (frame included), or ``None`` if no writer makes that layout.
    A writer's chunk 0 is full when there are more chunks, so its length is the writer's chunk size."""
    first = len0 - _FRAME.size
    if n < 1 or first < 0:
        return None
    if n == 1:
        return [len0] if first == total else None
    if len0 < _MIN_CHUNK or first >= total:
        return None
    rest = total - first
    if n != 1 + -(-rest // len0):
        return None
    return [len0] + [min(len0, rest - (c - 1) * len0) for c in range(1, n)]


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
