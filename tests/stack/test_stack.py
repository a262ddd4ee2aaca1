"""``TieredCache``: each kind of stack builds and works through its tree, allocation evicts just enough and
says "no room" as ``None``, every bad ``CacheConfig`` field and build argument is a typed error naming
it, and ``close`` is idempotent."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.radix_util import KV_SPEC, STATE_SPEC, SWA_SPEC, check_kv, insert_fresh, insert_swa, node_at
from tests.support.storage_util import settle
from tiered_cache import CacheConfig, TieredCache
from tiered_cache.config import (
    BACKENDS,
    CODECS,
    EVICTION_POLICIES,
    PREFETCH_POLICIES,
    STATE_ADMISSIONS,
    WRITE_POLICIES,
)
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, MemoryBudgetError
from tiered_cache.radix import (
    CacheReq,
    EvictParams,
    HiMambaRadixCache,
    HiSWARadixCache,
    InitLoadBackParams,
    MatchPrefixParams,
    RadixKey,
)

BASE = dict(page_size=2, kv_pages=16, t0_states=4, t1_states=8, codec="lossless", check_memory=False, backend="torch")
HOST = dict(host_kv_pages=16, host_states=8)


def build(state=STATE_SPEC, swa=None, device="cpu", **kw) -> TieredCache:
    cfg = CacheConfig(**{**BASE, "backend": "torch" if device == "cpu" else "auto", **kw})
    return TieredCache.build(cfg, kv=KV_SPEC, state=state, swa=swa, device=device, model_id="test-model")


def match(stack: TieredCache, toks, **kw):
    return stack.tree.match_prefix(MatchPrefixParams(key=RadixKey(toks), **kw))


# ------------------------------------------------------------------------------- each kind
def test_state_model_t0_t1():
    with build() as c:
        assert isinstance(c.tree, HiMambaRadixCache) and not isinstance(c.tree, HiSWARadixCache)
        assert c.host is None and c.transfer is None and c.storage is None and c.swa is None
        assert c.t1.num_slots == 8 and c.t1.codec == "lossless" and c.checkpoint_unit == 2 and c.page_size == 2
        free0 = c.free_sizes()
        assert free0 == {"t0_kv": c.kv.available_size(), "t0_states": c.states.available_size(), "t1": 8}
        insert_fresh(c.tree, [1, 2, 3, 4])
        m = match(c, [1, 2, 3, 4, 5])
        assert m.device_indices.numel() == 4 and m.kv_hit_length == 4
        c.check_invariants()
        s = c.stats()
        assert set(s) == {"tree", "evictions", "t1"}
        assert s["t1"]["stores"] == 1 and s["t1"]["store_bytes"] == c.t1.slot_bytes
        assert c.free_sizes()["t1"] == 7 and c.free_sizes()["t0_kv"] == free0["t0_kv"] - 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_state_model_with_host_tier_round_trip(device):
    with build(device=device, **HOST) as c:
        assert c.host is not None and c.transfer is not None and c.storage is None
        assert c.tree.host is c.host and c.tree.engine is c.transfer
        assert {k for k in c.free_sizes() if k.startswith("t2_")} == {"t2_full", "t2_state"}
        assert c.host.region("state").slot_bytes == c.t1.slot_bytes
        assert c.host.region("full").slot_bytes == c.kv.entry_bytes
        insert_fresh(c.tree, [1, 2, 3, 4])
        while c.tree.host_tier.busy:  # the write-through backup lands
            c.tree.check_hicache_events()
        assert c.stats()["transfer"]["d2h_bytes"] == 2 * c.kv.entry_bytes
        assert c.tree.evict(EvictParams(num_tokens=4)).num_tokens_evicted == 4  # device KV dropped, T2 keeps it
        m = match(c, [1, 2, 3, 4, 5])
        assert m.device_indices.numel() == 0 and m.host_hit_length == 4
        req = CacheReq(token_ids=[], kv_indices=torch.empty(0, dtype=torch.int64, device=c.kv.device))
        ids, _ = c.tree.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
        while not req.load_back.done:
            c.tree.check_hicache_events()
        assert req.load_back.ok and c.stats()["transfer"]["h2d_bytes"] == 2 * c.kv.entry_bytes
        check_kv(c.tree, ids, [1, 2, 3, 4])  # the KV came back from T2 byte for byte
        c.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=req.mamba_pool_idx)


def test_state_model_with_file_store_shares_prefixes_across_stacks(tmp_path):
    url = f"file://{tmp_path}"
    c = build(**HOST, storage_url=url, prefetch_policy="wait_complete")
    assert c.storage is not None and c.tree.t3 is not None
    insert_fresh(c.tree, [1, 2, 3, 4])
    settle(c.tree)
    assert c.stats()["storage"]["written"] >= 1
    c.close()
    c.close()  # idempotent
    assert c.storage is None
    with build(**HOST, storage_url=url, prefetch_policy="wait_complete") as d:  # a restart finds it in T3
        m = match(d, [1, 2, 3, 4])
        assert m.host_hit_length == 4 and d.stats()["tree"]["t3_hits"] == 1
    # another model's stack shares nothing
    cfg = CacheConfig(**{**BASE, **HOST}, storage_url=url, prefetch_policy="wait_complete")
    with TieredCache.build(cfg, kv=KV_SPEC, state=STATE_SPEC, device="cpu", model_id="other") as e:
        assert match(e, [1, 2, 3, 4]).host_hit_length == 0


@pytest.mark.parametrize("host", [False, True])
def test_swa_model(host):
    kw = dict(host_kv_pages=16, host_swa_pages=12) if host else {}
    with build(state=None, swa=SWA_SPEC, swa_pages=8, **kw) as c:
        assert isinstance(c.tree, HiSWARadixCache) and c.tree.window == SWA_SPEC.window
        assert c.t1 is None and c.states is None and c.swa is not None
        assert (c.host is not None) == host and c.checkpoint_unit == 2
        keys = {"t0_kv", "t0_swa"} | ({"t2_full", "t2_swa"} if host else set())
        assert set(c.free_sizes()) == keys
        if host:
            assert c.host.region("swa").available_size() == 12 and c.host.region("full").available_size() == 16
        insert_swa(c.tree, [1, 2, 3, 4, 5, 6])
        assert match(c, [1, 2, 3, 4, 5, 6]).device_indices.numel() == 6
        c.check_invariants()
        assert "t1" not in c.stats()
        with pytest.raises(InvalidArgumentError) as ei:
            c.alloc_states(1)
        assert ei.value.arg == "alloc_states"


# ------------------------------------------------------------------------------- allocation with eviction
def test_alloc_kv_evicts_just_enough_then_none_when_locked():
    c = build(kv_pages=6, t0_states=1)
    for start in (10, 20, 30):  # three cached leaves of 2 pages each, LRU order 10, 20, 30
        insert_fresh(c.tree, [start + i for i in range(4)])
    free = c.kv.available_size()
    ids = c.alloc_kv(free + 4)  # 2 pages short: the least recent leaf goes, no more
    assert ids is not None and ids.numel() == free + 4
    assert match(c, [10, 11, 12, 13]).device_indices.numel() == 0
    assert match(c, [20, 21, 22, 23]).device_indices.numel() == 4
    assert c.stats()["evictions"]["kv"] == 1
    c.kv.free(ids)
    m = match(c, [20, 21, 22, 23])
    c.tree.inc_lock_ref(m.last_device_node)
    m30 = match(c, [30, 31, 32, 33])
    c.tree.inc_lock_ref(m30.last_device_node)
    before = c.free_sizes()
    assert c.alloc_kv(c.kv.available_size() + 2) is None  # everything cached is locked: no room, a value
    assert c.free_sizes() == before
    assert c.alloc_kv(0).numel() == 0
    c.check_invariants()


def test_alloc_states_evicts_kv_for_the_bytes_then_none_when_locked():
    c = build(kv_pages=16, t0_states=1)
    insert_fresh(c.tree, list(range(1, 9)))
    insert_fresh(c.tree, list(range(1, 17)))  # a parent of 4 pages and a leaf of 4 pages
    rest = c.kv.alloc(c.kv.available_size())  # a request holds the rest of the buffer
    held = []
    while (s := c.states.alloc(1)) is not None:
        held.append(s)
    assert c.tree.full_evictable_size() == 16
    slot = c.alloc_states(1)  # the sides share the bytes: the leaf's pages go, the parent stays
    assert slot is not None and c.tree.full_evictable_size() == 8 and c.stats()["evictions"] == {"kv": 1}
    held.append(slot)
    m = match(c, list(range(1, 9)))
    c.tree.inc_lock_ref(m.last_device_node)
    while (s := c.states.alloc(1)) is not None:
        held.append(s)
    before = c.free_sizes()
    assert c.alloc_states(1) is None and c.free_sizes() == before  # all cached KV locked: no room
    c.check_invariants(request_kv=rest, request_states=torch.cat(held))


def test_alloc_swa_evicts_swa_first():
    c = build(state=None, swa=SWA_SPEC, kv_pages=16, swa_pages=6)
    insert_swa(c.tree, [1, 2, 3, 4, 5, 6, 7, 8])  # 4 SWA pages cached
    ids = c.alloc_swa(c.swa.available_size() + 4)
    assert ids is not None and c.stats()["evictions"]["swa"] >= 1
    assert c.stats()["evictions"].get("kv", 0) == 0  # the full KV stayed: internal nodes became tombstones
    c.swa.free(ids)
    with pytest.raises(InvalidArgumentError):
        build().alloc_swa(2)
    c.check_invariants()


@pytest.mark.parametrize("call", ["alloc_kv", "alloc_states"])
@pytest.mark.parametrize("bad, err", [(-2, InvalidArgumentError), (2.0, InvalidTypeError), ("2", InvalidTypeError),
                                      (True, InvalidTypeError)])
def test_alloc_bad_counts(call, bad, err):
    c = build()
    before = c.free_sizes()
    with pytest.raises(err) as ei:
        getattr(c, call)(bad)
    assert ei.value.arg == "n" and c.free_sizes() == before


# ------------------------------------------------------------------------------- bad configs
T, V = InvalidTypeError, InvalidArgumentError  # a wrong type; a wrong value of the right type
BAD_FIELDS = [
    ("page_size", 0, V), ("page_size", 2.0, T), ("kv_pages", 0, V), ("kv_pages", "8", T), ("t0_states", 0, V),
    ("t0_states", True, T), ("swa_pages", 0, V), ("swa_pages", 1.5, T), ("lazy_compaction", 1, T),
    ("t1_states", 0, V), ("t1_states", None, T),
    ("codec", "fp8", V), ("codec", None, T), ("checkpoint_unit", 3, V), ("checkpoint_unit", 0, V),
    ("checkpoint_unit", 4.0, T), ("host_kv_pages", -1, V), ("host_kv_pages", 1.0, T), ("host_states", -1, V),
    ("host_swa_pages", 0, V), ("host_swa_pages", "1", T), ("write_policy", "lazy", V), ("write_policy", 1, T),
    ("write_through_threshold", -1, V), ("load_back_threshold", -1, V), ("load_back_threshold", 0.5, T),
    ("storage_url", 7, T), ("storage_url", "", V), ("storage_url", "file:///tmp/x", V),  # the last: without T2
    ("storage_write_through", 1, T), ("prefetch_policy", "eager", V), ("prefetch_timeout_s", 0.0, V),
    ("prefetch_timeout_s", float("nan"), V), ("prefetch_timeout_s", "1", T), ("eviction_policy", "lfu", V),
    ("eviction_policy", None, T), ("backend", "cuda", V), ("check_memory", "yes", T), ("validate", 0, T),
    ("cost_model", "gpt-4", V), ("cost_model", None, T), ("state_admission", "every", V), ("state_admission", 1, T),
    ("admission_block", 0, V), ("admission_block", 512.0, T),
]


@pytest.mark.parametrize("field, bad, err", BAD_FIELDS)
def test_bad_config_field_is_a_typed_error_naming_it(field, bad, err):
    with pytest.raises(err) as ei:
        CacheConfig(**{field: bad})
    assert ei.value.arg == field
    if err is V:
        assert not isinstance(ei.value, T)


def test_every_field_has_a_bad_case():
    assert {f.name for f in dataclasses.fields(CacheConfig)} == {f for f, _, _ in BAD_FIELDS}


def test_option_names_live_in_config():
    from tiered_cache.radix.params import HostTierConfig
    from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool  # noqa: F401 (reads CODECS from config)

    assert CODECS == ("int8", "lossless") and BACKENDS == ("auto", "triton", "torch")
    assert EVICTION_POLICIES == ("lru", "marconi", "seglen", "tiered")
    for p in EVICTION_POLICIES:
        assert CacheConfig(eviction_policy=p).eviction_policy == p
    for a in STATE_ADMISSIONS:
        assert CacheConfig(state_admission=a).state_admission == a
    for p in WRITE_POLICIES:
        assert HostTierConfig(write_policy=p).write_policy == p
    for p in PREFETCH_POLICIES:
        assert CacheConfig(prefetch_policy=p).prefetch_policy == p


@pytest.mark.parametrize("kw, arg", [
    (dict(cfg=None), "cfg"), (dict(kv=STATE_SPEC), "kv"), (dict(kv=SWA_SPEC), "kv"), (dict(state=KV_SPEC), "state"),
    (dict(swa=STATE_SPEC), "swa"), (dict(swa=SWA_SPEC), "state, swa"), (dict(state=None), "state, swa"),
    (dict(state=None, swa=KV_SPEC), "swa.window"), (dict(storage=object()), "storage"),
    (dict(placement=4), "placement"), (dict(model_id=b"m"), "model_id"), (dict(model_id=""), "model_id"),
    (dict(device="tpu"), "device"), (dict(device=3.5), "device"),
    (dict(cfg=CacheConfig(**BASE, host_kv_pages=4)), "host_states"),
    (dict(cfg=CacheConfig(**BASE, host_states=4)), "host_kv_pages"),
    (dict(cfg=CacheConfig(**BASE, **HOST, storage_url="file:///nonexistent/x"), model_id=None), "model_id"),
    (dict(cfg=CacheConfig(**BASE, **HOST, storage_url="file:///nonexistent/x"), model_id=3), "model_id"),
    (dict(cfg=CacheConfig(**BASE, **HOST, storage_url="file:///nonexistent/x"), state=None, swa=SWA_SPEC),
     "storage_url"),
])
def test_bad_build_arguments(kw, arg):
    args = dict(cfg=CacheConfig(**BASE), kv=KV_SPEC, state=STATE_SPEC, device="cpu", model_id="m")
    args.update(kw)
    cfg = args.pop("cfg")
    with pytest.raises(InvalidArgumentError) as ei:
        TieredCache.build(cfg, **args)
    assert ei.value.arg == arg


def test_a_stack_too_big_for_memory_names_what_to_lower():
    with pytest.raises(MemoryBudgetError) as ei:
        build(kv_pages=10**11, check_memory=True)
    assert ei.value.setting


def test_close_without_storage_is_idempotent_and_tree_still_works():
    c = build()
    c.close()
    c.close()
    insert_fresh(c.tree, [1, 2])
    assert match(c, [1, 2]).device_indices.numel() == 2
    c.check_invariants()


def test_check_invariants_sees_request_owned_ids():
    c = build()
    ids = c.alloc_kv(4)
    slot = c.alloc_states(1)
    c.check_invariants(request_kv=ids, request_states=slot)
    none = torch.empty(0, dtype=torch.int64)
    with pytest.raises(AssertionError):
        c.check_invariants(request_kv=none, request_states=none)  # the request's ids: neither free nor cached
    c.kv.free(ids)
    c.states.free(slot)
    c.check_invariants(request_kv=none, request_states=none)


def test_a_prefetch_finding_host_state_slots_full_but_evictable_evicts_one(tmp_path):
    """Issue 19 parity: a T3 prefetch with every T2 state slot taken by an unlocked state evicts the
    LRU one for its state (was: refused, counted t3_no_room, a miss)."""
    url = f"file://{tmp_path}"
    with build(**{**HOST, "host_states": 1}, storage_url=url, prefetch_policy="wait_complete") as c:
        insert_fresh(c.tree, [1, 2, 3, 4])
        settle(c.tree)
    with build(**{**HOST, "host_states": 1}, storage_url=url, prefetch_policy="wait_complete") as d:
        insert_fresh(d.tree, [7, 8])
        settle(d.tree)
        assert d.tree.evict(EvictParams(mamba_num=1)).mamba_num_evicted == 1  # its state: T1 -> T2
        assert d.free_sizes()["t2_state"] == 0  # the one T2 state slot is taken, and evictable
        m = match(d, [1, 2, 3, 4])
        s = d.stats()["tree"]
        assert s.get("t3_hits") == 1 and not s.get("t3_no_room"), sorted(s.items())
        assert m.host_hit_length == 4 and m.mamba_host_hit_length == 1
        with pytest.raises(KeyError):  # [7, 8]'s T2 state made the room: a stateless leaf then, it went
            node_at(d.tree, [7, 8])
        req = CacheReq(token_ids=[], kv_indices=torch.empty(0, dtype=torch.int64))
        ids, _ = d.tree.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
        while not req.load_back.done:
            d.tree.check_hicache_events()
        assert req.load_back.ok
        check_kv(d.tree, ids, [1, 2, 3, 4])  # what T3 held, through T2, byte for byte
        d.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=req.mamba_pool_idx)


def test_a_query_that_diverges_inside_a_cached_node_gets_a_storage_continuation(tmp_path):
    """Issue 19 parity: the walk of [1, 2, 3, 4] stops inside the cached node [1, 2, 7, 8]; T3 holds
    [1, 2, 3, 4] with its state, so the fetch splits the node at 2 and hangs [3, 4] under [1, 2] (was: no
    prefetch, since it started only at node boundaries: a miss)."""
    url = f"file://{tmp_path}"
    with build(**HOST, storage_url=url, prefetch_policy="wait_complete") as c:
        insert_fresh(c.tree, [1, 2, 3, 4])
        settle(c.tree)
    with build(**HOST, storage_url=url, prefetch_policy="wait_complete") as d:
        insert_fresh(d.tree, [1, 2, 7, 8])
        settle(d.tree)
        m = match(d, [1, 2, 3, 4])
        s = d.stats()["tree"]
        assert s.get("t3_hits") == 1 and s.get("t3_split_anchors") == 1, sorted(s.items())
        assert m.host_hit_length == 4 and m.mamba_host_hit_length == 1
        upper = node_at(d.tree, [1, 2])
        assert upper.host_kv is not None and len(upper.children) == 2  # [7, 8] and the fetched [3, 4]
        req = CacheReq(token_ids=[], kv_indices=torch.empty(0, dtype=torch.int64))
        ids, _ = d.tree.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
        while not req.load_back.done:
            d.tree.check_hicache_events()
        assert req.load_back.ok
        check_kv(d.tree, ids, [1, 2, 3, 4])
        check_kv(d.tree, match(d, [1, 2, 7, 8]).device_indices, [1, 2, 7, 8])  # the split node still serves
        d.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=req.mamba_pool_idx)
