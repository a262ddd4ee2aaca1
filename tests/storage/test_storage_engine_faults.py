"""T3 faults through the reference engine (issue 9's acceptance): Redis killed mid-run, entries written
under another model's fingerprint, a slow store under each prefetch policy, and write-through to
storage switched off.

Every engine run here: lossless codec, so its tokens must equal the no-cache run's; invariants checked
after every step in which no T3 fetch is in flight (a fetch's T2 slots belong to no node until it
lands); at the end late fetches are let finish (bounded), every T3 lookup must have ended as a hit, a
miss, a changed tree, no room or a cancel (``t3_lookups`` == the sum), and the pools must be back to
their initial free sizes. Runs go on a watchdog thread (``bounded``): a wait without a bound fails the
test instead of hanging CI, and steps and ``close`` are timed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.support.storage_util import WrapBackend, own_redis  # noqa: E402,F401  (fixture)
from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.engine import tiny_qwen3_next  # noqa: E402
from tiered_cache.engine.config import EngineConfig  # noqa: E402
from tiered_cache.engine.request import Request  # noqa: E402
from tiered_cache.engine.scheduler import Engine  # noqa: E402
from tiered_cache.engine.workload import WorkloadConfig, run_workload  # noqa: E402
from tiered_cache.storage.format import HEADER_SIZE, pack_header, parse_header  # noqa: E402

WL = WorkloadConfig(clients=2, rounds=2, question_len=12, system_len=24, max_new_tokens=8)
# Three clients with their own system prompts: 32 T0 pages and 6 T1 states are too few for them, so
# KV is demoted T0 -> T2 and states T1 -> T2 while it runs (what write-through off sends to T3).
WL_EVICT = WorkloadConfig(clients=3, rounds=2, question_len=12, system_len=24, max_new_tokens=8,
                          shared_system=False)
COMMON = dict(page_size=4, chunk_size=16, prefill_budget=64, max_running=2)
TIERS = dict(codec="lossless", kv_pages=48, t0_states=2, t1_states=6, host_kv_pages=200, host_states=40,
             prefetch_policy="wait_complete")
ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def config(**over) -> EngineConfig:
    """TIERS and COMMON overridden by ``over``: EngineConfig's own fields go to it, the rest to its cache."""
    kw = {**TIERS, **COMMON, **over}
    serve = {k: kw.pop(k) for k in list(kw) if k in ENGINE_FIELDS}
    return EngineConfig(cache=CacheConfig(**kw), **serve)


RUN_BOUND_S = 120.0  # a whole run (tens of steps); a hang fails here instead of stalling CI
STEP_BOUND_S = 5.0   # one step, even right after the server died (connect + socket timeouts: 1 + 2 s)
CLOSE_BOUND_S = 10.0
SETTLE_BOUND_S = 30.0

pytestmark = pytest.mark.usefixtures("one_thread")


def no_cache(model, wl):
    return run_workload(Engine(model, config(use_cache=False)), wl)


@pytest.fixture(scope="module")
def baseline_turns(qwen_long):
    return no_cache(qwen_long, WL)


@pytest.fixture(scope="module")
def baseline(baseline_turns):
    return [t.output for t in baseline_turns]


@pytest.fixture(scope="module")
def baseline_evict(qwen_long):
    return [t.output for t in no_cache(qwen_long, WL_EVICT)]


# ------------------------------------------------------------------------------ helpers
def bounded(fn, timeout_s: float = RUN_BOUND_S):
    """``fn()`` on a daemon thread; the test fails if it has not returned within ``timeout_s``."""
    box: dict = {}

    def target():
        try:
            box["out"] = fn()
        except BaseException as e:  # re-raised on the test's thread
            box["err"] = e

    t = threading.Thread(target=target, daemon=True, name="bounded-engine-run")
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"still running after {timeout_s} s: something waits without a bound"
    if "err" in box:
        raise box["err"]
    return box["out"]


