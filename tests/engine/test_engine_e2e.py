"""The reference engine end to end: multi-turn conversations through the tiered cache equal a no-cache run.

Budgets are small on purpose: T0 holds a few conversations' KV, T1 a handful of states, so states are
evicted from T1 (to T2 when it exists) and KV from T0 and loaded back while the workload runs. Every
run checks ``check_invariants`` after every step and, at the end, that every pool is back to its
initial free set once the tree is dropped.

Equality: with the lossless codec the cached run generates the same tokens and its logits differ by
< 1e-4 (what is left is fp32 rounding of different chunk splits: the delta rule runs in 64-token
blocks counted from each call's start). With int8 the runs are teacher-forced with the no-cache
answers, so the logits are compared at the same positions.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("transformers")

from tests.support.torch_kernels import bare_torch_kernels  # noqa: E402
from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.engine import tiny_qwen3_next, tiny_swa_model  # noqa: E402
from tiered_cache.engine.config import EngineConfig  # noqa: E402
from tiered_cache.engine.request import Request, Status  # noqa: E402
from tiered_cache.engine.runner.forward import forward_chunk, new_cache  # noqa: E402
from tiered_cache.engine.scheduler import Engine  # noqa: E402
from tiered_cache.engine.workload import WorkloadConfig, make_conversations, run_workload  # noqa: E402
from tiered_cache.errors import InvalidArgumentError  # noqa: E402
from tiered_cache.radix import EvictParams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOGIT_ATOL = 1e-4
# int8 states, long-memory model, teacher-forced, max |logit| difference over all generated tokens.
# Measured (4 clients x 4 rounds x 16 tokens, workload seeds 0..4): T0+T1 0.049-0.114, through T2
# 0.109-0.159 (more turns resume from a state, and each turn's cached state descends from the last
# one's int8 copy); every state zeroed: 3.53 (T0+T1), 3.65 (T2). The bound is the largest
# measurement with margin.
INT8_DRIFT_BOUND = 0.3
# Top-1 agreement is not asserted on this random model (issue 24): a fifth of its positions have a
# top-2 margin under 0.05, so any rounding flips some. Asserted: agreement where the no-cache margin
# exceeds MARGIN_X times the run's measured drift (all of them must agree); the overall agreement is
# printed beside bf16 storage's. Trained models that remember: tests/accuracy/test_state_accuracy.py.
MARGIN_X = 4
WL = WorkloadConfig(clients=4, rounds=4, question_len=12, system_len=24, max_new_tokens=16)
SERVE = dict(chunk_size=16, prefill_budget=64, max_running=2)
# T0: 48 pages of 4 tokens (the 2 running requests reserve up to 2 x 25); T1: 6 states.
SMALL = dict(page_size=4, kv_pages=48, t0_states=2, t1_states=6)
HOST = dict(host_kv_pages=200, host_states=40)
NO_CACHE = EngineConfig(use_cache=False, cache=CacheConfig(page_size=4), **SERVE)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def baseline(qwen_long):
    return run_workload(Engine(qwen_long, NO_CACHE), WL, record_logits=True)


def run_checked(model, cfg: EngineConfig, wl: WorkloadConfig = WL, **kw):
    """Run the workload with invariants checked every step; the pools must end where they began."""
    e = Engine(model, cfg)
    turns = run_workload(e, wl, record_logits=True, on_step=e.check_invariants, **kw)
    assert_released(e)
    return e, turns


def assert_released(e: Engine) -> None:
    assert not e.running and not e.waiting
    e.check_invariants()
    stats = e.stats_dict()  # read before the reset drops the tree
    assert e.reset_cache() == e.initial_free, "a slot, page or host slot was left behind"
    e.cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    e.final_stats = stats


def compare(base, got):
    """-> (tokens compared, top-1 agreement, max |logit| difference, flipped positions' top-2 margins)."""
    n = agree = 0
    drift = 0.0
    margins = []
    for a, b in zip(base, got, strict=True):
        assert (a.client, a.round) == (b.client, b.round) and a.prompt == b.prompt
        top = torch.stack(a.logits).topk(2, dim=-1).values
        for i, (x, y, ax, bx) in enumerate(zip(a.logits, b.logits, a.argmax, b.argmax, strict=True)):
            n += 1
            agree += ax == bx
            drift = max(drift, (x - y).abs().max().item())
            if ax != bx:
                margins.append((top[i, 0] - top[i, 1]).item())
    return n, agree / n, drift, margins


# ------------------------------------------------------------------------------ lossless equality
@pytest.mark.parametrize("batch", [False, True, "static", "prefill"],
                         ids=["one-by-one", "decode-batch", "decode-static", "decode-static-prefill-static"])
@pytest.mark.parametrize("host", [False, True], ids=["T0-T1", "T0-T1-T2"])
def test_lossless_multi_turn_equals_no_cache(qwen_long, baseline, host, batch):
    """Through the tiers (lossless) every token equals the no-cache run, decoding one request per
    forward, (``decode_batch``) the step's decode tokens in one forward, or (``decode_graphs``, run
    eagerly on CPU) through the graph decoder's static buffers: the same math summed in another order
    (drift measured 1.1e-5 with T2); ("prefill") also the prefill forwards' chunk rule on padded static
    buffers (``prefill_graphs``). The batched run with T2 also times its phases (``phase_timing``:
    synchronizes, changes no result)."""
    timed = batch is True and bool(host)
    cfg = EngineConfig(cache=CacheConfig(codec="lossless", **SMALL, **(HOST if host else {})),
                       decode_batch=batch is True, decode_graphs=batch in ("static", "prefill"),
                       prefill_graphs=batch == "prefill", phase_timing=timed, **SERVE)
    e, got = run_checked(qwen_long, cfg)
    for a, b in zip(baseline, got, strict=True):
        assert b.output == a.output, f"client {a.client} round {a.round}"
    n, top1, drift, _ = compare(baseline, got)
    assert n >= 200 and top1 == 1.0 and drift < LOGIT_ATOL, drift
    st = e.final_stats
    if batch == "prefill":
        assert st["graph_prefill"]["calls"] > 0 and st["graph_prefill"]["eager"] == 0
    assert st["tokens"]["reused"] > 0 and st["hits"]["T1_states"] > 0
    assert e.tiers.t1.stats["stores"] > cfg.cache.t1_states  # more states cached than T1 holds: T1 evicted
    if host:  # KV and states went to the host and came back
        assert st["hits"]["T2_kv_tokens"] > 0 and st["hits"]["T2_states"] > 0
        assert st["bytes"]["T2_d2h"] > 0 and st["bytes"]["T2_h2d"] > 0
        assert e.cache.stats["state_demotes"] > 0
    assert e.stats.c["split_forwards"] > 0  # mid-chunk states were taken inside one forward
    if batch:
        assert st["tokens"]["decode_forwards"] < st["tokens"]["decoded"]  # some steps did batch
    if batch == "static":
        assert e.runner.graph_decoder.stats["steps"] == st["tokens"]["decode_forwards"] > 0
    if timed:
        ph = st["phase_s"]
        for k in ("events", "admit", "build_cache", "prefill_forward", "export_kv", "checkpoint", "decode_forward",
                  "emit", "finish"):
            assert ph.get(k, 0) > 0, (k, ph)
    else:
        assert "phase_s" not in st


def test_two_forwards_per_split_chunk_equals_no_cache(qwen_long, baseline):
    """``split_checkpoints=False``: a chunk whose state is cached inside it runs as two forwards (what
    models the split forward does not support do); through every tier the run still equals no cache."""
    cfg = EngineConfig(cache=CacheConfig(codec="lossless", **SMALL, **HOST), split_checkpoints=False, **SERVE)
    e, got = run_checked(qwen_long, cfg)
    assert e.stats.c["split_forwards"] == 0 and e.stats.c["branch_checkpoints"] > 0
    for a, b in zip(baseline, got, strict=True):
        assert b.output == a.output, f"client {a.client} round {a.round}"
    n, top1, drift, _ = compare(baseline, got)
    assert n >= 200 and top1 == 1.0 and drift < LOGIT_ATOL, drift


@pytest.mark.parametrize("host", [False, True], ids=["T0-T1", "T0-T1-T2"])
def test_block_admission_offers_block_boundaries_and_equals_no_cache(qwen_long, baseline, host):
    """``state_admission="block"``: the engine offers a state at every block boundary inside a prefill
    chunk (one forward that takes the state at each), the tree keeps those, and the run still equals no
    cache. Blocks of 8 tokens: a chunk [16, 32) is cut at 24, the shared system prompt's end; the run's
    chunks of 32 tokens are cut at three boundaries each, all taken by one split forward."""
    cache = CacheConfig(codec="lossless", state_admission="block", admission_block=8, **SMALL,
                        **(HOST if host else {}))
    e = Engine(qwen_long, EngineConfig(cache=cache, **SERVE))
    req = Request(rid="r", prompt=list(range(3, 40)), max_new_tokens=1)
    assert e.kind.cuts(req, 0, 16) == {8: "block", 16: "end"} and e.kind.cuts(req, 16, 36) == {
        24: "block", 32: "block", 36: "end"}
    chunk = Engine(qwen_long, EngineConfig(cache=CacheConfig(codec="lossless", **SMALL), **SERVE))
    assert chunk.kind.cuts(req, 16, 32) == {32: "end"}  # the default admission: no block cuts
    e, got = run_checked(qwen_long, EngineConfig(cache=cache, **dict(SERVE, chunk_size=32)))
    for a, b in zip(baseline, got, strict=True):
        assert b.output == a.output, f"client {a.client} round {a.round}"
    n, top1, drift, _ = compare(baseline, got)
    assert n >= 200 and top1 == 1.0 and drift < LOGIT_ATOL, drift
    # a chunk cut at several block boundaries ran as one forward that took every state
    assert e.stats.c["split_states"] > e.stats.c["split_forwards"] > 0 and not e.stats.c["split_failures"]
    st = e.final_stats
    assert st["checkpoints"]["block_boundaries"] > 0 and st["tokens"]["reused"] > 0 and st["hits"]["T1_states"] > 0


def test_a_split_forward_that_takes_no_state_caches_none_and_runs_two_forwards_after(qwen_long, baseline,
                                                                                   monkeypatch):
    """When a split forward cannot take the state (``forward_chunk_split`` returns None), the engine
    caches nothing at that cut, runs two forwards from then on, and still equals no cache."""
    import tiered_cache.engine.runner.split_forward as sf

    real = sf.forward_chunk_split
    calls = []

    def once_without_state(model, cache, ids, start, split):
        logits, cache, st = real(model, cache, ids, start, split)
        calls.append(split)
        return (logits, cache, None) if len(calls) == 1 else (logits, cache, st)

    monkeypatch.setattr(sf, "forward_chunk_split", once_without_state)
    e, got = run_checked(qwen_long, EngineConfig(cache=CacheConfig(codec="lossless", **SMALL, **HOST), **SERVE))
    assert len(calls) == 1 and e.stats.c["split_failures"] == 1 and not e.runner.split
    assert e.stats.c["split_forwards"] == 0 and e.stats.c["branch_checkpoints"] > 0
    for a, b in zip(baseline, got, strict=True):
        assert b.output == a.output, f"client {a.client} round {a.round}"


def test_phase_clock_counts_each_phase_once():
    """Nested phases are exclusive: the outer one is paused while the inner one runs."""
    import collections
    import time

    from tiered_cache.engine.stats import PhaseClock

    tot = collections.Counter()
    clock = PhaseClock(tot, torch.device("cpu"))
    t = time.perf_counter()
    with clock("outer"):
        time.sleep(0.02)
        with clock("inner"):
            time.sleep(0.03)
        time.sleep(0.01)
    wall = time.perf_counter() - t
    assert 0.03 <= tot["inner"] < 0.03 + 0.02 and 0.03 <= tot["outer"] < 0.03 + 0.02, tot
    assert tot["inner"] + tot["outer"] <= wall


def test_random_aborts_mid_prefill_release_everything(qwen_long, baseline):
    """Requests aborted in the middle of their prefill (some chunks cached, some not) and sent again:
    nothing leaks, and the answers still equal the no-cache run's."""
    cfg = EngineConfig(cache=CacheConfig(codec="lossless", **SMALL, **HOST), **SERVE)
    e, got = run_checked(qwen_long, cfg, abort_prob=0.5, abort_seed=1)
    assert e.final_stats["requests"]["aborted"] >= 2
    assert any(t.attempts > 1 for t in got)
    for a, b in zip(baseline, got, strict=True):
        assert b.output == a.output


# ------------------------------------------------------------------------------------ int8
def _int8_run(model, baseline, host: bool, zero_states: bool = False, bf16_states: bool = False):
    """The workload teacher-forced with the no-cache answers, int8 states; ``zero_states``: every state
    the tree hands back (from T1, or T2 through T1's layout) zeroed; ``bf16_states``: lossless states
    rounded to bf16 on every resume (what bf16 storage, SGLang's ``mamba_ssm_dtype=bfloat16``, keeps)."""
    forced = {(t.client, t.round): t.output for t in baseline}
    codec = "lossless" if bf16_states else "int8"
    e = Engine(model, EngineConfig(cache=CacheConfig(codec=codec, **SMALL, **(HOST if host else {})), **SERVE))
    if zero_states or bf16_states:
        load = e.tiers.t1.load_to_active

        def changed(ckpt_slots, side, active_ids):
            load(ckpt_slots, side, active_ids)
            rows = side.translate(torch.as_tensor(active_ids, device=side.device).reshape(-1))
            t = side.temporal_view_all()
            if bf16_states:
                t[:, rows] = t[:, rows].to(torch.bfloat16).to(t.dtype)
            else:
                t[:, rows] = 0
                side.conv_view_all(0)[:, rows] = 0

        e.tiers.t1.load_to_active = changed
    got = run_workload(e, WL, forced=forced, record_logits=True, on_step=e.check_invariants)
    assert_released(e)
    return e, got


def confident_agreement(base, got, drift: float) -> tuple[int, int]:
    """(positions whose no-cache top-2 margin exceeds ``MARGIN_X * drift``, how many of them agree)."""
    n = agree = 0
    for a, b in zip(base, got, strict=True):
        top = torch.stack(a.logits).topk(2, dim=-1).values
        for i, (ax, bx) in enumerate(zip(a.argmax, b.argmax, strict=True)):
            if (top[i, 0] - top[i, 1]).item() > MARGIN_X * drift:
                n += 1
                agree += ax == bx
    return n, agree


def check_random_model_int8(baseline, got, zgot, bgot, what: str) -> None:
    """The drift bound (and the zeroed control breaking it), and agreement where it is a claim."""
    n, top1, drift, margins = compare(baseline, got)
    _, ztop1, zdrift, _ = compare(baseline, zgot)
    _, btop1, bdrift, _ = compare(baseline, bgot)
    conf, conf_agree = confident_agreement(baseline, got, drift)
    print(f"int8 {what}: {n} tokens, top-1 {top1:.4f} (bf16 storage: {btop1:.4f}, drift {bdrift:.4f}), "
          f"drift {drift:.4f} (bound {INT8_DRIFT_BOUND}); margin > {MARGIN_X}x drift: {conf_agree}/{conf}; "
          f"flips' margins {margins}; zeroed state: top-1 {ztop1:.4f}, drift {zdrift:.3f}")
    assert n >= 200
    assert 0 < drift <= INT8_DRIFT_BOUND  # 0 would mean no int8 state was ever used
    assert conf >= 10 and conf_agree == conf  # every confident position agrees (measured: 20-24 of 256)
    assert all(m < 2 * drift for m in margins)  # a flip is a near-tie, not a lost state
    assert zdrift > INT8_DRIFT_BOUND and ztop1 < top1  # the bound catches a lost state


@pytest.mark.slow
def test_int8_long_memory_top1_and_drift(qwen_long, baseline):
    runs = [_int8_run(qwen_long, baseline, host=False, **kw)[1] for kw in ({}, dict(zero_states=True),
                                                                           dict(bf16_states=True))]
    check_random_model_int8(baseline, *runs, "T0+T1")


@pytest.mark.slow
def test_int8_long_memory_through_the_host_tier(qwen_long, baseline):
    """Through T2 the tree keeps every conversation's states, so 14 of the 16 turns resume from an
    int8 state (T0+T1: 7, all from the one system-prompt state, the other turns recompute exactly):
    twice the tokens see a rounding, each turn from a rounding of its own, and each turn's cached
    state descends from the previous turn's int8 copy. Where the loss comes from (measured, seeds
    0..4 of this workload; all of it is the temporal state's rounding: conv windows are stored in
    the model's fp32 and every resume is within half a step of the state it copies):

        loading the exact state instead of the int8 copy         top-1 1.0, drift 0
        every resume one rounding of the exact state (no chain)  top-1 0.969-0.981 (5-8 flips)
        the engine (chains of 1-4 roundings)                     top-1 0.961-0.977 (6-10 flips)

    Every flip is a near-tie of this random model (a fifth of its positions have a top-2 margin under
    0.05; the flips' margins are 0.000-0.062), so overall agreement measures the model, not the
    cache: asserted is agreement at every position whose margin exceeds ``MARGIN_X`` times the drift."""
    e, got = _int8_run(qwen_long, baseline, host=True)
    resumed = sum(t.summary["reused"] > 0 for t in got)
    assert e.final_stats["hits"]["T2_states"] > 0
    assert resumed >= 3 * len(got) // 4  # what makes this run harder than T0+T1's
    for a, b in zip(baseline, got, strict=True):  # a turn that resumed from nothing is exact
        if b.summary["reused"] == 0:
            assert b.argmax == a.argmax and max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits)) \
                < LOGIT_ATOL, f"client {a.client} round {a.round}"
    runs = [_int8_run(qwen_long, baseline, host=True, **kw)[1] for kw in (dict(zero_states=True),
                                                                          dict(bf16_states=True))]
    check_random_model_int8(baseline, got, *runs, f"through T2 ({resumed}/{len(got)} turns resumed)")


