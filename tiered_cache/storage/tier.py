"""``StorageTier`` (T3): moves entries between T2 host slots and a storage backend, off the engine's step.

The surface the radix tree calls (all from the engine's one thread; none of them blocks)::

    keys = tier.keys(tokens)                            # chained page keys (keys.py)
    op = tier.prefetch(keys, Kind.KV, region, slots)    # T3 -> T2: fetch, verify, copy into the slots
    op = tier.write(keys, Kind.KV, region, slots)       # T2 -> T3: write valid slots (demote / write-through)
    op = tier.lookup(keys, Kind.KV)                     # which keys T3 holds (no bytes move)
    for op in tier.poll(): ...                          # finished ops; their effects are applied here
    tier.wait(op, timeout_s)                            # the "wait for completion" policy; always bounded
    tier.cancel(op)                                     # the request was aborted

The work runs on a small thread pool; results are applied to T2 (``region.valid``, ``checksums``,
busy marks) only by ``poll`` / ``wait`` on the calling thread, so T2's bookkeeping never races.

Slots are owned the way ``TransferEngine`` tickets own them: ``prefetch`` and ``write`` mark their
slots busy (``free`` raises ``SlotBusyError``) until ``poll`` reports the op done, because a worker
may still be reading or writing the bytes. A cancelled or timed-out op is reported done only when its
worker has stopped (it checks between sub-batches of ``batch_bytes``, and every backend call has
its own timeout); its prefetched slots stay not ``valid``: the tree frees them.

Whatever goes wrong below (backend down, a value truncated, damaged, of another fingerprint or size)
becomes a miss counted in ``stats`` under its reason; nothing raises to the caller except misuse
(typed errors, nothing changed). While a backend is failing, ops fail fast as ``unavailable`` for
``retry_after_s`` instead of each paying a connect timeout (a circuit breaker). Reads and writes
have a breaker each: a full disk (writes failing) must not turn off reads of what is already stored.

Sizes are the tier's, not the store's: a prefetch expects exactly ``HEADER_SIZE + slot_bytes`` bytes
per value (a ``get``: ``HEADER_SIZE + entry_bytes[kind]`` when given), and the backend refuses a value
of any other stored size or chunk count before fetching or allocating it (``bad_length``). A
multi-round-trip read asks the op's cancel and deadline between round trips. A prefetched slot gets
back the T2 checksum its bytes left the GPU with (kept in the header): the GPU checks them once more.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Optional

import numpy as np

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, StorageFormatError, StorageUnavailableError
from tiered_cache.storage.backend import StorageBackend, WrongSize
from tiered_cache.storage.checks import entry_bytes_arg, key_arg, key_list, kind_arg, payload_list
from tiered_cache.storage.format import HEADER_SIZE, Kind, pack_header, unpack
from tiered_cache.storage.keys import Salt, StorageFingerprint, page_keys
from tiered_cache.storage.op import StorageOp
from tiered_cache.tiers.host_mirror import HostRegion
from tiered_cache.validate import float_arg, int_arg, int_list

log = logging.getLogger(__name__)
_DOWN = object()  # what _backend_call returns while the backend is unreachable


class StorageTier:
    """T3 over ``backend`` for one ``fingerprint`` (and tenant ``salt``).

    Args:
        workers: threads doing backend calls (I/O releases the GIL; CRC-32 of large buffers too).
        batch_bytes: a worker checks for cancel / deadline between sub-batches of about this size.
        retry_after_s: after a backend failure, ops fail fast as ``unavailable`` for this long.
        skip_existing: ``write`` first asks which keys the store has (content-addressed: same key,
            same bytes) and writes only the others.
        entry_bytes: ``{Kind: payload bytes}`` of each kind's envelope, the exact size a ``get`` expects
            (a prefetch takes it from its T2 region); a kind not in it is bounded by the backend's
            ``max_value_bytes``.
    """

    def __init__(self, backend: StorageBackend, fingerprint: StorageFingerprint, *, salt: Salt = None,
                 workers: int = 2, batch_bytes: int = 64 << 20, retry_after_s: float = 2.0,
                 skip_existing: bool = True, entry_bytes: Optional[dict] = None) -> None:
        if not isinstance(backend, StorageBackend):
            raise InvalidTypeError("backend", "a StorageBackend", backend)
        if not isinstance(fingerprint, StorageFingerprint):
            raise InvalidTypeError("fingerprint", "a StorageFingerprint", fingerprint)
        workers = int_arg("workers", workers, lo=1, hi=256)
        batch_bytes = int_arg("batch_bytes", batch_bytes, lo=1)
        retry_after_s = float_arg("retry_after_s", retry_after_s, lo=0)  # inf would never retry
        if not isinstance(skip_existing, bool):
            raise InvalidTypeError("skip_existing", "a bool", skip_existing)
        sizes = entry_bytes_arg("entry_bytes", entry_bytes)
        page_keys([], fingerprint, salt)  # validate salt now, not on the first call
        self.entry_bytes = sizes
        self.backend = backend
        self.fingerprint = fingerprint
        self.salt = salt
        self.tag = fingerprint.tag
        self.batch_bytes = batch_bytes
        self.retry_after_s = retry_after_s
        self.skip_existing = skip_existing
        self.stats: collections.Counter[str] = collections.Counter()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tc-storage")
        self._pending: dict[int, StorageOp] = {}
        self._ids = itertools.count(1)
        # One breaker per direction (written by workers, read by all: a float store is atomic).
        self._down_until = {"read": 0.0, "write": 0.0}

    # ------------------------------------------------------------------------------ keys
    def keys(self, tokens: Sequence[int], parent: Optional[bytes] = None, *, extra_key: Salt = None) -> list[bytes]:
        """Chained keys of the whole pages of ``tokens`` (after ``parent``'s page, if given) for the
        tenant (this tier's ``salt``, the request's ``extra_key``): the one place T3 keys are made."""
        return page_keys(tokens, self.fingerprint, self.salt, extra_key=extra_key, parent=parent)

    @staticmethod
    def storage_key(kind: Kind, key: bytes) -> str:
        return f"{kind_arg('kind', kind).name.lower()}-{key_arg('key', key).hex()}"

    # ------------------------------------------------------------------------------ T2 moves
    def prefetch(self, keys: Sequence[bytes], kind: Kind, region: HostRegion, slots: Sequence[int], *,
                 timeout_s: Optional[float] = None) -> StorageOp:
        """Fetch ``keys`` into the (allocated) host ``slots``; misses leave their slot not ``valid``."""
        keys, slots = self._check_slots(keys, region, slots)
        busy = [s for s in slots if region.allocator.is_busy(s)]
        if busy:
            raise InvalidArgumentError("slots", "slots no transfer is reading or writing", busy[:16])
        op = self._new("prefetch", kind, keys, region, slots, timeout_s)
        region.valid[slots] = False  # being written: not valid until poll applies a verified hit
        region.allocator.mark_busy(slots)
        dests = [region.slot(s).numpy() for s in slots]
        return self._submit(op, self._prefetch_work, op, dests, region.slot_bytes)

    def write(self, keys: Sequence[bytes], kind: Kind, region: HostRegion, slots: Sequence[int], *,
              timeout_s: Optional[float] = None) -> StorageOp:
        """Store the bytes of ``valid`` host ``slots`` under ``keys``. The slots stay busy until done."""
        keys, slots = self._check_slots(keys, region, slots)
        bad = [s for s in slots if not region.valid[s]]
        if bad:
            raise InvalidArgumentError("slots", "valid host slots (complete bytes and checksum)", bad[:16])
        op = self._new("write", kind, keys, region, slots, timeout_s)
        op._t2_checksums = [int(region.checksums[s]) for s in slots]
        region.allocator.mark_busy(slots)
        srcs = [region.slot(s).numpy() for s in slots]
        return self._submit(op, self._write_work, op, srcs)

    def lookup(self, keys: Sequence[bytes], kind: Kind, *, timeout_s: Optional[float] = None) -> StorageOp:
        """Which of ``keys`` the store holds (``hits``); nothing is read or verified."""
        op = self._new("lookup", kind, self._check_keys(keys), None, [], timeout_s)
        return self._submit(op, self._lookup_work, op)

    # ------------------------------------------------------------------------------ bytes (tools, tests)
    def get(self, keys: Sequence[bytes], kind: Kind, *, timeout_s: Optional[float] = None) -> StorageOp:
        op = self._new("get", kind, self._check_keys(keys), None, [], timeout_s)
        return self._submit(op, self._prefetch_work, op, None, None)

    def put(self, keys: Sequence[bytes], kind: Kind, payloads: Sequence[Any], *,
            timeout_s: Optional[float] = None, t2_checksums: Optional[Sequence[int]] = None) -> StorageOp:
        """Store ``payloads`` (bytes-like, read by a worker until the op is done: pass copies) under
        ``keys``. ``t2_checksums``: the T2 checksums a later ``prefetch`` gives back (default 0)."""
        keys = key_list("keys", keys)
        kind_arg("kind", kind)
        srcs = payload_list("payloads", payloads, len(keys))
        sums = [0] * len(keys) if t2_checksums is None else int_list("t2_checksums", t2_checksums)
        if len(sums) != len(keys) or any(not -(1 << 63) <= c < 1 << 63 for c in sums):
            raise InvalidArgumentError("t2_checksums", f"{len(keys)} int64 checksums", t2_checksums)
        op = self._new("put", kind, keys, None, [], timeout_s)
        op._t2_checksums = sums
        return self._submit(op, self._write_work, op, srcs)

    # ------------------------------------------------------------------------------ completion
    def poll(self) -> list[StorageOp]:
        """Ops that finished since the last call, their effects applied. Never blocks."""
        out = []
        now = time.monotonic()
        for op in list(self._pending.values()):
            if op._future.done():
                out.append(self._finish(op))
            elif op.deadline is not None and now > op.deadline and not op.cancelled:
                op.timed_out = True  # discarded like a cancel; reported once the worker has stopped
                self._cancel(op)
                if op._future.done():
                    out.append(self._finish(op))
        return out

    def wait(self, op: StorageOp, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for ``op``; True when it is done (effects applied here, so ``poll``
        does not report it again)."""
        self._check_op(op)
        timeout_s = float_arg("timeout_s", timeout_s, lo=0)
        if op.done:
            return True
        try:
            op._future.result(timeout=timeout_s)
        except (FutureTimeout, CancelledError):
            pass
        except Exception:
            pass  # recorded by _finish
        if op._future.done():
            self._finish(op)
        return op.done

    def cancel(self, op: StorageOp) -> None:
        """Stop ``op`` (its request was aborted). Results are discarded; ``poll`` reports it done
        once its worker has stopped, and only then are its slots free to reuse."""
        self._check_op(op)
        if not op.done and not op.cancelled:
            self._cancel(op)

    def pending(self) -> int:
        return len(self._pending)

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel the reads in flight, let the writes land (a restart reads them back) within ``timeout_s``
        (then cancel the rest), stop the workers (bounded by the backend's timeouts), close the backend."""
        timeout_s = float_arg("timeout_s", timeout_s, lo=0)
        for op in [op for op in self._pending.values() if op.op not in ("write", "put")]:
            self._cancel(op)
        deadline = time.monotonic() + timeout_s
        for op in list(self._pending.values()):
            if not self.wait(op, max(0.0, deadline - time.monotonic())):
                self._cancel(op)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.backend.close()

    # ------------------------------------------------------------------------------ internals
    def _check_op(self, op: Any) -> None:
        if not isinstance(op, StorageOp):
            raise InvalidTypeError("op", "a StorageOp of this tier", op)
        if not op.done and self._pending.get(op.id) is not op:
            raise InvalidArgumentError("op", "a StorageOp of this tier", op.id)

    def _check_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        return key_list("keys", keys)

    def _check_slots(self, keys, region, slots) -> tuple[list[bytes], list[int]]:
        keys = self._check_keys(keys)
        if not isinstance(region, HostRegion):
            raise InvalidTypeError("region", "a HostRegion", region)
        lst = region.allocator.check("slots", slots)
        if len(lst) != len(keys):
            raise InvalidArgumentError("slots", f"one slot per key ({len(keys)})", len(lst))
        return keys, lst

    def _new(self, name, kind, keys, region, slots, timeout_s) -> StorageOp:
        kind = kind_arg("kind", kind)
        if timeout_s is not None:  # None: no deadline; NaN or inf would be one that never comes
            timeout_s = float_arg("timeout_s", timeout_s, lo=0, lo_open=True)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        return StorageOp(next(self._ids), name, kind, keys, region, slots, deadline)

    def _submit(self, op: StorageOp, fn, *args) -> StorageOp:
        self._pending[op.id] = op
        op._future = self._pool.submit(fn, *args)
        return op

    def _cancel(self, op: StorageOp) -> None:
        op.cancelled = True
        op._future.cancel()  # succeeds only if no worker has started it

    def _finish(self, op: StorageOp) -> StorageOp:
        if op.done:
            return op
        n = len(op.keys)
        counts: collections.Counter[str] = collections.Counter()
        hits, extra = [False] * n, [None] * n  # type: list[bool], list[Any]  # the worker's per-key results
        if op._future.cancelled():
            counts["timed_out" if op.timed_out else "cancelled"] += n
        else:
            exc = op._future.exception()
            if exc is not None:  # a bug, not a storage fault: counted and logged, never raised into the step
                log.warning("storage %s op failed: %r", op.op, exc)
                op.error = repr(exc)
                counts["error"] += n
            else:
                hits, extra, worker_counts = op._future.result()
                if worker_counts.pop("_stopped", 0) and not op.cancelled:
                    op.timed_out = True  # the worker saw the deadline pass before poll did
                counts.update(worker_counts)
        if op.timed_out or op.cancelled:
            lost = sum(hits) if op.op in ("prefetch", "get") else 0
            counts["timed_out" if op.timed_out else "cancelled"] += lost
            counts["hit"] -= lost
            if op.op in ("prefetch", "get"):
                hits = [False] * n
        op.hits = hits
        if op.op == "prefetch" and op.region is not None:
            for s, h, cs in zip(op.slots, hits, extra):
                if h:
                    op.region.checksums[s] = cs
                    op.region.valid[s] = True
        elif op.op == "get":
            op.values = [v if h else None for v, h in zip(extra, hits)]
        if op.region is not None:
            op.region.allocator.unmark_busy(op.slots)
        counts += collections.Counter()  # drop zero / negative entries
        self.stats.update(counts)
        op.done = True
        del self._pending[op.id]
        return op

    def _backend_call(self, direction: str, fn, *args, **kw):
        """A backend call's result, or ``_DOWN`` when the backend is down for ``direction`` (``"read"``
        or ``"write"``: its breaker is open, or the call just failed and opened it)."""
        if time.monotonic() < self._down_until[direction]:
            return _DOWN
        try:
            return fn(*args, **kw)
        except StorageUnavailableError as e:
            log.warning("storage backend %s unavailable for %ss (misses for %.1f s): %s", self.backend.name,
                        direction, self.retry_after_s, e)
            self._down_until[direction] = time.monotonic() + self.retry_after_s
            return _DOWN

    # Workers: no T2 bookkeeping here (poll applies results); counts returned, merged by _finish.
    def _prefetch_work(self, op: StorageOp, dests: Optional[list[np.ndarray]], slot_bytes: Optional[int]):
        n = len(op.keys)
        counts: collections.Counter[str] = collections.Counter()
        hits, extra = [False] * n, [None if dests is None else 0] * n  # type: list[bool], list[Any]
        payload = slot_bytes if slot_bytes is not None else self.entry_bytes.get(op.kind)
        size = None if payload is None else HEADER_SIZE + payload
        per = max(1, self.batch_bytes // (slot_bytes or self.batch_bytes))
        for s in range(0, n, per):
            if op._stop():
                counts["cancelled" if op.cancelled and not op.timed_out else "timed_out"] += n - s
                counts["_stopped"] = 1
                break
            idx = range(s, min(n, s + per))
            vals = self._backend_call("read", self.backend.get_many,
                                      [self.storage_key(op.kind, op.keys[i]) for i in idx], [size] * len(idx),
                                      op._stop)
            if vals is _DOWN:
                counts["unavailable"] += len(idx)
                continue
            if op._stop():  # stopped inside the read: what it returned may be partial
                counts["cancelled" if op.cancelled and not op.timed_out else "timed_out"] += n - s
                counts["_stopped"] = 1
                break
            for i, v in zip(idx, vals):
                if v is None:
                    counts["absent"] += 1
                    continue
                if isinstance(v, WrongSize):  # refused by its stored size / chunk layout, before it was read
                    counts["bad_length"] += 1  # (a cut file is one of another size: not read to tell)
                    continue
                try:
                    h, parts = unpack(v, kind=op.kind, tag=self.tag, key=op.keys[i])
                except StorageFormatError as e:
                    counts[f"bad_{e.reason}"] += 1
                    continue
                if dests is None:
                    extra[i] = b"".join(parts)
                elif h.payload_len != slot_bytes:  # same fingerprint, other envelope size: not ours to serve
                    counts["bad_length"] += 1
                    continue
                else:
                    pos = 0
                    for p in parts:
                        dests[i][pos:pos + p.nbytes] = np.frombuffer(p, dtype=np.uint8)
                        pos += p.nbytes
                    extra[i] = h.t2_checksum
                hits[i] = True
                counts["hit"] += 1
        return hits, extra, counts

    def _write_work(self, op: StorageOp, srcs: list[np.ndarray]):
        n = len(op.keys)
        counts: collections.Counter[str] = collections.Counter()
        done = [False] * n
        skeys = [self.storage_key(op.kind, k) for k in op.keys]
        todo = list(range(n))
        if self.skip_existing:
            have = self._backend_call("write", self.backend.exists_many, skeys)
            if have is _DOWN:
                counts["write_unavailable"] += n
                return done, None, counts
            for i in todo:
                done[i] = have[i]
            counts["write_skipped"] += sum(have)
            todo = [i for i in todo if not have[i]]
        per = max(1, self.batch_bytes // max(1, max((s.nbytes for s in srcs), default=1)))
        for s in range(0, len(todo), per):
            if op._stop():
                counts["write_cancelled"] += len(todo) - s
                counts["_stopped"] = 1
                break
            idx = todo[s:s + per]
            items = [(skeys[i], [pack_header(op.kind, srcs[i].data, self.tag, op.keys[i], op._t2_checksums[i]),
                                 srcs[i]]) for i in idx]
            if self._backend_call("write", self.backend.put_many, items) is _DOWN:
                counts["write_unavailable"] += len(idx)
                continue
            for i in idx:
                done[i] = True
            counts["written"] += len(idx)
        return done, None, counts

    def _lookup_work(self, op: StorageOp):
        counts: collections.Counter[str] = collections.Counter()
        have = self._backend_call("read", self.backend.exists_many, [self.storage_key(op.kind, k) for k in op.keys])
        if have is _DOWN:
            counts["unavailable"] += len(op.keys)
            return [False] * len(op.keys), None, counts
        counts["lookup_hit"] += sum(have)
        counts["lookup_absent"] += len(have) - sum(have)
        return list(have), None, counts
