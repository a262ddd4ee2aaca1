"""The reference engine: a small serving loop that drives the tiered prefix cache as an engine does.

Each ``step`` (SGLang's scheduler order)::

    check_hicache_events                    apply finished host transfers (T2) to the tree; requests
                                            whose load back landed start prefill (a corrupt one is
                                            released and matches again: it recomputes that part)
    admit waiting requests                  match_prefix(cow_mamba) -> [init_load_back] -> inc_lock_ref
                                            -> a T0 state slot + KV for prompt and answer, reserved;
                                            with a host load in flight the request waits (LOADING)
                                            while the step's other work overlaps the copy
    one prefill chunk per prefilling req    forward [start, end) on the request's model cache, with
                                            explicit positions; KV exported to T0 after every forward;
                                            a state exported and inserted (cache_unfinished_req) at
                                            the branch point, at a page-aligned chunk end, and at
                                            cache.checkpoint_positions() of an unaligned last chunk
    one decode token per decoding req       greedy; the state is exported to the request's T0 slot
                                            at every checkpoint unit, so the turn's end is cacheable
    finished requests                       cache_finished_req (state at the last aligned position)

Batching: prefill chunks run one request at a time (batch 1 per forward call), on the CPU and the
GPU alike: the model's ``DynamicCache`` cannot hold requests of different lengths in one batch. With
``decode_batch`` or ``decode_graphs`` the decoding requests take one forward together, queued before
the step's prefill chunks (their launches overlap its device time) and read back after them.

A running request computes on its own ``transformers`` cache (the "kernel workspace"); the pools are
the source of truth for everything cached: a hit rebuilds the model cache from T0 KV pages and the
state the tree copied into the request's T0 slot (from T1, or T2 through ``init_load_back``). The
engine reserves a request's whole KV (prompt + max_new_tokens) at admission, so there is no
preemption; a request that does not fit waits, after the tree evicted what it could.

``use_cache=False`` is the no-cache baseline: the same chunked prefill and decode, no pools at all.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from tiered_cache import device as dev
from tiered_cache.engine.adapters import HybridCacheAdapter, decode_batch, forward_chunk
from tiered_cache.engine.graph_decode import GraphDecoder
from tiered_cache.engine.models import spec_for
from tiered_cache.engine.request import Request, Status
from tiered_cache.engine.stats import CountingCheckpointPool, CountingLRUPolicy, EngineStats
from tiered_cache.errors import InvalidArgumentError, MemoryBudgetError
from tiered_cache.radix import (
    CacheReq,
    EvictParams,
    HiMambaRadixCache,
    HiSWARadixCache,
    InitLoadBackParams,
    MatchPrefixParams,
    RadixKey,
)
from tiered_cache.tiers.checkpoint_pool import CODECS

# The host tier (T2) of the radix cache comes with the hierarchy issue; until the tree takes a
# ``host`` the engine runs on T0 + T1 and refuses host budgets (EngineConfig checks this).
HOST_TIER_AVAILABLE = "host" in inspect.signature(HiMambaRadixCache.__init__).parameters


def _pos_int(name: str, v: Any, lo: int = 1) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise InvalidArgumentError(name, f"an int >= {lo}", v)


class PhaseClock:
    """Seconds per named phase, exclusive: a phase entered inside another pauses the outer one. The
    device is synchronized at every boundary (``EngineConfig.phase_timing``)."""

    def __init__(self, totals: collections.Counter, device: torch.device) -> None:
        self.totals, self.device = totals, device
        self.stack: list[list] = []  # [name, started]

    @contextlib.contextmanager
    def __call__(self, name: str):
        dev.synchronize(self.device)
        now = time.perf_counter()
        if self.stack:
            outer = self.stack[-1]
            self.totals[outer[0]] += now - outer[1]
        self.stack.append([name, now])
        try:
            yield
        finally:
            dev.synchronize(self.device)
            now = time.perf_counter()
            self.totals[name] += now - self.stack.pop()[1]
            if self.stack:
                self.stack[-1][1] = now


_NO_PHASE = contextlib.nullcontext()


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs and how big its tiers are.

    use_cache: drive the tiered prefix cache (False: the no-cache baseline, no pools).
    page_size: tokens per KV page. chunk_size: prefill tokens per request per step (a multiple of
    page_size). prefill_budget: prefill tokens per step over all requests. max_running: requests
    admitted at once (each holds one T0 state slot).
    kv_pages / t0_states: T0 is sized for this many KV pages and state slots at once (one buffer:
    either side may take the other's free bytes). t1_states: T1 checkpoint slots. codec: T1's
    ``int8`` | ``lossless``. host_kv_pages / host_states: T2 host slots (both 0: no host tier);
    write_policy: when KV is copied to T2 (``HostTierConfig``). checkpoint_unit: tokens between
    cached states (default page_size).
    storage_url: T3 below T2 (``storage.open_backend``: ``file:///dir``, ``redis://host:port``, ...;
    None: no T3; needs T2). prefetch_policy / prefetch_timeout_s / storage_write_through: ``HostTierConfig``'s.
    storage_model_id: the model part of the storage fingerprint (default: the model class and a
    SHA-256 of its weights, so another model's entries are never served).
    decode_batch: run the step's decode tokens as one batched forward (``adapters.decode_batch``:
    the requests' KV gathered into one left-padded cache), queued before the step's prefill chunks and
    read back after them, instead of one forward per request. Logits then differ from batch-1 decoding
    by summation order only (~1e-6 in fp32). Models with sliding-window layers always decode one request at a time.
    decode_graphs: run the step's decode tokens through ``graph_decode.GraphDecoder``: static buffers
    and, on a GPU, one CUDA-graph replay per step instead of an eager forward (batched as with
    ``decode_batch``; full + linear attention models, SDPA). Its buffers (keys and values of
    ``max_running`` requests at the longest context, in buckets of 4,096 tokens) are outside the tier
    budgets.
    split_checkpoints: a prefill chunk that must cache the state at a position inside it (the last
    aligned position of a prompt that ends off a page boundary) runs as one forward that also takes
    the state there (``split_forward.forward_chunk_split``) instead of two forwards. None (default):
    where the model supports it (``split_supported``); True: required (raises otherwise); False: never.
    prefill_graphs: run the gated-delta chunk rule of prefill forwards through
    ``graph_prefill.GraphChunkRule``: on a GPU, one CUDA-graph replay per call (padded to a multiple of 64
    tokens, up to 4,096) instead of the rule's eager kernel launches; the rest of the forward stays
    eager. Needs a model whose layers call the rule by name (``split_supported``; a typed error
    otherwise). Its memory is outside the tier budgets: one set of input buffers 4,096 tokens long
    (about 66 MB for the benchmark's 1.7 B model), shared by every shape, and each graph's outputs and
    workspace.
    phase_timing: measure where a step's time goes (``stats_dict()["phase_s"]``: seconds per phase,
    each phase's own time, nested ones apart). The device is synchronized at every phase boundary so
    GPU work counts in the phase that queued it; that costs overlap, so leave it off for timings.
    """

    use_cache: bool = True
    page_size: int = 16
    chunk_size: int = 64
    prefill_budget: int = 256
    max_running: int = 4
    kv_pages: int = 256
    t0_states: int = 8
    t1_states: int = 32
    codec: str = "int8"
    host_kv_pages: int = 0
    host_states: int = 0
    write_policy: str = "write_through"
    checkpoint_unit: Optional[int] = None
    backend: str = "auto"
    check_memory: bool = True
    storage_url: Optional[str] = None
    prefetch_policy: str = "best_effort"
    prefetch_timeout_s: float = 1.0
    storage_write_through: bool = True
    storage_model_id: Optional[str] = None
    decode_batch: bool = False
    decode_graphs: bool = False
    phase_timing: bool = False
    prefill_graphs: bool = False
    split_checkpoints: Optional[bool] = None

    def __post_init__(self) -> None:
        for name in ("page_size", "chunk_size", "prefill_budget", "max_running", "kv_pages", "t0_states",
                     "t1_states"):
            _pos_int(name, getattr(self, name))
        for name in ("use_cache", "check_memory", "storage_write_through", "decode_batch", "decode_graphs",
                     "phase_timing", "prefill_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(name, "a bool", getattr(self, name))
        if self.split_checkpoints is not None and not isinstance(self.split_checkpoints, bool):
            raise InvalidArgumentError("split_checkpoints", "None, True or False", self.split_checkpoints)
        if self.chunk_size % self.page_size:
            raise InvalidArgumentError("chunk_size", f"a multiple of page_size={self.page_size}", self.chunk_size)
        if self.prefill_budget < self.chunk_size:
            raise InvalidArgumentError("prefill_budget", f">= chunk_size ({self.chunk_size})", self.prefill_budget)
        if self.use_cache and self.max_running > self.t0_states:
            raise InvalidArgumentError("max_running", f"<= t0_states ({self.t0_states}): one state slot each",
                                       self.max_running)
        if self.codec not in CODECS:
            raise InvalidArgumentError("codec", f"one of {CODECS}", self.codec)
        for name in ("host_kv_pages", "host_states"):
            _pos_int(name, getattr(self, name), 0)
        if (self.host_kv_pages == 0) != (self.host_states == 0):
            raise InvalidArgumentError("host_kv_pages, host_states", "both 0 (no T2) or both >= 1",
                                       (self.host_kv_pages, self.host_states))
        if self.storage_url is not None and self.use_cache and not self.host_kv_pages:
            raise InvalidArgumentError("storage_url", "None without a host tier (T3 prefetches into T2)",
                                       self.storage_url)
        if self.host_kv_pages and not HOST_TIER_AVAILABLE:
            raise InvalidArgumentError("host_kv_pages", "0: this radix cache has no host tier yet", self.host_kv_pages)

    @property
    def host_tier(self) -> bool:
        return self.use_cache and self.host_kv_pages > 0


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


class Engine:
    """Serves ``Request``s on ``model`` (a tiny hybrid from ``engine.models``) through the tiered cache.

    ``submit`` queues a request; ``step`` runs one scheduling step and returns the requests that
    finished in it; ``abort`` ends a request wherever it is (its locks, slots and pages released);
    ``run`` steps until nothing is left. ``stats_dict`` reports hits, tokens, bytes and TTFT.
    """

    def __init__(self, model, config: Optional[EngineConfig] = None) -> None:
        self.model = model
        self.cfg = cfg = config or EngineConfig()
        self.device = model.device
        self.specs = spec_for(model, cfg.page_size)
        self.adapter = HybridCacheAdapter(model, self.specs)
        self.graph_decoder = None
        if cfg.decode_graphs:
            if self.specs.swa_layers:
                raise InvalidArgumentError("decode_graphs", "False for a model with sliding-window layers", True)
            self.graph_decoder = GraphDecoder(model, max_batch=cfg.max_running)
        self.prefill_rule = None  # graph_prefill.GraphChunkRule (prefill_graphs)
        if cfg.prefill_graphs:
            from tiered_cache.engine.graph_prefill import GraphChunkRule
            from tiered_cache.engine.split_forward import install, split_supported

            if not split_supported(model):
                raise InvalidArgumentError("prefill_graphs", "False: this model's layers do not call the chunk "
                                           "rule by name (split_supported)", True)
            install(model)
            self.prefill_rule = GraphChunkRule(self.device)
        self.split = False  # one forward per chunk with a state taken inside it (split_checkpoints)
        if cfg.split_checkpoints is not False and self.specs.state is not None:
            from tiered_cache.engine.split_forward import split_supported

            self.split = split_supported(model)
            if cfg.split_checkpoints and not self.split:
                raise InvalidArgumentError("split_checkpoints", "None or False: this model's layers do not call "
                                           "the chunk rule and conv by name (split_supported)", True)
        self.stats = EngineStats()
        clock = PhaseClock(self.stats.phase_s, self.device) if cfg.phase_timing else None
        self._phase = clock if clock is not None else (lambda name: _NO_PHASE)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.cache: Optional[HiMambaRadixCache] = None
        self.pool = self.kv = self.states = self.ckpt = self.host = self.transfer = None
        self.swa = None  # SWA models: the T0 SWA KV side
        self.storage = None
        if cfg.use_cache:
            self._build_tiers()

    # ------------------------------------------------------------------------------- tiers
    def _build_tiers(self) -> None:
        cfg, specs = self.cfg, self.specs
        if specs.state is None:
            return self._build_swa_tiers()
        self.pool = specs.make_pool(full_slots=cfg.kv_pages, high_slots=cfg.t0_states, device=self.device,
                                    backend=cfg.backend, check_memory=cfg.check_memory)
        self.kv, self.states = self.pool.side("full"), self.pool.side("mamba")
        self.ckpt = CountingCheckpointPool(specs.state, cfg.t1_states, device=self.device, codec=cfg.codec,
                                           check_memory=cfg.check_memory, backend=cfg.backend)
        host = {}
        if cfg.host_tier:
            from tiered_cache.radix.params import HostTierConfig
            from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec
            from tiered_cache.transfer.engine import TransferEngine

            hc = HostTierConfig(write_policy=cfg.write_policy, prefetch_policy=cfg.prefetch_policy,
                                prefetch_timeout_s=cfg.prefetch_timeout_s,
                                storage_write_through=cfg.storage_write_through)
            self.host = HostMirror([RegionSpec(hc.kv_region, self.kv.entry_bytes, cfg.host_kv_pages),
                                    RegionSpec(hc.state_region, self.ckpt.slot_bytes, cfg.host_states)],
                                   check_memory=cfg.check_memory)
            self.transfer = TransferEngine(self.device, backend=cfg.backend)
            host = dict(host=self.host, transfer=self.transfer, host_config=hc)
            if cfg.storage_url is not None:
                host["storage"] = self.storage = self._open_storage()
        self.cache = HiMambaRadixCache(self.pool, self.ckpt, checkpoint_unit=cfg.checkpoint_unit,
                                       policy=CountingLRUPolicy(), **host)
        self.unit = self.cache.checkpoint_unit
        self.kv_token_bytes = self.kv.entry_bytes // cfg.page_size
        self.initial_free = self.free_sizes()

    def _open_storage(self):
        import hashlib

        from tiered_cache.storage import StorageFingerprint, StorageTier, open_backend

        cfg = self.cfg
        model_id = cfg.storage_model_id
        if model_id is None:
            h = hashlib.sha256()
            for name, t in sorted(self.model.state_dict().items()):
                h.update(name.encode())
                h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
            model_id = f"{type(self.model).__name__}/weights-sha256:{h.hexdigest()[:32]}"
        fp = StorageFingerprint.from_specs(model_id, kv_spec=self.specs.full, state_spec=self.specs.state,
                                           codec=cfg.codec, page_size=cfg.page_size)
        return StorageTier(open_backend(cfg.storage_url), fp)

    def close(self) -> None:
        """Stop T3's workers and close its backend (nothing else holds outside resources)."""
        if self.storage is not None:
            if self.cache is not None and self.cache.t3 is not None:
                self.cache.t3.drain()  # prefetches in flight stop; their T2 slots go back
            self.storage.close()
            self.storage = None

    def _build_swa_tiers(self) -> None:
        """SWA hybrids: T0 = full KV + SWA KV (``kv_pages`` pages each, one buffer), no states, no T1;
        T2 (if any) holds ``host_kv_pages`` full and as many SWA page envelopes."""
        cfg = self.cfg
        if cfg.storage_url is not None:
            raise InvalidArgumentError("storage_url", "None for a model without linear layers", cfg.storage_url)
        self.pool = self.specs.make_pool(full_slots=cfg.kv_pages, high_slots=cfg.kv_pages, device=self.device,
                                         backend=cfg.backend, check_memory=cfg.check_memory)
        self.kv, self.swa = self.pool.side("full"), self.pool.side("swa")
        host = {}
        if cfg.host_tier:
            from tiered_cache.radix.params import HostTierConfig
            from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec
            from tiered_cache.transfer.engine import TransferEngine

            hc = HostTierConfig(write_policy=cfg.write_policy)
            self.host = HostMirror([RegionSpec(hc.kv_region, self.kv.entry_bytes, cfg.host_kv_pages),
                                    RegionSpec(hc.swa_region, self.swa.entry_bytes, cfg.host_kv_pages)],
                                   check_memory=cfg.check_memory)
            self.transfer = TransferEngine(self.device, backend=cfg.backend)
            host = dict(host=self.host, transfer=self.transfer, host_config=hc)
        self.cache = HiSWARadixCache(self.pool, **host)
        self.unit = cfg.page_size
        self.kv_token_bytes = self.kv.entry_bytes // cfg.page_size
        self.initial_free = self.free_sizes()

    def free_sizes(self) -> dict[str, int]:
        """Free room per pool (T0 KV tokens, T0 state slots, T1 slots): the run must end where it began."""
        if self.swa is not None:
            out = {"t0_kv": self.kv.available_size(), "t0_swa": self.swa.available_size()}
        else:
            out = {"t0_kv": self.kv.available_size(), "t0_states": self.states.available_size(),
                   "t1": self.ckpt.available_size()}
        if self.host is not None:
            out.update({f"t2_{name}": r.available_size() for name, r in self.host.regions.items()})
        return out

    # ----------------------------------------------------------------------------- requests
    def submit(self, req: Request, arrival: Optional[float] = None) -> None:
        """Queue ``req``. ``arrival``: when it arrived, as a ``time.perf_counter()`` stamp (default now),
        for a front end that hands over requests between steps: a request that waited for a step to end
        counts that wait in its TTFT."""
        if req.status is not Status.WAITING or req.output:
            raise InvalidArgumentError("req", "a new request", req.status)
        t = time.perf_counter()
        if arrival is not None and (not isinstance(arrival, (int, float)) or isinstance(arrival, bool)
                                    or not math.isfinite(arrival) or arrival > t):
            raise InvalidArgumentError("arrival", "a time.perf_counter() stamp, not in the future", arrival)
        req.t_arrival = t if arrival is None else float(arrival)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, rid: Any) -> bool:
        """End request ``rid`` now, wherever it is; its locks, T0 slot and own KV pages are released,
        nothing of it is cached. Returns whether it was found."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                req.status = Status.ABORTED
                self.stats.add("aborted")
                return True
        for req in self.running:
            if req.rid == rid:
                if self.cache is not None:
                    self.cache.cancel_prefetch(req)
                    self._release(req)
                self._drop(req, Status.ABORTED)
                self.stats.add("aborted")
                self.stats.add("aborted_computed_tokens", req.computed_tokens)
                return True
        return False

    def run(self, max_steps: Optional[int] = None) -> list[Request]:
        done: list[Request] = []
        steps = 0
        while self.has_work() and (max_steps is None or steps < max_steps):
            done.extend(self.step())
            steps += 1
        return done

    # --------------------------------------------------------------------------------- step
    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that finished in it."""
        if self.cache is not None:
            self._poll_events()
        self._admit_waiting()
        finished: list[Request] = []
        budget = self.cfg.prefill_budget
        batched = (self.cfg.decode_batch or self.graph_decoder is not None) and not self.adapter.specs.swa_layers
        # The batched decode goes first, queued: the prefill chunks' launches below overlap its GPU time,
        # and its tokens are read back after them, in one read.
        decoding = [r for r in self.running if r.status is Status.DECODE] if batched else []
        queued = self._decode_launch(decoding) if decoding else None
        for req in list(self.running):
            if req.status is Status.PREFILL:
                if budget < self.cfg.page_size:
                    continue
                budget -= self._prefill_chunk(req, budget)
            elif req.status is Status.DECODE:
                if batched:
                    continue  # landed below
                self._decode(req)
            if req.status is Status.FINISHED:
                finished.append(req)
        if decoding:
            self._decode_land(decoding, queued)
            finished.extend(r for r in decoding if r.status is Status.FINISHED)
        # Loads back from T2 started by this step's admissions have usually landed by now (the step's
        # forwards ran meanwhile): start those prefills in this step rather than the next one.
        loading = [r for r in self.running if r.status is Status.LOADING]
        if loading:
            self._poll_events()
            for req in loading:
                if req.status is Status.PREFILL and req in self.running and budget >= self.cfg.page_size:
                    budget -= self._prefill_chunk(req, budget)
                    if req.status is Status.FINISHED:
                        finished.append(req)
        return finished

    def _admit_waiting(self) -> None:
        while self.waiting and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            with self._phase("admit"):
                ok = self._admit(req)
            if not ok:
                self.stats.add("admission_retries")
                if not self.running:
                    need = _ceil(len(req.tokens) + req.max_new_tokens, self.cfg.page_size)
                    raise MemoryBudgetError(f"request {req.rid!r} ({need} KV tokens + one state) in T0",
                                            need * self.kv_token_bytes, self.kv.available_size() * self.kv_token_bytes,
                                            "the prompt and max_new_tokens (or raise kv_pages)")
                return  # first come, first served: wait until running requests give room back
            self.waiting.popleft()
            self.running.append(req)
            req.t_admitted = time.perf_counter()
            self.stats.add("admitted")
            self.stats.add("prompt_tokens", len(req.prompt))

    # ------------------------------------------------------------------------------- admit
    def _admit(self, req: Request) -> bool:
        """Match, load back, lock, reserve. False: no room now, and nothing is held."""
        if self.cache is None:
            req.model_cache = self.adapter.new_cache()
            req.filled = 0
            req.status = Status.PREFILL
            self.stats.add("misses")
            return True
        cache, ps = self.cache, self.cfg.page_size
        n = len(req.tokens)
        # Leave one prompt token to compute: the first output token needs its logits.
        m = cache.match_prefix(MatchPrefixParams(key=RadixKey(req.tokens[:n - 1], req.extra_key),
                                                 cow_mamba=True, req=req))
        prefix, node = m.device_indices, m.last_device_node
        swa_prefix = m.swa_device_indices
        host_hit, state_from_host = 0, False
        if m.host_hit_length > 0:
            # T2: the tree starts copying the host part of the match into fresh T0 pages, and the state
            # at its end into the request's T0 slot; ``req.load_back`` tracks the transfer.
            ids, node = cache.init_load_back(InitLoadBackParams(
                best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req))
            if len(ids):
                prefix = torch.cat([prefix, ids])
                if self.swa is not None:
                    swa_prefix = torch.cat([swa_prefix, req.load_back.swa_indices])
                # ``ids`` also covers path KV still on the device; what came from T2 is what moved.
                tickets = getattr(req.load_back, "tickets", None) or {}
                kv_t = tickets.get("kv")
                host_hit = 0 if kv_t is None else kv_t.nbytes // self.kv_token_bytes
                state_from_host = "state" in tickets
        cache.inc_lock_ref(node)
        p = len(prefix)
        req.last_node, req.cache_protected_len, req.prefix_indices = node, p, prefix
        req.kv_indices = prefix
        if self.swa is not None:  # SWA models: SWA KV ids beside the KV ids, no state slot
            req.swa_kv_indices = swa_prefix
            new_swa = self._alloc_kv(_ceil(n + req.max_new_tokens, ps) - p, self.swa)
            new = None if new_swa is None else self._alloc_kv(_ceil(n + req.max_new_tokens, ps) - p)
            if new is None:
                if new_swa is not None:
                    self.swa.free(new_swa)
                self._release(req)
                return False
            req.swa_kv_indices = torch.cat([swa_prefix, new_swa])
        else:
            if req.mamba_pool_idx is None:
                req.mamba_pool_idx = self._alloc_state()
            new = None if req.mamba_pool_idx is None else self._alloc_kv(_ceil(n + req.max_new_tokens, ps) - p)
            if new is None:
                self._release(req)
                return False
        req.kv_indices = torch.cat([prefix, new])
        req.filled = req.slot_pos = p
        b = m.mamba_branching_seqlen
        req.branching = b if b is not None and b > p else None
        req.reused_tokens, req.reused_host_tokens = p, host_hit
        req.state_tier = ("T2" if state_from_host else "T1") if p else "miss"
        if req.load_back is not None and not req.load_back.done:
            req.status = Status.LOADING  # the step's other work overlaps the copy; it resumes when it lands
        else:
            self._start_prefill(req)
        return True

    def _start_prefill(self, req: Request) -> bool:
        """The request's prefix is on the device: build its model cache from the pools. False when the
        load back arrived corrupt (the tree dropped that host copy): the request is released."""
        handle, req.load_back = req.load_back, None
        if handle is not None and not handle.ok:
            self.stats.add("load_back_failures")
            self._release(req)
            return False
        st, p = self.stats, req.cache_protected_len
        if p:
            with self._phase("build_cache"):
                req.model_cache = self.adapter.build_cache(
                    self.kv, self._on_host(req, "kv_indices"), self.states, self._on_host(req, "mamba_pool_idx"),
                    n_tokens=p, swa_side=self.swa, swa_token_ids=self._on_host(req, "swa_kv_indices"))
            st.add("t0_kv_read_bytes", p * self.kv_token_bytes)
            if self.states is not None:
                st.add("t0_state_read_bytes", self.states.entry_bytes)
        else:
            req.model_cache = self.adapter.new_cache()
        st.add({"T1": "hit_t1_states", "T2": "hit_t2_states"}.get(req.state_tier, "misses"))
        st.add("hit_t0_kv_tokens", p - req.reused_host_tokens)
        st.add("hit_t2_kv_tokens", req.reused_host_tokens)
        st.add("reused_tokens", p)
        st.add("reused_host_tokens", req.reused_host_tokens)
        req.status = Status.PREFILL
        return True

    def _poll_events(self) -> None:
        """Apply finished host transfers to the tree; requests whose load back landed start prefill."""
        with self._phase("events"):
            self.cache.check_hicache_events()
            self._poll_loads()

    def _poll_loads(self) -> None:
        """Requests whose load back has landed start their prefill; a corrupt one goes back to the
        front of the queue and matches again (the bad host copy is gone: it recomputes that part)."""
        for req in [r for r in self.running if r.status is Status.LOADING]:
            if not req.load_back.done:
                continue
            if not self._start_prefill(req):
                self.running.remove(req)
                self.stats.add("admitted", -1)
                self.stats.add("prompt_tokens", -len(req.prompt))
                req.status, req.state_tier = Status.WAITING, "miss"
                req.reused_tokens = req.reused_host_tokens = 0
                self.waiting.appendleft(req)

    def _wait_load_back(self, req: Request) -> None:
        """Block until the request's host load (if any) has landed and been applied to the tree:
        nothing may be freed while a transfer still writes it."""
        handle, req.load_back = req.load_back, None
        with self._phase("load_wait"):
            while handle is not None and not handle.done:
                self.cache.check_hicache_events()

    def _alloc_kv(self, n: int, side=None) -> Optional[torch.Tensor]:
        """``n`` T0 KV token ids (whole pages) of ``side`` (default the full KV), evicting cached KV (LRU)
        for room; None if there is none. The SWA side evicts SWA KV first, then whole leaves."""
        side = self.kv if side is None else side
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=side.device)
        ids = side.alloc(n)
        while ids is None:
            short = max(self.cfg.page_size, n - side.available_size())
            if side is self.swa:
                r = self.cache.evict(EvictParams(swa_num_tokens=short))
                if r.swa_num_tokens_evicted == 0 and r.num_tokens_evicted == 0 and \
                        self.cache.evict(EvictParams(num_tokens=short)).num_tokens_evicted == 0:
                    return None
            elif self.cache.evict(EvictParams(num_tokens=short)).num_tokens_evicted == 0:
                return None
            ids = side.alloc(n)
        return ids

    def _alloc_state(self) -> Optional[torch.Tensor]:
        """A T0 state slot; cached KV pages are evicted for the bytes (the two sides share one buffer)."""
        slot = self.states.alloc(1)
        pages = max(1, -(-self.states.entry_bytes // self.kv.entry_bytes))
        while slot is None:
            if self.cache.evict(EvictParams(num_tokens=pages * self.cfg.page_size)).num_tokens_evicted == 0:
                return None
            slot = self.states.alloc(1)
        return slot

    # ----------------------------------------------------------------------------- prefill
    def _prefill_chunk(self, req: Request, budget: int) -> int:
        """Run one prefill chunk of ``req``; returns the tokens it computed."""
        ps, n_prompt = self.cfg.page_size, len(req.prompt)
        start = req.filled
        end = min(n_prompt, start + min(self.cfg.chunk_size, budget // ps * ps))
        # Where a state is exported and cached during this chunk: (position, kind). The cache's rule
        # says where a chunk may export one mid-way; an aligned chunk end is itself cacheable, so the
        # mid-chunk position is used only for the unaligned last chunk (where it matters: the next
        # turn of a conversation resumes there).
        cuts: dict[int, str] = {}
        if self.cache is not None and self.swa is not None:
            cuts[end] = "end"  # SWA: every written position's KV is in T0; the aligned part is cached
        elif self.cache is not None:
            b = req.branching
            if b is not None and start < b <= end:
                cuts[b] = "branch"
            if end % ps:
                for p in self.cache.checkpoint_positions(start, end):
                    cuts.setdefault(p, "mid")
            else:
                cuts.setdefault(end, "end")
        pos, logits = start, None
        inside = [c for c in cuts if start < c < end]
        if self.split and len(inside) == 1:
            # one forward; the state at the cut is taken inside it
            c = inside[0]
            logits, states = self._forward(req, start, end, split_at=c)
            if states is not None:
                self.stats.add("split_forwards")
                self._checkpoint(req, c, cuts[c], states)
            else:  # the model did not let the state be taken (a warning said why): no entry at c, and
                self.split = False  # the next chunks run two forwards
                self.stats.add("split_failures")
            if end in cuts:
                self._checkpoint(req, end, cuts[end])
            pos = end
        for c in sorted(set(cuts) | {end}):
            if c <= pos:
                continue
            logits = self._forward(req, pos, c)
            pos = c
            if c in cuts:
                self._checkpoint(req, c, cuts[c])
        req.computed_tokens += end - start
        self.stats.add("computed_tokens", end - start)
        if end == n_prompt:
            req.status = Status.DECODE
            self._emit(req, logits[-1])
        return end - start

    def _forward(self, req: Request, start: int, end: int, phase: str = "prefill_forward",
                 split_at: Optional[int] = None):
        """Run positions ``[start, end)`` on the request's model cache and write their KV to T0.
        ``split_at``: also take the state after that position; returns ``(logits, SplitStates)`` then."""
        if self.swa is not None:
            # a sliding layer keeps only its last ``window`` tokens: run pieces no longer than that and
            # export each one's SWA KV right after it
            w = self.swa.spec.window
            for s in range(start, end, w):
                e = min(end, s + w)
                ids = torch.tensor(req.tokens[s:e], dtype=torch.long, device=self.device)
                with self._phase(phase):
                    logits, _ = forward_chunk(self.model, req.model_cache, ids, s)
                with self._phase("export_kv"):
                    self.adapter.export_kv(req.model_cache, self.swa, self._on_host(req, "swa_kv_indices"), s, e)
                    self.adapter.export_kv(req.model_cache, self.kv, self._on_host(req, "kv_indices"), s, e)
            self.stats.add("t0_kv_write_bytes", (end - start) * (self.kv_token_bytes + self.swa.entry_bytes
                                                                 // self.cfg.page_size))
            req.filled = end
            return logits
        ids = torch.tensor(req.tokens[start:end], dtype=torch.long, device=self.device)
        rule = self.prefill_rule.active() if self.prefill_rule is not None and end - start > 1 else _NO_PHASE
        with self._phase(phase), rule:
            if split_at is not None:
                from tiered_cache.engine.split_forward import forward_chunk_split

                logits, _, states = forward_chunk_split(self.model, req.model_cache, ids, start, split_at)
            else:
                logits, _ = forward_chunk(self.model, req.model_cache, ids, start)
        self._ran(req, start, end)
        return logits if split_at is None else (logits, states)

    def _ran(self, req: Request, start: int, end: int) -> None:
        """Positions ``[start, end)`` ran on the request's model cache: their KV goes to T0."""
        if self.cache is not None:
            with self._phase("export_kv"):
                self.adapter.export_kv(req.model_cache, self.kv, self._on_host(req, "kv_indices"), start, end)
            self.stats.add("t0_kv_write_bytes", (end - start) * self.kv_token_bytes)
        req.filled = end

    @staticmethod
    def _on_host(req: Request, name: str) -> Optional[torch.Tensor]:
        """``req.<name>`` (``kv_indices``, ``swa_kv_indices``, ``mamba_pool_idx``) on the host, copied once
        each time the tensor is replaced (admission, a checkpoint that hands pages to the tree): the
        adapter then checks and translates those ids on the allocator's host table, with no wait for the
        device."""
        src = getattr(req, name)
        if src is None:
            return None
        held = req.host_copies.get(name)
        if held is None or held[0] is not src:
            held = req.host_copies[name] = (src, src.cpu())
        return held[1]

    def _checkpoint(self, req: Request, pos: int, kind: str, states=None) -> None:
        """Export the state after ``pos`` tokens to the request's T0 slot and cache the prefix there.
        ``states``: that state as a split forward took it (default: the model cache's, at its end)."""
        with self._phase("checkpoint"):
            self._checkpoint_now(req, pos, kind, states)

    def _checkpoint_now(self, req: Request, pos: int, kind: str, states=None) -> None:
        if states is not None:
            self.adapter.export_split_state(states, self.states, self._on_host(req, "mamba_pool_idx"))
            self.stats.add("t0_state_write_bytes", self.states.entry_bytes)
        elif self.states is not None:
            self.adapter.export_state(req.model_cache, self.states, self._on_host(req, "mamba_pool_idx"))
            self.stats.add("t0_state_write_bytes", self.states.entry_bytes)
        req.slot_pos = pos
        before = req.cache_protected_len
        view = self._view(req, pos)
        self.cache.cache_unfinished_req(view, chunked=True)
        req.swa_kv_indices = getattr(view, "swa_kv_indices", None)
        req.kv_indices, req.last_node = view.kv_indices, view.last_node
        req.cache_protected_len, req.prefix_indices = view.cache_protected_len, view.prefix_indices
        if req.cache_protected_len > before:
            self.stats.add("checkpoints")
            self.stats.add(f"{kind}_checkpoints")

    def _view(self, req: Request, n: int) -> CacheReq:
        """The request as the cache's ``cache_*_req`` see it, with its first ``n`` tokens written."""
        view = CacheReq(token_ids=req.tokens[:n], kv_indices=req.kv_indices,
                        mamba_pool_idx=req.mamba_pool_idx, last_node=req.last_node,
                        cache_protected_len=req.cache_protected_len, prefix_indices=req.prefix_indices,
                        extra_key=req.extra_key)
        if self.swa is not None:  # HiSWARadixCache reads the SWA ids beside the KV ids (none slid out)
            view.swa_kv_indices, view.swa_evicted_seqlen = req.swa_kv_indices, 0
        return view

    # ------------------------------------------------------------------------------ decode
    def _decode(self, req: Request) -> None:
        pos = req.filled
        logits = self._forward(req, pos, pos + 1, "decode_forward")
        self.stats.add("decode_forwards")
        self._decoded(req, logits[-1])

    def _decode_batch(self, reqs: list[Request]) -> None:
        """One decode token for each of ``reqs`` in one forward (``cfg.decode_batch``) or one step of the
        graph decoder (``cfg.decode_graphs``)."""
        self._decode_land(reqs, self._decode_launch(reqs))

    def _decode_launch(self, reqs: list[Request]) -> Optional[torch.Tensor]:
        """``_decode_batch``'s forward and KV exports, queued on the device; nothing is read back. Returns
        the logits for ``_decode_land``, or None where the step ran whole (one request, no graphs)."""
        if len(reqs) == 1 and self.graph_decoder is None:
            self._decode(reqs[0])
            return None
        pos = [r.filled for r in reqs]
        caches, toks = [r.model_cache for r in reqs], [r.tokens[p] for r, p in zip(reqs, pos)]
        with self._phase("decode_forward"):
            if self.graph_decoder is not None:
                logits = self.graph_decoder.step(caches, toks, pos)
            else:
                logits = decode_batch(self.model, caches, toks, pos)
        self.stats.add("decode_forwards")
        for req, p in zip(reqs, pos):
            self._ran(req, p, p + 1)
        return logits

    def _decode_land(self, reqs: list[Request], logits: Optional[torch.Tensor]) -> None:
        """Read the launched step's picks back (one read for the batch), then checkpoint and emit."""
        if logits is None:
            return
        with self._phase("emit"):
            picks = logits.argmax(-1).tolist()
        for req, row, am in zip(reqs, logits, picks):
            self._decoded(req, row, am)

    def _decoded(self, req: Request, row: torch.Tensor, am: Optional[int] = None) -> None:
        """After ``req``'s decode token ran (``req.filled`` counts it): checkpoint, then emit ``row``."""
        self.stats.add("decode_tokens")
        if self.states is not None and req.filled % self.unit == 0:
            # Keep the state at the last aligned position: the turn is cached up to there at finish
            # (a state is valid at one position only, and only page-aligned prefixes are cached).
            with self._phase("checkpoint"):
                self.adapter.export_state(req.model_cache, self.states, self._on_host(req, "mamba_pool_idx"))
            self.stats.add("t0_state_write_bytes", self.states.entry_bytes)
            self.stats.add("decode_checkpoints")
            req.slot_pos = req.filled
        self._emit(req, row, am)

    def _emit(self, req: Request, row: torch.Tensor, am: Optional[int] = None) -> None:
        """The model's next-token distribution ``row``: pick (greedy, or the forced token) and record.
        ``am``: ``row``'s argmax when the caller has read it back already (a batch's, in one go)."""
        if am is None:
            with self._phase("emit"):
                am = int(row.argmax())
        i = len(req.output)
        tok = am if req.forced_output is None else int(req.forced_output[i])
        req.output.append(tok)
        req.argmax.append(am)
        req.tokens.append(tok)
        if req.record_logits:
            req.logits.append(row.detach().float().cpu().clone())
        if i == 0:
            req.t_first_token = time.perf_counter()
            self.stats.ttft.append(req.ttft)
            self.stats.ttft_admitted.append(req.ttft_admitted)
        if len(req.output) >= req.max_new_tokens:
            self._finish(req)

    # ------------------------------------------------------------------------------ finish
    def _finish(self, req: Request) -> None:
        if self.cache is not None:
            # Cache the turn up to the state the slot holds (the last aligned position written);
            # cache_finished_req frees the rest of the request's pages, its slot and its lock.
            assert req.slot_pos >= req.cache_protected_len
            # SWA: no state, every written position's KV is in T0
            with self._phase("finish"):
                self.cache.cache_finished_req(self._view(req, req.filled if self.swa is not None else req.slot_pos))
            req.swa_kv_indices = None
            req.mamba_pool_idx, req.last_node, req.cache_protected_len = None, None, 0
        self._drop(req, Status.FINISHED)
        self.stats.add("finished")

    def _release(self, req: Request) -> None:
        """Give back everything a running request holds (abort, failed admission): its own pages, its
        T0 slot, its lock; nothing of it is cached."""
        self._wait_load_back(req)
        self.cache.cache_finished_req(self._view(req, req.cache_protected_len), is_insert=False)
        req.mamba_pool_idx, req.last_node, req.cache_protected_len = None, None, 0
        req.kv_indices = req.prefix_indices = req.swa_kv_indices = None
        req.host_copies.clear()

    def _drop(self, req: Request, status: Status) -> None:
        req.status = status
        req.t_finish = time.perf_counter()
        req.model_cache = None
        req.kv_indices = req.prefix_indices = None
        req.host_copies.clear()
        self.running.remove(req)

    # ------------------------------------------------------------------------------ checks
    def request_owned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(KV ids, T0 state slots) the running requests own (not the tree's)."""
        kv = [r.kv_indices[r.cache_protected_len:] for r in self.running if r.kv_indices is not None]
        st = [r.mamba_pool_idx.reshape(-1) for r in self.running if r.mamba_pool_idx is not None]
        if self.swa is not None:  # SWA mode: the requests' own SWA ids stand where the state slots do
            st = [r.swa_kv_indices[r.cache_protected_len:] for r in self.running if r.swa_kv_indices is not None]
        device = self.kv.device
        cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.int64, device=device)
        return cat(kv), cat(st)

    def check_invariants(self) -> None:
        """Every slot of every pool is free, cached by the tree or owned by a running request."""
        if self.cache is None:
            return
        kv, st = self.request_owned()
        self.cache.check_invariants(request_kv=kv, request_states=st)

    def reset_cache(self) -> dict[str, int]:
        """Drop the whole tree (the engine must be idle); returns the pools' free sizes after it."""
        if self.running:
            raise InvalidArgumentError("engine", "no running requests", len(self.running))
        if self.cache is None:
            return {}
        self.cache.reset()
        return self.free_sizes()

    def stats_dict(self) -> dict:
        out = self.stats.as_dict(self.ckpt, self.transfer)
        if isinstance(getattr(self.cache, "policy", None), CountingLRUPolicy):
            out["evictions"] = dict(self.cache.policy.counts)  # victims per resource (tier)
        if self.storage is not None:
            t3 = {k[3:]: v for k, v in self.cache.stats.items() if k.startswith("t3_")}
            t3["tier"] = dict(self.storage.stats)
            out["T3"] = t3
        if self.prefill_rule is not None:
            out["graph_prefill"] = dict(self.prefill_rule.stats, graphs=len(self.prefill_rule.entries),
                                        capture_error=self.prefill_rule.capture_error)
        return out