@pytest.mark.parametrize("host", [False, True], ids=["T1", "T2"])
def test_int8_resume_is_one_rounding_of_the_cached_state(qwen_long, host):
    """The state an int8 resume hands the model is the state the previous turn cached, rounded once:
    every element within half a quantization step of it, the step being that state's own scale (one
    per layer, head and k-channel: amax over d_v / 127). A dequantize with the wrong scales, layout
    or value axis is off by more; a zeroed state by up to 127 steps."""
    p1, q2 = _two_turn_prompts()
    e = Engine(qwen_long, EngineConfig(cache=CacheConfig(codec="int8", **SMALL, **(HOST if host else {})), **SERVE))
    cached, resumed = {}, {}
    finish, start = e._finish, e._start_prefill

    def states(rows):  # [L, H, d_k, d_v] fp32
        return torch.stack([r.reshape(r.shape[-3:]) for r in rows]).clone()

    def on_finish(req):  # the T0 slot holds the state at slot_pos: what cache_finished_req quantizes
        row = e.tiers.states.translate(req.mamba_pool_idx.reshape(-1))
        cached[req.rid] = req.slot_pos, states(e.tiers.states.temporal_view_all()[:, row].unbind(0))
        finish(req)

    def on_start(req):
        ok = start(req)
        if ok and req.cache_protected_len:
            rec = [req.model_cache.layers[i].recurrent_states[0] for i in e.specs.linear_layers]
            resumed[req.cache_protected_len] = states(rec)
        return ok

    e._finish, e._start_prefill = on_finish, on_start
    r1 = _one_turn(e, "t1", p1)
    if host:
        e.cache.evict(EvictParams(num_tokens=10**6, mamba_num=10**6))
    r2 = _one_turn(e, "t2", p1 + r1.output + q2)
    assert r2.state_tier == ("T2" if host else "T1")
    p, x = cached["t1"]
    assert r2.reused_tokens == p  # turn 2 resumed where turn 1's state was cached
    y = resumed[p]
    step = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127  # per (layer, head, k-channel)
    err = ((y - x).abs() / step).amax().item()
    assert 0 < err <= 0.5 + 1e-4, err  # rounded (int8, not a copy), once, with the right scales
    assert_released(e)


