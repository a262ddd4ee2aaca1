"""The tier-aware policy ("ours"): a victim's cost is what its next hit costs from where it goes.

Per (resource, tier), evicting ``x`` moves its data one tier down or drops it, and the next request
that would resume at ``x`` pays for that::

    T1 state   -> T2 (a T2 below)  a PCIe copy of its int8 bytes at the measured rate
               -> dropped          recomputing [anchor, prefix) at the prefill rate
    T0 KV      -> T2 (backed up)   a PCIe copy of its KV bytes; else dropped (with the leaf's state)
    T2 copies  -> dropped          recomputing [anchor, prefix)

The ranking is Greedy-Dual-Size-Frequency over those costs: ``H(x) = L + freq(x) x cost(x) / bytes(x)``
with ``L`` the ``H`` of the last victim of the same recency clock when ``x`` was last used (so what is
not used again ages out), and ``freq`` the matches that resumed at ``x`` plus one for a leaf or a
branch point: a node with exactly one child is resumed from only by a request that diverges right
there (its child's longer state serves the rest), so it keeps only the hits it actually had.
"""

from __future__ import annotations

from typing import Any

from tiered_cache.radix.policies.scored import ScoredPolicy
from tiered_cache.radix.policy import _SHARING, RECENCY


class TieredPolicy(ScoredPolicy):
    """Tier-aware GDSF (module docstring); ``tiered`` says whether T1 victims go to a T2."""

    def clear(self) -> None:
        super().clear()
        self._level = dict.fromkeys(_SHARING, 0.0)
        self._at: dict[str, dict[Any, float]] = {b: {} for b in _SHARING}

    def touch(self, resource: str, node: Any) -> None:
        base = RECENCY[resource]
        self._at[base][node] = self._level[base]
        super().touch(resource, node)

    def add(self, resource: str, node: Any) -> None:
        at = self._at[RECENCY[resource]]
        if node not in at:
            at[node] = self._level[RECENCY[resource]]
        super().add(resource, node)

    def forget(self, node: Any) -> None:
        super().forget(node)
        for at in self._at.values():
            at.pop(node, None)

    def cost_s(self, resource: str, x: Any) -> float:
        """Seconds the next hit at ``x`` pays once ``resource`` is evicted."""
        f, c = self.facts, self.costs
        if resource == "state" and self.tiered:
            return c.copy_s(c.host_state_bytes)
        if resource == "kv" and f.host_kv(x):
            return c.copy_s(f.span(x) * c.kv_bytes)
        return c.recompute_s(f.anchor(x), f.prefix(x))

    def priority(self, resource: str, x: Any) -> float:
        f = self.facts
        freq = f.hits(x) + (0 if f.children(x) == 1 else 1)
        at = self._at[RECENCY[resource]].get(x, 0.0)
        return at + freq * self.cost_s(resource, x) / self.freed_bytes(resource, x)

    def choose(self, resource: str, cands: list[Any]) -> Any:
        if resource == "swa":
            return self.least_recent(resource, cands)
        h = [self.priority(resource, x) for x in cands]
        i = min(range(len(cands)), key=lambda j: (h[j], self.recency(resource, cands[j]), cands[j].id))
        base = RECENCY[resource]
        self._level[base] = max(self._level[base], h[i])
        return cands[i]
