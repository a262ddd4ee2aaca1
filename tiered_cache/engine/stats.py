"""What the reference engine counts: hits per tier, tokens computed and reused, bytes moved per tier,
and (``PhaseClock``) where a step's time goes.

Bytes are counted where they move: T0 by the engine (KV and states written from the model's cache
into the pool, read back to resume); T1 (every quantize-store and dequantize-load the tree asks for),
T2 (the transfer engine's bytes) and T3 by the tiers themselves, read from ``TieredCache.stats()``,
which also gives the evictions per tier.
"""

from __future__ import annotations

import collections
import contextlib
import math
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from tiered_cache import device as dev

_NO_PHASE = contextlib.nullcontext()


class PhaseClock:
    """Seconds per named phase, exclusive: a phase entered inside another pauses the outer one. The
    device is synchronized at every boundary (``EngineConfig.phase_timing``). ``on=False``: a phase is
    a no-op (no synchronization)."""

    def __init__(self, totals: collections.Counter, device: torch.device, on: bool = True) -> None:
        self.totals, self.device, self.on = totals, device, on
        self.stack: list[list] = []  # [name, started]

    def __call__(self, name: str):
        return self._timed(name) if self.on else _NO_PHASE

    @contextlib.contextmanager
    def _timed(self, name: str):
        dev.synchronize(self.device)
        now = time.perf_counter()
        if self.stack:
            outer = self.stack[-1]
            self.totals[outer[0]] += now - outer[1]
        self.stack.append([name, now])
        try:
            yield
        finally:
            dev.synchronize(self.device)
            now = time.perf_counter()
            self.totals[name] += now - self.stack.pop()[1]
            if self.stack:
                self.stack[-1][1] = now


def percentile(xs: Sequence[float], q: float) -> Optional[float]:
    """Linear-interpolated percentile (``q`` in [0, 100]); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


class EngineStats:
    """Counters of one engine run (``as_dict`` for reports and JSON)."""

    def __init__(self) -> None:
        self.c: collections.Counter = collections.Counter()
        self.ttft: list[float] = []  # from arrival (Engine.submit's stamp; queueing included)
        self.ttft_admitted: list[float] = []  # from admission
        self.phase_s: collections.Counter = collections.Counter()  # EngineConfig.phase_timing

    def add(self, key: str, n: int = 1) -> None:
        self.c[key] += n

    def admitted(self, req, n: int = 1) -> None:
        """``req`` (a ``Request``) was admitted (``n=-1``: sent back to the queue, its admission undone)."""
        self.add("admitted", n)
        self.add("prompt_tokens", n * len(req.prompt))

    def first_token(self, req) -> None:
        """``req`` (an admitted ``Request``) emitted its first token: its TTFT from arrival and admission."""
        self.ttft.append(req.t_first_token - req.t_arrival)
        self.ttft_admitted.append(req.t_first_token - req.t_admitted)

    def resumed(self, req) -> None:
        """``req`` (an admitted ``Request``) starts its prefill: where its prefix and state came from."""
        p, host = req.cache_protected_len, req.reused_host_tokens
        self.add({"T1": "hit_t1_states", "T2": "hit_t2_states", "T0_swa": "hit_t0_swa_windows",
                  "T2_swa": "hit_t2_swa_windows"}.get(req.state_tier, "misses"))
        self.add("hit_t0_kv_tokens", p - host)
        self.add("hit_t2_kv_tokens", host)
        self.add("reused_tokens", p)
        self.add("reused_host_tokens", host)

    def as_dict(self, tiers: Optional[dict] = None) -> dict:
        """The counters as one report; ``tiers``: ``TieredCache.stats()`` (None: no cache), whose T1 and T2
        bytes, evictions per tier and T3 counters join it."""
        c = self.c
        prompt = c["prompt_tokens"]
        out: dict[str, Any] = {
            "requests": {"finished": c["finished"], "aborted": c["aborted"], "admitted": c["admitted"],
                         "admission_retries": c["admission_retries"]},
            "tokens": {"prompt": prompt, "computed": c["computed_tokens"], "reused": c["reused_tokens"],
                       "reused_from_host": c["reused_host_tokens"], "decoded": c["decode_tokens"],
                       "decode_forwards": c["decode_forwards"],
                       "reuse_rate": (c["reused_tokens"] / prompt) if prompt else 0.0,
                       "recomputed_after_abort": c["aborted_computed_tokens"]},
            "hits": {"T0_kv_tokens": c["hit_t0_kv_tokens"], "T1_states": c["hit_t1_states"],
                     "T2_kv_tokens": c["hit_t2_kv_tokens"], "T2_states": c["hit_t2_states"],
                     # an SWA model's hits: the window's SWA KV from T0, or loaded back from T2
                     "T0_swa_windows": c["hit_t0_swa_windows"], "T2_swa_windows": c["hit_t2_swa_windows"],
                     "misses": c["misses"], "state_hit_rate": self._rate()},
            "checkpoints": {"offered": c["offered_checkpoints"], "inserted": c["checkpoints"],
                            "chunk_ends": c["end_checkpoints"],
                            "mid_chunk": c["mid_checkpoints"], "branch_points": c["branch_checkpoints"],
                            "block_boundaries": c["block_checkpoints"],
                            "decode_tracked": c["decode_checkpoints"]},
            "bytes": {"T0_kv_written": c["t0_kv_write_bytes"], "T0_kv_read": c["t0_kv_read_bytes"],
                      "T0_state_written": c["t0_state_write_bytes"], "T0_state_read": c["t0_state_read_bytes"]},
            "ttft_s": {"p50": percentile(self.ttft, 50), "p90": percentile(self.ttft, 90),
                       "mean": (sum(self.ttft) / len(self.ttft)) if self.ttft else None, "n": len(self.ttft),
                       "from_admission_p50": percentile(self.ttft_admitted, 50),
                       "from_admission_p90": percentile(self.ttft_admitted, 90)},
        }
        if self.phase_s:
            out["phase_s"] = dict(self.phase_s)
        if tiers is None:
            return out
        out["evictions"] = tiers["evictions"]  # victims per resource (tier)
        if "t1" in tiers:
            out["bytes"]["T1_stored"] = tiers["t1"].get("store_bytes", 0)
            out["bytes"]["T1_loaded"] = tiers["t1"].get("load_bytes", 0)
        if "transfer" in tiers:
            st = tiers["transfer"]
            out["bytes"]["T2_d2h"] = int(st.get("d2h_bytes", 0))
            out["bytes"]["T2_h2d"] = int(st.get("h2d_bytes", 0))
            out["hits"]["T2_checksum_failures"] = int(st.get("checksum_failures", 0))
        if "storage" in tiers:  # the tree's T3 hook counters, and the storage tier's own
            out["T3"] = dict({k[3:]: v for k, v in tiers["tree"].items() if k.startswith("t3_")},
                             tier=tiers["storage"])
        return out

    def _rate(self) -> float:
        c = self.c
        n = c["hit_t1_states"] + c["hit_t2_states"] + c["misses"]
        return (c["hit_t1_states"] + c["hit_t2_states"]) / n if n else 0.0
