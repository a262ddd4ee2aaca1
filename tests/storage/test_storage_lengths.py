"""Every length and count read from storage is checked before it is trusted (issue 17 item 2).

Before the fix one flipped bit in the chunk count of a Redis value made a single read fetch up to
2**32 phantom chunks (2**20: 18.7 s; 2**22: 57 s and 640 MiB), deaf to ``timeout_s`` and ``cancel``.
Here every length/count field (the header's ``header_len`` and ``payload_len``; the Redis frame's
chunk count and total) of a stored entry is mutated, bit by bit and to the extreme values 0, 1,
2**31-1, 2**32-1, 2**63-1 (masked to the field's width), with the header CRC left as it was and
fixed up, in a file-store and a Redis entry. Each read must end as a counted miss, within its deadline
and in bounded memory. The bounds (correctness bounds, loose on purpose): Python memory traced
during the read (``tracemalloc``, every thread) below 2 x the entry's size; wall time below the op's
timeout + 3 s of slack.
"""

from __future__ import annotations

import struct
import time
import tracemalloc
import uuid
import zlib

import pytest

from tests.support import storage_util
from tests.support.storage_util import FP, fill_slots, make_region, wait_done
from tiered_cache.storage import FileStore, Kind, RedisStore, StorageTier
from tiered_cache.storage.format import HEADER_SIZE

redis_server = storage_util.redis_server  # the fixture, used through request.getfixturevalue
SLOT = 64 << 10  # payload bytes: a 64 KiB envelope, 5 Redis chunks of 16 KiB
ENTRY = HEADER_SIZE + SLOT
CHUNK = 16 << 10
FRAME = 16  # b"TCRC", u32 chunk count, u64 total
OP_TIMEOUT_S = 5.0
SLACK_S = 3.0
EXTREMES = (0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1)

# (name, offset in the header, struct format)
HEADER_FIELDS = (("header_len", 8, "<H"), ("payload_len", 16, "<Q"))
FRAME_FIELDS = (("frame_count", 4, "<I"), ("frame_total", 8, "<Q"))


def mutations(fields):
    out = []
    for name, off, fmt in fields:
        bits = struct.calcsize(fmt) * 8
        out += [(name, off, fmt, f"bit{b}", lambda v, b=b: v ^ (1 << b)) for b in range(bits)]
        mask = (1 << bits) - 1
        values = sorted({x & mask for x in EXTREMES})
        out += [(name, off, fmt, f"set{x}", lambda v, x=x: x) for x in values]
    return out


HEADER_CASES = [(*m, fix) for m in mutations(HEADER_FIELDS) for fix in ("crc_kept", "crc_fixed")]
FRAME_CASES = [(*m, "frame") for m in mutations(FRAME_FIELDS)]


class Entry:
    """One KV entry written through a tier, and raw access to its stored bytes."""

    def __init__(self, kind: str, tmp_path, port=None) -> None:
        if kind == "file":
            self.backend = FileStore(str(tmp_path / "t3"))
        else:
            # one chunk per pipeline and per socket read: the client's reply buffer (which holds a whole
            # pipeline's reply once more) is then a chunk, not the entry, and the bound is about the read
            self.backend = RedisStore("127.0.0.1", port, prefix=f"len{uuid.uuid4().hex[:8]}:", chunk_bytes=CHUNK,
                                      socket_read_size=CHUNK, pipeline_bytes=CHUNK)
        self.tier = StorageTier(self.backend, FP)
        self.region = make_region(SLOT, 2)
        self.key = self.tier.keys(list(range(4)))[0]
        self.name = self.tier.storage_key(Kind.KV, self.key)
        s = self.region.alloc(1)
        fill_slots(self.region, s, [self.key])
        assert wait_done(self.tier, self.tier.write([self.key], Kind.KV, self.region, s)).hits == [True]
        self.region.free(s)
        self.original = self.raw()

    # the stored bytes: the whole file, or Redis chunk 0 (frame + the value's first bytes)
    def raw(self) -> bytes:
        if isinstance(self.backend, FileStore):
            with open(self.backend.path(self.name), "rb") as f:
                return f.read()
        return self._redis().get(self.backend._ck(self.name, 0))

    def set_raw(self, b: bytes) -> None:
        if isinstance(self.backend, FileStore):
            with open(self.backend.path(self.name), "wb") as f:
                f.write(b)
        else:
            self._redis().set(self.backend._ck(self.name, 0), b)

    def _redis(self):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.backend.port)

    def header_at(self) -> int:
        return 0 if isinstance(self.backend, FileStore) else FRAME

    def close(self) -> None:
        self.tier.close()


@pytest.fixture(scope="module", params=["file", "redis"])
def entry(request, tmp_path_factory):
    port = request.getfixturevalue("redis_server").port if request.param == "redis" else None
    e = Entry(request.param, tmp_path_factory.mktemp("lengths"), port)
    yield e
    e.close()


@pytest.fixture
def redis_entry(request, tmp_path_factory):
    e = Entry("redis", tmp_path_factory.mktemp("lengths"), request.getfixturevalue("redis_server").port)
    yield e
    e.close()


