"""The backend as SGLang builds it: ``factory`` through SGLang's registry with a real
``TreeCacheBuildContext`` over SGLang's real pools on CPU (``ReqToTokenPool`` with its mamba pool, the
paged token-to-KV allocator and its MHA KV pool), driven with SGLang's ``Req`` in the scheduler's order
(``init_next_round_input`` -> match with copy-on-write, lock, the request's row and slot, a checkpoint
per prefill chunk, ``release_kv_cache``) over a multi-turn workload with T1 (lossless) and no T2.

The "model" writes, for every token, KV that is a function of the prefix up to it, and at every chunk
end a state that is a function of the prefix; so whatever the tree hands back is checked against what
that prefix must hold: the ids SGLang gets hold exactly that KV, the restored slot exactly that state."""

from __future__ import annotations

import json
import types
import zlib
from array import array

import pytest
import torch

B = pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")
registry = pytest.importorskip("sglang.srt.mem_cache.registry")
memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
allocator_mod = pytest.importorskip("sglang.srt.mem_cache.allocator")
cache_init_params = pytest.importorskip("sglang.srt.mem_cache.cache_init_params")
common = pytest.importorskip("sglang.srt.mem_cache.common")
mamba_utils = pytest.importorskip("sglang.srt.configs.mamba_utils")
schedule_batch = pytest.importorskip("sglang.srt.managers.schedule_batch")
sgl_radix = pytest.importorskip("sglang.srt.mem_cache.radix_cache")
sampling_params = pytest.importorskip("sglang.srt.sampling.sampling_params")

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError  # noqa: E402
from tiered_cache.integrations import sglang as backend_pkg  # noqa: E402
from tiered_cache.integrations.sglang.t0 import SGLangT0  # noqa: E402

PAGE, TOKENS, LAYERS, HEADS, DIM, ROWS, SLOTS, CHUNK = 16, 512, 2, 2, 8, 4, 4, 32


def _pools():
    kv_pool = memory_pool.MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.float32, head_num=HEADS,
                                           head_dim=DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    alloc = allocator_mod.PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.float32, "cpu", kv_pool, need_sort=False)
    shape = mamba_utils.Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2,
                                                head_dim=4, state_size=8, conv_kernel=4)
    params = mamba_utils.Mamba2CacheParams(shape=shape, layers=[0, 2], dtype=mamba_utils.Mamba2StateDType(
        conv=torch.float32, temporal=torch.float32))
    rows = memory_pool.HybridReqToTokenPool(
        size=ROWS, mamba_size=SLOTS, mamba_spec_state_size=0, max_context_len=256, device="cpu",
        enable_memory_saver=False, cache_params=params, mamba_layer_ids=[0, 2], enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False)
    return rows, alloc, kv_pool


def _ctx(rows, alloc, **kw):
    params = cache_init_params.CacheInitParams(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc,
                                               page_size=PAGE)
    fields = dict(server_args=None, params=params, is_hybrid_swa=False, is_hybrid_ssm=True,
                  enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None, model_config=None,
                  tp_size=1, tp_rank=0, tp_group=None)
    fields.update(kw)
    return registry.TreeCacheBuildContext(**fields)


def _build(monkeypatch, rows, alloc, config: dict):
    # Req.owned_kv_len and release_kv_cache read SGLang's published config (a launched server's
    # ServerArgs); this test launches none, so the fields they read get their defaults
    serving = types.SimpleNamespace(strip_thinking_cache=False, enable_streaming_session=False)
    memory = types.SimpleNamespace(radix_cache_backend=backend_pkg.BACKEND_NAME, enable_hierarchical_cache=False,
                                   hicache_host_memory_mode="", enable_session_radix_cache=False,
                                   radix_eviction_policy="lru")  # --radix-cache-backend tiered
    for mod in (schedule_batch, common, registry):
        monkeypatch.setattr(mod, "get_serving", lambda: serving, raising=False)
    monkeypatch.setattr(registry, "get_memory", lambda: memory)
    monkeypatch.setattr(common, "get_spec", lambda: types.SimpleNamespace(speculative_algorithm=None))
    monkeypatch.setenv(backend_pkg.CONFIG_ENV, json.dumps(config))
    backend_pkg.register()
    return registry.create_tree_cache(_ctx(rows, alloc))  # SGLang's own routing to the registered factory


# ----------------------------------------------------------------------------- the "model"
def _code(toks) -> float:
    """A number naming the prefix ``toks`` (exact in float32)."""
    return float(zlib.crc32(array("q", toks).tobytes()) % (1 << 22))


def _kv_of(toks, layer: int) -> torch.Tensor:
    """The K rows the model writes for every token of ``toks``: [n, HEADS, DIM]."""
    codes = torch.tensor([_code(toks[:i + 1]) for i in range(len(toks))], dtype=torch.float32)
    return (codes + layer)[:, None, None].expand(-1, HEADS, DIM)


