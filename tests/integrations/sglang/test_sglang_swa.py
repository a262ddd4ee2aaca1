"""The backend for an SWA hybrid (full-attention + sliding-window layers) over SGLang 0.5.23's real SWA
pools on CPU and on CUDA (``SWATokenToKVPoolAllocator`` over an ``SWAKVPool``), built through SGLang's registry and
driven in its scheduler's order, with SGLang's own sliding-window frees during decode: resumed prefixes
hold the exact full KV and the exact SWA KV of their window, SGLang's full-to-SWA mapping stays the
tree's, nothing leaks, and what is not built is a typed error."""

from __future__ import annotations

import random
import types

import pytest
import torch

from tests.support.sglang_util import (
    PAGE,
    SWA_TOKENS,
    TOKENS,
    WINDOW,
    _build,
    _build_swa,
    _check_swa_mapping,
    _pools,
    _serve_swa,
    _swa_pools,
    backend_pkg,
)
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.integrations.sglang.backend import TieredRadixCache

B = pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")

A = [random.Random(1).randrange(1, 1000) for _ in range(100)]


def _drain(backend, alloc):
    """Evict everything: both pools back to their free counts, the mapping all 0."""
    backend.evict(B.EvictParams(num_tokens=alloc.size_full, swa_num_tokens=alloc.size_swa))
    assert alloc.full_available_size() == alloc.size_full and alloc.swa_available_size() == alloc.size_swa
    assert not bool((alloc.full_to_swa_index_mapping[:-1] != 0).any())
    backend.check_invariants()


@pytest.mark.parametrize("shield", [False, True])
def test_multi_turn_resumes_with_the_exact_swa_window(monkeypatch, shield, device):
    """``shield``: SGLang's prefill-aware SWA keeps the page [32, 48) of turn 1's prompt live below pages
    it freed; the backend frees it when the tree caches the span as a tombstone (the same tree results)."""
    rows, alloc, pool = _swa_pools(device=device)
    backend = _build_swa(monkeypatch, rows, alloc)
    assert backend.supports_swa() and not backend.supports_mamba() and backend.swa_retain_window == WINDOW
    # turn 1: a 40-token prompt (checkpoints at 32 and 40) and 60 decode steps, SGLang freeing the SWA KV
    # that slid out of the window above the tree's prefix: [32, 64) is cached as an SWA tombstone
    assert _serve_swa(backend, rows, alloc, pool, "t1", A, 40, shield) == 0
    assert _check_swa_mapping(backend, alloc) == (96, 64)  # full KV of [0, 96), SWA KV of [0, 32) + [64, 96)
    backend.check_invariants()
    # turn 2: the conversation goes on; it resumes at the last whole page, its window [72, 96) on the device
    assert _serve_swa(backend, rows, alloc, pool, "t2", A + [7] * 30, 130) == 96
    _check_swa_mapping(backend, alloc)
    # a request sharing 70 tokens cannot resume at 64: the window before 64 was freed (tombstone); it
    # resumes at 32 and its prefill puts SWA KV back under the tombstone, the tree keeping its full ids
    full, swa = _check_swa_mapping(backend, alloc)
    assert _serve_swa(backend, rows, alloc, pool, "t3", A[:70] + [3] * 20, 90) == 32
    assert _check_swa_mapping(backend, alloc) == (full + 16, swa + 32 + 16)  # [32, 64) and t3's own page
    # ... so now 64 is a resume point, its window read through SGLang's mapping exact
    assert _serve_swa(backend, rows, alloc, pool, "t4", A[:64] + [5] * 20, 84) == 64
    _check_swa_mapping(backend, alloc)
    backend.check_invariants()
    _drain(backend, alloc)
    backend.close()


def test_without_the_remap_the_mapping_and_the_resumed_window_go_wrong(monkeypatch, device):
    """Control: the same turns with the backend's remap after an insert left out: a tombstone that takes
    the request's SWA KV keeps its own full ids, which SGLang's mapping then does not pair with it."""
    rows, alloc, pool = _swa_pools(device=device)
    backend = _build_swa(monkeypatch, rows, alloc)
    monkeypatch.setattr(TieredRadixCache, "_swa_remap", lambda self, node, old, new: None)
    _serve_swa(backend, rows, alloc, pool, "t1", A, 40)
    _serve_swa(backend, rows, alloc, pool, "t3", A[:70] + [3] * 20, 90)
    with pytest.raises(AssertionError):
        _check_swa_mapping(backend, alloc)
    with pytest.raises(AssertionError):
        _serve_swa(backend, rows, alloc, pool, "t4", A[:64] + [5] * 20, 84)


