"""The T2 slot checksum (issue 17, item 3): kernel == reference == definition; every 1-, 2- and 3-bit error
caught; random multi-bit corruption caught; a 3-bit flip in a T2 copy makes its load ``ok=False``.

The bug these pin: the old checksum ``sum_i w_i (2i + 1) mod 2**64`` missed 3-bit errors (+1 at bit 0
of word 0, +3 from bit 0 of word 1, -4 from bit 2 of word 0), so such a flip in a host copy loaded
with ``ok=True``.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from tiered_cache import InvalidArgumentError, KVSpec, StateSpec, UnifiedPool
from tiered_cache.kernels import _checksum_tables as ct
from tiered_cache.kernels.checksum import row_checksums
from tiered_cache.kernels.reference import row_checksums_reference
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec
from tiered_cache.transfer.engine import TransferEngine
from tiered_cache.transfer.moves import demote_kv, demote_states, load_kv, promote_states

ROW_SIZES = [16, 48, 4096, 2048 * 4 * 3 + 16]  # the last spans four tiles, one of them a 4-word stub


def _rows(n: int, nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=g)


def _definition(row: bytes) -> int:
    """The checksum from its definition, one bit and one word at a time in Python ints."""
    n = len(row) // 4
    words = struct.unpack(f"<{n}I", row)
    a, b, s = (t.tolist() for t in ct.checksum_tables("cpu"))
    parity = pos = 0
    for i, w in enumerate(words):
        for bit in range(32):
            if w >> bit & 1:
                parity ^= 1
                pos ^= 32 * i + bit
    h = sum(s[i // ct.TILE] * ((w & 0xFFFF) * a[i % ct.TILE] + (w >> 16) * b[i % ct.TILE])
            for i, w in enumerate(words)) % ct.P
    return (parity | pos << 1) | h << 32


def _sums(rows: torch.Tensor) -> torch.Tensor:
    return row_checksums_reference(rows, torch.arange(rows.shape[0]))


# ------------------------------------------------------------------------------------ kernel vs twin
@pytest.mark.parametrize("nbytes", ROW_SIZES)
def test_kernel_equals_reference_bit_exact(nbytes):
    """The Triton kernel (interpreter) and the torch twin agree on every row, in any order, repeated rows
    included, written into an ``out`` full of garbage (a slot it did not write would show)."""
    rows = _rows(6, nbytes, nbytes)
    for ids in (torch.tensor([5, 0, 3, 3]), torch.tensor([2, 4, 1], dtype=torch.int32)):
        out = torch.randint(-2**62, 2**62, (len(ids),), dtype=torch.int64)
        got = row_checksums(rows, ids, backend="triton", out=out)
        assert got.data_ptr() == out.data_ptr()
        assert torch.equal(out, row_checksums_reference(rows, ids.long()))
        assert torch.equal(row_checksums(rows, ids, backend="triton"), out)
        assert torch.equal(row_checksums(rows, ids, backend="torch"), out)


@pytest.mark.parametrize("iters", [1, 2])
def test_kernel_split_over_parts_equals_reference(monkeypatch, iters):
    """A row split over several programs (as on the GPU), whose parts the combine kernel XORs and adds
    mod p: 6148 words in 4 or 2 parts of 1 or 2 blocks."""
    from tiered_cache.kernels import checksum

    monkeypatch.setattr(checksum, "_iters", lambda row_words, block, n_rows, cuda: iters)
    rows = _rows(3, 2048 * 4 * 3 + 16, 21)
    ids = torch.tensor([2, 0, 1, 2])
    out = torch.randint(-2**62, 2**62, (4,), dtype=torch.int64)
    row_checksums(rows, ids, backend="triton", out=out)
    assert torch.equal(out, row_checksums_reference(rows, ids))


@pytest.mark.parametrize("programs", [1, 3, 64])
def test_kernel_with_fewer_programs_than_items_equals_reference(monkeypatch, programs):
    """A capped grid (``programs``): each program loops over its share of the (row, part) items; 5 rows
    in 3 parts each are 15 items for 1, 3 or 64 programs."""
    from tiered_cache.kernels import checksum

    monkeypatch.setattr(checksum, "_iters", lambda row_words, block, n_rows, cuda: 1)
    rows = _rows(5, 2048 * 4 * 2 + 64, 23)
    ids = torch.tensor([4, 1, 1, 0, 3])
    out = torch.randint(-2**62, 2**62, (5,), dtype=torch.int64)
    row_checksums(rows, ids, backend="triton", out=out, programs=programs)
    assert torch.equal(out, row_checksums_reference(rows, ids))


def test_gpu_split_keeps_many_rows_whole_and_splits_few_big_ones():
    """The GPU's split: 2,048 KV pages of 384 KiB are one item each (fused, no combine kernel); 32
    Qwen3-Next state envelopes of 21 MB split to about ``TARGET_ITEMS`` items of >= 8 blocks."""
    from tiered_cache.kernels import checksum

    kv_iters = checksum._iters(98304, 2048, 2048, True)
    assert triton_cdiv(98304, 2048 * kv_iters) == 1
    st_iters = checksum._iters(5308416, 2048, 32, True)
    parts = triton_cdiv(5308416, 2048 * st_iters)
    assert st_iters >= checksum.MIN_PART_BLOCKS and 32 * parts >= checksum.TARGET_ITEMS // 2
    assert checksum._iters(5308416, 2048, 32, False) == 2592  # the interpreter: one item a row


@pytest.mark.parametrize("n_rows", [1, 3, 9])
def test_gpu_split_rule_run_in_the_interpreter_equals_reference(monkeypatch, n_rows):
    """The GPU's own split rule (``_iters`` with cuda=True, ``TARGET_ITEMS`` scaled down to 8 so small
    rows split), in the interpreter: split rows (combine kernel) for 1 and 3 rows, fused for 9."""
    from tiered_cache.kernels import checksum

    rule = checksum._iters
    monkeypatch.setattr(checksum, "TARGET_ITEMS", 8)
    monkeypatch.setattr(checksum, "MIN_PART_BLOCKS", 1)
    monkeypatch.setattr(checksum, "_iters", lambda row_words, block, n, cuda: rule(row_words, block, n, True))
    rows = _rows(n_rows, 2048 * 4 * 3 + 48, 40 + n_rows)
    ids = torch.arange(n_rows - 1, -1, -1)
    out = torch.randint(-2**62, 2**62, (n_rows,), dtype=torch.int64)
    row_checksums(rows, ids, backend="triton", out=out)
    assert torch.equal(out, row_checksums_reference(rows, ids))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.mark.parametrize("programs", [0, -1, 1.5, "4", True])
def test_programs_must_be_a_positive_int(programs):
    rows = _rows(2, 64, 3)
    with pytest.raises(InvalidArgumentError, match="programs"):
        row_checksums(rows, torch.tensor([0, 1]), backend="triton", programs=programs)


@pytest.mark.gpu
def test_kernel_on_the_gpu_equals_reference_for_long_split_rows(poison):
    """Rows of 1 MiB + 16 B (17 parts of up to 8 blocks) and a state-envelope-like 21 MB row, read
    through page-locked row ids and written into page-locked sums, as the transfer engine does."""
    for nbytes, n in ((1 << 20) + 16, 5), (21_233_664, 2):
        rows = _rows(n, nbytes, 31).cuda()
        ids = torch.arange(n - 1, -1, -1)
        out = poison((n,), torch.int64).pin_memory()
        row_checksums(rows, ids.pin_memory(), backend="triton", out=out)
        torch.cuda.synchronize()
        assert torch.equal(out, row_checksums_reference(rows.cpu(), ids))


@pytest.mark.parametrize("nbytes", [16, 48, 4096, 2048 * 4 + 32])
def test_reference_equals_the_definition(nbytes):
    """The vectorized twin against a bit-by-bit Python reading of the definition (a second tile included)."""
    rows = _rows(3, nbytes, 100 + nbytes)
    want = [_definition(bytes(r.tolist())) for r in rows]
    assert _sums(rows).tolist() == want


def test_tables_are_splitmix64_of_the_fixed_seed_in_range():
    """The tables are part of the checksum's definition (T3 keeps checksums across processes): they come
    from splitmix64, checked here against its published first output for seed 0."""
    with np.errstate(over="ignore"):
        assert int(ct._splitmix64(1, 0)[0]) == 0xE220A8397B1DCDAF
    a, b, s = ct.checksum_tables("cpu")
    assert a.shape == b.shape == (ct.TILE,) and s.shape == (ct.TILES,)
    for t in (a, b, s):
        assert t.dtype == torch.int32 and int(t.min()) >= 0 and int(t.max()) < ct.P
        assert len(torch.unique(t)) > 0.99 * t.numel()
    assert all(x is y for x, y in zip(ct.checksum_tables("cpu"), (a, b, s)))  # built once, cached


def test_rows_longer_than_2_pow_26_words_are_refused_by_name():
    """Past 2**26 words bit positions alias in the syndrome's 31 position bits: refused, out unchanged."""
    big = torch.empty(1, 4 * ct.MAX_WORDS + 16, dtype=torch.uint8, device="meta")
    out = torch.full((1,), 7, dtype=torch.int64)
    for backend in ("torch", "triton"):
        with pytest.raises(InvalidArgumentError, match="rows_view"):
            row_checksums(big, torch.tensor([0]), backend=backend, out=out)
    with pytest.raises(InvalidArgumentError, match="rows_view"):
        row_checksums_reference(big, torch.tensor([0]))
    assert out.tolist() == [7]
    with pytest.raises(TypeError, match="rows"):
        row_checksums(_rows(1, 16, 0), [0])
    with pytest.raises(TypeError, match="out"):
        row_checksums(_rows(1, 16, 0), torch.tensor([0]), out=[0])


