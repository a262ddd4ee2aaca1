"""tiered-cache as a radix-cache backend of SGLang 0.5.23 (issue 19; SGLang's interface: ``docs/sglang.md``).

- ``TieredRadixCache`` (``backend.py``): SGLang's ``BasePrefixCache`` over our radix tree; it translates
  SGLang's params, results, keys and ``Req`` to ours and back.
- ``parse_backend_config`` (``config.py``): T1/T2/T3 budgets from a JSON object or file, typed errors
  naming the key; ``TIERED_CACHE_SGLANG_CONFIG`` holds it for ``factory``.
- ``factory(ctx)``: what ``register_radix_cache_backend`` calls with a ``TreeCacheBuildContext``.
- ``register()``: registers ``factory`` under ``BACKEND_NAME`` (``--radix-cache-backend tiered``); once
  per process, a second call does nothing.

- ``t0.py``: ``SGLangKVSide`` (SGLang's paged allocator + MHA KV pool: ids, room, and per-layer page rows
  for the T2 moves), ``SGLangStateSide`` (SGLang's mamba pool + slot allocator: a whole ``StateSide``),
  ``SGLangT0``.
- ``t0_swa.py``: ``SGLangSWASide`` and ``SGLangSWAT0``: an SWA hybrid's full and SWA halves of SGLang's
  ``SWATokenToKVPoolAllocator``, the tree's SWA ids kept what SGLang's full-to-SWA mapping says.

Built: the factory builds T1, T2 (``host_kv_pages`` / ``host_states``; KV pages gathered from and
scattered into SGLang's per-layer buffers), T3 and the tree over SGLang's own pools (``SGLangT0``, no
second T0) through ``TieredCache.build_on``; for an SWA hybrid (full + sliding-window layers) a
``HiSWARadixCache`` over SGLang's SWA allocator (``SGLangSWAT0``) and T2. Not built: the extra mamba
buffer and SGLang's int8 checkpoint pool (refused); for SWA hybrids T3, SWA + mamba, TP, SGLang's
per-request SWA ring and all-SWA allocator (refused; ``docs/sglang.md``, "Left").
"""

from __future__ import annotations

import os
from typing import Any

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.integrations.sglang.backend import TieredRadixCache, salted, tree_key
from tiered_cache.integrations.sglang.config import KEYS, BackendConfig, parse_backend_config

BACKEND_NAME = "tiered"
CONFIG_ENV = "TIERED_CACHE_SGLANG_CONFIG"

__all__ = ["BACKEND_NAME", "CONFIG_ENV", "KEYS", "BackendConfig", "TieredRadixCache", "factory",
           "parse_backend_config", "register", "salted", "tree_key"]


def check_context(ctx: Any) -> BackendConfig:
    """The refusals of ``factory``, before anything is built: a typed error naming the context field."""
    if int(ctx.tp_size) > 1 and getattr(ctx.tp_group, "cpu_group", None) is None:
        # every rank must make the same tree decisions: they agree over the TP group's gloo group
        raise InvalidArgumentError("ctx.tp_group", "SGLang's GroupCoordinator of the TP ranks (with its cpu_group)",
                                   ctx.tp_group)
    if ctx.is_hybrid_swa and ctx.is_hybrid_ssm:
        raise InvalidArgumentError("ctx.is_hybrid_ssm", "False with is_hybrid_swa (SWA + mamba is not built yet)",
                                   True)
    if ctx.is_hybrid_swa and int(ctx.tp_size) > 1:
        raise InvalidArgumentError("ctx.tp_size", "1 for an SWA hybrid (its TP agreement is not built yet)",
                                   ctx.tp_size)
    if not ctx.is_hybrid_ssm and not ctx.is_hybrid_swa:
        raise InvalidArgumentError("ctx.is_hybrid_ssm", "True (a hybrid model with recurrent states or SWA layers)",
                                   False)
    if ctx.disable_radix_cache:
        raise InvalidArgumentError("ctx.disable_radix_cache", "False (a disabled cache needs no backend)", True)
    return parse_backend_config(os.environ.get(CONFIG_ENV), CONFIG_ENV)


