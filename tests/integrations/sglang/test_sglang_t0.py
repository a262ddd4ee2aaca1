"""``SGLangKVSide`` over SGLang's real paged allocator and MHA KV pool on CPU: the ids are SGLang's, the
room is SGLang's (its allocator's free count moves with ours and comes back), misuse is a typed error
with nothing freed, busy pages are refused, and what is not a view of SGLang's layout is not offered."""

from __future__ import annotations

import numpy as np
import pytest
import torch

memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
allocator_mod = pytest.importorskip("sglang.srt.mem_cache.allocator")

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, SlotBusyError, SlotStateError  # noqa: E402
from tiered_cache.integrations.sglang.t0 import SGLangKVSide  # noqa: E402
from tiered_cache.tiers.protocols import ActiveSide, KVSide  # noqa: E402

PAGE, TOKENS, LAYERS, HEADS, DIM = 16, 128, 3, 2, 8


def _sglang(device: str = "cpu"):
    pool = memory_pool.MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.float32, head_num=HEADS,
                                        head_dim=DIM, layer_num=LAYERS, device=device, enable_memory_saver=False)
    alloc = allocator_mod.PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.float32, device, pool, need_sort=False)
    return alloc, pool


def test_the_side_is_sglangs_memory(device):
    alloc, pool = _sglang(device)
    side = SGLangKVSide(alloc)
    # every member of the T0 protocol but the views that would span SGLang's per-layer buffers (t0.py);
    # rows_bytes is there (an ActiveSide, as the tree requires) but only as a typed error
    members = {n for proto in (ActiveSide, KVSide) for n in vars(proto) if not n.startswith("_")}
    assert {"alloc", "free", "rows_bytes", "k_view_all"} <= members
    assert sorted(n for n in members if not hasattr(side, n)) == ["k_view_all", "v_view_all"]
    assert isinstance(side, ActiveSide) and not isinstance(side, KVSide)
    with pytest.raises(InvalidArgumentError) as e:
        side.rows_bytes()
    assert e.value.arg == "allocator"
    assert (side.page_size, side.capacity, side.device.type) == (PAGE, TOKENS // PAGE + 1, device)
    assert side.entry_bytes == LAYERS * 2 * PAGE * HEADS * DIM * 4
    assert side.available_size() == alloc.available_size() == TOKENS
    ids = side.alloc(48)
    assert ids.dtype == torch.int64 and ids.numel() == 48 and alloc.available_size() == TOKENS - 48
    assert ids.min().item() >= PAGE  # page 0 is SGLang's padding page, never handed out
    pages = sorted(set((ids // PAGE).tolist()))
    assert side.live_virtual_ids() == pages and side.physical_rows(pages) == pages
    assert torch.equal(side.translate(ids), ids)
    # what is written at a token id through SGLang's pool is what the id names on our side
    pool.k_buffer[1][ids[5]] = 7.0
    assert torch.equal(pool.get_key_buffer(1)[side.translate(ids[5:6])].cpu(), torch.full((1, HEADS, DIM), 7.0))
    host = side.translate_host(np.array([int(ids[0]), 0, 5 * PAGE + 100 * PAGE]))
    assert host[0] == int(ids[0]) and host[1] == -1 and host[2] == -1
    side.free(ids)
    assert side.available_size() == alloc.available_size() == TOKENS and side.live_virtual_ids() == []


def test_ids_sglangs_scheduler_allocated_are_live_here_too():
    """The scheduler allocates a running request's KV from the allocator itself; the tree later frees
    those pages (once inserted) through the side."""
    alloc, _ = _sglang()
    side = SGLangKVSide(alloc)
    ids = alloc.alloc(32).to(torch.int64)
    assert side.live_virtual_ids() == sorted(set((ids // PAGE).tolist()))
    side.free(ids)
    assert alloc.available_size() == TOKENS


def test_misuse_is_a_typed_error_and_frees_nothing():
    alloc, _ = _sglang()
    side = SGLangKVSide(alloc)
    ids = side.alloc(32)
    before = alloc.available_size()
    cases = [
        (ids[:8], InvalidArgumentError, "ids"),                        # part of a page
        (torch.cat([ids[:16], ids[:16]]), SlotStateError, "ids"),       # a page twice
        (ids.float(), InvalidTypeError, "ids"),
        (torch.arange(PAGE * 7, PAGE * 8), SlotStateError, "ids"),      # a free page
        (torch.arange(0, PAGE), SlotStateError, "ids"),                 # the padding page
    ]
    for bad, err, arg in cases:
        with pytest.raises(err) as e:
            side.free(bad)
        assert e.value.arg == arg
        assert alloc.available_size() == before
    with pytest.raises(InvalidArgumentError) as e:
        side.alloc(10)
    assert e.value.arg == "n"
    assert side.alloc(TOKENS) is None and alloc.available_size() == before  # no room: None, nothing changed
    with pytest.raises(InvalidTypeError):
        SGLangKVSide(object())


def test_busy_pages_are_refused_until_unmarked():
    alloc, _ = _sglang()
    side = SGLangKVSide(alloc)
    ids = side.alloc(32)
    page = int(ids[0]) // PAGE
    side.mark_busy([page])
    side.mark_busy([page])  # two transfers
    with pytest.raises(SlotBusyError):
        side.free(ids)
    side.unmark_busy([page])
    with pytest.raises(SlotBusyError):
        side.free(ids)
    side.unmark_busy([page])
    with pytest.raises(SlotStateError):
        side.unmark_busy([page])
    side.free(ids)
    assert alloc.available_size() == TOKENS


# ----------------------------------------------------------------------------- the state side
mamba_utils = pytest.importorskip("sglang.srt.configs.mamba_utils")
mamba_alloc_mod = pytest.importorskip("sglang.srt.mem_cache.allocator.mamba")

from tiered_cache.integrations.sglang.t0 import SGLangStateSide  # noqa: E402
from tiered_cache.kernels._ref_quant import dequantize_reference, quantize_reference  # noqa: E402
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool  # noqa: E402
from tiered_cache.tiers.protocols import StateSide  # noqa: E402

SLOTS = 4


def _mamba(envelope: bool, device: str = "cpu"):
    shape = mamba_utils.Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2,
                                                head_dim=4, state_size=8, conv_kernel=4)
    params = mamba_utils.Mamba2CacheParams(shape=shape, layers=[0, 2],
                                           dtype=mamba_utils.Mamba2StateDType(conv=torch.float32,
                                                                              temporal=torch.float32))
    pool = memory_pool.MambaPool(size=SLOTS, spec_state_size=0, cache_params=params, mamba_layer_ids=[0, 2],
                                 device=device, envelope_layout=envelope)
    return pool, mamba_alloc_mod.MambaSlotAllocator(SLOTS, device)


@pytest.mark.parametrize("envelope", [True, False])
def test_the_state_side_is_sglangs_mamba_pool(envelope):
    pool, alloc = _mamba(envelope)
    side = SGLangStateSide(pool, alloc)
    assert isinstance(side, StateSide)
    assert side.spec.temporal_shape == (2, 4, 8) and side.spec.conv_shapes == ((32, 3),)
    assert side.capacity == SLOTS + 1 and side.available_size() == alloc.available_size() == SLOTS
    assert side.temporal_view_all().data_ptr() == pool.mamba_cache.temporal.data_ptr()  # SGLang's memory itself
    if envelope:
        rows = side.rows_bytes()
        assert rows.shape == (SLOTS + 1, side.entry_bytes)
    else:
        with pytest.raises(InvalidArgumentError) as e:
            side.rows_bytes()
        assert e.value.arg == "pool"
    slots = side.alloc(2)
    assert alloc.available_size() == SLOTS - 2 and side.live_virtual_ids() == sorted(slots.tolist())
    for bad, err in ((torch.tensor([0]), SlotStateError), (torch.tensor([int(slots[0])] * 2), SlotStateError),
                     (slots.float(), InvalidTypeError)):
        with pytest.raises(err):
            side.free(bad)
    side.mark_busy([int(slots[0])])
    with pytest.raises(SlotBusyError):
        side.free(slots)
    side.unmark_busy([int(slots[0])])
    assert alloc.available_size() == SLOTS - 2
    side.free(slots)
    assert alloc.available_size() == SLOTS and side.live_virtual_ids() == []


@pytest.mark.parametrize("codec", ["lossless", "int8"])
def test_a_state_in_sglangs_slot_goes_through_t1_and_comes_back(codec, device, poison):
    """T1 quantizes straight out of SGLang's slot and dequantizes straight into another: lossless is
    bit-exact, int8 is one rounding (the reference math); the conv windows are copies."""
    pool, alloc = _mamba(envelope=True, device=device)
    side = SGLangStateSide(pool, alloc)
    t1 = Int8CheckpointPool(side.spec, 2, device=device, codec=codec, check_memory=False)
    src, dst = side.alloc(1), side.alloc(1)
    g = torch.Generator().manual_seed(3)
    temporal = torch.randn((2, *side.spec.temporal_shape), generator=g).to(device)
    conv = torch.randn((2, *side.spec.conv_shapes[0]), generator=g).to(device)
    pool.mamba_cache.temporal[:, int(src)] = temporal
    pool.mamba_cache.conv[0][:, int(src)] = conv
    pool.mamba_cache.temporal[:, int(dst)] = poison.value(torch.float32)  # an element the load misses shows
    pool.mamba_cache.conv[0][:, int(dst)] = poison.value(torch.float32)
    slot = t1.alloc(1)
    t1.store_from_active(side, src, slot)
    t1.load_to_active(slot, side, dst)
    got = pool.mamba_cache.temporal[:, int(dst)]
    if codec == "lossless":
        assert torch.equal(got, temporal)
    else:
        q, scale = quantize_reference(temporal)
        assert torch.equal(got, dequantize_reference(q, scale, torch.float32)) and not torch.equal(got, temporal)
    assert torch.equal(pool.mamba_cache.conv[0][:, int(dst)], conv)
    side.free(torch.cat([src, dst]))
    t1.free(slot)
    assert alloc.available_size() == SLOTS and t1.available_size() == 2


def test_sglang_t0_hands_out_the_sides_by_name():
    from tiered_cache.integrations.sglang.t0 import SGLangT0

    alloc, _ = _sglang()
    pool, mamba_alloc = _mamba(envelope=True)
    kv, st = SGLangKVSide(alloc), SGLangStateSide(pool, mamba_alloc)
    t0 = SGLangT0(kv, st)
    assert t0.side("full") is kv and t0.side("mamba") is st
    with pytest.raises(InvalidArgumentError) as e:
        t0.side("swa")
    assert e.value.arg == "name"
    with pytest.raises(InvalidTypeError) as e:
        SGLangT0(st, kv)
    assert e.value.arg == "kv"
    ids = kv.alloc(16)
    kv.mark_busy([int(ids[0]) // PAGE])
    t0.check_invariants()
    kv._busy[int(ids[0]) // PAGE + 1] += 1  # a busy mark on a free page: the check must see it
    with pytest.raises(AssertionError):
        t0.check_invariants()
