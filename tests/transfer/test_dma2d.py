"""Strided DMA for one layer of KV pages (``transfer/batch_dma.Dma2D``) and the ``staging`` path that uses
it: a layer's sub-range of each run of consecutive host slots moves as one 2D copy into a packed staging
buffer and is scattered to the pages' device rows (or gathered and copied out). On CPU a stand-in performs
each 2D copy row by row with ``ctypes.memmove`` on the addresses the path computes; the GPU test runs the
real call."""

from __future__ import annotations

import ctypes

import pytest
import torch

from tiered_cache import KVSpec, StateSpec, UnifiedPool
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec
from tiered_cache.transfer.batch_dma import Dma2D
from tiered_cache.transfer.engine import TransferEngine
from tiered_cache.transfer.moves import demote_kv, kv_layer_ranges, load_kv

KV = KVSpec(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float16)
ST = StateSpec(num_layers=2, temporal_shape=(2, 8, 16), temporal_dtype=torch.float32,
               conv_shapes=((6, 3),), conv_dtype=torch.bfloat16, value_axis=2)


class _Memmove2D:
    """Stands in for ``Dma2D`` on CPU: ``height`` rows of ``width`` bytes, one memmove each."""

    available = True

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int, str]] = []

    def copy(self, dst, dpitch, src, spitch, width, height, direction, stream) -> None:
        assert width <= dpitch and width <= spitch
        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        self.calls.append((dpitch, spitch, width, height, direction))


def test_dma2d_is_unavailable_on_cpu_and_staging_of_a_layer_falls_back_to_the_kernel():
    d = Dma2D(torch.device("cpu"))
    assert d.available is False
    eng = TransferEngine("cpu", method={"d2h": "staging", "h2d": "staging"})
    assert eng.copier.pick("h2d", 4096, [(0, 1, 8)], True) != "staging"
    assert eng.copier.pick("h2d", 4096, [(0, 1, 8)], False) == "staging"


