"""Batched DMA (``transfer/batch_dma.py``): the coalescing of copy lists, the fallback where
``cuda-bindings`` is missing, and the engine's ``batch`` path end to end on CPU with a stand-in that
performs each copy with ``ctypes.memmove`` on the addresses the path computes (the real call needs CUDA;
its GPU test is below)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from tiered_cache import KVSpec, StateSpec, UnifiedPool
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec
from tiered_cache.transfer.batch_dma import BatchDMA, coalesce
from tiered_cache.transfer.engine import TransferEngine
from tiered_cache.transfer.moves import demote_kv, load_kv

KV = KVSpec(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float16)
ST = StateSpec(num_layers=2, temporal_shape=(2, 8, 16), temporal_dtype=torch.float32,
               conv_shapes=((6, 3),), conv_dtype=torch.bfloat16, value_axis=2)


def _apply(dst, src, sizes, memory: np.ndarray) -> np.ndarray:
    """The copies run one by one on a byte array addressed from 0 (the twin of a batch)."""
    out = memory.copy()
    for d, s, n in zip(dst.tolist(), src.tolist(), np.broadcast_to(sizes, np.shape(dst)).tolist()):
        out[d:d + n] = memory[s:s + n]
    return out


@pytest.mark.parametrize("seed", range(8))
def test_coalesce_moves_the_same_bytes_in_fewer_copies(seed):
    rng = np.random.default_rng(seed)
    n, size = 40, 16
    # destinations: distinct 16-byte slots in [4096, 8192), partly in runs; sources below 4096, runs mixed in
    dslots = np.concatenate([np.arange(n // 2) + 200, rng.permutation(200)[: n - n // 2]])  # a run, then strays
    sslots = rng.integers(0, 256, n)
    sslots[: n // 2] = np.arange(n // 2) + 3  # the run matched on the source side for its first half ...
    sslots[n // 4: n // 2] += 50  # ... and again, shifted, for its second
    order = rng.permutation(n)  # given in any order
    dst, src = 4096 + dslots[order] * size, sslots[order] * size
    mem = rng.integers(0, 256, 8192, dtype=np.uint8)
    d, s, k = coalesce(dst, src, size)
    assert np.array_equal(_apply(d, s, k, mem), _apply(dst, src, size, mem))
    assert k.sum() == n * size and np.all(np.diff(d) > 0)
    # the twin: sorted by destination, a copy merges into the previous one when it continues it on both sides
    runs = 0
    prev = None
    for a, b in sorted(zip(dst.tolist(), src.tolist())):
        runs += prev is None or (a, b) != (prev[0] + size, prev[1] + size)
        prev = (a, b)
    assert d.size == runs <= n - 2 * (n // 4 - 1)


def test_coalesce_edge_cases():
    d, s, k = coalesce(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 8)
    assert d.size == s.size == k.size == 0
    d, s, k = coalesce(np.array([32, 0, 16]), np.array([72, 40, 56]), 16)  # one run, given out of order
    assert d.tolist() == [0] and s.tolist() == [40] and k.tolist() == [48]
    d, s, k = coalesce(np.array([0, 16, 32]), np.array([40, 56, 100]), np.array([16, 0, 16]))  # empty copy dropped
    assert d.tolist() == [0, 32] and k.tolist() == [16, 16]
    with pytest.raises(InvalidArgumentError, match="src"):
        coalesce(np.array([0, 16]), np.array([0]), 16)
    with pytest.raises(InvalidArgumentError, match="nbytes"):
        coalesce(np.array([0]), np.array([0]), -1)


def test_batch_dma_is_unavailable_on_cpu_and_auto_never_picks_it():
    b = BatchDMA(torch.device("cpu"))
    assert b.available is False
    eng = TransferEngine("cpu", method={"d2h": "batch", "h2d": "batch"})
    assert eng.copier.pick("d2h", 4096, [(0, 1, 1)], False) != "batch"
    assert eng.copier.pick("h2d", 4096, [(0, 1, 1)], False) != "batch"


def test_auto_takes_batched_dma_for_whole_small_rows_h2d_only():
    """Where batched DMA exists (a stand-in here, on a device the copier takes for CUDA): ``auto`` sends
    whole KV pages H2D by it, D2H and a layer's sub-range through the kernel, large rows one copy each."""
    eng = TransferEngine("cpu")
    c = eng.copier
    c.batch, c.device = _MemmoveBatch(), torch.device("cuda")
    assert c.pick("h2d", 384 << 10, [(0, 1, 1)], False) == "batch"
    assert c.pick("h2d", 384 << 10, [(0, 1, 1)], True) == "kernel"
    assert c.pick("d2h", 384 << 10, [(0, 1, 1)], False) == "kernel"
    assert c.pick("h2d", 21 << 20, [(0, 1, 1)], False) == "copy"


