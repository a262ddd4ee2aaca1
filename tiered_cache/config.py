"""``CacheConfig``: how big each tier is and how the tiers are used, checked once, in one place.

It is also the one home of the option names: the tuples below are what ``CacheConfig`` accepts, what
the lower layers check their own arguments against (``Int8CheckpointPool``'s codec, the host tier's
policies, the kernels' backend) and what the command line offers as ``choices=``. A new codec or
policy is added here and nowhere else is spelled out.

This module imports nothing of the package but its errors and argument checks, so every layer may
read it without an import circle.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.validate import bool_arg, choice_arg, float_arg, int_arg, str_arg

# T1's codecs: ``int8`` (per-(head, k-channel) scale, one rounding) or ``lossless`` (the T0 bytes).
CODECS = ("int8", "lossless")
# When KV is copied to T2: when cached, once matched ``write_through_threshold`` times, when evicted.
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
# What a match that misses T2 does about T3: fetch in the background, wait (bounded), wait up to a timeout.
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# Which cached node gives up a resource next (``tiered_cache.radix.policy``).
EVICTION_POLICIES = ("lru", "marconi", "seglen", "tiered")
# Which offered states the tree keeps (``tiered_cache.radix.policies.admission``): every chunk end, the leaf
# and branch points, or those and every ``admission_block`` tokens.
STATE_ADMISSIONS = ("chunk", "leaf_branch", "block")
# Model geometries of the cost-aware policies' FLOP and byte counts (``tiered_cache.costs.GEOMETRIES``).
COST_MODELS = ("qwen3-next-80b", "marconi-7b")
# Triton kernels or their torch twins: ``auto`` is Triton on CUDA, torch on CPU (``kernels.use_triton``).
BACKENDS = ("auto", "triton", "torch")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """The tiers' sizes and policies. Every field is checked here; a bad one raises a typed error from
    ``tiered_cache.errors`` naming it. Which fields apply depends on the model ``TieredCache.build``
    gets: a state model (KV + recurrent states) uses ``t0_states`` / ``t1_states`` / ``host_states`` /
    ``codec`` / ``checkpoint_unit`` / T3; an SWA model (full + sliding-window KV) uses ``swa_pages`` /
    ``host_swa_pages`` instead and has no T1 and no T3.

    page_size: tokens per KV page. checkpoint_unit: tokens between cached states, a multiple of
        page_size (None: page_size).
    kv_pages: T0 full-KV pages. t0_states: T0 state slots (one per running request). swa_pages: T0
        SWA KV pages (None: kv_pages). T0 is one buffer sized for these at once; either side may take
        the other's free bytes. lazy_compaction: T0 leaves holes on free and compacts when the other
        side needs the bytes (False: every free compacts its band at once).
    t1_states: T1 checkpoint slots. codec: T1's form, one of ``CODECS``.
    host_kv_pages: T2 full-KV pages (0: no T2). host_states: T2 state slots (state models: >= 1
        exactly when host_kv_pages is). host_swa_pages: T2 SWA pages (None: host_kv_pages).
    write_policy (``WRITE_POLICIES``) / write_through_threshold / load_back_threshold: how the tree
        uses T2 (``radix.HostTierConfig``).
    storage_url: T3 below T2 (``storage.open_backend``: ``file:///dir``, ``redis://host:port``, ...;
        None: no T3; needs T2). storage_write_through: what is copied to T2 goes to T3 at once (False:
        only what eviction demotes). prefetch_policy (``PREFETCH_POLICIES``) / prefetch_timeout_s: what a
        match that misses T2 does about T3.
    eviction_policy: one of ``EVICTION_POLICIES``; the cost-aware ones (marconi, seglen, tiered) count
        FLOPs with the geometry ``cost_model`` (``COST_MODELS``) and bytes from the specs.
    state_admission: which offered states the tree keeps (``STATE_ADMISSIONS``); admission_block: tokens
        between kept states for ``block`` (then a multiple of checkpoint_unit, or of page_size without one).
    backend: one of ``BACKENDS``.
    check_memory: check every pool against free device / host memory before allocating it.
    validate: the tree checks that ids handed to ``insert`` are the caller's (one device sync each).
    """

    page_size: int = 16
    kv_pages: int = 256
    t0_states: int = 8
    swa_pages: Optional[int] = None
    lazy_compaction: bool = False
    t1_states: int = 32
    codec: str = "int8"
    checkpoint_unit: Optional[int] = None
    host_kv_pages: int = 0
    host_states: int = 0
    host_swa_pages: Optional[int] = None
    write_policy: str = "write_through"
    write_through_threshold: int = 2
    load_back_threshold: int = 0
    storage_url: Optional[str] = None
    storage_write_through: bool = True
    prefetch_policy: str = "best_effort"
    prefetch_timeout_s: float = 1.0
    eviction_policy: str = "lru"
    cost_model: str = "qwen3-next-80b"
    state_admission: str = "chunk"
    admission_block: int = 512
    backend: str = "auto"
    check_memory: bool = True
    validate: bool = True

    def __post_init__(self) -> None:
        for name in ("page_size", "kv_pages", "t0_states", "t1_states"):
            int_arg(name, getattr(self, name), lo=1)
        for name in ("host_kv_pages", "host_states", "write_through_threshold", "load_back_threshold"):
            int_arg(name, getattr(self, name), lo=0)
        for name in ("swa_pages", "host_swa_pages"):
            if getattr(self, name) is not None:
                int_arg(name, getattr(self, name), lo=1)
        if self.checkpoint_unit is not None:
            unit, ps = self.checkpoint_unit, self.page_size
            int_arg("checkpoint_unit", unit, lo=1)
            if unit % ps:
                raise InvalidArgumentError("checkpoint_unit", f"a positive multiple of page_size={ps}", unit)
        choice_arg("codec", self.codec, CODECS)
        choice_arg("write_policy", self.write_policy, WRITE_POLICIES)
        choice_arg("prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES)
        choice_arg("eviction_policy", self.eviction_policy, EVICTION_POLICIES)
        choice_arg("cost_model", self.cost_model, COST_MODELS)
        choice_arg("state_admission", self.state_admission, STATE_ADMISSIONS)
        unit = self.checkpoint_unit or self.page_size
        int_arg("admission_block", self.admission_block, lo=1)
        if self.state_admission == "block" and self.admission_block % unit:
            raise InvalidArgumentError("admission_block", f"a positive multiple of the checkpoint unit {unit}",
                                       self.admission_block)
        choice_arg("backend", self.backend, BACKENDS)
        float_arg("prefetch_timeout_s", self.prefetch_timeout_s, lo=0.0, lo_open=True)
        for name in ("lazy_compaction", "storage_write_through", "check_memory", "validate"):
            bool_arg(name, getattr(self, name))
        if self.storage_url is not None:
            if not isinstance(self.storage_url, str):
                raise InvalidTypeError("storage_url", "None or a storage URL (str)", self.storage_url)
            str_arg("storage_url", self.storage_url)
            if not self.host_kv_pages:
                raise InvalidArgumentError("storage_url", "None without a host tier (T3 prefetches into T2)",
                                           self.storage_url)

    @property
    def host_tier(self) -> bool:
        """Whether there is a T2 (host mirror and transfer engine)."""
        return self.host_kv_pages > 0
