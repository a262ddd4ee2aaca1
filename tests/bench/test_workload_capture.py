"""Issue 21 item 7: a CUDA-graph capture in a compared configuration failed and the comparison went on
with one side eager. On CPU: every capture runs inside ``capture_window`` (transfers waited for first,
the garbage collector off inside), a failed capture is retried once, one that fails twice is a recorded
fallback, and ``bench_workload`` refuses (nulls and lists) every ratio with a side that fell back.

The CUDA calls are stood in for (``dev.cuda_graph`` / ``graph_capture``): the capture's context is
what these tests look at; whether a real capture survives is the H200's to show."""

from __future__ import annotations

import contextlib
import gc
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiered_cache import device as dev  # noqa: E402
from tiered_cache.engine.runner import graph_prefill  # noqa: E402
from tiered_cache.engine.runner.graph_prefill import GraphChunkRule, transfers_waited  # noqa: E402


def rule_fn(q, k, v, g=None, beta=None, initial_state=None, output_final_state=True, **kw):
    """A stand-in chunk rule with fla's signature: outputs from every input, a state from the last."""
    o = v * beta[..., None] + g[..., None] + (q * k).sum(-1, keepdim=True).mean(2, keepdim=True)
    return o, initial_state * 0.5 + v[:, -1:].transpose(1, 2).sum(1, keepdim=True).transpose(1, 2)[..., :1, :]


