"""StorageTier over both backends: T2 -> T3 -> T2 byte-exact, faults are counted misses, ops never block
the caller, cancel and timeouts release slots, misuse is a typed error with nothing changed."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest

from tests.support import storage_util
from tests.support.storage_util import FP, check_slots, fill_slots, make_region, wait_done
from tiered_cache.errors import InvalidArgumentError, SlotBusyError
from tiered_cache.storage import FileStore, Kind, RedisStore, StorageTier
from tiered_cache.storage.backend import StorageBackend

redis_server = storage_util.redis_server  # the fixture (by name, through request.getfixturevalue)
SLOT = 20_016  # three Redis chunks of 8 KiB: the chunked path runs in every test
TOKENS = list(range(40))  # 10 pages of 4


@pytest.fixture(params=["file", "redis"])
def backend(request, tmp_path):
    if request.param == "file":
        b = FileStore(str(tmp_path / "t3"))
    else:
        srv = request.getfixturevalue("redis_server")
        b = RedisStore("127.0.0.1", srv.port, prefix=f"t{uuid.uuid4().hex[:8]}:", chunk_bytes=8192)
    yield b
    b.close()


def written(tier, region, keys, kind=Kind.KV):
    slots = region.alloc(len(keys))
    fill_slots(region, slots, keys)
    op = wait_done(tier, tier.write(keys, kind, region, slots))
    assert all(op.hits)
    return slots


def test_write_then_prefetch_is_byte_exact_with_checksums(backend):
    tier = StorageTier(backend, FP, salt="s")
    region = make_region(SLOT, 24)
    keys = tier.keys(TOKENS)
    written(tier, region, keys)
    assert tier.stats["written"] == 10
    dst = region.alloc(10)
    op = tier.prefetch(keys, Kind.KV, region, dst)
    assert region.allocator.is_busy(dst[0]) and not region.valid[dst].any()
    wait_done(tier, op)
    assert op.hits == [True] * 10 and op.hit_prefix == 10
    check_slots(region, dst, keys)
    assert not region.allocator.busy_ids and tier.pending() == 0
    assert tier.stats["hit"] == 10
    region.check_invariants()
    tier.close()


def test_misses_and_hit_prefix_and_kinds(backend):
    tier = StorageTier(backend, FP)
    region = make_region(SLOT, 24)
    keys = tier.keys(TOKENS)
    written(tier, region, [keys[i] for i in (0, 1, 2, 5)])
    written(tier, region, [keys[3]], Kind.STATE)  # a state at page 3's end is not a KV page
    dst = region.alloc(10)
    op = wait_done(tier, tier.prefetch(keys, Kind.KV, region, dst))
    assert op.hits == [True, True, True, False, False, True, False, False, False, False]
    assert op.hit_prefix == 3
    assert region.valid[dst].tolist() == op.hits
    assert tier.stats["absent"] == 6 and tier.stats["hit"] == 4
    st = wait_done(tier, tier.lookup(keys[3:4], Kind.STATE))
    assert st.hits == [True]
    tier.close()


def test_write_skips_what_the_store_has(backend):
    tier = StorageTier(backend, FP)
    region = make_region(SLOT, 24)
    keys = tier.keys(TOKENS)
    written(tier, region, keys[:4])
    written(tier, region, keys[:6])
    assert tier.stats["written"] == 6 and tier.stats["write_skipped"] == 4
    tier.close()


def test_bytes_get_put(backend):
    tier = StorageTier(backend, FP)
    keys = tier.keys(TOKENS[:8])
    payloads = [b"", np.arange(50_000, dtype=np.uint8).tobytes()]
    assert wait_done(tier, tier.put(keys, Kind.BLOB, payloads)).hits == [True, True]
    op = wait_done(tier, tier.get(keys + tier.keys(TOKENS[8:12]), Kind.BLOB))
    assert op.values == payloads + [None] and op.hits == [True, True, False]
    tier.close()


# ------------------------------------------------------------------------------------------ faults
def _raw(backend: StorageBackend, tier: StorageTier, key: bytes, kind=Kind.KV) -> bytes:
    v = backend.get_many([tier.storage_key(kind, key)])[0]
    return b"".join(v) if isinstance(v, list) else bytes(v)


def _set_raw(backend, tier, key: bytes, value: bytes, kind=Kind.KV) -> None:
    backend.put_many([(tier.storage_key(kind, key), [value])])


FAULTS = {  # a value of another size is refused by its size before it is read (issue 17 item 2): bad_length
    "truncated": (lambda v: v[: len(v) // 2], "bad_length"),
    "header_only": (lambda v: v[:96], "bad_length"),
    "empty": (lambda v: b"", "bad_length"),
    "payload_byte_flipped": (lambda v: v[:5000] + bytes([v[5000] ^ 0x10]) + v[5001:], "bad_checksum"),
    "header_byte_flipped": (lambda v: v[:40] + bytes([v[40] ^ 1]) + v[41:], "bad_checksum"),
    "garbage": (lambda v: b"\x00" * len(v), "bad_magic"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_damaged_values_are_counted_misses_never_served(backend, fault):
    tier = StorageTier(backend, FP)
    region = make_region(SLOT, 24)
    keys = tier.keys(TOKENS[:12])
    written(tier, region, keys)
    mutate, reason = FAULTS[fault]
    _set_raw(backend, tier, keys[1], mutate(_raw(backend, tier, keys[1])))
    dst = region.alloc(3)
    op = wait_done(tier, tier.prefetch(keys, Kind.KV, region, dst))
    assert op.hits == [True, False, True] and op.hit_prefix == 1
    assert not region.valid[dst[1]]
    assert tier.stats[reason] == 1 and tier.stats["hit"] == 2 and tier.stats["error"] == 0
    check_slots(region, [dst[0], dst[2]], [keys[0], keys[2]])
    tier.close()


def test_a_value_of_another_model_under_our_key_is_foreign(backend):
    import dataclasses

    ours = StorageTier(backend, FP)
    theirs = StorageTier(backend, dataclasses.replace(FP, model_id="test/other-model"))
    region = make_region(SLOT, 24)
    mine, k_theirs = ours.keys(TOKENS[:12]), theirs.keys(TOKENS[:4])
    written(theirs, region, k_theirs)
    written(ours, region, mine[2:])
    # A store bug, a hash collision or a careless tool puts their bytes under our key: refuse them.
    _set_raw(backend, ours, mine[0], _raw(backend, theirs, k_theirs[0]))
    # Our own bytes under another of our keys (a misplaced value) are refused too.
    _set_raw(backend, ours, mine[1], _raw(backend, ours, mine[2]))
    dst = region.alloc(3)
    op = wait_done(ours, ours.prefetch(mine, Kind.KV, region, dst))
    assert op.hits == [False, False, True] and ours.stats["bad_foreign"] == 2
    ours.close()
    theirs.close()


def test_a_value_of_another_envelope_size_is_not_served(backend):
    tier = StorageTier(backend, FP)
    small, big = make_region(SLOT - 16, 4), make_region(SLOT, 4)
    keys = tier.keys(TOKENS[:4])
    written(tier, small, keys)
    dst = big.alloc(1)
    op = wait_done(tier, tier.prefetch(keys, Kind.KV, big, dst))
    assert op.hits == [False] and tier.stats["bad_length"] == 1 and not big.valid[dst[0]]
    tier.close()


# ------------------------------------------------------------------------------------------ async
class GateBackend(StorageBackend):
    """Holds every call until ``gate`` opens (or 10 s pass): ops stay in flight as long as a test wants."""

    name = "gate"

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _hold(self):
        self.entered.set()
        self.gate.wait(10)

    def get_many(self, keys, sizes=None, stop=None):
        self._hold()
        return self.inner.get_many(keys, sizes, stop)

    def put_many(self, items):
        self._hold()
        return self.inner.put_many(items)

    def exists_many(self, keys):
        self._hold()
        return self.inner.exists_many(keys)

    def delete_many(self, keys):
        return self.inner.delete_many(keys)


def _gated(backend, tmp_path):
    tier = StorageTier(backend, FP)
    region = make_region(SLOT, 24)
    keys = tier.keys(TOKENS)
    written(tier, region, keys)
    tier.close(timeout_s=5)
    gate = GateBackend(backend)
    return StorageTier(gate, FP, batch_bytes=SLOT * 2), gate, region, keys


def test_close_lets_writes_in_flight_land_and_cancels_reads(backend, tmp_path):
    """A write-through is what a restarted engine reads back: ``close`` waits for the writes in flight
    (a running one and ones still queued behind it) and cancels the reads. CI once lost a state this way:
    an engine closed right after serving cancelled its queued write-throughs."""
    gate = GateBackend(backend)
    tier = StorageTier(gate, FP, workers=1)
    region = make_region(SLOT, 24)
    keys = tier.keys(TOKENS)
    slots = region.alloc(len(keys))
    fill_slots(region, slots, keys)
    ops = [tier.write(keys[:5], Kind.KV, region, slots[:5]),
           tier.put(keys[5:], Kind.KV, [region.slot(s).numpy().copy() for s in slots[5:]],
                    t2_checksums=[int(region.checksums[s]) for s in slots[5:]])]
    read = tier.lookup(keys, Kind.STATE)  # queued behind the writes: cancelled
    assert gate.entered.wait(5)
    threading.Timer(0.2, gate.gate.set).start()  # the backend answers only once close has begun
    tier.close(timeout_s=5)
    assert all(op.done and not op.cancelled and all(op.hits) for op in ops), [op.hits for op in ops]
    assert read.done and read.cancelled
    again = StorageTier(backend, FP)
    dst = make_region(SLOT, 10)
    dst_slots = dst.alloc(10)
    got = wait_done(again, again.prefetch(keys, Kind.KV, dst, dst_slots))
    assert all(got.hits)
    check_slots(dst, dst_slots, keys)
    again.close()


def test_ops_never_block_and_busy_slots_cannot_be_freed(backend, tmp_path):
    tier, gate, region, keys = _gated(backend, tmp_path)
    dst = region.alloc(10)
    t0 = time.perf_counter()
    op = tier.prefetch(keys, Kind.KV, region, dst)
    assert tier.poll() == [] and not op.done
    assert time.perf_counter() - t0 < 0.5
    with pytest.raises(SlotBusyError):
        region.free(dst[:1])
    with pytest.raises(InvalidArgumentError, match="slots"):  # a second op on slots in flight
        tier.prefetch(keys[:1], Kind.KV, region, dst[:1])
    assert not tier.wait(op, 0.05)
    gate.gate.set()
    wait_done(tier, op)
    assert all(op.hits)
    region.free(dst)
    region.check_invariants()
    tier.close()


def test_cancel_discards_results_and_releases_slots_when_the_worker_stops(backend, tmp_path):
    tier, gate, region, keys = _gated(backend, tmp_path)
    dst = region.alloc(10)
    op = tier.prefetch(keys, Kind.KV, region, dst)
    assert gate.entered.wait(5)
    tier.cancel(op)
    assert tier.poll() == []  # the worker is still inside a backend call: slots stay busy
    assert region.allocator.is_busy(dst[0])
    gate.gate.set()
    wait_done(tier, op)
    assert op.cancelled and not any(op.hits) and not region.valid[dst].any()
    assert tier.stats["cancelled"] == 10 and tier.stats["hit"] == 0
    region.free(dst)  # no longer busy
    queued = tier.prefetch(keys[:2], Kind.KV, region, region.alloc(2))
    tier.cancel(queued)
    wait_done(tier, queued)
    assert queued.cancelled and not any(queued.hits)
    tier.close()


def test_timeout_policy(backend, tmp_path):
    tier, gate, region, keys = _gated(backend, tmp_path)
    dst = region.alloc(10)
    op = tier.prefetch(keys, Kind.KV, region, dst, timeout_s=0.05)
    time.sleep(0.1)
    assert tier.poll() == [] and op.timed_out  # marked at once, reported when the worker stops
    gate.gate.set()
    deadline = time.monotonic() + 10
    while not op.done and time.monotonic() < deadline:
        tier.poll()
        time.sleep(0.01)
    assert op.done and not any(op.hits) and not region.valid[dst].any()
    assert tier.stats["timed_out"] == 10 and not region.allocator.busy_ids
    tier.close()


def test_an_unexpected_backend_exception_is_counted_not_raised(tmp_path):
    class Broken(FileStore):
        def get_many(self, keys, sizes=None, stop=None):
            raise RuntimeError("bug")

    tier = StorageTier(Broken(str(tmp_path)), FP)
    region = make_region(SLOT, 4)
    op = wait_done(tier, tier.prefetch(tier.keys(TOKENS[:8]), Kind.KV, region, region.alloc(2)))
    assert op.hits == [False, False] and "bug" in op.error and tier.stats["error"] == 2
    assert not region.allocator.busy_ids
    tier.close()


def test_misuse_is_a_typed_error_and_changes_nothing(tmp_path):
    tier = StorageTier(FileStore(str(tmp_path)), FP)
    region = make_region(SLOT, 4)
    keys = tier.keys(TOKENS[:8])
    slots = region.alloc(2)
    with pytest.raises(InvalidArgumentError, match="keys"):
        tier.prefetch([b"short", keys[1]], Kind.KV, region, slots)
    with pytest.raises(InvalidArgumentError, match="slots"):
        tier.prefetch(keys, Kind.KV, region, slots[:1])
    with pytest.raises(InvalidArgumentError, match="slots"):
        tier.prefetch(keys, Kind.KV, region, [3, 4])  # not allocated
    with pytest.raises(InvalidArgumentError, match="slots"):
        tier.write(keys, Kind.KV, region, slots)  # not valid: nothing complete to write
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        tier.lookup(keys, Kind.KV, timeout_s=0)
    with pytest.raises(ValueError):
        tier.lookup(keys, 42)
    assert tier.pending() == 0 and not region.allocator.busy_ids and not tier.stats
    tier.close()


NAN, INF = float("nan"), float("inf")
TIER_SETTINGS = [("workers", 0), ("workers", 1.5), ("workers", True), ("workers", NAN), ("batch_bytes", 0),
                 ("batch_bytes", INF), ("retry_after_s", NAN), ("retry_after_s", INF), ("retry_after_s", -1.0),
                 ("retry_after_s", "2"), ("skip_existing", 1), ("skip_existing", None), ("entry_bytes", {99: 10}),
                 ("entry_bytes", {Kind.KV: -1}), ("entry_bytes", {Kind.KV: 1.5}), ("entry_bytes", [1])]


@pytest.mark.parametrize("arg, bad", TIER_SETTINGS, ids=[f"{a}={b!r}" for a, b in TIER_SETTINGS])
def test_tier_settings_are_checked(tmp_path, arg, bad):
    """Issue 17 item 8: settings were taken unchecked (a NaN ``retry_after_s`` kept the breaker open or
    shut forever). Each is refused with a typed error naming it."""
    with pytest.raises(InvalidArgumentError) as ei:
        StorageTier(FileStore(str(tmp_path)), FP, **{arg: bad})
    assert ei.value.arg == arg


@pytest.mark.parametrize("bad", [NAN, INF, -INF, 0, -1.0, "1", True])
def test_op_timeouts_are_checked(tmp_path, bad):
    """Issue 17 item 8: ``timeout_s=nan`` made an op whose deadline never came (NaN compares false)."""
    tier = StorageTier(FileStore(str(tmp_path)), FP)
    keys = tier.keys(TOKENS[:8])
    for call in (lambda: tier.lookup(keys, Kind.KV, timeout_s=bad), lambda: tier.get(keys, Kind.KV, timeout_s=bad),
                 lambda: tier.put(keys[:1], Kind.BLOB, [b"x"], timeout_s=bad)):
        with pytest.raises(InvalidArgumentError) as ei:
            call()
        assert ei.value.arg == "timeout_s"
    assert tier.pending() == 0 and not tier.stats
    op = wait_done(tier, tier.lookup(keys, Kind.KV))
    if bad != 0:  # a wait of 0 s is a poll; the rest are refused
        with pytest.raises(InvalidArgumentError, match="timeout_s"):
            tier.wait(op, bad)
    tier.close()


REDIS_SETTINGS = [("socket_timeout", NAN), ("socket_timeout", INF), ("socket_timeout", 0), ("connect_timeout", NAN),
                  ("connect_timeout", -1), ("chunk_bytes", 100), ("chunk_bytes", 4096.0), ("pipeline_bytes", 0),
                  ("ttl_s", 0), ("ttl_s", 1.5), ("socket_read_size", 0), ("db", -1), ("port", 0), ("port", 70000),
                  ("port", "6379"), ("max_value_bytes", 0), ("prefix", None), ("cluster_nodes", [("h", NAN)])]


@pytest.mark.parametrize("arg, bad", REDIS_SETTINGS, ids=[f"{a}={b!r}" for a, b in REDIS_SETTINGS])
def test_redis_settings_are_checked(arg, bad):
    """Issue 17 item 8: a NaN socket timeout never expires; every numeric setting is range-checked."""
    pytest.importorskip("redis")
    with pytest.raises(InvalidArgumentError) as ei:
        RedisStore(**{arg: bad})
    assert ei.value.arg == arg


@pytest.mark.parametrize("arg, bad", [("fsync", 1), ("fsync", "yes"), ("max_value_bytes", 0),
                                      ("max_value_bytes", NAN)])
def test_file_store_settings_are_checked(tmp_path, arg, bad):
    with pytest.raises(InvalidArgumentError) as ei:
        FileStore(str(tmp_path), **{arg: bad})
    assert ei.value.arg == arg


@pytest.mark.parametrize("kw, arg", [(dict(timeout_s=INF), "prefetch_timeout_s"),
                                     (dict(timeout_s=NAN), "prefetch_timeout_s"),
                                     (dict(policy="eager"), "prefetch_policy"),
                                     (dict(write_through=1), "storage_write_through")])
def test_storage_hook_settings_are_checked(tmp_path, kw, arg):
    """Issue 17 item 8 (the radix side of T3): the hook's timeout, policy and switch are checked."""
    from tests.support.storage_util import make_t3_cache
    from tiered_cache.radix.storage_hook import StorageHook

    tier = StorageTier(FileStore(str(tmp_path)), FP)
    cache = make_t3_cache(tier)
    with pytest.raises(InvalidArgumentError) as ei:
        StorageHook(cache, tier, **kw)
    assert ei.value.arg == arg
    tier.close()


