"""tiered-cache as a radix-cache backend of SGLang 0.5.23 (issue 19; SGLang's interface: ``docs/sglang.md``).

- ``TieredRadixCache`` (``backend.py``): SGLang's ``BasePrefixCache`` over our radix tree; it translates
  SGLang's params, results, keys and ``Req`` to ours and back.
- ``parse_backend_config`` (``config.py``): T1/T2/T3 budgets from a JSON object or file, typed errors
  naming the key; ``TIERED_CACHE_SGLANG_CONFIG`` holds it for ``factory``.
- ``factory(ctx)``: what ``register_radix_cache_backend`` calls with a ``TreeCacheBuildContext``.
- ``register()``: registers ``factory`` under ``BACKEND_NAME`` (``--radix-cache-backend tiered``); once
  per process, a second call does nothing.

- ``t0.py``: ``SGLangKVSide`` (SGLang's paged allocator + MHA KV pool: ids and room, no layer-spanning
  views), ``SGLangStateSide`` (SGLang's mamba pool + slot allocator: a whole ``StateSide``), ``SGLangT0``.

Built so far: the translation, the config, the factory's refusals, the T0 sides. Not built: the tree over
``SGLangT0`` inside the factory (the radix facade accepts only a ``UnifiedPool``), T2 for SGLang's
per-layer KV layout, and the parity items of issue 19; until then the factory stops after its checks
with an error saying so (it never builds a second copy of T0).
"""

from __future__ import annotations

import os
from typing import Any

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.integrations.sglang.backend import TieredRadixCache, salted, tree_key
from tiered_cache.integrations.sglang.config import KEYS, BackendConfig, parse_backend_config

BACKEND_NAME = "tiered"
CONFIG_ENV = "TIERED_CACHE_SGLANG_CONFIG"

__all__ = ["BACKEND_NAME", "CONFIG_ENV", "KEYS", "BackendConfig", "TieredRadixCache", "factory",
           "parse_backend_config", "register", "salted", "tree_key"]


def check_context(ctx: Any) -> BackendConfig:
    """The refusals of ``factory``, before anything is built: a typed error naming the context field."""
    if int(ctx.tp_size) > 1:
        # Every rank must make the same tree decisions (evictions, T3 answers); until the TP issue lands,
        # refuse instead of letting ranks diverge.
        raise InvalidArgumentError("ctx.tp_size", "1 (tensor-parallel ranks are not kept in step yet)", ctx.tp_size)
    if ctx.is_hybrid_swa and not ctx.is_hybrid_ssm:
        raise InvalidArgumentError("ctx.is_hybrid_swa", "False (the SWA backend is not built yet)", True)
    if not ctx.is_hybrid_ssm:
        raise InvalidArgumentError("ctx.is_hybrid_ssm", "True (a hybrid model with recurrent states)", False)
    if ctx.disable_radix_cache:
        raise InvalidArgumentError("ctx.disable_radix_cache", "False (a disabled cache needs no backend)", True)
    return parse_backend_config(os.environ.get(CONFIG_ENV), CONFIG_ENV)


def factory(ctx: Any) -> TieredRadixCache:
    """SGLang's ``RadixCacheFactory``: checks ``ctx`` and the backend config (``check_context``).

    Not finished: the tree cannot yet be built over SGLang's own pools (``SGLangT0``; see the module
    docstring), so after the checks this raises ``NotImplementedError`` naming what is missing."""
    check_context(ctx)
    raise NotImplementedError(
        "tiered-cache's SGLang backend: the radix tree is not yet built over SGLang's own KV and mamba pools "
        "(issue 19); the backend cannot run inside SGLang's scheduler in this version")


def register() -> None:
    """Register ``factory`` as ``--radix-cache-backend tiered``; a second call in a process does nothing."""
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    if BACKEND_NAME not in registered_radix_cache_backends():
        register_radix_cache_backend(BACKEND_NAME, factory)
