"""Cost-aware eviction policies: each ``pop`` scores the candidates and takes the lowest.

They share ``LRUPolicy``'s candidate sets and recency stamps (the tree's ``touch`` / ``add`` /
``discard`` / ``forget`` are unchanged) and replace its heap by a scan, since a score depends on the
whole candidate set (normalised terms) or on facts that change after a node was stamped (its nearest
resumable ancestor). What a victim frees and what its loss costs come from ``PrefixCosts`` (the model's
FLOP and byte counts, ``tiered_cache.costs``) and ``NodeFacts``; ties go to the least recent, then the
oldest node, so a run is the same every time.

    marconi  (Marconi, arXiv 2411.19379) over nodes with at most one child: utility = normalised recency
             + alpha x normalised FLOP efficiency (FLOPs a hit saves / bytes the victim frees); alpha is
             tuned online by ``tuning.AlphaTuner`` when one is given (``make_policy`` gives one when
             it knows the tree's budget). Host copies go least recently used.
    seglen   replay length to the nearest resumable ancestor x normalised recency (host copies: LRU).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional

from tiered_cache.costs import Geometry
from tiered_cache.errors import InvalidTypeError
from tiered_cache.radix.policies.facts import NodeFacts
from tiered_cache.radix.policy import RECENCY, LRUPolicy
from tiered_cache.validate import float_arg, int_arg

# H200 host -> device copy of int8 states, measured (benchmarks/results/transfer-h200.json, h2d_GBps)
PCIE_BYTES_PER_S = 52.8e9
# Prefill throughput assumed for recompute: 40 % of an H200's 989 dense bf16 TFLOP/s
PREFILL_FLOPS_PER_S = 0.4 * 989e12


@dataclasses.dataclass(frozen=True)
class PrefixCosts:
    """What the tree's data costs and saves, in tree tokens (``tokens_per_key`` model tokens each: a
    simulation's page). Bytes per tier: ``kv_bytes`` per tree token (T0 and T2 alike), ``t1_state_bytes``
    (T1's codec), ``host_state_bytes`` (T2: int8)."""

    geometry: Geometry
    kv_bytes: int
    t1_state_bytes: int
    host_state_bytes: int
    tokens_per_key: int = 1
    pcie_bytes_per_s: float = PCIE_BYTES_PER_S
    prefill_flops_per_s: float = PREFILL_FLOPS_PER_S

    def __post_init__(self) -> None:
        for name in ("kv_bytes", "t1_state_bytes", "host_state_bytes", "tokens_per_key"):
            int_arg(name, getattr(self, name), lo=1)
        for name in ("pcie_bytes_per_s", "prefill_flops_per_s"):
            float_arg(name, getattr(self, name), lo=0.0, lo_open=True)

    @classmethod
    def of(cls, geometry: Geometry, *, tokens_per_key: int = 1, t1_int8: bool = True, **kw: Any) -> PrefixCosts:
        """The geometry's own bytes: KV per token x ``tokens_per_key``, T1 int8 (or native), T2 int8."""
        t1 = geometry.state_bytes_int8 if t1_int8 else geometry.state_bytes
        return cls(geometry, geometry.kv_bytes_per_token * tokens_per_key, t1, geometry.state_bytes_int8,
                   tokens_per_key, **kw)

    def saved(self, start: int, end: int) -> int:
        """FLOPs a hit at tree position ``end`` saves over one at ``start``."""
        k = self.tokens_per_key
        return self.geometry.saved_flops(start * k, end * k)

    def recompute_s(self, start: int, end: int) -> float:
        return self.saved(start, end) / self.prefill_flops_per_s

    def copy_s(self, nbytes: int) -> float:
        return nbytes / self.pcie_bytes_per_s


class ScoredPolicy(LRUPolicy):
    """Candidates and stamps as ``LRUPolicy``; ``pop`` takes the candidate ``choose`` picks. ``counts``:
    victims per resource (as the stack's ``CountingLRUPolicy``). ``tiered``: a T2 lies below T1 (a T1
    state and backed-up KV are demoted, not dropped). ``tuner``: a ``tuning.AlphaTuner`` fed by ``observe``
    that sets the attribute ``TUNED`` names (a policy without one takes no tuner); ``tunings`` counts its
    settings."""

    TUNED: Optional[str] = None

    def __init__(self, costs: PrefixCosts, *, tiered: bool = False, facts: Optional[NodeFacts] = None,
                 tuner: Any = None) -> None:
        if not isinstance(costs, PrefixCosts):
            raise InvalidTypeError("costs", "a PrefixCosts", type(costs).__name__)
        if tuner is not None and (self.TUNED is None or not callable(getattr(tuner, "observe", None))):
            raise InvalidTypeError("tuner", f"None{' or an AlphaTuner' if self.TUNED else ''} for "
                                   f"{type(self).__name__}", type(tuner).__name__)
        self.costs, self.tiered, self.tuner, self.tunings = costs, bool(tiered), tuner, 0
        self.facts = facts or NodeFacts()
        self.counts: collections.Counter = collections.Counter()
        super().__init__()

    def clear(self) -> None:
        super().clear()
        self.facts.clear()
        if self.tuner is not None:
            self.tuner.reset()

    def forget(self, node: Any) -> None:
        super().forget(node)
        self.facts.forget(node)

    def _push(self, resource: str, t: int, node: Any) -> None:
        """No heap: ``pop`` scans the candidates."""

    def pop(self, resource: str) -> Optional[Any]:
        cand = self._cand[resource]
        if not cand:
            return None
        x = self.choose(resource, list(cand))
        cand.discard(x)
        self.counts[resource] += 1
        return x

    def choose(self, resource: str, cands: list[Any]) -> Any:
        """The victim among ``cands`` (in no order: ties go by recency, then node id); least recently used here."""
        return self.least_recent(resource, cands)

    def observe(self, tokens: list[int], kv_held: int) -> None:
        """A request finished with ``tokens`` cached (the tree holds ``kv_held`` device KV tokens): the tuner
        records them and may set the tuned weight."""
        if self.tuner is not None:
            v = self.tuner.observe(tokens, kv_held, evicting=bool(self.counts),
                                   live=getattr(self, self.TUNED))  # type: ignore[arg-type]
            if v is not None:
                setattr(self, self.TUNED, v)  # type: ignore[arg-type]
                self.tunings += 1

    # ----------------------------------------------------------------------------- shared terms
    def recency(self, resource: str, x: Any) -> int:
        return self._stamp[RECENCY[resource]].get(x, 0)

    def least_recent(self, resource: str, cands: list[Any]) -> Any:
        return min(cands, key=lambda x: (self.recency(resource, x), x.id))

    def lost_flops(self, x: Any) -> int:
        """FLOPs the next hit at ``x`` recomputes once its state or KV is gone: from its resumable ancestor."""
        f = self.facts
        return self.costs.saved(f.anchor(x), f.prefix(x))

    def freed_bytes(self, resource: str, x: Any) -> int:
        """Bytes of ``resource``'s tier that evicting ``x`` frees: a dropped leaf frees its KV, its T1 state
        and the KV of the tombstones that go with it (``NodeFacts.dropped_with``)."""
        f, c = self.facts, self.costs
        kv = f.span(x) * c.kv_bytes
        if resource == "state":
            leaf_goes = not self.tiered and not f.children(x) and not f.t2(x) and f.on_device(x)
            return c.t1_state_bytes + ((f.span(x) + f.dropped_with(x)) * c.kv_bytes if leaf_goes else 0)
        if resource == "kv":
            if f.host_kv(x):  # demoted: only its own KV leaves the device
                return kv
            return (f.span(x) + f.dropped_with(x)) * c.kv_bytes + (c.t1_state_bytes if f.t1(x) else 0)
        if resource == "state_host":
            return c.host_state_bytes
        return kv


def _norm(vals: list[float]) -> list[float]:
    lo, hi = min(vals), max(vals)
    return [0.0] * len(vals) if hi == lo else [(v - lo) / (hi - lo) for v in vals]


class MarconiPolicy(ScoredPolicy):
    """Marconi's eviction (module docstring); the tuner sets ``alpha``."""

    TUNED = "alpha"

    def __init__(self, costs: PrefixCosts, *, alpha: float = 1.0, **kw: Any) -> None:
        super().__init__(costs, **kw)
        self.alpha = float_arg("alpha", alpha, lo=0.0)

    def choose(self, resource: str, cands: list[Any]) -> Any:
        if resource not in ("kv", "state"):
            return self.least_recent(resource, cands)
        pool = [x for x in cands if self.facts.children(x) <= 1] or cands
        rec = _norm([float(self.recency(resource, x)) for x in pool])
        eff = _norm([self.lost_flops(x) / self.freed_bytes(resource, x) for x in pool])
        best = min(range(len(pool)), key=lambda i: (rec[i] + self.alpha * eff[i], rec[i], pool[i].id))
        return pool[best]


class SegLenPolicy(ScoredPolicy):
    """Replay length to the nearest resumable ancestor x recency in (0, 1]: short replays and old go first."""

    def choose(self, resource: str, cands: list[Any]) -> Any:
        if resource not in ("kv", "state"):
            return self.least_recent(resource, cands)
        f = self.facts
        stamps = [self.recency(resource, x) for x in cands]
        lo, hi = min(stamps), max(stamps)
        score = [(f.prefix(x) - f.anchor(x)) * (s - lo + 1) / (hi - lo + 1) for x, s in zip(cands, stamps)]
        return cands[min(range(len(cands)), key=lambda i: (score[i], stamps[i], cands[i].id))]
