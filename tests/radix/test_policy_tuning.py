"""Marconi's online alpha (issue 23): the ghost cache the tuner replays on, and the tuner in the live policy.

Ghost: its counts, candidate sets and admission (leaf + branch) after every request of random traces,
hits against a brute-force reading of its own nodes, a copy that runs alike and leaves the original
alone. Tuner: on a trace whose best alpha is small and one whose best is large, the live policy moves
alpha to the value that independent replays (fresh ghosts, warmed from scratch) score best; it replays
once per window, never per eviction; the stack's Marconi policy comes with a tuner of the tree's budget
and learns from ``cache_finished_req``.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from tiered_cache import costs
from tiered_cache.config import CacheConfig
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix import CacheReq
from tiered_cache.radix.policies import ALPHA_GRID, AlphaTuner, GhostCache, MarconiPolicy, PrefixCosts, make_policy
from tiered_cache.radix.policies import ghost as ghost_mod
from tiered_cache.radix.policies import tuning as tuning_mod
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.stack import TieredCache


def _costs():
    return PrefixCosts.of(costs.MARCONI_7B, tokens_per_key=64, t1_int8=False)


def _marconi(alpha: float = 1.0) -> MarconiPolicy:
    return MarconiPolicy(_costs(), alpha=alpha)


def _paths(g: GhostCache) -> dict:
    """node -> its tokens from the root."""
    out, stack = {}, [(c, []) for c in g.root.children.values()]
    while stack:
        x, pre = stack.pop()
        out[x] = pre + list(x.key)
        stack.extend((c, out[x]) for c in x.children.values())
    return out


def _check(g: GhostCache) -> None:
    paths = _paths(g)
    assert g.kv == sum(len(x.key) for x in paths) <= g.kv_cap
    assert g.st == sum(x.mamba_value is not None for x in paths) <= g.st_cap
    for x in paths:
        assert x.key and x.parent.children[x.key[0]] is x
        assert x.children or x.mamba_value is not None, "a stateless leaf"
    assert g.policy.candidates("kv") == {x for x in paths if not x.children}
    assert g.policy.candidates("state") == {x for x in paths if x.mamba_value is not None}


def _hit(g: GhostCache, seq: list[int]) -> int:
    """The longest prefix of ``seq`` that is the whole path of a node with a state (brute force)."""
    best = 0
    for x, p in _paths(g).items():
        if x.mamba_value is not None and p == seq[:len(p)]:
            best = max(best, len(p))
    return best


def _trace(rng: random.Random, n: int) -> list[list[int]]:
    """Sessions of growing sequences over a few shared prefixes: hits, splits, branch points."""
    shared = [[rng.randrange(1000, 2000) for _ in range(rng.randint(1, 6))] for _ in range(3)]
    live: list[list[int]] = []
    out = []
    for _ in range(n):
        if live and rng.random() < 0.6:
            s = rng.choice(live)
            s += [rng.randrange(2000, 10 ** 6) for _ in range(rng.randint(1, 4))]
        else:
            s = list(rng.choice(shared)) + [rng.randrange(2000, 10 ** 6) for _ in range(rng.randint(0, 5))]
            live.append(s)
        out.append(list(s))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_ghost_keeps_its_counts_and_rules(seed):
    rng = random.Random(seed)
    g = GhostCache(_marconi(rng.choice(ALPHA_GRID)), kv_tokens=rng.randint(8, 60), states=rng.randint(1, 12))
    for seq in _trace(rng, 120):
        want = _hit(g, seq)
        assert g.request(seq) == want
        _check(g)
        if len(seq) <= g.kv_cap and g.st_cap >= 2:  # it fits: the sequence's end keeps a state (the leaf)
            assert _hit(g, seq) == len(seq) or g.st == g.st_cap or g.kv > g.kv_cap - len(seq)


def test_ghost_admits_leaf_and_branch_states():
    g = GhostCache(_marconi(), kv_tokens=100, states=100)
    assert g.request([1, 2, 3, 4, 5]) == 0
    assert g.request([1, 2, 3, 9]) == 0  # leaves [1 2 3 4 5] inside its span: [1 2 3] is a branch point
    assert {tuple(p) for x, p in _paths(g).items() if x.mamba_value} == {(1, 2, 3), (1, 2, 3, 4, 5), (1, 2, 3, 9)}
    assert g.request([1, 2, 3, 4, 5, 6]) == 5
    assert g.request([1, 2, 3, 7]) == 3  # at the end of a node with children: [1 2 3] has its state already
    _check(g)
    g.request([1, 2, 3, 4, 5, 6, 8])  # [.. 6] is a leaf with a state: no branch there, a longer leaf
    assert g.request([1, 2, 3, 4, 5, 6, 8]) == 7
    _check(g)


def test_ghost_copy_runs_alike_and_apart():
    rng = random.Random(3)
    trace = _trace(rng, 200)
    g = GhostCache(_marconi(2.0), kv_tokens=40, states=6)
    for seq in trace[:100]:
        g.request(seq)
    before = {tuple(p): x.mamba_value for x, p in _paths(g).items()}
    twin = g.copy(_marconi(2.0))
    _check(twin)
    assert {tuple(p): x.mamba_value for x, p in _paths(twin).items()} == before
    hits = [twin.request(seq) for seq in trace[100:]]
    assert {tuple(p): x.mamba_value for x, p in _paths(g).items()} == before  # the original untouched
    assert [g.request(seq) for seq in trace[100:]] == hits  # same state, same stamps: same victims


def test_ghost_bad_budgets():
    with pytest.raises(InvalidArgumentError, match="kv_tokens"):
        GhostCache(_marconi(), kv_tokens=0, states=1)
    with pytest.raises(InvalidArgumentError, match="states"):
        GhostCache(_marconi(), kv_tokens=1, states=0)


# ------------------------------------------------------------------------------------------ tuner
def _reused_short_vs_one_shot_long(rng: random.Random, n: int) -> list[list[int]]:
    """Short conversations that come back soon, among long one-shot documents: FLOP efficiency keeps the
    documents (long prefixes save the most per byte) and loses the conversations; recency keeps them."""
    chats = [[rng.randrange(10 ** 6)] for _ in range(6)]
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append([rng.randrange(10 ** 6, 10 ** 7) for _ in range(24)])
        else:
            c = chats[i % len(chats)]
            c += [rng.randrange(10 ** 6) for _ in range(2)]
            out.append(list(c))
            if len(c) > 10:
                chats[i % len(chats)] = [rng.randrange(10 ** 6)]
    return out


def _long_reused_vs_short_noise(rng: random.Random, n: int) -> list[list[int]]:
    """Long contexts that come back after a while, among short one-shot requests: recency loses the
    contexts to the noise; FLOP efficiency keeps them."""
    docs = [[rng.randrange(10 ** 6, 10 ** 7) for _ in range(20)] for _ in range(3)]
    out = []
    for i in range(n):
        if i % 4 == 0:
            out.append(docs[(i // 4) % len(docs)] + [rng.randrange(10 ** 7, 10 ** 8)])
        else:
            out.append([rng.randrange(10 ** 7, 10 ** 8) for _ in range(3)])
    return out


def _independent_scores(trace, warm_n, window, grid, kv_tokens, states, live=1.0):
    """Each alpha's FLOPs saved on the first window, by a fresh ghost that ran the whole warm-up itself
    (under the live alpha, as the live cache did), then the window under that alpha."""
    pc, out = _costs(), {}
    for a in grid:
        g = GhostCache(_marconi(live), kv_tokens, states)
        for seq in trace[:warm_n]:
            g.request(seq)
        g.policy.alpha = a
        out[a] = float(sum(pc.saved(0, g.request(seq)) for seq in trace[warm_n:warm_n + window]))
    return out


@pytest.mark.parametrize("trace_of,kv_tokens,states,side", [(_reused_short_vs_one_shot_long, 60, 6, "below"),
                                                            (_long_reused_vs_short_noise, 80, 5, "above")])
def test_tuner_moves_alpha_to_the_best_value(trace_of, kv_tokens, states, side):
    """The live policy starts at alpha 1; after its first window from the first eviction, alpha is the
    value fresh ghosts score best on that window, and on these traces that is not 1."""
    window, warm_n = 40, 30
    trace = trace_of(random.Random(1), warm_n + window)
    p = make_policy("marconi", _costs(), tiered=False, budget=(kv_tokens, states), window=window)
    assert p.alpha == 1.0 and isinstance(p.tuner, AlphaTuner)
    for seq in trace[:warm_n]:
        p.observe(seq, 0)
    p.counts["state"] += 1  # what the live tree's pop does: from here on it evicts
    for seq in trace[warm_n:]:
        p.observe(seq, kv_tokens)  # the live tree held its whole budget
    want = _independent_scores(trace, warm_n, window, ALPHA_GRID, kv_tokens, states)
    assert p.tuner.history == [want]
    best = max(ALPHA_GRID, key=lambda a: (want[a], -a))
    assert p.alpha == best and p.tunings == 1
    assert (best < 1.0) if side == "below" else (best > 1.0)
    assert want[best] > want[1.0]


def test_tuner_replays_once_per_window(monkeypatch):
    """No replay before the window fills, whatever the evictions; then one per value of the grid (and
    the live value), each of the window's requests once, on ghosts of the KV the live tree held; the
    next base is the live value's replay."""
    calls = []
    real = ghost_mod.GhostCache.request

    def counted(self, seq):
        calls.append(self)
        return real(self, seq)

    monkeypatch.setattr(tuning_mod.GhostCache, "request", counted)
    p = MarconiPolicy(_costs(), alpha=0.25, tuner=AlphaTuner(_marconi, 30, 4, grid=(0.0, 2.0), window=5))
    trace = _reused_short_vs_one_shot_long(random.Random(0), 20)
    for seq in trace[:3]:
        p.observe(seq, 0)
    assert len(calls) == 3  # the warm-up: into the base ghost
    p.counts["kv"] += 1
    for seq in trace[3:7]:
        p.counts["kv"] += 50  # many evictions in the live tree, no replay
        p.observe(seq, 12)
    assert len(calls) == 3 and not p.tuner.history
    p.observe(trace[7], 9)
    assert len(calls) == 3 + 3 * 5 and len(p.tuner.history) == 1 and set(p.tuner.history[0]) == {0.0, 2.0}
    live_replay = calls[3 + 5]  # values in order 0, 0.25, 2: the second replay ran under the live 0.25
    assert p.tuner.base is live_replay and p.alpha in (0.0, 2.0)
    assert p.tuner.seconds > 0.0
    # the replays ran on ghosts of the most KV the live tree held in the window (12 of its 30: the
    # running requests hold the rest), not of its budget
    assert {g.kv_cap for g in calls[3:]} == {12} and p.tuner.held == 0
    for seq in trace[8:13]:
        p.observe(seq, 33)  # a T0 shared with the states can hold more than the KV budget
    assert {g.kv_cap for g in calls[18:]} == {33}


