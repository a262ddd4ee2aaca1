"""T3 format: header round trip, every refusal typed, and the parser fuzzed with >= 100,000 inputs."""

from __future__ import annotations

import os
import random
import struct
import time
import zlib

import numpy as np
import pytest
import torch

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


def fuzz(seed: int, n: int) -> tuple[int, int, float]:
    """``n`` random and mutated inputs from ``seed`` (payloads too: the seed alone fixes the run)."""
    rng = random.Random(seed)
    good = [value(rng.randbytes(n_), kind=k) for n_, k in ((0, Kind.KV), (17, Kind.STATE), (200, Kind.SWA))]
    n_inputs, accepted = 0, 0
    t0 = time.perf_counter()
    for i in range(n):
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
            h, payload = unpack(data, kind=Kind.KV, tag=TAG, key=KEY)
        except StorageFormatError:
            continue
        # What an accepted value must be: exactly the one canonical encoding of a KV entry of this tag
        # and key whose payload is what came back. (The old assertion, "the KV value as it was", is
        # untrue: a header rewritten with a fixed CRC may relabel the STATE or SWA entry under the
        # same key as a KV one; the CRC is no defence against a forger, only salted keys and a store
        # writable by trusted processes are. It failed for 7 of seeds 0-19, exactly those.)
        got = b"".join(payload)
        assert data == value(got, cs=h.t2_checksum), "an accepted value is not a canonical KV entry"
        assert h.payload_len == len(got) and h.kind == Kind.KV
        accepted += 1
    return n_inputs, accepted, time.perf_counter() - t0


@pytest.mark.parametrize("seed", [1234, 1, 4])  # 1 and 4 relabel a STATE / SWA entry as KV (see fuzz)
def test_parser_fuzz_100k_inputs_only_typed_errors_and_fast(seed):
    """Issue 17 item 12: this test passed for seed 1234 and failed for 7 of seeds 0-19. Not a parser bug:
    it asserted that every accepted input was the KV value as written, but a header rewritten with a
    valid CRC can turn the kind of a same-key STATE/SWA entry into KV, which is a canonical KV entry.
    The property now checked holds for every seed (0-49 were run by hand): only typed errors, and an
    accepted input is exactly the canonical encoding of what it decodes to."""
    n_inputs, accepted, dt = fuzz(seed, 100_000)
    assert n_inputs >= 100_000
    assert accepted <= n_inputs // 5  # accepted ones come only from the mutation modes of good values
    assert dt < 60, f"fuzzing took {dt:.1f} s"  # a bound on a hang, not a performance claim


def test_a_relabelled_kind_with_a_fixed_crc_is_the_only_header_rewrite_accepted():
    """Issue 17 item 12, the input class seeds 1 and 4 hit: for every single-byte header rewrite with a
    fixed CRC, the accepted ones change only the opaque T2 checksum or relabel the kind to KV."""
    for base_kind in (Kind.KV, Kind.STATE, Kind.SWA):
        base = value(bytes(range(50)), kind=base_kind)
        for off in range(4, HEADER_SIZE - 4):
            for x in (0, 1, 0x80, 0xFF, base[off] ^ 1):
                b = bytearray(base)
                b[off] = x
                struct.pack_into("<I", b, HEADER_SIZE - 4, zlib.crc32(bytes(b[:HEADER_SIZE - 4])))
                if bytes(b) == base:
                    continue
                try:
                    unpack(bytes(b), kind=Kind.KV, tag=TAG, key=KEY)
                except StorageFormatError:
                    continue
                assert 24 <= off < 32 or (off == 6 and x == Kind.KV), (base_kind, off, x)


NOT_BUFFERS = {
    "none": None, "str": "TCS3" + "x" * 200, "int": 12345, "float": 1.5, "list_of_ints": [1, 2, 3],
    "numpy_strided": np.frombuffer(bytes(400), np.uint8)[::2],
    "numpy_2d_strided": np.zeros((4, 200), np.uint8)[:, ::2],
    "numpy_float": np.zeros(100, np.float64),
    "torch_view": torch.zeros(400, dtype=torch.uint8)[::2],
    "torch": torch.zeros(200, dtype=torch.uint8),
    "memoryview_double": memoryview(np.zeros(50, np.float64)),
    "memoryview_int32": memoryview(bytes(400)).cast("i"),
    "memoryview_strided": memoryview(bytes(400))[::2],
    "object": object(),
}


@pytest.mark.parametrize("name", list(NOT_BUFFERS))
def test_non_buffer_input_is_a_format_error_only(name):
    """Issue 17 item 9: ``parse_header`` / ``unpack`` raised TypeError on None, a str or a strided view,
    against their contract of raising only ``StorageFormatError`` whatever the input."""
    data = NOT_BUFFERS[name]
    with pytest.raises(StorageFormatError) as ei:
        parse_header(data)
    assert ei.value.reason in ("type", "truncated", "magic")
    for arg in (data, [data], [value(b"abc")[:50], data]):
        with pytest.raises(StorageFormatError):
            unpack(arg, kind=Kind.KV, tag=TAG, key=KEY)


def test_a_released_view_is_a_format_error():
    """Issue 17 item 9: a released memoryview raised ValueError."""
    mv = memoryview(value(b"abc"))
    mv.release()
    with pytest.raises(StorageFormatError, match="type"):
        parse_header(mv)


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