# ------------------------------------------------------------------------- split and resume, T2
def _one_turn(e: Engine, rid, prompt, n_new=12) -> Request:
    req = Request(rid=rid, prompt=prompt, max_new_tokens=n_new, record_logits=True)
    e.submit(req)
    while e.has_work():
        e.step()
        e.check_invariants()
    return req


def _reference(model, prompts, n_new=12):
    e = Engine(model, NO_CACHE)
    return [_one_turn(e, i, p, n_new) for i, p in enumerate(prompts)]


def _two_turn_prompts():
    conv = make_conversations(WorkloadConfig(clients=1, rounds=2, question_len=13, system_len=30))[0]
    return conv.system + conv.questions[0], conv.questions[1]


@pytest.mark.parametrize("host", [False, True], ids=["T0-T1-T0", "T0-T1-T2-T0"])
def test_split_and_resume_through_every_tier(qwen_long, host):
    """Turn 1 is cached (its state checkpointed T0 -> T1); everything the tree holds on the device is
    evicted (to T2 when there is one); turn 2 resumes from it and equals the no-cache run."""
    p1, q2 = _two_turn_prompts()
    e = Engine(qwen_long, EngineConfig(cache=CacheConfig(codec="lossless", **SMALL, **(HOST if host else {})), **SERVE))
    r1 = _one_turn(e, "t1", p1)
    p2 = p1 + r1.output + q2
    ref = _reference(qwen_long, [p1, p2])
    assert r1.output == ref[0].output
    if host:
        e.cache.evict(EvictParams(num_tokens=10**6, mamba_num=10**6))
        assert e.cache.total_size() == (0, 0), "the tree still holds device data"
    r2 = _one_turn(e, "t2", p2)
    assert r2.reused_tokens >= len(p1) - 4  # resumed at the last page-aligned state of turn 1
    assert r2.state_tier == ("T2" if host else "T1")
    assert (r2.reused_host_tokens > 0) == host
    assert r2.output == ref[1].output
    assert max((x - y).abs().max().item() for x, y in zip(r2.logits, ref[1].logits)) < LOGIT_ATOL
    assert_released(e)


