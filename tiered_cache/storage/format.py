"""The stored form of one T3 entry: a fixed 96-byte header, then the raw payload bytes. No pickle.

    offset  size  field
    0       4     magic            b"TCS3"
    4       2     version          FORMAT_VERSION
    6       1     kind             Kind (KV page, recurrent state, SWA page, blob)
    7       1     flags            0 (reserved: a reader of this version refuses anything else)
    8       2     header_len       HEADER_SIZE
    10      2     reserved         0
    12      4     payload_crc      CRC-32 of the payload
    16      8     payload_len      bytes after the header
    24      8     t2_checksum      the T2 slot checksum (kernels/checksum.py) the bytes left the GPU with
    32      16    fingerprint tag  first 16 bytes of StorageFingerprint.digest
    48      32    key              the chain key the value was written under
    80      12    reserved         0
    92      4     header_crc       CRC-32 of bytes [0, 92)
    (all little-endian)

Why CRC-32 for the payload: it catches every burst of up to 32 flipped bits and all but 2**-32 of
random damage, and runs at ~2.4 GB/s on one core of the CPU machines (SHA-256: 1.8, BLAKE2b: 0.65),
faster than the Redis link. The bytes are checked a second time, end to end, on the GPU against
``t2_checksum`` when they are promoted from T2. Not a defence against a writer that forges entries:
keys are salted per tenant, and a store must only be writable by trusted processes.

``parse_header`` and ``unpack`` raise only ``StorageFormatError`` (``reason`` says why) whatever the
input; the fuzz test feeds them 100,000 random and mutated inputs.
"""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from tiered_cache.errors import StorageFormatError

MAGIC = b"TCS3"
FORMAT_VERSION = 1
HEADER_SIZE = 96
_HEAD = struct.Struct("<4sHBBHHIQq16s32s12s")  # everything before header_crc
assert _HEAD.size == HEADER_SIZE - 4
_CRC = struct.Struct("<I")
_ZERO12 = bytes(12)

Buffer = Union[bytes, bytearray, memoryview]


class Kind(enum.IntEnum):
    KV = 1      # one full-attention KV page envelope (all layers of one page)
    STATE = 2   # one recurrent-state envelope at a page's end (T1 format)
    SWA = 3     # one sliding-window KV page envelope
    BLOB = 15   # anything else (tools, tests)


@dataclass(frozen=True)
class Header:
    kind: Kind
    payload_len: int
    payload_crc: int
    t2_checksum: int
    tag: bytes
    key: bytes


def pack_header(kind: Kind, payload: Buffer, tag: bytes, key: bytes, t2_checksum: int = 0) -> bytes:
    """The header of ``payload`` (CRC taken here: the one pass over the payload a write makes)."""
    mv = memoryview(payload).cast("B")
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, int(Kind(kind)), 0, HEADER_SIZE, 0, zlib.crc32(mv), mv.nbytes,
                      int(t2_checksum), tag, key, _ZERO12)
    return head + _CRC.pack(zlib.crc32(head))


_BYTE_FORMATS = ("B", "b", "c")


def _byte_view(data: object) -> memoryview:
    """``data`` as a flat byte view, or ``StorageFormatError("type")``: whatever a backend (or a caller)
    hands in, the parser's contract is to refuse it with the one error type, never ``TypeError``."""
    try:
        mv = memoryview(data)  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):  # not a buffer (None, str, int, a tensor), or released
        raise StorageFormatError("type", f"a bytes-like value, got {type(data).__name__}") from None
    if mv.format not in _BYTE_FORMATS or mv.itemsize != 1:
        raise StorageFormatError("type", f"a byte buffer, got a view of format {mv.format!r}")
    if not mv.c_contiguous:
        raise StorageFormatError("type", "a contiguous buffer, got a strided view")
    return mv.cast("B") if mv.ndim != 1 or mv.format != "B" else mv


def parse_header(data: Buffer) -> Header:
    """Parse and check the first ``HEADER_SIZE`` bytes of ``data`` (payload not checked here)."""
    mv = _byte_view(data)
    if mv.nbytes < HEADER_SIZE:
        raise StorageFormatError("truncated", f"{mv.nbytes} bytes, a header has {HEADER_SIZE}")
    if mv[:4] != MAGIC:
        raise StorageFormatError("magic", f"{bytes(mv[:4])!r}")
    (magic, version, kind, flags, header_len, reserved, pcrc, plen, t2cs, tag, key,
     pad) = _HEAD.unpack_from(mv)
    (hcrc,) = _CRC.unpack_from(mv, HEADER_SIZE - 4)
    if zlib.crc32(mv[:HEADER_SIZE - 4]) != hcrc:
        raise StorageFormatError("checksum", "header")
    # A header whose CRC matches but whose fields we do not know comes from another version of the
    # format (or a forger): refuse it rather than guess.
    if version != FORMAT_VERSION:
        raise StorageFormatError("version", f"{version}, this reader knows {FORMAT_VERSION}")
    if header_len != HEADER_SIZE or flags or reserved or pad != _ZERO12:
        raise StorageFormatError("version", "unknown header fields")
    try:
        k = Kind(kind)
    except ValueError:
        raise StorageFormatError("kind", f"{kind}") from None
    return Header(k, plen, pcrc, t2cs, tag, key)


def unpack(data: Union[Buffer, Sequence[Buffer]], *, kind: Kind, tag: bytes, key: bytes
           ) -> tuple[Header, list[memoryview]]:
    """Check a whole stored value against what the reader asked for; returns the header and the
    payload as views of ``data`` (no copy). ``data`` may be one buffer or its parts in order (a chunked
    backend need not join them). Raises ``StorageFormatError`` for anything that is not exactly that entry."""
    parts = [_byte_view(p) for p in (data if isinstance(data, (list, tuple)) else (data,))]
    if not parts or parts[0].nbytes < HEADER_SIZE:  # a header split over parts (tiny chunks): join them
        parts = [memoryview(b"".join(parts))]
    h = parse_header(parts[0])
    if h.tag != tag:
        raise StorageFormatError("foreign", "written with another fingerprint")
    if h.key != key:
        raise StorageFormatError("foreign", "written under another key")
    if h.kind != kind:
        raise StorageFormatError("foreign", f"kind {h.kind.name}, asked for {Kind(kind).name}")
    payload = [parts[0][HEADER_SIZE:], *parts[1:]]
    have = sum(p.nbytes for p in payload)
    if have < h.payload_len:
        raise StorageFormatError("truncated", f"payload {have} of {h.payload_len} bytes")
    if have > h.payload_len:
        raise StorageFormatError("length", f"payload {have} bytes, header says {h.payload_len}")
    crc = 0
    for p in payload:
        crc = zlib.crc32(p, crc)
    if crc != h.payload_crc:
        raise StorageFormatError("checksum", "payload")
    return h, payload
