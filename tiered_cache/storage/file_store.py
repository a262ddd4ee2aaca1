"""``FileStore``: T3 values as files in one directory (the default backend).

    <root>/<last 2 characters of the key>/<key>       one file per value (256 folders for hex keys)
    <root>/.tmp/<key>.<pid>.<thread>.<n>             a value being written

A write goes to a temp file in ``.tmp`` (same file system) and is renamed over its final name:
``rename`` is atomic, so a reader sees the old value, the new one or none, never a torn file, and two
processes writing the same content-addressed key are harmless. ``fsync=True`` also syncs the file
before the rename (and survives power loss, at the cost of a disk flush per value); without it a
crash can leave a short or empty file, which the format's checksum turns into a counted miss.
Temp files older than an hour (a writer that died) are removed when a store opens the directory.

Keys are file names from a fixed alphabet (``[A-Za-z0-9_-]``, at most 200 characters): no separator,
no dot, so no key can name a path outside ``root`` (``"evil.."`` once wrote one level above it);
every path is also resolved and checked to lie under the resolved root (a symlinked shard folder
pointing elsewhere is refused too). A file's size is checked against the size the reader expects
(``fstat``) before a byte of it is read or a buffer allocated.

A new ``FileStore`` on the same directory finds what earlier ones wrote: that is how a restarted
engine starts warm. There is no size limit or eviction here (left to the operator, e.g. a cron job
removing the oldest files; a missing file is just a miss).
"""

from __future__ import annotations

import itertools
import os
import re
import threading
import time
from collections.abc import Sequence
from typing import Optional

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, StorageUnavailableError
from tiered_cache.storage.backend import DEFAULT_MAX_VALUE_BYTES, Buffer, Read, Stop, StorageBackend, WrongSize
from tiered_cache.validate import int_arg

_STALE_TMP_S = 3600.0
_KEY_RE = re.compile(r"[A-Za-z0-9_-]{1,200}")
_KEY_TEXT = "1-200 characters of [A-Za-z0-9_-] (no separator, no dot)"


class FileStore(StorageBackend):
    """Values as files under ``root`` (created if missing)."""

    name = "file"

    def __init__(self, root: str, *, fsync: bool = False, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES) -> None:
        if not isinstance(root, (str, os.PathLike)) or not isinstance(os.fspath(root), str):
            raise InvalidTypeError("root", "a directory path (str or os.PathLike)", root)
        if not os.fspath(root):
            raise InvalidArgumentError("root", "a directory path", root)
        if not isinstance(fsync, bool):
            raise InvalidTypeError("fsync", "a bool", fsync)
        self.max_value_bytes = int_arg("max_value_bytes", max_value_bytes, lo=1)
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = fsync
        self._tmp = os.path.join(self.root, ".tmp")
        self._n = itertools.count()
        try:
            os.makedirs(self._tmp, exist_ok=True)
            self._real_root = os.path.realpath(self.root)
        except (OSError, ValueError) as e:  # ValueError: a NUL in the path
            raise StorageUnavailableError(f"file store {self.root}", e) from e
        self._clean_stale_tmp()

    def path(self, key: str) -> str:
        """The file of ``key``, always inside ``root`` (typed error naming ``key`` otherwise)."""
        if not isinstance(key, str):
            raise InvalidTypeError("key", _KEY_TEXT, key)
        if not _KEY_RE.fullmatch(key):
            raise InvalidArgumentError("key", _KEY_TEXT, key)
        p = os.path.join(self.root, key[-2:], key)
        # The alphabet already rules out escapes; resolving also catches a shard folder that is a
        # symlink to elsewhere (planted by someone with write access to the store).
        real = os.path.realpath(p)
        if os.path.commonpath([real, self._real_root]) != self._real_root or real == self._real_root:
            raise InvalidArgumentError("key", f"a key whose file lies under {self._real_root}", key)
        return p

    def _paths(self, keys: Sequence[str]) -> list[str]:
        if not isinstance(keys, (list, tuple)):  # a str would be iterated as one-character keys
            raise InvalidTypeError("keys", "a list or tuple of keys", keys)
        return [self.path(k) for k in keys]  # all checked before any is touched

    def get_many(self, keys: Sequence[str], sizes: Optional[Sequence[Optional[int]]] = None,
                 stop: Stop = None) -> list[Optional[Read]]:
        paths = self._paths(keys)
        if sizes is not None and len(sizes) != len(paths):
            raise InvalidArgumentError("sizes", f"{len(paths)} sizes (one per key)", len(sizes))
        out: list[Optional[Read]] = []
        for i, p in enumerate(paths):
            if stop is not None and stop():
                out += [None] * (len(paths) - i)
                break
            want = None if sizes is None else sizes[i]
            try:
                with open(p, "rb", buffering=0) as f:
                    size = os.fstat(f.fileno()).st_size
                    if (size != want) if want is not None else (size > self.max_value_bytes):
                        out.append(WrongSize(size))  # not read: its size alone says it is not the entry
                        continue
                    out.append(_read_all(f, size))
            except FileNotFoundError:
                out.append(None)
            except OSError as e:
                raise StorageUnavailableError(f"file store {self.root}", e) from e
        return out

    def put_many(self, items: Sequence[tuple[str, Sequence[Buffer]]]) -> None:
        if not isinstance(items, (list, tuple)) or not all(
                isinstance(it, tuple) and len(it) == 2 and isinstance(it[1], (list, tuple)) for it in items):
            raise InvalidTypeError("items", "a list of (key, [bytes-like parts])", items)
        for _, parts in items:
            for p in parts:
                try:
                    memoryview(p)
                except TypeError:
                    raise InvalidTypeError("items", "bytes-like parts", p) from None
        finals = self._paths([key for key, _ in items])
        for (key, parts), final in zip(items, finals):
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
        return [os.path.exists(p) for p in self._paths(keys)]

    def delete_many(self, keys: Sequence[str]) -> None:
        for p in self._paths(keys):
            _unlink_quiet(p)

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


def _read_all(f, size: int) -> bytearray:
    """The whole file (``size`` bytes, from ``fstat``) in one buffer: one copy from the kernel."""
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
