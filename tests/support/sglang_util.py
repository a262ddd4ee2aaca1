"""SGLang's real pools, built and driven as SGLang's scheduler does, for the tests of
``tiered_cache.integrations.sglang`` (``tests/integrations/sglang``): ``_pools`` (``HybridReqToTokenPool``
with its mamba pool, the paged allocator and its MHA KV pool), ``_build`` (the backend through SGLang's
registry with a real ``TreeCacheBuildContext``), the "model" (``_kv_of``, ``_state_of``: KV and states
that are functions of the prefix, on the pools' device) and ``_serve`` (one request in the scheduler's
order). The pools are on the CPU or on CUDA (``device``: the fixture of the tests' conftest), and the
tiers the factory builds over them on the same device. Importing it skips the importing test module
where SGLang is not installed."""

from __future__ import annotations

import json
import types
import zlib
from array import array

import pytest
import torch

registry = pytest.importorskip("sglang.srt.mem_cache.registry")
memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
allocator_mod = pytest.importorskip("sglang.srt.mem_cache.allocator")
cache_init_params = pytest.importorskip("sglang.srt.mem_cache.cache_init_params")
common = pytest.importorskip("sglang.srt.mem_cache.common")
mamba_utils = pytest.importorskip("sglang.srt.configs.mamba_utils")
schedule_batch = pytest.importorskip("sglang.srt.managers.schedule_batch")
sampling_params = pytest.importorskip("sglang.srt.sampling.sampling_params")
B = pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")

from tiered_cache.integrations import sglang as backend_pkg  # noqa: E402
from tiered_cache.kernels._ref_quant import dequantize_reference, quantize_reference  # noqa: E402

PAGE, TOKENS, LAYERS, HEADS, DIM, ROWS, SLOTS, CHUNK = 16, 512, 2, 2, 8, 4, 4, 32


def _state_params(family: str, tp: int = 1):
    """SGLang's cache params for a state family, built as its model configs build them (tiny sizes):
    ``mamba2`` (NemotronH, FalconH1, GraniteMoeHybrid: ``Mamba2StateShape``), ``gdn`` (Qwen3-Next's
    gated delta-net: the same shape class with key heads as groups and the q/k/v conv groups), ``kda``
    (Kimi Linear: ``KimiLinearStateShape``, conv windows laid out ``[K-1, channels]``), ``short_conv``
    (Lfm2: no recurrent state, conv windows only)."""
    dtype = mamba_utils.Mamba2StateDType(conv=torch.float32, temporal=torch.float32)
    if family == "mamba2":
        shape = mamba_utils.Mamba2StateShape.create(tp_world_size=tp, intermediate_size=16, n_groups=tp,
                                                    num_heads=2, head_dim=4, state_size=8, conv_kernel=4)
        return mamba_utils.Mamba2CacheParams(shape=shape, layers=[0, 2], dtype=dtype)
    if tp != 1:
        raise ValueError(f"TP pools are built for mamba2 only, not {family}")
    if family == "gdn":  # 2 key heads of 4, 4 value heads of 4 (configs/qwen3_next.py): conv over q, k and v
        shape = mamba_utils.Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=2, num_heads=4,
                                                    head_dim=4, state_size=4, conv_kernel=4,
                                                    conv_shard_groups=[8, 8, 16])
        return mamba_utils.Mamba2CacheParams(shape=shape, layers=[0, 2], dtype=dtype)
    if family == "kda":  # configs/kimi_linear.py
        shape = mamba_utils.KimiLinearStateShape.create(tp_world_size=1, num_heads=2, head_dim=4, conv_kernel_size=4)
        return mamba_utils.KimiLinearCacheParams(shape=shape, layers=[0, 2], dtype=dtype)
    if family == "short_conv":  # Lfm2 (configs/lfm2.py): a Mamba2 shape with state_size 0, conv windows only
        shape = mamba_utils.Mamba2StateShape.create(tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=1,
                                                    head_dim=16, state_size=0, conv_kernel=3)
        return mamba_utils.Mamba2CacheParams(shape=shape, layers=[0, 2], dtype=dtype)
    raise ValueError(family)


STATE_FAMILIES = ("mamba2", "gdn", "kda", "short_conv")


def _pools(family: str = "mamba2", rank: int = 0, tp: int = 1, device: str = "cpu"):
    """SGLang's pools on ``device``; under TP (``tp`` ranks), rank ``rank``'s: its share of the KV heads
    and of the state heads, as SGLang builds a rank's pools (``kv_pool.test_rank`` / ``test_tp`` say whose)."""
    kv_pool = memory_pool.MHATokenToKVPool(size=TOKENS, page_size=PAGE, dtype=torch.float32, head_num=HEADS // tp,
                                           head_dim=DIM, layer_num=LAYERS, device=device, enable_memory_saver=False)
    kv_pool.test_rank, kv_pool.test_tp = rank, tp
    alloc = allocator_mod.PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.float32, device, kv_pool, need_sort=False)
    params = _state_params(family, tp)
    rows = memory_pool.HybridReqToTokenPool(
        size=ROWS, mamba_size=SLOTS, mamba_spec_state_size=0, max_context_len=256, device=device,
        enable_memory_saver=False, cache_params=params, mamba_layer_ids=[0, 2], enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False)
    return rows, alloc, kv_pool


