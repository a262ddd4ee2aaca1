"""``Agreement``: the one collective per step that keeps the ranks' trees identical.

A rank's tree changes only through calls every rank makes in the same order (match, insert, lock,
evict: their outcomes are functions of the tree and of pools that all ranks size alike), except where
it reads something only this rank observed. Those reads are collected into one int64 vote vector per
``check_hicache_events`` and reduced with MIN over the TP group, so each becomes the AND of the ranks':

    vote                                   per                         MIN means
    done, ok[i] of each ticket             transfer op (T2 backup/load) applied only once every rank's
                                                                        tickets finished; item i intact
                                                                        only if intact on every rank (a
                                                                        checksum failure anywhere drops
                                                                        the entry everywhere)
    ready, hits[j] of each storage op      T3 fetch (lookup, prefetch)  a page is a hit only if every
                                                                        rank read its shard of it
    landed, finite                         T1 store awaiting its flag   a state with a NaN/inf in any
                                                                        rank's shard is dropped everywhere
    digest, -digest (``check_digest``)     the tree                     min == max: the trees agree,
                                                                        else ``RanksDivergedError``

The vector's layout follows the tree's own lists (ops, fetches, owned T1 slots), which are the same on
every rank because the trees are; so every rank reduces a vector of the same length. The agreed bits
overwrite the local ones (``ticket.ok``, ``op.hits``) before the tree's own code applies them, in the
order TP 1 applies them: flags, transfers, storage. Where the tree waits in place (``settle``, a
``wait_complete`` prefetch, a state served before its flag was read) every rank waits at the same call,
then one more reduction agrees on what the wait saw.

"No room" needs no vote: every rank's pools have the same slot counts (only the bytes per slot are
``1/tp``) and see the same calls, so they run out together; the digest check is what would catch it
if they did not.
"""

from __future__ import annotations

import collections
from typing import Any

from tiered_cache.errors import RanksDivergedError
from tiered_cache.parallel.dump import digest
from tiered_cache.parallel.group import TPGroup


def _op_votes(op: Any) -> list[int]:
    done = all(t.done for t in op.tickets.values())
    out = [int(done)]
    for name in sorted(op.tickets):
        t = op.tickets[name]
        out.extend([int(b) for b in t.ok] if done else [1] * len(t.host_slots))
    return out


def _fetch_votes(f: Any) -> list[int]:
    ready = all(op.done for op in f.ops)
    out = [int(ready)]
    for op in f.ops:
        n = len(op.keys)
        out.extend([int(b) for b in op.hits[:n]] + [0] * (n - len(op.hits)) if ready else [1] * n)
    return out