def settle(e: Engine, timeout_s: float = SETTLE_BOUND_S) -> None:
    """Let the T3 fetches still in flight finish and land (or be dropped), as later steps would."""
    deadline = time.monotonic() + timeout_s
    while e.cache.t3.fetches and time.monotonic() < deadline:
        e.cache.check_hicache_events()
        time.sleep(0.005)
    assert not e.cache.t3.fetches, f"T3 fetches still in flight after {timeout_s} s"
    e.cache.check_hicache_events()


def checked_step(e: Engine) -> None:
    """``on_step``: invariants whenever no fetch owns T2 slots outside the tree."""
    if not e.cache.t3.fetches:
        e.check_invariants()


def assert_every_lookup_ended(t3: dict) -> None:
    ends = sum(t3.get(k, 0) for k in ("hits", "miss", "tree_changed", "no_room", "cancelled"))
    assert t3.get("lookups", 0) == ends, f"a T3 lookup neither hit nor missed: {t3}"


def assert_released(e: Engine) -> dict:
    """Idle, consistent, and every pool back where it began once the tree is dropped. -> T3 stats."""
    assert not e.running and not e.waiting
    e.check_invariants()
    t3 = e.stats_dict()["T3"]  # before the reset drops the tree
    assert_every_lookup_ended(t3)
    assert e.reset_cache() == e.initial_free, "a slot, page or host slot was left behind"
    e.cache.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
    return t3


@dataclasses.dataclass
class Run:
    outs: list
    t3: dict
    max_step_s: float
    close_s: float
    engine: Engine
    calls: list = dataclasses.field(default_factory=list)


def run(model, wl: WorkloadConfig = WL, *, setup=None, on_step=None, **cfg) -> Run:
    """One engine over ``wl`` (TIERS and COMMON, overridden by ``cfg``), bounded, checked, closed.
    ``setup(engine)`` runs before the workload (e.g. wraps the backend); ``on_step(engine)`` after
    every step (invariants are checked there too)."""

    def go() -> Run:
        e = Engine(model, config(**cfg))
        try:
            if setup is not None:
                setup(e)
            last, worst = [time.monotonic()], [0.0]

            def step_hook():
                now = time.monotonic()
                worst[0] = max(worst[0], now - last[0])
                last[0] = now
                checked_step(e)
                if on_step is not None:
                    on_step(e)

            outs = [t.output for t in run_workload(e, wl, on_step=step_hook)]
            settle(e)
            t3 = assert_released(e)
        finally:
            t0 = time.monotonic()
            e.close()
            close_s = time.monotonic() - t0
        calls = list(getattr(e.cache.t3.tier.backend, "calls", []))
        return Run(outs, t3, worst[0], close_s, e, calls)

    return bounded(go)


def store_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and ".tmp" not in p.parts)


# ------------------------------------------------------------------------------ (a) Redis killed mid-run
@pytest.mark.parametrize("policy, kill_at", [("wait_complete", 2), ("wait_complete", 8), ("best_effort", 4)],
                         ids=["wait-during-first-fetch", "wait-after-a-hit", "best-effort-during-fetch"])
