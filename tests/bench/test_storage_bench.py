"""Smoke run of benchmarks/bench_storage.py --small: it checks a round trip per backend and writes both files."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiered_cache.testing.local_redis import REDIS_BIN  # noqa: E402


def test_bench_storage_small(tmp_path):
    from benchmarks.bench_storage import main

    path = main(["--small", "--out", str(tmp_path)])
    rec = json.load(open(path))
    names = ["file_read_GBps", "file_write_GBps", "file_read_cold_GBps", "t2_copy_GBps"]
    if REDIS_BIN is not None:
        names += ["redis_read_GBps", "redis_write_GBps"]
    for name in names:
        assert rec["metrics"][name] > 0, name
    assert len(rec["rows"]) == 2 and os.path.exists(path[:-5] + ".md")