def inputs(t: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    kw = dict(g=r(1, t, 3), beta=r(1, t, 3), initial_state=r(1, 3, 4, 4), output_final_state=True)
    return (r(1, t, 2, 4), r(1, t, 2, 4), r(1, t, 3, 4)), kw


class FakeCuda:
    """``dev``'s graph calls, recorded: each capture notes whether the collector was on and what ran
    before it; ``fail`` captures raise (as an invalidated one does at its end)."""

    def __init__(self, monkeypatch, fail: int = 0):
        self.log: list[str] = []
        self.fail = fail
        monkeypatch.setattr(dev, "cuda_graph", lambda: type("G", (), {"replay": lambda s: self.log.append("replay")})())
        monkeypatch.setattr(dev, "graph_pool", lambda: None)
        monkeypatch.setattr(dev, "graph_capture", self.capture)

    @contextlib.contextmanager
    def capture(self, graph, pool=None, mode="thread_local"):
        self.log.append(f"capture gc={'on' if gc.isenabled() else 'off'} mode={mode}")
        yield
        if self.fail:
            self.fail -= 1
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


@pytest.fixture(autouse=True)
def no_grad():
    with torch.no_grad():  # the rule replays calls made outside autograd only
        yield


def graph_rule(**kw) -> GraphChunkRule:
    rule = GraphChunkRule("cpu", granule=8, **kw)
    rule.use_graphs = True  # as on a GPU; the fakes stand in for the CUDA calls
    return rule


def test_capture_runs_after_quiesce_with_the_collector_off(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    rule = graph_rule()
    rule.quiesce = lambda: cuda.log.append("quiesce")
    assert gc.isenabled()
    (q, k, v), kw = inputs(13, 0)
    rule(rule_fn, q, k, v, **kw)
    assert cuda.log == ["quiesce", "capture gc=off mode=thread_local", "replay"]
    assert gc.isenabled()  # back on after the window
    rule(rule_fn, *inputs(11, 1)[0], **inputs(11, 1)[1])  # same padded shape: a replay, no capture
    assert cuda.log[3:] == ["replay"] and rule.stats["captures"] == 1 and rule.capture_error is None
    # a collector the caller had switched off stays off
    gc.disable()
    try:
        rule(rule_fn, *inputs(30, 2)[0], **inputs(30, 2)[1])
        assert not gc.isenabled() and cuda.log[-2] == "capture gc=off mode=thread_local"
    finally:
        gc.enable()


def test_a_failed_capture_is_retried_once(monkeypatch):
    cuda = FakeCuda(monkeypatch, fail=1)
    rule = graph_rule()
    (q, k, v), kw = inputs(13, 3)
    rule(rule_fn, q, k, v, **kw)
    assert rule.stats["capture_retries"] == 1 and rule.stats["captures"] == 1 and rule.capture_error is None
    assert "previous error during capture" in rule.retried_error and rule.use_graphs
    assert cuda.log.count("capture gc=off mode=thread_local") == 2


def test_two_failures_are_a_recorded_fallback_and_stay_exact(monkeypatch):
    FakeCuda(monkeypatch, fail=2)
    rule = graph_rule()
    (q, k, v), kw = inputs(13, 4)
    with pytest.warns(UserWarning, match="failed twice"):
        got = rule(rule_fn, q, k, v, **kw)
    want = rule_fn(q, k, v, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert "previous error" in rule.capture_error and not rule.use_graphs and rule.stats["eager"] == 1
    assert not rule.entries


def test_transfers_waited_waits_for_every_pending_ticket_and_consumes_none():
    class Transfer:
        def __init__(self):
            self.pending, self.waited, self.finished = ["a", "b", "c"], [], []

        def pending_tickets(self):
            return list(self.pending)

        def wait(self, t):
            self.waited.append(t)
            self.pending.remove(t)
            self.finished.append(t)  # left for the tree's poll
            return True

    tr = Transfer()
    transfers_waited(tr)()
    assert tr.waited == ["a", "b", "c"] and tr.finished == ["a", "b", "c"] and not tr.pending
    assert transfers_waited(None) is None


def test_the_engine_quiesces_its_transfers_before_a_capture():
    """The engine hands its cache's transfer engine to both graph paths (configurations with a host tier);
    without a host tier there is nothing to wait for."""
    from tiered_cache.config import CacheConfig
    from tiered_cache.engine.config import EngineConfig
    from tiered_cache.engine.models import tiny_qwen3_next
    from tiered_cache.engine.scheduler import Engine

    model = tiny_qwen3_next(seed=0, device="cpu")
    host = Engine(model, EngineConfig(cache=CacheConfig(page_size=16, kv_pages=64, t0_states=4, t1_states=4,
                                                        host_kv_pages=16, host_states=4),
                                      decode_graphs=True, prefill_graphs=True, max_running=2))
    assert callable(host.runner.graph_decoder.quiesce) and callable(host.runner.prefill_rule.quiesce)
    gpu = Engine(model, EngineConfig(cache=CacheConfig(page_size=16, kv_pages=64, t0_states=4, t1_states=4),
                                     decode_graphs=True, prefill_graphs=True, max_running=2))
    assert gpu.runner.graph_decoder.quiesce is None and gpu.runner.prefill_rule.quiesce is None
    assert graph_prefill.capture_window  # exported for graph_decode


def fallbacks_case():
    def cfg(ttft, rps, hit):
        return {"ttft_p50_s": ttft, "ttft_p50_round3plus_s": ttft, "requests_per_s": rps,
                "requests_per_s_round3plus": rps, "hit_rate": hit}

    return {"no_cache": cfg(2.0, 1.0, 0.0), "gpu_only": cfg(1.0, 1.5, 0.2), "gpu_only_host": cfg(0.8, 2.0, 0.7),
            "int8_t1": cfg(0.9, 1.8, 0.3), "int8_t1_t2": cfg(0.5, 3.0, 0.8)}


def test_ratios_with_a_side_that_fell_back_are_refused():
    from benchmarks.bench_workload import ratios

    s = fallbacks_case()
    ok = ratios(s)
    assert ok["throughput_vs_2b"] == 1.5 and ok["ttft_p50_speedup_vs_2b"] == 0.8 / 0.5
    assert ok["hit_rate_2b"] == 0.7 and ok["throughput_vs_nocache"] == 3.0 and ok["invalid"] == []
    bad = ratios(s, fell_back={"gpu_only_host"})
    assert bad["throughput_vs_2b"] is None and bad["ttft_p50_speedup_vs_2b"] is None
    assert bad["hit_rate_vs_2b"] is None  # a hit rate from a run that fell back is not compared either
    assert bad["throughput_vs_nocache"] == 3.0  # (4) vs (1): neither side fell back
    assert "throughput_vs_2b" in bad["invalid"] and "throughput_vs_nocache" not in bad["invalid"]
    worst = ratios(s, fell_back={"int8_t1_t2"})
    assert all(worst[k] is None for k in ("throughput_vs_nocache", "throughput_vs_2b", "hit_rate_vs_gpu_only"))
