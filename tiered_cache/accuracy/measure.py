"""Recall accuracy of the trained models with their states through the tiers, and through codec twins.

Two ways in:

- ``engine_recall``: the reference engine (``engine.scheduler.Engine``) serves each sequence as two
  requests, as a chat would: the prefix (BOS, pairs, gap: ``task.query_start`` tokens, whole pages)
  first, so the tree caches its state; then the prefix and the queries, teacher-forced
  (``forced_output``: each query key, then its true value), resuming from the cached state wherever
  the config put it (T1, T2 after an eviction, T3 in a fresh engine over the same store). Scored: the
  argmax of the logits at every query key. ``zeroed=True`` zeroes every state a resume hands the model.
- ``engine_chain``: one turn per query (the prompt grows by a value and a key each turn, one token
  generated), with pages of 2 tokens so each turn resumes from the state the turn before cached,
  itself computed from a state that came out of int8: a chain of roundings.
- ``direct_recall`` / ``direct_chain``: the same without the engine, on batched ``DynamicCache`` s, with
  the states put through a codec twin (``codecs``) at the resume (or at every turn): the codec table.

The reference for every comparison is ``exact_logits``: one full forward per sequence, no cache.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tiered_cache.accuracy import codecs, recall
from tiered_cache.config import CacheConfig
from tiered_cache.engine import kinds as kinds_mod
from tiered_cache.engine.config import EngineConfig
from tiered_cache.engine.model_specs import spec_for
from tiered_cache.engine.request import Request
from tiered_cache.engine.scheduler import Engine
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix import EvictParams


@dataclass
class Scored:
    """Answer-position logits of one run over ``n`` sequences: ``logits [n, pairs, vocab]`` (fp32, CPU)."""

    logits: torch.Tensor
    answers: torch.Tensor
    tiers: list[str] = field(default_factory=list)  # per sequence: where its resume state came from
    stats: dict = field(default_factory=dict)

    @property
    def correct(self) -> int:
        return int((self.logits.argmax(-1) == self.answers).sum())

    @property
    def n(self) -> int:
        return self.answers.numel()

    @property
    def accuracy(self) -> float:
        return self.correct / self.n

    def agreement(self, ref: Scored) -> float:
        return float((self.logits.argmax(-1) == ref.logits.argmax(-1)).float().mean())

    def drift(self, ref: Scored) -> float:
        return float((self.logits - ref.logits).abs().max())

    def summary(self, ref: Optional[Scored] = None) -> dict:
        lo, hi = recall.wilson(self.correct, self.n)
        out = dict(correct=self.correct, n=self.n, accuracy=self.accuracy, wilson95=[lo, hi])
        if ref is not None:
            out.update(top1_agreement=self.agreement(ref), max_logit_drift=self.drift(ref))
        return out


@torch.no_grad()
def exact_logits(model, task: recall.RecallTask, ids: torch.Tensor, answers: torch.Tensor, batch: int = 32) -> Scored:
    """The no-cache reference: a full forward of each whole sequence."""
    pos = task.answer_positions()
    out = [model(input_ids=ids[i:i + batch].to(model.device)).logits[:, pos].float().cpu()
           for i in range(0, ids.shape[0], batch)]
    return Scored(torch.cat(out), answers)


@contextlib.contextmanager
def zeroed_states():
    """Every resume of a state model hands it zeroed conv windows and recurrent states (KV untouched)."""
    real = kinds_mod.StateKind.resume

    def resume(self, req, n):
        cache, nbytes = real(self, req, n)
        for layer in cache.layers:
            for d in (getattr(layer, "conv_states", {}), getattr(layer, "recurrent_states", {})):
                for t in d.values():
                    if isinstance(t, torch.Tensor):
                        t.zero_()
        return cache, nbytes

    kinds_mod.StateKind.resume = resume
    try:
        yield
    finally:
        kinds_mod.StateKind.resume = real


def serve_config(task: recall.RecallTask, n: int, *, codec: str = "int8", host: bool = False,
                 storage_url: Optional[str] = None, page_size: int = 8, max_running: int = 16) -> EngineConfig:
    """Tiers that keep all ``n`` prefixes and what the ``n`` query turns cache after them, so nothing a
    later turn needs is evicted: T1 for all of them (``host`` False), or T2 for all of them and T1 for a few
    (the caller evicts T1 before the queries); ``storage_url``: T3 below T2."""
    pages, keep = -(-(task.length + 8) // page_size), 2 * n + max_running
    tiers: dict[str, Any] = dict(page_size=page_size, kv_pages=pages * (keep if not host else 2 * max_running),
                 t0_states=max_running, t1_states=keep if not host else max_running, codec=codec)
    if host or storage_url:
        tiers.update(host_kv_pages=pages * keep, host_states=keep)
    if storage_url:
        tiers.update(storage_url=storage_url, prefetch_policy="wait_complete")
    chunk = -(-task.query_start // page_size) * page_size
    return EngineConfig(cache=CacheConfig(**tiers), chunk_size=chunk, prefill_budget=chunk * max_running,
                        max_running=max_running, decode_batch=True)


def _drain(e: Engine, on_step=None) -> list[Request]:
    done = []
    while e.has_work():
        done.extend(e.step())
        if on_step is not None:
            on_step()
    return done


def _evict_device(e: Engine) -> None:
    """Evict everything the tree holds on the device (KV and T1 states), down to T2."""
    assert e.cache is not None  # an engine with use_cache
    e.cache.evict(EvictParams(num_tokens=10**9, mamba_num=10**9))


def cache_prefixes(e: Engine, task: recall.RecallTask, ids: torch.Tensor, on_step=None) -> None:
    """Serve each sequence's prefix (one generated token) so the tree caches its state at ``query_start``."""
    q0 = task.query_start
    for i in range(ids.shape[0]):
        e.submit(Request(rid=f"p{i}", prompt=ids[i, :q0].tolist(), max_new_tokens=1))
    _drain(e, on_step)


