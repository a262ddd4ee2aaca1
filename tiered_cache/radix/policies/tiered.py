"""The tier-aware policy ("ours"): a victim's cost is what its next hit costs from where it goes.

Per (resource, tier), evicting ``x`` moves its data one tier down or drops it, and the next request
that would resume at ``x`` pays for that::

    T1 state   -> T2 (a T2 below)  a PCIe copy of its int8 bytes at the measured rate
               -> dropped          recomputing [anchor, prefix) at the prefill rate
    T0 KV      -> T2 (backed up)   a PCIe copy of its KV bytes; else dropped (with the leaf's state
                                   and the tombstones above it: ``NodeFacts.dropped_with``)
    T2 copies  -> dropped          recomputing [anchor, prefix)

Two forms rank the candidates, each over these tier-aware costs (in FLOPs: a copy's seconds at the
prefill rate), per byte the victim frees:

    saving   the least expected saving per byte and per unit of time, ``freq(x) x cost(x) / bytes(x) /
             age(x) ** power``: ``age`` counts the uses (of the same recency clock) since ``x``'s last
             one; ``freq`` is the matches that resumed at ``x`` plus one for a leaf or a branch point,
             and 0 for a node with exactly one child (the requests that resumed there have moved on to
             its child's longer state), so such nodes go first, least recent first
    utility  Marconi's: normalised recency + ``alpha`` x normalised cost per byte, over the nodes with at
             most one child. On one tier the cost is the recompute Marconi counts, so ``("utility", a)``
             evicts exactly as Marconi at alpha ``a`` (tests/radix/test_policy_tuning.py); with a T2 the
             copies' costs come on top

The setting (form, weight) is tuned online by the tuner Marconi's alpha uses (``tuning.AlphaTuner``,
ghost replays of the recent window) over ``TIERED_GRID``: the saving form at powers 1, 1.5, 2 and the
utility at each of Marconi's alphas, so the tuner can pick whatever Marconi's can, and more. It starts
at ("saving", 1.5), the power that, fixed, was not behind the Marconi of before (alpha tuned on a
second cache over 0, 1, 2, 4) at any point of bench_policy's grid, and was behind the Marconi tuned on
ghosts at 3 of 10 (0.987-0.998 of its FLOPs saved). The ghosts model the device tiers only: in a
tiered cache the setting is picked for what the device keeps. A window's best setting on its ghosts is
not always the live cache's best over the next window (the ghost leaves out the running requests, the
prompt / answer split and the host tiers).
"""

from __future__ import annotations

from typing import Any

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix.policies.scored import PrefixCosts, ScoredPolicy, norm
from tiered_cache.radix.policies.tuning import ALPHA_GRID, setting

# ours' settings (form, weight), in the tuner's order of preference on a tie: its own expected saving per
# byte at a recency power, then Marconi's utility over the tier-aware terms at each of Marconi's alphas
FORMS = ("saving", "utility")
TIERED_GRID = (*(("saving", p) for p in (1.0, 1.5, 2.0)), *(("utility", a) for a in ALPHA_GRID))


class TieredPolicy(ScoredPolicy):
    """Tier-aware eviction (module docstring); ``tiered``: T1 victims go to a T2; ``setting``: (form,
    weight), ``("saving", power)`` or ``("utility", alpha)``, tuned online over ``TIERED_GRID`` when a
    tuner is given (``make_policy`` gives one when it knows the tree's budget)."""

    TUNED = "setting"
    GRID = TIERED_GRID

    def __init__(self, costs: PrefixCosts, *, setting: Any = ("saving", 1.5), **kw: Any) -> None:
        super().__init__(costs, **kw)
        self.setting = setting

    @property
    def setting(self) -> tuple[str, float]:
        return self.form, self.weight

    @setting.setter
    def setting(self, value: Any) -> None:
        v = setting(value)
        if not isinstance(v, tuple) or v[0] not in FORMS:
            raise InvalidArgumentError("setting", f"a (form, weight >= 0) pair, form one of {', '.join(FORMS)}",
                                       value)
        self.form, self.weight = v

    def cost(self, resource: str, x: Any) -> float:
        """What the next hit at ``x`` pays once ``resource`` is evicted, in FLOPs: those it recomputes, or a
        copy's seconds at the prefill rate."""
        f, c = self.facts, self.costs
        if resource == "state" and self.tiered:
            return c.copy_s(c.host_state_bytes) * c.prefill_flops_per_s
        if resource == "kv" and f.host_kv(x):
            return c.copy_s(f.span(x) * c.kv_bytes) * c.prefill_flops_per_s
        return self.lost_flops(x)

    def priority(self, resource: str, x: Any, now: int) -> float:
        """Expected FLOPs saved per byte per use of the clock (``now``: the latest stamp): the saving form."""
        f = self.facts
        freq = 0 if f.children(x) == 1 else f.hits(x) + 1
        age = now - self.recency(resource, x) + 1
        return freq * self.cost(resource, x) / self.freed_bytes(resource, x) / age ** self.weight

    def choose(self, resource: str, cands: list[Any]) -> Any:
        if resource == "swa":
            return self.least_recent(resource, cands)
        if self.form == "utility":  # Marconi's, over the nodes with at most one child, with the tier's cost
            pool = [x for x in cands if self.facts.children(x) <= 1] or cands
            rec = norm([float(self.recency(resource, x)) for x in pool])
            eff = norm([self.cost(resource, x) / self.freed_bytes(resource, x) for x in pool])
            a = self.weight
            return pool[min(range(len(pool)), key=lambda i: (rec[i] + a * eff[i], rec[i], pool[i].id))]
        passed = [x for x in cands if self.facts.children(x) == 1]
        if passed:  # freq 0: priority 0
            return self.least_recent(resource, passed)
        now = max(self.recency(resource, x) for x in cands)
        h = [self.priority(resource, x, now) for x in cands]
        return cands[min(range(len(cands)), key=lambda j: (h[j], self.recency(resource, cands[j]), cands[j].id))]
