"""Eviction policies: which cached node gives up a resource next.

The tree tells the policy four things and asks one: a node was *used* (``touch``), a node became or
stopped being a *candidate* for a resource (``add``/``discard``: the tree alone knows locks and
leaves), a node left the tree (``forget``), a request finished with these tokens cached (``observe``:
what a policy that tunes itself replays); and ``pop`` returns the best victim among the candidates.
The policy never looks inside a node, and the tree never orders victims, so a cost-aware policy
(bytes, recompute cost, hit counts) replaces ``LRUPolicy`` without touching the tree.

Resources, one candidate set per (resource, tier): ``"kv"`` (device KV of unlocked nodes with no
device child), ``"state"`` (unlocked T1 states), ``"kv_host"`` / ``"state_host"`` (their T2 copies),
``"swa"`` (device SWA KV, SWA mode). A host tier ranks its victims by the recency of the data it
holds, so ``touch("kv", x)`` also stamps ``"kv_host"`` (``RECENCY`` says which share a clock).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any, Optional

RESOURCES = ("kv", "state", "kv_host", "state_host", "swa")
# resource -> the resource whose recency it uses (a host copy is as recent as its data's last use)
RECENCY = {"kv": "kv", "kv_host": "kv", "swa": "kv", "state": "state", "state_host": "state"}
_SHARING = {base: tuple(r for r in RESOURCES if RECENCY[r] == base) for base in set(RECENCY.values())}


class EvictionPolicy(ABC):
    @abstractmethod
    def touch(self, resource: str, node: Any) -> None:
        """``node``'s ``resource`` was used now (inserted, matched, stored)."""

    def touch_all(self, resource: str, nodes: list[Any]) -> None:
        """``touch`` of each of ``nodes``, in order (a walk's path: one call, not one per node)."""
        for node in nodes:
            self.touch(resource, node)

    @abstractmethod
    def add(self, resource: str, node: Any) -> None:
        """``node`` may now give up ``resource``."""

    @abstractmethod
    def discard(self, resource: str, node: Any) -> None:
        """``node`` may no longer give up ``resource`` (locked, or got children). No-op if it could not."""

    @abstractmethod
    def forget(self, node: Any) -> None:
        """``node`` left the tree: drop everything about it."""

    @abstractmethod
    def pop(self, resource: str) -> Optional[Any]:
        """The best victim among the candidates, no longer a candidate; ``None`` when there is none."""

    @abstractmethod
    def candidates(self, resource: str) -> set[Any]:
        """The current candidate set (for ``check_invariants``)."""

    def iter_candidates(self, resource: str) -> Iterator[Any]:
        """The candidates one at a time, in no order and with no copy made where the policy can (a reader that
        stops early pays for what it read); the caller changes no candidate set while it iterates."""
        return iter(self.candidates(resource))

    @abstractmethod
    def clear(self) -> None:
        """Forget every node."""

    @abstractmethod
    def observe(self, tokens: list[int], kv_held: int) -> None:
        """A request finished and the tree cached ``tokens``; it now holds ``kv_held`` device KV tokens. A
        policy that learns from the requests records them (``MarconiPolicy``'s alpha tuner)."""

    def size(self, resource: str) -> int:
        """How many candidates ``resource`` has (override when a cheaper count exists)."""
        return len(self.candidates(resource))


