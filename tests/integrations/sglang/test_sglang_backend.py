"""The backend driven with SGLang 0.5.23's own objects: its ``Req``, its ``ReqToTokenPool`` rows, its
registry and a real ``TreeCacheBuildContext``; and the backend config's typed errors.

T0 here is still our ``UnifiedPool`` (the adapters over SGLang's KV and mamba pools are not built), so
the rows of SGLang's ``ReqToTokenPool`` hold our T0 ids: the test checks the translation (what a
checkpoint writes into the row, where the lock goes, what a later match hands back), not SGLang's
memory. The request tests run with everything on CPU and on CUDA (``device``)."""

from __future__ import annotations

import json
from array import array

import pytest
import torch

B = pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")
sgl_radix = pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from tests.support.sglang_util import (  # noqa: E402
    cache_init_params,
    memory_pool,
    registry,
    sampling_params,
    schedule_batch,
)
from tiered_cache import CacheConfig, KVSpec, StateSpec, TieredCache  # noqa: E402
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError  # noqa: E402
from tiered_cache.integrations import sglang as backend_pkg  # noqa: E402
from tiered_cache.integrations.sglang import TieredRadixCache, parse_backend_config  # noqa: E402
from tiered_cache.radix import tree as tree_module  # noqa: E402

PAGE = 16
STATE = StateSpec(num_layers=2, temporal_shape=(1, 4, 4), temporal_dtype=torch.float32,
                  conv_shapes=((8, 3),), conv_dtype=torch.float32, value_axis=2)


def _cache(device: str, codec: str = "lossless") -> TieredCache:
    kv = KVSpec(num_layers=2, kv_heads=1, head_dim=8, dtype=torch.float32)
    cfg = CacheConfig(page_size=PAGE, kv_pages=16, t0_states=4, t1_states=4, codec=codec, check_memory=False)
    return TieredCache.build(cfg, kv=kv, state=STATE, device=device)


def _req(rid: str, toks: list[int]):
    req = schedule_batch.Req(rid, "", array("q", toks), sampling_params.SamplingParams(max_new_tokens=1))
    req.refresh_fill_ids()
    return req


