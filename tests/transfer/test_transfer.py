"""T2 and the transfer engine: byte-exact round trips, checksums, busy slots, back-pressure."""

from __future__ import annotations

import random

import pytest
import torch

from tiered_cache import (
    InvalidArgumentError,
    KVSpec,
    MemoryBudgetError,
    SlotBusyError,
    SlotStateError,
    StateSpec,
    UnifiedPool,
)
from tiered_cache.errors import InvalidTypeError, TransferTimeoutError
from tiered_cache.kernels.checksum import row_checksums
from tiered_cache.kernels.reference import row_checksums_reference
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec
from tiered_cache.transfer.engine import TransferEngine
from tiered_cache.transfer.moves import (
    demote_kv,
    demote_states,
    kv_layer_ranges,
    load_kv,
    promote_states,
    restore_states,
)

KV = KVSpec(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float16)
ST = StateSpec(num_layers=2, temporal_shape=(2, 8, 16), temporal_dtype=torch.float32,
               conv_shapes=((6, 3),), conv_dtype=torch.bfloat16, value_axis=2)


def setup(device="cpu", codec="int8", host_states=8, host_pages=16):
    pool = UnifiedPool(KV, ST, low_slots=16, high_slots=6, page_size=4, device=device)
    t1 = Int8CheckpointPool(ST, 8, device=device, codec=codec)
    mirror = HostMirror([RegionSpec("state", t1.slot_bytes, host_states),
                         RegionSpec("full", pool.low.entry_bytes, host_pages)])
    return pool, t1, mirror, TransferEngine(device)


def fill_random(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator(device="cpu").manual_seed(seed)
    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g).to(t.device))


@pytest.mark.parametrize("entry_bytes", [16, 64, 8192 + 48])
def test_checksum_kernel_matches_reference(entry_bytes):
    rows = torch.randint(0, 256, (7, entry_bytes), dtype=torch.uint8)
    ids = torch.tensor([6, 0, 3, 3])
    got = row_checksums(rows, ids, backend="triton")
    assert torch.equal(got, row_checksums_reference(rows, ids))
    assert got[2] == got[3] and got[0] != got[1]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_checksum_kernel_writes_into_out(poison, backend):
    rows = torch.randint(0, 256, (7, 8192 + 48), dtype=torch.uint8)
    ids = torch.tensor([6, 0, 3])
    out = poison((4,), torch.int64)
    got = row_checksums(rows, ids, backend=backend, out=out[1:])  # a view: the engine fills slices
    assert got.data_ptr() == out[1:].data_ptr() and out[0] == poison.value(torch.int64)
    assert torch.equal(out[1:], row_checksums_reference(rows, ids))
    for bad in (torch.empty(2, dtype=torch.int64), torch.empty(3, dtype=torch.int32),
                torch.empty(6, dtype=torch.int64)[::2]):
        with pytest.raises(InvalidArgumentError, match="out"):
            row_checksums(rows, ids, backend=backend, out=bad)


@pytest.mark.gpu
def test_checksum_kernel_reads_row_ids_from_and_writes_sums_to_page_locked_host_memory(poison):
    """The transfer engine hands the kernel its row ids in pinned host memory and takes the sums back
    the same way (no copy on any stream, none in a copy engine's queue)."""
    rows = torch.randint(0, 256, (9, 8192 + 48), dtype=torch.uint8).cuda()
    ids = torch.tensor([8, 0, 3, 3, 5])
    want = row_checksums_reference(rows.cpu(), ids)
    got = row_checksums(rows, ids.pin_memory(), backend="triton")
    assert got.is_cuda and torch.equal(got.cpu(), want)
    out = poison((5,), torch.int64).pin_memory()
    row_checksums(rows, ids.pin_memory(), backend="triton", out=out)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    with pytest.raises(InvalidArgumentError, match="page-locked"):
        row_checksums(rows, ids, backend="triton")  # pageable host ids: refused
    with pytest.raises(InvalidArgumentError, match="out"):
        row_checksums(rows, ids.cuda(), backend="triton", out=torch.empty(5, dtype=torch.int64))  # pageable


def test_checksum_detects_every_single_bit_flip_in_a_row():
    rows = torch.randint(0, 256, (1, 64), dtype=torch.uint8)
    base = row_checksums_reference(rows, torch.tensor([0]))
    for byte in range(64):
        for bit in range(8):
            flipped = rows.clone()
            flipped[0, byte] ^= 1 << bit
            assert row_checksums_reference(flipped, torch.tensor([0])) != base