def _second_turn_from_host(model):
    """An engine with T2 that served turn 1 and then evicted everything the tree held on the device
    (to T2); returns it, turn 2's prompt and the no-cache run of turn 2."""
    p1, q2 = _two_turn_prompts()
    e = Engine(model, EngineConfig(cache=CacheConfig(codec="lossless", **SMALL, **HOST), **SERVE))
    r1 = _one_turn(e, "t1", p1)
    p2 = p1 + r1.output + q2
    ref = _reference(model, [p2])[0]
    e.cache.evict(EvictParams(num_tokens=10**6, mamba_num=10**6))
    return e, p2, ref


def test_a_load_back_that_lands_during_the_step_prefills_in_it(qwen_long):
    """The step polls its admissions' loads again after its forwards: one that landed meanwhile (on the
    CPU, every one) starts its prefill in that step, not the next; the result still equals no cache."""
    e, p2, ref = _second_turn_from_host(qwen_long)
    req = Request(rid="t2", prompt=p2, max_new_tokens=12, record_logits=True)
    e.submit(req)
    e.step()
    assert req.reused_host_tokens > 0 and req.status is not Status.LOADING
    assert req.filled > req.reused_tokens  # its first chunk ran in the step that admitted it
    while e.has_work():
        e.step()
        e.check_invariants()
    assert req.output == ref.output
    assert_released(e)


