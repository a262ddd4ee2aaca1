"""policy_budgets at tiny scale: its replay of a bench_workload run through the capacity simulation counts what
the reference engine counts when it serves the same requests one at a time on tiers of the same budgets (hit
rate and state hits T1 / T2 / miss, per eviction policy), on the multi-turn workload and on a trace with block
admission and prompts whose last page is partial; the grid's rows and the points it says differ."""

from __future__ import annotations

import collections
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

pytest.importorskip("transformers")

# shared blocks (0, 1, 3), prompt lengths whose last 16-token page is partial (1100 / 512 x 64 = 137.5 tokens)
TRACE = [{"timestamp": 0, "input_length": 1100, "output_length": 30, "hash_ids": [0, 1, 2]},
         {"timestamp": 500, "input_length": 1600, "output_length": 2, "hash_ids": [0, 1, 3, 4]},
         {"timestamp": 900, "input_length": 600, "output_length": 40, "hash_ids": [0, 5]},
         {"timestamp": 1000, "input_length": 2048, "output_length": 9, "hash_ids": [0, 1, 3, 6]},
         {"timestamp": 1500, "input_length": 1536, "output_length": 17, "hash_ids": [0, 1, 2]},
         {"timestamp": 2000, "input_length": 1900, "output_length": 5, "hash_ids": [0, 1, 3, 4]},
         {"timestamp": 2500, "input_length": 700, "output_length": 64, "hash_ids": [0, 5]},
         {"timestamp": 3000, "input_length": 2560, "output_length": 3, "hash_ids": [0, 1, 3, 6, 7]}]
MULTI_TURN = ["--workloads", "multi_turn", "--set", "clients=4", "rounds=3"]


def trace_run(tmp_path) -> list[str]:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    return ["--workloads", "multi_turn", "--trace", str(path), "--trace-limit", "8", "--trace-block", "64",
            "--trace-max-blocks", "8", "--trace-max-answer", "40", "--admission", "block"]


def budgets(s) -> list[float]:
    """GPU MiB just above ``s``'s running reservation: a cache share of about 2 and 6 int8 T1 states."""
    from benchmarks import workload_common as wc

    running = s.max_running * (s.tb.state_native + s.request_pages * s.tb.kv_page)
    return [(running + k * s.tb.t1_int8 / (1 - s.kv_fraction)) / wc.MiB for k in (2.5, 6.5)]


def engine_counts(model, e: dict, s, policy: str, gpu_mib: float, host_mib: float) -> dict:
    """``s``'s requests through the reference engine (``e``: the workload's engine section), one at a time (each
    served before the next is sent), on the tiers bench_workload builds at these budgets for ``policy``;
    counted as bench_workload counts."""
    from benchmarks import bench_workload as bw
    from benchmarks import workload_common as wc
    from tiered_cache.engine.request import Request
    from tiered_cache.engine.scheduler import Engine

    config = "int8_t1_t2" if host_mib else "int8_t1"
    tiers = wc.split_budget(s.tb, int(gpu_mib * wc.MiB), int(host_mib * wc.MiB), s.max_running, s.request_pages,
                            s.kv_fraction)[config]
    serve = dict(chunk_size=e["chunk_size"], prefill_budget=e["prefill_budget"], max_running=e["max_running"])
    eng = Engine(model, bw.engine_config(serve, bw.policy_cache(s.cache, policy), tiers))
    reused = prompt = 0
    tiers_hit: collections.Counter = collections.Counter()
    for i, (p, a) in enumerate(s.requests):
        eng.submit(Request(rid=f"r{i}", prompt=list(p), max_new_tokens=len(a), forced_output=list(a)))
        for q in eng.run():
            sm = q.summary()
            reused, prompt = reused + sm["reused"], prompt + sm["prompt_len"]
            tiers_hit[sm["state_tier"]] += 1
    eng.check_invariants()
    return {"hit_rate": reused / prompt, "state_hits_t1": tiers_hit["T1"], "state_hits_t2": tiers_hit["T2"],
            "state_misses": tiers_hit["miss"]}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("run", ["multi_turn", "trace"])
def test_replay_counts_what_the_engine_counts_serving_one_request_at_a_time(run, tmp_path):
    import torch

    from benchmarks import bench_workload as bw
    from benchmarks import policy_budgets as pb

    argv = MULTI_TURN if run == "multi_turn" else trace_run(tmp_path)
    s = pb.setup(run, argv, "small", {})
    e = bw._load("multi_turn", bw.parse_args(["--scale", "small", *argv]), None)["engine"]
    assert (s.chunk, s.page, s.max_running) == (e["chunk_size"], e["page_size"], e["max_running"])
    if run == "trace":
        assert any(len(p) % s.page for p, _ in s.requests) and s.cache["state_admission"] == "block"
    model = bw.build_model({"tiny": True, "dtype": "float32", "long_memory": True}, torch.device("cpu"))
    reqs = pb.sim_requests(s)
    seen = set()
    for g in budgets(s):
        for h in (0.0, s.host_mib):
            for policy in ("lru", "tiered"):
                got = pb.replay(s, reqs, policy, g, h)
                want = engine_counts(model, e, s, policy, g, h)
                assert {k: got[k] for k in want} == pytest.approx(want), (run, g, h, policy)
                seen.add((g, h, policy, tuple(want.values())))
    # the points are no ceiling everywhere: some policy or budget keeps something the others do not
    assert len({v for *_, v in seen}) > 1


