"""The reference engine's groundwork: tiny hybrid models from ``transformers`` and the adapters that
move their per-layer KV and recurrent states between the model's cache and the pools.

Needs the ``engine`` extra (``transformers>=5.17,<6``); imported lazily by nothing else in the package.
"""

from __future__ import annotations

from tiered_cache.engine.adapters import HybridCacheAdapter, forward_chunk, new_cache
from tiered_cache.engine.models import ModelSpecs, spec_for, tiny_qwen3_next, tiny_swa_model

__all__ = [
    "HybridCacheAdapter",
    "ModelSpecs",
    "forward_chunk",
    "new_cache",
    "spec_for",
    "tiny_qwen3_next",
    "tiny_swa_model",
]
