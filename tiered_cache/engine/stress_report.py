"""What the stress job prints and draws: the side-by-side table, timing spread, answer agreement, why
reuse is what it is, and the chart (``tiered_cache/engine/stress.py`` runs the job)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Optional


def _g(d: Any, *path: str, default: Any = None) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{1000 * x:.1f} ms"


def spread(xs: Sequence[float]) -> dict:
    """min / median / max of the repeats (what the report and ``report.json`` give for every time)."""
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs), "n": len(xs), "all": list(xs)}


def _spread_s(s: Optional[dict]) -> str:
    return "-" if not s else f"{s['min']:.1f} / {s['median']:.1f} / {s['max']:.1f} s"


def _median_of(runs: Sequence[dict], *path: str) -> Optional[float]:
    xs = [v for v in (_g(r, *path) for r in runs) if v is not None]
    return statistics.median(xs) if xs else None


def report_lines(cached: Sequence[dict], base: Sequence[dict]) -> list[str]:
    """The table: one column per configuration. ``cached`` / ``base``: the stats of each repeat (counters
    from the first, which every repeat of a deterministic run repeats; times as the median of the repeats)."""
    c = cached[0]
    b = base[0] if base else {}
    has_b = bool(base)
    t3 = c.get("T3")
    n = len(cached)

    def both(*path, fmt=str):
        v, w = _g(c, *path), _g(b, *path)
        return fmt(v) if v is not None else "-", (fmt(w) if has_b and w is not None else "-")

    rows = [
        ("turns finished", *both("requests", "finished")),
        ("requests aborted (sent again)", *both("requests", "aborted")),
        ("prompt tokens", *both("tokens", "prompt")),
        ("  computed", *both("tokens", "computed")),
        ("  reused from the cache", *both("tokens", "reused")),
        ("  reuse rate", *both("tokens", "reuse_rate", fmt=lambda x: f"{100 * x:.1f} %")),
        ("hits: KV tokens on the device (T0)", _g(c, "hits", "T0_kv_tokens"), "-"),
        ("hits: KV tokens loaded back (T2)" + (", incl. T3's" if t3 else ""), _g(c, "hits", "T2_kv_tokens"), "-"),
        ("hits: states from T1", _g(c, "hits", "T1_states"), "-"),
        ("hits: states from T2" + (", incl. T3's" if t3 else ""), _g(c, "hits", "T2_states"), "-"),
    ]
    if t3:
        # A T3 hit lands in T2 first and is then loaded back like any T2 hit, so the engine credits the
        # resumed request to T2; these rows say how much of T2's came from T3.
        rows += [("hits: prefixes fetched from T3 into T2", t3.get("hits", 0), "-"),
                 ("  their tokens", t3.get("hit_tokens", 0), "-"),
                 ("T3 lookups / misses", f"{t3.get('lookups', 0)} / {t3.get('miss', 0)}", "-"),
                 ("T3 KV pages / states written", f"{t3.get('kv_pages_written', 0)} / {t3.get('states_written', 0)}",
                  "-"),
                 ("T3 errors (unavailable, timed out)",
                  f"{_g(t3, 'tier', 'unavailable', default=0) + _g(t3, 'tier', 'write_unavailable', default=0)}, "
                  f"{t3.get('wait_timed_out', 0)}", "-")]
    rows += [
        ("misses", *both("hits", "misses")),
        ("states checkpointed (inserted)", _g(c, "checkpoints", "inserted"), "-"),
        ("bytes T0 KV written / read", f"{fmt_bytes(_g(c, 'bytes', 'T0_kv_written'))} / "
                                       f"{fmt_bytes(_g(c, 'bytes', 'T0_kv_read'))}", "-"),
        ("bytes T0 states written / read", f"{fmt_bytes(_g(c, 'bytes', 'T0_state_written'))} / "
                                           f"{fmt_bytes(_g(c, 'bytes', 'T0_state_read'))}", "-"),
        ("bytes T1 stored / loaded", f"{fmt_bytes(_g(c, 'bytes', 'T1_stored'))} / "
                                     f"{fmt_bytes(_g(c, 'bytes', 'T1_loaded'))}", "-"),
    ]
    if "T2_d2h" in c.get("bytes", {}):
        rows += [("bytes T2 D2H / H2D", f"{fmt_bytes(_g(c, 'bytes', 'T2_d2h'))} / "
                                        f"{fmt_bytes(_g(c, 'bytes', 'T2_h2d'))}", "-"),
                 ("T2 checksum failures", _g(c, "hits", "T2_checksum_failures", default="-"), "-")]
    for label, key in (("TTFT p50", "p50"), ("TTFT p90", "p90"),
                       ("TTFT from admission p50 (no queueing)", "from_admission_p50"),
                       ("TTFT from admission p90", "from_admission_p90")):
        rows.append((label + (f" (median of {n})" if n > 1 else ""), _ms(_median_of(cached, "ttft_s", key)),
                     _ms(_median_of(base, "ttft_s", key)) if has_b else "-"))
    rows += [(f"wall time min / median / max ({n} runs)", _spread_s(c.get("wall")), _spread_s(b.get("wall"))),
             (f"CPU time min / median / max ({n} runs)", _spread_s(c.get("cpu")), _spread_s(b.get("cpu")))]
    w = max(len(r[0]) for r in rows)
    lines = [f"{'':<{w}}  {'tiered cache':>24}  {'no cache':>24}"]
    lines += [f"{name:<{w}}  {str(x if x is not None else '-'):>24}  {str(y if y is not None else '-'):>24}"
              for name, x, y in rows]
    return lines


def timing_lines(cached: dict, base: Optional[dict]) -> list[str]:
    """The headline comparison (medians of alternated repeats) and where the time went."""
    out = []
    if base:
        for what in ("wall", "cpu"):
            out.append(f"{what} time, cached / no cache (medians): {cached[what]['median']:.1f} / "
                       f"{base[what]['median']:.1f} s = {cached[what]['median'] / base[what]['median']:.2f}x")
    for name, run in (("tiered cache", cached), ("no cache", base)):
        ph = (run or {}).get("phase_s")
        if not ph:
            continue
        total = sum(ph.values()) or 1.0
        top = sorted(ph.items(), key=lambda kv: -kv[1])[:5]
        out.append(f"where the time goes ({name}, first run): "
                   + ", ".join(f"{k} {v:.1f} s ({100 * v / total:.0f} %)" for k, v in top))
    for name, run in (("tiered cache", cached), ("no cache", base)):
        t = (run or {}).get("ttft_s", {})
        if t.get("p50") is not None and t.get("from_admission_p50") is not None:
            out.append(f"TTFT p50 ({name}, first run): {_ms(t['p50'])}, of which waiting for admission about "
                       f"{_ms(t['p50'] - t['from_admission_p50'])} (--max-running admits at once)")
    return out


def agreement(cached_out: dict, base_out: dict, rounds: int) -> dict:
    """Identical answers per round (free-running: a client whose answer differs sends different prompts
    afterwards, so later rounds compare different questions)."""
    per = [0] * rounds
    per_n = [0] * rounds
    for k, v in cached_out.items():
        r = int(k.split("r", 1)[1])
        per_n[r] += 1
        per[r] += v == base_out.get(k)
    return {"identical": sum(per), "turns": sum(per_n), "per_round": per, "per_round_turns": per_n}


def forced_agreement(turns: Sequence[Any], base_out: dict, rounds: int) -> dict:
    """Teacher-forced agreement: the cached run fed the no-cache run's answers (so both saw the same
    prompts); per turn, whether every token the cached model picked equals the no-cache answer, and the
    share of tokens that do."""
    per = [0] * rounds
    per_n = [0] * rounds
    tok = tok_n = 0
    for t in turns:
        ref = base_out[f"c{t.client}r{t.round}"]
        same = [a == b for a, b in zip(t.argmax, ref)]
        per_n[t.round] += 1
        per[t.round] += all(same) and len(t.argmax) == len(ref)
        tok += sum(same)
        tok_n += len(ref)
    return {"identical": sum(per), "turns": sum(per_n), "per_round": per, "tokens_equal": tok, "tokens": tok_n}


def agreement_lines(free: dict, forced: Optional[dict], codec: str) -> list[str]:
    out = [f"identical answers, free-running (cached vs no cache): {free['identical']} / {free['turns']} turns; "
           f"per round {', '.join(str(x) for x in free['per_round'])} of {max(free['per_round_turns'])} "
           f"(once a client's answer differs its later prompts differ too)"]
    if forced is not None:
        out.append(f"identical answers, teacher-forced (same prompts for both): {forced['identical']} / "
                   f"{forced['turns']} turns, per round {', '.join(str(x) for x in forced['per_round'])}; "
                   f"{forced['tokens_equal']} / {forced['tokens']} tokens")
    if codec == "int8":
        out.append("  (int8 T1: a resumed state is one rounding of the exact one, so near-ties can flip a "
                   "token; --codec lossless gives every answer identical)")
    return out


def reuse_lines(cached: dict, turns: Sequence[Any], cfg: dict) -> tuple[list[str], dict]:
    """Why reuse is what it is: how much of the prompts an earlier turn had seen (the most any cache
    could reuse), then what each tier evicted and dropped, and which tier ran out."""
    page = cfg["page_size"]
    by = {(t.client, t.round): t for t in turns}
    reusable = 0
    for t in turns:
        if t.round:
            prev = by[(t.client, t.round - 1)]
            seen = len(prev.prompt) + len(prev.output) - 1  # the last answer token's KV is never computed
        else:
            seen = cfg["system_len"] if not cfg["no_shared_system"] and t.client else 0
        reusable += (min(seen, len(t.prompt) - 1) // page) * page
    prompt = _g(cached, "tokens", "prompt", default=0)
    reused = _g(cached, "tokens", "reused", default=0)
    ev = cached.get("evictions", {})
    tree = cached.get("tree", {})
    host = bool(cfg["host_kv_pages"])
    info = {"prompt_tokens": prompt, "reused": reused, "reusable_at_most": reusable, "evictions": ev,
            "state_demotes": tree.get("state_demotes", 0), "load_back_no_room": tree.get("load_back_no_room", 0)}
    pct = (lambda x: f"{100 * x / prompt:.1f} %") if prompt else (lambda x: "-")
    lines = [f"reuse: {reused} of {prompt} prompt tokens ({pct(reused)}); an earlier turn had seen at most "
             f"{reusable} ({pct(reusable)}), page-aligned: the rest is new questions"]
    t1_ev, t1_dem = ev.get("state", 0), tree.get("state_demotes", 0)
    parts = [f"T0 KV {ev.get('kv', 0)} nodes" + (" (to T2 if backed up, else dropped)" if host else " (dropped)"),
             f"T1 states {t1_ev} ({t1_dem} demoted to T2)" if host else f"T1 states {t1_ev} (dropped)"]
    if host:
        parts.append(f"T2 KV {ev.get('kv_host', 0)} nodes and T2 states {ev.get('state_host', 0)} (dropped)")
    lines.append("evictions per tier: " + "; ".join(parts))
    # What ran out: the last tier that drops states or KV loses them for good (a state lost cuts every
    # later match back to the deepest state left, so host KV without its state is written and never read).
    short = []
    if host:
        if ev.get("state_host", 0):
            short.append(f"T2 states ({cfg['host_states']} slots: --host-states)")
        if ev.get("kv_host", 0):
            short.append(f"T2 KV ({cfg['host_kv_pages']} pages: --host-kv-pages)")
        if tree.get("load_back_no_room", 0):
            short.append(f"T0 room for load-backs ({tree['load_back_no_room']} refused: --kv-pages)")
    else:
        if t1_ev:
            short.append(f"T1 states ({cfg['t1_states']} slots: --t1-states)")
        if ev.get("kv", 0):
            short.append(f"T0 KV ({cfg['kv_pages']} pages: --kv-pages)")
    lost = reusable - reused
    if short:
        lines.append(f"what limited reuse: {', '.join(short)} ran out and dropped entries; {lost} tokens an "
                     "earlier turn had seen were computed again")
    else:
        lines.append(f"what limited reuse: no tier dropped anything; {lost} seen tokens were computed again "
                     "(matches cut back to the deepest cached state, prefixes in flight)")
    info["limited_by"] = short
    return lines, info


def write_chart(path: str, cached: dict, base: Optional[dict]) -> None:
    import matplotlib.pyplot as plt

    fig = chart(cached, base)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def chart(cached: dict, base: Optional[dict]):
    """The report's figure (2 x 2 axes): TTFT per round, prompt tokens, where states came from (every
    tier the run used), bytes per tier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(11, 8))
    rounds = range(1, len(cached["ttft_by_round_s"]) + 1)
    ax[0, 0].plot(rounds, [1000 * x for x in cached["ttft_by_round_s"]], "o-", label="tiered cache")
    if base:
        ax[0, 0].plot(rounds, [1000 * x for x in base["ttft_by_round_s"]], "s--", label="no cache")
    ax[0, 0].set(title="mean time to first token per round (first run)", xlabel="round", ylabel="ms",
                 xticks=list(rounds))
    ax[0, 0].legend()
    runs = [("tiered cache", cached)] + ([("no cache", base)] if base else [])
    names = [n for n, _ in runs]
    comp = [r["tokens"]["computed"] for _, r in runs]
    reu = [r["tokens"]["reused"] for _, r in runs]
    ax[0, 1].bar(names, comp, label="computed")
    ax[0, 1].bar(names, reu, bottom=comp, label="reused")
    ax[0, 1].set(title="prompt tokens", ylabel="tokens")
    ax[0, 1].legend()
    h = cached["hits"]
    t3 = cached.get("T3")
    labels, vals, colors = ["states T1", "states T2"], [h["T1_states"], h["T2_states"]], ["tab:green", "tab:orange"]
    if t3:  # every tier the run used; T3's hits reach the request through T2
        labels.append("T3 -> T2 prefetches")
        vals.append(t3.get("hits", 0))
        colors.append("tab:purple")
    labels.append("misses")
    vals.append(h["misses"])
    colors.append("tab:red")
    ax[1, 0].bar(labels, vals, color=colors)
    kv = f"KV tokens: T0 {h['T0_kv_tokens']}, T2 {h['T2_kv_tokens']}"
    if t3:
        kv += f", T3 {t3.get('hit_tokens', 0)}"
    ax[1, 0].set(title=f"where resumed states came from ({kv})", ylabel="requests")
    ax[1, 0].title.set_fontsize(9)
    by = cached["bytes"]
    keys = [k for k in ("T0_kv_written", "T0_state_written", "T1_stored", "T1_loaded", "T2_d2h", "T2_h2d")
            if k in by]
    ax[1, 1].barh(keys, [by[k] / 2**20 for k in keys])
    ev = cached.get("evictions", {})
    ax[1, 1].set(title="bytes moved per tier (evictions: " + ", ".join(f"{k} {v}" for k, v in sorted(ev.items()))
                 + ")", xlabel="MiB")
    ax[1, 1].title.set_fontsize(9)
    fig.tight_layout()
    return fig