def test_redis_killed_mid_run(qwen_long, baseline, own_redis, policy, kill_at):  # noqa: F811
    """A second engine reads what a first one wrote to Redis; the server is SIGKILLed inside the
    engine's backend call number ``kill_at`` (2 / 4: the first prefetch's GET, after its lookup said
    the keys are there; 8: after one verified hit). From then on every lookup, fetch and write fails
    at the socket: each is a counted ``unavailable`` miss, the requests compute what they could not
    fetch, no step waits long, and ``close`` returns at once."""
    url = f"redis://127.0.0.1:{own_redis.port}"
    first = run(qwen_long, storage_url=url)
    assert first.outs == baseline and first.t3["tier"].get("written", 0) > 0, first.t3

    def setup(e):
        def before(method, n):
            if n == kill_at:
                own_redis.kill()
        e.tiers.storage.retry_after_s = 0.05  # the breaker lets calls through often: many raw failures, not one
        e.tiers.storage.backend = WrapBackend(e.tiers.storage.backend, before=before)

    r = run(qwen_long, setup=setup, storage_url=url, prefetch_policy=policy)
    assert own_redis.proc.poll() is not None, "the server was not killed during the run"
    assert len(r.calls) > kill_at + 1, f"the engine stopped using T3 after the kill: {r.calls}"
    assert r.outs == baseline
    tier = r.t3["tier"]
    assert tier.get("unavailable", 0) > 0 and tier.get("write_unavailable", 0) > 0, r.t3
    assert tier.get("error", 0) == 0, f"a dead server must read as unavailable, not as a failed op: {r.t3}"
    assert tier.get("lookup_hit", 0) > 0, r.t3  # the store had the entries before it died
    if kill_at == 8:
        assert r.t3["hits"] >= 1 and tier["hit"] > 0, r.t3  # a verified hit before the kill ...
    elif policy == "wait_complete":
        assert r.t3.get("hits", 0) == 0 and r.t3["miss"] >= 1, r.t3  # ... or the fetch failed: a miss
    assert r.max_step_s < STEP_BOUND_S, f"a step took {r.max_step_s:.2f} s after the kill"
    assert r.close_s < CLOSE_BOUND_S, f"close took {r.close_s:.2f} s"


# ------------------------------------------------------------------------------ (b) another fingerprint
def _bf16(model):
    return tiny_qwen3_next(seed=0, long_memory=True, device="cpu", dtype=torch.bfloat16)


# (writer model factory, writer config, config of both): everything else is the reader's default.
FOREIGN = {
    "weights": (lambda m: tiny_qwen3_next(seed=1, long_memory=True, device="cpu"), {}, {}),
    "model_id": (None, dict(storage_model_id="someone/another-model"), {}),
    "dtype": (_bf16, {}, dict(storage_model_id="tiny/shared-id")),  # only the dtypes differ
    "codec": (None, dict(codec="int8"), {}),
    "page_size": (None, dict(page_size=8, chunk_size=16), {}),
}


@pytest.mark.parametrize("what", list(FOREIGN))
def test_entries_of_another_fingerprint_give_zero_hits(qwen_long, baseline, tmp_path, what):
    """An engine that differs in one thing that changes the bytes (weights, model id, dtype, codec,
    page size) fills the store; ours asks for the same prompts and finds none of its keys there (the
    fingerprint seeds the key chain), computes everything, and equals the no-cache run. Control: a
    second run of ours does hit, on what the first one wrote."""
    make, writer_cfg, both = FOREIGN[what]
    url = f"file://{tmp_path / 'store'}"
    other = run(make(qwen_long) if make else qwen_long, storage_url=url, **both, **writer_cfg)
    assert other.t3["tier"].get("written", 0) > 0, other.t3
    n_foreign = len(store_files(tmp_path / "store"))
    assert other.engine.tiers.storage is None  # closed
    ours = run(qwen_long, storage_url=url, **both)
    assert ours.outs == baseline
    assert ours.t3["lookups"] > 0 and ours.t3.get("hits", 0) == 0, ours.t3
    assert ours.t3["tier"].get("lookup_hit", 0) == 0, f"a key of the other fingerprint matched: {ours.t3}"
    assert len(store_files(tmp_path / "store")) > n_foreign  # ours wrote its own entries next to them
    again = run(qwen_long, storage_url=url, **both)
    assert again.outs == baseline
    assert again.t3["hits"] > 0, again.t3


