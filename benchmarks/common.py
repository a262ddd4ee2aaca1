"""Shared by the benchmark scripts: where results go and what every result file carries."""

from __future__ import annotations

import datetime as _dt
import json
import os
import subprocess
import sys
from typing import Optional

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def device_tag() -> str:
    """``cpu`` or a short GPU name such as ``h200``."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    for tag in ("h200", "h100", "a100", "b200", "l40s"):
        if tag in name:
            return tag
    return name.replace("nvidia", "").strip().replace(" ", "-")


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def commit() -> str:
    """``git rev-parse --short HEAD`` (+ ``-dirty``); ``TIERED_CACHE_COMMIT`` where the tree has no .git
    (the GPU machine gets a copy of the work tree without its history)."""
    if os.environ.get("TIERED_CACHE_COMMIT"):
        return os.environ["TIERED_CACHE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(RESULTS), timeout=10)
        sha = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=os.path.dirname(RESULTS), timeout=10).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def write_results(bench: str, metrics: dict[str, Optional[float]], *, rows: Optional[list[dict[str, object]]] = None,
                  notes: str = "", out_dir: Optional[str] = None, info: Optional[dict[str, object]] = None) -> str:
    """Write ``<bench>-<device>.json`` and ``.md`` (BENCHMARKS.md's format); returns the JSON path.
    A metric that is None is undefined (a ratio over 0, a goal never reached): ``null`` in the JSON,
    ``undefined`` in the markdown. ``info``: what the numbers mean (a ceiling used, a unit), kept beside them."""
    out_dir = out_dir or RESULTS
    os.makedirs(out_dir, exist_ok=True)
    tag = device_tag()
    record = {
        "bench": bench,
        "device": device_name(),
        "date": _dt.date.today().isoformat(),
        "commit": commit(),
        "command": "python " + " ".join(sys.argv),
        "metrics": {k: None if v is None else float(v) for k, v in metrics.items()},
    }
    if info:
        record["info"] = info
    if rows:
        record["rows"] = rows
    path = os.path.join(out_dir, f"{bench}-{tag}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    lines = [f"# {bench} on {record['device']}", "",
             f"date {record['date']}, commit `{record['commit']}`", "", f"`{record['command']}`", ""]
    if notes:
        lines += [notes, ""]
    if info:
        lines += [f"- {k}: {_fmt(v)}" for k, v in info.items()] + [""]
    if rows:
        cols = list(rows[0].keys())
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
        lines.append("")
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in record["metrics"].items()]
    with open(path[:-5] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _fmt(v: object) -> str:
    if v is None:
        return "undefined"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e3 else f"{v:,.0f}"
    return str(v)


def bench_gpu(fn, warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median milliseconds of ``fn`` on the GPU (CUDA events through triton.testing.do_bench)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