@pytest.mark.parametrize("delay", [0.0, 0.05])
def test_background_tuning_takes_each_window_one_window_late_whatever_the_timing(monkeypatch, delay):
    """``background=True`` (the stack's): the replays run beside the requests, so the request that fills
    a window does not wait for them, and each result is taken when the next window fills (waiting only
    if the replay still runs). The scores and values are the inline tuner's, one window late, however
    slow the replay (``delay`` per ghost request): what keeps TP ranks' trees identical."""
    real = ghost_mod.GhostCache.request

    def slow(self, seq):
        if delay:
            time.sleep(delay / 20)
        return real(self, seq)

    monkeypatch.setattr(tuning_mod.GhostCache, "request", slow)
    window, trace = 5, _reused_short_vs_one_shot_long(random.Random(3), 33)
    alphas = {}
    for bg in (False, True):
        p = MarconiPolicy(_costs(), alpha=1.0,
                          tuner=AlphaTuner(_marconi, 30, 4, grid=(0.0, 1.0, 4.0), window=window, background=bg))
        p.observe(trace[0], 0)  # warm-up, then the live tree evicts
        p.counts["kv"] += 1
        seen = []
        for i, seq in enumerate(trace[1:]):
            p.observe(seq, 20)
            seen.append(p.alpha)
            if bg and i == window - 1:  # the first window filled: its replay runs, nothing is taken yet
                assert p.tuner._pending is not None and not p.tuner.history and p.alpha == 1.0
        alphas[bg] = seen
        p.tuner._pending and p.tuner._pending[0].join()
    inline, late = alphas[False], alphas[True]
    assert late[:2 * window - 1] == [1.0] * (2 * window - 1)
    assert late[2 * window - 1:] == inline[window - 1:len(late) - window]  # each value one window late
    assert len(set(inline)) > 1  # the weight did move: the comparison is not between constants