class Agreement:
    """Agrees ``cache``'s rank-local observations over ``group`` (a ``TPGroup`` of more than one rank).
    ``check_digest``: also compare the trees' digests at every step (costs a walk of the tree).
    ``stats``: ``rounds`` (reductions), ``overruled_*`` (what this rank saw but another did not)."""

    def __init__(self, cache: Any, group: TPGroup, *, check_digest: bool = False) -> None:
        self.cache, self.group, self.check_digest = cache, group, check_digest
        self.stats: collections.Counter = collections.Counter()

    def _reduce(self, votes: list[int]) -> list[int]:
        self.stats["rounds"] += 1
        return self.group.all_min(votes)

    # ------------------------------------------------------------------------------ each step
    def check_events(self) -> None:
        """``check_hicache_events`` of a TP rank: vote, reduce once, apply what every rank saw."""
        cache = self.cache
        host, flags = cache.host_tier, getattr(cache.rule, "flags", None)
        t3 = host.t3
        if host.engine is not None:
            host.engine.poll()
        if t3 is not None:
            t3.tier.poll()
        ops, fetches = list(host.ops), list(t3.fetches) if t3 is not None else []
        owned, landed = self._local_flags(flags)
        votes: list[int] = []
        for op in ops:
            votes += _op_votes(op)
        for f in fetches:
            votes += _fetch_votes(f)
        for s in owned:
            votes += [1, int(landed[s])] if s in landed else [0, 1]
        if self.check_digest:
            d = digest(cache)
            votes += [d, -d]
        agreed = self._reduce(votes)
        if self.check_digest and agreed[-2] != -agreed[-1]:
            raise RanksDivergedError(self.group.rank, "the tree digests of the ranks differ")
        i = 0
        done_ops = []
        for op in ops:
            n = len(_op_votes(op))
            if agreed[i]:
                self._set_oks(op, agreed[i + 1:i + n])
                done_ops.append(op)
            i += n
        ready = []
        for f in fetches:
            n = len(_fetch_votes(f))
            if agreed[i]:
                self._set_hits(f, agreed[i + 1:i + n])
                ready.append(f)
            i += n
        if flags is not None and owned:
            flags.apply({s: bool(agreed[i + 2 * k + 1]) for k, s in enumerate(owned) if agreed[i + 2 * k]})
        host.apply_ops(lambda op: any(op is o for o in done_ops))
        if t3 is not None:
            t3.poll(ready=ready)

    # ------------------------------------------------------------------------------ waits in place
    def settle(self, ops: list) -> None:
        """Every rank waited for ``ops`` (``HostTier.settle``): agree on their checksums."""
        votes: list[int] = []
        for op in ops:
            votes += _op_votes(op)[1:]
        agreed = self._reduce(votes)
        i = 0
        for op in ops:
            n = len(_op_votes(op)) - 1
            self._set_oks(op, agreed[i:i + n])
            i += n

    def fetches(self, fs: list) -> list:
        """Which of ``fs`` (T3 fetches every rank waited for) are ready on every rank, their hits agreed."""
        votes: list[int] = []
        for f in fs:
            votes += _fetch_votes(f)
        agreed = self._reduce(votes)
        out, i = [], 0
        for f in fs:
            n = len(_fetch_votes(f))
            if agreed[i]:
                self._set_hits(f, agreed[i + 1:i + n])
                out.append(f)
            i += n
        return out

    def flags(self, flags: Any) -> dict[int, bool]:
        """The NaN/inf flags of every T1 store ``flags`` (a ``StateFlags``) awaits, waited for and agreed:
        slot -> finite on every rank (slots whose flag has not landed on some rank are left out)."""
        owned, landed = self._local_flags(flags)
        votes: list[int] = []
        for s in owned:
            votes += [1, int(landed[s])] if s in landed else [0, 1]
        agreed = self._reduce(votes)
        return {s: bool(agreed[2 * k + 1]) for k, s in enumerate(owned) if agreed[2 * k]}

    # ------------------------------------------------------------------------------ helpers
    @staticmethod
    def _local_flags(flags: Any) -> tuple[list[int], dict[int, bool]]:
        """The T1 slots whose flags ``flags`` awaits (sorted: the same list on every rank) and what this
        rank read of them, waiting for each (small copies of earlier stores, landed long ago)."""
        if flags is None or not flags.owner:
            return [], {}
        owned = sorted(flags.owner)
        return owned, flags.ckpt.poll_flags(owned)

    def _set_oks(self, op: Any, bits: list[int]) -> None:
        i = 0
        for name in sorted(op.tickets):
            t = op.tickets[name]
            n = len(t.host_slots)
            mine, agreed = list(t.ok), [bool(b) for b in bits[i:i + n]]
            self.stats["overruled_checksums"] += sum(1 for a, b in zip(mine, agreed) if a and not b)
            t.ok = agreed
            i += n

    def _set_hits(self, f: Any, bits: list[int]) -> None:
        i = 0
        for op in f.ops:
            n = len(op.keys)
            agreed = [bool(b) for b in bits[i:i + n]]
            self.stats["overruled_storage_hits"] += sum(1 for a, b in zip(op.hits, agreed) if a and not b)
            op.hits = agreed
            i += n


def attach(cache: Any, group: TPGroup) -> Any:
    """Wire ``cache`` (a radix cache) to agree with ``group``; returns the ``Agreement``, or None for
    TP 1 (nothing is wired: the cache decides alone, at no cost)."""
    if group.size == 1:
        return None
    a = Agreement(cache, group, check_digest=group.check_digest)
    cache.agreement = a
    cache.host_tier.agree = a
    if cache.host_tier.t3 is not None:
        cache.host_tier.t3.agree = a
    flags = getattr(cache.rule, "flags", None)
    if flags is not None:
        flags.agree = a
    return a
