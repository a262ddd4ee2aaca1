"""The backend against SGLang 0.5.23's own definitions, read from the installed wheel: every abstract
method of ``BasePrefixCache`` (and every helper the base leaves unimplemented that the scheduler
calls) is defined with a signature that takes every call SGLang's takes, and every field SGLang's
scheduler reads off a ``MatchResult`` is produced, with SGLang's types.

SGLang is installed by scripts/setup.sh for the test extra (constraints/sglang-test.txt); where it is
absent (Python 3.10) the module skips."""

from __future__ import annotations

import ast
import inspect
import textwrap
from array import array

import pytest
import torch

B = pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")
common = pytest.importorskip("sglang.srt.mem_cache.common")
sgl_radix = pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from tiered_cache import CacheConfig, KVSpec, StateSpec, TieredCache  # noqa: E402
from tiered_cache.integrations.sglang import TieredRadixCache  # noqa: E402
from tiered_cache.radix import InsertParams, RadixKey  # noqa: E402

# Unimplemented in the base and left so here, with why: the scheduler calls them only on paths this
# backend does not enable (HiCache's controller, debugging dumps).
LEFT_UNIMPLEMENTED = {
    "ready_to_load_host_cache": "HiCache's cache controller only (cache_controller stays None)",
    "pretty_print": "a debugging dump",
}


def _raises_not_implemented(fn) -> bool:
    """The function's own body is (after a docstring) ``raise NotImplementedError``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    body = tree.body[0].body
    body = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in ast.unparse(body[0])


def _takes_every_call(ours: inspect.Signature, theirs: inspect.Signature) -> list[str]:
    """What a call valid for ``theirs`` could pass that ``ours`` refuses (empty: compatible)."""
    problems = []
    mine = ours.parameters
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in mine.values())
    for name, p in theirs.parameters.items():
        if p.kind is p.VAR_KEYWORD:
            if not has_var_kw:
                problems.append("**kwargs missing")
            continue
        q = mine.get(name)
        if q is None:
            problems.append(f"parameter {name!r} missing")
        elif q.kind is not p.kind:
            problems.append(f"parameter {name!r} is {q.kind.name}, SGLang's {p.kind.name}")
        elif p.default is not p.empty and q.default is q.empty:
            problems.append(f"parameter {name!r} has no default, SGLang's has one")
    for name, q in mine.items():
        if name not in theirs.parameters and q.default is q.empty and q.kind not in (q.VAR_KEYWORD, q.VAR_POSITIONAL):
            problems.append(f"extra parameter {name!r} without a default")
    return problems


def test_every_abstract_method_is_defined_with_a_compatible_signature():
    abstract = sorted(B.BasePrefixCache.__abstractmethods__)
    assert {"reset", "match_prefix", "checkpoint", "evict", "inc_lock_ref", "dec_lock_ref"} <= set(abstract)
    assert TieredRadixCache.__abstractmethods__ == frozenset()
    for name in abstract:
        assert name in TieredRadixCache.__dict__, name
        problems = _takes_every_call(inspect.signature(getattr(TieredRadixCache, name)),
                                     inspect.signature(getattr(B.BasePrefixCache, name)))
        assert problems == [], (name, problems)


def test_every_helper_the_base_leaves_unimplemented_is_defined():
    """``path_device_indices`` (read by ``prefix_device_indices``), ``init_load_back``, ``total_size``,
    ``check_hicache_events``: the base raises NotImplementedError; the backend must not."""
    todo = [n for n, f in vars(B.BasePrefixCache).items() if inspect.isfunction(f) and _raises_not_implemented(f)]
    assert {"path_device_indices", "init_load_back", "total_size"} <= set(todo)
    for name in todo:
        if name in LEFT_UNIMPLEMENTED:
            continue
        assert name in TieredRadixCache.__dict__, name
        problems = _takes_every_call(inspect.signature(getattr(TieredRadixCache, name)),
                                     inspect.signature(getattr(B.BasePrefixCache, name)))
        assert problems == [], (name, problems)


def _fields_read(fn, var: str) -> set[str]:
    """Attribute names read off ``var`` in ``fn``'s source (what SGLang's code takes from a result)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == var}