def test_a_background_replay_that_fails_stops_tuning_and_raises_nothing(monkeypatch):
    """A serving thread never sees a replay's failure: the tuner records it, keeps the weight and replays
    no more."""
    p = MarconiPolicy(_costs(), alpha=0.5, tuner=AlphaTuner(_marconi, 30, 4, window=2, background=True))
    trace = _reused_short_vs_one_shot_long(random.Random(4), 12)
    p.observe(trace[0], 0)
    p.counts["kv"] += 1
    calls = []

    def broken(self, seq):
        calls.append(seq)
        raise RuntimeError("ghost broke")

    monkeypatch.setattr(tuning_mod.GhostCache, "request", broken)
    for seq in trace[1:5]:  # the window fills at trace[2] (the replay fails beside the requests), then trace[4]
        p.observe(seq, 9)
    assert isinstance(p.tuner.error, RuntimeError) and p.alpha == 0.5 and p.tunings == 0
    n = len(calls)
    assert n > 0  # the replay did run (and fail)
    for seq in trace[5:]:
        p.observe(seq, 9)
    assert len(calls) == n and p.tuner._pending is None and p.alpha == 0.5


def test_clearing_the_policy_resets_its_tuner():
    p = MarconiPolicy(_costs(), tuner=AlphaTuner(_marconi, 30, 4, window=3, background=True))
    trace = _reused_short_vs_one_shot_long(random.Random(5), 6)
    p.observe(trace[0], 0)
    p.counts["kv"] += 1
    for seq in trace[1:4]:
        p.observe(seq, 9)
    assert p.tuner._pending is not None
    p.clear()
    assert p.tuner._pending is None and p.tuner.base is None and not p.tuner.recent


