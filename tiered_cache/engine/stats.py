"""What the reference engine counts: hits per tier, tokens computed and reused, bytes moved per tier.

Bytes are counted where they move: T0 by the engine (KV and states written from the model's cache
into the pool, read back to resume), T1 by ``CountingCheckpointPool`` (every quantize-store and
dequantize-load the tree asks for), T2 by the ``TransferEngine``'s own ``stats`` counter.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Optional

from tiered_cache.radix.policy import LRUPolicy
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool


class CountingCheckpointPool(Int8CheckpointPool):
    """``Int8CheckpointPool`` that counts the slots and bytes its T0 <-> T1 moves touch.

    ``bytes`` per move: the T1 envelope (int8 data + scales + conv windows, or the lossless copy),
    which is what T1 writes on a store and reads on a load.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.counts: collections.Counter = collections.Counter()

    def store_from_active(self, side, active_ids, ckpt_slots) -> None:
        super().store_from_active(side, active_ids, ckpt_slots)
        n = len(ckpt_slots)
        self.counts["stores"] += n
        self.counts["store_bytes"] += n * self.slot_bytes

    def load_to_active(self, ckpt_slots, side, active_ids) -> None:
        super().load_to_active(ckpt_slots, side, active_ids)
        n = len(ckpt_slots)
        self.counts["loads"] += n
        self.counts["load_bytes"] += n * self.slot_bytes


class CountingLRUPolicy(LRUPolicy):
    """``LRUPolicy`` that counts its victims per resource: ``counts["kv"]`` device KV nodes evicted (demoted
    to T2 or dropped), ``"state"`` T1 states, ``"kv_host"`` / ``"state_host"`` T2 copies dropped. The tree
    asks ``pop`` once per victim, so these are the evictions per tier (the stress report says which tier
    ran out from them)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def pop(self, resource: str):
        x = super().pop(resource)
        if x is not None:
            self.counts[resource] += 1
        return x


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

    def as_dict(self, ckpt: Optional[CountingCheckpointPool] = None, transfer=None) -> dict:
        c = self.c
        prompt = c["prompt_tokens"]
        out = {
            "requests": {"finished": c["finished"], "aborted": c["aborted"], "admitted": c["admitted"],
                         "admission_retries": c["admission_retries"]},
            "tokens": {"prompt": prompt, "computed": c["computed_tokens"], "reused": c["reused_tokens"],
                       "reused_from_host": c["reused_host_tokens"], "decoded": c["decode_tokens"],
                       "decode_forwards": c["decode_forwards"],
                       "reuse_rate": (c["reused_tokens"] / prompt) if prompt else 0.0,
                       "recomputed_after_abort": c["aborted_computed_tokens"]},
            "hits": {"T0_kv_tokens": c["hit_t0_kv_tokens"], "T1_states": c["hit_t1_states"],
                     "T2_kv_tokens": c["hit_t2_kv_tokens"], "T2_states": c["hit_t2_states"],
                     "misses": c["misses"], "state_hit_rate": self._rate()},
            "checkpoints": {"inserted": c["checkpoints"], "chunk_ends": c["end_checkpoints"],
                            "mid_chunk": c["mid_checkpoints"], "branch_points": c["branch_checkpoints"],
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
        if ckpt is not None:
            out["bytes"]["T1_stored"] = ckpt.counts["store_bytes"]
            out["bytes"]["T1_loaded"] = ckpt.counts["load_bytes"]
        if transfer is not None:
            st = transfer.stats
            out["bytes"]["T2_d2h"] = int(st.get("d2h_bytes", 0))
            out["bytes"]["T2_h2d"] = int(st.get("h2d_bytes", 0))
            out["hits"]["T2_checksum_failures"] = int(st.get("checksum_failures", 0))
        return out

    def _rate(self) -> float:
        c = self.c
        n = c["hit_t1_states"] + c["hit_t2_states"] + c["misses"]
        return (c["hit_t1_states"] + c["hit_t2_states"]) / n if n else 0.0
