"""The backend as SGLang builds it: ``factory`` through SGLang's registry with a real
``TreeCacheBuildContext`` over SGLang's real pools, on CPU and on CUDA (``ReqToTokenPool`` with its mamba
pool, the paged token-to-KV allocator and its MHA KV pool), driven with SGLang's ``Req`` in the
scheduler's order (``init_next_round_input`` -> match with copy-on-write, lock, the request's row and
slot, a checkpoint per prefill chunk, ``release_kv_cache``) over a multi-turn workload with T1 (lossless
and int8) and no T2.

The "model" writes, for every token, KV that is a function of the prefix up to it, and at every chunk
end a state that is a function of the prefix; so whatever the tree hands back is checked against what
that prefix must hold: the ids SGLang gets hold exactly that KV, the restored slot exactly that state
(int8: its one rounding)."""

from __future__ import annotations

import types
from array import array

import pytest

B = pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")

from tests.support.sglang_util import (  # noqa: E402
    ROWS,
    SLOTS,
    STATE_FAMILIES,
    TOKENS,
    _build,
    _check_prefix,
    _ctx,
    _pools,
    _serve,
    _state_params,
    memory_pool,
    sampling_params,
    schedule_batch,
)
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError  # noqa: E402
from tiered_cache.integrations import sglang as backend_pkg  # noqa: E402
from tiered_cache.integrations.sglang.t0 import SGLangT0  # noqa: E402


@pytest.mark.parametrize("codec", ["lossless", "int8"])
@pytest.mark.parametrize("family", STATE_FAMILIES)
def test_factory_builds_the_tree_over_sglangs_pools_and_serves_a_multi_turn_workload(monkeypatch, family, codec,
                                                                                    device):
    """Per state family SGLang has a pool layout for (its own cache params, built as its model configs
    build them): every prefix handed to SGLang holds exactly its KV, every resumed slot its state
    (lossless T1: bit-exact; int8: the reference's one rounding). The tiers are on the pools' device."""
    rows, alloc, kv_pool = _pools(family, device=device)
    kv_free, rows_free = alloc.available_size(), rows.available_size()
    slots_free = rows.mamba_allocator.available_size()
    backend = _build(monkeypatch, rows, alloc, {"t1_states": 6, "codec": codec})
    assert isinstance(backend, B.BasePrefixCache) and backend.supports_mamba()
    stack = backend.stack
    assert isinstance(stack.pool, SGLangT0) and stack.host is None  # T0 is SGLang's; no T2
    assert stack.tree.kv.available_size() == kv_free  # no second T0: the room is SGLang's allocator's
    assert stack.t1.device.type == kv_pool.k_buffer[0].device.type == device
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


def test_a_cow_match_with_no_free_state_slot_is_a_miss_and_evicts_no_kv(monkeypatch, device):
    """SGLang's mamba slots all held by running requests: the match cannot copy the cached state out,
    so it reports no prefix and no host hit, and evicts no KV (evicting KV frees no slot of SGLang's
    separate mamba pool) and no T1 state; once a slot is free the same match is a hit again."""
    rows, alloc, kv_pool = _pools(device=device)
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
    ({"host_kv_pages": 8}, "host_states", InvalidArgumentError),  # T2 holds states too
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


def test_factory_refuses_a_mamba_pool_with_per_slot_side_states(monkeypatch):
    """Qwen4-Exp's short convs ride on SGLang's mamba slots as a side state (``register_slot_state``);
    T1 copies temporal and conv only, so a resume would leave them stale: refused, naming the pool."""
    rows, alloc, _ = _pools()
    params = _state_params("mamba2")
    with_side = memory_pool.HybridReqToTokenPool(
        size=ROWS, mamba_size=SLOTS, mamba_spec_state_size=0, max_context_len=256, device="cpu",
        enable_memory_saver=False, cache_params=params, mamba_layer_ids=[0, 2], enable_mamba_extra_buffer=False,
        enable_overlap_schedule=False, short_conv_layer_ids=[1], short_conv_state_shape=(16, 2))
    assert with_side.short_conv_pool.enabled
    free = alloc.available_size()
    with pytest.raises(InvalidArgumentError) as e:
        _build(monkeypatch, with_side, alloc, {})
    assert e.value.arg == "ctx.params.req_to_token_pool.mamba_pool" and alloc.available_size() == free
    _build(monkeypatch, rows, alloc, {}).close()  # the same pools without it build


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