def test_clearing_does_not_wait_for_a_running_replay_and_drops_it():
    """``reset`` (a clear of the live cache) while a background replay runs returns without waiting for it:
    the replay is told to stop at its next ghost request and its result is never taken, and the tuner starts
    afresh (a new warm-up, a new window, replayed and taken as usual)."""
    release, entered = threading.Event(), threading.Event()
    made = []

    def make(alpha):  # a replay's policies wait for ``release``: the replay is running while reset is called
        made.append(alpha)
        if threading.current_thread().name == "alpha-tuner" and not release.is_set():
            entered.set()
            release.wait(60)
        return _marconi(alpha)

    p = MarconiPolicy(_costs(), tuner=AlphaTuner(make, 30, 4, grid=(0.0, 2.0), window=3, background=True))
    trace = _reused_short_vs_one_shot_long(random.Random(6), 14)
    p.observe(trace[0], 0)
    p.counts["kv"] += 1
    for seq in trace[1:4]:
        p.observe(seq, 9)
    assert entered.wait(60)  # the replay of the first window is running, held in its first policy
    thread = p.tuner._pending[0]
    clearing = threading.Thread(target=p.clear)
    clearing.start()
    clearing.join(60)  # a guard against a hang, not a timing: with the replay held, a join would never end
    done = not clearing.is_alive()
    release.set()
    thread.join(60)
    assert done and not thread.is_alive()
    assert made.count(0.0) == 1 and 2.0 not in made[1:]  # it stopped at its first ghost request once released
    assert p.tuner._pending is None and p.tuner.base is None and not p.tuner.history and p.tunings == 0
    p.observe(trace[4], 0)  # afresh: a warm-up, then two windows, the first taken when the second fills
    p.counts["kv"] += 1
    for seq in trace[5:11]:
        p.observe(seq, 9)
    assert len(p.tuner.history) == 1 and p.tuner.error is None
    p.tuner._pending[0].join()