def test_a_value_stamped_with_another_fingerprint_under_our_key_is_not_served(qwen_long, baseline, tmp_path):
    """Every stored value is rewritten with a valid header carrying another fingerprint's tag, under
    our own key, with our own payload (so serving it would even give the right answer): the tag
    check must refuse it. Every lookup finds the key, every fetch is a counted ``bad_foreign`` miss."""
    store = tmp_path / "store"
    url = f"file://{store}"
    first = run(qwen_long, storage_url=url)
    assert first.outs == baseline
    e = first.engine
    foreign_tag = dataclasses.replace(e.cache.t3.tier.fingerprint, model_id="someone/another-model").tag
    assert foreign_tag != e.cache.t3.tier.tag
    files = store_files(store)
    assert files
    for p in files:
        b = p.read_bytes()
        h = parse_header(b)
        payload = b[HEADER_SIZE:]
        p.write_bytes(pack_header(h.kind, payload, foreign_tag, h.key, h.t2_checksum) + payload)
    r = run(qwen_long, storage_url=url)
    assert r.outs == baseline
    tier = r.t3["tier"]
    assert tier.get("lookup_hit", 0) > 0 and r.t3.get("hits", 0) == 0 and tier.get("hit", 0) == 0, r.t3
    assert tier.get("bad_foreign", 0) > 0, r.t3


# ------------------------------------------------------------------------------ (c) prefetch policies
GET_DELAY_S = 0.6     # every GET of the slow store
TIMEOUT_S = 0.05      # prefetch_timeout_s


@pytest.mark.parametrize("policy", ["wait_complete", "timeout", "best_effort"])
def test_prefetch_policies_with_a_slow_store(qwen_long, baseline_turns, baseline, tmp_path, policy):
    """A restarted engine over a store whose every GET takes ``GET_DELAY_S``; its first request's
    prefix is all in T3. ``wait_complete``: the match waits for the fetch and the request starts from
    it (loaded back from T2). ``timeout``: the match gives up after ``prefetch_timeout_s``, the request
    computes its prefix, and the fetch goes on; when it lands the tree has the request's own copy, so
    it is dropped (``tree_changed``) and its T2 slots are freed. ``best_effort``: the match never
    waits. Then the whole workload on the same engine (its tree, late fetches and all) still equals
    the no-cache run."""
    url = f"file://{tmp_path / 'store'}"
    fill = run(qwen_long, storage_url=url)
    assert fill.outs == baseline

    def go():
        e = Engine(qwen_long, config(prefetch_policy=policy, storage_url=url, prefetch_timeout_s=TIMEOUT_S))
        try:
            assert e.cache.t3.policy == policy and e.cache.t3.timeout_s == TIMEOUT_S
            e.tiers.storage.backend = w = WrapBackend(e.tiers.storage.backend, delay_s=GET_DELAY_S, slow=("get",))
            t0 = baseline_turns[0]
            r = Request("first", list(t0.prompt), len(t0.output))
            e.submit(r)
            start = time.monotonic()
            e.step()  # admits r: its match asks T3 (and, per policy, waits)
            first_step = time.monotonic() - start
            waited_reused = (r.reused_tokens, r.reused_host_tokens)
            stats0 = dict(e.cache.stats)
            while e.has_work():
                e.step()
                checked_step(e)
            assert r.output == t0.output
            settle(e)
            e.check_invariants()
            stats1 = dict(e.cache.stats)
            outs = [t.output for t in run_workload(e, WL, on_step=lambda: checked_step(e))]
            settle(e)
            t3 = assert_released(e)
            return first_step, waited_reused, stats0, stats1, outs, t3, list(w.calls)
        finally:
            e.close()

    first_step, (reused, reused_host), stats0, stats1, outs, t3, calls = bounded(go)
    assert "get" in calls
    if policy == "wait_complete":
        assert first_step >= GET_DELAY_S, f"the match did not wait for the fetch ({first_step:.3f} s)"
        assert stats0.get("t3_hits") == 1 and reused > 0 and reused_host == reused, (stats0, reused)
        assert not stats0.get("t3_wait_timed_out")
    else:
        assert first_step < GET_DELAY_S, f"the match waited {first_step:.3f} s"  # waiting takes >= that
        assert reused == 0 and not stats0.get("t3_hits"), (stats0, reused)
        assert stats0.get("t3_wait_timed_out", 0) == (policy == "timeout"), stats0
        # the late fetch found the request's own copy of the prefix under its anchor: dropped, not hung
        assert stats1.get("t3_tree_changed") == 1 and not stats1.get("t3_hits"), stats1
    assert outs == baseline
    assert t3["tier"].get("hit", 0) > 0, t3  # the fetched bytes were verified (and then used or dropped)


