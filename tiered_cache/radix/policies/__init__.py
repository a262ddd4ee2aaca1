"""Admission and eviction policies of the radix trees beyond LRU (``radix.policy`` holds the interface).

    admission.py  StateAdmission: which offered states the tree keeps (chunk ends, leaf + branch, blocks)
    facts.py      NodeFacts: the node facts the cost-aware policies read (prefix, anchor, children, tiers)
    scored.py     PrefixCosts (costs of a victim from the model geometry), MarconiPolicy, SegLenPolicy
    tiered.py     TieredPolicy: tier-aware expected saving per byte ("ours")
    tuning.py     AlphaTuner: Marconi's online alpha, by replaying the recent window over a grid
    ghost.py      GhostCache: the token-and-count model of a cache the tuner replays on
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix.policies.admission import ADMISSIONS, StateAdmission, is_branch_point
from tiered_cache.radix.policies.facts import NodeFacts
from tiered_cache.radix.policies.ghost import GhostCache
from tiered_cache.radix.policies.scored import MarconiPolicy, PrefixCosts, ScoredPolicy, SegLenPolicy
from tiered_cache.radix.policies.tiered import TieredPolicy
from tiered_cache.radix.policies.tuning import ALPHA_GRID, AlphaTuner

# CacheConfig.eviction_policy -> the class, for every policy but "lru" (the stack's CountingLRUPolicy)
SCORED: dict[str, type[ScoredPolicy]] = {"marconi": MarconiPolicy, "seglen": SegLenPolicy, "tiered": TieredPolicy}


def stack_costs(cost_model: str, kv_token_bytes: int, t1_slot_bytes: int) -> PrefixCosts:
    """The costs a stack's policy ranks by: FLOPs of the geometry ``cost_model``, bytes of the stack's own
    slots (a KV token of T0 / T2, a T1 slot; T2 keeps states as T1 envelopes)."""
    from tiered_cache.costs import geometry

    return PrefixCosts(geometry(cost_model), kv_token_bytes, t1_slot_bytes, t1_slot_bytes)


def make_policy(name: str, costs: PrefixCosts, *, tiered: bool, budget: Optional[tuple[int, int]] = None,
                window: int = 500, grid: Sequence[float] = ALPHA_GRID, background: bool = False,
                **kw: Any) -> ScoredPolicy:
    """The scored policy ``name`` over ``costs``; ``tiered``: a T2 lies below T1; ``kw``: the class's own.
    ``budget``: the tree's (device KV tokens, T1 states): a policy with a tuned weight (Marconi's alpha)
    then tunes it online over ``grid`` every ``window`` finished requests (``tuning.AlphaTuner``; with
    ``background`` its replays run beside the requests, the stack's choice)."""
    if name not in SCORED:
        raise InvalidArgumentError("eviction_policy", f"one of {', '.join(SCORED)}", name)
    cls, tuned = SCORED[name], SCORED[name].TUNED
    if budget is not None and tuned is not None and "tuner" not in kw:
        def fresh(value: float) -> ScoredPolicy:  # a replay's policy: the live class at ``value``, no tuner
            weight: dict[str, Any] = {tuned: value}
            return cls(costs, **weight)

        kw["tuner"] = AlphaTuner(fresh, *budget, grid=grid, window=window, background=background)
    return cls(costs, tiered=tiered, **kw)


__all__ = ["ADMISSIONS", "ALPHA_GRID", "SCORED", "AlphaTuner", "GhostCache", "MarconiPolicy", "NodeFacts",
           "PrefixCosts", "ScoredPolicy", "SegLenPolicy", "StateAdmission", "TieredPolicy", "is_branch_point",
           "make_policy", "stack_costs"]
