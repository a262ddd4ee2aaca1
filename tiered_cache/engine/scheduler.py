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
the step's prefill chunks (their launches overlap its device time) and read back after them. The
forwards themselves are the model runner's (``runner.model_runner.ModelRunner``).

A running request computes on its own ``transformers`` cache (the "kernel workspace"); the pools are
the source of truth for everything cached: a hit rebuilds the model cache from T0 KV pages and the
state the tree copied into the request's T0 slot (from T1, or T2 through ``init_load_back``). The
engine reserves a request's whole KV (prompt + max_new_tokens) at admission, so there is no
preemption; a request that does not fit waits, after the tree evicted what it could.

The tiers are a ``TieredCache`` (``tiered_cache.stack``), built from ``EngineConfig.cache``; what
differs between a state model and an SWA model is its kind's (``kinds.StateKind`` / ``SWAKind``).
``use_cache=False`` is the no-cache baseline: the same chunked prefill and decode, no pools at all.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Optional

import torch

from tiered_cache.engine.adapters import HybridCacheAdapter
from tiered_cache.engine.config import EngineConfig
from tiered_cache.engine.kinds import kind_for
from tiered_cache.engine.model_specs import spec_for
from tiered_cache.engine.models import weights_id
from tiered_cache.engine.request import Request, Status
from tiered_cache.engine.runner.model_runner import ModelRunner
from tiered_cache.engine.stats import EngineStats, PhaseClock
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.stack import TieredCache
from tiered_cache.validate import float_arg