def test_abort_during_load_back_and_corrupt_host_copy(qwen_long):
    e, p2, ref = _second_turn_from_host(qwen_long)

    # 1. Abort while the load back is in flight. A slow copy: its tickets do not fire during the step
    # (on the CPU a ticket ends at the next poll, and the step polls again before it ends).
    req = Request(rid="t2", prompt=p2, max_new_tokens=12)
    e.submit(req)
    fired, slow = e.tiers.transfer._fired, [True]
    e.tiers.transfer._fired = lambda t: not slow[0] and fired(t)
    e.step()
    assert req.status is Status.LOADING and req.load_back is not None and not req.load_back.done
    e.check_invariants()
    slow[0] = False  # the copy goes on; the abort waits for it before giving anything back
    assert e.abort("t2") and req.status is Status.ABORTED
    e.check_invariants()
    assert e.cache.total_size()[0] > 0  # the load landed and stays cached; only the request's share went

    # 2. A host copy corrupted in T2: detected by its checksum, dropped, the request recomputes.
    e.cache.evict(EvictParams(num_tokens=10**6, mamba_num=10**6))
    flipped = []

    def flip_once(region, slots):
        if not flipped and region.name == "full":
            region.flip_bit(slots[0], 5, 3)
            flipped.append(slots[0])

    e.tiers.transfer.corrupt_hook = flip_once
    r2 = _one_turn(e, "t2b", p2)
    e.tiers.transfer.corrupt_hook = None
    st = e.stats_dict()
    assert flipped and st["hits"]["T2_checksum_failures"] >= 1 and e.stats.c["load_back_failures"] == 1
    assert r2.output == ref.output
    assert max((x - y).abs().max().item() for x, y in zip(r2.logits, ref.logits)) < LOGIT_ATOL
    assert_released(e)