# (SWA pages, full pages, T2 KV pages) of the random turns: the SWA pool short (tombstones, leaves
# dropped), the full pool short with T2 (full KV demoted with its SWA KV), the SWA pool short with T2
# (SWA eviction demotes what T2 holds)
POOLS = {"swa": (10, 14, 0), "full+host": (24, 12, 64), "swa+host": (10, 24, 64)}


def _random_turns(monkeypatch, seed: int, mode: str, device: str):
    """Conversations that go on, branch and start afresh (a request takes up to 9 pages; half of them
    with SGLang's prefill shield) over the pools of ``POOLS[mode]``: SGLang's allocator evicts through
    the backend every few requests. After each request: the resumed prefix exact with every free page
    NaN (``_serve_swa``), the mapping the tree's, the tree's invariants; at the end both pools back to
    their free counts. -> (SGLang's eviction results, the tree's stats)."""
    rng = random.Random(seed)
    swa_pages, full_pages, host_pages = POOLS[mode]
    rows, alloc, pool = _swa_pools(swa_pages * PAGE, full_pages * PAGE, device)
    backend = _build_swa(monkeypatch, rows, alloc, {"host_kv_pages": host_pages} if host_pages else {})
    convs: list[list[int]] = []
    evictions = []
    evict = backend.evict
    backend.evict = lambda params: evictions.append(evict(params)) or evictions[-1]  # SGLang's calls, counted
    for i in range(14):
        pick = rng.random()
        if convs and pick < 0.5:  # the conversation goes on
            c = rng.choice(convs)
            toks = c + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 40))]
        elif convs and pick < 0.75:  # a branch off a cached conversation
            c = rng.choice(convs)
            toks = c[:rng.randrange(1, len(c))] + [rng.randrange(1, 1000) for _ in range(rng.randrange(8, 40))]
        else:
            toks = [rng.randrange(1, 1000) for _ in range(rng.randrange(20, 60))]
        toks = toks[:140]
        _serve_swa(backend, rows, alloc, pool, f"r{i}", toks, max(1, len(toks) - rng.randrange(0, 60)),
                   shield=rng.random() < 0.5)
        convs.append(toks)
        _check_swa_mapping(backend, alloc)
        backend.check_invariants()
    stats = dict(backend.cache.stats)
    _drain(backend, alloc)
    backend.close()
    return evictions, stats


@pytest.mark.parametrize("mode", list(POOLS))
@pytest.mark.parametrize("seed", range(4))
def test_random_turns_under_swa_pressure_evict_and_leak_nothing(monkeypatch, seed, mode, device):
    """``_random_turns``; the pool ``mode`` names was short, and with T2 it was used (host hits
    themselves: most seeds here, and the T2 tests below)."""
    evictions, stats = _random_turns(monkeypatch, seed, mode, device)
    if mode == "full+host":
        assert stats["backups"] > 0 and sum(r.num_tokens_evicted for r in evictions) > 0
    else:
        assert sum(r.swa_num_tokens_evicted for r in evictions) > 0
    if mode == "swa+host":
        assert stats["swa_demotes"] > 0


