"""The chunk rule of prefill forwards on padded static buffers (``engine.runner.graph_prefill``), against plain
calls of the same rule: transformers' torch rule pads to its chunk size the same way, so a padded call
computes exactly the plain one (outputs and final state bit for bit); on a GPU the captured graph's
replays match the eager calls; through the engine the tokens and cached states are those of an engine
without it."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("transformers")

from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.engine import EngineConfig, tiny_qwen3_next  # noqa: E402
from tiered_cache.engine.runner.graph_prefill import GraphChunkRule, routed  # noqa: E402
from tiered_cache.errors import InvalidArgumentError  # noqa: E402

H_K, H_V, D_K, D_V = 2, 4, 16, 8


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():  # as the engine's forwards run; a call that records autograd runs eagerly
        yield


def _rule():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    fn = m.torch_chunk_gated_delta_rule
    return getattr(fn, "__tiered_cache_split__", fn)  # the unwrapped rule, if the engine wrapped it


def _inputs(t, seed, device="cpu", batch=1):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(device)

    q, k, v = r(batch, t, H_V, D_K), r(batch, t, H_V, D_K), r(batch, t, H_V, D_V)
    kw = dict(g=-torch.rand(batch, t, H_V, generator=g).to(device),
              beta=torch.rand(batch, t, H_V, generator=g).to(device),
              initial_state=r(batch, H_V, D_K, D_V), output_final_state=True, use_qk_l2norm_in_kernel=True)
    return q, k, v, kw


def test_padded_calls_equal_plain_calls_in_any_order():
    """Lengths in and across buckets, longer before shorter: a call must not see an earlier, longer
    call's tokens in its padding (they would move the state), also where a call in a smaller bucket
    came between; every output and state is bit-exact."""
    orig, rule = _rule(), GraphChunkRule("cpu")
    lengths = ((60, 1), (17, 2), (64, 3), (1, 4), (130, 5), (33, 7), (100, 8), (70, 6))
    for t, seed in lengths:
        q, k, v, kw = _inputs(t, seed)
        want_o, want_s = orig(q, k, v, **kw)
        got_o, got_s = rule(orig, q, k, v, **kw)
        assert torch.isfinite(want_o).all() and torch.isfinite(want_s).all()
        assert got_o.shape == want_o.shape and torch.equal(got_o, want_o), t
        assert torch.equal(got_s, want_s), t
    assert rule.stats["eager"] == 0 and rule.stats["calls"] == len(lengths)
    assert len(rule.entries) == 3  # buckets of 64, 128 and 192 tokens
    # ... reading leading views of one set of input buffers (their memory does not grow with the shapes)
    assert len({e.views[i].data_ptr() for e in rule.entries.values() for i in range(5)}) == 5
    assert all(e.views[0].shape[1] in (64, 128, 192) for e in rule.entries.values())
    assert rule.stats["padded_tokens"] == sum(-(-t // 64) * 64 - t for t, _ in lengths)


def test_without_initial_or_final_state():
    orig, rule = _rule(), GraphChunkRule("cpu")
    q, k, v, kw = _inputs(40, 8)
    kw = dict(kw, initial_state=None, output_final_state=False)
    want_o, want_s = orig(q, k, v, **kw)
    got_o, got_s = rule(orig, q, k, v, **kw)
    assert want_s is None and got_s is None and torch.equal(got_o, want_o)
    # the same length with an initial state is another shape: its own buffers
    q, k, v, kw2 = _inputs(40, 9)
    assert torch.equal(rule(orig, q, k, v, **kw2)[1], orig(q, k, v, **kw2)[1])
    assert len(rule.entries) == 2


def test_calls_it_does_not_replay_run_as_they_came():
    orig, rule = _rule(), GraphChunkRule("cpu", max_tokens=64, max_graphs=1)
    seen = []

    def spy(q, k, v, *args, **kw):
        seen.append(q.shape[1])
        kw.pop("cu_seqlens", None)  # the torch rule takes one sequence only
        return orig(q, k, v, *args, **kw)

    for t, batch in ((100, 1), (20, 2)):  # longer than max_tokens; two sequences
        q, k, v, kw = _inputs(t, t, batch=batch)
        assert torch.equal(rule(spy, q, k, v, **kw)[0], orig(q, k, v, **kw)[0])
    q, k, v, kw = _inputs(20, 1)
    rule(spy, q, k, v, **kw, cu_seqlens=torch.tensor([0, 20]))  # varlen
    rule(spy, q, k, v, **dict(kw, initial_state=None))  # a first shape: kept
    rule(spy, q, k, v, **kw)  # a second shape past max_graphs: eager
    with torch.enable_grad():
        rule(spy, q, k, v, **dict(kw, initial_state=None))  # recording autograd
    assert seen == [100, 20, 20, 64, 20, 20]  # the kept shape ran padded to 64
    assert rule.stats["eager"] == 5 and len(rule.entries) == 1


def test_routed_passes_through_unless_active():
    orig = _rule()
    q, k, v, kw = _inputs(10, 11)
    rule = GraphChunkRule("cpu")
    routed(orig, q, k, v, **kw)
    assert rule.stats["calls"] == 0
    with rule.active():
        got = routed(orig, q, k, v, **kw)
    assert rule.stats["calls"] == 1 and torch.equal(got[1], orig(q, k, v, **kw)[1])
    routed(orig, q, k, v, **kw)
    assert rule.stats["calls"] == 1


@pytest.mark.parametrize("kw,name", [(dict(max_tokens=0), "max_tokens"), (dict(max_graphs=1.5), "max_graphs"),
                                     (dict(granule=True), "granule"), (dict(use_graphs="yes"), "use_graphs")])
def test_bad_arguments_name_themselves(kw, name):
    with pytest.raises(InvalidArgumentError) as ei:
        GraphChunkRule("cpu", **kw)
    assert ei.value.arg == name


def test_graphs_refused_without_cuda():
    with pytest.raises(InvalidArgumentError) as ei:
        GraphChunkRule("cpu", use_graphs=True)
    assert ei.value.arg == "use_graphs"


def test_engine_with_prefill_graphs_serves_what_it_serves_without():
    """Two turns of one conversation (the second a hit, ending off a page boundary, so its prefill is a
    split forward): the same tokens, computed and reused, with the rule's calls all taken."""
    from tiered_cache.engine.request import Request
    from tiered_cache.engine.scheduler import Engine

    model = tiny_qwen3_next(seed=5, long_memory=True, device="cpu")
    g = torch.Generator().manual_seed(12)
    first = torch.randint(3, 256, (150,), generator=g).tolist()
    second = first + torch.randint(3, 256, (45,), generator=g).tolist()
    out = {}
    for on in (False, True):
        eng = Engine(model, EngineConfig(cache=CacheConfig(page_size=16, kv_pages=64, t0_states=4, t1_states=8),
                                         chunk_size=64, prefill_budget=256, prefill_graphs=on))
        toks = []
        for i, prompt in enumerate((first, second)):
            eng.submit(Request(rid=f"r{i}", prompt=prompt, max_new_tokens=4))
            toks.append([r.output for r in eng.run()][0])
        assert eng.stats.c["split_forwards"] > 0
        out[on] = (toks, eng.stats_dict())
    assert out[True][0] == out[False][0]
    assert out[True][1]["tokens"] == out[False][1]["tokens"]
    assert 0 < out[True][1]["tokens"]["reused"] and out[True][1]["tokens"]["computed"] < len(first) + len(second)
    gp = out[True][1]["graph_prefill"]
    assert gp["calls"] > 0 and gp["eager"] == 0 and gp["capture_error"] is None
    assert "graph_prefill" not in out[False][1]


