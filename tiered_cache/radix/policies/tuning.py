"""Marconi's online tuning of alpha: replay the recent window of requests over a grid, keep the best.

The tuner records the requests the policy ``observe``s; once it holds ``window`` of them it hands the
window to ``replay(requests, alpha)`` for every alpha of the grid (a fresh cache of the same budget run
with that alpha, returning the FLOPs the window saved) and answers the best alpha (ties: the smaller);
then it starts a new window. Until the first window is full the policy keeps its initial alpha. The
replay is the caller's: only it can build a cache of the same shape (``stack.py`` builds tiers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.validate import int_arg

ALPHA_GRID = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)


class AlphaTuner:
    def __init__(self, replay: Callable[[list[Any], float], float], grid: Sequence[float] = ALPHA_GRID,
                 window: int = 500) -> None:
        if not callable(replay):
            raise InvalidTypeError("replay", "a callable (requests, alpha) -> FLOPs saved", type(replay).__name__)
        if not grid or any(not isinstance(a, (int, float)) or isinstance(a, bool) or a < 0 for a in grid):
            raise InvalidArgumentError("grid", "a non-empty sequence of alphas >= 0", grid)
        self.replay, self.grid = replay, sorted(float(a) for a in grid)
        self.window = int_arg("window", window, lo=1)
        self.recent: list[Any] = []
        self.history: list[dict[float, float]] = []  # each tuning's score per alpha

    def observe(self, request: Any) -> Optional[float]:
        """Record ``request``; -> the best alpha when this one filled the window, else None."""
        self.recent.append(request)
        if len(self.recent) < self.window:
            return None
        scores = {a: float(self.replay(self.recent, a)) for a in self.grid}
        self.history.append(scores)
        self.recent = []
        return max(self.grid, key=lambda a: (scores[a], -a))