def _old_free_pages_oracle(monkeypatch) -> list[int]:
    """Every SWA free through ``SGLangSWASide.free_pages`` is also done the old way, on a copy of the
    mapping before it (every entry of the whole mapping pointing into a freed page cleared), and the two
    mappings must be equal. -> pages checked, per free."""
    from tiered_cache.integrations.sglang.t0_swa import SGLangSWASide

    checked: list[int] = []
    reverse_index = SGLangSWASide.free_pages

    def free_pages(self, pages):
        m = self._mapping[:-1]
        want = m.clone()
        if pages:
            want[torch.isin(want // self.page_size, torch.tensor(pages, device=m.device)) & (want > 0)] = 0
        reverse_index(self, pages)
        assert torch.equal(m, want), "the reverse index unmapped other full ids than the whole-mapping scan"
        checked.append(len(pages))

    monkeypatch.setattr(SGLangSWASide, "free_pages", free_pages)
    return checked


@pytest.mark.parametrize("mode", list(POOLS))
@pytest.mark.parametrize("seed", range(3))
def test_swa_frees_through_the_reverse_index_equal_the_whole_mapping_scan(monkeypatch, seed, mode, device):
    """Property: over random turns in every pool ``mode`` (SWA tombstones, leaves dropped, duplicates
    freed at insert, demotions, loads back), each SWA free's mapping equals the old method's (a scan of
    SGLang's whole mapping, O(pool) on the GPU per free), though the side reads only the freed pages'
    noted full pages."""
    checked = _old_free_pages_oracle(monkeypatch)
    _random_turns(monkeypatch, seed, mode, device)
    assert sum(checked) > 0


def test_without_the_pairs_the_reverse_index_misses_mapped_full_ids(monkeypatch):
    """Control: with ``pair`` a no-op (nothing noted), the first SWA eviction leaves the evicted pages'
    full ids mapped, which the whole-mapping scan unmaps."""
    from tiered_cache.integrations.sglang.t0_swa import SGLangSWASide

    _old_free_pages_oracle(monkeypatch)
    monkeypatch.setattr(SGLangSWASide, "pair", lambda self, full, swa: None)
    rows, alloc, pool = _swa_pools()
    backend = _build_swa(monkeypatch, rows, alloc)
    _serve_swa(backend, rows, alloc, pool, "t1", A[:64], 64)
    with pytest.raises(AssertionError, match="reverse index"):
        backend.evict(B.EvictParams(num_tokens=0, swa_num_tokens=PAGE))


def test_swa_eviction_tombstones_through_sglangs_allocator(monkeypatch, device):
    """``evict(swa_num_tokens=)`` frees SWA pages through SGLang's SWA allocator and unmaps their full ids;
    the full KV stays cached (a longer match still uses it) and a leaf goes whole."""
    rows, alloc, pool = _swa_pools(device=device)
    backend = _build_swa(monkeypatch, rows, alloc)
    _serve_swa(backend, rows, alloc, pool, "t1", A[:64], 64)  # two nodes: [0, 32) and [32, 64)
    full, swa = _check_swa_mapping(backend, alloc)
    assert (full, swa) == (64, 64) and backend.swa_evictable_size() == 64
    r = backend.evict(B.EvictParams(num_tokens=0, swa_num_tokens=PAGE))
    assert r.swa_num_tokens_evicted >= PAGE
    full2, swa2 = _check_swa_mapping(backend, alloc)
    assert swa2 == swa - r.swa_num_tokens_evicted and alloc.swa_available_size() == SWA_TOKENS - swa2
    backend.check_invariants()
    _drain(backend, alloc)


def test_t2_demotes_and_loads_back_the_swa_window(monkeypatch, device):
    """T2 (``host_kv_pages``): a conversation written through to the host, evicted from the device
    (its full and SWA pages given back to SGLang, their mapping cleared), then resumed: the match is a
    host hit, ``init_load_back`` loads the full pages and the SWA pages of the nodes that had them
    (a tombstone comes back full KV only) into fresh pages of SGLang's pools, sets SGLang's mapping for
    them, and the resumed prefix and its window are exact with every free page NaN."""
    rows, alloc, pool = _swa_pools(device=device)
    backend = _build_swa(monkeypatch, rows, alloc, {"host_kv_pages": 32})
    _serve_swa(backend, rows, alloc, pool, "t1", A, 40)  # [0, 32) SWA, [32, 64) tombstone, [64, 96) SWA
    assert backend.cache.stats["backups"] > 0
    backend.evict(B.EvictParams(num_tokens=TOKENS))  # to the host: nothing of it on the device
    assert alloc.full_available_size() == TOKENS and alloc.swa_available_size() == SWA_TOKENS
    assert not bool((alloc.full_to_swa_index_mapping[:-1] != 0).any())
    assert _serve_swa(backend, rows, alloc, pool, "t2", A + [7] * 30, 130) == 96  # a host hit of 96
    assert backend.cache.stats["load_backs"] == 1
    _check_swa_mapping(backend, alloc)
    backend.check_invariants()
    _drain(backend, alloc)
    backend.close()


@pytest.mark.parametrize("demote", [True, False])
def test_swa_pressure_keeps_a_written_through_conversation_as_a_host_hit(monkeypatch, demote, device):
    """SGLang's allocator short of SWA pages (``reclaim_for_prealloc`` asking for the whole SWA pool): the
    tree's SWA eviction demotes the leaf [64, 96), whose full and SWA KV were written through to T2 (its
    device pages back to SGLang, its mapping cleared, the node kept on the host), and tombstones [0, 32)
    (its child still on the device). The next turn is a 96-token host hit: ``init_load_back`` brings the
    leaf's full KV and the SWA KV of its window back into fresh pages of SGLang's pools, exact with every
    free page NaN. Control (``demote`` False: every node taken as not backed up, the old rule): the leaf
    goes whole with its T2 copy, the tombstones above it with it, and the next turn finds nothing."""
    from tiered_cache.radix.swa_rule import SWARule

    if not demote:
        monkeypatch.setattr(SWARule, "_backed", staticmethod(lambda x: False))
    rows, alloc, pool = _swa_pools(device=device)
    backend = _build_swa(monkeypatch, rows, alloc, {"host_kv_pages": 32})
    _serve_swa(backend, rows, alloc, pool, "t1", A, 40)  # [0, 32) SWA, [32, 64) tombstone, [64, 96) SWA
    assert backend.cache.stats["backups"] > 0
    assert alloc.reclaim_for_prealloc(backend, 0, SWA_TOKENS) is None  # SGLang's SWA shortfall, evicted
    assert alloc.swa_available_size() == SWA_TOKENS
    assert backend.cache.stats["swa_demotes"] == int(demote)
    assert alloc.full_available_size() == (TOKENS - 64 if demote else TOKENS)  # [0, 64) stays as tombstones
    assert _check_swa_mapping(backend, alloc) == ((64, 0) if demote else (0, 0))
    backend.check_invariants()
    assert _serve_swa(backend, rows, alloc, pool, "t2", A + [7] * 30, 130) == (96 if demote else 0)
    assert backend.cache.stats["load_backs"] == int(demote)
    _check_swa_mapping(backend, alloc)
    backend.check_invariants()
    _drain(backend, alloc)
    backend.close()


def test_without_the_remap_after_a_load_the_loaded_window_is_not_sglangs(monkeypatch, device):
    """Control: the T2 test with the backend's remap left out: the loaded full pages map to no SWA page,
    so the window SGLang would read is not the one loaded."""
    rows, alloc, pool = _swa_pools(device=device)
    backend = _build_swa(monkeypatch, rows, alloc, {"host_kv_pages": 32})
    _serve_swa(backend, rows, alloc, pool, "t1", A, 40)
    backend.evict(B.EvictParams(num_tokens=TOKENS))
    monkeypatch.setattr(TieredRadixCache, "_swa_remap", lambda self, node, old, new: None)
    with pytest.raises(AssertionError, match="no SWA KV"):
        _serve_swa(backend, rows, alloc, pool, "t2", A + [7] * 30, 130)


# ----------------------------------------------------------------------------- refusals
def test_swa_refusals_are_typed_errors_naming_the_field(monkeypatch):
    rows, alloc, _ = _swa_pools()
    with pytest.raises(InvalidArgumentError) as e:  # T3
        _build_swa(monkeypatch, rows, alloc, {"storage_url": "file:///tmp/x", "model_id": "m"})
    assert e.value.arg == "storage_url"
    with pytest.raises(InvalidArgumentError) as e:  # SWA + mamba
        _build(monkeypatch, rows, alloc, {}, {"sliding_window_size": WINDOW}, is_hybrid_swa=True, is_hybrid_ssm=True)
    assert e.value.arg == "ctx.is_hybrid_ssm"
    group = types.SimpleNamespace(cpu_group=object())
    with pytest.raises(InvalidArgumentError) as e:
        _build(monkeypatch, rows, alloc, {}, {"sliding_window_size": WINDOW}, is_hybrid_swa=True, is_hybrid_ssm=False,
               tp_size=2, tp_group=group)
    assert e.value.arg == "ctx.tp_size"
    with pytest.raises(InvalidArgumentError) as e:  # no window
        _build(monkeypatch, rows, alloc, {}, {}, is_hybrid_swa=True, is_hybrid_ssm=False)
    assert e.value.arg == "ctx.params.sliding_window_size"
    prows, palloc, _ = _pools()
    with pytest.raises(InvalidTypeError) as e:  # a plain paged allocator
        _build(monkeypatch, prows, palloc, {}, {"sliding_window_size": WINDOW}, is_hybrid_swa=True,
               is_hybrid_ssm=False)
    assert e.value.arg == "ctx.params.token_to_kv_pool_allocator"
    assert alloc.full_available_size() == TOKENS and alloc.swa_available_size() == SWA_TOKENS
    assert backend_pkg.BACKEND_NAME