class _MemmoveBatch:
    """Stands in for ``BatchDMA`` on CPU: coalesces like it, then copies with memmove."""

    available = True

    def __init__(self) -> None:
        self.calls: list[int] = []

    def copy(self, dst, src, nbytes, stream) -> int:
        d, s, k = coalesce(dst, src, nbytes)
        for a, b, n in zip(d.tolist(), s.tolist(), k.tolist()):
            ctypes.memmove(a, b, n)
        self.calls.append(int(d.size))
        return int(d.size)


@pytest.mark.parametrize("layerwise", [False, True])
def test_batch_path_round_trip_byte_exact_with_runs_and_strays(poison, layerwise):
    pool = UnifiedPool(KV, ST, low_slots=16, high_slots=4, page_size=4, device="cpu")
    mirror = HostMirror([RegionSpec("full", pool.low.entry_bytes, 12)], chunk_bytes=pool.low.entry_bytes * 5)
    full, region = pool.side("full"), mirror.region("full")
    eng = TransferEngine("cpu", method={"d2h": "batch", "h2d": "batch"})
    fake = _MemmoveBatch()
    eng.copier.batch = fake
    toks = full.alloc(4 * 8)
    g = torch.Generator().manual_seed(3)
    rb = full.rows_bytes()
    rb.copy_(torch.randint(0, 256, rb.shape, dtype=torch.uint8, generator=g))
    rows = full.translate(toks[::4]) // 4
    saved = rb[rows].clone()
    hs = region.alloc(10)
    slots = [hs[0], hs[1], hs[2], hs[3], hs[4], hs[5], hs[9], hs[7]]  # a run across a chunk border, strays
    t = demote_kv(eng, full, toks, region, slots)
    assert eng.wait(t) and fake.calls and fake.calls[-1] < 8  # consecutive rows and slots merged
    for h, row in zip(slots, saved):
        assert torch.equal(region.slot(h), row)
    rb[rows] = poison.value(torch.uint8)
    t = load_kv(eng, region, slots[::-1], full, toks, layerwise=layerwise)
    assert eng.wait(t) and t.ok == [True] * 8
    assert torch.equal(rb[rows], saved.flip(0))
    region.flip_bit(slots[3], 7, 1)  # the checksum still guards what the batch path lands
    t = load_kv(eng, region, slots, full, toks, layerwise=False)
    assert eng.wait(t) and t.ok == [True, True, True, False, True, True, True, True]


@pytest.mark.gpu
def test_batch_dma_on_cuda_round_trip():
    b = BatchDMA(torch.device("cuda"))
    if not b.available:
        pytest.skip(f"no batched DMA here: {b.error}")
    pool = UnifiedPool(KV, ST, low_slots=16, high_slots=4, page_size=4, device="cuda")
    mirror = HostMirror([RegionSpec("full", pool.low.entry_bytes, 12)])
    full, region = pool.side("full"), mirror.region("full")
    eng = TransferEngine("cuda", method={"d2h": "batch", "h2d": "batch"})
    toks = full.alloc(4 * 8)
    rb = full.rows_bytes()
    rb.copy_(torch.randint(0, 256, rb.shape, dtype=torch.uint8, device="cuda"))
    rows = full.translate(toks[::4]) // 4
    saved = rb[rows].clone()
    hs = region.alloc(10)
    slots = [hs[9], hs[1], hs[2], hs[3], hs[0], hs[5], hs[6], hs[7]]
    assert eng.wait(demote_kv(eng, full, toks, region, slots), timeout=10)
    rb[rows] = 0
    t = load_kv(eng, region, slots[::-1], full, toks)
    assert eng.wait(t, timeout=10) and t.ok == [True] * 8
    assert torch.equal(rb[rows], saved.flip(0))
