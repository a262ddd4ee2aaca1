"""Charts for benchmarks/results/: one PNG per result file that has something to draw.

    python benchmarks/plot_results.py                 # reads *.json in benchmarks/results, writes *.png beside them
    python benchmarks/plot_results.py --results DIR   # another folder (e.g. a GPU run's $OUT/results)
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _bars(ax, labels, series: dict, ylabel: str, title: str) -> None:
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(labels))]
        ax.bar(xs, vals, width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)


def plot_kernels(rec: dict, path: str) -> None:
    m = rec["metrics"]
    labels, ours, torch_, copy = [], [], [], []
    for op in ("store", "load"):
        for dt in ("fp32", "bf16"):
            for n in (16, 64):
                key = f"{op}_{dt}_{n}"
                if f"{key}_GBps" in m:
                    labels.append(f"{op}\n{dt} x{n}")
                    ours.append(m[f"{key}_GBps"])
                    torch_.append(m[f"{key}_torch_GBps"])
                    copy.append(m[f"copy_{dt}_{n}_GBps"])
    fig, ax = plt.subplots(figsize=(9, 4))
    _bars(ax, labels, {"Triton kernel": ours, "torch reference": torch_, "device copy": copy}, "GB/s (read + write)",
          f"int8 checkpoint kernels, {rec['device']}, {rec['date']}, {rec['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_transfer(rec: dict, path: str) -> None:
    rows = rec.get("rows", [])
    order = ["copy", "staging", "kernel", "batch", "kernel+batch", "auto"]  # any other method after these
    methods = sorted({r["method"] for r in rows}, key=lambda m: (order.index(m) if m in order else len(order), m))
    # sustained (several calls in flight) where the run measured it, else single calls
    sus = any(r["data"].endswith("sustained") for r in rows)
    kinds = ("state sustained", "kv sustained") if sus else ("state", "kv")
    labels = [f"{d}\n{k}" for k in kinds for d in ("d2h", "h2d", "bidir")]
    got = {(r["method"], r["data"], r["direction"]): r["GBps"] for r in rows}
    series = {meth: [got.get((meth, k, d), 0.0) for k in kinds for d in ("d2h", "h2d", "bidir")]
              for meth in methods}
    m = rec["metrics"]
    suffix = "_sustained" if sus else ""
    series["contiguous pinned copy"] = [m.get(f"contig_{k}_{d}{suffix}_GBps", 0.0) for k in ("state", "kv")
                                        for d in ("d2h", "h2d", "bidir")]
    fig, ax = plt.subplots(figsize=(9, 4))
    _bars(ax, labels, series, "GB/s over PCIe", f"T2 transfers, {rec['device']}, {rec['date']}, {rec['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PLOTTERS = {"kernels": plot_kernels, "transfer": plot_transfer}


def plot_workload_rates(rec: dict, path: str) -> list[str]:
    """Each workload's TTFT and throughput against the arrival rate, where the file holds a sweep
    (``bench_workload.py --rates``); drawn by the benchmark's own ``chart_sweep``."""
    import sys

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks.bench_workload import chart_sweep, sweep_from_record

    out = []
    tag = os.path.basename(path)[len("workload-"):-len(".json")]  # the device tag
    for name in rec.get("info", {}).get("workloads", {}):
        res = sweep_from_record(rec, name)
        if res["sweep"]:
            out.append(os.path.join(os.path.dirname(path), f"workload-{name}-rates-{tag}.png"))
            chart_sweep(out[-1], res)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--results", default=RESULTS, help="folder of result JSON files; PNGs are written beside them")
    args = p.parse_args(argv)  # before anything is drawn: --help and bad flags leave the committed PNGs alone
    for path in sorted(glob.glob(os.path.join(args.results, "*.json"))):
        with open(path) as f:
            rec = json.load(f)
        fn = PLOTTERS.get(rec.get("bench"))
        if fn is not None:
            fn(rec, path[:-5] + ".png")
            print("wrote", path[:-5] + ".png")
        if rec.get("bench") == "workload":
            for png in plot_workload_rates(rec, path):
                print("wrote", png)


if __name__ == "__main__":
    main()
