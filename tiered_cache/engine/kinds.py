"""What the engine does differently for the two kinds of hybrid: one object per kind, so the scheduler
asks its kind and never which kind it runs.

A state model (linear-attention layers: Qwen3-Next, Mamba2 hybrids; Lfm2's short convs, whose state is a
conv window alone) resumes only from a state saved at exactly the resume position: each running request
holds a T0 state slot, the state is exported into it at every position the tree caches, and the tree
takes it into T1. An SWA model (sliding-window layers: Gemma3) has no state: a resume needs the last
``window`` tokens' SWA KV, which the request holds in T0 beside its full KV, so every page it writes is
cacheable. (A model sliding on every layer, Mistral's ``sliding_window``, is an SWA model whose first
layer is the full side: ``ModelSpecs.full_window``.)::

                          StateKind                                SWAKind
    T0 a request holds    a state slot + KV pages                  SWA KV pages + KV pages
    a forward runs        the whole chunk                          pieces of at most ``window`` tokens, each
                                                                   one's SWA KV exported before it slides out
    cached during prefill the branch point, aligned chunk ends,    every chunk end
                          the tree's mid-chunk positions, block
                          boundaries (``block`` admission)
    decode keeps          the state at every checkpoint unit       nothing more (its KV is in T0)
    a finished turn       up to the last state (``slot_pos``)      up to the last token written

Both write the full-attention KV of every position they run to T0 (``export_kv``), and both hold a
request's side of the tree's protocol (SGLang's): ``admit`` (match_prefix with cow_mamba, init_load_back
for a host hit, inc_lock_ref, the request's T0 room reserved), ``cache_prefix`` (cache_unfinished_req),
``finish`` (cache_finished_req) and ``release`` (everything given back, nothing cached).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Optional

import torch

from tiered_cache.engine.adapters import HybridCacheAdapter
from tiered_cache.engine.request import Request
from tiered_cache.errors import InvalidArgumentError, MemoryBudgetError
from tiered_cache.radix import (
    CacheReq,
    HiMambaRadixCache,
    InitLoadBackParams,
    MatchPrefixParams,
    MatchResult,
    RadixKey,
)
from tiered_cache.stack import TieredCache


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


@dataclasses.dataclass
class SWACacheReq(CacheReq):
    """``CacheReq`` with what ``HiSWARadixCache`` also reads: the request's SWA KV ids beside its KV ids,
    and how many leading positions' SWA KV it freed itself (none here: the engine keeps them all)."""

    swa_kv_indices: Optional[torch.Tensor] = None
    swa_evicted_seqlen: int = 0


