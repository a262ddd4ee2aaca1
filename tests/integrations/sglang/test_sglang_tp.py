"""The SGLang backend under tensor parallelism (issues 19 and 25), on CPU with gloo: SGLang's registry
builds the backend on each rank over that rank's pools (its share of the heads), and the ranks' trees
agree over the TP group's gloo group. A host copy damaged on one rank only must fail the load on every
rank (each reports 0 tokens loaded, every rank drops the copy), and the ranks' trees stay identical
after every step; the intact host hit that follows loads on every rank, each rank's share exact."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang.srt.mem_cache.registry")
import torch.multiprocessing as mp  # noqa: E402

from tests.integrations.sglang import tp_worker  # noqa: E402


def test_ranks_agree_a_host_copy_damaged_on_one_rank_fails_the_load_on_all(tmp_path):
    size, bad = 2, 1  # (two spawned processes importing SGLang: about a minute on a 2-core machine)
    mp.spawn(tp_worker.main, args=(size, str(tmp_path), bad), nprocs=size, join=True)
    res = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(size)]
    r0 = res[0]
    assert all(r["dumps"] == r0["dumps"] for r in res), "the ranks' trees differ"
    assert all(r["resumed"] == [0, 48] for r in res)
    # damaged on rank `bad` only, failed everywhere; then the intact copy (up to the checkpoint at 32,
    # what the drop left on the host) loads on every rank
    assert all(r["loads"] == [[48, 0], [32, 32]] for r in res), [r["loads"] for r in res]
    assert all(r["tree"].get("corrupt_host_kv_dropped") == 1 for r in res)
    assert res[1 - bad]["agreement"].get("overruled_checksums", 0) > 0  # the intact rank was overruled