def test_checksum_detects_two_bit_flips_in_a_row():
    """Pairs of flips, sign bits included (two flips of bit 31 cancel in a mod-2**32 sum)."""
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(0, 256, (1, 256), dtype=torch.uint8, generator=g)
    base = row_checksums_reference(rows, torch.tensor([0]))
    sign_bytes = list(range(3, 256, 4))  # little-endian: the top byte of each 32-bit word
    pairs = [(a, 7, b, 7) for a in sign_bytes for b in sign_bytes if a < b]
    rng = random.Random(1)
    pairs += [(rng.randrange(256), rng.randrange(8), rng.randrange(256), rng.randrange(8)) for _ in range(3000)]
    batch = rows.repeat(len(pairs), 1)
    for k, (b1, x1, b2, x2) in enumerate(pairs):
        if (b1, x1) == (b2, x2):
            x2 = (x2 + 1) % 8
        batch[k, b1] ^= 1 << x1
        batch[k, b2] ^= 1 << x2
    sums = row_checksums_reference(batch, torch.arange(len(pairs)))
    assert not (sums == base).any()
    assert torch.equal(row_checksums(batch[:40], torch.arange(40), backend="triton"), sums[:40])


def test_state_round_trip_t1_t2_t1_is_byte_exact_scattered_and_repeated():
    pool, t1, mirror, eng = setup()
    region = mirror.region("state")
    src = t1.alloc(4).tolist()
    fill_random(t1.envelopes, 1)
    before = t1.envelopes.clone()
    # scattered host slots, and one T1 slot demoted twice
    hs = region.alloc(6)
    hs = [hs[5], hs[1], hs[3], hs[0], hs[4], hs[2]]
    demote = demote_states(eng, t1, src + src[:2], region, hs)
    assert not demote.done
    assert eng.poll() == [demote] and demote.done and demote.ok == [True] * 6
    for s, h in zip(src + src[:2], hs):
        assert torch.equal(region.slot(h), before[s])
    dst = t1.alloc(4).tolist()
    t1.envelopes[dst] = 0
    promote = promote_states(eng, region, [hs[3], hs[0], hs[1], hs[5]], t1, dst[::-1])
    assert eng.wait(promote, timeout=5) and promote.ok == [True] * 4
    expect = [src[3], src[0], src[1], src[1]]
    for d, s in zip(dst[::-1], expect):
        assert torch.equal(t1.envelopes[d], before[s])
    mirror.check_invariants()