def test_engine_refuses_prefill_graphs_for_a_model_without_the_rule():
    from tiered_cache.engine.models import tiny_swa_model
    from tiered_cache.engine.scheduler import Engine

    with pytest.raises(InvalidArgumentError) as ei:
        Engine(tiny_swa_model(device="cpu"), EngineConfig(prefill_graphs=True))
    assert ei.value.arg == "prefill_graphs"


@pytest.mark.gpu
def test_captured_replays_match_eager_calls_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    orig, rule = _rule(), GraphChunkRule("cuda")
    # flash-linear-attention's kernels (where installed) compute in TF32 and autotune per shape: a padded
    # call sums in another order than the unpadded one, so only a looser bound holds there (a wrong state
    # or a padding that leaks is off by far more)
    impl = inspect.getclosurevars(orig).nonlocals.get("implementation", orig)
    tol = 5e-3 if getattr(impl, "__module__", "").startswith("fla") else 1e-5
    lengths = ((60, 1), (17, 2), (130, 5), (33, 7), (100, 8), (70, 6))  # the CPU test's traps, replayed
    for t, seed in lengths:
        q, k, v, kw = _inputs(t, seed, device="cuda")
        want_o, want_s = orig(q, k, v, **kw)
        got_o, got_s = rule(orig, q, k, v, **kw)
        for got, want in ((got_o, want_o), (got_s, want_s)):
            torch.testing.assert_close(got, want, rtol=0, atol=tol * max(1.0, want.abs().max().item()))
    assert rule.stats["captures"] == 3 and rule.stats["replays"] == len(lengths) and rule.capture_error is None
