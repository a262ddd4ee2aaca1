"""T2 over SGLang's own KV pool (issue 19): SGLang's ``MHATokenToKVPool`` keeps one buffer per layer, so
``SGLangKVSide`` offers per-layer page rows (``layer_rows``) and the T2 moves gather them into our page
envelope and scatter a loaded one back. Tested on SGLang's real pools on CPU: the moves' round trip
byte for byte (checksummed, busy marks released, a damaged host copy caught), and the factory with
``host_kv_pages`` driven in the scheduler's order, the KV demoted to T2 by eviction and loaded back
into the ids SGLang gets, the state of the prefix restored, the pools back to their free counts; and T3
below it: a restarted backend over fresh pools serves the prefix from a file store. Each test also runs
with the pools on CUDA (``device``): T1 on the GPU, T2 in pinned host memory, the moves on the transfer
engine's streams."""

from __future__ import annotations

from array import array

import pytest
import torch

B = pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")

from tests.support.sglang_util import (  # noqa: E402
    CHUNK,
    LAYERS,
    PAGE,
    STATE_FAMILIES,
    TOKENS,
    _build,
    _check_prefix,
    _kv_of,
    _pools,
    _serve,
    sampling_params,
    schedule_batch,
)
from tiered_cache.errors import InvalidArgumentError  # noqa: E402
from tiered_cache.integrations.sglang.t0 import SGLangKVSide  # noqa: E402
from tiered_cache.radix import EvictParams  # noqa: E402
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec  # noqa: E402
from tiered_cache.tiers.protocols import KVSide, LayeredKVSide  # noqa: E402
from tiered_cache.transfer.engine import TransferEngine  # noqa: E402
from tiered_cache.transfer.moves import demote_kv, load_kv  # noqa: E402


def _moves(device: str = "cpu"):
    """SGLang's pools on ``device``, the side over them, a T2 region (pinned where CUDA is) and an engine
    (on CUDA its default backend: the Triton gathers; on CPU plain torch, not the Triton interpreter)."""
    rows, alloc, kv_pool = _pools(device=device)
    side = SGLangKVSide(alloc)
    host = HostMirror([RegionSpec("full", side.entry_bytes, 8)], check_memory=False)
    engine = TransferEngine(device, backend="torch" if device == "cpu" else "auto")
    return alloc, kv_pool, side, host.region("full"), engine


def test_sglang_kv_side_is_a_layered_kv_side_with_views_of_sglangs_buffers(device):
    _, kv_pool, side, _, _ = _moves(device)
    assert isinstance(side, LayeredKVSide) and not isinstance(side, KVSide)
    fields = side.layer_rows()
    assert len(fields) == 2 * LAYERS
    assert [o for o, _ in fields] == [o for kv in side.spec.field_offsets(PAGE) for o in kv]
    off, k1 = fields[2]  # layer 1's K
    k1[3, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8, device=device)  # aliases SGLang's buffer
    assert torch.equal(kv_pool.k_buffer[1][3 * PAGE].view(torch.uint8).reshape(-1)[:4].cpu(),
                       torch.tensor([1, 2, 3, 4], dtype=torch.uint8))


