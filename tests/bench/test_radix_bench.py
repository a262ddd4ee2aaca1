"""Smoke run of benchmarks/bench_radix.py --small: it checks matches against its baseline and writes both files."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_bench_radix_small(tmp_path):
    from benchmarks.bench_radix import main

    path = main(["--small", "--out", str(tmp_path)])
    rec = json.load(open(path))
    for tag in ("1e3", "1e4"):
        for name in ("match_ops_per_s", "insert_ops_per_s", "evict_ops_per_s", "match_p99_us"):
            assert rec["metrics"][f"{name}_{tag}"] > 0
    assert os.path.exists(path[:-5] + ".md")
