"""The reference engine: tiny hybrid models from ``transformers``, the adapters that move their
per-layer KV and recurrent states between the model's cache and the pools, the serving loop that
drives the tiered prefix cache (``scheduler.Engine``, configured by ``config.EngineConfig``), the
model runner it hands its forwards to (``runner/``), a multi-turn workload, and the stress job.

Needs the ``engine`` extra (``transformers>=5.17,<6``); imported lazily by nothing else in the package.
"""

from __future__ import annotations

from tiered_cache.engine.adapters import HybridCacheAdapter
from tiered_cache.engine.config import EngineConfig
from tiered_cache.engine.model_specs import ModelSpecs, spec_for
from tiered_cache.engine.models import tiny_qwen3_next, tiny_swa_model
from tiered_cache.engine.request import Request, Status
from tiered_cache.engine.runner.forward import decode_batch, forward_chunk, new_cache
from tiered_cache.engine.scheduler import Engine
from tiered_cache.engine.workload import WorkloadConfig, make_conversations, run_workload

__all__ = [
    "Engine",
    "EngineConfig",
    "HybridCacheAdapter",
    "ModelSpecs",
    "Request",
    "Status",
    "WorkloadConfig",
    "decode_batch",
    "forward_chunk",
    "make_conversations",
    "new_cache",
    "run_workload",
    "spec_for",
    "tiny_qwen3_next",
    "tiny_swa_model",
]
