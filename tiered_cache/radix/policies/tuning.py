"""Online tuning of a policy's one weight (Marconi's alpha): replay the recent window of requests over a
grid, keep the best.

The live policy records every sequence the tree caches at a request's end (``EvictionPolicy.observe``:
``requests.cache_finished_req`` tells it), so the engine, the SGLang backend and the capacity simulation
tune through this one object. The replays run on ``ghost.GhostCache``s, the policy's model of a cache of
the live budget (a second cache of data on the GPU is out of the question), ranking victims with a fresh
policy of the live class at each value of the grid.

As in Marconi, tuning starts at the first eviction: until then no weight changes anything and the
requests only fill the cache. Until the live tree first evicts, each finished sequence goes into the
``base`` ghost (the model of the live cache, under the live value); from then on sequences are kept, and
once ``window`` of them have arrived each value of the grid replays them on a copy of ``base`` and
scores the FLOPs its hits save. A window scored from an empty cache measures one that fills, not one
that evicts, and picks weights for the wrong regime (in bench_policy, alpha 2 on SWE-agent sessions at 2
sessions/s where 0 and 1 did better), hence the warm ``base``. The best value is kept (ties: the
smaller); the copy that ran the window under the live value becomes the next ``base`` (the live cache
ran it under that value).

The live tree does not hold its budget of KV: the running requests' KV is outside it, and a T0 shared
with the states (``UnifiedPool``) may give it more. A window's replays therefore run on ghosts of the
most device KV the live tree held after a request of the window (the budget until the first window).

Cost: nothing per eviction; per finished request, one ghost request until the first eviction, then the
tokens kept; per window, ``len(grid)`` copies of the ghost and ``len(grid) x window`` ghost requests,
whose evictions scan the ghost's candidates as the live policy scans the tree's.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Optional

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix.policies.ghost import GhostCache
from tiered_cache.validate import int_arg

ALPHA_GRID = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)


class AlphaTuner:
    """Tunes the weight of a policy made by ``make(value)`` (a fresh ``ScoredPolicy`` without a tuner, of
    the live one's class and costs) on ghosts of ``kv_tokens`` device KV tokens and ``states`` T1 states
    (the live tree's budget), over ``grid``, every ``window`` finished requests from the first eviction."""

    def __init__(self, make: Callable[[float], Any], kv_tokens: int, states: int, grid: Sequence[float] = ALPHA_GRID,
                 window: int = 500) -> None:
        if not grid or any(not isinstance(a, (int, float)) or isinstance(a, bool) or a < 0 for a in grid):
            raise InvalidArgumentError("grid", "a non-empty sequence of values >= 0", grid)
        self.make, self.grid = make, sorted({float(a) for a in grid})
        self.window = int_arg("window", window, lo=1)
        self.kv_tokens = int_arg("kv_tokens", kv_tokens, lo=1)
        self.states = int_arg("states", states, lo=1)
        self.base: Optional[GhostCache] = None  # made at the first request, under the live value
        self.recent: list[array] = []
        self.history: list[dict[float, float]] = []  # each tuning's score per value
        self.seconds = 0.0  # spent replaying
        self.held = 0  # the most device KV tokens the live tree held in this window

    def observe(self, tokens: Sequence[int], kv_held: int, evicting: bool, live: float) -> Optional[float]:
        """Record the finished sequence ``tokens`` (``kv_held``: the device KV tokens the live tree holds
        after it; ``evicting``: the live tree has evicted; ``live``: the weight it runs under) -> the best
        value when this one filled the window, else None."""
        if self.base is None:
            self.base = GhostCache(self.make(float(live)), self.kv_tokens, self.states)
        if not evicting and not self.history and not self.recent:
            self.base.request(tokens)  # the cache is still filling: the first window's warm-up
            return None
        self.recent.append(array("q", tokens))
        self.held = max(self.held, int(kv_held))
        if len(self.recent) < self.window:
            return None
        t, costs = time.perf_counter(), self.base.policy.costs
        scores, ends = {}, {}
        cap = self.held or self.kv_tokens
        for a in sorted({*self.grid, float(live)}):
            g = self.base.copy(self.make(a), kv_tokens=cap)
            scores[a] = float(sum(costs.saved(0, g.request(t)) for t in self.recent))
            ends[a] = g
        self.history.append({a: scores[a] for a in self.grid})
        self.base, self.recent, self.held = ends[float(live)], [], 0
        self.seconds += time.perf_counter() - t
        return max(self.grid, key=lambda a: (scores[a], -a))