def test_tuner_bad_arguments():
    with pytest.raises(InvalidArgumentError, match="grid"):
        AlphaTuner(_marconi, 10, 2, grid=(-1.0,))
    with pytest.raises(InvalidArgumentError, match="grid"):
        AlphaTuner(_marconi, 10, 2, grid=())
    with pytest.raises(InvalidArgumentError, match="window"):
        AlphaTuner(_marconi, 10, 2, window=0)
    with pytest.raises(InvalidArgumentError, match="kv_tokens"):
        AlphaTuner(_marconi, 0, 2)
    with pytest.raises(InvalidArgumentError, match="states"):
        AlphaTuner(_marconi, 1, 0)
    for flag in (1, "yes", None):  # a bool only (``validate.bool_arg``)
        with pytest.raises(InvalidTypeError, match="background"):
            AlphaTuner(_marconi, 10, 2, background=flag)


def test_only_marconi_takes_a_tuner():
    """SegLen and ours have no tuned weight: make_policy gives them no tuner, and they refuse one."""
    for name in ("seglen", "tiered"):
        assert make_policy(name, _costs(), tiered=False, budget=(10, 2)).tuner is None
        with pytest.raises(InvalidTypeError, match="tuner"):
            make_policy(name, _costs(), tiered=False, tuner=AlphaTuner(_marconi, 10, 2))
    assert make_policy("marconi", _costs(), tiered=False).tuner is None  # no budget: alpha stays
    with pytest.raises(InvalidTypeError, match="tuner"):
        MarconiPolicy(_costs(), tuner="grid")


def test_stack_marconi_tunes_from_finished_requests():
    """TieredCache.build gives Marconi a tuner over the tree's budget; every cache_finished_req reaches it."""
    kv = KVSpec(num_layers=1, kv_heads=1, head_dim=4, dtype=torch.float32)
    st = StateSpec(num_layers=1, temporal_shape=(1, 2, 2), temporal_dtype=torch.float32, conv_shapes=((2, 2),),
                   conv_dtype=torch.float32)
    cfg = CacheConfig(page_size=2, kv_pages=32, t0_states=2, t1_states=5, eviction_policy="marconi",
                      cost_model="marconi-7b", backend="torch")
    stack = TieredCache.build(cfg, kv=kv, state=st, device="cpu")
    pol = stack.tree.tree.policy
    assert isinstance(pol, MarconiPolicy) and (pol.tuner.kv_tokens, pol.tuner.states) == (64, 5)
    cache = stack.tree
    toks = [1, 2, 3, 4, 5, 6]
    req = CacheReq(token_ids=toks, kv_indices=stack.alloc_kv(len(toks)))
    req.mamba_pool_idx = stack.alloc_states(1)
    cache.cache_finished_req(req)
    assert pol.tuner.base.kv_cap == 64 and max(len(p) for p in _paths(pol.tuner.base).values()) == 6