def _ctx(rows, alloc, params_kw=None, **kw):
    params = cache_init_params.CacheInitParams(disable=False, req_to_token_pool=rows, token_to_kv_pool_allocator=alloc,
                                               page_size=PAGE, **(params_kw or {}))
    fields = dict(server_args=None, params=params, is_hybrid_swa=False, is_hybrid_ssm=True,
                  enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None, model_config=None,
                  tp_size=1, tp_rank=0, tp_group=None)
    fields.update(kw)
    return registry.TreeCacheBuildContext(**fields)


def _build(monkeypatch, rows, alloc, config: dict, params_kw=None, **ctx_kw):
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
    # SGLang's own routing to the registered factory
    return registry.create_tree_cache(_ctx(rows, alloc, params_kw=params_kw, **ctx_kw))


# ----------------------------------------------------------------------------- the "model"
def _code(toks) -> float:
    """A number naming the prefix ``toks`` (exact in float32)."""
    return float(zlib.crc32(array("q", toks).tobytes()) % (1 << 22))


def _kv_of(toks, layer: int, kv_pool) -> torch.Tensor:
    """The K rows the model writes for every token of ``toks``: [n, heads, DIM], each head its own (exact
    in float32), on ``kv_pool``'s device; ``kv_pool``: a TP rank's, whose share of the heads it holds."""
    codes = torch.tensor([_code(toks[:i + 1]) for i in range(len(toks))], dtype=torch.float32)
    rank, tp = kv_pool.test_rank, kv_pool.test_tp
    h = HEADS // tp
    heads = torch.arange(rank * h, (rank + 1) * h, dtype=torch.float32)
    kv = ((codes + layer)[:, None] + 4096 * heads[None, :])[:, :, None].expand(-1, h, DIM)
    return kv.to(kv_pool.device)


def _state_of(toks, cache, rank: int = 0):
    """The state after ``toks`` (a TP rank's share: seeded by the rank too), on the pool's device."""
    g = torch.Generator().manual_seed(zlib.crc32(array("q", toks).tobytes()) + rank)
    t = torch.randn(cache.temporal[:, 0].shape, generator=g)
    convs = [torch.randn(c[:, 0].shape, generator=g) for c in cache.conv]
    dev = cache.temporal.device
    return t.to(dev), [c.to(dev) for c in convs]


def _restored(backend, state: torch.Tensor) -> torch.Tensor:
    """What a T1 round trip makes of a temporal state: itself (lossless) or one int8 rounding (the
    reference math: SGLang's temporal is (HV, V, K), V the value axis, so no transpose)."""
    if backend.stack.config.codec == "lossless" or state.numel() == 0:
        return state
    q, scale = quantize_reference(state)
    return dequantize_reference(q, scale, state.dtype)


def _check_prefix(backend, kv_pool, mcache, req, toks):
    """The ids handed to SGLang hold exactly the prefix's KV; the request's slot the prefix's state."""
    n = req.prefix_len
    ids = backend.prefix_device_indices(req)
    assert ids.numel() == n
    for layer in range(LAYERS):
        assert torch.equal(kv_pool.k_buffer[layer][ids], _kv_of(toks[:n], layer, kv_pool))
        assert torch.equal(kv_pool.v_buffer[layer][ids], -_kv_of(toks[:n], layer, kv_pool))
    if n:
        slot = int(req.kv.mamba_pool_idx)
        t, convs = _state_of(toks[:n], mcache, kv_pool.test_rank)
        want = _restored(backend, t)
        assert torch.equal(mcache.temporal[:, slot], want)  # lossless T1: bit-exact; int8: one rounding
        assert t.numel() == 0 or torch.equal(want, t) == (backend.stack.config.codec == "lossless")
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
            kv_pool.k_buffer[layer][row[start:end]] = _kv_of(toks, layer, kv_pool)[start:end]
            kv_pool.v_buffer[layer][row[start:end]] = -_kv_of(toks, layer, kv_pool)[start:end]
        t, convs = _state_of(toks[:end], mcache, kv_pool.test_rank)
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


# ----------------------------------------------------------------------------- an SWA hybrid (full + SWA layers)
SWA_TOKENS, WINDOW, FULL_LAYERS, SWA_LAYERS = 256, 24, [0], [1, 2]