# ------------------------------------------------------------------------------------ detection
def _counterexample(rows: torch.Tensor, i: int) -> torch.Tensor:
    """A copy of ``rows`` with the 3-bit error the old checksum missed, at words ``i`` and ``3i + 1``:
    +1 (bit 0 of word i), -4 (bit 2 of word i), +1 (bit 0 of word 3i + 1); the old sum changes by
    (1 - 4)(2i + 1) + (2(3i + 1) + 1) = 0. ``rows`` is first set (in place) so those are the bits' values."""
    rows.copy_(_counterexample_base(rows, i))
    bad = rows.clone()
    bw = bad.view(torch.int32)
    bw[:, i] ^= 0b101
    bw[:, 3 * i + 1] ^= 1
    return bad


def _old_checksum(rows: torch.Tensor) -> torch.Tensor:
    w = rows.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return (w * (torch.arange(w.shape[1]) * 2 + 1)).sum(dim=1)


@pytest.mark.parametrize("nbytes", [16, 4096])
def test_constructed_three_bit_error_is_caught(nbytes):
    """The counterexample of the issue: the old checksum kept its value, the new one (kernel and twin) changes."""
    rows = _rows(4, nbytes, 3)
    bad = _counterexample(rows, 0 if nbytes == 16 else 5)
    assert torch.equal(_old_checksum(rows), _old_checksum(bad))  # what the old code could not see
    ids = torch.arange(4)
    assert not (row_checksums(rows, ids, backend="triton") == row_checksums(bad, ids, backend="triton")).any()
    assert not (_sums(rows) == _sums(bad)).any()


