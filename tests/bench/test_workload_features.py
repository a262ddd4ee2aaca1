"""bench_workload's issue-21 features at tiny scale: repeats (median, min, max), answers of other lengths,
the GPU-budget sweep, think times, the trace replay (Mooncake format) and the no-cache baseline's own
efficiency (model FLOPs from the geometry)."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

pytest.importorskip("transformers")
pytest.importorskip("asyncio_throttle")


def write_trace(path, lines):
    with open(path, "w") as f:
        for ln in lines:
            f.write(json.dumps(ln) + "\n")


# three conversations: 1 and 2 share request 0's first two blocks; 3 shares block 0 only
TRACE = [{"timestamp": 0, "input_length": 1100, "output_length": 300, "hash_ids": [0, 1, 2]},
         {"timestamp": 500, "input_length": 1600, "output_length": 2, "hash_ids": [0, 1, 3, 4]},
         {"timestamp": 1000, "input_length": 600, "output_length": 40, "hash_ids": [0, 5]},
         {"timestamp": 3000, "input_length": 2048, "output_length": 9, "hash_ids": [0, 1, 3, 6]}]


def test_aggregate_takes_median_min_max_and_keeps_refusals():
    from benchmarks.bench_workload import aggregate

    reps = [{"throughput_vs_2b": 1.2, "hit_rate_2b": 0.5, "hit_rate_vs_gpu_only": None, "invalid": []},
            {"throughput_vs_2b": 0.9, "hit_rate_2b": 0.5, "hit_rate_vs_gpu_only": None, "invalid": []},
            {"throughput_vs_2b": 1.5, "hit_rate_2b": 0.6, "hit_rate_vs_gpu_only": None, "invalid": ["x"]}]
    reps[2]["x"] = None
    for r in reps[:2]:
        r["x"] = 2.0
    a = aggregate(reps)
    assert (a["throughput_vs_2b"], a["throughput_vs_2b_min"], a["throughput_vs_2b_max"]) == (1.2, 0.9, 1.5)
    assert a["hit_rate_2b"] == 0.5 and a["repeats"] == 3
    assert a["hit_rate_vs_gpu_only"] is None and "hit_rate_vs_gpu_only_min" not in a  # undefined in every repeat
    assert a["x"] is None and a["invalid"] == ["x"]  # refused in one repeat: refused
    assert aggregate([]) == {} and aggregate([{}]) == {}


def test_prefill_flops_from_the_geometry():
    from benchmarks.bench_workload import n_params, prefill_flops
    from tiered_cache.engine.models import tiny_qwen3_next

    model = tiny_qwen3_next(seed=0, device="cpu")
    cfg = model.config
    full, lin = cfg.layer_types.count("full_attention"), cfg.layer_types.count("linear_attention")
    matrix = n_params(model) - model.get_input_embeddings().weight.numel()  # untied: the LM head counts
    n = 10
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * (n * (n + 1) / 2) * full
    rec = 4 * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * n * lin
    assert prefill_flops(model, 0, n) == 2 * matrix * n + attn + rec
    # chunks add up to the whole (attention reads the cached positions before a chunk)
    assert prefill_flops(model, 0, 10) + prefill_flops(model, 10, 6) == pytest.approx(prefill_flops(model, 0, 16))


def test_trace_items_keep_the_prefix_sharing_and_scale_lengths_and_arrivals(tmp_path):
    from benchmarks import traces
    from benchmarks.workload_common import trace_items

    write_trace(tmp_path / "t.jsonl", TRACE)
    trace = traces.load_trace(str(tmp_path / "t.jsonl"))
    items = trace_items(trace, vocab=500, block=8, max_blocks=3, max_answer=16, rate=2.0)
    # lengths: ceil(input * 8 / 512), at most 3 blocks of 8
    assert [len(it.prompt) for it in items] == [18, 24, 10, 24]
    assert [len(it.answer) for it in items] == [16, 2, 16, 9]  # capped at 16
    assert items[1].prompt[:16] == items[0].prompt[:16] != items[2].prompt[:16]  # blocks 0, 1 shared
    assert items[2].prompt[:8] == items[0].prompt[:8] and items[3].prompt == items[1].prompt[:24]
    assert all(3 <= t < 500 for it in items for t in it.answer)
    # mean rate 2/s: 3 gaps over a 3 s trace -> 1.5 s of replay
    assert [it.at_s for it in items] == pytest.approx([0.0, 0.25, 0.5, 1.5])
    with pytest.raises(ValueError, match="rate > 0"):
        trace_items(trace, vocab=500, block=8, max_blocks=3, max_answer=16, rate=0.0)


def test_think_time_delays_a_clients_next_round():
    from benchmarks.workload_common import ClientPlan, drive

    class Engine:  # finishes each request at the step after its submission
        def __init__(self):
            self.queue = []

        def submit(self, req, arrival=None):
            self.queue.append(req)

        def has_work(self):
            return bool(self.queue)

        def step(self):
            done, self.queue = self.queue, []
            return done

    turns = []
    w = {"request_rate": 0.0, "max_parallel": 8, "max_new_tokens": 1, "seed": 5, "think_time_s": 0.04}
    drive(Engine(), [ClientPlan(0, [1], [[2], [3], [4]], [[5], [6], [7]], True)], w, turns.append)
    gaps = [b.submitted_s - a.finished_s for a, b in zip(turns, turns[1:])]
    rng = random.Random(5 + 2)
    want = [rng.expovariate(1 / 0.04) for _ in gaps]
    assert [t.round for t in turns] == [0, 1, 2]
    assert all(g >= x - 1e-3 for g, x in zip(gaps, want)), (gaps, want)


def test_repeats_answers_budgets_and_efficiency(tmp_path, keep_threads):
    from benchmarks.bench_workload import main

    rec = main(["--scale", "small", "--workloads", "multi_turn", "--set", "clients=2", "rounds=2", "--answers", "3",
                "--repeats", "2", "--gpu-mib", "2.5", "--host-mib", "12", "--configs", "no_cache", "gpu_only_host",
                "int8_t1_t2", "--gpu-budgets", "3", "--budget-configs", "gpu_only_host", "int8_t1_t2",
                "--out", str(tmp_path), "--no-progress"])
    m = rec["metrics"]
    for k in ("throughput_vs_nocache", "throughput_vs_2b", "ttft_p50_speedup_vs_2b", "hit_rate_2b"):
        assert m[k] == m[f"multi_turn_ans3_{k}"] and m[f"{k}_min"] <= m[k] <= m[f"{k}_max"], k
    assert m["hit_rate_2b"] > 0 and m["repeats"] == 2
    assert m["multi_turn_ans3_gpu3_gpu_only_host_hit_rate"] > 0 and "multi_turn_ans3_gpu3_throughput_vs_2b" in m
    assert m["multi_turn_ans3_no_cache_prefill_tokens_per_s"] > 0 and "multi_turn_ans3_no_cache_mfu" not in m  # CPU
    info = rec["info"]
    assert info["invalid_comparisons"] == {} and info["fell_back"] == {}
    wl = info["workloads"]["multi_turn_ans3"]
    assert wl["answer"] == 3 and wl["budget_sweep_tiers"]["3"]["gpu_only_host"]["host_states"] > 0
    assert wl["host_budget_mib"] == 12 and wl["gpu_budget_mib"] == 2.5
    assert {r["answer"] for r in rec["rows"]} == {"3 (prefill-node)"} and all(r["valid"] == "yes" for r in rec["rows"])
    # measured against the no-cache run; the budget sweep's rows have none at their budget: undefined
    agree = [r["argmax_agree"] for r in rec["rows"]]
    assert [a is None for a in agree] == [False] * 3 + [True] * 2 and all(0 <= a <= 1 for a in agree[:3])


def test_trace_through_the_engine(tmp_path, keep_threads):
    from benchmarks.bench_workload import main

    write_trace(tmp_path / "t.jsonl", TRACE)
    rec = main(["--scale", "small", "--trace", str(tmp_path / "t.jsonl"), "--trace-block", "16", "--trace-max-blocks",
                "4", "--trace-max-answer", "3", "--repeats", "1", "--out", str(tmp_path), "--no-progress"])
    assert os.path.exists(tmp_path / "workload-mooncake-cpu.json")
    m = rec["metrics"]
    assert {r["config"].split(" ", 1)[0] for r in rec["rows"]} == {"(1)", "(2)", "(2b)", "(3)", "(4)"}
    assert m["mooncake_int8_t1_t2_prefill_tokens_saved"] > 0 and m["mooncake_no_cache_prefill_tokens_saved"] == 0
    tr = rec["info"]["workloads"]["mooncake"]["trace"]
    assert tr["requests"] == 4 and tr["rate_per_s"] > 0 and tr["load"] == 1.0 and tr["answer_tokens_mean"] == 2.75


def test_sample_conversations_keeps_each_whole_and_the_bound_counts_shared_pages():
    from benchmarks import traces
    from benchmarks.workload_common import TraceItem, sample_conversations, shared_prefix_bound

    rng = random.Random(0)
    trace = [traces.TraceRequest(i, 1024, 5, (0, rng.randrange(40), 100 + i)) for i in range(400)]
    for f in (0.1, 0.5):
        got = sample_conversations(trace, f, seed=3)
        kept = {r.hash_ids[:2] for r in got}
        assert got == [r for r in trace if r.hash_ids[:2] in kept]  # whole conversations, in order
        assert 0 < len(kept) < 40 and got == sample_conversations(trace, f, seed=3)
    assert sample_conversations(trace, 1.0) == trace
    with pytest.raises(ValueError, match="fraction"):
        sample_conversations(trace, 0.0)
    a, b = list(range(10, 30)), list(range(10, 22)) + [7, 8, 9]  # b shares a's first 12 tokens
    items = [TraceItem(0.0, p, [1]) for p in (a, b, a, [5] * 6)]
    # b: 12 shared (3 pages of 4); a again: 19 (all but its last token) -> 16; the last shares nothing
    assert shared_prefix_bound(items, 4) == 12 + 16 and shared_prefix_bound(items, 8) == 8 + 16


def test_trace_window_with_block_admission_and_a_second_pass_calibration(tmp_path, keep_threads):
    """``--admission block``: every cached configuration keeps states at the trace's block boundaries,
    which the engine offers; the JSON records the admission, the window and both calibration passes."""
    from benchmarks.bench_workload import main

    skipped = {"timestamp": 0, "input_length": 600, "output_length": 4, "hash_ids": [0, 9]}
    write_trace(tmp_path / "t.jsonl", [skipped] + TRACE)  # the window skips it: its block 0 is not counted
    rec = main(["--scale", "small", "--trace", str(tmp_path / "t.jsonl"), "--trace-start", "1", "--trace-block", "32",
                "--trace-max-blocks", "3", "--trace-max-answer", "3", "--repeats", "1", "--admission", "block",
                "--configs", "no_cache", "gpu_only", "--out", str(tmp_path), "--no-progress"])
    info = rec["info"]
    assert info["state_admission"] == "block" and info["admission_block"] == 32
    wl = info["workloads"]["mooncake"]
    tr = wl["trace"]
    assert tr["requests"] == 4 and tr["start"] == 1 and tr["sample"] == 1.0
    assert tr["calibration"]["requests"] == 4 and tr["calibration"]["timed_pass_s"] > 0
    # in pages of 16: the 2nd request shares the 1st's two blocks (64 tokens), the 3rd block 0 (32), the 4th
    # all of the 2nd's 96 tokens but its last (95 -> 80)
    assert tr["reuse_bound_tokens"] == 64 + 32 + 80 and tr["prompt_tokens"] == 69 + 96 + 38 + 96
    cp = wl["tree_stats"]["gpu_only"]["checkpoints"]
    assert cp["block_boundaries"] > 0 and cp["offered"] >= cp["inserted"] > 0
    assert rec["metrics"]["mooncake_gpu_only_prefill_tokens_saved"] > 0
    with pytest.raises(ValueError, match="page size"):
        main(["--scale", "small", "--trace", str(tmp_path / "t.jsonl"), "--trace-block", "24", "--repeats", "1",
              "--out", str(tmp_path), "--no-progress"])


def test_max_running_sets_the_running_batch_and_t0_reservation_of_every_configuration(tmp_path, keep_threads):
    from benchmarks import workload_common as wc
    from benchmarks.bench_workload import _load, main, parse_args

    assert _load("multi_turn", parse_args(["--max-running", "2"]), None)["engine"]["max_running"] == 2
    assert _load("multi_turn", parse_args([]), None)["engine"]["max_running"] == 4  # the file's
    with pytest.raises(SystemExit):
        parse_args(["--max-running", "0"])
    rec = main(["--scale", "small", "--workloads", "multi_turn", "--set", "clients=3", "rounds=2", "--answers", "3",
                "--repeats", "1", "--no-warm-each", "--max-running", "2", "--configs", "gpu_only_host",
                "int8_t1_t2", "--out", str(tmp_path), "--no-progress"])
    wl = rec["info"]["workloads"]["multi_turn_ans3"]
    assert wl["engine"]["max_running"] == 2
    assert {t["t0_states"] for c, t in wl["tiers"].items() if c in wc.CONFIGS[1:]} == {2}
    assert rec["metrics"]["multi_turn_ans3_hit_rate_gpu_only_host"] > 0
    # no no-cache run here: the argmax agreement with it is undefined, never a made-up 1.0
    assert not any(k.endswith("argmax_agreement_vs_nocache") for k in rec["metrics"])
    assert [r["argmax_agree"] for r in rec["rows"]] == [None, None]