def _swa_pools(size_swa: int = SWA_TOKENS, size: int = TOKENS, device: str = "cpu"):
    """SGLang's pools of an SWA hybrid on ``device``: a ``ReqToTokenPool``, the ``SWATokenToKVPoolAllocator``
    (a paged full allocator and a paged SWA allocator, the full-to-SWA mapping) and its ``SWAKVPool``
    (one full-attention layer, two sliding-window layers)."""
    swa_pool_mod = pytest.importorskip("sglang.srt.mem_cache.swa_memory_pool")
    swa_alloc_mod = pytest.importorskip("sglang.srt.mem_cache.allocator.swa")
    pool = swa_pool_mod.SWAKVPool(size=size, size_swa=size_swa, page_size=PAGE, dtype=torch.float32, head_num=HEADS,
                                  head_dim=DIM, swa_attention_layer_ids=SWA_LAYERS,
                                  full_attention_layer_ids=FULL_LAYERS, device=device, enable_memory_saver=False)
    pool.test_rank, pool.test_tp = 0, 1
    alloc = swa_alloc_mod.SWATokenToKVPoolAllocator(size, size_swa, PAGE, torch.float32, device, pool,
                                                    need_sort=False)
    rows = memory_pool.ReqToTokenPool(size=ROWS, max_context_len=256, device=device, enable_memory_saver=False)
    return rows, alloc, pool


def _build_swa(monkeypatch, rows, alloc, config=None, window: int = WINDOW):
    """The backend of an SWA hybrid through SGLang's registry (``is_hybrid_swa``, its window)."""
    return _build(monkeypatch, rows, alloc, config or {}, {"sliding_window_size": window}, is_hybrid_swa=True,
                  is_hybrid_ssm=False)


def _write_swa(pool, alloc, row, toks, start: int, end: int) -> None:
    """The model's forward over ``[start, end)``: full KV at the row's ids, SWA KV at their SWA ids."""
    ids = row[start:end]
    swa = alloc.full_to_swa_index_mapping[ids]
    assert bool((swa > 0).all()), "a token computed without SWA KV"
    for i, layer in enumerate(FULL_LAYERS):
        pool.full_kv_pool.k_buffer[i][ids] = _kv_of(toks, layer, pool)[start:end]
        pool.full_kv_pool.v_buffer[i][ids] = -_kv_of(toks, layer, pool)[start:end]
    for i, layer in enumerate(SWA_LAYERS):
        pool.swa_kv_pool.k_buffer[i][swa] = _kv_of(toks, layer, pool)[start:end]
        pool.swa_kv_pool.v_buffer[i][swa] = -_kv_of(toks, layer, pool)[start:end]


def _check_swa_prefix(backend, pool, alloc, req, toks) -> None:
    """The full ids handed to SGLang hold the prefix's full KV; their SWA ids (SGLang's mapping) the SWA
    KV of the window before the resume point, exactly."""
    n = req.prefix_len
    ids = backend.prefix_device_indices(req)
    assert ids.numel() == n
    for i, layer in enumerate(FULL_LAYERS):
        assert torch.equal(pool.full_kv_pool.k_buffer[i][ids], _kv_of(toks[:n], layer, pool))
        assert torch.equal(pool.full_kv_pool.v_buffer[i][ids], -_kv_of(toks[:n], layer, pool))
    lo = max(0, n - backend.swa_retain_window)
    swa = alloc.full_to_swa_index_mapping[ids[lo:]]
    assert bool((swa > 0).all()), "the window before the resume point has no SWA KV"
    for i, layer in enumerate(SWA_LAYERS):
        assert torch.equal(pool.swa_kv_pool.k_buffer[i][swa], _kv_of(toks[:n], layer, pool)[lo:])
        assert torch.equal(pool.swa_kv_pool.v_buffer[i][swa], -_kv_of(toks[:n], layer, pool)[lo:])


def _poison_free(pool, alloc) -> None:
    """NaN into every free page of the full and the SWA pool."""
    for sub, side in ((pool.full_kv_pool, alloc.full_attn_allocator), (pool.swa_kv_pool, alloc.swa_attn_allocator)):
        pages = side.get_all_free_pages().to(torch.int64)
        toks = (pages[:, None] * PAGE + torch.arange(PAGE, device=pages.device)[None, :]).reshape(-1)
        for buf in (*sub.k_buffer, *sub.v_buffer):
            buf[toks] = float("nan")