class Kind(ABC):
    """The part both kinds share: the full-attention KV in T0 and the request's side of the tree's
    protocol. ``phase``: the engine's phase clock (``EngineConfig.phase_timing``)."""

    def __init__(self, tiers: TieredCache, adapter: HybridCacheAdapter, phase: Callable) -> None:
        self.tiers, self.tree, self.adapter, self.kv, self._phase = tiers, tiers.tree, adapter, tiers.kv, phase
        self.page_size = tiers.page_size
        self.kv_token_bytes = self.kv.entry_bytes // self.page_size  # T0 bytes of one token's full KV

    # ------------------------------------------------------------------------------ the tree
    def admit(self, req: Request) -> bool:
        """Match, load back, lock, reserve the request's whole KV (prompt + max_new_tokens) and the rest
        of its T0 room. False: no room now, and nothing is held. With a host hit ``req.load_back`` tracks
        the copy; the request may resume once it is done."""
        tree, n = self.tree, len(req.tokens)
        # Leave one prompt token to compute: the first output token needs its logits.
        m = tree.match_prefix(MatchPrefixParams(key=RadixKey(req.tokens[:n - 1], req.extra_key), cow_mamba=True,
                                                req=req))
        prefix, node = m.device_indices, m.last_device_node
        host_hit, state_from_host, loaded = 0, False, False
        if m.host_hit_length > 0:
            # T2: the tree starts copying the host part of the match into fresh T0 pages, and the state
            # at its end into the request's T0 slot; ``req.load_back`` tracks the transfer.
            ids, node = tree.init_load_back(InitLoadBackParams(
                best_match_node=m.best_match_node, host_hit_length=m.host_hit_length, req=req))
            if len(ids):
                prefix, loaded = torch.cat([prefix, ids]), True
                # ``ids`` also covers path KV still on the device; what came from T2 is what moved.
                host_hit = req.load_back.host_kv_bytes // self.kv_token_bytes
                state_from_host = req.load_back.loads_state
        tree.inc_lock_ref(node)
        p = len(prefix)
        req.last_node, req.cache_protected_len, req.prefix_indices = node, p, prefix
        req.kv_indices = prefix
        self.hold_prefix(req, m, loaded)
        new = self.reserve(req, _ceil(n + req.max_new_tokens, self.page_size) - p)
        if new is None:
            self.release(req)
            return False
        req.kv_indices = torch.cat([prefix, new])
        req.filled = req.slot_pos = p
        b = m.mamba_branching_seqlen
        req.branching = b if b is not None and b > p else None
        req.reused_tokens, req.reused_host_tokens = p, host_hit
        req.state_tier = self.hit_tier(state_from_host, loaded) if p else "miss"
        return True

    def abort(self, req: Request) -> None:
        """End a running request: its T3 prefetch cancelled, everything it holds released."""
        self.tree.cancel_prefetch(req)
        self.release(req)

    def too_large(self, req: Request) -> MemoryBudgetError:
        """The error for a request that does not fit in T0 even with nothing else running."""
        need, tb = _ceil(len(req.tokens) + req.max_new_tokens, self.page_size), self.kv_token_bytes
        return MemoryBudgetError(f"request {req.rid!r} ({need} KV tokens + one state) in T0", need * tb,
                                 self.kv.available_size() * tb, "the prompt and max_new_tokens (or raise kv_pages)")

    def cache_prefix(self, req: Request, pos: int) -> bool:
        """Insert the request's first ``pos`` tokens (its state, if any, saved in its slot for ``pos``):
        the tree takes what it did not hold and the request keeps its lock on the new end. Returns whether
        the tree's part of the request grew."""
        req.slot_pos = pos
        before = req.cache_protected_len
        view = self.view(req, pos)
        self.tree.cache_unfinished_req(view, chunked=True)
        req.swa_kv_indices = view.swa_kv_indices if isinstance(view, SWACacheReq) else None
        req.kv_indices, req.last_node = view.kv_indices, view.last_node
        req.cache_protected_len, req.prefix_indices = view.cache_protected_len, view.prefix_indices
        return req.cache_protected_len > before

    def finish(self, req: Request) -> None:
        """Cache the turn as far as its kind can resume it; the tree frees the rest of the request's
        pages, its slot and its lock."""
        assert req.slot_pos >= req.cache_protected_len
        self.tree.cache_finished_req(self.view(req, self.finished_len(req)))
        req.swa_kv_indices = None
        req.mamba_pool_idx, req.last_node, req.cache_protected_len = None, None, 0

    def release(self, req: Request) -> None:
        """Give back everything a running request holds (abort, failed admission, a corrupt load back):
        its own pages, its T0 slot, its lock; nothing of it is cached. A host load still writing its pages
        is waited for first."""
        handle, req.load_back = req.load_back, None
        with self._phase("load_wait"):
            while handle is not None and not handle.done:
                self.tree.check_hicache_events()
        self.tree.cache_finished_req(self.view(req, req.cache_protected_len), is_insert=False)
        req.mamba_pool_idx, req.last_node, req.cache_protected_len = None, None, 0
        req.kv_indices = req.prefix_indices = req.swa_kv_indices = None
        req.host_copies.clear()

    def owned(self, running: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
        """(KV ids, T0 state slots or SWA ids) the running requests own, not the tree (``check_invariants``)."""
        kv = [r.kv_indices[r.cache_protected_len:] for r in running if r.kv_indices is not None]
        cat = lambda xs: torch.cat(xs) if xs else torch.empty(0, dtype=torch.int64, device=self.kv.device)
        return cat(kv), cat(self.own_slots(running))

    # ------------------------------------------------------------------------------ per kind
    @abstractmethod
    def hit_tier(self, state_from_host: bool, loaded: bool) -> str:
        """Where a hit's resume point came from (``Request.state_tier``): ``state_from_host``: the load back
        brought the state; ``loaded``: a load back brought part of the prefix."""

    @abstractmethod
    def hold_prefix(self, req: Request, m: MatchResult, loaded: bool) -> None:
        """Set the matched prefix's ids the kind holds beside its KV ids (``loaded``: a load back brings more)."""

    @abstractmethod
    def reserve(self, req: Request, n: int) -> Optional[torch.Tensor]:
        """The request's own T0 room: ``n`` KV token ids and what its kind holds beside them; None: no room."""

    @abstractmethod
    def finished_len(self, req: Request) -> int:
        """Tokens of a finished turn the tree caches."""

    @abstractmethod
    def own_slots(self, running: list[Request]) -> list[torch.Tensor]:
        """What running requests own of the kind's own T0 side (for ``check_invariants``)."""

    @abstractmethod
    def cuts(self, req: Request, start: int, end: int) -> dict[int, str]:
        """Where the chunk ``[start, end)`` caches its prefix: position -> why (``branch``, ``mid``, ``end``)."""

    @abstractmethod
    def resume(self, req: Request, n: int) -> tuple[object, int]:
        """A model cache holding the request's first ``n`` tokens from T0; returns it and the state bytes read."""

    @abstractmethod
    def save_state(self, req: Request, states=None) -> int:
        """Save what a resume at the model cache's end needs beyond its KV; returns bytes written."""

    @abstractmethod
    def keeps_decode_state(self, req: Request) -> bool:
        """Whether the state after the decode token just run is kept (``save_state``)."""

    # ------------------------------------------------------------------------------ T0
    def pieces(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The forwards positions ``[start, end)`` run as, each followed by its ``export_kv``."""
        return ((start, end),)

    def export_kv(self, req: Request, start: int, end: int) -> int:
        """Positions ``[start, end)`` ran on the request's model cache: write their KV to T0. Returns bytes."""
        self.adapter.export_kv(req.model_cache, self.kv, req.on_host("kv_indices"), start, end)
        return (end - start) * self.kv_token_bytes

    def view(self, req: Request, n: int, cls: type[CacheReq] = CacheReq, **extra) -> CacheReq:
        """The request as the tree's ``cache_*_req`` see it, with its first ``n`` tokens written (a ``cls``,
        with ``extra`` fields: what the kind's tree also reads)."""
        return cls(token_ids=req.tokens[:n], kv_indices=req.held("kv_indices"), mamba_pool_idx=req.mamba_pool_idx,
                   last_node=req.last_node, cache_protected_len=req.cache_protected_len,
                   prefix_indices=req.prefix_indices, extra_key=req.extra_key, **extra)


class StateKind(Kind):
    """A model with linear-attention layers: KV + one recurrent state per request."""

    tree: HiMambaRadixCache

    def __init__(self, tiers: TieredCache, adapter: HybridCacheAdapter, phase: Callable) -> None:
        super().__init__(tiers, adapter, phase)
        states, tree = tiers.states, tiers.tree
        if states is None or not isinstance(tree, HiMambaRadixCache):
            raise InvalidArgumentError("tiers", "the TieredCache of a model with recurrent states", type(tree).__name__)
        self.states, self.tree = states, tree
        self.unit = tiers.checkpoint_unit  # tokens between cached states
        cfg = tiers.config  # the tree's admission was built from it: block boundaries are offered for ``block``
        self.block: Optional[int] = cfg.admission_block if cfg.state_admission == "block" else None

    def cuts(self, req: Request, start: int, end: int) -> dict[int, str]:
        """Where a state is exported and cached during the chunk ``[start, end)``: position -> why. The
        tree's rule says where a chunk may export one mid-way; an aligned chunk end is itself cacheable,
        so the mid-chunk positions are used only for the unaligned last chunk (where it matters: the next
        turn of a conversation resumes there). With the tree's ``block`` admission every block boundary
        inside the chunk is offered too (one split forward takes them all): the admission keeps
        those states, and a chunk end alone would offer them only where a chunk happens to end."""
        cuts: dict[int, str] = {}
        b = req.branching
        if b is not None and start < b <= end:
            cuts[b] = "branch"
        if self.block is not None:
            for p in range(start // self.block * self.block + self.block, end, self.block):
                cuts.setdefault(p, "block")
        if end % self.page_size:
            for p in self.tree.checkpoint_positions(start, end):
                cuts.setdefault(p, "mid")
        else:
            cuts.setdefault(end, "end")
        return cuts

    def hit_tier(self, state_from_host: bool, loaded: bool) -> str:
        """The state the request resumes from: copied from T1, or loaded back from T2."""
        return "T2" if state_from_host else "T1"

    def hold_prefix(self, req: Request, m: MatchResult, loaded: bool) -> None:
        """The matched prefix's ids beside its KV ids: a state model has none (the state is in its slot)."""

    def reserve(self, req: Request, n: int) -> Optional[torch.Tensor]:
        """The request's own T0 room: its state slot (unless the match copied the state into one) and
        ``n`` KV token ids, evicting for both. None when there is no room (the caller releases what is held)."""
        if req.mamba_pool_idx is None:
            req.mamba_pool_idx = self.tiers.alloc_states(1)
        return None if req.mamba_pool_idx is None else self.tiers.alloc_kv(n)

    def resume(self, req: Request, n: int) -> tuple[object, int]:
        """A model cache holding the first ``n`` tokens from T0 (their KV pages, the state in the slot);
        returns it and the state bytes read."""
        cache = self.adapter.build_cache(self.kv, req.on_host("kv_indices"), self.states,
                                         req.on_host("mamba_pool_idx"), n_tokens=n)
        return cache, self.states.entry_bytes

    def save_state(self, req: Request, states=None) -> int:
        """Export the state into the request's T0 slot: the model cache's (at its end) or ``states``, the
        one a split forward took inside it. Returns bytes written."""
        slot = req.on_host("mamba_pool_idx")
        if states is not None:
            self.adapter.export_split_state(states, self.states, slot)
        else:
            self.adapter.export_state(req.model_cache, self.states, slot)
        return self.states.entry_bytes

    def keeps_decode_state(self, req: Request) -> bool:
        """Whether the state after the decode token just run is kept (``save_state``): at every checkpoint
        unit, so the turn is cached up to there at finish (a state is valid at one position only, and only
        page-aligned prefixes are cached)."""
        return req.filled % self.unit == 0

    def finished_len(self, req: Request) -> int:
        """Tokens of a finished turn the tree caches: up to the state the slot holds."""
        return req.slot_pos

    def own_slots(self, running: list[Request]) -> list[torch.Tensor]:
        """The T0 state slots running requests own (for ``check_invariants``)."""
        return [r.mamba_pool_idx.reshape(-1) for r in running if r.mamba_pool_idx is not None]


class SWAKind(Kind):
    """A model with sliding-window layers: full KV + SWA KV per request, no state."""

    def __init__(self, tiers: TieredCache, adapter: HybridCacheAdapter, phase: Callable) -> None:
        super().__init__(tiers, adapter, phase)
        swa = tiers.swa
        if swa is None:
            raise InvalidArgumentError("tiers", "the TieredCache of a model with sliding-window layers", None)
        self.swa = swa
        self.window = swa.spec.window
        self.unit = self.page_size

    def pieces(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """A sliding layer keeps only its last ``window`` tokens: pieces no longer than that, each one's
        SWA KV exported right after it."""
        return tuple((s, min(end, s + self.window)) for s in range(start, end, self.window))

    def export_kv(self, req: Request, start: int, end: int) -> int:
        self.adapter.export_kv(req.model_cache, self.swa, req.on_host("swa_kv_indices"), start, end)
        return super().export_kv(req, start, end) + (end - start) * (self.swa.entry_bytes // self.page_size)

    def cuts(self, req: Request, start: int, end: int) -> dict[int, str]:
        """Every written position's KV is in T0: the chunk's aligned part is cached at its end."""
        return {end: "end"}

    def hit_tier(self, state_from_host: bool, loaded: bool) -> str:
        """No state: the resume needs the last ``window`` tokens' SWA KV, at the end of the match, which is
        the part a load back brings from T2 when there is one, and in T0 otherwise."""
        return "T2_swa" if loaded else "T0_swa"

    def hold_prefix(self, req: Request, m: MatchResult, loaded: bool) -> None:
        """The matched prefix's SWA KV ids beside its KV ids (``loaded``: with those the load back brings)."""
        ids = m.swa_device_indices
        if ids is not None and loaded:
            ids = torch.cat([ids, req.load_back.swa_indices])
        req.swa_kv_indices = ids

    def reserve(self, req: Request, n: int) -> Optional[torch.Tensor]:
        """``n`` SWA KV and ``n`` KV token ids of T0 for the request, evicting for both; None (and nothing
        taken) when there is no room."""
        new_swa = self.tiers.alloc_swa(n)
        if new_swa is None:
            return None
        new = self.tiers.alloc_kv(n)
        if new is None:
            self.swa.free(new_swa)
            return None
        req.swa_kv_indices = torch.cat([req.held("swa_kv_indices"), new_swa])
        return new

    def resume(self, req: Request, n: int) -> tuple[object, int]:
        cache = self.adapter.build_cache(self.kv, req.on_host("kv_indices"), n_tokens=n, swa_side=self.swa,
                                         swa_token_ids=req.on_host("swa_kv_indices"))
        return cache, 0

    def save_state(self, req: Request, states=None) -> int:
        return 0  # its SWA KV, exported with each piece, is what a resume needs

    def keeps_decode_state(self, req: Request) -> bool:
        return False

    def finished_len(self, req: Request) -> int:
        return req.filled  # every written position's KV is in T0

    def own_slots(self, running: list[Request]) -> list[torch.Tensor]:
        """The T0 SWA ids running requests own (they stand where a state model's slots do)."""
        return [r.swa_kv_indices[r.cache_protected_len:] for r in running if r.swa_kv_indices is not None]

    def view(self, req: Request, n: int, cls: type[CacheReq] = SWACacheReq, **extra) -> CacheReq:
        return super().view(req, n, cls, swa_kv_indices=req.swa_kv_indices, **extra)  # none slid out


def kind_for(tiers: TieredCache, adapter: HybridCacheAdapter, phase: Callable) -> Kind:
    """The kind of ``tiers``: a state model's stack has a state side, an SWA model's an SWA side."""
    return (StateKind if tiers.states is not None else SWAKind)(tiers, adapter, phase)