def mutate(raw: bytes, at: int, off: int, fmt: str, fn, fix: str) -> bytes:
    b = bytearray(raw)
    (v,) = struct.unpack_from(fmt, b, at + off)
    struct.pack_into(fmt, b, at + off, fn(v))
    if fix == "crc_fixed":  # as a forger (or a bug in another writer) would: the header CRC matches
        struct.pack_into("<I", b, at + HEADER_SIZE - 4, zlib.crc32(bytes(b[at:at + HEADER_SIZE - 4])))
    return bytes(b)


def read_is_a_bounded_miss(e: Entry) -> None:
    before = sum(e.tier.stats.values())
    dst = e.region.alloc(1)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        t0 = time.monotonic()
        op = e.tier.prefetch([e.key], Kind.KV, e.region, dst, timeout_s=OP_TIMEOUT_S)
        done = e.tier.wait(op, OP_TIMEOUT_S + SLACK_S)
        dt = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert done, "the read did not end within its deadline + slack"
    assert dt < OP_TIMEOUT_S + SLACK_S
    assert peak < 2 * ENTRY, f"the read allocated {peak} bytes, the entry has {ENTRY}"
    assert op.hits == [False] and not e.region.valid[dst[0]]
    assert e.tier.stats["hit"] == 0 and sum(e.tier.stats.values()) == before + 1, e.tier.stats  # counted once
    e.region.free(dst)


def test_the_entry_reads_back_in_bounded_memory(entry):
    """The control: the unmutated entry is a hit, under the same bound the mutated ones are held to."""
    dst = entry.region.alloc(1)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        op = wait_done(entry.tier, entry.tier.prefetch([entry.key], Kind.KV, entry.region, dst))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert op.hits == [True] and peak < 2 * ENTRY, peak
    entry.region.free(dst)
    entry.tier.stats.clear()


@pytest.mark.parametrize("name, off, fmt, how, fn, fix", HEADER_CASES,
                         ids=[f"{c[0]}-{c[3]}-{c[5]}" for c in HEADER_CASES])
def test_a_mutated_header_length_is_a_bounded_miss(entry, name, off, fmt, how, fn, fix):
    bad = mutate(entry.original, entry.header_at(), off, fmt, fn, fix)
    assert bad != entry.original
    entry.set_raw(bad)
    try:
        read_is_a_bounded_miss(entry)
    finally:
        entry.set_raw(entry.original)


@pytest.mark.parametrize("name, off, fmt, how, fn, fix", FRAME_CASES,
                         ids=[f"{c[0]}-{c[3]}" for c in FRAME_CASES])
def test_a_mutated_redis_frame_is_a_bounded_miss(redis_entry, name, off, fmt, how, fn, fix):
    """The Redis chunk count and total: a read must not fetch (or list) chunks on their say-so."""
    e = redis_entry
    (n,) = struct.unpack_from("<I", e.original, 4)
    assert n == 5  # the layout this test means: chunk 0 and four more
    bad = mutate(e.original, 0, off, fmt, fn, fix)
    assert bad != e.original
    e.set_raw(bad)
    read_is_a_bounded_miss(e)
    e.backend.delete_many([e.name])  # a damaged count must not make delete walk 2**32 names either
    assert not e.backend.exists_many([e.name])[0]


class SlowRedis(RedisStore):
    """Each round trip takes ``delay_s`` (a slow link): a multi-chunk read spans many of them."""

    delay_s = 0.1

    def _run(self, fill):
        time.sleep(self.delay_s)
        return super()._run(fill)


@pytest.mark.parametrize("stop_by", ["deadline", "cancel"])
def test_a_multi_chunk_read_stops_between_chunks(redis_server, stop_by):
    """Issue 17 item 2: a chunked read honours the op's deadline and cancel between round trips. One
    chunk per pipeline and 100 ms a round trip: the 17-round-trip read of one entry takes 1.7 s, and
    the op must end within ~0.3 s of its deadline (0.5 s) or its cancel (at 0.3 s), the slot not valid."""
    store = SlowRedis("127.0.0.1", redis_server.port, prefix=f"slow{uuid.uuid4().hex[:8]}:", chunk_bytes=4096,
                      pipeline_bytes=4096)
    tier = StorageTier(store, FP)
    region = make_region(SLOT, 2)
    key = tier.keys(list(range(4)))[0]
    s = region.alloc(1)
    fill_slots(region, s, [key])
    store.delay_s = 0.0
    assert wait_done(tier, tier.write([key], Kind.KV, region, s)).hits == [True]
    store.delay_s = 0.1
    dst = region.alloc(1)
    t0 = time.monotonic()
    op = tier.prefetch([key], Kind.KV, region, dst, timeout_s=0.5 if stop_by == "deadline" else None)
    if stop_by == "cancel":
        time.sleep(0.3)
        tier.cancel(op)
    while not op.done and time.monotonic() - t0 < 10:
        tier.poll()
        time.sleep(0.01)
    dt = time.monotonic() - t0
    assert op.done and op.hits == [False] and not region.valid[dst[0]] and not region.allocator.busy_ids
    assert dt < 0.8, f"the read went on for {dt:.2f} s after its {stop_by}"
    assert tier.stats["timed_out" if stop_by == "deadline" else "cancelled"] == 1, tier.stats
    store.delay_s = 0.0
    op = wait_done(tier, tier.prefetch([key], Kind.KV, region, dst))  # the control: unhurried, it is a hit
    assert op.hits == [True]
    tier.close()