def _alloc_extend(backend, alloc, prefix, n: int) -> torch.Tensor:
    """The full ids of tokens ``[len(prefix), n)`` from SGLang's ``alloc_extend`` (an SWA page paired with
    each full page), evicting through SGLang's ``evict_to_free_tokens`` when a pool is short."""
    p = prefix.numel()
    one = lambda v, dev="cpu": torch.tensor([v], dtype=torch.int64, device=dev)  # noqa: E731
    dev = alloc.device  # the lengths and last location on the pools' device (SGLang's kernel reads them), and on CPU
    args = (one(p, dev), one(p), one(n, dev), one(n), one(int(prefix[-1]) if p else -1, dev), n - p)
    out = alloc.alloc_extend(*args)
    if out is None:
        alloc.evict_to_free_tokens(backend, -(-(n - p) // PAGE) * PAGE)
        out = alloc.alloc_extend(*args)
    assert out is not None, "no room after eviction"
    return out.to(torch.int64)


def _serve_swa(backend, rows, alloc, pool, rid: str, toks: list[int], prompt_len: int, shield: bool = False) -> int:
    """One request of an SWA hybrid in the scheduler's order: match, lock, alloc, chunked prefill of
    ``prompt_len`` tokens with a checkpoint after each chunk, decode of the rest one token a step with
    SGLang's sliding-window frees (``evict_sliding_windows``), finish (``release_kv_cache``). ``shield``:
    SGLang's prefill-aware SWA (``req.kv.swa_evict_floor`` at the prefill's end: decode frees nothing
    below it). A host hit is loaded back (``init_load_back``, as SGLang's admission does). Every free page
    of both pools is NaN first, so a token read from anywhere but what the tree holds fails the checks.
    Returns the prefix it resumed at (device and host)."""
    _poison_free(pool, alloc)
    req = schedule_batch.Req(rid, "", array("q", toks), sampling_params.SamplingParams(max_new_tokens=1))
    req.init_next_round_input(backend)
    if req.host_hit_length:
        got, req.last_node = backend.init_load_back(B.InitLoadBackParams(req.best_match_node, req.host_hit_length,
                                                                         req=req))
        assert got == req.host_hit_length
        req.prefix_len += got
        req.kv.cache_protected_len = req.prefix_len
    _check_swa_prefix(backend, pool, alloc, req, toks)
    req.lock = backend.lock(req.last_node)
    assert rows.alloc([req]) is not None
    start = resumed = int(req.prefix_len)
    prefix = backend.prefix_device_indices(req)
    row = torch.cat([prefix, _alloc_extend(backend, alloc, prefix, len(toks))])
    own = -(-(len(toks) - start) // PAGE) * PAGE  # the request's SWA pages, whole
    assert (alloc.swa_available_size() + backend.swa_evictable_size() + backend.swa_protected_size() + own
            == alloc.size_swa)  # SGLang's SWA leak check with the request running: its prefix protected
    rows.write((req.kv.req_pool_idx, slice(0, len(toks))), row.to(torch.int32))
    req.kv.kv_allocated_len = req.kv.kv_committed_len = len(toks)
    while start < prompt_len:  # chunked prefill
        end = min(start + CHUNK, prompt_len)
        _write_swa(pool, alloc, row, toks, start, end)
        backend.checkpoint(req, up_to=end)
        req.prefix_len = start = end
    if shield:
        req.kv.swa_evict_floor = prompt_len
    for pos in range(start, len(toks)):  # decode: SGLang frees what slid out of the window
        _write_swa(pool, alloc, row, toks, pos, pos + 1)
        backend.evict_sliding_windows(req, pos + 1)
    req.finished_reason = schedule_batch.FINISH_LENGTH(length=1)
    common.release_kv_cache(req, backend, checkpoint=True)
    assert req.kv.req_pool_idx is None
    backend.check_hicache_events()  # backups to T2 land
    return resumed


def _check_swa_mapping(backend, alloc) -> tuple[int, int]:
    """With no request running: SGLang's mapping is exactly the tree's (each cached full id maps to its
    node's SWA id, a tombstone's to 0, no other full id to anything); every allocated page of either
    pool is the tree's, and SGLang's leak check (free + evictable = capacity) holds. Returns (full
    tokens, SWA tokens) the tree holds on the device."""
    m = alloc.full_to_swa_index_mapping
    want = torch.zeros_like(m[:-1])
    full = swa = 0
    stack = list(backend.root_node.children.values())
    while stack:
        x = stack.pop()
        stack.extend(x.children.values())
        if x.value is None:  # on the host only
            assert x.payload.swa_value is None
            continue
        full += x.value.numel()
        if x.payload.swa_value is not None:
            want[x.value] = x.payload.swa_value
            swa += x.value.numel()
    assert torch.equal(m[:-1], want), "SGLang's full-to-SWA mapping differs from the tree's SWA ids"
    assert alloc.full_available_size() + full == alloc.size_full
    assert alloc.full_available_size() + backend.full_evictable_size() == alloc.size_full  # SGLang's leak check
    assert alloc.swa_available_size() + backend.swa_evictable_size() == alloc.size_swa
    assert backend.swa_protected_size() == 0
    assert alloc.swa_available_size() + swa == alloc.size_swa
    return full, swa