class Engine:
    """Serves ``Request``s on ``model`` (a tiny hybrid from ``engine.models``) through the tiered cache.

    ``submit`` queues a request; ``step`` runs one scheduling step and returns the requests that
    finished in it; ``abort`` ends a request wherever it is (its locks, slots and pages released);
    ``run`` steps until nothing is left. ``stats_dict`` reports hits, tokens, bytes and TTFT.
    ``tiers``: the ``TieredCache`` (None without ``use_cache``); ``cache``: its radix tree. ``tp``: this rank's
    ``parallel.TPGroup`` (tiers hold its share of the heads and agree each step: docs/tensor-parallel.md).
    """

    def __init__(self, model, config: Optional[EngineConfig] = None, tp: Any = None) -> None:
        self.model = model
        self.cfg = cfg = config or EngineConfig()
        self.device = model.device
        # The no-cache baseline needs no pools, so no specs: a family the tiers refuse still runs it.
        self.specs = spec_for(model, cfg.page_size) if cfg.use_cache else None
        self.adapter = HybridCacheAdapter(model, self.specs, tp=tp) if self.specs is not None else None
        self.runner = ModelRunner(model, self.specs, cfg)
        self.stats = EngineStats()
        self._phase = PhaseClock(self.stats.phase_s, self.device, on=cfg.phase_timing)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.tiers: Optional[TieredCache] = None
        self.cache = self.kind = None
        if self.specs is not None and self.adapter is not None:  # use_cache
            model_id = None if cfg.cache.storage_url is None else cfg.storage_model_id or weights_id(model)
            self.tiers = TieredCache.build(cfg.cache, kv=self.specs.full, state=self.specs.state, swa=self.specs.swa,
                                           device=self.device, model_id=model_id, tp=tp)
            self.cache, self.kind = self.tiers.tree, kind_for(self.tiers, self.adapter, self._phase)
            self.runner.quiesce_with(self.tiers.transfer)  # no transfer in flight while a CUDA graph captures
            self.initial_free = self.free_sizes()

    def close(self) -> None:
        """Stop T3's workers and close its backend (nothing else holds outside resources)."""
        if self.tiers is not None:
            self.tiers.close()

    def free_sizes(self) -> dict[str, int]:
        """Free room per pool (T0, T1, T2): the run must end where it began."""
        return {} if self.tiers is None else self.tiers.free_sizes()

    # ----------------------------------------------------------------------------- requests
    def submit(self, req: Request, arrival: Optional[float] = None) -> None:
        """Queue ``req``. ``arrival``: when it arrived, as a ``time.perf_counter()`` stamp (default now),
        for a front end that hands over requests between steps: a request that waited for a step to end
        counts that wait in its TTFT."""
        if req.status is not Status.WAITING or req.output:
            raise InvalidArgumentError("req", "a new request", req.status)
        t = time.perf_counter()  # a stamp from the future is refused
        req.t_arrival = t if arrival is None else float_arg("arrival", arrival, hi=t)
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
                if self.kind is not None:
                    self.kind.abort(req)
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
        self._poll_events()
        self._admit_waiting()
        finished: list[Request] = []
        budget, ps = self.cfg.prefill_budget, self.cfg.page_size
        batched = self.runner.batched
        # The batched decode goes first, queued: the prefill chunks' launches below overlap its GPU time,
        # and its tokens are read back after them, in one read.
        decoding = [r for r in self.running if r.status is Status.DECODE] if batched else []
        queued = self._decode_launch(decoding) if decoding else None
        for req in list(self.running):
            if req.status is Status.PREFILL:
                if budget < ps:
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
                if req.status is Status.PREFILL and req in self.running and budget >= ps:
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
                if not self.running and self.kind is not None:  # (the no-cache baseline always admits)
                    raise self.kind.too_large(req)
                return  # first come, first served: wait until running requests give room back
            self.waiting.popleft()
            self.running.append(req)
            req.t_admitted = time.perf_counter()
            self.stats.admitted(req)

    # ------------------------------------------------------------------------------- admit
    def _admit(self, req: Request) -> bool:
        """Match, load back, lock, reserve. False: no room now, and nothing is held."""
        if self.kind is not None and not self.kind.admit(req):
            return False
        if req.load_back is not None and not req.load_back.done:
            req.status = Status.LOADING  # the step's other work overlaps the copy; it resumes when it lands
        else:
            self._start_prefill(req)
        return True

    def _start_prefill(self, req: Request) -> bool:
        """The request's prefix is on the device: build its model cache from the pools. False when the
        load back arrived corrupt (the tree dropped that host copy): the request is released."""
        handle, req.load_back = req.load_back, None
        if handle is not None and not handle.ok and self.kind is not None:
            self.stats.add("load_back_failures")
            self.kind.release(req)
            return False
        st, p = self.stats, req.cache_protected_len
        if p and self.kind is not None:
            with self._phase("build_cache"):
                req.model_cache, state_bytes = self.kind.resume(req, p)
            st.add("t0_kv_read_bytes", p * self.kind.kv_token_bytes)
            if state_bytes:
                st.add("t0_state_read_bytes", state_bytes)
        else:
            req.model_cache = self.runner.new_cache()
        st.resumed(req)
        req.status = Status.PREFILL
        return True

    def _poll_events(self) -> None:
        """Apply finished host transfers to the tree; requests whose load back landed start their prefill;
        a corrupt one goes back to the front of the queue and matches again (the bad host copy is gone:
        it recomputes that part)."""
        if self.cache is None:
            return
        with self._phase("events"):
            self.cache.check_hicache_events()
            for req in [r for r in self.running if r.status is Status.LOADING]:
                if not req.load_back.done or self._start_prefill(req):
                    continue
                self.running.remove(req)
                self.stats.admitted(req, -1)
                req.status, req.state_tier = Status.WAITING, "miss"
                req.reused_tokens = req.reused_host_tokens = 0
                self.waiting.appendleft(req)

    # ----------------------------------------------------------------------------- prefill
    def _prefill_chunk(self, req: Request, budget: int) -> int:
        """Run one prefill chunk of ``req``, caching states where its kind says; returns the tokens it computed."""
        ps, n_prompt = self.cfg.page_size, len(req.prompt)
        start = req.filled
        end = min(n_prompt, start + min(self.cfg.chunk_size, budget // ps * ps))
        cuts = {} if self.kind is None else self.kind.cuts(req, start, end)  # position -> what it is
        pos, inside = start, sorted(c for c in cuts if start < c < end)
        if self.runner.split and inside:  # one forward; the state at each cut is taken inside it
            logits, states = self._forward(req, start, end, split_at=tuple(inside))
            if states is not None:
                self.stats.add("split_forwards")
                self.stats.add("split_states", len(inside))
                for c, st in zip(inside, states, strict=True):
                    self._checkpoint(req, c, cuts[c], st)
            else:  # the model did not let the states be taken (a warning said why): no entry at the cuts,
                self.stats.add("split_failures")  # and the runner's next chunks run a forward per part
            if end in cuts:
                self._checkpoint(req, end, cuts[end])
            pos = end
        for c in sorted(set(cuts) | {end}):
            if c <= pos:
                continue
            logits, _ = self._forward(req, pos, c)
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
                 split_at: Optional[tuple[int, ...]] = None):
        """Run positions ``[start, end)`` on the request's model cache (in its kind's pieces) and write
        their KV to T0. Returns ``(logits, states)``: the states at the ``split_at`` positions, if asked for."""
        states = None
        for s, e in ((start, end),) if self.kind is None else self.kind.pieces(start, end):
            with self._phase(phase):
                logits, states = self.runner.prefill(req.model_cache, req.tokens[s:e], s, split_at)
            self._ran(req, s, e)
        return logits, states

    def _ran(self, req: Request, start: int, end: int) -> None:
        """Positions ``[start, end)`` ran on the request's model cache: their KV goes to T0."""
        if self.kind is not None:
            with self._phase("export_kv"):
                self.stats.add("t0_kv_write_bytes", self.kind.export_kv(req, start, end))
        req.filled = end

    def _checkpoint(self, req: Request, pos: int, what: str, states=None) -> None:
        """Export the state after ``pos`` tokens to the request's T0 slot and cache the prefix there.
        ``what``: why here (``branch``, ``mid``, ``end``: counted apart). ``states``: that state as a split
        forward took it (default: the model cache's, at its end)."""
        assert self.kind is not None  # a chunk has cuts only in a cached run
        with self._phase("checkpoint"):
            self.stats.add("t0_state_write_bytes", self.kind.save_state(req, states))
            grew = self.kind.cache_prefix(req, pos)
        self.stats.add("offered_checkpoints")  # the tree's admission may keep it or not
        if grew:
            self.stats.add("checkpoints")
            self.stats.add(f"{what}_checkpoints")

    # ------------------------------------------------------------------------------ decode
    def _decode(self, req: Request) -> None:
        pos = req.filled
        logits, _ = self._forward(req, pos, pos + 1, "decode_forward")
        self.stats.add("decode_forwards")
        self._decoded(req, logits[-1])

    def _decode_launch(self, reqs: list[Request]) -> Optional[torch.Tensor]:
        """One decode token for each of ``reqs`` in one forward, queued on the device with its KV exports;
        nothing is read back. Returns the logits for ``_decode_land``, or None where the step ran whole
        (as one-request forwards)."""
        if self.runner.decode_alone(len(reqs)):
            for req in reqs:
                self._decode(req)
            return None
        pos = [r.filled for r in reqs]
        with self._phase("decode_forward"):
            logits = self.runner.decode([r.model_cache for r in reqs], [r.tokens[p] for r, p in zip(reqs, pos)], pos)
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
        """After ``req``'s decode token ran (``req.filled`` counts it): keep its state if its kind says
        so (the turn is then cached up to there at finish), then emit ``row``."""
        self.stats.add("decode_tokens")
        if self.kind is not None and self.kind.keeps_decode_state(req):
            with self._phase("checkpoint"):
                self.stats.add("t0_state_write_bytes", self.kind.save_state(req))
            self.stats.add("decode_checkpoints")
            req.slot_pos = req.filled
        self._emit(req, row, am)

    def _emit(self, req: Request, row: torch.Tensor, am: Optional[int] = None) -> None:
        """The model's next-token distribution ``row``: pick (greedy, or the forced token) and record.
        ``am``: ``row``'s argmax when the caller has read it back already (a batch's, in one go)."""
        if am is None:
            with self._phase("emit"):
                am = int(row.argmax())
        if req.emit(am, row) == 0:
            self.stats.first_token(req)
        if len(req.output) >= req.max_new_tokens:
            self._finish(req)

    # ------------------------------------------------------------------------------ finish
    def _finish(self, req: Request) -> None:
        if self.kind is not None:
            with self._phase("finish"):
                self.kind.finish(req)
        self._drop(req, Status.FINISHED)
        self.stats.add("finished")

    def _drop(self, req: Request, status: Status) -> None:
        req.status = status
        req.t_finish = time.perf_counter()
        req.model_cache = None
        req.kv_indices = req.prefix_indices = None
        req.host_copies.clear()
        self.running.remove(req)

    # ------------------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Every slot of every pool is free, cached by the tree or owned by a running request."""
        if self.tiers is None or self.kind is None:
            return
        kv, st = self.kind.owned(self.running)
        self.tiers.check_invariants(request_kv=kv, request_states=st)

    def reset_cache(self) -> dict[str, int]:
        """Drop the whole tree (the engine must be idle); returns the pools' free sizes after it."""
        if self.running:
            raise InvalidArgumentError("engine", "no running requests", len(self.running))
        if self.cache is None:
            return {}
        self.cache.reset()
        return self.free_sizes()

    def stats_dict(self) -> dict:
        """Hits, tokens, bytes, TTFT, evictions per tier (``EngineStats.as_dict``) and the runner's counters."""
        out = self.stats.as_dict(None if self.tiers is None else self.tiers.stats())
        out.update(self.runner.stats())
        return out