@pytest.mark.parametrize("call, arg", [
    (lambda t, k: t.lookup("k" * 32, Kind.KV), "keys"),           # a str is not a list of keys
    (lambda t, k: t.lookup(["k" * 32], Kind.KV), "keys"),         # nor is a list of str
    (lambda t, k: t.lookup(k, "kv"), "kind"),
    (lambda t, k: t.lookup(k, None), "kind"),
    (lambda t, k: t.get(k, 1.0), "kind"),
    (lambda t, k: t.put(k[:1], Kind.BLOB, None), "payloads"),
    (lambda t, k: t.put(k[:1], Kind.BLOB, [3]), "payloads"),
    (lambda t, k: t.put(k[:1], Kind.BLOB, [b"x"], t2_checksums=[1.5]), "t2_checksums"),
    (lambda t, k: t.storage_key("kv", k[0]), "kind"),
    (lambda t, k: t.storage_key(Kind.KV, None), "key"),
    (lambda t, k: t.prefetch(k, Kind.KV, None, [1]), "region"),
    (lambda t, k: t.wait(object(), 1.0), "op"),
    (lambda t, k: t.cancel(None), "op"),
])
def test_wrong_types_are_type_errors_naming_the_argument(tmp_path, call, arg):
    """Issue 17 item 8 (types): these raised builtin ValueError / TypeError / AttributeError, or took a
    str of keys as a list of one-character keys. Now ``InvalidTypeError`` (also a ``TypeError``)."""
    from tiered_cache.errors import InvalidTypeError

    tier = StorageTier(FileStore(str(tmp_path)), FP)
    keys = tier.keys(TOKENS[:8])
    with pytest.raises(InvalidTypeError) as ei:
        call(tier, keys)
    assert ei.value.arg == arg and tier.pending() == 0 and not tier.stats
    tier.close()