class LRUPolicy(EvictionPolicy):
    """Least recently used first, per resource.

    A logical clock stamps each ``touch``. Candidates sit in a min-heap of ``(stamp, seq, node)``;
    entries go stale when a node is touched again or stops being a candidate and are skipped when
    popped (lazy deletion), so every operation is O(log n) and ``pop`` never walks past locked or
    internal nodes. The heap is rebuilt when stale entries outnumber live ones.
    """

    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self._seq = itertools.count()
        self.clear()

    def clear(self) -> None:
        self._stamp: dict[str, dict[Any, int]] = {r: {} for r in _SHARING}  # by recency base
        self._cand: dict[str, set[Any]] = {r: set() for r in RESOURCES}
        self._heap: dict[str, list[tuple[int, int, Any]]] = {r: [] for r in RESOURCES}

    def touch(self, resource: str, node: Any) -> None:
        t = next(self._clock)
        base = RECENCY[resource]
        self._stamp[base][node] = t
        for r in _SHARING[base]:
            if node in self._cand[r]:
                self._push(r, t, node)

    def touch_all(self, resource: str, nodes: list[Any]) -> None:
        """``touch`` over ``nodes`` (distinct) in C: the same stamps, in order (``zip`` stops at the last node
        before it takes another tick), and a push for each node that is a candidate of a sharing resource (a
        path's nodes are few and mostly not: the candidate set is intersected with them, not tested node by
        node in Python). The pushes' order among nodes may differ from ``touch``'s: their stamps differ, so no
        pop order does. A subclass that overrides ``touch`` overrides this too."""
        base = RECENCY[resource]
        stamps = self._stamp[base]
        stamps.update(zip(nodes, self._clock))
        for r in _SHARING[base]:
            cand = self._cand[r]
            if cand:
                for node in cand.intersection(nodes):
                    self._push(r, stamps[node], node)

    def add(self, resource: str, node: Any) -> None:
        cand = self._cand[resource]
        if node in cand:
            return
        cand.add(node)
        stamps = self._stamp[RECENCY[resource]]
        t = stamps.get(node)
        if t is None:
            t = stamps[node] = next(self._clock)
        self._push(resource, t, node)

    def discard(self, resource: str, node: Any) -> None:
        self._cand[resource].discard(node)

    def forget(self, node: Any) -> None:
        for r in RESOURCES:
            self._cand[r].discard(node)
        for stamps in self._stamp.values():
            stamps.pop(node, None)

    def pop(self, resource: str) -> Optional[Any]:
        heap, cand, stamps = self._heap[resource], self._cand[resource], self._stamp[RECENCY[resource]]
        while heap:
            t, _, node = heapq.heappop(heap)
            if node in cand and stamps.get(node) == t:
                cand.discard(node)
                return node
        return None

    def candidates(self, resource: str) -> set[Any]:
        return set(self._cand[resource])

    def iter_candidates(self, resource: str) -> Iterator[Any]:
        return iter(self._cand[resource])

    def observe(self, tokens: list[int], kv_held: int) -> None:
        """Recency learns nothing from the requests themselves."""

    def size(self, resource: str) -> int:
        return len(self._cand[resource])

    def adopt(self, other: LRUPolicy, twin: dict[Any, Any]) -> None:
        """Forget every node, then take ``other``'s stamps and candidates, each node as ``twin`` maps it (a
        copy of ``other``'s tree: ``radix.policies.ghost``); new stamps come after all of them."""
        self.clear()
        last = 0
        for base, stamps in other._stamp.items():
            self._stamp[base] = {twin[n]: t for n, t in stamps.items() if n in twin}
            last = max(last, max(stamps.values(), default=0))
        self._clock = itertools.count(last + 1)
        for r, cand in other._cand.items():
            for n in cand:
                if n in twin:
                    self.add(r, twin[n])

    def stamp(self, resource: str, node: Any) -> Optional[int]:
        """The node's last-use stamp (tests pin orders with it)."""
        return self._stamp[RECENCY[resource]].get(node)

    def _push(self, resource: str, t: int, node: Any) -> None:
        heap = self._heap[resource]
        heapq.heappush(heap, (t, next(self._seq), node))
        if len(heap) > 64 and len(heap) > 3 * len(self._cand[resource]):
            # the live entries again, built in C (zip over map: no Python step per candidate; the same entries and
            # sequence numbers, in the set's order, as a comprehension would make)
            cand = list(self._cand[resource])
            self._heap[resource] = list(zip(map(self._stamp[RECENCY[resource]].__getitem__, cand), self._seq, cand))
            heapq.heapify(self._heap[resource])