def test_abort_mid_prefill_and_while_waiting(qwen_long):
    e = Engine(qwen_long, EngineConfig(cache=CacheConfig(codec="lossless", **SMALL), **SERVE))
    prompt = list(range(3, 3 + 70))
    a = Request(rid="a", prompt=prompt, max_new_tokens=4)
    b = Request(rid="b", prompt=prompt[:40], max_new_tokens=4)
    c = Request(rid="c", prompt=prompt[:20], max_new_tokens=4)
    for r in (a, b, c):
        e.submit(r)
    e.step()
    e.step()  # a and b are two chunks in: some of a's prefix is cached and locked by it
    assert a.status is Status.PREFILL and 0 < a.filled < len(prompt) and a.cache_protected_len > 0
    assert c.status is Status.WAITING
    assert e.abort("a") and e.abort("c") and not e.abort("nope")
    e.check_invariants()
    e.run()
    assert b.status is Status.FINISHED and len(b.output) == 4
    assert_released(e)


# ------------------------------------------------------------------------------------ SWA model
def test_swa_model_runs_through_the_no_cache_path():
    """Gemma3-style sliding-window model: the engine's no-cache path equals greedy decoding by full
    recomputation (through the tiers: test_swa_model_through_the_cache_equals_no_cache)."""
    model = tiny_swa_model(seed=0, device="cpu")
    prompt = make_conversations(WorkloadConfig(clients=1, rounds=1, question_len=21, system_len=0))[0].questions[0]
    e = Engine(model, NO_CACHE)
    req = _one_turn(e, "s", prompt, n_new=10)
    toks = list(prompt)
    for _ in range(10):
        logits, _ = forward_chunk(model, new_cache(model), torch.tensor(toks), 0)
        toks.append(int(logits[-1].argmax()))
    assert req.output == toks[len(prompt):]
    with pytest.raises(InvalidArgumentError, match="decode_graphs"):
        Engine(model, EngineConfig(use_cache=False, cache=CacheConfig(page_size=4), decode_graphs=True, **SERVE))


@pytest.mark.parametrize("host", [False, True], ids=["T0", "T0-T2"])
def test_swa_model_through_the_cache_equals_no_cache(host):
    """The sliding-window model through HiSWARadixCache, T0 small enough that SWA KV is tombstoned and
    whole leaves evicted (and, with T2, demoted and loaded back): every generated token equals the
    no-cache run, logits differ by < 1e-4, every pool ends where it began."""
    model = tiny_swa_model(seed=0, device="cpu")
    base = run_workload(Engine(model, NO_CACHE), WL, record_logits=True)
    cfg = EngineConfig(cache=CacheConfig(codec="lossless", page_size=4, kv_pages=48, **(HOST if host else {})), **SERVE)
    e = Engine(model, cfg)
    assert type(e.cache).__name__ == "HiSWARadixCache"
    evicted = {"swa": 0, "kv": 0}
    evict = e.cache.evict

    def counting(params):
        r = evict(params)
        evicted["swa"] += r.swa_num_tokens_evicted
        evicted["kv"] += r.num_tokens_evicted
        return r

    e.cache.evict = counting
    got = run_workload(e, WL, record_logits=True, on_step=e.check_invariants)
    assert_released(e)
    for a, b in zip(base, got, strict=True):
        assert b.output == a.output, f"client {a.client} round {a.round}"
    n, top1, drift, _ = compare(base, got)
    assert n >= 200 and top1 == 1.0 and drift < LOGIT_ATOL, drift
    st = e.final_stats
    assert st["tokens"]["reused"] > 0 and evicted["swa"] > 0 and evicted["kv"] > 0
    if host:  # full and SWA KV went to the host and came back
        assert st["hits"]["T2_kv_tokens"] > 0 and e.cache.stats["load_backs"] > 0
        assert st["bytes"]["T2_d2h"] > 0 and st["bytes"]["T2_h2d"] > 0