def _state_of(toks, cache):
    g = torch.Generator().manual_seed(zlib.crc32(array("q", toks).tobytes()))
    t = torch.randn(cache.temporal[:, 0].shape, generator=g)
    return t, [torch.randn(c[:, 0].shape, generator=g) for c in cache.conv]


def _check_prefix(backend, kv_pool, mcache, req, toks):
    """The ids handed to SGLang hold exactly the prefix's KV; the request's slot the prefix's state."""
    n = req.prefix_len
    ids = backend.prefix_device_indices(req)
    assert ids.numel() == n
    for layer in range(LAYERS):
        assert torch.equal(kv_pool.k_buffer[layer][ids], _kv_of(toks[:n], layer))
        assert torch.equal(kv_pool.v_buffer[layer][ids], -_kv_of(toks[:n], layer))
    if n:
        slot = int(req.kv.mamba_pool_idx)
        t, convs = _state_of(toks[:n], mcache)
        assert torch.equal(mcache.temporal[:, slot], t)  # lossless T1: bit-exact
        assert all(torch.equal(c[:, slot], want) for c, want in zip(mcache.conv, convs))


def _serve(backend, rows, alloc, kv_pool, rid: str, toks: list[int]) -> int:
    """One request in the scheduler's order; returns the prefix it resumed at."""
    mcache = rows.mamba_pool.mamba_cache
    req = schedule_batch.Req(rid, "", array("q", toks), sampling_params.SamplingParams(max_new_tokens=1))
    req.init_next_round_input(backend)  # SGLang's admission: match_kv_cache with cow_mamba
    assert req.host_hit_length == 0 and req.mamba_host_hit_length == 0  # no T2
    _check_prefix(backend, kv_pool, mcache, req, toks)
    req.lock = backend.lock(req.last_node)
    assert rows.alloc([req]) is not None  # its row, and a slot when the match gave none
    start = resumed = int(req.prefix_len)
    new = alloc.alloc(len(toks) - start)
    row = torch.cat([backend.prefix_device_indices(req), new.to(torch.int64)])
    rows.write((req.kv.req_pool_idx, slice(0, len(toks))), row.to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = len(toks)
    for end in range(start + CHUNK, len(toks) + CHUNK, CHUNK):  # chunked prefill
        end = min(end, len(toks))
        for layer in range(LAYERS):
            kv_pool.k_buffer[layer][row[start:end]] = _kv_of(toks, layer)[start:end]
            kv_pool.v_buffer[layer][row[start:end]] = -_kv_of(toks, layer)[start:end]
        t, convs = _state_of(toks[:end], mcache)
        slot = int(req.kv.mamba_pool_idx)
        mcache.temporal[:, slot] = t
        for c, want in zip(mcache.conv, convs):
            c[:, slot] = want
        if end < len(toks):
            backend.checkpoint(req, up_to=end)
            req.prefix_len = end
        start = end
    req.finished_reason = schedule_batch.FINISH_LENGTH(length=1)
    common.release_kv_cache(req, backend, checkpoint=True)  # final checkpoint, free row, unlock, slot back
    assert req.kv.mamba_pool_idx is None and req.kv.req_pool_idx is None  # slot and row back to SGLang
    return resumed


def test_factory_builds_the_tree_over_sglangs_pools_and_serves_a_multi_turn_workload(monkeypatch):
    rows, alloc, kv_pool = _pools()
    kv_free, rows_free = alloc.available_size(), rows.available_size()
    slots_free = rows.mamba_allocator.available_size()
    backend = _build(monkeypatch, rows, alloc, {"t1_states": 6, "codec": "lossless"})
    assert isinstance(backend, B.BasePrefixCache) and backend.supports_mamba()
    stack = backend.stack
    assert isinstance(stack.pool, SGLangT0) and stack.host is None  # T0 is SGLang's; no T2
    assert stack.tree.kv.available_size() == kv_free  # no second T0: the room is SGLang's allocator's
    a = [100 + i for i in range(48)]
    b = [900 + i for i in range(64)]
    turns = [("a1", a), ("b1", b), ("a2", a + [200 + i for i in range(32)]),
             ("a3", a + [200 + i for i in range(32)] + [300 + i for i in range(16)]),
             ("b2", b + [700 + i for i in range(48)]), ("a2'", a + [200 + i for i in range(16)] + [5] * 16)]
    resumed = {rid: _serve(backend, rows, alloc, kv_pool, rid, toks) for rid, toks in turns}
    assert resumed["a1"] == 0 and resumed["b1"] == 0
    assert resumed["a2"] == 48 and resumed["a3"] == 80 and resumed["b2"] == 64  # each turn resumes the last
    # a2' shares 64 tokens of KV with a2, but a2 prefilled 48..80 in one chunk: no state at 64, so it
    # resumes at the deepest state on its path, 48
    assert resumed["a2'"] == 48
    stats = stack.stats()
    assert stats["t1"]["stores"] > 0 and stats["t1"]["loads"] >= 4
    assert stats["evictions"].get("state", 0) > 0  # more checkpoints than T1 slots: T1 evicted states
    # nothing the requests held is left: SGLang's rows and slots are free, the tree holds the KV
    assert rows.available_size() == rows_free and rows.mamba_allocator.available_size() == slots_free
    assert backend.full_protected_size() == 0 and backend.full_evictable_size() == kv_free - alloc.available_size()
    backend.check_invariants()
    cached = kv_free - alloc.available_size()
    res = backend.evict(B.EvictParams(num_tokens=TOKENS))
    assert res.num_tokens_evicted == cached > 0
    assert alloc.available_size() == kv_free and backend.full_evictable_size() == 0
    backend.check_invariants()
    backend.close()


def test_a_cow_match_with_no_free_state_slot_is_a_miss_and_evicts_no_kv(monkeypatch):
    """SGLang's mamba slots all held by running requests: the match cannot copy the cached state out,
    so it reports no prefix and no host hit, and evicts no KV (evicting KV frees no slot of SGLang's
    separate mamba pool) and no T1 state; once a slot is free the same match is a hit again."""
    rows, alloc, kv_pool = _pools()
    backend = _build(monkeypatch, rows, alloc, {"t1_states": 4, "codec": "lossless"})
    toks = list(range(10, 58))
    assert _serve(backend, rows, alloc, kv_pool, "first", toks) == 0
    assert _serve(backend, rows, alloc, kv_pool, "other", list(range(500, 532))) == 0  # KV off the match's path
    kv_cached, states_cached = backend.full_evictable_size(), backend.mamba_evictable_size()
    held = rows.mamba_allocator.alloc(SLOTS)  # running requests hold every slot
    assert held is not None and rows.mamba_allocator.available_size() == 0
    req = schedule_batch.Req("starved", "", array("q", toks + [1] * 16), sampling_params.SamplingParams())
    req.init_next_round_input(backend)
    assert req.prefix_len == 0 and req.host_hit_length == 0 and req.mamba_host_hit_length == 0
    assert req.kv.mamba_pool_idx is None and req.best_match_node is backend.root_node
    assert backend.full_evictable_size() == kv_cached and backend.mamba_evictable_size() == states_cached
    # SGLang's admission asks for state room with EvictParams(mamba_num=...): the tree's states are
    # T1's, not SGLang's slots, so nothing is evicted for it
    assert backend.evict(B.EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted == 0
    assert backend.mamba_evictable_size() == states_cached
    rows.mamba_allocator.free(held[:1])
    req.init_next_round_input(backend)
    assert req.prefix_len == 48 and req.kv.mamba_pool_idx is not None
    _check_prefix(backend, kv_pool, rows.mamba_pool.mamba_cache, req, toks + [1] * 16)
    rows.mamba_allocator.free(req.kv.mamba_pool_idx.reshape(1))
    rows.mamba_allocator.free(held[1:])
    backend.evict(B.EvictParams(num_tokens=TOKENS))
    assert alloc.available_size() == TOKENS and rows.mamba_allocator.available_size() == SLOTS
    backend.check_invariants()


@pytest.mark.parametrize("config, arg, err", [
    ({"host_kv_pages": 8, "host_states": 2}, "host_kv_pages", InvalidArgumentError),  # T2 over SGLang's KV: not built
    ({"t1_states": 0}, "t1_states", InvalidArgumentError),
])
def test_factory_refuses_a_config_it_cannot_build_naming_the_key(monkeypatch, config, arg, err):
    rows, alloc, _ = _pools()
    free = alloc.available_size()
    with pytest.raises(err) as e:
        _build(monkeypatch, rows, alloc, config)
    assert e.value.arg == arg and alloc.available_size() == free


def test_factory_refuses_pools_without_a_mamba_pool(monkeypatch):
    _, alloc, _ = _pools()
    plain = memory_pool.ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
    monkeypatch.delenv(backend_pkg.CONFIG_ENV, raising=False)
    with pytest.raises(InvalidTypeError) as e:
        backend_pkg.factory(_ctx(plain, alloc))
    assert e.value.arg == "ctx.params.req_to_token_pool"


def test_factory_refuses_sglangs_int8_checkpoint_pool(monkeypatch):
    """--enable-int8-mamba-checkpoint gives the HybridReqToTokenPool SGLang's own int8 pool for cached
    states; ours is T1, so the factory refuses it, naming the field."""
    ckpt_mod = pytest.importorskip("sglang.srt.mem_cache.mamba_checkpoint_pool")
    flags = types.SimpleNamespace(mamba=types.SimpleNamespace(enable_int8_mamba_checkpoint=True,
                                                              int8_mamba_ckpt_size=4))
    monkeypatch.setattr(ckpt_mod, "get_exec", lambda: flags)
    rows, alloc, _ = _pools()
    assert rows.mamba_ckpt_pool is not None
    with pytest.raises(InvalidArgumentError) as e:
        _build(monkeypatch, rows, alloc, {})
    assert e.value.arg == "ctx.params.req_to_token_pool.mamba_ckpt_pool"