def factory(ctx: Any) -> TieredRadixCache:
    """SGLang's ``RadixCacheFactory``: checks ``ctx`` and the backend config (``check_context``), adapts
    SGLang's pools in ``ctx.params`` to T0 (``SGLangT0``: SGLang's memory, no copy) and builds T1 and the
    tree above it with ``TieredCache.build_on``. Refusals are typed errors naming the field or key."""
    from tiered_cache.integrations.sglang.t0 import SGLangKVSide, SGLangStateSide, SGLangT0
    from tiered_cache.parallel import TPGroup
    from tiered_cache.stack import TieredCache

    conf = check_context(ctx)
    params = ctx.params
    if ctx.is_hybrid_swa:
        return swa_factory(params, conf)
    if getattr(params, "enable_mamba_extra_buffer", False):
        raise InvalidArgumentError("ctx.params.enable_mamba_extra_buffer",
                                   "False (the ping-pong track buffers are not read yet)", True)
    rows, allocator = params.req_to_token_pool, params.token_to_kv_pool_allocator
    if getattr(rows, "mamba_pool", None) is None or getattr(rows, "mamba_allocator", None) is None:
        raise InvalidTypeError("ctx.params.req_to_token_pool", "SGLang's HybridReqToTokenPool (a mamba pool)",
                               type(rows).__name__)
    if getattr(rows, "mamba_ckpt_pool", None) is not None:  # --enable-int8-mamba-checkpoint
        raise InvalidArgumentError("ctx.params.req_to_token_pool.mamba_ckpt_pool",
                                   "None (SGLang's int8 checkpoint pool: our T1 is the int8 tier)", "a pool")
    siblings = getattr(rows.mamba_pool, "_slot_siblings", ())
    if siblings:  # per-slot side states (Qwen4-Exp's short convs, n-gram context): T1 would not copy them
        raise InvalidArgumentError("ctx.params.req_to_token_pool.mamba_pool",
                                   "a mamba pool with no per-slot side states (they are not cached yet)",
                                   [type(x).__name__ for x in siblings])
    kv = SGLangKVSide(allocator)
    states = SGLangStateSide(rows.mamba_pool, rows.mamba_allocator)
    if int(params.page_size) != kv.page_size:
        raise InvalidArgumentError("ctx.params.page_size", f"the KV allocator's page size {kv.page_size}",
                                   params.page_size)
    cfg = conf.cache_config(page_size=kv.page_size, kv_pages=kv.capacity - 1, t0_states=states.capacity - 1)
    # Under TP each rank's pools hold its share of the heads already; the ranks' trees agree once per
    # step over the group's gloo group (host votes, as SGLang's own HiCache agrees), T3 keys name the rank
    tp = TPGroup(int(ctx.tp_rank), int(ctx.tp_size), ctx.tp_group.cpu_group) if int(ctx.tp_size) > 1 else None
    stack = TieredCache.build_on(cfg, SGLangT0(kv, states), model_id=conf.model_id, tp=tp)
    return TieredRadixCache(stack.tree, req_to_token_pool=rows, token_to_kv_pool_allocator=allocator,
                            page_size=kv.page_size, disable=bool(params.disable), stack=stack)


def swa_factory(params: Any, conf: BackendConfig) -> TieredRadixCache:
    """``factory`` for an SWA hybrid: a ``HiSWARadixCache`` over SGLang's ``SWATokenToKVPoolAllocator``
    (``SGLangSWAT0``), its window SGLang's retain window, and T2 as the config asks; T3 refused (a typed
    error naming the key)."""
    from tiered_cache.integrations.sglang.t0_swa import SGLangSWAT0
    from tiered_cache.stack import TieredCache

    allocator = params.token_to_kv_pool_allocator
    if not hasattr(allocator, "full_to_swa_index_mapping") or not hasattr(allocator, "full_attn_allocator"):
        raise InvalidTypeError("ctx.params.token_to_kv_pool_allocator", "SGLang's SWATokenToKVPoolAllocator",
                               type(allocator).__name__)
    if allocator.full_attn_allocator is allocator.swa_attn_allocator or getattr(allocator, "swa_req_ring", False):
        raise InvalidArgumentError("ctx.params.token_to_kv_pool_allocator",
                                   "separate paged full and SWA pools (not the all-SWA allocator or the per-request "
                                   "SWA ring)", type(allocator).__name__)
    window = params.swa_retain_window
    if window is None:
        raise InvalidArgumentError("ctx.params.sliding_window_size", "the model's window (an int >= 1)", None)
    if conf.tiers.get("storage_url") is not None:
        raise InvalidArgumentError("storage_url", "None for an SWA hybrid (its T3 is not built yet)",
                                   conf.tiers["storage_url"])
    t0 = SGLangSWAT0(allocator, window)
    kv = t0.side("full")
    if int(params.page_size) != kv.page_size:
        raise InvalidArgumentError("ctx.params.page_size", f"the KV allocator's page size {kv.page_size}",
                                   params.page_size)
    cfg = conf.cache_config(page_size=kv.page_size, kv_pages=kv.capacity - 1, t0_states=1)
    stack = TieredCache.build_on(cfg, t0, state_side="swa", model_id=conf.model_id)
    return TieredRadixCache(stack.tree, req_to_token_pool=params.req_to_token_pool,
                            token_to_kv_pool_allocator=allocator, page_size=kv.page_size,
                            disable=bool(params.disable), stack=stack,
                            sliding_window_size=params.sliding_window_size,
                            draft_swa_window=int(params.draft_swa_window))


def register() -> None:
    """Register ``factory`` as ``--radix-cache-backend tiered``; a second call in a process does nothing."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, factory)
