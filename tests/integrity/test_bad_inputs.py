"""Table-driven bad-input test (issue 17, items 6, 7 and 8) over the public constructors and methods of
``tiered_cache``, ``tiered_cache.storage`` and ``tiered_cache.transfer.moves``.

Each case crosses one argument of one call with one bad value of a class (wrong types; negative, zero,
huge, NaN and infinite sizes; wrong dtypes, devices and shapes; freed, repeated, out-of-range ids; str,
float, bool and None ids), every other argument good. It pins the three rules of the brief: the call
raises a typed error (a ``TieredCacheError``; also a ``TypeError`` for a value of the wrong type), the
error names the argument (``err.arg``, else its message), and nothing changed (sizes, free counts, ids,
bytes and ``check_invariants()`` of every fixture before and after). On the code before this change,
``free("12")`` freed slots 1 and 2, ``free([3.7])`` slot 3, NaN settings were kept, and 193 cases
raised builtin errors (IndexError, AttributeError, OverflowError, MemoryError) instead.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.bad_inputs_table import (
    BOOL,
    CHOICE,
    DEVICE,
    DTYPE,
    FP,
    HUGE,
    IDS_TYPE,
    INDEX,
    INF,
    KV,
    NAME,
    NONNEG_INT,
    NOT_INT,
    OBJ,
    OPT_SECONDS,
    POS_INT,
    POS_SECONDS,
    SECONDS,
    ST,
    STR,
    TENSOR,
    Api,
    D,
    T,
    V,
    World,
    ids_state,
)
from tiered_cache import (
    CacheReq,
    EvictParams,
    HiMambaRadixCache,
    HostMirror,
    InitLoadBackParams,
    InsertParams,
    Int8CheckpointPool,
    KVSpec,
    MatchPrefixParams,
    MultiEndedAllocator,
    RegionSpec,
    StateSpec,
    TieredCacheError,
    TransferEngine,
    UnifiedPool,
    prefill_checkpoint_positions,
)
from tiered_cache.errors import MemoryBudgetError
from tiered_cache.radix import RadixKey
from tiered_cache.storage import FileStore, Kind, StorageFingerprint, StorageTier, open_backend, page_keys
from tiered_cache.transfer import moves

OPT_POS_SECONDS = [b for b in POS_SECONDS if b.label != "none"]  # None: no deadline
COUNT = NOT_INT + [V("negative", -1)]
SIZE = POS_INT + HUGE
KVS = [*OBJ, V("state_spec", ST)]
TOKENS = [T("str", "abc"), T("float_list", [1.5, 2.5]), T("bool_list", [True, False]), T("none", None),
          T("none_list", [None]), T("nested", [[1]]), T("float_tensor", torch.tensor([1.5])),
          T("object", object()), T("inf_list", [INF])]


def kv_state(page: int):
    return ids_state(lambda w: [int(i) // page for i in w.kv_ids[::page]], lambda w: 3,
                     lambda w: w.kv.capacity, page)


ST_IDS = ids_state(lambda w: w.st_ids.tolist(), lambda w: 3, lambda w: w.st.capacity)
SOLO_IDS = ids_state(lambda w: w.solo_ids.tolist(), lambda w: 4, lambda w: w.solo.capacity)
T1_IDS = ids_state(lambda w: w.t1_ids, lambda w: 3, lambda w: w.t1.capacity)
HS_IDS = ids_state(lambda w: w.hs_dst, lambda w: w.hs_freed, lambda w: w.hs.capacity)
HK_IDS = ids_state(lambda w: w.hk_dst, lambda w: w.hk_freed, lambda w: w.hk.capacity)
GATHER_IDS = [b for b in IDS_TYPE if b.label != "tensor_2d"]  # a gather takes ids of any shape
RANGE_IDS = [D("negative", lambda w: [-1]), D("past_end", lambda w: [10 ** 6]), D("huge", lambda w: [2 ** 63 - 1])]
SPEC_KW = dict(num_layers=2, kv_heads=1, head_dim=4)
ST_KW = dict(num_layers=2, temporal_shape=(2, 4, 4), temporal_dtype=torch.float32, conv_shapes=((4, 3),),
             conv_dtype=torch.float32, value_axis=1)
SHAPE = [T("str", "244"), T("none", None), T("int", 3), T("float_dims", (2.0, 4, 4)), T("bool_dim", (True, 4, 4)),
         V("two_dims", (2, 4)), V("zero_dim", (2, 0, 4)), V("negative_dim", (2, -1, 4)), V("four_dims", (2, 4, 4, 4)),
         V("huge_dim", (2, 4, 2 ** 40)), T("nested", ((2,), 4, 4))]
CONV = [T("str", "43"), T("none", None), T("int", 3), T("float_dims", ((4.5, 3),)), V("zero_dim", ((4, 0),)),
        V("empty_shape", ((),)), T("flat", (4, 3))]


def _pool(w, **kw):
    return UnifiedPool(**kw)


def _alloc(w, **kw):
    return MultiEndedAllocator(**kw)


def _tier_keys(w):
    return list(w.keys[:1])


APIS: list[Api] = [
    # ------------------------------------------------------------------------- specs
    Api("KVSpec", lambda w, **k: KVSpec(**k), dict(SPEC_KW, dtype=torch.float16, v_head_dim=0, window=0),
        {"num_layers": POS_INT + HUGE, "kv_heads": POS_INT + HUGE, "head_dim": POS_INT + HUGE,
         "v_head_dim": NONNEG_INT + HUGE, "window": NONNEG_INT, "dtype": DTYPE}),
    Api("StateSpec", lambda w, **k: StateSpec(**k), ST_KW,
        {"num_layers": POS_INT + HUGE, "temporal_shape": SHAPE, "conv_shapes": CONV,
         "temporal_dtype": DTYPE + [V("float64", torch.float64), V("int32", torch.int32)], "conv_dtype": DTYPE,
         "value_axis": NOT_INT + [V("zero", 0), V("three", 3), V("negative", -1)]}),
    Api("RegionSpec", lambda w, **k: RegionSpec(**k), dict(name="x", slot_bytes=64, num_slots=2),
        {"name": NAME, "slot_bytes": SIZE + [V("not_16", 24)], "num_slots": POS_INT}),
    # ------------------------------------------------------------------------- T0
    Api("UnifiedPool", _pool, dict(low=KV, high=ST, low_slots=4, high_slots=2, page_size=2, device="cpu",
                                   lazy_compaction=False, backend="torch", check_memory=True),
        {"low": KVS, "high": OBJ, "low_slots": SIZE, "high_slots": SIZE, "page_size": POS_INT + HUGE,
         "device": DEVICE, "lazy_compaction": BOOL, "backend": CHOICE, "check_memory": BOOL,
         "names": [V("same", ("a", "a")), T("one", ("a",)), T("str", "ab"), T("ints", (1, 2)), T("empty", ("", "x"))]}),
    Api("UnifiedPool(total_bytes)", _pool, dict(low=KV, high=ST, total_bytes=1 << 14, device="cpu"),
        {"total_bytes": SIZE + [V("not_16", (1 << 14) + 8), V("too_small", 32)]}),
    Api("UnifiedPool.bytes_for", lambda w, **k: UnifiedPool.bytes_for(**k),
        dict(low=KV, high=ST, low_slots=4, high_slots=2, page_size=1),
        {"low": OBJ, "high": OBJ, "low_slots": POS_INT + HUGE, "high_slots": POS_INT + HUGE, "page_size": POS_INT}),
    Api("UnifiedPool.side", lambda w, name: w.pool.side(name), dict(name="full"), {"name": STR + [V("bogus", "x")]}),
    Api("SubPool.alloc[kv]", lambda w, n: w.kv.alloc(n), dict(n=2), {"n": COUNT + [V("partial_page", 3)]}),
    Api("SubPool.alloc[state]", lambda w, n: w.st.alloc(n), dict(n=1), {"n": COUNT}),
    Api("SubPool.free[kv]", lambda w, ids: w.kv.free(ids), dict(ids=lambda w: w.kv_ids[:2]),
        {"ids": IDS_TYPE + kv_state(2)}),
    Api("SubPool.free[state]", lambda w, ids: w.st.free(ids), dict(ids=lambda w: w.st_ids[:1]),
        {"ids": IDS_TYPE + ST_IDS}),
    Api("SubPool.translate", lambda w, ids: w.kv.translate(ids), dict(ids=lambda w: w.kv_ids),
        {"ids": GATHER_IDS + RANGE_IDS}),
    Api("SubPool.k_view", lambda w, layer: w.kv.k_view(layer), dict(layer=0), {"layer": INDEX + [V("past", 2)]}),
    Api("SubPool.v_view", lambda w, layer: w.kv.v_view(layer), dict(layer=1), {"layer": INDEX + [V("past", 2)]}),
    Api("SubPool.temporal_view", lambda w, layer: w.st.temporal_view(layer), dict(layer=0),
        {"layer": INDEX + [V("past", 2)]}),
    Api("SubPool.conv_view", lambda w, layer, i: w.st.conv_view(layer, i), dict(layer=0, i=0),
        {"layer": INDEX, "i": INDEX + [V("past", 1)]}),
    Api("SubPool.k_view_all[state]", lambda w, side: w.pool.side(side).k_view_all(), dict(side="full"),
        {"side": [V("state_side", "mamba")]}),
    # ------------------------------------------------------------------------- allocator
    Api("MultiEndedAllocator", _alloc, dict(name="a", entry_bytes=64, total_bytes=640, grows="up", page_size=1,
                                            lazy=False, device="cpu", mover=None),
        {"name": STR, "entry_bytes": POS_INT, "total_bytes": POS_INT + HUGE + [V("too_small", 64), V("eib", 2 ** 63)],
         "grows": CHOICE, "page_size": POS_INT + HUGE, "lazy": BOOL, "device": DEVICE,
         "mover": [T("int", 3), T("str", "x")]}),
    Api("MultiEndedAllocator.alloc", lambda w, n: w.solo.alloc(n), dict(n=1), {"n": COUNT}),
    Api("MultiEndedAllocator.free", lambda w, ids: w.solo.free(ids), dict(ids=lambda w: w.solo_ids[:1]),
        {"ids": IDS_TYPE + SOLO_IDS}),
    Api("MultiEndedAllocator.translate_host", lambda w, ids: w.solo.translate_host(ids),
        dict(ids=lambda w: w.solo_ids.numpy()), {"ids": IDS_TYPE + RANGE_IDS}),
    Api("MultiEndedAllocator.translate_pages", lambda w, page_ids: w.solo.translate_pages(page_ids),
        dict(page_ids=lambda w: w.solo_ids), {"page_ids": GATHER_IDS + RANGE_IDS}),
    Api("MultiEndedAllocator.physical_rows", lambda w, vids: w.solo.physical_rows(vids),
        dict(vids=lambda w: w.solo_ids.tolist()), {"vids": IDS_TYPE + SOLO_IDS[:1] + SOLO_IDS[2:]}),
    Api("MultiEndedAllocator.physical_of", lambda w, vid: w.solo.physical_of(vid), dict(vid=1),
        {"vid": INDEX + [V("past", 10)]}),
    Api("MultiEndedAllocator.bind_peer", lambda w, peer: w.solo.bind_peer(peer), dict(peer=None),
        {"peer": OBJ + [D("itself", lambda w: w.solo), D("other_buffer", lambda w: w.kv.allocator)]}, control=False),
    # ------------------------------------------------------------------------- T1
    Api("Int8CheckpointPool", lambda w, **k: Int8CheckpointPool(**k),
        dict(spec=ST, num_slots=2, device="cpu", codec="int8", check_memory=True, backend="torch"),
        {"spec": [*OBJ, V("kv_spec", KV)], "num_slots": SIZE, "device": DEVICE, "codec": CHOICE,
         "check_memory": BOOL, "backend": CHOICE}),
    Api("Int8CheckpointPool.estimate_bytes", lambda w, **k: Int8CheckpointPool.estimate_bytes(**k),
        dict(spec=ST, num_slots=2, codec="int8"), {"spec": OBJ, "num_slots": POS_INT, "codec": CHOICE}),
    Api("Int8CheckpointPool.envelope", lambda w, slot: w.t1.envelope(slot), dict(slot=1),
        {"slot": INDEX + [V("past", 7)]}),
    Api("Int8CheckpointPool.field", lambda w, name: w.t1.field(name), dict(name="qdata"),
        {"name": STR + [V("bogus", "x")]}),
    Api("Int8CheckpointPool.alloc", lambda w, n: w.t1.alloc(n), dict(n=1), {"n": COUNT}),
    Api("Int8CheckpointPool.free", lambda w, ids: w.t1.free(ids), dict(ids=lambda w: w.t1_ids[:1]),
        {"ids": IDS_TYPE + T1_IDS}),
    Api("Int8CheckpointPool.is_allocated", lambda w, slot: w.t1.is_allocated(slot), dict(slot=1),
        {"slot": [b for b in NOT_INT if b.typ]}),
    Api("Int8CheckpointPool.store_from_active", lambda w, **k: w.t1.store_from_active(**k),
        dict(side=lambda w: w.st, active_ids=lambda w: w.st_ids[:1], ckpt_slots=lambda w: w.t1_ids[1:2]),
        {"side": OBJ + [D("kv_side", lambda w: w.kv)], "active_ids": IDS_TYPE + ST_IDS[:1] + ST_IDS[2:],
         "ckpt_slots": IDS_TYPE + T1_IDS}),
    Api("Int8CheckpointPool.load_to_active", lambda w, **k: w.t1.load_to_active(**k),
        dict(ckpt_slots=lambda w: w.t1_ids[:1], side=lambda w: w.st, active_ids=lambda w: w.st_ids[1:2]),
        {"side": OBJ + [D("kv_side", lambda w: w.kv)], "active_ids": IDS_TYPE + ST_IDS,
         "ckpt_slots": IDS_TYPE + T1_IDS[:1] + T1_IDS[2:]}),
    # ------------------------------------------------------------------------- T2
    Api("HostMirror", lambda w, **k: HostMirror(**k),
        dict(regions=[RegionSpec("a", 64, 2)], pin="auto", chunk_bytes=1 << 20, budget_bytes=None,
             check_memory=True),
        {"regions": [*OBJ, T("empty", []), T("one_spec", RegionSpec("a", 64, 2)), T("ints", [3]),
                     V("same_names", [RegionSpec("a", 64, 2), RegionSpec("a", 64, 2)]),
                     V("huge", [RegionSpec("a", 64, 2 ** 50)])],
         "pin": CHOICE + [V("register_without_cuda", "register")], "chunk_bytes": POS_INT + [V("small", 8)],
         "budget_bytes": OPT_SECONDS + [V("too_small", 64), V("inf", INF)], "check_memory": BOOL},
        {"regions": ("num_slots",), "budget_bytes": ("num_slots",)}),
    Api("HostMirror.region", lambda w, name: w.mirror.region(name), dict(name="state"),
        {"name": STR + [V("bogus", "x")]}),
    Api("HostMirror.estimate_bytes", lambda w, regions: HostMirror.estimate_bytes(regions),
        dict(regions=[RegionSpec("a", 64, 2)]), {"regions": [T("none", None), T("int", 3), T("ints", [3])]}),
    Api("HostRegion.alloc", lambda w, n: w.hs.alloc(n), dict(n=1), {"n": COUNT}),
    Api("HostRegion.free", lambda w, ids: w.hs.free(ids), dict(ids=lambda w: w.hs_dst),
        {"ids": IDS_TYPE + HS_IDS}),
    Api("HostRegion.slot", lambda w, i: w.hs.slot(i), dict(i=1), {"i": INDEX + [V("past", 7)]}),
    Api("HostRegion.flip_bit", lambda w, **k: w.hk.flip_bit(**k), dict(slot=1, byte=0, bit=0),
        {"slot": INDEX + [V("past", 9)], "byte": INDEX + [D("past", lambda w: w.hk.slot_bytes)],
         "bit": INDEX + [V("past", 8)]}),
    # ------------------------------------------------------------------------- transfers
    Api("TransferEngine", lambda w, **k: TransferEngine(**k),
        dict(device="cpu", max_inflight_bytes=1 << 20, method=None, staging_bytes=1 << 16, backend="torch",
             room_timeout_s=1.0, stream_priority=0),
        {"device": DEVICE, "max_inflight_bytes": POS_INT, "staging_bytes": POS_INT,
         "method": [T("str", "copy"), V("bogus", {"d2h": "bogus"}), V("direction", {"x": "copy"}),
                    V("int", {"d2h": 3})],
         "backend": CHOICE, "room_timeout_s": POS_SECONDS,
         "stream_priority": NOT_INT + [V("positive", 1), V("very_negative", -100)]}),
    Api("TransferEngine.demote", lambda w, **k: w.engine.demote(**k),
        dict(rows_view=lambda w: w.t1.envelopes, rows=lambda w: w.t1_ids[1:2], region=lambda w: w.hs,
             host_slots=lambda w: w.hs_dst, kind="demote", busy=(), block=True),
        {"rows_view": TENSOR + [D("float_view", lambda w: w.t1.envelopes.float()),
                                D("wrong_width", lambda w: w.kv.rows_bytes()), D("flat", lambda w: w.t1.raw),
                                D("meta", lambda w: torch.empty(w.t1.envelopes.shape, dtype=torch.uint8,
                                                                device="meta"))],
         "rows": IDS_TYPE + RANGE_IDS, "region": OBJ + [D("other_region", lambda w: w.hk)],
         "host_slots": IDS_TYPE + HS_IDS, "kind": STR, "block": BOOL,
         "busy": [T("int", 3), T("ints", [3]), T("none_pair", [(None, [1])])]},
        {"region": ("rows_view",)}),
    Api("TransferEngine.load", lambda w, **k: w.engine.load(**k),
        dict(region=lambda w: w.hk, host_slots=lambda w: w.hk_valid, rows_view=lambda w: w.kv.rows_bytes(),
             rows=[5], kind="load",
             layer_ranges=None, busy=(), after=None, block=True),
        {"rows_view": TENSOR + [D("wrong_width", lambda w: w.t1.envelopes)],
         "rows": IDS_TYPE + RANGE_IDS, "region": OBJ,
         "host_slots": IDS_TYPE + HK_IDS + [D("not_valid", lambda w: w.hk_dst)], "kind": STR, "block": BOOL,
         "layer_ranges": [T("int", 3), T("flat", [0, 16]), V("past_end", [(0, 10 ** 6)]), V("negative", [(-4, 8)]),
                          T("float", [(0.0, 16)]), V("unaligned", [(2, 16)])],
         "after": [T("int", 3), T("str", "x")], "busy": [T("int", 3)]}),
    Api("TransferEngine.wait", lambda w, **k: w.engine.wait(**k), dict(ticket=lambda w: w.ticket, timeout=1.0),
        {"ticket": OBJ, "timeout": OPT_SECONDS}),
    Api("TransferEngine.wait_all", lambda w, timeout: w.engine.wait_all(timeout), dict(timeout=1.0),
        {"timeout": OPT_SECONDS}),
    # ------------------------------------------------------------------------- moves
    Api("moves.demote_states", lambda w, **k: moves.demote_states(**k),
        dict(engine=lambda w: w.engine, t1=lambda w: w.t1, t1_slots=lambda w: w.t1_ids[1:2], region=lambda w: w.hs,
             host_slots=lambda w: w.hs_dst),
        {"engine": OBJ, "t1": OBJ, "region": OBJ, "t1_slots": IDS_TYPE + T1_IDS[:1] + T1_IDS[2:],
         "host_slots": IDS_TYPE + HS_IDS}),
    Api("moves.promote_states", lambda w, **k: moves.promote_states(**k),
        dict(engine=lambda w: w.engine, region=lambda w: w.hs, host_slots=lambda w: w.hs_valid, t1=lambda w: w.t1,
             t1_slots=lambda w: w.t1_ids[1:2]),
        {"engine": OBJ, "t1": OBJ, "region": OBJ, "t1_slots": IDS_TYPE + T1_IDS,
         "host_slots": IDS_TYPE + HS_IDS[:1] + HS_IDS[2:] + [D("not_valid", lambda w: w.hs_dst)]}),
    Api("moves.restore_states", lambda w, **k: moves.restore_states(**k),
        dict(engine=lambda w: w.engine, region=lambda w: w.hs, host_slots=lambda w: w.hs_valid, t1=lambda w: w.t1,
             scratch_slots=lambda w: w.t1_ids[1:2], side=lambda w: w.st, active_ids=lambda w: w.st_ids[1:2]),
        {"engine": OBJ, "region": OBJ, "t1": OBJ, "side": OBJ + [D("kv_side", lambda w: w.kv)],
         "scratch_slots": IDS_TYPE + T1_IDS, "active_ids": IDS_TYPE + ST_IDS[:1] + ST_IDS[2:],
         "host_slots": IDS_TYPE + [D("not_valid", lambda w: w.hs_dst)]}),
    Api("moves.demote_kv", lambda w, **k: moves.demote_kv(**k),
        dict(engine=lambda w: w.engine, side=lambda w: w.kv, token_ids=lambda w: w.kv_ids[2:4],
             region=lambda w: w.hk, host_slots=lambda w: w.hk_dst),
        {"engine": OBJ, "region": OBJ, "side": OBJ + [D("state_side", lambda w: w.st)],
         "token_ids": IDS_TYPE + kv_state(2)[:1] + kv_state(2)[2:], "host_slots": IDS_TYPE + HK_IDS}),
    Api("moves.load_kv", lambda w, **k: moves.load_kv(**k),
        dict(engine=lambda w: w.engine, region=lambda w: w.hk, host_slots=lambda w: w.hk_valid,
             side=lambda w: w.kv, token_ids=lambda w: w.kv_ids[2:4], layerwise=True),
        {"engine": OBJ, "region": OBJ, "side": OBJ + [D("state_side", lambda w: w.st)], "layerwise": BOOL,
         "token_ids": IDS_TYPE + kv_state(2), "host_slots": IDS_TYPE + [D("not_valid", lambda w: w.hk_dst)]}),
    Api("moves.kv_layer_ranges", lambda w, side: moves.kv_layer_ranges(side), dict(side=lambda w: w.kv),
        {"side": OBJ + [D("state_side", lambda w: w.st)]}),
]

# ----------------------------------------------------------------------------- radix (T0 + T1 + T2 tree)
def _cache(w, **k):
    from tests.support.radix_util import make_cache

    base = make_cache()
    args = dict(pool=base.pool, ckpt_pool=base.ckpt)
    args.update(k)
    return HiMambaRadixCache(**args)


def _match(w, **k):
    return w.cache.match_prefix(MatchPrefixParams(**k))


def _insert(w, **k):
    return w.cache.insert(InsertParams(**k))


def _req(w, **k):
    return w.cache.cache_finished_req(CacheReq(**k))


P = ("params",)
APIS += [
    Api("HiMambaRadixCache", _cache, dict(kv_side="full", state_side="mamba", checkpoint_unit=None, validate=True),
        {"pool": OBJ, "ckpt_pool": OBJ, "kv_side": STR + [V("bogus", "x")], "state_side": STR + [V("bogus", "x")],
         "checkpoint_unit": [b for b in NOT_INT if b.label != "none"] + [V("zero", 0), V("negative", -1)],
         "policy": [T("str", "lru"), T("int", 3)],
         "host": [T("str", "x"), T("int", 3)], "transfer": [T("str", "x"), T("int", 3)],
         "host_config": [T("str", "x"), T("int", 3)], "storage": [T("str", "x"), T("int", 3)],
         "validate": BOOL}),
    Api("HiMambaRadixCache.match_prefix", _match, dict(key=[1, 2, 3], cow_mamba=False, req=None),
        {"key": TOKENS + [D("radix_key_floats", lambda w: RadixKey([1.5]), typ=True),
                          D("radix_key_salt", lambda w: RadixKey([1, 2], 3), typ=True),
                          D("radix_key_str", lambda w: RadixKey("12"), typ=True)],
         "cow_mamba": BOOL}, {"key": P + ("token_ids", "extra_key"), "cow_mamba": P}),
    Api("HiMambaRadixCache.match_prefix(params)", lambda w, params: w.cache.match_prefix(params), dict(params=None),
        {"params": [T("none", None), T("list", [1, 2]), T("str", "12"), T("dict", {"key": [1]})]}, control=False),
    Api("HiMambaRadixCache.insert", _insert,
        dict(key=[7, 8], value=lambda w: w.ins_kv, mamba_value=lambda w: w.ins_state, prev_prefix_len=0,
             chunked=False, priority=0),
        {"key": TOKENS + [V("short", [7])], "value": [T("list", [1, 2]), T("float_tensor", torch.tensor([1.0, 2.0])),
                                                       V("short", torch.tensor([1])),
                                                       D("freed", lambda w: w.freed_kv),
                                                       D("sink", lambda w: torch.tensor([0, 0]))],
         "mamba_value": [T("float_tensor", torch.tensor([1.5])), T("str", "1"), D("sink", lambda w: torch.tensor([0])),
                         D("freed", lambda w: w.freed_state), D("huge", lambda w: torch.tensor([2 ** 40]))],
         "prev_prefix_len": NONNEG_INT + [V("past_key", 3)], "chunked": BOOL, "priority": [T("str", "1"),
                                                                                          T("none", None)]},
        {k: P for k in ("key", "value", "mamba_value", "prev_prefix_len", "chunked", "priority")}),
    Api("HiMambaRadixCache.evict", lambda w, **k: w.cache.evict(EvictParams(**k)),
        dict(num_tokens=0, mamba_num=0, host_num_tokens=0, host_mamba_num=0, swa_num_tokens=0),
        {k: NONNEG_INT for k in ("num_tokens", "mamba_num", "host_num_tokens", "host_mamba_num", "swa_num_tokens")},
        {k: P for k in ("num_tokens", "mamba_num", "host_num_tokens", "host_mamba_num", "swa_num_tokens")}),
    Api("HiMambaRadixCache.evict(params)", lambda w, params: w.cache.evict(params), dict(params=None),
        {"params": [T("none", None), T("int", 3), T("dict", {"num_tokens": 1})]}, control=False),
    Api("HiMambaRadixCache.inc_lock_ref", lambda w, node: w.cache.inc_lock_ref(node), dict(node=None),
        {"node": OBJ + [D("foreign", lambda w: w.foreign_node)]}, control=False),
    Api("HiMambaRadixCache.dec_lock_ref", lambda w, node: w.cache.dec_lock_ref(node), dict(node=None),
        {"node": OBJ + [D("foreign", lambda w: w.foreign_node), D("unlocked", lambda w: w.node)]}, control=False),
    Api("HiMambaRadixCache.init_load_back", lambda w, **k: w.cache.init_load_back(InitLoadBackParams(**k)),
        dict(best_match_node=lambda w: w.node, host_hit_length=0, mem_quota=None, req=None),
        {"best_match_node": OBJ + [D("foreign", lambda w: w.foreign_node)], "host_hit_length": NONNEG_INT,
         "mem_quota": [b for b in NONNEG_INT if b.label != "none"]},
        {k: P for k in ("best_match_node", "host_hit_length", "mem_quota")}),
    Api("HiMambaRadixCache.cache_finished_req", _req,
        dict(token_ids=[9, 10], kv_indices=lambda w: w.req_kv, mamba_pool_idx=None, last_node=lambda w: w.cache.root,
             cache_protected_len=0),
        {"token_ids": TOKENS, "kv_indices": [T("list", [1, 2]), T("float_tensor", torch.tensor([1.0, 2.0])),
                                             T("none", None), D("freed", lambda w: w.freed_kv)],
         "mamba_pool_idx": [T("float_tensor", torch.tensor([1.5])), T("str", "1"),
                            D("freed", lambda w: w.freed_state)],
         "last_node": [T("str", "x"), T("int", 3), D("foreign", lambda w: w.foreign_node)],
         "cache_protected_len": NONNEG_INT + [V("past_tokens", 5)]},
        {k: ("req", "params") for k in ("token_ids", "kv_indices", "mamba_pool_idx", "last_node",
                                        "cache_protected_len")}),
    Api("HiMambaRadixCache.cache_finished_req(req)", lambda w, req: w.cache.cache_finished_req(req), dict(req=None),
        {"req": [T("none", None), T("int", 3), T("str", "x")]}, control=False),
    Api("HiMambaRadixCache.checkpoint_positions", lambda w, **k: w.cache.checkpoint_positions(**k),
        dict(start=0, end=4), {"start": NONNEG_INT, "end": NONNEG_INT + [V("before_start", -5)]}),
    Api("prefill_checkpoint_positions", lambda w, **k: prefill_checkpoint_positions(**k),
        dict(start=0, end=8, unit=2, hash_block_size=2, block_size=2, alignment=None),
        {"start": NONNEG_INT, "end": NONNEG_INT, "unit": POS_INT, "hash_block_size": POS_INT,
         "block_size": POS_INT, "alignment": [b for b in POS_INT if b.label != "none"]}),
]

# ----------------------------------------------------------------------------------------- storage (T3)
KEYS = [T("str", "k"), T("none", None), T("str_list", ["k"]), T("int_list", [3]), V("short_key", [b"x"]),
        T("object", object())]
SKEYS = [T("none", None), T("str", "abc"), T("int_list", [3]), V("bad_chars", ["../x"]), V("empty_key", [""]),
         T("bytes_key", [b"k"])]
KIND = [V("bogus_int", 99), T("str", "kv"), T("none", None), T("float", 1.5)]
APIS += [
    Api("FileStore", lambda w, **k: FileStore(**k), dict(root=lambda w: w.root + "-other", fsync=False,
                                                        max_value_bytes=1 << 20),
        {"root": [T("none", None), T("int", 3), V("empty", ""), T("bytes_list", [b"x"])], "fsync": BOOL,
         "max_value_bytes": POS_INT}),
    Api("FileStore.get_many", lambda w, keys: w.store.get_many(keys), dict(keys=["kv-x"]), {"keys": SKEYS}),
    Api("FileStore.exists_many", lambda w, keys: w.store.exists_many(keys), dict(keys=["kv-x"]), {"keys": SKEYS}),
    Api("FileStore.delete_many", lambda w, keys: w.store.delete_many(keys), dict(keys=["kv-x"]), {"keys": SKEYS}),
    Api("FileStore.put_many", lambda w, items: w.store.put_many(items), dict(items=[("kv-x", [b"ab"])]),
        {"items": [T("none", None), T("str", "x"), V("bad_key", [("../x", [b"ab"])]), T("int_payload", [("k", [3])]),
                   T("flat", [("k", b"ab", 1)]), T("str_payload", [("k", ["ab"])])]},
        {"items": ("key",)}),  # a bad key inside the items is named as the key it is
    Api("StorageFingerprint", lambda w, **k: StorageFingerprint(**k),
        dict(model_id="m", layer_range=(0, 2), dtypes=("kv=float16",), codec="int8", page_size=2),
        {"model_id": NAME, "layer_range": [T("list", [0, 2]), V("empty", (2, 2)), T("floats", (0.0, 2.0)),
                                           T("none", None), V("negative", (-1, 2))],
         "dtypes": [T("str", "kv=float16"), T("ints", (3,)), T("none", None)], "codec": NAME,
         "page_size": POS_INT}),
    Api("StorageFingerprint.from_specs", lambda w, **k: StorageFingerprint.from_specs(**k),
        dict(model_id="m", kv_spec=KV, codec="int8", page_size=2),
        {"model_id": NAME, "kv_spec": [T("str", "x"), T("int", 3)], "page_size": POS_INT, "codec": NAME}),
    Api("page_keys", lambda w, **k: page_keys(**k), dict(tokens=[1, 2, 3, 4], fingerprint=FP, salt=None, parent=None),
        {"tokens": TOKENS, "fingerprint": OBJ, "salt": [T("int", 3), T("list", ["a"]), T("float", 1.5)],
         "parent": [T("str", "p"), V("short", b"p"), T("int", 3)]}),
    Api("open_backend", lambda w, url: open_backend(url), dict(url="file:///tmp/x"),
        {"url": [T("none", None), T("int", 3), V("empty", ""), V("scheme", "ftp://x"), V("no_port", "redis://h"),
                 V("two_nodes", "redis://h:1,h:2")]}),
    Api("StorageTier", lambda w, **k: StorageTier(**k),
        dict(backend=lambda w: w.store, fingerprint=FP, salt=None, workers=1, batch_bytes=1 << 20, retry_after_s=1.0,
             skip_existing=True),
        {"backend": OBJ, "fingerprint": OBJ, "salt": [T("int", 3), T("float", 1.5)], "workers": POS_INT + HUGE,
         "batch_bytes": POS_INT, "retry_after_s": SECONDS, "skip_existing": BOOL}),
    Api("StorageTier.keys", lambda w, **k: w.tier.keys(**k), dict(tokens=[1, 2], parent=None),
        {"tokens": TOKENS, "parent": [T("str", "p"), V("short", b"p"), T("int", 3)]}),
    Api("StorageTier.storage_key", lambda w, **k: w.tier.storage_key(**k), dict(kind=Kind.KV, key=lambda w: w.keys[0]),
        {"kind": KIND, "key": [T("str", "k"), T("none", None), V("short", b"k")]}),
    Api("StorageTier.prefetch", lambda w, **k: w.tier.prefetch(**k),
        dict(keys=lambda w: list(w.keys), kind=Kind.KV, region=lambda w: w.sregion, slots=lambda w: w.s_slots,
             timeout_s=None),
        {"keys": KEYS, "kind": KIND, "region": OBJ, "slots": IDS_TYPE + [D("freed", lambda w: [3, 4]),
                                                                            D("one_short", lambda w: w.s_slots[:1])],
         "timeout_s": OPT_POS_SECONDS}),
    Api("StorageTier.write", lambda w, **k: w.tier.write(**k),
        dict(keys=lambda w: list(w.keys), kind=Kind.KV, region=lambda w: w.sregion, slots=lambda w: w.s_slots,
             timeout_s=None),
        {"keys": KEYS, "kind": KIND, "region": OBJ, "slots": IDS_TYPE + [D("freed", lambda w: [3, 4])],
         "timeout_s": OPT_POS_SECONDS}),
    Api("StorageTier.lookup", lambda w, **k: w.tier.lookup(**k), dict(keys=lambda w: list(w.keys), kind=Kind.KV,
                                                                     timeout_s=None),
        {"keys": KEYS, "kind": KIND, "timeout_s": OPT_POS_SECONDS}),
    Api("StorageTier.get", lambda w, **k: w.tier.get(**k), dict(keys=lambda w: list(w.keys), kind=Kind.KV,
                                                               timeout_s=None),
        {"keys": KEYS, "kind": KIND, "timeout_s": OPT_POS_SECONDS}),
    Api("StorageTier.put", lambda w, **k: w.tier.put(**k),
        dict(keys=lambda w: list(w.keys[:1]), kind=Kind.KV, payloads=[bytes(64)], timeout_s=None, t2_checksums=None),
        {"keys": KEYS, "kind": KIND, "payloads": [T("none", None), T("ints", [3]), V("two", [b"a", b"b"])],
         "timeout_s": OPT_POS_SECONDS, "t2_checksums": [T("floats", [1.5]), V("two", [1, 2]), T("str", "1")]}),
    Api("StorageTier.wait", lambda w, **k: w.tier.wait(**k), dict(op=lambda w: w.op, timeout_s=1.0),
        {"op": OBJ, "timeout_s": SECONDS}),
    Api("StorageTier.cancel", lambda w, op: w.tier.cancel(op), dict(op=lambda w: w.op), {"op": OBJ}),
    Api("StorageTier.close", lambda w, timeout_s: w.tier.close(timeout_s), dict(timeout_s=1.0),
        {"timeout_s": SECONDS}),
]

CASES = [c for api in APIS for c in api.cases()]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("bad-inputs"))
    c = w.cache
    w.ins_kv = c.kv.alloc(2)
    w.ins_state = c.states.alloc(1)
    w.req_kv = c.kv.alloc(2)
    w.freed_kv = c.kv.alloc(2)
    c.kv.free(w.freed_kv)
    w.freed_state = c.states.alloc(1)
    c.states.free(w.freed_state)
    w.foreign_node = _cache(w).root  # a node of another tree
    yield w
    w.close()


def test_table_is_large():
    """The acceptance bar: at least 1,000 generated cases over every API listed."""
    assert len(CASES) >= 1000, len(CASES)
    assert len({c.id for c in CASES}) == len(CASES), "two cases share an id"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(world, case):
    """Issue 17, items 6-8: a bad value is a typed error naming its argument, and changes nothing."""
    before = world.snapshot()
    with pytest.raises(Exception) as info:
        case.call(world)
    err = info.value
    assert isinstance(err, TieredCacheError), f"{type(err).__name__} is not a TieredCacheError: {err}"
    if case.bad.typ and not isinstance(err, MemoryBudgetError):
        assert isinstance(err, TypeError), f"a wrong type should raise a TypeError too: {type(err).__name__}: {err}"
    named = getattr(err, "arg", None)
    if named is not None:
        # a per-item name counts (``key`` of ``keys``), as does a qualified one (``params.key``)
        assert any(n in named or named in n for n in case.names), f"names {named!r}, not {case.arg!r}"
    else:
        assert any(n in str(err) for n in case.names), f"message does not name {case.arg!r}: {err}"
    assert world.snapshot() == before, "state changed"


@pytest.mark.parametrize("api", [a for a in APIS if a.control], ids=[a.name for a in APIS if a.control])
def test_good_call_is_accepted(tmp_path, api):
    """The control of every row: with all arguments good the call succeeds, so a case's error comes from
    its one bad argument (on a world of its own, since good calls change state)."""
    w = World(tmp_path)
    w.ins_kv, w.ins_state = w.cache.kv.alloc(2), w.cache.states.alloc(1)
    w.req_kv = w.cache.kv.alloc(2)
    try:
        api.good_call(w)
    finally:
        w.close()
