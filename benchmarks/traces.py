"""Request traces in the Mooncake format: load, check, turn into token ids, and the reuse bound.

The format (``../shared/traces/README.md``): one JSON object a line, ``timestamp`` (arrival, ms from
the start), ``input_length`` / ``output_length`` (tokens) and ``hash_ids``, the prompt's 512-token
blocks as remapped prefix-block hashes: equal ids at equal positions are the same tokens, so two
requests whose first k ids agree share a prefix of k blocks; the last block may be partial.

    trace = load_trace(path)                       # list[TraceRequest], checked line by line
    ids = prompt_tokens(trace[0], vocab=151_936)   # input_length token ids, the same for the same blocks
    unbounded_reuse(trace)                         # 0.374 for the shipped conversation trace

Token ids: every hash id gets its own seeded run of ``block`` ids (a counter hash of (seed, hash id,
position): no generator state, so the same id gives the same tokens in any request, any order, any
process); a prompt is its blocks' runs cut to ``input_length``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from tiered_cache.errors import InvalidArgumentError

BLOCK = 512  # tokens per hash id in the Mooncake traces
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceFormatError(InvalidArgumentError):
    """A trace line is not a valid request: ``line`` (1-based) and ``field`` say where; ``arg`` reads
    ``<path>:<line> <field>``."""

    def __init__(self, path: str, line: int, field: str, expected: str, got: Any):
        self.path, self.line, self.field = path, line, field
        super().__init__(f"{path}:{line} {field}", expected, got)


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. ``hash_ids``: its prompt's blocks (``ceil(input_length / block)`` of them)."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _request(obj: Any, path: str, line: int, block: int) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceFormatError(path, line, "line", "a JSON object", obj)
    for f in _FIELDS:
        if f not in obj:
            raise TraceFormatError(path, line, f, "present", f"keys {sorted(obj)}")
    for f, lo in (("timestamp", 0), ("input_length", 1), ("output_length", 0)):
        if not _int(obj[f]) or obj[f] < lo:
            raise TraceFormatError(path, line, f, f"an int >= {lo}", obj[f])
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(_int(h) and h >= 0 for h in ids):
        raise TraceFormatError(path, line, "hash_ids", "a list of ints >= 0", ids)
    need = math.ceil(obj["input_length"] / block)
    if len(ids) != need:
        raise TraceFormatError(path, line, "hash_ids", f"{need} ids (ceil(input_length {obj['input_length']} / "
                               f"{block}))", f"{len(ids)} ids")
    return TraceRequest(obj["timestamp"], obj["input_length"], obj["output_length"], tuple(ids))


def load_trace(path: str, *, limit: Optional[int] = None, block: int = BLOCK) -> list[TraceRequest]:
    """The first ``limit`` requests (None: all) of the trace file at ``path``, checked: every field
    present and of its type, ``len(hash_ids) == ceil(input_length / block)``, timestamps that never go
    back, and prefix-consistent ids (an id always at the same position after the same id: the format's
    meaning of a prefix hash). Blank lines are skipped. A bad line raises ``TraceFormatError`` naming
    the line and the field; an empty trace is one too (line 0)."""
    if limit is not None and (not _int(limit) or limit < 1):
        raise InvalidArgumentError("limit", "None or an int >= 1", limit)
    if not _int(block) or block < 1:
        raise InvalidArgumentError("block", "an int >= 1", block)
    out: list[TraceRequest] = []
    parent: dict[int, tuple[int, int]] = {}  # hash id -> (position, previous id; -1 at position 0)
    with open(path) as f:
        for line, text in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                got = f"{text.strip()[:60]!r} ({e.msg})"
                raise TraceFormatError(path, line, "line", "one JSON object", got) from None
            r = _request(obj, path, line, block)
            if out and r.timestamp_ms < out[-1].timestamp_ms:
                raise TraceFormatError(path, line, "timestamp", f">= the previous line's {out[-1].timestamp_ms}",
                                       r.timestamp_ms)
            prev = -1
            for i, h in enumerate(r.hash_ids):
                want = parent.setdefault(h, (i, prev))
                if want != (i, prev):
                    raise TraceFormatError(path, line, "hash_ids",
                                           f"id {h} at position {want[0]} after {want[1]} as before",
                                           f"position {i} after {prev}")
                prev = h
            out.append(r)
    if not out:
        raise TraceFormatError(path, 0, "line", "at least one request", "an empty trace")
    return out


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 (wrapping arithmetic): a counter -> 64 well-mixed bits."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def block_tokens(hash_ids: Sequence[int], *, vocab: int, block: int = BLOCK, seed: int = 0) -> np.ndarray:
    """``[len(hash_ids), block]`` int64 token ids in ``[0, vocab)``: row i is hash id i's run, a function
    of (seed, id, position) only."""
    if not _int(vocab) or vocab < 2:
        raise InvalidArgumentError("vocab", "an int >= 2", vocab)
    if not _int(block) or block < 1:
        raise InvalidArgumentError("block", "an int >= 1", block)
    if not _int(seed) or seed < 0:
        raise InvalidArgumentError("seed", "an int >= 0", seed)
    ids = np.asarray(hash_ids, dtype=np.int64)
    if ids.ndim != 1 or (ids < 0).any():
        raise InvalidArgumentError("hash_ids", "a flat sequence of ints >= 0", hash_ids)
    with np.errstate(over="ignore"):
        key = _mix(ids.astype(np.uint64) ^ _mix(np.array([seed], dtype=np.uint64)))  # one stream per (seed, id)
        x = _mix(key[:, None] + np.arange(1, block + 1, dtype=np.uint64)[None, :] * np.uint64(0x9E3779B97F4A7C15))
    return (x % np.uint64(vocab)).astype(np.int64)


def prompt_tokens(req: TraceRequest, *, vocab: int, block: int = BLOCK, seed: int = 0) -> list[int]:
    """``req``'s prompt as ``input_length`` token ids: its blocks' runs (``block_tokens``) end to end, cut.
    Requests that share their first k hash ids share their first ``k * block`` tokens."""
    if not isinstance(req, TraceRequest):
        raise InvalidArgumentError("req", "a TraceRequest", type(req).__name__)
    if len(req.hash_ids) * block < req.input_length:
        raise InvalidArgumentError("block", f"an int with {len(req.hash_ids)} x block >= input_length "
                                   f"{req.input_length}", block)
    return block_tokens(req.hash_ids, vocab=vocab, block=block, seed=seed).reshape(-1)[:req.input_length].tolist()


def unbounded_reuse(trace: Sequence[TraceRequest], *, block: int = BLOCK) -> float:
    """The share of input tokens an unbounded prefix cache reuses, replaying ``trace`` in order: a request
    reuses its longest run of leading blocks seen before (any earlier request's), ``min(k * block,
    input_length)`` tokens. An upper bound: no finite cache reaches it, and a hybrid model only where a
    state was cached at the block boundary."""
    if not trace:
        raise InvalidArgumentError("trace", "at least one request", trace)
    seen: set[int] = set()
    reused = total = 0
    for r in trace:
        k = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            k += 1
        reused += min(k * block, r.input_length)
        total += r.input_length
        seen.update(r.hash_ids)
    return reused / total
