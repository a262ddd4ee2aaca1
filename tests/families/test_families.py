"""Every hybrid family of the installed transformers that the engine serves, end to end (issue 20).

Per family a tiny seeded model (``engine.models.tiny_family``) runs a multi-turn workload through the
tiers with the lossless codec, budgets small enough that states and KV go to T1 and T2 and come back,
and every generated token must equal the no-cache run's, with every decode path the family supports.

Each family's pass is checked not to be vacuous: the same run with the cached states zeroed on every
resume (a state model) or the sliding layers' KV zeroed (an SWA model) must break that equality. A
state model's recipe for a state that matters is ``long_memory=True`` (its measured zeroed-state drift
at 24 tokens: Mamba2 2.1-2.3, KDA 2.9, gated delta-net 2.9-3.3; flips 12-92% of the next tokens).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.engine import kinds as kinds_mod  # noqa: E402
from tiered_cache.engine.config import EngineConfig  # noqa: E402
from tiered_cache.engine.models import tiny_family  # noqa: E402
from tiered_cache.engine.scheduler import Engine  # noqa: E402
from tiered_cache.engine.workload import WorkloadConfig, run_workload  # noqa: E402

WL = WorkloadConfig(clients=4, rounds=3, question_len=12, system_len=24, max_new_tokens=8)
SERVE = dict(chunk_size=16, prefill_budget=64, max_running=2)
# T0: 44 pages of 4 tokens (2 running requests reserve up to 2 x 21); T1: 8 states, so some state hits
# come from T1 and some from T2; T2 beside.
TIERS = dict(codec="lossless", page_size=4, kv_pages=44, t0_states=2, t1_states=8, host_kv_pages=160,
             host_states=24)
NO_CACHE = EngineConfig(use_cache=False, cache=CacheConfig(page_size=4), **SERVE)

STATE = ["bamba", "granitemoehybrid", "kimi_linear", "qwen3_5", "olmo_hybrid"]
SWA = ["gpt_oss", "cohere2"]
# decode paths per family: one request per forward everywhere; batched (decode_batch) and static
# (decode_graphs, run eagerly on CPU) where the family has no sliding layers (sliding ones decode one
# request at a time, as EngineConfig.decode_batch says)
PATHS = {f: ("alone", "batch", "static") for f in STATE} | {f: ("alone",) for f in SWA}
CASES = [(f, p) for f in STATE + SWA for p in PATHS[f]]

pytestmark = pytest.mark.usefixtures("one_thread")

_models: dict[str, object] = {}
_baselines: dict[str, list] = {}


def model_of(family: str):
    if family not in _models:
        _models[family] = tiny_family(family, seed=0, long_memory=family in STATE, device="cpu")
    return _models[family]


def baseline_of(family: str):
    if family not in _baselines:
        _baselines[family] = run_workload(Engine(model_of(family), NO_CACHE), WL)
    return _baselines[family]


def config(path: str) -> EngineConfig:
    return EngineConfig(cache=CacheConfig(**TIERS), decode_batch=path == "batch", decode_graphs=path == "static",
                        **SERVE)


def run_checked(model, cfg: EngineConfig):
    e = Engine(model, cfg)
    turns = run_workload(e, WL, on_step=e.check_invariants)
    assert not e.running and not e.waiting
    stats = e.stats_dict()
    assert e.reset_cache() == e.initial_free, "a slot, page or host slot was left behind"
    return e, stats, turns


@pytest.mark.parametrize("family, path", CASES, ids=[f"{f}-{p}" for f, p in CASES])
def test_lossless_through_t1_and_t2_equals_no_cache(family, path):
    model, base = model_of(family), baseline_of(family)
    e, st, got = run_checked(model, config(path))
    for a, b in zip(base, got, strict=True):
        assert (a.client, a.round, a.prompt) == (b.client, b.round, b.prompt)
        assert b.output == a.output, f"{family}: client {a.client} round {a.round}"
    assert st["tokens"]["reused"] > 0 and st["hits"]["T2_kv_tokens"] > 0
    assert st["bytes"]["T2_d2h"] > 0 and st["bytes"]["T2_h2d"] > 0
    if family in STATE:  # states went through T1 (more stored than it holds) and T2, and came back
        assert st["hits"]["T1_states"] > 0 and st["hits"]["T2_states"] > 0
        assert e.tiers.t1.stats["stores"] > TIERS["t1_states"]
    if path != "alone":  # some steps did batch
        assert st["tokens"]["decode_forwards"] < st["tokens"]["decoded"]
    if path == "static":
        assert e.runner.graph_decoder.stats["steps"] == st["tokens"]["decode_forwards"] > 0


def _zeroing(real):
    """``Kind.resume`` that zeroes what the cache brought: the linear layers' conv windows and states, the
    sliding layers' KV (the full-attention KV is left as it is)."""
    def resume(self, req, n):
        cache, nbytes = real(self, req, n)
        for layer in cache.layers:
            if hasattr(layer, "conv_states"):
                for d in (layer.conv_states, layer.recurrent_states):
                    for t in d.values():
                        if isinstance(t, torch.Tensor):
                            t.zero_()
            elif getattr(layer, "sliding_window", None) and isinstance(getattr(layer, "keys", None), torch.Tensor):
                layer.keys.zero_()
                layer.values.zero_()
        return cache, nbytes
    return resume


@pytest.mark.parametrize("family", STATE + SWA)
def test_negative_control_zeroed_cache_breaks_equality(family, monkeypatch):
    """The same run with what the tiers carry zeroed on every resume: some turn must differ, or the
    equality above would prove nothing."""
    cls = kinds_mod.StateKind if family in STATE else kinds_mod.SWAKind
    monkeypatch.setattr(cls, "resume", _zeroing(cls.resume))
    _, st, got = run_checked(model_of(family), config("alone"))
    assert st["tokens"]["reused"] > 0
    differ = [(a.client, a.round) for a, b in zip(baseline_of(family), got, strict=True) if a.output != b.output]
    assert differ, f"{family}: zeroed states left every turn equal"
