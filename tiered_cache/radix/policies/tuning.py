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
whose evictions scan the ghost's candidates as the live policy scans the tree's: seconds of Python for a
window of 500 (3-25 s on a loaded CPU core in bench_policy). Inline (``background=False``, the
simulation's choice) that time falls on the request that fills the window. ``background=True`` (the
stack's: an engine's or SGLang's serving thread must not stall) replays on a daemon thread beside the
requests and takes the result at a fixed point, when the next window has filled, waiting there only if
the replay is still running: the weight then changes one window late, but at the same request whatever
the timing, so tensor-parallel ranks (each tunes its own tree from the same requests) stay identical.
A background replay that fails stops the tuning (``error`` holds why, logged; the weight stays), rather
than raise into a serving thread. Clearing the live cache (``reset``) does not wait for a running replay:
it tells the replay to stop at its next ghost request and drops it, result unseen (the replay reads only
its own ghosts, which nothing else touches from then on). Replays are Python and share the GIL with the
serving thread: they slow its host work while they run, in small slices, where inline they would stop it.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from typing import Any, Optional

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix.policies.ghost import GhostCache
from tiered_cache.validate import bool_arg, int_arg

ALPHA_GRID = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0)
_log = logging.getLogger(__name__)


class _Cancelled(Exception):
    """A background replay dropped by ``reset``: it stops where it is, its result is not wanted."""


class AlphaTuner:
    """Tunes the weight of a policy made by ``make(value)`` (a fresh ``ScoredPolicy`` without a tuner, of
    the live one's class and costs) on ghosts of ``kv_tokens`` device KV tokens and ``states`` T1 states
    (the live tree's budget), over ``grid``, every ``window`` finished requests from the first eviction."""

    def __init__(self, make: Callable[[float], Any], kv_tokens: int, states: int, grid: Sequence[float] = ALPHA_GRID,
                 window: int = 500, background: bool = False) -> None:
        if not grid or any(not isinstance(a, (int, float)) or isinstance(a, bool) or a < 0 for a in grid):
            raise InvalidArgumentError("grid", "a non-empty sequence of values >= 0", grid)
        self.make, self.grid = make, sorted({float(a) for a in grid})
        self.window = int_arg("window", window, lo=1)
        self.kv_tokens = int_arg("kv_tokens", kv_tokens, lo=1)
        self.states = int_arg("states", states, lo=1)
        self.background = bool_arg("background", background)
        self.base: Optional[GhostCache] = None  # made at the first request, under the live value
        self.recent: list[array] = []
        self.history: list[dict[float, float]] = []  # each tuning's score per value
        self.seconds = 0.0  # spent replaying
        self.held = 0  # the most device KV tokens the live tree held in this window
        # a background replay, its result, and the event that cancels it
        self._pending: Optional[tuple[threading.Thread, dict, threading.Event]] = None
        self.error: Optional[Exception] = None  # why a background replay failed (tuning stopped)

    def reset(self) -> None:
        """The live cache was cleared: forget its model. A replay still running is cancelled and dropped,
        not waited for (it stops at its next ghost request; a clear never stalls behind a window's replay)."""
        if self._pending is not None:
            self._pending[2].set()
        self._pending, self.base, self.recent, self.held = None, None, [], 0

    def observe(self, tokens: Sequence[int], kv_held: int, evicting: bool, live: float) -> Optional[float]:
        """Record the finished sequence ``tokens`` (``kv_held``: the device KV tokens the live tree holds
        after it; ``evicting``: the live tree has evicted; ``live``: the weight it runs under) -> the best
        value when a tuning ends with this one (inline: it filled the window; background: it filled the
        window after the one being replayed), else None."""
        if self.error is not None:
            return None
        if self.base is None:
            self.base = GhostCache(self.make(float(live)), self.kv_tokens, self.states)
        if not evicting and not self.history and not self.recent and self._pending is None:
            self.base.request(tokens)  # the cache is still filling: the first window's warm-up
            return None
        self.recent.append(array("q", tokens))
        self.held = max(self.held, int(kv_held))
        if len(self.recent) < self.window:
            return None
        best = None
        if self._pending is not None:  # the fixed point: the replay of the window before is taken now
            thread, done, _ = self._pending
            thread.join()
            self._pending = None
            if "error" in done:
                self.error = done["error"]
                _log.warning("Marconi alpha tuning stopped (the weight stays %s): %r", live, self.error)
                self.recent = []
                return None
            best = self._take(*done["result"])
        recent, held, self.recent, self.held = self.recent, self.held or self.kv_tokens, [], 0
        base, live = self.base, float(live)
        if not self.background:
            return self._take(*self._replay(base, recent, held, live))

        def run(out: dict, cancel: threading.Event) -> None:
            try:
                out["result"] = self._replay(base, recent, held, live, cancel)
            except _Cancelled:  # reset dropped it: nobody reads ``out``
                pass
            except Exception as e:  # seen by the serving thread at the next fixed point
                out["error"] = e

        out: dict = {}
        cancel = threading.Event()
        thread = threading.Thread(target=run, args=(out, cancel), name="alpha-tuner", daemon=True)
        self._pending = (thread, out, cancel)
        thread.start()
        return best

    def _replay(self, base: GhostCache, recent: list[array], cap: int, live: float,
                cancel: Optional[threading.Event] = None) -> tuple[dict[float, float], GhostCache, float]:
        """Each value of the grid (and ``live``) replays ``recent`` on a copy of ``base`` of ``cap`` KV
        tokens -> (scores, the copy that ran under ``live``, seconds). Reads nothing the requests change.
        ``cancel``, once set, stops it (``_Cancelled``) before its next ghost request."""
        t, costs = time.perf_counter(), base.policy.costs
        scores, ends = {}, {}
        for a in sorted({*self.grid, live}):
            g = base.copy(self.make(a), kv_tokens=cap)
            total = 0
            for x in recent:
                if cancel is not None and cancel.is_set():
                    raise _Cancelled
                total += costs.saved(0, g.request(x))
            scores[a] = float(total)
            ends[a] = g
        return scores, ends[live], time.perf_counter() - t

    def _take(self, scores: dict[float, float], end: GhostCache, seconds: float) -> float:
        self.history.append({a: scores[a] for a in self.grid})
        self.base = end
        self.seconds += seconds
        return max(self.grid, key=lambda a: (scores[a], -a))