def ask(e: Engine, task: recall.RecallTask, ids: torch.Tensor, answers: torch.Tensor, on_step=None) -> Scored:
    """Serve each sequence's queries teacher-forced, resuming from the cached prefix; score the answers."""
    q0, p = task.query_start, task.pairs
    for i in range(ids.shape[0]):
        e.submit(Request(rid=f"q{i}", prompt=ids[i, :q0 + 1].tolist(), max_new_tokens=2 * p - 1,
                         forced_output=ids[i, q0 + 1:].tolist(), record_logits=True))
    done = {r.rid: r for r in _drain(e, on_step)}
    rows = [torch.stack(done[f"q{i}"].logits[0::2]) for i in range(ids.shape[0])]
    tiers = [done[f"q{i}"].state_tier if done[f"q{i}"].reused_tokens == q0 else "miss" for i in range(ids.shape[0])]
    return Scored(torch.stack(rows), answers, tiers)


def engine_recall(model, task: recall.RecallTask, ids: torch.Tensor, answers: torch.Tensor, *, codec: str = "int8",
                  via: str = "T1", zeroed: bool = False, storage_url: Optional[str] = None,
                  check: bool = False) -> Scored:
    """Queries resumed from states ``via`` ``T1`` (kept there), ``T2`` (T1 and T0 evicted first) or ``T3``
    (the prefixes served by one engine writing through to ``storage_url``, the queries by a fresh one over
    the same store). ``check``: invariants after every step."""
    n = ids.shape[0]
    cfg = serve_config(task, n, codec=codec, host=via != "T1", storage_url=storage_url if via == "T3" else None)
    ctx = zeroed_states() if zeroed else contextlib.nullcontext()
    with ctx:
        e = Engine(model, cfg)
        try:
            cache_prefixes(e, task, ids, e.check_invariants if check else None)
            if via != "T1":
                _evict_device(e)  # nothing left on the device
            if via == "T3":
                e.close()
                e = Engine(model, cfg)
            got = ask(e, task, ids, answers, e.check_invariants if check else None)
            got.stats = e.stats_dict()
        finally:
            e.close()
    return got