# ------------------------------------------------------------------------------- config misuse
@pytest.mark.parametrize("kw, cache, arg", [
    (dict(chunk_size=10), dict(page_size=4), "chunk_size"),
    (dict(max_running=4), dict(t0_states=2), "max_running"),
    (dict(), dict(codec="fp4"), "codec"),
    (dict(), dict(host_kv_pages=8), "host_kv_pages"),
    (dict(prefill_budget=8, chunk_size=16), dict(), "prefill_budget"),
    (dict(decode_batch="yes"), dict(), "decode_batch"),
    (dict(phase_timing=1), dict(), "phase_timing"),
    (dict(decode_graphs="on"), dict(), "decode_graphs"),
    (dict(split_checkpoints="auto"), dict(), "split_checkpoints"),
    (dict(cache=dict(page_size=4)), None, "cache"),
])
def test_config_misuse_names_the_argument(kw, cache, arg):
    with pytest.raises(InvalidArgumentError, match=arg):
        EngineConfig(**kw) if cache is None else EngineConfig(cache=CacheConfig(**cache), **kw)


def test_request_too_large_for_t0_is_refused(qwen_long):
    e = Engine(qwen_long, EngineConfig(cache=CacheConfig(codec="lossless", **dict(SMALL, kv_pages=8)), **SERVE))
    e.submit(Request(rid="big", prompt=[5] * 1000, max_new_tokens=8))  # T0 holds ~450 tokens
    with pytest.raises(MemoryError, match="kv_pages"):
        e.step()
    e.check_invariants()
    assert not e.running and e.free_sizes() == e.initial_free  # the failed admission held nothing


def test_a_step_queues_its_decode_before_its_prefills_and_reads_it_back_after(qwen_long):
    """Batched decode: the step's decode forward and its KV exports are queued first, the prefill chunks
    after them (their launches overlap the decode's device time), and the picks are read back last;
    every request's tokens are still what one request alone gets."""
    prompts = [list(range(3, 40)), list(range(50, 95))]
    ref = _reference(qwen_long, prompts)
    e = Engine(qwen_long, EngineConfig(cache=CacheConfig(codec="lossless", **SMALL), decode_graphs=True, **SERVE))
    log = []
    for name in ("_decode_launch", "_prefill_chunk", "_decode_land"):
        fn = getattr(e, name)
        setattr(e, name, lambda *a, fn=fn, name=name: log.append(name) or fn(*a))
    reqs = [Request(rid=i, prompt=p, max_new_tokens=12, record_logits=True) for i, p in enumerate(prompts)]
    e.submit(reqs[0])
    e.step()
    e.step()  # request 0 decodes from here on
    e.submit(reqs[1])
    mixed = False
    while e.has_work():
        mark = len(log)
        e.step()
        names = log[mark:]
        if "_decode_launch" in names and "_prefill_chunk" in names:
            assert names.index("_decode_launch") < names.index("_prefill_chunk") < names.index("_decode_land")
            mixed = True
    assert mixed
    for r, want in zip(reqs, ref):
        assert r.output == want.output
    assert_released(e)


def test_submit_arrival_stamp(qwen_long):
    """A front end that hands a request over after a step stamps when it arrived: its TTFT counts the
    wait. A stamp in the future, or not a number, is refused and nothing is queued."""
    e = Engine(qwen_long, EngineConfig(cache=CacheConfig(codec="lossless", **SMALL), **SERVE))
    for bad in (time.perf_counter() + 60.0, float("nan"), "now", True):
        with pytest.raises(InvalidArgumentError, match="arrival"):
            e.submit(Request(rid="x", prompt=[5] * 20, max_new_tokens=2), arrival=bad)
    assert not e.waiting
    waited = 0.5
    req = Request(rid="late", prompt=[5] * 20, max_new_tokens=2)
    e.submit(req, arrival=time.perf_counter() - waited)
    t_in = time.perf_counter()
    while e.has_work():
        e.step()
    assert req.ttft >= waited + (req.t_first_token - t_in) - 1e-6  # the half second before submit counts
    assert_released(e)


