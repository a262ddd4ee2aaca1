"""``EngineConfig``: how the reference engine serves (chunks, batches, forwards), beside the tiers' own
``CacheConfig`` (their sizes and policies), which it holds.

The split follows who reads what: the scheduler and the model runner read the serving knobs here;
``TieredCache.build`` reads only the ``CacheConfig``. The two meet in three checks that need both: a
prefill chunk is whole pages, the step's prefill budget holds a chunk, and each running request holds
one T0 state slot.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tiered_cache.config import CacheConfig
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.validate import bool_arg, int_arg, str_arg


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs; ``cache``: the tiers it runs on (their page is the engine's ``page_size``).

    use_cache: drive the tiered prefix cache (False: the no-cache baseline, no pools; ``cache`` then
    only gives the page size prefill chunks are counted in).
    chunk_size: prefill tokens per request per step (a multiple of page_size). prefill_budget: prefill
    tokens per step over all requests. max_running: requests admitted at once (each holds one T0 state
    slot: at most ``cache.t0_states``).
    storage_model_id: the model part of T3's fingerprint (default: the model class and a SHA-256 of its
    weights, so another model's entries are never served).
    decode_batch: run the step's decode tokens as one batched forward (``runner.forward.decode_batch``:
    the requests' KV gathered into one left-padded cache), queued before the step's prefill chunks and
    read back after them, instead of one forward per request. Logits then differ from batch-1 decoding
    by summation order only (~1e-6 in fp32). Models with sliding-window layers always decode one
    request at a time.
    decode_graphs: run the step's decode tokens through ``runner.graph_decode.GraphDecoder``: static
    buffers and, on a GPU, one CUDA-graph replay per step instead of an eager forward (batched as with
    ``decode_batch``; models without sliding layers, SDPA). Its buffers (keys and values of
    ``max_running`` requests at the longest context, in buckets of 4,096 tokens) are outside the tier
    budgets.
    split_checkpoints: a prefill chunk that must cache states at positions inside it (the last aligned
    position of a prompt that ends off a page boundary; with ``block`` admission every block boundary)
    runs as one forward that also takes the states there (``runner.split_forward.forward_chunk_split``)
    instead of one forward per part. None
    (default): where the model supports it (``split_supported``); True: required (raises otherwise);
    False: never.
    prefill_graphs: run the gated-delta chunk rule of prefill forwards through
    ``runner.graph_prefill.GraphChunkRule``: on a GPU, one CUDA-graph replay per call (padded to a
    multiple of 64 tokens, up to 4,096) instead of the rule's eager kernel launches; the rest of the
    forward stays eager. Needs a model whose layers call the rule by name (``split_supported``; a typed
    error otherwise). Its memory is outside the tier budgets: one set of input buffers 4,096 tokens
    long (about 66 MB for the benchmark's 1.7 B model), shared by every shape, and each graph's outputs
    and workspace.
    phase_timing: measure where a step's time goes (``stats_dict()["phase_s"]``: seconds per phase,
    each phase's own time, nested ones apart). The device is synchronized at every phase boundary so
    GPU work counts in the phase that queued it; that costs overlap, so leave it off for timings.
    """

    use_cache: bool = True
    cache: CacheConfig = field(default_factory=CacheConfig)
    chunk_size: int = 64
    prefill_budget: int = 256
    max_running: int = 4
    storage_model_id: Optional[str] = None
    decode_batch: bool = False
    decode_graphs: bool = False
    split_checkpoints: Optional[bool] = None
    prefill_graphs: bool = False
    phase_timing: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.cache, CacheConfig):
            raise InvalidTypeError("cache", "a CacheConfig", self.cache)
        for name in ("chunk_size", "prefill_budget", "max_running"):
            int_arg(name, getattr(self, name), lo=1)
        for name in ("use_cache", "decode_batch", "decode_graphs", "prefill_graphs", "phase_timing"):
            bool_arg(name, getattr(self, name))
        if self.split_checkpoints is not None and not isinstance(self.split_checkpoints, bool):
            raise InvalidTypeError("split_checkpoints", "None, True or False", self.split_checkpoints)
        if self.storage_model_id is not None:
            str_arg("storage_model_id", self.storage_model_id)
        ps = self.page_size
        if self.chunk_size % ps:
            raise InvalidArgumentError("chunk_size", f"a multiple of page_size={ps}", self.chunk_size)
        if self.prefill_budget < self.chunk_size:
            raise InvalidArgumentError("prefill_budget", f">= chunk_size ({self.chunk_size})", self.prefill_budget)
        if not self.use_cache:
            return
        if self.max_running > self.cache.t0_states:
            raise InvalidArgumentError("max_running", f"<= t0_states ({self.cache.t0_states}): one state slot each",
                                       self.max_running)
        # TieredCache.build checks this too, knowing the model's kind; here it fails before a model is loaded
        host = (self.cache.host_kv_pages, self.cache.host_states)
        if (host[0] == 0) != (host[1] == 0):
            raise InvalidArgumentError("host_kv_pages, host_states", "both 0 (no T2) or both >= 1", host)

    @property
    def page_size(self) -> int:
        """Tokens per KV page: the cache's, which prefill chunks and KV reservations are counted in."""
        return self.cache.page_size
