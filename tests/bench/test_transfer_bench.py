"""bench_transfer's host-slot patterns and KV case on the CPU (the timings need a GPU; what they move is
checked here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.bench_transfer import KVCase, _engine, churned_host_slots, mean_run_pages
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec


@pytest.mark.parametrize("seed", range(6))
def test_churned_slots_are_the_allocators_lowest_free_ids_after_churn(seed):
    m = HostMirror([RegionSpec("x", 64, 600)], pin="none")
    r = m.region("x")
    g = torch.Generator().manual_seed(seed)
    hs = churned_host_slots(r, 100, g, mean=8)
    assert len(hs) == 100 and len(set(hs)) == 100
    assert all(r.allocator.is_allocated(i) for i in hs)
    # live slots of the churn stay between them: not one block from the region's start
    assert max(hs) - min(hs) + 1 > 100
    # runs: one DMA copy each; with nodes of 8 pages on average they are longer than a page, shorter than all
    runs = mean_run_pages(r, hs)
    assert 1 < runs < 100
    # what the region has free was never handed out twice: alloc gives the rest
    rest = r.alloc(r.available_size())
    assert not set(rest) & set(hs)


def test_churned_slots_free_more_where_half_is_not_enough():
    m = HostMirror([RegionSpec("x", 64, 40)], pin="none")
    r = m.region("x")
    hs = churned_host_slots(r, 30, torch.Generator().manual_seed(0), mean=16)
    assert len(set(hs)) == 30


@pytest.mark.parametrize("host", ["scattered", "churn"])
def test_kv_case_round_trips_each_pattern_and_layerwise(host):
    g = torch.Generator().manual_seed(1)
    case = KVCase(torch.device("cpu"), 16, 6, g, host)
    try:
        assert case.run_pages >= 1
        for method in ("auto", "staging+batch", "copy"):
            eng = _engine(torch.device("cpu"), method, 1 << 24)
            rb = case.full.rows_bytes()
            for layerwise in (False, True):
                case.check(eng, layerwise=layerwise)  # poisons the destinations first; asserts equal bytes
                assert torch.equal(rb[case.dst_rows], rb[case.src_rows])
        # the host slots the moves used hold the source pages' bytes
        got = np.stack([case.region.slot(s).numpy() for s in case.hs[:case.n]])
        assert np.array_equal(got, rb[case.src_rows].numpy())
    finally:
        case.close()