def _bit_errors(nbits: int):
    """Every error pattern of 1, 2 and 3 bits among ``nbits``, in batches of [patterns, nbits // 32]
    int64 words. A 3-bit pattern {a < b < c} is the pair {b < c} XOR bit a; pairs come in lexicographic
    order, so those with b > a are a suffix of the pair list."""
    single = torch.zeros(nbits, nbits // 32, dtype=torch.int64)
    pos = torch.arange(nbits)
    single[pos, pos // 32] = 1 << (pos % 32)
    pairs = torch.combinations(pos, 2)
    pair_words = single[pairs[:, 0]] ^ single[pairs[:, 1]]
    first = torch.searchsorted(pairs[:, 0].contiguous(), pos, right=True)  # pairs[first[a]:] all have b > a
    yield single
    yield pair_words
    batch, size = [], 0
    for a in range(nbits - 2):
        batch.append(pair_words[first[a]:] ^ single[a])
        size += len(batch[-1])
        if size >= 1 << 18 or a == nbits - 3:
            yield torch.cat(batch)
            batch, size = [], 0


def _apply(base: torch.Tensor, err_words: torch.Tensor) -> torch.Tensor:
    """``base`` ([E] uint8) XOR each error row, as [patterns, E] uint8 rows."""
    bw = base.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    x = bw ^ err_words
    x = torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)
    return x.contiguous().view(torch.uint8)


@pytest.mark.parametrize("nbytes", [16, pytest.param(32, marks=pytest.mark.slow)])
def test_every_error_of_one_two_or_three_bits_is_caught_exhaustively(nbytes):
    """All C(8E, 1) + C(8E, 2) + C(8E, 3) patterns (2.8 M for 32-byte rows) change the checksum; the old
    checksum missed some of them (counted here too, so the exhaustive set does reach its blind spot)."""
    base = _rows(1, nbytes, 11 + nbytes)[0]
    want = int(_sums(base[None])[0])
    old_want = int(_old_checksum(base[None])[0])
    seen = old_misses = 0
    for errs in _bit_errors(8 * nbytes):
        rows = _apply(base, errs)
        weights = sum(int(x).bit_count() for x in errs[0])
        assert not (_sums(rows) == want).any(), f"a {weights}-bit error was missed"
        old_misses += int((_old_checksum(rows) == old_want).sum())
        seen += len(errs)
    n = 8 * nbytes
    assert seen == n + n * (n - 1) // 2 + n * (n - 1) * (n - 2) // 6
    assert old_misses > 0
    last = next(e for i, e in enumerate(_bit_errors(8 * nbytes)) if i == 2)
    sample = _apply(base, last[:: max(1, len(last) // 40)])  # and the kernel, on a spread sample
    assert not (row_checksums(sample, torch.arange(len(sample)), backend="triton") == want).any()


# Per seed: (row bytes, corruptions) for weight flips and for byte replacements; 1.07 M in all.
RANDOM_PLAN = [(16, 200_000), (32, 150_000), (64, 130_000), (256, 30_000), (1024, 20_000), (4096, 5_000)]


def _distinct(n: int, size: int, k_max: int, k: torch.Tensor, g: torch.Generator):
    """Per row, ``k_max`` distinct positions in ``[0, size)`` in random order, and a mask keeping the
    first ``k`` of them. Sorted draws from ``[0, size - k_max]`` plus ``0, 1, ..`` are distinct; the
    shuffle makes the kept ones any of them (cost O(k_max) a row, not O(size))."""
    pos = torch.randint(0, size - k_max + 1, (n, k_max), generator=g).sort(dim=1).values + torch.arange(k_max)
    pos = pos.gather(1, torch.rand(n, k_max, generator=g).argsort(dim=1))
    return pos, torch.arange(k_max) < k[:, None]


def _flip_random_bits(rows: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Each row with 4..64 random distinct bits flipped."""
    n, nbytes = rows.shape
    pos, keep = _distinct(n, 8 * nbytes, 64, torch.randint(4, 65, (n,), generator=g), g)
    mask = torch.zeros(n, nbytes, dtype=torch.int64)
    mask.scatter_add_(1, pos // 8, keep.long() << (pos % 8))  # distinct bits: add = or
    return rows ^ mask.to(torch.uint8)


def _replace_random_bytes(rows: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Each row with 1..64 random bytes (or, for every 8th row, all of them) replaced by random values."""
    n, nbytes = rows.shape
    k_max = min(64, nbytes)
    m = torch.randint(1, k_max + 1, (n,), generator=g)
    pos, keep = _distinct(n, nbytes, k_max, m, g)
    hit = torch.zeros(n, nbytes, dtype=torch.bool).scatter_(1, pos, keep)
    hit[::8] = True
    return torch.where(hit, torch.randint(0, 256, rows.shape, dtype=torch.uint8, generator=g), rows)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_multi_bit_corruption_is_caught_for_every_seed(seed):
    """Over 10**6 random corruptions per seed (weight 4..64 flips; random byte replacement), rows of
    16 B .. 4 KiB, each row its own random data: every changed row changes its checksum. The bound is a
    miss probability below 2**-32 each, so a failure on any seed here would be a real defect."""
    g = torch.Generator().manual_seed(seed)
    changed_total = 0
    for nbytes, count in RANDOM_PLAN:
        chunk = max(1, (1 << 22) // (8 * nbytes))
        for c0 in range(0, count, chunk):
            base = torch.randint(0, 256, (min(chunk, count - c0), nbytes), dtype=torch.uint8, generator=g)
            want = _sums(base)
            for corrupt in (_flip_random_bits, _replace_random_bytes):
                bad = corrupt(base, g)
                changed = (bad != base).any(dim=1)
                assert not ((_sums(bad) == want) & changed).any(), (nbytes, corrupt.__name__)
                changed_total += int(changed.sum())
    assert changed_total >= 10**6


# ------------------------------------------------------------------------------------ end to end
KV = KVSpec(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.float16)
ST = StateSpec(num_layers=2, temporal_shape=(2, 8, 16), temporal_dtype=torch.float32,
               conv_shapes=((6, 3),), conv_dtype=torch.bfloat16, value_axis=2)


def _setup():
    pool = UnifiedPool(KV, ST, low_slots=16, high_slots=6, page_size=4, device="cpu")
    t1 = Int8CheckpointPool(ST, 8, device="cpu", codec="int8")
    mirror = HostMirror([RegionSpec("state", t1.slot_bytes, 8), RegionSpec("full", pool.low.entry_bytes, 16)])
    return pool, t1, mirror, TransferEngine("cpu")


def _flip_counterexample(region, slot: int, i: int) -> None:
    """The 3-bit error of ``_counterexample`` at words i, 3i + 1 of a host slot (its bits set up before)."""
    for byte, bit in ((4 * i, 0), (4 * i, 2), (4 * (3 * i + 1), 0)):
        region.flip_bit(slot, byte, bit)


def test_three_bit_flip_in_a_demoted_kv_page_fails_its_load():
    """A host KV page with the counterexample flipped loads ``ok=False`` (it loaded ``ok=True`` before);
    the clean page in the same ticket still loads ``ok=True``."""
    pool, _, mirror, eng = _setup()
    full, region = pool.side("full"), mirror.region("full")
    toks = full.alloc(8)
    rows = full.translate(toks[::4]) // 4
    view = full.rows_bytes()
    view[rows] = _rows(2, view.shape[1], 5)
    view[rows[0]] = _counterexample_base(view[rows[0]], 2)
    hs = region.alloc(2)
    assert eng.wait(demote_kv(eng, full, toks, region, hs)) and all(region.valid[hs])
    _flip_counterexample(region, hs[0], 2)
    full.free(toks)
    back = full.alloc(8)
    t = load_kv(eng, region, hs, full, back, layerwise=True)
    assert eng.wait(t) and t.ok == [False, True] and eng.stats["checksum_failures"] == 1


def _counterexample_base(row: torch.Tensor, i: int) -> torch.Tensor:
    """``row`` with the bits the counterexample flips at words i, 3i + 1 set to 0, 1 (bit 2), 0."""
    r = row.clone()
    w = r.view(torch.int32)
    w[..., i] = (w[..., i] & ~1) | 4
    w[..., 3 * i + 1] &= ~1
    return r


def test_three_bit_flip_in_a_state_slots_host_bytes_fails_its_promote():
    """The same for a state envelope in T2: its promote is ``ok=False``, the other one's ``ok=True``."""
    _, t1, mirror, eng = _setup()
    region = mirror.region("state")
    src = t1.alloc(2).tolist()
    t1.envelopes[src] = _rows(2, t1.slot_bytes, 6)
    t1.envelopes[src[1]] = _counterexample_base(t1.envelopes[src[1]], 7)
    hs = region.alloc(2)
    assert eng.wait(demote_states(eng, t1, src, region, hs))
    _flip_counterexample(region, hs[1], 7)
    dst = t1.alloc(2).tolist()
    t = promote_states(eng, region, hs, t1, dst)
    assert eng.wait(t) and t.ok == [True, False] and eng.stats["checksum_failures"] == 1


def test_bench_transfer_checksum_overheads_smoke_on_cpu():
    """bench_transfer's checksum-overhead helper (which now also times KV pages, ``checksum_overhead_kv``)
    runs its interleaved on/off rounds on a CPU engine, switches checksums back on, and every verified
    load in it passes: the GPU run cannot trip on it."""
    from benchmarks.bench_transfer import checksum_overheads

    pool, _, mirror, eng = _setup()
    full, region = pool.side("full"), mirror.region("full")
    src, dst = full.alloc(8), full.alloc(8)
    full.rows_bytes().copy_(_rows(*full.rows_bytes().shape, 9))
    hs = region.alloc(4)
    assert eng.wait(demote_kv(eng, full, src, region, hs[:2]))
    loads = []

    def kv_bidir():
        d = demote_kv(eng, full, src, region, hs[2:])
        t = load_kv(eng, region, hs[:2], full, dst, layerwise=False)
        assert eng.wait(d) and eng.wait(t) and t.ok == [True, True]
        loads.append(eng.checksums)

    m = checksum_overheads(eng, {"checksum_overhead_kv": kv_bidir}, rounds=2)
    assert set(m) == {"checksum_overhead_kv", "checksum_overhead_kv_worst_round"}
    assert all(np.isfinite(v) and v > -1 for v in m.values())
    assert eng.checksums and True in loads and False in loads and eng.stats["checksum_failures"] == 0