def engine_chain(model, task: recall.RecallTask, ids: torch.Tensor, answers: torch.Tensor, *, codec: str = "int8",
                 host: bool = True) -> tuple[Scored, torch.Tensor]:
    """One turn per query, each resuming from the previous turn's cached state (pages of 2 tokens; with
    ``host`` the tree's states are evicted to T2 after every round of turns, so each resume loads from
    T2). Returns the scored answers and, per turn, the positions the turns resumed from ``[n, pairs]``."""
    n, q0, p = ids.shape[0], task.query_start, task.pairs
    cfg = serve_config(task, n, codec=codec, host=host, page_size=2)
    e = Engine(model, cfg)
    logits = torch.empty(n, p, model.config.vocab_size)
    resumed = torch.zeros(n, p, dtype=torch.int64)
    try:
        cache_prefixes(e, task, ids)
        for t in range(p):
            if host:
                _evict_device(e)
            for i in range(n):
                e.submit(Request(rid=f"c{i}t{t}", prompt=ids[i, :q0 + 2 * t + 1].tolist(), max_new_tokens=1,
                                 record_logits=True))
            for r in _drain(e):
                i = int(r.rid[1:].split("t")[0])
                logits[i, t], resumed[i, t] = r.logits[0], r.reused_tokens
        stats = e.stats_dict()
    finally:
        e.close()
    return Scored(logits, answers, stats=stats), resumed


# ------------------------------------------------------------------------------ codec twins, no engine
def map_states(cache, fn, value_axis: int) -> None:
    """Replace every recurrent state of ``cache`` (a DynamicCache) by ``fn`` of it (conv windows kept, as
    T1 keeps them in the model's dtype)."""
    for layer in cache.layers:
        for k, t in getattr(layer, "recurrent_states", {}).items():
            if isinstance(t, torch.Tensor):
                layer.recurrent_states[k] = fn(t, value_axis)


@torch.no_grad()
def _run(model, cache, ids: torch.Tensor, start: int):
    from tiered_cache.engine.runner.forward import cache_kwarg

    ids = ids.to(model.device)
    pos = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    return model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache}).logits.float().cpu()


def value_axis_of(model) -> int:
    state = spec_for(model).state
    if state is None:
        raise InvalidArgumentError("model", "a model with recurrent states", type(model).__name__)
    return state.value_axis


@torch.no_grad()
def direct_recall(model, task: recall.RecallTask, ids: torch.Tensor, answers: torch.Tensor, codec: str,
                  chain: bool = False, batch: int = 64) -> Scored:
    """Resume once at the prefix's end from states through ``codec`` (``chain``: again at every query,
    each rounding applied to the state the last one produced), all queries teacher-forced."""
    from transformers import DynamicCache

    va, q0, p = value_axis_of(model), task.query_start, task.pairs
    rt = lambda t, axis: codecs.roundtrip(codec, t, axis)
    out = []
    for b in range(0, ids.shape[0], batch):
        x = ids[b:b + batch]
        cache = DynamicCache(config=model.config)
        _run(model, cache, x[:, :q0], 0)
        if not chain:
            map_states(cache, rt, va)
            out.append(_run(model, cache, x[:, q0:], q0)[:, 0::2])
            continue
        rows = []
        for t in range(p):
            map_states(cache, rt, va)
            rows.append(_run(model, cache, x[:, q0 + 2 * t:q0 + 2 * t + 2], q0 + 2 * t)[:, 0])
        out.append(torch.stack(rows, 1))
    return Scored(torch.cat(out), answers)


@torch.no_grad()
def one_rounding_drift(model, task: recall.RecallTask, ids: torch.Tensor, resumed: torch.Tensor,
                       ref: Scored) -> torch.Tensor:
    """Per sequence and turn, ``[n, pairs]``: the answer logits' max drift when the turn resumes from
    one int8 rounding of the exact state at ``resumed[i, t]`` (what one turn of the chain adds)."""
    va, q0 = value_axis_of(model), task.query_start
    out = torch.zeros(resumed.shape)
    for i in range(ids.shape[0]):
        from transformers import DynamicCache

        cache, at = DynamicCache(config=model.config), 0
        for t in range(task.pairs):
            r = int(resumed[i, t])
            if r > at:
                _run(model, cache, ids[i:i + 1, at:r], at)
                at = r
            c = copy.deepcopy(cache)
            map_states(c, lambda s, axis: codecs.roundtrip("int8", s, axis), va)
            got = _run(model, c, ids[i:i + 1, r:q0 + 2 * t + 1], r)[0, -1]
            out[i, t] = (got - ref.logits[i, t]).abs().max()
    return out
