"""benchmarks/bench_radix.py: the side-by-side run against SGLang's ``RadixCache`` (--small), its check that
both trees find the same hits (and that the check fails when they do not), and its skip without sglang."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import bench_radix  # noqa: E402

needs_sglang = pytest.mark.skipif(bench_radix.importlib.util.find_spec("sglang") is None,
                                  reason="sglang not installed (constraints/sglang-test.txt)")


@needs_sglang
def test_bench_radix_small(tmp_path):
    path = bench_radix.main(["--small", "--out", str(tmp_path)])
    rec = json.load(open(path))
    m = rec["metrics"]
    for tag in ("1e3", "1e4"):
        assert m[f"cached_tokens_{tag}"] >= float(tag) and m[f"check_hit_tokens_{tag}"] > 0
        for op in ("match", "insert", "evict"):
            for variant in ("", "_tree_only"):
                med = m[f"{op}_vs_sglang{variant}_{tag}"]
                assert m[f"{op}_vs_sglang{variant}_min_{tag}"] <= med <= m[f"{op}_vs_sglang{variant}_max_{tag}"]
                assert med > 0
    assert os.path.exists(path[:-5] + ".md")


@needs_sglang
def test_same_hits_both_sides_and_the_check_catches_a_difference():
    sgl = bench_radix.load_sglang()
    ours, theirs = bench_radix.Ours(2000, 4), bench_radix.Sgl(2000, 4, sgl)
    trace = bench_radix.Trace(3)
    while ours.size < 2000:
        toks = trace.next_turn()
        ours.turn(ours.held(toks))
        theirs.turn(theirs.held(toks))
    assert ours.size == theirs.size
    queries = [trace.query() for _ in range(30)]
    assert bench_radix.check_same_hits(ours, theirs, queries) > 0
    extra = trace.chats[0] + trace.turn()  # cached on SGLang's side only: its queries now hit more there
    theirs.turn(theirs.held(extra))
    with pytest.raises(AssertionError, match="ours .* SGLang"):
        bench_radix.check_same_hits(ours, theirs, [extra + trace.turn()])


def test_without_sglang_it_says_so_and_measures_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench_radix, "load_sglang", lambda: None)
    assert bench_radix.main(["--small", "--out", str(tmp_path)]) is None
    assert "sglang is not installed" in capsys.readouterr().out
    assert not os.listdir(tmp_path)