def _write_state(cache: TieredCache, slot: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    row = cache.states.translate(slot.reshape(1))
    view = cache.states.temporal_view_all()
    t = torch.randn((STATE.num_layers, 1, *STATE.temporal_shape), generator=g).to(view.device)
    view[:, row] = t
    return t


def test_chunked_prefill_checkpoints_then_a_second_request_resumes_from_the_tree(device, monkeypatch):
    """The scheduler's order for one request (match with cow_mamba, lock, a checkpoint per prefill chunk,
    the final checkpoint, release), then a second request with the same prompt and more: its match
    hands back exactly the ids the tree holds, and its copied state is the cached one, bit for bit. A
    checkpoint's insert starts its walk at the request's ``last_node`` (the previous chunk's), where the
    tree proves the path holds."""
    walked_from = []  # what each insert's hint gave: tokens from the root to the hint's end (0: from the root)
    real = tree_module.hinted
    monkeypatch.setattr(tree_module, "hinted", lambda *a: walked_from.append(real(*a)) or walked_from[-1])
    with _cache(device) as cache:
        rows = memory_pool.ReqToTokenPool(size=4, max_context_len=128, device=device, enable_memory_saver=False)
        backend = TieredRadixCache(cache.tree, req_to_token_pool=rows, token_to_kv_pool_allocator=None,
                                   page_size=PAGE)
        free0 = cache.free_sizes()
        toks = list(range(1000, 1048))  # 3 pages
        req = _req("a", toks)
        assert rows.alloc([req]) is not None
        r = backend.match_prefix(B.MatchPrefixParams(key=sgl_radix.RadixKey(array("q", toks)), cow_mamba=True,
                                                     req=req))
        assert r.device_prefix_len == 0 and r.last_device_node is backend.root_node
        req.last_node = r.last_device_node
        req.lock = backend.lock(req.last_node)
        req.kv.mamba_pool_idx = cache.alloc_states(1)[0]
        ids = cache.alloc_kv(48)
        rows.write((req.kv.req_pool_idx, slice(0, 48)), ids.to(torch.int32))
        # chunk 1 ends at 32: the state there is exported into the request's slot, then checkpointed
        s32 = _write_state(cache, req.kv.mamba_pool_idx, 1)
        backend.checkpoint(req, up_to=32)
        assert req.kv.cache_protected_len == 32 and req.kv.cache_inserted_len == 32
        assert torch.equal(backend.path_device_indices(req.last_node), ids[:32])
        assert req.lock.node is req.last_node and backend.full_protected_size() == 32
        # chunk 2 (the last) ends at 48
        s48 = _write_state(cache, req.kv.mamba_pool_idx, 2)
        backend.checkpoint(req, up_to=48)
        assert req.kv.cache_protected_len == 48 and walked_from[-1] == 32  # from chunk 1's node
        row = rows.req_to_token[req.kv.req_pool_idx, :48].to(torch.int64)
        assert torch.equal(row, backend.path_device_indices(req.last_node)) and torch.equal(row, ids)
        cache.check_invariants(request_states=req.kv.mamba_pool_idx.reshape(1))
        # the request finishes: release_kv_cache's order (the final checkpoint, free the row past the
        # protected prefix: nothing here, unlock, on_release, free the row)
        req.finished_reason = schedule_batch.FINISH_LENGTH(length=1)
        states_free = cache.states.available_size()
        backend.checkpoint(req, up_to=48)
        assert req.kv.mamba_pool_idx is None and cache.states.available_size() == states_free + 1
        backend.unlock(req.lock)
        req.lock = None
        backend.on_release(req, checkpointed=True)
        rows.free(req)
        assert backend.full_protected_size() == 0 and backend.full_evictable_size() == 48

        # a second request: same prompt + a new page; the match resumes at 48 with the state of 48
        req2 = _req("b", toks + list(range(5000, 5016)))
        r2 = backend.match_prefix(B.MatchPrefixParams(key=sgl_radix.RadixKey(array("q", req2.origin_input_ids)),
                                                      cow_mamba=True, req=req2))
        assert r2.device_prefix_len == 48 and r2.full_kv_hit_length == 48
        req2.prefix_len, req2.last_node = r2.device_prefix_len, r2.last_device_node
        assert torch.equal(backend.prefix_device_indices(req2), ids)  # the base's helper, SGLang's path
        slot = req2.kv.mamba_pool_idx.reshape(1)
        got = cache.states.temporal_view_all()[:, cache.states.translate(slot)]
        assert torch.equal(got, s48) and not torch.equal(got, s32)  # lossless T1: bit-exact
        # a prefix of it that ends at 32 resumes there, at the chunk-1 state
        req3 = _req("c", toks[:32] + [9, 9])
        r3 = backend.match_prefix(B.MatchPrefixParams(key=sgl_radix.RadixKey(array("q", req3.origin_input_ids)),
                                                      cow_mamba=True, req=req3))
        assert r3.device_prefix_len == 32
        slot3 = req3.kv.mamba_pool_idx.reshape(1)
        assert torch.equal(cache.states.temporal_view_all()[:, cache.states.translate(slot3)], s32)
        cache.states.free(slot)
        cache.states.free(slot3)
        # evict everything with SGLang's EvictParams: every pool is back where it began
        res = backend.evict(B.EvictParams(num_tokens=48, mamba_num=2))
        assert res.num_tokens_evicted == 48
        backend.reset()
        cache.check_invariants()
        assert cache.free_sizes() == free0


def test_an_aborted_request_gives_its_state_slot_back_on_release(device):
    with _cache(device) as cache:
        rows = memory_pool.ReqToTokenPool(size=2, max_context_len=64, device=device, enable_memory_saver=False)
        backend = TieredRadixCache(cache.tree, req_to_token_pool=rows, token_to_kv_pool_allocator=None,
                                   page_size=PAGE)
        free0 = cache.free_sizes()
        req = _req("a", list(range(32)))
        rows.alloc([req])
        req.kv.mamba_pool_idx = cache.alloc_states(1)[0]
        req.finished_reason = schedule_batch.FINISH_ABORT()
        backend.on_release(req, checkpointed=False)
        assert req.kv.mamba_pool_idx is None and cache.free_sizes() == free0
        backend.on_release(req, checkpointed=False)  # nothing held: nothing freed twice
        assert cache.free_sizes() == free0


def test_checkpoint_refuses_a_position_past_the_fill_ids(device):
    with _cache(device) as cache:
        rows = memory_pool.ReqToTokenPool(size=2, max_context_len=64, device=device, enable_memory_saver=False)
        backend = TieredRadixCache(cache.tree, req_to_token_pool=rows, token_to_kv_pool_allocator=None,
                                   page_size=PAGE)
        req = _req("a", list(range(16)))
        rows.alloc([req])
        with pytest.raises(InvalidArgumentError) as e:
            backend.checkpoint(req, up_to=32)
        assert e.value.arg == "up_to"
        assert backend.full_evictable_size() == 0


# ----------------------------------------------------------------------------- the backend config
def test_backend_config_keys_and_values(tmp_path):
    cfg = parse_backend_config('{"t1_states": 64, "host_kv_pages": 128, "host_states": 16, "codec": "int8"}')
    built = cfg.cache_config(page_size=PAGE, kv_pages=100, t0_states=8)
    assert (built.t1_states, built.host_kv_pages, built.host_states, built.kv_pages) == (64, 128, 16, 100)
    path = tmp_path / "tiered.json"
    path.write_text(json.dumps({"t1_states": 8}))
    assert parse_backend_config(str(path)).tiers == {"t1_states": 8}
    assert parse_backend_config(None).tiers == {} and parse_backend_config("  ").tiers == {}


@pytest.mark.parametrize("text, arg, err", [
    ('{"t1_state": 4}', "t1_state", InvalidArgumentError),           # unknown key
    ('{"kv_pages": 4}', "kv_pages", InvalidArgumentError),           # T0 is SGLang's
    ('{"t1_states": 0}', "t1_states", InvalidArgumentError),         # CacheConfig's check, under the key
    ('{"codec": "fp8"}', "codec", InvalidArgumentError),
    ('{"host_states": "4"}', "host_states", InvalidTypeError),
    ('{"host_kv_pages": 4, "host_states": 1, "storage_url": "file:///tmp/x"}', "model_id", InvalidArgumentError),
    ('{"t1_states": 4', "config", InvalidArgumentError),             # not JSON
    ('[1, 2]', "config", InvalidArgumentError),                      # not an object (a path that is no file)
    ("/no/such/file.json", "config", InvalidArgumentError),
])
def test_bad_backend_config_is_a_typed_error_naming_the_key(text, arg, err):
    with pytest.raises(err) as e:
        parse_backend_config(text)
    assert e.value.arg == arg


# ----------------------------------------------------------------------------- factory and registry
def _ctx(**kw):
    rows = memory_pool.ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
    params = cache_init_params.CacheInitParams(disable=False, req_to_token_pool=rows,
                                               token_to_kv_pool_allocator=None, page_size=PAGE)
    fields = dict(server_args=None, params=params, is_hybrid_swa=False, is_hybrid_ssm=True,
                  enable_hierarchical_cache=False, disable_radix_cache=False, tp_worker=None, model_config=None,
                  tp_size=1, tp_rank=0, tp_group=None)
    fields.update(kw)
    return registry.TreeCacheBuildContext(**fields)


@pytest.mark.parametrize("kw, arg", [
    ({"tp_size": 2}, "ctx.tp_group"),  # TP without a group to agree over
    ({"is_hybrid_swa": True}, "ctx.is_hybrid_ssm"),  # SWA + mamba
    ({"is_hybrid_ssm": False}, "ctx.is_hybrid_ssm"),  # neither
    ({"disable_radix_cache": True}, "ctx.disable_radix_cache"),
])
def test_factory_refuses_what_it_cannot_run_with_a_typed_error(kw, arg):
    with pytest.raises(InvalidArgumentError) as e:
        backend_pkg.factory(_ctx(**kw))
    assert e.value.arg == arg


def test_factory_reads_the_config_from_the_environment(monkeypatch):
    monkeypatch.setenv(backend_pkg.CONFIG_ENV, '{"t1_states": -1}')
    with pytest.raises(InvalidArgumentError) as e:
        backend_pkg.factory(_ctx())
    assert e.value.arg == "t1_states"
    monkeypatch.setenv(backend_pkg.CONFIG_ENV, '{"t1_states": 8}')
    assert backend_pkg.check_context(_ctx()).tiers == {"t1_states": 8}


def test_register_puts_the_factory_in_sglangs_registry_once():
    backend_pkg.register()
    backend_pkg.register()  # SGLang's registry refuses a name twice; ours does nothing the second time
    assert backend_pkg.BACKEND_NAME in registry.registered_radix_cache_backends()
    assert registry.get_radix_cache_factory(backend_pkg.BACKEND_NAME) is backend_pkg.factory