def _setup(seed: int, device: str = "cpu"):
    pool = UnifiedPool(KV, ST, low_slots=16, high_slots=4, page_size=4, device=device)
    # chunks of 5 slots: a run of consecutive slot ids is cut at a chunk border (two host ranges)
    mirror = HostMirror([RegionSpec("full", pool.low.entry_bytes, 14)], chunk_bytes=pool.low.entry_bytes * 5)
    full, region = pool.side("full"), mirror.region("full")
    g = torch.Generator().manual_seed(seed)
    toks = full.alloc(4 * 8)
    rb = full.rows_bytes()
    rb.copy_(torch.randint(0, 256, rb.shape, dtype=torch.uint8, generator=g).to(device))
    rows = full.translate(toks[::4]) // 4
    hs = region.alloc(12)
    # runs (one across a chunk border), strays, one out of order
    slots = [hs[0], hs[1], hs[2], hs[3], hs[4], hs[5], hs[11], hs[8]]
    return full, region, toks, rb, rows, slots


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("staging_rows", [64, 3])  # one group, and groups of 3 rows (the buffer reused)
def test_staging_path_moves_each_layer_of_runs_byte_exact(poison, layerwise, staging_rows):
    full, region, toks, rb, rows, slots = _setup(4)
    eng = TransferEngine("cpu", method={"d2h": "staging", "h2d": "staging"},
                         staging_bytes=staging_rows * full.entry_bytes)
    fake = _Memmove2D()
    eng.copier.dma2d = fake
    saved = rb[rows].clone()
    t = demote_kv(eng, full, toks, region, slots)
    assert eng.wait(t)
    for h, row in zip(slots, saved):
        assert torch.equal(region.slot(h), row)
    rb[rows] = poison.value(torch.uint8)
    # the slots in their order (runs kept) into the pages in reverse order (device rows scattered)
    t = load_kv(eng, region, slots, full, toks.view(-1, 4).flip(0).reshape(-1), layerwise=layerwise)
    assert eng.wait(t) and t.ok == [True] * 8
    assert torch.equal(rb[rows], saved.flip(0))
    if layerwise:  # each layer's ranges of each run as one strided copy out of the slots, packed in staging
        ranges = kv_layer_ranges(full)
        got = {(c[2], c[0], c[1]) for c in fake.calls}
        assert got == {(n, n, region.slot_bytes) for _, n in ranges}
        runs = sum(len(region.runs(slots[g0:g0 + max(1, (staging_rows * full.entry_bytes) // n)]))
                   for _, n in ranges for g0 in range(0, 8, max(1, (staging_rows * full.entry_bytes) // n)))
        assert len(fake.calls) == runs and runs < 8 * len(ranges)
    else:
        assert not fake.calls
    region.flip_bit(slots[3], 7, 1)  # the checksum still guards what lands by this path
    t = load_kv(eng, region, slots, full, toks, layerwise=layerwise)
    assert eng.wait(t) and t.ok == [True, True, True, False, True, True, True, True]


def test_staging_of_one_layer_demotes_only_that_range(poison):
    """The D2H direction of the same path (a layer's range of each row gathered, then one 2D copy per run
    into the host slots): bytes outside the range stay as they were."""
    full, region, toks, rb, rows, slots = _setup(5)
    eng = TransferEngine("cpu", method={"d2h": "staging", "h2d": "staging"})
    eng.copier.dma2d = _Memmove2D()
    before = torch.stack([region.slot(h).clone() for h in slots])
    off, n = kv_layer_ranges(full)[1]
    rows_t = torch.tensor(rows.tolist(), dtype=torch.int64)
    eng.copier.copy_rows("d2h", rb, rows_t, rows.tolist(), region, slots, (off, n), keep=[])
    after = torch.stack([region.slot(h) for h in slots])
    assert torch.equal(after[:, off:off + n], rb[rows][:, off:off + n])
    assert torch.equal(after[:, :off], before[:, :off]) and torch.equal(after[:, off + n:], before[:, off + n:])


@pytest.mark.gpu
def test_dma2d_staging_on_cuda_round_trip():
    eng = TransferEngine("cuda", method={"d2h": "staging", "h2d": "staging"})
    if not eng.copier.dma2d.available:
        pytest.skip(f"no 2D DMA here: {eng.copier.dma2d.error}")
    full, region, toks, rb, rows, slots = _setup(6, "cuda")
    saved = rb[rows].clone()
    assert eng.wait(demote_kv(eng, full, toks, region, slots), timeout=10)
    rb[rows] = 0
    # the slots in their order (runs kept) into the pages in reverse order, layer by layer
    t = load_kv(eng, region, slots, full, toks.view(-1, 4).flip(0).reshape(-1), layerwise=True)
    assert eng.wait(t, timeout=10) and t.ok == [True] * 8
    assert torch.equal(rb[rows], saved.flip(0))

def test_auto_keeps_its_measured_picks():
    """``auto`` (on a stand-in CUDA device with batched and 2D DMA): whole pages H2D by batched DMA, every
    D2H (long runs or scattered) and every layer through the kernel; the 2D path is taken only when asked
    for (``staging``); without batched DMA, long H2D runs through the staging buffer."""
    eng = TransferEngine("cpu")
    c = eng.copier
    c.device = torch.device("cuda")
    c.batch = type("B", (), {"available": True})()
    c.dma2d = _Memmove2D()
    page = 384 << 10
    long_runs, strays = [(0, 1, 64), (64, 100, 64)], [(0, 1, 1), (1, 9, 1)]
    assert c.pick("h2d", page, long_runs, False) == "batch"
    assert c.pick("d2h", page, long_runs, False) == "kernel"
    assert c.pick("d2h", page, strays, False) == "kernel"
    assert c.pick("h2d", page, long_runs, True) == "kernel"
    c.batch = type("B", (), {"available": False})()
    assert c.pick("h2d", page, long_runs, False) == "staging"
    assert c.pick("h2d", page, strays, False) == "kernel"
    assert c.pick("d2h", page, long_runs, False) == "kernel"
    c.method = {"d2h": "staging", "h2d": "staging"}
    assert c.pick("h2d", page, long_runs, True) == "staging"
    c.dma2d = Dma2D(torch.device("cpu"))  # no 2D DMA: a layer goes through the kernel even when asked
    assert c.pick("h2d", page, long_runs, True) == "kernel"
