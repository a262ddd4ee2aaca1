"""T3: shared storage of KV pages and states, content-addressed, in a file store or Redis.

    keys.py        chained page keys, seeded with a fingerprint of everything that changes the bytes
    format.py      fixed binary header + raw payload; parse errors are StorageFormatError only
    backend.py     StorageBackend: batched byte get / put / exists / delete (blocking, thread-safe)
    file_store.py  FileStore: one directory, atomic temp-file + rename writes (the default)
    redis_store.py RedisStore: one server or a Redis Cluster, chunked values, pipelined
    tier.py        StorageTier: asynchronous T2 <-> T3 moves (prefetch / write / lookup / poll / cancel)
"""

from __future__ import annotations

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.storage.backend import StorageBackend
from tiered_cache.storage.file_store import FileStore
from tiered_cache.storage.format import HEADER_SIZE, Kind
from tiered_cache.storage.keys import LAYOUT_VERSION, StorageFingerprint, page_keys
from tiered_cache.storage.redis_store import RedisStore
from tiered_cache.storage.tier import StorageOp, StorageTier


def open_backend(url: str, **kwargs) -> StorageBackend:
    """A backend from a URL: ``file:///abs/dir`` (or a bare path), ``redis://host:port``,
    ``redis-cluster://host:port,host:port``. ``kwargs`` go to the backend's constructor."""
    if not isinstance(url, str):
        raise InvalidTypeError("url", "file:///dir, redis://host:port or redis-cluster://h:p,h:p", url)
    if not url:
        raise InvalidArgumentError("url", "file:///dir, redis://host:port or redis-cluster://h:p,h:p", url)
    if url.startswith("redis://") or url.startswith("redis-cluster://"):
        scheme, rest = url.split("://", 1)
        nodes = []
        for hp in rest.rstrip("/").split(","):
            host, _, port = hp.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InvalidArgumentError("url", "host:port pairs after the scheme", url)
            nodes.append((host, int(port)))
        if scheme == "redis":
            if len(nodes) != 1:
                raise InvalidArgumentError("url", "one host:port for redis:// (redis-cluster:// for several)", url)
            return RedisStore(nodes[0][0], nodes[0][1], **kwargs)
        return RedisStore(cluster_nodes=nodes, **kwargs)
    if "://" in url and not url.startswith("file://"):
        raise InvalidArgumentError("url", "a file://, redis:// or redis-cluster:// URL", url)
    return FileStore(url.removeprefix("file://"), **kwargs)


__all__ = [
    "HEADER_SIZE",
    "LAYOUT_VERSION",
    "FileStore",
    "Kind",
    "RedisStore",
    "StorageBackend",
    "StorageFingerprint",
    "StorageOp",
    "StorageTier",
    "open_backend",
    "page_keys",
]
