"""benchmarks/traces.py: the Mooncake trace format loader, its checks, token ids and the reuse bound."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.traces import (  # noqa: E402
    TraceFormatError,
    TraceRequest,
    block_tokens,
    load_trace,
    prompt_tokens,
    unbounded_reuse,
)
from tiered_cache.errors import InvalidArgumentError  # noqa: E402

REAL = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces",
                    "mooncake_conversation_trace.jsonl")


def _write(tmp_path, rows, name="t.jsonl") -> str:
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(p)


def _row(ts=0, n=600, out=10, ids=(0, 1)):
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": list(ids)}


def test_load_small_trace_and_limit(tmp_path):
    p = _write(tmp_path, [_row(0, 600, 5, (0, 1)), "", _row(3, 1024, 7, (0, 1)), _row(9, 100, 0, (2,))])
    got = load_trace(p)
    assert got == [TraceRequest(0, 600, 5, (0, 1)), TraceRequest(3, 1024, 7, (0, 1)), TraceRequest(9, 100, 0, (2,))]
    assert load_trace(p, limit=2) == got[:2]


@pytest.mark.parametrize("bad, field, line", [
    ("{not json", "line", 2),
    ([1, 2], "line", 2),
    ({"timestamp": 1, "input_length": 600, "output_length": 1}, "hash_ids", 2),
    (_row(ts=-1), "timestamp", 2),
    (_row(ts=3.5), "timestamp", 2),
    (_row(ts=True), "timestamp", 2),
    (_row(n=0, ids=()), "input_length", 2),
    (_row(n=600.0), "input_length", 2),
    (_row(out=-2), "output_length", 2),
    (_row(ids=(0, "1")), "hash_ids", 2),
    (_row(ids=(0, -1)), "hash_ids", 2),
    (_row(ids=(0, 1, 2)), "hash_ids", 2),  # 600 tokens are 2 blocks, not 3
    (_row(ids=(5, 1)), "hash_ids", 2),  # id 1 after 5, but after 0 on line 1
    (_row(ids=(1, 0)), "hash_ids", 2),  # id 1 at position 0, at 1 on line 1
])
def test_bad_line_names_line_and_field(tmp_path, bad, field, line):
    p = _write(tmp_path, [_row(0), bad])
    with pytest.raises(TraceFormatError) as e:
        load_trace(p)
    assert (e.value.line, e.value.field) == (line, field)
    assert f"t.jsonl:{line} {field}" in str(e.value)
    assert isinstance(e.value, InvalidArgumentError)


def test_timestamps_never_go_back_and_empty_trace(tmp_path):
    with pytest.raises(TraceFormatError) as e:
        load_trace(_write(tmp_path, [_row(5), _row(4)]))
    assert (e.value.line, e.value.field) == (2, "timestamp")
    with pytest.raises(TraceFormatError) as e:
        load_trace(_write(tmp_path, ["", ""]))
    assert e.value.line == 0
    with pytest.raises(InvalidArgumentError, match="limit"):
        load_trace(_write(tmp_path, [_row()]), limit=0)


def test_block_changes_the_count_check(tmp_path):
    p = _write(tmp_path, [_row(0, 600, 1, (0,))])
    assert load_trace(p, block=1024)[0].hash_ids == (0,)
    with pytest.raises(TraceFormatError, match="hash_ids"):
        load_trace(p)  # 600 tokens at 512 a block: two ids


def test_prompt_tokens_deterministic_per_hash_id():
    vocab = 1000
    a = TraceRequest(0, 1100, 1, (7, 8, 9))
    b = TraceRequest(5, 700, 1, (7, 3))
    ta, tb = prompt_tokens(a, vocab=vocab), prompt_tokens(b, vocab=vocab)
    assert len(ta) == 1100 and len(tb) == 700
    assert ta[:512] == tb[:512]  # the shared block
    assert ta[512:700] != tb[512:700]  # different ids, different runs
    assert all(0 <= t < vocab for t in ta + tb)
    # order and process independent: block 8 alone gives the same run as inside a
    assert block_tokens([8], vocab=vocab)[0].tolist() == ta[512:1024]
    assert prompt_tokens(a, vocab=vocab, seed=1) != ta
    runs = block_tokens(list(range(64)), vocab=vocab)
    assert runs.shape == (64, 512) and runs.dtype == np.int64
    assert len({tuple(r) for r in runs.tolist()}) == 64
    # roughly uniform over the vocabulary (a broken mix would pile up)
    counts = np.bincount(runs.reshape(-1), minlength=vocab)
    assert counts.max() < 4 * counts.mean()
    with pytest.raises(InvalidArgumentError, match="vocab"):
        prompt_tokens(a, vocab=1)
    with pytest.raises(InvalidArgumentError, match="block"):
        prompt_tokens(a, vocab=vocab, block=256)  # 3 x 256 < 1100
    with pytest.raises(InvalidArgumentError, match="req"):
        prompt_tokens({"hash_ids": [1]}, vocab=vocab)


def test_unbounded_reuse_small():
    t = [TraceRequest(0, 1024, 1, (0, 1)),  # new: 0
         TraceRequest(1, 1500, 1, (0, 1, 2)),  # 2 blocks seen: 1024
         TraceRequest(2, 1400, 1, (0, 1, 2)),  # all 3 seen: the whole prompt, 1400 (< 3 x 512)
         TraceRequest(3, 600, 1, (0, 5))]  # 1 block: 512
    assert unbounded_reuse(t) == pytest.approx((1024 + 1400 + 512) / (1024 + 1500 + 1400 + 600))
    with pytest.raises(InvalidArgumentError):
        unbounded_reuse([])


@pytest.mark.skipif(not os.path.exists(REAL), reason="the shared trace folder is not next to this checkout")
def test_real_trace_slice_and_bound():
    head = load_trace(REAL, limit=500)
    assert len(head) == 500 and head[0].hash_ids[0] == 0
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in head)
    whole = load_trace(REAL)
    assert len(whole) == 12031 and whole[:500] == head
    assert unbounded_reuse(whole) == pytest.approx(0.374, abs=5e-4)  # its README's figure
    toks = prompt_tokens(whole[1], vocab=151_936)
    assert len(toks) == whole[1].input_length
    assert toks[:512] == prompt_tokens(whole[0], vocab=151_936)[:512]  # both start with block 0