# ------------------------------------------------------------------------------ (d) write-through off
NO_EVICTION = dict(kv_pages=400, t1_states=40)  # room for everything WL caches: nothing is ever evicted


def test_without_write_through_nothing_evicted_means_nothing_in_t3(qwen_long, baseline, tmp_path):
    """``storage_write_through=False``: T3 gets only what eviction demotes to T2 (HostTierConfig),
    and ``close`` does not flush the tiers above. With room for everything nothing is evicted, so
    nothing is written, and a restart on the same directory starts cold (zero T3 hits)."""
    store = tmp_path / "store"
    url = f"file://{store}"

    def nothing_evicted_or_written(e):
        c = e.cache
        assert c.tree.freed["kv"] == 0 and not c.stats.get("state_demotes"), "evicted: the pools are too small"
        assert not c.stats.get("t3_kv_pages_written") and not c.stats.get("t3_states_written"), dict(c.stats)

    a = run(qwen_long, storage_url=url, storage_write_through=False, on_step=nothing_evicted_or_written,
            **NO_EVICTION)
    assert a.outs == baseline
    assert a.t3.get("kv_pages_written", 0) == a.t3.get("states_written", 0) == 0, a.t3
    assert store_files(store) == []
    b = run(qwen_long, storage_url=url, storage_write_through=False, **NO_EVICTION)
    assert b.outs == baseline
    assert b.t3["lookups"] > 0 and b.t3.get("hits", 0) == 0, b.t3


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_without_write_through_t3_gets_what_eviction_demotes(qwen_long, baseline_evict, tmp_path, write_policy):
    """``storage_write_through=False`` under tight T0/T1: nothing reaches T3 before the first eviction;
    KV pages go when eviction demotes them T0 -> T2 (whatever the T2 write policy) and states when
    they are demoted T1 -> T2; fewer entries than with write-through; and a restart on the same
    directory finds prefixes that were pushed down (T3 hits), still equal to the no-cache run."""
    base = baseline_evict
    store = tmp_path / "store"
    url = f"file://{store}"
    tight = dict(kv_pages=32, write_policy=write_policy)

    seen = {"kv": 0, "states": 0}

    def before_eviction_nothing_written(e):
        c = e.cache
        seen["kv"], seen["states"] = c.tree.freed["kv"], c.stats.get("state_demotes", 0)  # read before the reset
        written = c.stats.get("t3_kv_pages_written", 0) + c.stats.get("t3_states_written", 0)
        assert seen["kv"] or seen["states"] or not written, f"T3 written before any eviction: {dict(c.stats)}"

    a = run(qwen_long, WL_EVICT, storage_url=url, storage_write_through=False,
            on_step=before_eviction_nothing_written, **tight)
    assert a.outs == base
    assert seen["kv"] > 0 and seen["states"] > 0, f"the workload evicted too little to test anything: {seen}"
    assert a.t3.get("kv_pages_written", 0) > 0 and a.t3.get("states_written", 0) > 0, a.t3
    wt = run(qwen_long, WL_EVICT, storage_url=f"file://{tmp_path / 'wt'}", **tight)
    assert wt.outs == base
    # (write_back: KV reaches T2 only through eviction anyway, but a victim's ancestors copied along
    # with it go to T3 only when they are demoted themselves)
    assert a.t3["kv_pages_written"] <= wt.t3["kv_pages_written"], (a.t3, wt.t3)
    assert a.t3["states_written"] < wt.t3["states_written"], (a.t3, wt.t3)
    assert len(store_files(store)) < len(store_files(tmp_path / "wt"))
    b = run(qwen_long, WL_EVICT, storage_url=url, storage_write_through=False, **tight)
    assert b.outs == base
    assert b.t3["hits"] > 0 and b.t3["hit_tokens"] > 0, b.t3