def test_grid_rows_refused_budgets_and_differ(tmp_path):
    from benchmarks import policy_budgets as pb

    s = pb.setup("t", MULTI_TURN, "small", {})
    low, *ok = [0.1, *budgets(s)]
    rows = pb.grid(s, ["lru", "tiered"], [low, *ok])
    assert [(r["gpu_mib"], r["host_mib"], r["policy"]) for r in rows] == [
        (g, h, p) for g in [low, *ok] for h in (0.0, s.host_mib) for p in ("lru", "tiered")]
    assert all(set(r) == set(rows[0]) for r in rows)  # one set of columns (the markdown table's)
    refused = [r for r in rows if r["gpu_mib"] == low]
    assert all("below the running reservation" in r["error"] and r["hit_rate"] is None for r in refused)
    assert all(r["error"] is None and r["config"] == ("int8_t1_t2" if r["host_mib"] else "int8_t1")
               for r in rows if r["gpu_mib"] != low)
    d = pb.differ(rows)
    by = {(r["gpu_mib"], r["host_mib"], r["policy"]): r for r in rows if r["error"] is None}
    want = [(g, h) for g in ok for h in (0.0, s.host_mib)
            if any(by[g, h, "tiered"][k] != by[g, h, "lru"][k] for k in pb.COUNTS)]
    assert [(x["gpu_mib"], x["host_mib"]) for x in d] == want
    for x in d:
        assert x["lru"] == {k: by[x["gpu_mib"], x["host_mib"], "lru"][k] for k in pb.COUNTS}
        assert x["tiered"] == {k: by[x["gpu_mib"], x["host_mib"], "tiered"][k] for k in pb.COUNTS}
    m = pb.metrics(rows, ["lru", "tiered"])
    for g, h in [(g, h) for g in ok for h in (0.0, s.host_mib)]:
        pre = f"t_gpu{g:g}_host{h:g}_hit_rate"
        assert m[f"{pre}_lru"] == by[g, h, "lru"]["hit_rate"]
        lru = by[g, h, "lru"]["hit_rate"]
        assert m[f"{pre}_tiered_vs_lru"] == (by[g, h, "tiered"]["hit_rate"] / lru if lru else None)
    assert not any(f"gpu{low:g}_" in k for k in m)


def test_sim_requests_pages_by_content_partial_pages_and_answers_fresh():
    from benchmarks import policy_budgets as pb
    from benchmarks import workload_common as wc

    tb = wc.TierBytes(kv_page=64, state_native=100, t1_lossless=100, t1_int8=30)
    a, b = list(range(10, 26)), list(range(30, 46))  # two 16-token pages
    reqs = [(a + b + [1, 2], [7] * 5), (a + b, [8] * 16), (a + [3] * 16 + a, [9])]
    s = pb.Setup("t", "small", 16, 64, 4, 0.6, "write_through", {}, tb, 1.0, 0.0, tuple(reqs))
    out = pb.sim_requests(s)
    pa, pb_ = out[0].prompt[:2]
    # 34 tokens: two whole pages and a partial one (an id of its own); the turn's end at page 2 (38 // 16): no
    # answer id; 32 tokens + 16: the turn ends at page 2 (47 // 16), one answer id (never fed)
    assert out[0].prompt[2] not in (pa, pb_) and len(out[0].prompt) == 3 and out[0].tokens == 34
    assert len(out[0].answer) == (34 + 5 - 1) // 16 - 3 + 1 == 0
    assert out[1].prompt == [pa, pb_] and len(out[1].answer) == (32 + 16 - 1) // 16 - 2 + 1 == 1
    assert out[2].prompt[0] == out[2].prompt[2] == pa and out[2].prompt[1] not in (pa, pb_)
    ids = [t for r in out for t in r.prompt]
    fresh = [t for r in out for t in r.answer] + [out[0].prompt[2]]
    assert len(set(fresh)) == len(fresh) and not set(fresh) & set(ids[:2] + out[2].prompt)


def test_parse_args_refuses_without_lru_and_budgets_not_above_zero(capsys):
    from benchmarks import policy_budgets as pb

    with pytest.raises(SystemExit):
        pb.parse_args(["--policies", "tiered"])
    assert "include lru" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pb.parse_args(["--gpu-budgets", "512", "0"])
    assert "MiB > 0" in capsys.readouterr().err


@pytest.mark.parametrize("cut_end", [True, False])
def test_serve_caches_a_state_at_the_prompt_end_only_with_cut_end(cut_end):
    """``capacity_sim.serve(cut_end=False)`` (a prompt whose last page is partial) leaves no state at the prompt
    end: a later prompt that diverges right after it resumes from there only when the end was cut."""
    from benchmarks import capacity_sim as cs
    from tiered_cache.config import CacheConfig

    cfg = CacheConfig(page_size=1, kv_pages=64, t0_states=2, t1_states=8, codec="int8", validate=False,
                      check_memory=False, backend="torch")
    sim = cs.Sim(cfg, cs.tiny_state(cs.real_bytes(64)), page=64, fast=True)
    prompt = [1, 2, 3, 4, 5, 6]
    assert cs.serve(sim.stack, prompt, [100, 101, 102], 64, cut_end=cut_end).reused == 0
    # the turn ended at page 8 (prompt + answer - 1); a prompt diverging at page 7 can resume only at 6
    assert cs.serve(sim.stack, prompt + [7, 8], [103], 64).reused == (6 if cut_end else 0)
    sim.check()
