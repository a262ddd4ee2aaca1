"""Decode attention of the graph decoder: ``gqa_sdpa`` against the two ways transformers' ``sdpa`` runs
grouped-query attention under a mask, on the buffers the decoder attends over.

One decode token for each of ``--batch`` requests over a ``--width``-token bucket (positions drawn
uniformly from its last quarter, the rest masked), ``--heads`` query heads on ``--kv-heads`` key/value
heads, bf16 keys and values on a GPU (fp32 on CPU):

- ``repeat_kv``: every key/value head copied for its query heads, then SDPA under the mask (what
  transformers 5.17's ``sdpa`` does whenever a mask is given);
- ``packed_sdpa``: the query heads of a key/value head packed into rows of one head, then SDPA under
  the mask (what 5.24 does for one query token);
- ``gqa_sdpa``: ours, the same packing through two fp32 batched products and a softmax.

All three are checked against fp64 attention with repeated heads before they are timed (NaN-poisoned
outputs). Reports milliseconds per call (one layer) and the ratios. Writes
``decode_attention-<device>.json`` / ``.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import RESULTS, bench_gpu, write_results  # noqa: E402
from tiered_cache.engine.runner.graph_decode import gqa_sdpa  # noqa: E402


def repeat_kv(module, q, k, v, mask, scaling=None):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def packed_sdpa(module, q, k, v, mask, scaling=None):
    b, h, n, d = q.shape
    kvh = k.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(q.reshape(b, kvh, (h // kvh) * n, d), k, v,
                                                           attn_mask=mask, scale=scaling)
    return out.reshape(b, h, n, d).transpose(1, 2).contiguous(), None


METHODS = {"repeat_kv": repeat_kv, "packed_sdpa": packed_sdpa, "gqa_sdpa": gqa_sdpa}


def reference(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(g, dim=1), v.double().repeat_interleave(g, dim=1)
    s = (q.double() @ k.transpose(-1, -2)) * scale
    return (s.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(1, 2)


def time_ms(fn, device: torch.device, reps: int) -> float:
    if device.type == "cuda":
        return bench_gpu(fn)
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--width", type=int, default=20480)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--reps", type=int, default=5, help="timed calls per method on CPU (GPU: do_bench)")
    p.add_argument("--out", default=RESULTS)
    a = p.parse_args(argv)
    for name in ("batch", "width", "heads", "kv_heads", "head_dim", "reps"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}: an int >= 1, got {getattr(a, name)}")
    if a.heads % a.kv_heads:
        p.error(f"--heads: a multiple of --kv-heads={a.kv_heads}, got {a.heads}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    b, h, kvh, w, d = a.batch, a.heads, a.kv_heads, a.width, a.head_dim
    q = torch.randn((b, h, 1, d), generator=g).to(device, dtype)
    k = torch.randn((b, kvh, w, d), generator=g).to(device, dtype)
    v = torch.randn((b, kvh, w, d), generator=g).to(device, dtype)
    pos = torch.randint(w - w // 4, w, (b,), generator=g).to(device)
    mask = (torch.arange(w, device=device).view(1, w) <= pos.view(b, 1)).view(b, 1, 1, w)
    scale = d ** -0.5
    module = torch.nn.Module().eval()
    ref = reference(q, k, v, mask, scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    metrics: dict[str, float] = {}
    rows = []
    for name, fn in METHODS.items():
        out = torch.full((b, 1, h, d), float("nan"), device=device, dtype=dtype)
        out.copy_(fn(module, q, k, v, mask, scaling=scale)[0])
        err = (out.double() - ref).abs().max().item()
        if not err <= tol:  # NaN fails too
            raise AssertionError(f"{name}: max error {err} against fp64 attention (tolerance {tol})")
        ms = time_ms(lambda fn=fn: fn(module, q, k, v, mask, scaling=scale), device, a.reps)
        metrics[f"{name}_ms"] = ms
        metrics[f"{name}_max_abs_err"] = err
        rows.append({"method": name, "ms_per_layer": ms, "max_abs_err_vs_fp64": err})
    metrics["gqa_sdpa_speedup_vs_repeat_kv"] = metrics["repeat_kv_ms"] / metrics["gqa_sdpa_ms"]
    metrics["gqa_sdpa_speedup_vs_packed_sdpa"] = metrics["packed_sdpa_ms"] / metrics["gqa_sdpa_ms"]
    for r in rows:
        r["vs_repeat_kv"] = metrics["repeat_kv_ms"] / r["ms_per_layer"]
    notes = (f"{b} requests x 1 token, bucket {w}, {h} query heads on {kvh} key/value heads of {d}, "
             f"{str(dtype).replace('torch.', '')}")
    path = write_results("decode_attention", metrics, rows=rows, notes=notes, out_dir=a.out)
    for r in rows:
        print(f"{r['method']:>12}: {r['ms_per_layer']:.3f} ms  ({r['vs_repeat_kv']:.2f}x of repeat_kv)")
    print(f"wrote {path}")
    return {"path": path, "metrics": metrics}


if __name__ == "__main__":
    main()
