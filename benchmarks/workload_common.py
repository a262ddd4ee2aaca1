"""Shared by ``bench_workload.py`` and ``bench_capacity.py``: named workloads, the five configurations
and how one GPU byte budget is split among their tiers, and the Poisson request driver.

The five configurations, at one GPU budget (bytes):

    no_cache       (1)  no prefix cache: every prompt is computed whole
    gpu_only       (2)  radix cache, cached states in their own dtype (T1 codec ``lossless``), no host
                        tier: what SGLang's ``MambaRadixCache`` keeps
    gpu_only_host  (2b) as (2), plus a host tier of the same bytes as (4)'s, states in their own dtype
                        (lossless envelopes): what SGLang 0.5.23 runs with HiCache for a hybrid model
    int8_t1        (3)  as (2), T1 in int8 (a state costs ~1/3.6 of its fp32 bytes)
    int8_t1_t2     (4)  as (3), plus the T2 host mirror (host budget, pinned RAM)

int8's own gain is (4) against (2b) and (3) against (2): the same GPU and host bytes on both sides.

The split (``split_budget``), the same rule for every configuration::

    gpu budget = running reservation                          + cache share
               = max_running x (one T0 state slot, native dtype  |  kv_fraction     -> more T0 KV pages
                                + KV pages of the longest request)|  1 - kv_fraction -> T1 state slots
    host budget ((2b) and (4)): kv_fraction -> T2 KV pages, the rest -> T2 state slots (envelopes of
                                 T1's codec: lossless in (2b), int8 in (4))

T0 is sized for the running requests identically in (2)-(4); the cache's share is split the same way,
so (2) and (3) hold the same KV and differ only in how many states the same T1 bytes hold. (1) needs
no pools (its requests compute on the model's own cache).
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import json
import math
import os
import random
import time
from collections.abc import Callable
from typing import Any, Optional

WORKLOADS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workloads")
CONFIGS = ("no_cache", "gpu_only", "gpu_only_host", "int8_t1", "int8_t1_t2")
LABELS = {"no_cache": "(1) no cache", "gpu_only": "(2) GPU-only, lossless",
          "gpu_only_host": "(2b) + lossless host", "int8_t1": "(3) + int8 T1", "int8_t1_t2": "(4) + T2 host"}
MiB = 1 << 20


def list_workloads() -> list[str]:
    """Names of ``workloads/*.json``, multi_turn first (it carries the acceptance metrics)."""
    names = sorted(f[:-5] for f in os.listdir(WORKLOADS_DIR) if f.endswith(".json"))
    return sorted(names, key=lambda n: n != "multi_turn")


def load_workload(name: str, scale: str, overrides: Optional[dict[str, Any]] = None) -> dict:
    """The ``scale`` section (``small`` | ``full``) of ``workloads/<name>.json``, with ``overrides``
    applied to its ``workload`` params. Keys: name, kind, workload, model, engine, gpu_budget_mib,
    host_budget_mib."""
    path = os.path.join(WORKLOADS_DIR, f"{name}.json")
    with open(path) as f:
        doc = json.load(f)
    if scale not in doc:
        have = sorted(k for k in doc if k in ("small", "full"))
        raise ValueError(f"workload {name!r} has no {scale!r} section (has {have})")
    sec = json.loads(json.dumps(doc[scale]))
    sec["name"], sec["description"] = name, doc.get("description", "")
    for k, v in (overrides or {}).items():
        if k not in sec["workload"]:
            raise ValueError(f"--set {k}: not a workload param of {name!r} ({sorted(sec['workload'])})")
        sec["workload"][k] = type(sec["workload"][k])(v)
    return sec


# ------------------------------------------------------------------------------------------ budget
@dataclasses.dataclass(frozen=True)
class TierBytes:
    """Bytes of one slot of each kind, from the model's specs."""

    kv_page: int  # a T0 KV page (page_size tokens, every full layer); also a T2 KV slot
    state_native: int  # a T0 state slot (recurrent state + conv window, native dtype)
    t1_lossless: int  # a T1 slot, codec lossless
    t1_int8: int  # a T1 slot, codec int8; also a T2 state slot (T1's bytes as they are)

    @classmethod
    def from_specs(cls, kv_spec, state_spec, page_size: int) -> TierBytes:
        from tiered_cache.tiers.checkpoint_pool import envelope_layout

        return cls(kv_spec.bytes_per_slot(page_size), state_spec.bytes_per_slot(),
                   envelope_layout(state_spec, "lossless")[1], envelope_layout(state_spec, "int8")[1])


def split_budget(b: TierBytes, gpu_bytes: int, host_bytes: int, max_running: int, request_pages: int,
                 kv_fraction: float) -> dict[str, dict[str, Any]]:
    """Tier sizes (``EngineConfig`` fields) of the five configurations at one budget (module docstring).

    ``request_pages``: KV pages the longest request needs (prompt + answer). Slot 0 of every pool is a
    reserved sink, so each count is one less than its bytes would hold.
    """
    if not 0.0 < kv_fraction < 1.0:
        raise ValueError(f"kv_fraction: expected a fraction in (0, 1), got {kv_fraction}")
    running = max_running * (b.state_native + request_pages * b.kv_page)
    cache = gpu_bytes - running
    if cache <= 0:
        raise ValueError(f"gpu budget {gpu_bytes / MiB:.1f} MiB is below the running reservation "
                         f"{running / MiB:.1f} MiB ({max_running} requests): raise the budget or lower max_running")
    extra_pages = int(kv_fraction * cache) // b.kv_page
    t1_bytes = cache - extra_pages * b.kv_page
    kv_pages = max_running * request_pages + extra_pages - 1
    base = dict(kv_pages=kv_pages, t0_states=max_running)
    out = {"no_cache": dict(use_cache=False),
           "gpu_only": dict(base, t1_states=max(1, t1_bytes // b.t1_lossless - 1), codec="lossless"),
           "int8_t1": dict(base, t1_states=max(1, t1_bytes // b.t1_int8 - 1), codec="int8")}
    host_kv = int(kv_fraction * host_bytes) // b.kv_page
    host_states = (host_bytes - host_kv * b.kv_page) // b.t1_int8
    out["int8_t1_t2"] = dict(out["int8_t1"], host_kv_pages=max(1, host_kv), host_states=max(1, host_states))
    # (2b): the same host bytes, KV split alike; its state slots hold lossless envelopes (fewer of them)
    lossless_states = (host_bytes - host_kv * b.kv_page) // b.t1_lossless
    out["gpu_only_host"] = dict(out["gpu_only"], host_kv_pages=max(1, host_kv), host_states=max(1, lossless_states))
    return {c: out[c] for c in CONFIGS}


# ------------------------------------------------------------------------------------------ runs
def ratio_sides(kind: str, top, base) -> tuple:
    """(numerator, denominator) of a comparison of configuration ``top`` against its baseline ``base``
    (values, or the names of their values): ``speedup`` is base / top (a time: less is better), ``gain``
    top / base (a rate or share: more is better)."""
    if kind not in ("speedup", "gain"):
        raise ValueError(f"kind: expected 'speedup' or 'gain', got {kind!r}")
    return (base, top) if kind == "speedup" else (top, base)


def rotated(keys: list[str], rep: int) -> list[str]:
    """The order of the timed runs ``keys`` in repeat ``rep`` (0-based): started at the ``rep mod n``-th, so
    that over ``n`` repeats each run is first once. The first timed run of a kind paid first-call costs that
    a fixed order left to the same configuration in every repeat (the warm pass pays them; the rotation
    keeps what it misses from favouring one side)."""
    if not keys:
        return []
    r = rep % len(keys)
    return keys[r:] + keys[:r]


# ------------------------------------------------------------------------------------------ requests
@dataclasses.dataclass
class ClientPlan:
    """One client: a base prefix, then one question per round. ``chain``: each round's prompt is the
    previous prompt + its answer + the new question (a conversation); else base + question (QA)."""

    cid: int
    base: list[int]
    questions: list[list[int]]
    answers: list[list[int]]
    chain: bool

    def prompt(self, rnd: int, prev_prompt: Optional[list[int]]) -> list[int]:
        if rnd == 0 or not self.chain:
            return self.base + self.questions[rnd]
        return prev_prompt + self.answers[rnd - 1] + self.questions[rnd]


def make_clients(w: dict, vocab: int) -> list[ClientPlan]:
    """Seeded clients of a workload (``w``: its ``workload`` params). Answers are fixed too (the
    engine is teacher-forced with them), so every configuration sees the same tokens.

    prefix_len / prefix_groups: client ``c`` starts with prefix ``c % prefix_groups`` (0: its own).
    """
    rng = random.Random(w.get("seed", 0))
    lo = 3

    def draw(n: int) -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(n)]

    groups = int(w.get("prefix_groups", 0))
    shared = [draw(w["prefix_len"]) for _ in range(groups)]
    out = []
    for c in range(w["clients"]):
        base = shared[c % groups] if groups else draw(w["prefix_len"])
        qs = [draw(w["question_len"]) for _ in range(w["rounds"])]
        ans = [draw(w["max_new_tokens"]) for _ in range(w["rounds"])]
        out.append(ClientPlan(c, base, qs, ans, bool(w.get("chain", True))))
    return out


def longest_request(clients: list[ClientPlan], max_new: int) -> int:
    """Tokens (prompt + answer) of the longest request in the plan."""
    best = 0
    for c in clients:
        prev = None
        for r in range(len(c.questions)):
            prev = c.prompt(r, prev)
            best = max(best, len(prev) + max_new)
    return best


@dataclasses.dataclass
class Finished:
    client: int
    round: int
    prompt_len: int
    summary: dict
    argmax: list[int]
    submitted_s: float = 0.0  # seconds since the drive began
    finished_s: float = 0.0


async def _drive(engine, clients: list[ClientPlan], w: dict, on_done: Callable[[Finished], None]) -> None:
    """SGLang's ``bench_multiturn`` shape: a ready queue holds each client's next request; a sender
    pops one at a time with exponential gaps (Poisson arrivals at ``request_rate`` per second, the
    long-run rate held by an ``asyncio_throttle.Throttler``) while fewer than ``max_parallel`` are in
    flight; a finished request puts its client's next round in the queue, ready after a think time
    (``think_time_s``: exponential draws of that mean, seeded; 0: at once). ``request_rate`` 0: no
    gaps (every ready request is sent at once, up to ``max_parallel``).

    The engine steps in the same event loop: a step blocks it, so a request due during a step is
    handed over right after it, stamped with its due time (``Engine.submit(arrival=...)``): its TTFT
    counts the wait, and the arrival process keeps its rate whatever the step times.
    """
    from asyncio_throttle import Throttler

    from tiered_cache.engine.request import Request

    rate, max_par, max_new = float(w.get("request_rate", 0)), int(w.get("max_parallel", 1 << 30)), w["max_new_tokens"]
    rng = random.Random(w.get("seed", 0) + 1)
    think, think_rng = float(w.get("think_time_s", 0.0)), random.Random(w.get("seed", 0) + 2)
    order = list(range(len(clients)))
    rng.shuffle(order)  # interleave tasks / documents / system-prompt groups
    # (ready since: seconds since t0, order of arrival in the queue, client, round): earliest ready first
    ready = [(0.0, i, c, 0) for i, c in enumerate(order)]
    seq = itertools.count(len(ready))
    prompts: dict[int, list[int]] = {}
    live: dict[str, tuple[int, int]] = {}
    sent_at: dict[str, float] = {}
    t0 = time.perf_counter()
    total = sum(len(c.questions) for c in clients)
    state = {"sent": 0, "done": 0, "room_at": 0.0}
    window = 1.0
    throttler = Throttler(rate_limit=max(1, math.ceil(rate * window)), period=window) if rate > 0 else None

    def now() -> float:
        return time.perf_counter() - t0

    def submit(cid: int, rnd: int, at: float) -> None:
        plan = clients[cid]
        prompt = plan.prompt(rnd, prompts.get(cid))
        prompts[cid] = prompt
        rid = f"c{cid}r{rnd}"
        live[rid] = (cid, rnd)
        sent_at[rid] = at
        engine.submit(Request(rid=rid, prompt=prompt, max_new_tokens=max_new, forced_output=plan.answers[rnd]),
                      arrival=t0 + at)
        state["sent"] += 1

    async def sender() -> None:
        # Arrivals follow their own clock, as a client process would: a request is due at the previous
        # one's due time plus a Poisson gap (or when its client became ready, or a parallel slot freed, if
        # later). An engine step blocks this loop, so a request due during a step is handed over after it,
        # stamped with its due time: the wait inside the step counts in its TTFT, and a long step does not
        # stretch the arrival process (which would cap the throughput of a fast configuration at the rate
        # its steps let the sender run, not at request_rate).
        due = 0.0
        while state["sent"] < total:
            full = len(live) >= max_par
            if not ready or full or ready[0][0] > now():  # nothing ready (a client still thinking)
                await asyncio.sleep(0.0002)
                continue
            if due > now():
                await asyncio.sleep(due - now())
                continue
            ready_at, _, cid, rnd = heapq.heappop(ready)
            at = max(due, ready_at, state["room_at"])
            if throttler is not None:
                t_in = time.perf_counter()
                async with throttler:  # holds the long-run rate: a burst over it arrives when let through
                    if time.perf_counter() - t_in > throttler.retry_interval / 2:  # it waited at least once
                        at = now()
            submit(cid, rnd, at)
            due = at + (rng.expovariate(rate) if rate > 0 else 0.0)

    async def stepper() -> None:
        while state["done"] < total:
            if not engine.has_work():
                await asyncio.sleep(0.0002)
                continue
            for req in engine.step():
                t = now()
                if len(live) >= max_par:
                    state["room_at"] = t  # a request held for a parallel slot goes when this one frees it
                cid, rnd = live.pop(req.rid)
                state["done"] += 1
                on_done(Finished(cid, rnd, len(req.prompt), req.summary(), list(req.argmax),
                                 sent_at.pop(req.rid), t))
                if rnd + 1 < len(clients[cid].questions):
                    gap = think_rng.expovariate(1.0 / think) if think > 0 else 0.0
                    heapq.heappush(ready, (t + gap, next(seq), cid, rnd + 1))
            await asyncio.sleep(0)

    await asyncio.gather(sender(), stepper())


def drive(engine, clients: list[ClientPlan], w: dict, on_done: Callable[[Finished], None]) -> None:
    asyncio.run(_drive(engine, clients, w, on_done))


# ------------------------------------------------------------------------------------------ traces
@dataclasses.dataclass(frozen=True)
class TraceItem:
    """One trace request as the engine replays it: due ``at_s`` seconds after the start (the trace's
    timestamp, scaled), ``prompt`` token ids and a teacher-forced ``answer``."""

    at_s: float
    prompt: list[int]
    answer: list[int]


def trace_items(trace, *, vocab: int, block: int, max_blocks: int, max_answer: int, rate: float,
                seed: int = 0) -> list[TraceItem]:
    """``trace`` (``benchmarks.traces.load_trace``'s requests) as the engine replays it.

    Prompts: every 512-token block (hash id) becomes ``block`` tokens (``traces.block_tokens`` at that
    block size: the same id the same tokens), at most ``max_blocks`` blocks of a prompt, the last block
    cut in proportion to ``input_length``: the trace's prefix sharing kept exactly (two requests share k
    blocks there, so they share k x ``block`` tokens here), lengths scaled by ``block / 512``. Answers:
    ``output_length`` tokens capped at ``max_answer`` (at least 1), teacher-forced (seeded ids). Arrivals:
    the timestamps scaled so that the mean rate over the trace is ``rate`` requests/s."""
    from benchmarks import traces

    if not trace:
        raise ValueError("trace: expected at least one request, got none")
    if not (block >= 1 and max_blocks >= 1 and max_answer >= 1 and rate > 0):
        raise ValueError(f"block, max_blocks, max_answer >= 1 and rate > 0 expected, got {block}, {max_blocks}, "
                         f"{max_answer}, {rate}")
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000.0
    scale = (len(trace) - 1) / (rate * span_s) if span_s > 0 else 0.0  # trace seconds -> replay seconds
    rng = random.Random(seed + 3)
    out = []
    for r in trace:
        ids = r.hash_ids[:max_blocks]
        toks = traces.block_tokens(ids, vocab=vocab, block=block, seed=seed).reshape(-1)
        n = min(len(toks), max(1, math.ceil(r.input_length * block / traces.BLOCK)))
        ans = [rng.randrange(3, vocab) for _ in range(max(1, min(r.output_length, max_answer)))]
        out.append(TraceItem((r.timestamp_ms - trace[0].timestamp_ms) / 1000.0 * scale, toks[:n].tolist(), ans))
    return out


def sample_conversations(trace, fraction: float, seed: int = 0) -> list:
    """The requests of a seeded ``fraction`` of the trace's conversations, each kept whole, in order.

    A conversation is the requests whose first two blocks agree (``hash_ids[:2]``: the Mooncake trace's
    first block is one system prompt every request shares; a later turn that reuses an earlier one shares
    its first blocks and more); a one-block request is its own. The trace's multi-turn reuse is far apart
    (the 10th percentile of the distance between a request and the earlier one it extends by >= 2 blocks
    is 141 requests in the conversation trace), so a short window of the whole trace holds next to none of
    it; a sample brings a conversation's turns closer. What it loses: the other conversations' traffic
    between those turns (cache pressure: the same budget holds more of the sample than of the trace)."""
    import hashlib

    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction: expected a share in (0, 1], got {fraction}")
    if fraction == 1.0:
        return list(trace)
    out = []
    for i, r in enumerate(trace):
        key = (seed, *r.hash_ids[:2]) if len(r.hash_ids) > 1 else (seed, -1, i)
        h = int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") / 2.0 ** 64
        if h < fraction:
            out.append(r)
    return out


def shared_prefix_bound(items: list[TraceItem], page: int) -> int:
    """Prompt tokens an unbounded cache could reuse in a replay of ``items`` (in their order, the cache
    empty at the first): each request's longest prefix that an earlier one's prompt also begins with,
    rounded down to whole pages of ``page`` tokens, less its last token (the first output needs its
    logits). The ceiling of the replay's hit rate, counted from its own tokens."""
    seen: set = set()
    total = 0
    for it in items:
        p = it.prompt
        k = 0
        while k < len(p) - 1 and tuple(p[:k + 1]) in seen:
            k += 1
        total += k // page * page
        seen.update(tuple(p[:j]) for j in range(1, len(p) + 1))
    return total


async def _drive_trace(engine, items: list[TraceItem], on_done: Callable[[Finished], None]) -> None:
    """Open loop: each item is handed over at its due time (stamped with it, as ``_drive`` does), whatever
    is in flight; the engine steps in the same loop. ``Finished.client`` is the item's index, round 0."""
    from tiered_cache.engine.request import Request

    t0 = time.perf_counter()
    state = {"done": 0}
    sent_at: dict[str, tuple[int, float]] = {}

    async def sender() -> None:
        for i, it in enumerate(items):
            wait = it.at_s - (time.perf_counter() - t0)
            if wait > 0:
                await asyncio.sleep(wait)
            rid, at = f"t{i}", min(it.at_s, time.perf_counter() - t0)  # never a stamp from the future
            sent_at[rid] = (i, at)
            engine.submit(Request(rid=rid, prompt=list(it.prompt), max_new_tokens=len(it.answer),
                                  forced_output=list(it.answer)), arrival=t0 + at)

    async def stepper() -> None:
        while state["done"] < len(items):
            if not engine.has_work():
                await asyncio.sleep(0.0002)
                continue
            for req in engine.step():
                i, at = sent_at.pop(req.rid)
                state["done"] += 1
                on_done(Finished(i, 0, len(req.prompt), req.summary(), list(req.argmax), at,
                                 time.perf_counter() - t0))
            await asyncio.sleep(0)

    await asyncio.gather(sender(), stepper())


def drive_trace(engine, items: list[TraceItem], on_done: Callable[[Finished], None]) -> None:
    asyncio.run(_drive_trace(engine, items, on_done))