def test_kv_round_trip_t0_t2_t0_layerwise_byte_exact():
    pool, t1, mirror, eng = setup()
    full, region = pool.side("full"), mirror.region("full")
    toks = full.alloc(12)  # 3 pages
    fill_random(full.rows_bytes(), 2)
    rows = full.translate(toks[::4]) // 4
    saved = full.rows_bytes()[rows].clone()
    hs = region.alloc(3)[::-1]
    t = demote_kv(eng, full, toks, region, hs)
    eng.wait(t)
    full.free(toks)
    back = full.alloc(12)
    full.rows_bytes()[full.translate(back[::4]) // 4] = 0
    t = load_kv(eng, region, hs, full, back, layerwise=True)
    assert len(t.layer_events) == 3
    assert eng.wait(t) and t.ok == [True] * 3
    assert torch.equal(full.rows_bytes()[full.translate(back[::4]) // 4], saved)
    assert [n for _, n in kv_layer_ranges(full)] == [full.entry_bytes // 3] * 3


def test_restore_dequantizes_into_a_t0_slot_and_keeps_the_host_copy():
    pool, t1, mirror, eng = setup()
    mamba, region = pool.side("mamba"), mirror.region("state")
    a = mamba.alloc(1)
    mamba.temporal_view_all()[:, mamba.translate(a)] = torch.randn(2, 1, 2, 8, 16)
    mamba.conv_view_all()[:, mamba.translate(a)] = torch.randn(2, 1, 6, 3).to(torch.bfloat16)
    ck = t1.alloc(1)
    t1.store_from_active(mamba, a, ck)
    hs = region.alloc(1)
    eng.wait(demote_states(eng, t1, ck.tolist(), region, hs))
    ref = mamba.alloc(1)
    t1.load_to_active(ck, mamba, ref)  # what a T1 hit gives
    t1.free(ck)
    scratch = t1.alloc(1)
    b = mamba.alloc(1)
    t = restore_states(eng, region, hs, t1, scratch.tolist(), mamba, b.tolist())
    assert eng.wait(t) and t.ok == [True]
    temporal = mamba.temporal_view_all()
    assert torch.equal(temporal[:, mamba.translate(b)], temporal[:, mamba.translate(ref)])
    assert torch.equal(mamba.conv_view_all()[:, mamba.translate(b)], mamba.conv_view_all()[:, mamba.translate(ref)])
    assert region.valid[hs[0]]


def test_one_bit_flipped_in_each_of_1000_host_entries_is_always_caught():
    pool, t1, mirror, eng = setup(host_states=4, host_pages=1000)
    full, region = pool.side("full"), mirror.region("full")
    rng = random.Random(0)
    toks = full.alloc(16)
    fill_random(full.rows_bytes(), 3)
    vids = toks[::4].tolist()
    caught = 0
    for _round in range(4):
        hs = region.alloc(250)
        src = [vids[i % 4] for i in range(250)]
        token_ids = [v + j for v in src for j in range(4)]
        eng.wait(demote_kv(eng, full, token_ids, region, hs))
        for h in hs:
            region.flip_bit(h, rng.randrange(region.slot_bytes), rng.randrange(8))
        for i in range(0, 250, 4):  # load back through 4 live pages at a time
            t = load_kv(eng, region, hs[i:i + 4], full, toks[: 4 * len(hs[i:i + 4])], layerwise=False)
            eng.wait(t)
            caught += t.ok.count(False)
            assert not any(t.ok)
    assert caught == 1000 and eng.stats["checksum_failures"] == 1000


def test_busy_slots_cannot_be_freed_until_the_ticket_completes():
    pool, t1, mirror, eng = setup()
    full, region = pool.side("full"), mirror.region("full")
    toks = full.alloc(8)
    hs = region.alloc(2)
    t = demote_kv(eng, full, toks, region, hs)
    with pytest.raises(SlotBusyError):
        full.free(toks[:4])
    with pytest.raises(SlotBusyError):
        region.free(hs[:1])
    ck = t1.alloc(1).tolist()
    hs2 = region.alloc(1)
    t2 = demote_states(eng, t1, ck, mirror.region("state"), mirror.region("state").alloc(1))
    with pytest.raises(SlotBusyError):
        t1.free(ck)
    assert [x.id for x in eng.poll()] == [t.id, t2.id]
    full.free(toks)
    region.free(hs + hs2)
    t1.free(ck)


def test_bad_input_is_typed_and_changes_nothing():
    pool, t1, mirror, eng = setup()
    full, region, sregion = pool.side("full"), mirror.region("full"), mirror.region("state")
    toks = full.alloc(4)
    hs = region.alloc(1)
    with pytest.raises(InvalidArgumentError, match="rows_view"):
        eng.demote(t1.envelopes, [1], region, hs)  # wrong slot size for this region
    with pytest.raises(SlotStateError, match="host_slots"):
        demote_kv(eng, full, toks, region, [hs[0] + 1])  # not allocated
    with pytest.raises(InvalidArgumentError, match="host_slots"):
        load_kv(eng, region, hs, full, toks)  # never demoted: nothing valid to load
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        demote_kv(eng, full, toks[1:], region, hs)
    with pytest.raises(SlotStateError, match="t1_slots"):
        demote_states(eng, t1, [3], sregion, sregion.alloc(1))
    with pytest.raises(InvalidArgumentError, match="rows_view"):
        eng.demote(torch.zeros(4, region.slot_bytes, dtype=torch.int8), [1], region, hs)
    assert eng.pending == 0 and not region.valid.any()


class StuckEvent:
    """An event on a stream that has not got there yet: what a busy copy stream looks like."""

    def __init__(self):
        self.released = False

    def query(self):
        return self.released


def test_back_pressure_bounds_bytes_in_flight():
    pool, t1, mirror, _ = setup()
    eng = TransferEngine("cpu", max_inflight_bytes=2 * t1.slot_bytes, room_timeout_s=0.05)
    region = mirror.region("state")
    ck = t1.alloc(3).tolist()
    t_a = demote_states(eng, t1, ck[:2], region, region.alloc(2))
    stuck = t_a.event = StuckEvent()
    assert eng.inflight_bytes == 2 * t1.slot_bytes and eng.poll() == []
    # no room while t_a is in flight: a non-blocking move is refused, a blocking one times out
    hs = region.alloc(1)
    assert eng.demote(t1.envelopes, ck[2:], region, hs, block=False) is None
    with pytest.raises(TransferTimeoutError):
        demote_states(eng, t1, ck[2:], region, hs)
    assert eng.pending == 1 and not region.valid[hs[0]]
    with pytest.raises(SlotBusyError):
        t1.free(ck[:1])
    stuck.released = True  # the copy stream catches up
    t_b = demote_states(eng, t1, ck[2:], region, hs)
    assert t_a.done and t_b is not None and eng.inflight_bytes == t1.slot_bytes
    assert eng.wait(t_b, timeout=1) and eng.inflight_bytes == 0
    t1.free(ck)


def test_host_mirror_budget_and_chunks():
    with pytest.raises(MemoryBudgetError, match="num_slots of state"):
        HostMirror([RegionSpec("state", 1 << 20, 64)], budget_bytes=1 << 20)
    with pytest.raises(MemoryBudgetError, match="num_slots"):
        HostMirror([RegionSpec("state", 1 << 30, 1 << 20)])
    with pytest.raises(InvalidArgumentError, match="slot_bytes"):
        RegionSpec("x", 10, 4)
    with pytest.raises(InvalidArgumentError, match="pin"):
        HostMirror([RegionSpec("x", 16, 4)], pin="register")
    m = HostMirror([RegionSpec("x", 48, 10)], chunk_bytes=100)  # two slots a chunk, none straddling
    r = m.region("x")
    assert r.per_chunk == 2 and len(r.chunks) == 6 and m.nbytes == 11 * 48
    assert r.runs([1, 2, 3, 7, 6]) == [(0, 1, 1), (1, 2, 2), (3, 7, 1), (4, 6, 1)]


@pytest.mark.gpu
def test_a_region_held_past_its_mirror_stays_pinned():
    """A region unpins its own memory when it is collected, not when its HostMirror is: a region held
    alone stays mapped, so the mapped-memory kernel still reaches it (on the H200 the SGLang T2 test
    held only ``mirror.region(...)``, and the kernel found the slots unmapped: "cannot be accessed from
    Triton"). Closing unpins, and says so."""
    import gc

    from tiered_cache.kernels.hostcopy import copy_items

    region = HostMirror([RegionSpec("x", 4096, 4)], pin="register").region("x")
    gc.collect()
    assert region.pinned
    src = torch.randint(-2**31, 2**31 - 1, (1024,), dtype=torch.int32, device="cuda")
    dst = region.chunks[0].view(torch.int32)
    dst.fill_(7)
    offs = torch.tensor([0], dtype=torch.int64, device="cuda")
    copy_items(src, offs, dst, torch.tensor([1024], dtype=torch.int64, device="cuda"), 1024)
    torch.cuda.synchronize()
    assert torch.equal(dst[1024:2048], src.cpu())
    region.close()
    assert not region.pinned


@pytest.mark.parametrize("method, backend", [("kernel", "triton"), ("staging", "triton"), ("staging", "torch")])
def test_kv_round_trip_through_other_methods(method, backend):
    """The mapped-memory kernel (interpreter on CPU) and the staging path (its gather by the same kernel,
    or by torch's index ops) move the same bytes."""
    pool, t1, mirror, _ = setup()
    eng = TransferEngine("cpu", method={"d2h": method, "h2d": method}, backend=backend)
    full, region = pool.side("full"), mirror.region("full")
    toks = full.alloc(16)
    fill_random(full.rows_bytes(), 9)
    saved = full.rows_bytes()[full.translate(toks[::4]) // 4].clone()
    hs = region.alloc(6)
    hs = [hs[4], hs[0], hs[1], hs[5]]  # a run of two, and two strays
    eng.wait(demote_kv(eng, full, toks, region, hs))
    for h, row in zip(hs, saved):
        assert torch.equal(region.slot(h), row)
    full.rows_bytes()[full.translate(toks[::4]) // 4] = 0
    t = load_kv(eng, region, hs[::-1], full, toks, layerwise=method == "kernel")
    assert eng.wait(t) and t.ok == [True] * 4
    assert torch.equal(full.rows_bytes()[full.translate(toks[::4]) // 4], saved.flip(0))


@pytest.mark.parametrize("bad", [1, "high", True, 0.5])
def test_stream_priority_is_checked(bad):
    with pytest.raises(InvalidArgumentError, match="stream_priority"):
        TransferEngine("cpu", stream_priority=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("method, priority", [("copy", -1), ("staging", -1), ("kernel", -1), ("kernel", 0),
                                              ("auto", -1)])
def test_round_trips_on_cuda(method, priority):
    pool, t1, mirror, _ = setup("cuda")
    eng = TransferEngine("cuda", method={"d2h": method, "h2d": method}, stream_priority=priority)
    assert eng.streams["h2d"].priority <= priority
    region = mirror.region("state")
    src = t1.alloc(4).tolist()
    fill_random(t1.envelopes, 5)
    before = t1.envelopes.clone()
    hs = region.alloc(5)
    assert eng.wait(demote_states(eng, t1, src + src[:1], region, hs), timeout=10)
    dst = t1.alloc(4).tolist()
    t = promote_states(eng, region, hs[:4][::-1], t1, dst)
    assert eng.wait(t, timeout=10) and t.ok == [True] * 4
    for d, s in zip(dst, src[::-1]):
        assert torch.equal(t1.envelopes[d], before[s])
    full, kreg = pool.side("full"), mirror.region("full")
    toks = full.alloc(16)
    fill_random(full.rows_bytes(), 6)
    saved = full.rows_bytes()[full.translate(toks[::4]) // 4].clone()
    khs = kreg.alloc(4)
    eng.wait(demote_kv(eng, full, toks, kreg, khs), timeout=10)
    kreg.flip_bit(khs[2], 5, 3)
    full.rows_bytes()[full.translate(toks[::4]) // 4] = 0
    t = load_kv(eng, kreg, khs, full, toks)
    assert eng.wait(t, timeout=10) and t.ok == [True, True, False, True]
    got = full.rows_bytes()[full.translate(toks[::4]) // 4]
    assert torch.equal(got[[0, 1, 3]], saved[[0, 1, 3]])


@pytest.mark.parametrize("block_words,num_warps,progs", [(64, 1, 1), (256, 8, 3), (2048, 4, 16)])
def test_copy_items_kernel_settings_match_reference(poison, block_words, num_warps, progs):
    """Every (block, warps, programs) setting the benchmark sweeps moves exactly the reference's words."""
    from tiered_cache.kernels.hostcopy import copy_items
    from tiered_cache.kernels.reference import copy_items_reference

    g = torch.Generator().manual_seed(block_words)
    src = torch.randint(-2**31, 2**31 - 1, (4000,), dtype=torch.int32, generator=g)
    so = torch.tensor([0, 900, 1800, 3000, 2700], dtype=torch.int64)
    do = torch.tensor([1500, 0, 3100, 600, 2300], dtype=torch.int64)
    want = poison((4000,), torch.int32)
    got = want.clone()
    copy_items_reference(src, so, want, do, 300)
    copy_items(src, so, got, do, 300, progs, block_words, num_warps)
    assert torch.equal(got, want)


@pytest.mark.parametrize("shift, n_words, vector", [(0, 300, True), (0, 300, False), (1, 300, True), (0, 302, True),
                                                     (2, 298, True)])
def test_copy_items_four_words_a_lane_match_reference(poison, shift, n_words, vector):
    """Aligned ranges (four words a lane) and every misaligned form (an offset, ``n_words``: one word a lane) move
    exactly the reference's words, on fresh random words into a poisoned destination."""
    from tiered_cache.kernels.hostcopy import _vec_width, copy_items
    from tiered_cache.kernels.reference import copy_items_reference

    g = torch.Generator().manual_seed(1000 * shift + n_words)
    src = torch.randint(-2**31, 2**31 - 1, (4000,), dtype=torch.int32, generator=g)
    so = torch.tensor([0, 900, 1800, 3000, 2700], dtype=torch.int64) + shift
    do = torch.tensor([1500, 0, 3100, 600, 2300], dtype=torch.int64)
    want = poison((4000,), torch.int32)
    got = want.clone()
    copy_items_reference(src, so, want, do, n_words)
    copy_items(src, so, got, do, n_words, 3, 64, 2, vector=vector)
    assert torch.equal(got, want)
    assert _vec_width(src, so, got, do, n_words) == (4 if shift == 0 and n_words % 4 == 0 else 1)


@pytest.mark.gpu
@pytest.mark.parametrize("shift", [0, 1])
def test_copy_items_four_words_a_lane_over_mapped_memory_on_cuda(shift):
    """Both directions between the GPU and pinned host memory, offsets in pinned memory as the transfer paths keep
    them: aligned (128-bit accesses) and one word off (one word a lane, no misaligned fault), bit-exact."""
    from tiered_cache.kernels.hostcopy import _vec_width, copy_items

    g = torch.Generator().manual_seed(7 + shift)
    host = torch.randint(-2**31, 2**31 - 1, (1 << 16,), dtype=torch.int32, generator=g).pin_memory()
    devw = torch.full((1 << 16,), -1, dtype=torch.int32, device="cuda")
    so = (torch.tensor([0, 9000, 20000, 40000], dtype=torch.int64) + shift).pin_memory()
    do = torch.tensor([30000, 0, 50000, 10000], dtype=torch.int64).pin_memory()
    n = 8192
    assert _vec_width(host, so, devw, do, n) == (1 if shift else 4)
    copy_items(host, so, devw, do, n)  # H2D
    back = torch.full_like(host, -1).pin_memory()
    copy_items(devw, do, back, so, n)  # D2H into the same host offsets
    torch.cuda.synchronize()
    got = devw.cpu()
    for a, b in zip(so.tolist(), do.tolist()):
        assert torch.equal(got[b:b + n], host[a:a + n])
        assert torch.equal(back[a:a + n], host[a:a + n])


def test_copy_items_vector_width_is_checked_never_assumed():
    """Four words a lane only where both tensors, ``n_words`` and every offset (read on the host) are 16-byte
    aligned: a 128-bit access of a misaligned address faults on a GPU."""
    from tiered_cache.kernels.hostcopy import _vec_width

    x, y = torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    ok = torch.tensor([0, 8, 4], dtype=torch.int64)
    assert _vec_width(x, ok, y, ok, 8) == 4
    assert _vec_width(x, ok, y, ok, 6) == 1  # n_words
    assert _vec_width(x, ok, y, torch.tensor([0, 8, 6]), 8) == 1  # one destination offset
    assert _vec_width(x, torch.tensor([2, 8, 4]), y, ok, 8) == 1  # one source offset
    assert _vec_width(x[1:], ok, y, ok, 8) == 1  # a view one word past 16 bytes
    assert _vec_width(x, ok, y[2:], ok, 8) == 1
    assert _vec_width(x, ok.to("meta"), y, ok, 8) == 1  # offsets not on the host: not read, one word a lane


@pytest.mark.parametrize("kw,arg", [({"block_words": 100}, "block_words"), ({"num_warps": 3}, "num_warps"),
                                    ({"num_programs": 0}, "num_programs")])
def test_copy_items_bad_settings_name_the_argument(kw, arg):
    from tiered_cache.kernels.hostcopy import copy_items

    x = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(InvalidArgumentError, match=arg):
        copy_items(x, torch.tensor([0]), x.clone(), torch.tensor([0]), 4, **kw)


def test_copy_items_vector_must_be_a_bool():
    from tiered_cache.kernels.hostcopy import copy_items

    x = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(InvalidTypeError, match="vector"):
        copy_items(x, torch.tensor([0]), x.clone(), torch.tensor([0]), 4, vector=1)


def _runs_one_by_one(slots, per_chunk):
    """The run grouping spelled out slot by slot (the twin of ``HostRegion.runs``)."""
    out = []
    for pos, s in enumerate(slots):
        if out and s == out[-1][1] + out[-1][2] and s // per_chunk == out[-1][1] // per_chunk:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((pos, s, 1))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_runs_match_the_slot_by_slot_grouping(seed):
    m = HostMirror([RegionSpec("x", 48, 40)], chunk_bytes=48 * 7)  # 7 slots a chunk
    r = m.region("x")
    g = torch.Generator().manual_seed(seed)
    for n in (0, 1, 5, 40):
        base = sorted(torch.randperm(40, generator=g)[:n].tolist())
        mixed = base[: n // 2] + torch.randperm(40, generator=g)[: n - n // 2].tolist()  # runs, then strays
        for slots in (base, mixed, list(range(n))):
            assert r.runs(slots) == _runs_one_by_one(slots, r.per_chunk)