def _cache() -> TieredCache:
    kv = KVSpec(num_layers=2, kv_heads=1, head_dim=8, dtype=torch.float32)
    state = StateSpec(num_layers=2, temporal_shape=(1, 4, 4), temporal_dtype=torch.float32,
                      conv_shapes=((8, 3),), conv_dtype=torch.float32, value_axis=2)
    cfg = CacheConfig(page_size=16, kv_pages=16, t0_states=4, t1_states=4, codec="lossless", check_memory=False)
    return TieredCache.build(cfg, kv=kv, state=state, device="cpu")


def _backend(cache: TieredCache) -> TieredRadixCache:
    return TieredRadixCache(cache.tree, req_to_token_pool=None, token_to_kv_pool_allocator=None, page_size=16)


def _insert(cache: TieredCache, toks: list[int]) -> torch.Tensor:
    ids = cache.alloc_kv(len(toks))
    slot = cache.alloc_states(1)
    cache.tree.insert(InsertParams(key=RadixKey(toks), value=ids, mamba_value=slot))
    cache.states.free(slot)
    return ids


def test_match_result_has_every_field_the_scheduler_reads_with_sglangs_types():
    read = _fields_read(common.match_kv_cache, "match_result")
    assert {"device_prefix_len", "last_device_node", "best_match_node", "host_hit_length"} <= read
    assert read <= set(B.MatchResult._fields), read - set(B.MatchResult._fields)
    with _cache() as cache:
        backend = _backend(cache)
        toks = list(range(100, 148))
        ids = _insert(cache, toks)
        key = sgl_radix.RadixKey(array("q", toks + [7, 8, 9]), extra_key=None)
        r = backend.match_prefix(B.MatchPrefixParams(key=key))
        assert type(r) is B.MatchResult
        assert r.device_prefix_len == 48 and isinstance(r.device_prefix_len, int)
        assert r.full_kv_hit_length == 48
        for name in ("host_hit_length", "swa_host_hit_length", "mamba_host_hit_length"):
            assert getattr(r, name) == 0 and isinstance(getattr(r, name), int), name
        assert torch.equal(backend.path_device_indices(r.last_device_node)[:r.device_prefix_len], ids)
        zero = B.zero_match_result(backend, r)  # SGLANG_RADIX_FORCE_MISS: _replace on 0.5.23's names
        assert zero.device_prefix_len == 0 and zero.last_device_node is backend.root_node
        # limit cuts the key (SGLang re-prefills a tail): 32 tokens of KV match, and no state is cached
        # at 32, so a hybrid model resumes at 0; another cache_salt shares nothing
        cut = backend.match_prefix(B.MatchPrefixParams(key=sgl_radix.RadixKey(array("q", toks), limit=40)))
        assert (cut.device_prefix_len, cut.full_kv_hit_length) == (0, 32)
        salted = backend.match_prefix(B.MatchPrefixParams(key=sgl_radix.RadixKey(array("q", toks), cache_salt="s")))
        assert salted.device_prefix_len == 0
        cache.check_invariants()


def test_evict_and_locks_take_and_return_sglangs_types():
    with _cache() as cache:
        backend = _backend(cache)
        _insert(cache, list(range(100, 132)))
        node = backend.match_prefix(B.MatchPrefixParams(key=sgl_radix.RadixKey(array("q", range(100, 132))))) \
            .last_device_node
        lock = backend.lock(node)  # the base's helper over our inc_lock_ref
        assert isinstance(lock, B.TreeLock) and isinstance(lock.receipt, B.DecLockRefParams)
        assert backend.full_protected_size() == 32 and backend.full_evictable_size() == 0
        r = backend.evict(B.EvictParams(num_tokens=16))  # SGLang's object: no host_* fields
        assert type(r) is B.EvictResult and r.num_tokens_evicted == 0  # locked: nothing to evict
        backend.unlock(lock)
        assert backend.full_protected_size() == 0 and backend.full_evictable_size() == 32
        free = cache.free_sizes()["t0_kv"]
        r = backend.evict(B.EvictParams(num_tokens=16))
        assert r.num_tokens_evicted >= 16 and cache.free_sizes()["t0_kv"] == free + r.num_tokens_evicted
        backend.reset()
        assert backend.full_evictable_size() == 0
        cache.check_invariants()


def test_supports_mamba_and_init_load_back_returns_a_count():
    with _cache() as cache:
        backend = _backend(cache)
        assert backend.supports_mamba() is True and backend.supports_prefix_sharing() is True
        root = backend.root_node
        assert backend.init_load_back(B.InitLoadBackParams(best_match_node=root, host_hit_length=0)) == (0, root)
