"""T3 format: header round trip, every refusal typed, and the parser fuzzed with >= 100,000 inputs."""

from __future__ import annotations

import os
import random
import struct
import time
import zlib

import pytest

from tiered_cache.errors import IntegrityError, StorageError, StorageFormatError
from tiered_cache.storage.format import HEADER_SIZE, Kind, pack_header, parse_header, unpack

TAG = bytes(range(16))
KEY = bytes(range(100, 132))


def value(payload: bytes, kind=Kind.KV, tag=TAG, key=KEY, cs=-7) -> bytes:
    return pack_header(kind, payload, tag, key, cs) + payload


def test_round_trip_header_fields_and_payload_view():
    payload = os.urandom(1000)
    h, view = unpack(value(payload), kind=Kind.KV, tag=TAG, key=KEY)
    assert (h.kind, h.payload_len, h.t2_checksum, h.tag, h.key) == (Kind.KV, 1000, -7, TAG, KEY)
    assert b"".join(view) == payload and len(pack_header(Kind.STATE, b"", TAG, KEY)) == HEADER_SIZE
    h0, v0 = unpack(value(b"", Kind.STATE), kind=Kind.STATE, tag=TAG, key=KEY)
    assert h0.payload_len == 0 and b"".join(v0) == b""


@pytest.mark.parametrize("mutate, reason", [
    (lambda v: v[:50], "truncated"),
    (lambda v: v[:-1], "truncated"),
    (lambda v: v + b"x", "length"),
    (lambda v: b"XXXX" + v[4:], "magic"),
    (lambda v: v[:20] + bytes([v[20] ^ 1]) + v[21:], "checksum"),          # header byte
    (lambda v: v[:-3] + bytes([v[-3] ^ 0x80]) + v[-2:], "checksum"),       # payload byte
    (lambda v: value(v[HEADER_SIZE:], tag=bytes(16)), "foreign"),          # another fingerprint
    (lambda v: value(v[HEADER_SIZE:], key=bytes(32)), "foreign"),          # written under another key
    (lambda v: value(v[HEADER_SIZE:], kind=Kind.STATE), "foreign"),        # another kind
    (lambda v: _reheader(v, version=2), "version"),
    (lambda v: _reheader(v, flags=1), "version"),
    (lambda v: _reheader(v, kind=9), "kind"),
])
def test_every_bad_value_is_a_typed_refusal(mutate, reason):
    with pytest.raises(StorageFormatError) as ei:
        unpack(mutate(value(os.urandom(300))), kind=Kind.KV, tag=TAG, key=KEY)
    assert ei.value.reason == reason
    assert isinstance(ei.value, IntegrityError) and isinstance(ei.value, StorageError)


def _reheader(v: bytes, **fields) -> bytes:
    """Rewrite header fields and fix the header CRC, as a newer writer (or a forger) would."""
    b = bytearray(v)
    offs = {"version": ("<H", 4), "kind": ("<B", 6), "flags": ("<B", 7)}
    for name, x in fields.items():
        fmt, off = offs[name]
        struct.pack_into(fmt, b, off, x)
    struct.pack_into("<I", b, HEADER_SIZE - 4, zlib.crc32(bytes(b[:HEADER_SIZE - 4])))
    return bytes(b)


def test_parser_fuzz_100k_inputs_only_typed_errors_and_fast():
    rng = random.Random(1234)
    good = [value(os.urandom(n), kind=k) for n, k in ((0, Kind.KV), (17, Kind.STATE), (200, Kind.SWA))]
    n_inputs, accepted = 0, 0
    t0 = time.perf_counter()
    for i in range(100_000):
        mode = i % 5
        base = good[i % 3]
        if mode == 0:  # random bytes of random length, sometimes around the header size
            data = rng.randbytes(rng.choice((0, 1, 3, 4, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1,
                                             rng.randrange(400))))
        elif mode == 1:  # a valid value with 1-4 random bytes changed
            b = bytearray(base)
            for _ in range(rng.randint(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            data = bytes(b)
        elif mode == 2:  # truncated or extended
            cut = rng.randrange(len(base) + 8)
            data = base[:cut] + rng.randbytes(max(0, cut - len(base)))
        elif mode == 3:  # the right magic, then garbage (reaches the CRC and field checks)
            data = b"TCS3" + rng.randbytes(rng.randrange(HEADER_SIZE + 64))
        else:  # header fields rewritten with a valid CRC (reaches version / kind / length checks)
            b = bytearray(base)
            off = rng.randrange(4, HEADER_SIZE - 4)
            b[off] = rng.randrange(256)
            struct.pack_into("<I", b, HEADER_SIZE - 4, zlib.crc32(bytes(b[:HEADER_SIZE - 4])))
            data = bytes(b)
        n_inputs += 1
        try:
            parse_header(data)
            unpack(data, kind=Kind.KV, tag=TAG, key=KEY)
            # The one field a rewrite with a fixed CRC may change is the opaque T2 checksum, which the
            # GPU checks again on promote; everything else must be the KV value as it was.
            same = lambda v: v[:24] + v[32:HEADER_SIZE - 4] + v[HEADER_SIZE:]  # all but t2 checksum, header CRC
            assert same(data) == same(good[0]), "a changed value was accepted"
            accepted += 1
        except StorageFormatError:
            pass
    dt = time.perf_counter() - t0
    assert n_inputs >= 100_000
    assert accepted <= n_inputs // 5  # only mutations that left the one KV value as it was
    assert dt < 20, f"fuzzing took {dt:.1f} s"


def test_accepted_fuzz_values_are_exactly_the_original():
    rng = random.Random(7)
    payload = os.urandom(64)
    base = value(payload)
    for _ in range(20_000):
        b = bytearray(base)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)  # a real change: one flipped bit
        with pytest.raises(StorageFormatError):
            unpack(bytes(b), kind=Kind.KV, tag=TAG, key=KEY)


def test_a_value_in_parts_reads_as_the_whole():
    payload = os.urandom(5000)
    v = value(payload)
    for cuts in ([10], [96], [97, 2000], [50, 60, 4000, 5095]):  # the header itself may be split
        parts = [v[a:b] for a, b in zip([0, *cuts], [*cuts, len(v)])]
        h, view = unpack(parts, kind=Kind.KV, tag=TAG, key=KEY)
        assert b"".join(view) == payload
    with pytest.raises(StorageFormatError, match="truncated"):
        unpack([v[:3000]], kind=Kind.KV, tag=TAG, key=KEY)
    with pytest.raises(StorageFormatError, match="truncated"):
        unpack([], kind=Kind.KV, tag=TAG, key=KEY)
