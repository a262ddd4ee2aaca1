"""``FileStore``: T3 values as files in one directory (the default backend).

    <root>/<last 2 characters of the key>/<key>       one file per value (256 folders for hex keys)
    <root>/.tmp/<key>.<pid>.<thread>.<n>             a value being written

A write goes to a temp file in ``.tmp`` (same file system) and is renamed over its final name:
``rename`` is atomic, so a reader sees the old value, the new one or none, never a torn file, and two
processes writing the same content-addressed key are harmless. ``fsync=True`` also syncs the file
before the rename (and survives power loss, at the cost of a disk flush per value); without it a
crash can leave a short or empty file, which the format's checksum turns into a counted miss.
Temp files older than an hour (a writer that died) are removed when a store opens the directory.

A new ``FileStore`` on the same directory finds what earlier ones wrote: that is how a restarted
engine starts warm. There is no size limit or eviction here (left to the operator, e.g. a cron job
removing the oldest files; a missing file is just a miss).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Sequence
from typing import Optional

from tiered_cache.errors import InvalidArgumentError, StorageUnavailableError
from tiered_cache.storage.backend import Buffer, StorageBackend

_STALE_TMP_S = 3600.0


class FileStore(StorageBackend):
    """Values as files under ``root`` (created if missing)."""

    name = "file"

    def __init__(self, root: str, *, fsync: bool = False) -> None:
        if not isinstance(root, (str, os.PathLike)) or not str(root):
            raise InvalidArgumentError("root", "a directory path", root)
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync
        self._tmp = os.path.join(self.root, ".tmp")
        self._n = itertools.count()
        try:
            os.makedirs(self._tmp, exist_ok=True)
        except OSError as e:
            raise StorageUnavailableError(f"file store {self.root}", e) from e
        self._clean_stale_tmp()

    def path(self, key: str) -> str:
        if not key or "/" in key or key.startswith("."):
            raise InvalidArgumentError("key", "a non-empty file name not starting with '.'", key)
        return os.path.join(self.root, key[-2:], key)

    def get_many(self, keys: Sequence[str]) -> list[Optional[Buffer]]:
        out: list[Optional[Buffer]] = []
        for k in keys:
            try:
                with open(self.path(k), "rb", buffering=0) as f:
                    out.append(_read_all(f))
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                raise StorageUnavailableError(f"file store {self.root}", e) from e
        return out

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        for key, parts in items:
            final = self.path(key)
            tmp = os.path.join(self._tmp, f"{key}.{os.getpid()}.{threading.get_ident()}.{next(self._n)}")
            try:
                os.makedirs(os.path.dirname(final), exist_ok=True)
                with open(tmp, "wb", buffering=0) as f:
                    for p in parts:
                        _write_all(f, p)
                    if self.fsync:
                        os.fsync(f.fileno())
                os.replace(tmp, final)
            except OSError as e:
                _unlink_quiet(tmp)
                raise StorageUnavailableError(f"file store {self.root}", e) from e

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [os.path.exists(self.path(k)) for k in keys]

    def delete_many(self, keys: Sequence[str]) -> None:
        for k in keys:
            _unlink_quiet(self.path(k))

    def _clean_stale_tmp(self) -> None:
        now = time.time()
        try:
            for e in os.scandir(self._tmp):
                try:
                    if now - e.stat().st_mtime > _STALE_TMP_S:
                        os.unlink(e.path)
                except OSError:
                    pass
        except OSError:
            pass


def _read_all(f) -> bytearray:
    """The whole file in one buffer: ``readinto`` a buffer of the file's size (one copy from the kernel)."""
    size = os.fstat(f.fileno()).st_size
    buf = bytearray(size)
    mv = memoryview(buf)
    got = 0
    while got < size:
        n = f.readinto(mv[got:])
        if not n:  # shrank under us (another writer replaced it: we hold the old inode, so only truncation)
            del buf[got:]
            break
        got += n
    return buf


def _write_all(f, data: Buffer) -> None:
    mv = memoryview(data).cast("B")
    while mv.nbytes:
        n = f.write(mv)
        mv = mv[n:]


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
