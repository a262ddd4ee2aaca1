"""Online tuning of a policy's one weight (Marconi's alpha): replay the recent window of requests over
a grid, keep the best.

As in Marconi, tuning starts at the first eviction: until then no weight changes anything, and the
requests so far only fill the cache. The tuner records the requests the policy ``observe``s; once
``window`` of them have arrived since eviction began it asks ``replay(warm, requests, value)`` for
every value of the grid: a fresh cache of the same budget runs ``warm`` and then ``requests`` with that
value, and answers the FLOPs ``requests`` saved. ``warm`` is what brings the fresh cache to the state
the live one had when the window began: for the first window, every request before it (exact: they
ran before any eviction, so under any weight they leave the same cache), then the window before.
Scored from an empty cache, a window measures a cache that is filling, not one that evicts, and picks
weights for the wrong regime (bench_policy's SWE-agent sessions at 2 sessions/s: alpha 2 picked where
0 and 1 both did better). The tuner keeps the best value (ties: the smaller) and starts a new window;
until the first window is full the policy keeps its initial value. The replay is the caller's: only it
can build a cache of the same shape (``stack.py`` builds tiers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.validate import int_arg

ALPHA_GRID = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)


class AlphaTuner:
    def __init__(self, replay: Callable[[list[Any], list[Any], float], float], grid: Sequence[float] = ALPHA_GRID,
                 window: int = 500) -> None:
        if not callable(replay):
            raise InvalidTypeError("replay", "a callable (warm, requests, value) -> FLOPs saved", type(replay).__name__)
        if not grid or any(not isinstance(a, (int, float)) or isinstance(a, bool) or a < 0 for a in grid):
            raise InvalidArgumentError("grid", "a non-empty sequence of values >= 0", grid)
        self.replay, self.grid = replay, sorted(float(a) for a in grid)
        self.window = int_arg("window", window, lo=1)
        self.before: list[Any] = []
        self.recent: list[Any] = []
        self.history: list[dict[float, float]] = []  # each tuning's score per value

    def observe(self, request: Any, evicting: bool) -> Optional[float]:
        """Record ``request`` (``evicting``: the cache has evicted before it); -> the best value when this
        one filled the window, else None."""
        if not evicting and not self.history and not self.recent:
            self.before.append(request)  # the cache is still filling: the first window's warm-up
            return None
        self.recent.append(request)
        if len(self.recent) < self.window:
            return None
        scores = {a: float(self.replay(self.before, self.recent, a)) for a in self.grid}
        self.history.append(scores)
        self.before, self.recent = self.recent, []
        return max(self.grid, key=lambda a: (scores[a], -a))
