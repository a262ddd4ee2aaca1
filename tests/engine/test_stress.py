"""The stress job's report (issue 26 items 2, 3, 6, 7): runs timed alike, answer agreement per round and
teacher-forced, T3 in the table and chart, why reuse is what it is. Tiny runs, in process."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from tiered_cache import cli  # noqa: E402
from tiered_cache.engine import stress  # noqa: E402
from tiered_cache.engine import stress_report as rep  # noqa: E402
from tiered_cache.stack import CountingLRUPolicy  # noqa: E402

TINY = ["--clients", "2", "--rounds", "3", "--question-len", "8", "--system-len", "8", "--max-new-tokens", "4",
        "--page-size", "4", "--chunk-size", "8", "--kv-pages", "24", "--max-running", "2", "--t0-states", "2",
        "--t1-states", "2", "--host-kv-pages", "16", "--host-states", "2", "--no-progress"]


def _job(argv, out, monkeypatch):
    """Run the job; returns (report.json, the runs in order as (use_cache, forced))."""
    order = []
    real = stress._run

    def spy(model, cfg, wl, label, args, forced=None):
        order.append((cfg.use_cache, forced is not None))
        return real(model, cfg, wl, label, args, forced=forced)

    monkeypatch.setattr(stress, "_run", spy)
    assert cli.main(["stress", *TINY, *argv, "--out", str(out)]) == 0
    return json.loads((out / "report.json").read_text()), order


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        yield _job(["--repeats", "3"], tmp_path_factory.mktemp("stress") / "out", mp)
    finally:
        mp.undo()


def test_runs_alternate_and_report_wall_and_cpu_spread(job):
    """Item 2: each configuration was timed once by wall clock, one after the other, so the comparison
    flipped between runs; now they alternate --repeats times and both report min / median / max of wall
    and CPU time."""
    r, order = job
    assert order == [(True, False)] + [(True, False), (False, False)] * 3 + [(True, True)]
    for side in ("cached", "no_cache"):
        for what in ("wall", "cpu"):
            s = r[side][what]
            assert s["n"] == 3 and s["min"] <= s["median"] <= s["max"] and len(s["all"]) == 3
            assert s["min"] > 0
    assert any("wall time min / median / max (3 runs)" in line for line in r["report"])
    assert any("CPU time min / median / max (3 runs)" in line for line in r["report"])
    assert r["config"]["decode_batch"] is True  # the faster path is the default


def test_agreement_per_round_and_teacher_forced(job):
    """Item 3: "identical answers 16 / 64" hid that rounds after a differing answer compare different
    prompts; now per round, and teacher-forced (the same prompts for both runs)."""
    r, _ = job
    free, forced = r["agreement"]["free_running"], r["agreement"]["teacher_forced"]
    assert sum(free["per_round"]) == free["identical"] == r["identical_answers"]
    assert free["per_round_turns"] == [2, 2, 2]
    # Round 0 sends the same prompts in both modes, so the two counts agree there.
    assert forced["per_round"][0] == free["per_round"][0]
    assert forced["turns"] == 6 and forced["tokens"] == 6 * 4 and 0 <= forced["tokens_equal"] <= 24
    cached, base = r["cached"]["outputs"], r["no_cache"]["outputs"]
    assert free["identical"] == sum(cached[k] == base[k] for k in cached)
    text = "\n".join(r["report"])
    assert "per round" in text and "teacher-forced" in text and "--codec lossless" in text


def test_reuse_says_which_tier_ran_out(job):
    """Item 7: the report showed state hits and host bytes but not why reuse was low; now evictions per
    tier, the most an earlier turn had seen, and the tier that dropped entries (2 T2 states here)."""
    r, _ = job
    info, ev = r["reuse"], r["cached"]["evictions"]
    assert info["evictions"] == ev and ev.get("state_host", 0) > 0
    assert any("--host-states" in s for s in info["limited_by"])
    assert info["reused"] <= info["reusable_at_most"] <= info["prompt_tokens"]
    assert ev.get("state", 0) >= r["cached"]["tree"].get("state_demotes", 0)
    assert any(line.startswith("evictions per tier:") for line in r["report"])


def test_counting_policy_counts_each_victim():
    """The per-tier eviction counts come from the policy: one count per node ``pop`` hands out, none
    for an empty pop."""
    p = CountingLRUPolicy()

    class N:
        pass

    nodes = [N() for _ in range(3)]
    for x in nodes:
        p.touch("state", x)
        p.add("state", x)
    p.add("kv_host", nodes[0])
    got = [p.pop("state") for _ in range(4)]
    assert got[:3] == nodes and got[3] is None
    assert p.pop("kv_host") is nodes[0] and p.pop("kv") is None
    assert dict(p.counts) == {"state": 3, "kv_host": 1}


def test_t3_is_in_the_table_and_the_chart(tmp_path, monkeypatch):
    """Item 6: T3's counters were only in report.json, and with wait_complete its hits were credited to
    T2 in the table. A second job on the same file store finds the first job's prefixes in T3."""
    store = f"file://{tmp_path / 'store'}"
    args = ["--storage", store, "--prefetch-policy", "wait_complete", "--repeats", "1", "--no-forced",
            "--no-baseline", "--host-states", "4"]
    _job(args, tmp_path / "a", monkeypatch)
    r, _ = _job(args, tmp_path / "b", monkeypatch)
    t3 = r["cached"]["T3"]
    assert t3["hits"] > 0
    row = next(line for line in r["report"] if line.startswith("hits: prefixes fetched from T3 into T2"))
    assert row.split()[-2] == str(t3["hits"])
    fig = rep.chart(r["cached"], None)
    labels = [t.get_text() for t in fig.axes[2].get_xticklabels()]
    assert "T3 -> T2 prefetches" in labels and "T3" in fig.axes[2].get_title()
    import matplotlib.pyplot as plt

    plt.close(fig)
