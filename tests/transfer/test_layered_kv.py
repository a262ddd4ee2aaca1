"""The T2 moves over a ``LayeredKVSide`` (a KV side with one buffer per layer, as SGLang's
``MHATokenToKVPool``): gather into page envelopes for a D2H copy, scatter back after an H2D copy, on CPU
and on CUDA streams. The side here has SGLang's layout without SGLang, so this runs where SGLang does not
install (the H200 image); tests/integrations/sglang/test_sglang_t2.py runs the moves over SGLang's real
pools (CPU)."""

from __future__ import annotations

import collections

import pytest
import torch

from tiered_cache.specs import KVSpec
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec
from tiered_cache.tiers.protocols import KVSide, LayeredKVSide
from tiered_cache.transfer.engine import TransferEngine
from tiered_cache.transfer.moves import demote_kv, load_kv

PAGE, PAGES, LAYERS, HEADS, DIM = 4, 16, 3, 2, 8


class _Side:
    """A ``LayeredKVSide`` with one ``[pages * PAGE, HEADS, DIM]`` K and V buffer per layer (SGLang's
    MHA pool layout), the ids physical and pages handed out in order: only what the moves use."""

    name, page_size, capacity = "full", PAGE, PAGES

    def __init__(self, device):
        self.device = torch.device(device)
        self.spec = KVSpec(num_layers=LAYERS, kv_heads=HEADS, head_dim=DIM, dtype=torch.bfloat16)
        self.entry_bytes = self.spec.bytes_per_slot(PAGE)
        n = PAGES * PAGE
        self.bufs = [torch.zeros(n, HEADS, DIM, dtype=torch.bfloat16, device=device) for _ in range(2 * LAYERS)]
        self.next, self.busy = 1, collections.Counter()

    def alloc(self, n):
        ids = torch.arange(self.next * PAGE, self.next * PAGE + n, device=self.device)
        self.next += n // PAGE
        return ids

    def layer_rows(self):
        offs = [o for kv in self.spec.field_offsets(PAGE) for o in kv]
        return [(o, b.reshape(PAGES, -1).view(torch.uint8)) for o, b in zip(offs, self.bufs)]

    def physical_rows(self, vids, arg="vids"):
        return [int(v) for v in vids]

    def mark_busy(self, ids):
        self.busy.update(ids)

    def unmark_busy(self, ids):
        self.busy.subtract(ids)

    def add_fence(self, fence):
        pass

    def rows_bytes(self):
        raise NotImplementedError("one buffer per layer")

    free = available_size = translate = translate_host = live_virtual_ids = rows_bytes


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_layered_kv_round_trip(device, poison):
    side = _Side(device)
    assert isinstance(side, LayeredKVSide) and not isinstance(side, KVSide)
    host = HostMirror([RegionSpec("full", side.entry_bytes, 8)], check_memory=False)
    region = host.region("full")
    engine = TransferEngine(device)
    src = side.alloc(5 * PAGE)
    for b in side.bufs:
        b[src] = torch.randn(len(src), HEADS, DIM, device=device).to(torch.bfloat16)
    want = [b[src].clone() for b in side.bufs]
    hs = region.alloc(5)
    t = demote_kv(engine, side, src, region, hs)
    for b in side.bufs:  # compute overwrites the pages right after: the copy read them first
        b[src] = poison.value(torch.bfloat16)
    engine.wait(t)
    assert all(t.ok)
    dst = side.alloc(5 * PAGE)
    for b in side.bufs:
        b[dst] = poison.value(torch.bfloat16)
    t = load_kv(engine, region, hs, side, dst)
    t.wait_layer(LAYERS - 1)  # the compute stream waits for the whole load (scatter included)
    got = [b[dst].clone() for b in side.bufs]
    engine.wait(t)
    assert all(t.ok) and not +side.busy
    assert all(torch.equal(g.view(torch.int16), w.view(torch.int16)) for g, w in zip(got, want))