def test_t2_round_trip_through_sglangs_per_layer_kv_pool(poison, device):
    alloc, kv_pool, side, region, engine = _moves(device)
    src = alloc.alloc(3 * PAGE).to(torch.int64)
    for layer in range(LAYERS):  # every layer, K and V, a different pattern per page and token
        kv_pool.k_buffer[layer][src] = torch.randn(len(src), *kv_pool.k_buffer[layer].shape[1:], device=device)
        kv_pool.v_buffer[layer][src] = torch.randn(len(src), *kv_pool.v_buffer[layer].shape[1:], device=device)
    want = [(kv_pool.k_buffer[la][src].clone(), kv_pool.v_buffer[la][src].clone()) for la in range(LAYERS)]
    hs = region.alloc(3)
    t = demote_kv(engine, side, src, region, hs)
    engine.wait(t)
    assert t.done and all(t.ok)
    dst = alloc.alloc(3 * PAGE).to(torch.int64)
    for layer in range(LAYERS):  # poisoned first: the load must write every byte
        kv_pool.k_buffer[layer][dst] = poison.value(torch.float32)
        kv_pool.v_buffer[layer][dst] = poison.value(torch.float32)
    t = load_kv(engine, region, hs, side, dst, layerwise=True)
    assert side._busy[int(dst[0]) // PAGE] == 1  # read or written by the transfer: free refuses it
    engine.wait(t)
    assert t.done and all(t.ok) and not any(side._busy.values())
    for layer, (k, v) in enumerate(want):
        assert torch.equal(kv_pool.k_buffer[layer][dst], k) and torch.equal(kv_pool.v_buffer[layer][dst], v)
    assert torch.equal(kv_pool.k_buffer[0][src], want[0][0])  # the source is untouched
    region.slot(hs[1])[5] ^= 0xFF  # a damaged host copy is caught by its checksum
    t = load_kv(engine, region, hs, side, dst)
    engine.wait(t)
    assert t.ok == [True, False, True]
    alloc.free(torch.cat([src, dst]))


def test_t2_moves_refuse_layer_rows_that_do_not_fit_the_envelope():
    alloc, _, side, region, engine = _moves()
    ids = alloc.alloc(PAGE).to(torch.int64)

    class Bad(SGLangKVSide):
        def layer_rows(self):
            return super().layer_rows()[1:]

    bad = Bad(alloc)
    with pytest.raises(InvalidArgumentError) as e:
        demote_kv(engine, bad, ids, region, region.alloc(1))
    assert e.value.arg == "side"


def _host_hit_loads_back(backend, rows, kv_pool, a, monkeypatch, poison):
    """A request for ``a`` + 16 more tokens, whose prefix ``a`` ends at a state only the host tiers hold:
    (with ``poison``, every device page poisoned first, when no KV of ``a`` is on the device) the match
    reports a host hit, ``init_load_back`` scatters the KV back into
    SGLang's per-layer buffers and the state into the request's slot, both checked against the model.
    The request's slot goes back to SGLang afterwards."""
    for layer in range(LAYERS if poison is not None else 0):  # only the load can put the KV back
        kv_pool.k_buffer[layer].copy_(poison.like(kv_pool.k_buffer[layer]))
        kv_pool.v_buffer[layer].copy_(poison.like(kv_pool.v_buffer[layer]))
    toks, n = a + [7] * 16, len(a)
    req = schedule_batch.Req("a2", "", array("q", toks), sampling_params.SamplingParams(max_new_tokens=1))
    req.init_next_round_input(backend)
    assert req.prefix_len == 0 and req.host_hit_length == n and req.mamba_host_hit_length == 1
    got, node = backend.init_load_back(B.InitLoadBackParams(req.best_match_node, req.host_hit_length, req=req))
    assert got == n and req.kv.mamba_pool_idx is not None
    while not req.tiered_load_back.done:
        backend.check_hicache_events()
    assert req.tiered_load_back.ok
    ids = backend.path_device_indices(node)
    for layer in range(LAYERS):  # the KV the host held, scattered back into SGLang's per-layer buffers
        assert torch.equal(kv_pool.k_buffer[layer][ids], _kv_of(a, layer, kv_pool))
        assert torch.equal(kv_pool.v_buffer[layer][ids], -_kv_of(a, layer, kv_pool))
    req.prefix_len = n
    req.last_node = node
    req.kv.cache_protected_len = 0
    with monkeypatch.context() as m:
        m.setattr(backend, "prefix_device_indices", lambda r: ids)
        _check_prefix(backend, kv_pool, rows.mamba_pool.mamba_cache, req, toks)  # and the state at n
    rows.mamba_allocator.free(req.kv.mamba_pool_idx.reshape(1))


HOST = {"t1_states": 6, "codec": "lossless", "host_kv_pages": 32, "host_states": 6}


@pytest.mark.parametrize("family", STATE_FAMILIES)
def test_factory_with_t2_serves_a_host_hit_from_sglangs_pools(monkeypatch, poison, family, device):
    rows, alloc, kv_pool = _pools(family, device=device)
    kv_free, slots_free = alloc.available_size(), rows.mamba_allocator.available_size()
    backend = _build(monkeypatch, rows, alloc, HOST)
    stack = backend.stack
    assert stack.host is not None and stack.host.region("full").slot_bytes == stack.kv.entry_bytes
    assert stack.t1.device.type == device
    if device == "cuda":  # T2 is pinned host memory (the copies are DMA on the engine's streams)
        assert all(c.is_pinned() for r in ("full", "state") for c in stack.host.region(r).chunks)
    a = [100 + i for i in range(48)]
    assert _serve(backend, rows, alloc, kv_pool, "a1", a) == 0
    while stack.tree.host_tier.busy:  # write-through backups land
        backend.check_hicache_events()
    assert stack.stats()["transfer"]["d2h_bytes"] > 0
    # SGLang needs the room: the device KV goes, T2 keeps it (SGLang's mamba_num names its own slots, so
    # the tree is asked directly to push its T1 states down to T2 as well)
    assert backend.evict(B.EvictParams(num_tokens=TOKENS)).num_tokens_evicted == 48
    assert stack.tree.evict(EvictParams(mamba_num=8)).mamba_num_evicted >= 1
    assert alloc.available_size() == kv_free
    _host_hit_loads_back(backend, rows, kv_pool, a, monkeypatch, poison)  # every device page is free
    assert stack.stats()["tree"]["state_promotes"] == 1  # the state came back to T1 with the load
    assert _serve(backend, rows, alloc, kv_pool, "a3", a + [8] * 16) == 48  # from the device now (no host hit)
    backend.evict(B.EvictParams(num_tokens=TOKENS))
    assert alloc.available_size() == kv_free and rows.mamba_allocator.available_size() == slots_free
    backend.check_invariants()
    backend.close()


def test_factory_with_t3_serves_a_restarted_server_from_storage(monkeypatch, poison, tmp_path, device):
    """T3 through SGLang's pools: one backend writes its prefix through to a file store and closes (a
    server stopping: its writes in flight land); a fresh backend over fresh SGLang pools, the same store
    and model id (a restarted server) finds the prefix in T3 on the match, fetches it into T2 and loads
    it back into SGLang's pools. Another model id over the same store finds nothing."""
    conf = dict(HOST, storage_url=f"file://{tmp_path / 't3'}", prefetch_policy="wait_complete", model_id="m")
    rows, alloc, kv_pool = _pools(device=device)
    first = _build(monkeypatch, rows, alloc, conf)
    a = [100 + i for i in range(48)]
    assert _serve(first, rows, alloc, kv_pool, "a1", a) == 0
    while first.stack.tree.host_tier.busy:  # write-through backups land, then go on to T3
        first.check_hicache_events()
    written = first.stack.stats()["tree"]
    assert written["t3_kv_pages_written"] == 3 and written["t3_states_written"] >= 1, written
    first.close()
    rows, alloc, kv_pool = _pools(device=device)
    kv_free, slots_free = alloc.available_size(), rows.mamba_allocator.available_size()
    other = _build(monkeypatch, rows, alloc, dict(conf, model_id="another model"))
    req = schedule_batch.Req("x", "", array("q", a + [7] * 16), sampling_params.SamplingParams(max_new_tokens=1))
    req.init_next_round_input(other)
    assert req.prefix_len == 0 and req.host_hit_length == 0  # its keys name another model
    other.close()
    again = _build(monkeypatch, rows, alloc, conf)
    _host_hit_loads_back(again, rows, kv_pool, a, monkeypatch, poison)
    tree, storage = again.stack.stats()["tree"], again.stack.stats()["storage"]
    assert tree["t3_hits"] == 1 and tree["t3_hit_tokens"] == 48, tree
    assert storage["hit"] >= 4, storage
    again.evict(B.EvictParams(num_tokens=TOKENS))
    assert alloc.available_size() == kv_free and rows.mamba_allocator.available_size() == slots_free
    again.check_invariants()
    again.close()


def _on_host(monkeypatch, rows, alloc, kv_pool, turns):
    """A backend with T2 (``HOST``) that served ``turns`` (token lists, in order), their backups landed."""
    backend = _build(monkeypatch, rows, alloc, HOST)
    for i, toks in enumerate(turns):
        _serve(backend, rows, alloc, kv_pool, f"t{i}", toks)
        while backend.stack.tree.host_tier.busy:  # write-through backups land
            backend.check_hicache_events()
    return backend


@pytest.mark.parametrize("damaged", ["kv", "state"])
def test_a_host_copy_that_fails_its_checksum_loads_nothing(monkeypatch, damaged, device):
    """SGLang runs the forward over what ``init_load_back`` reports as soon as it returns, so a host copy
    that fails its checksum must be caught before: the load is reported as 0 tokens (SGLang's
    all-or-none rule), the damaged copy is dropped and the slot the load took goes back. What the host
    still holds intact (the prefix up to the chunk checkpoint at 32) is offered next and loads exactly."""
    rows, alloc, kv_pool = _pools(device=device)
    kv_free, slots_free = alloc.available_size(), rows.mamba_allocator.available_size()
    a = [100 + i for i in range(48)]
    backend = _on_host(monkeypatch, rows, alloc, kv_pool, [a])
    tree = backend.stack.tree
    backend.evict(B.EvictParams(num_tokens=TOKENS))
    tree.evict(EvictParams(mamba_num=8))  # the state to T2 as well
    toks = a + [7] * 16
    req = schedule_batch.Req("a2", "", array("q", toks), sampling_params.SamplingParams(max_new_tokens=1))
    req.init_next_round_input(backend)
    best = req.best_match_node
    assert req.host_hit_length == 48 and req.mamba_host_hit_length == 1
    if damaged == "kv":
        backend.stack.host.region("full").slot(best.host_kv[-1])[5] ^= 0xFF
    else:
        tree.state_region.slot(best.payload.state_host)[5] ^= 0xFF
    assert backend.init_load_back(B.InitLoadBackParams(best, req.host_hit_length, req=req)) == (0, req.last_node)
    assert req.kv.mamba_pool_idx is None and rows.mamba_allocator.available_size() == slots_free
    assert tree.stats[f"corrupt_host_{damaged}_dropped"] == 1
    backend.check_invariants()
    # the pages before the damaged one loaded fine and stay on the device: no poison
    _host_hit_loads_back(backend, rows, kv_pool, a[:CHUNK], monkeypatch, None)
    backend.evict(B.EvictParams(num_tokens=TOKENS))
    assert alloc.available_size() == kv_free and rows.mamba_allocator.available_size() == slots_free
    backend.close()


def test_a_failed_load_below_a_device_prefix_gives_the_slot_that_prefix_state_again(monkeypatch, device):
    """The request resumes on the device at 48 (its slot holds the state at 48, copied by the match) and
    the next 64 tokens are on the host only; their copy fails its checksum after the load started writing
    the state at 112 into the slot. The load reports 0 tokens and the slot holds the state at 48 again,
    bit for bit: SGLang goes on from 48."""
    rows, alloc, kv_pool = _pools(device=device)
    a, b = [100 + i for i in range(48)], [300 + i for i in range(64)]
    backend = _on_host(monkeypatch, rows, alloc, kv_pool, [a, a + b])
    tree = backend.stack.tree
    assert backend.evict(B.EvictParams(num_tokens=64)).num_tokens_evicted == 64  # LRU: the tail a + b
    toks = a + b + [7] * 16
    req = schedule_batch.Req("c", "", array("q", toks), sampling_params.SamplingParams(max_new_tokens=1))
    req.init_next_round_input(backend)
    assert req.prefix_len == 48 and req.host_hit_length == 64 and req.kv.mamba_pool_idx is not None
    best = req.best_match_node
    backend.stack.host.region("full").slot(best.host_kv[0])[5] ^= 0xFF
    req.lock = backend.lock(req.last_node)  # SGLang's admission pins the device prefix meanwhile
    assert backend.init_load_back(B.InitLoadBackParams(best, req.host_hit_length, req=req)) == (0, req.last_node)
    assert tree.stats["corrupt_host_kv_dropped"] == 1
    _check_prefix(backend, kv_pool, rows.mamba_pool.mamba_cache, req, toks)  # the KV and state at 48
    backend.unlock(req.lock)
    rows.mamba_allocator.free(req.kv.mamba_pool_idx.reshape(1))
    backend.check_invariants()
    backend.close()