# ------------------------------------------------------------------------------------- main job
@pytest.mark.slow
def test_stress_command_smoke(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "tiered_cache", "stress", "--clients", "2", "--rounds", "2", "--question-len", "8",
           "--system-len", "8", "--max-new-tokens", "4", "--page-size", "4", "--chunk-size", "8", "--kv-pages", "24",
           "--max-running", "2", "--t0-states", "2", "--t1-states", "3", "--host-kv-pages", "32", "--host-states",
           "8", "--codec", "lossless", "--prefill-graphs", "--no-progress", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "TTFT p50" in res.stdout and "hits: states from T1" in res.stdout
    assert "identical answers, free-running (cached vs no cache): 4 / 4 turns" in res.stdout
    assert "identical answers, teacher-forced (same prompts for both): 4 / 4 turns" in res.stdout  # lossless
    rep = json.loads((out / "report.json").read_text())
    assert rep["cached"]["requests"]["finished"] == 4 and rep["no_cache"]["tokens"]["reused"] == 0
    assert rep["cached"]["tokens"]["reused"] > 0
    assert (out / "report.png").stat().st_size > 10_000


# ------------------------------------------------------------------------------------------ GPU
def test_bare_torch_kernels_takes_every_wrapper_off(qwen_long):
    """What the CUDA equality tests below rely on (``tests/support/torch_kernels``), checked on the CPU:
    after an engine's split forward wrapped the functions, each kernel-routed one is the bare torch
    function for the test (no transformers wrapper, no split wrapper), and is put back after it."""
    import transformers.models.qwen3_next.modeling_qwen3_next as mod

    from tiered_cache.engine.runner import split_forward

    split_forward.install(qwen_long)
    assert hasattr(mod.torch_chunk_gated_delta_rule, "__tiered_cache_split__")
    mp = pytest.MonkeyPatch()
    try:
        done = bare_torch_kernels(mp, qwen_long)
        names = {d.rsplit(".", 1)[1] for d in done}
        assert {"torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                "causal_conv1d_update"} <= names, done
        for name in names:
            fn = getattr(mod, name)
            assert not hasattr(fn, "__wrapped__") and not hasattr(fn, "__tiered_cache_split__"), name
            assert fn.__module__ == mod.__name__ and fn.__name__ == name
    finally:
        mp.undo()
    assert hasattr(mod.torch_chunk_gated_delta_rule, "__tiered_cache_split__")  # put back


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True, "all"], ids=["eager", "decode-graphs", "decode-and-prefill-graphs"])
def test_lossless_multi_turn_equals_no_cache_on_cuda(graphs, monkeypatch):
    """Through every tier on the GPU, and (``decode_graphs``) with decode steps replayed as CUDA graphs,
    and ("all") the prefill forwards' chunk rule too (``prefill_graphs``); the gated delta on its torch
    implementation (``bare_torch_kernels``), whether or not fla is installed."""
    from benchmarks.bench_workload import gated_delta_impl

    model = tiny_qwen3_next(seed=0, long_memory=True, device="cuda")
    bare_torch_kernels(monkeypatch, model)
    assert not gated_delta_impl(model).startswith("fla"), gated_delta_impl(model)
    torch.backends.cuda.matmul.allow_tf32 = False
    base = run_workload(Engine(model, NO_CACHE), WL, record_logits=True)
    e, got = run_checked(model, EngineConfig(cache=CacheConfig(codec="lossless", **SMALL, **HOST),
                                             decode_graphs=bool(graphs), prefill_graphs=graphs == "all", **SERVE))
    if graphs:
        assert e.runner.graph_decoder.stats["replays"] > 0
    if graphs == "all":
        gp = e.final_stats["graph_prefill"]
        assert gp["replays"] > 0 and gp["eager"] == 0 and gp["capture_error"] is None
    for a, b in zip(base, got, strict=True):
        assert b.output == a.output
    n, top1, drift, _ = compare(base, got)
    assert n >= 200 and drift < LOGIT_ATOL, drift
    st = e.final_stats
    assert st["hits"]["T1_states"] > 0 and st["hits"]["T2_states"] > 0 and st["hits"]["T2_kv_tokens"] > 0


@pytest.mark.gpu
def test_int8_long_memory_on_cuda():
    model = tiny_qwen3_next(seed=0, long_memory=True, device="cuda")
    base = run_workload(Engine(model, NO_CACHE), WL, record_logits=True)
    _, got = _int8_run(model, base, host=False)
    n, top1, drift, margins = compare(base, got)
    conf, conf_agree = confident_agreement(base, got, drift)
    print(f"cuda int8 T0+T1: {n} tokens, top-1 {top1:.4f}, drift {drift:.4f}, margin > {MARGIN_X}x drift: "
          f"{conf_agree}/{conf}, flips' margins {margins}")
    assert 0 < drift <= INT8_DRIFT_BOUND and all(m < 2 * drift for m in margins) and conf_agree == conf
