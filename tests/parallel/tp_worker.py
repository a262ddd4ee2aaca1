"""One tensor-parallel rank of ``test_tensor_parallel.py``: a seeded random sequence of requests and
evictions through a rank's ``TieredCache`` (T0, T1 lossless, T2, T3 on files), with per-rank faults.

Every rank draws the same operations from the same seed and writes its share of the heads of the same
whole K/V and states (a pattern of the tokens, distinct per head, so a wrong share shows). The faults
are drawn from the seed too, each for one rank: a host copy corrupted before a load (its checksum then
fails on that rank only), a ticket that finishes some polls late (on that rank only), a T3 page read
that misses (on that rank only). After every ``check_hicache_events`` the ranks' canonical dumps must be
equal; after every operation (in-flight work settled), rank 0 also compares them with a TP 1 *twin*
that runs the same operations over whole heads with every rank's faults at once, which is what the
agreement says TP N must do. A hit's K/V and state, gathered from the ranks' shares, must equal the
pattern (lossless: what TP 1 serves, byte for byte). At the end everything is drained and every pool
is back to its initial free size.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import random
from typing import Any, Optional

import torch
import torch.distributed as dist

from tiered_cache import CacheConfig, KVSpec, StateSpec, TieredCache
from tiered_cache.parallel import TPGroup, tree_dump
from tiered_cache.radix import CacheReq, InitLoadBackParams, MatchPrefixParams, RadixKey
from tiered_cache.radix.params import EvictParams

PS = 4
KV = KVSpec(num_layers=2, kv_heads=4, head_dim=2, dtype=torch.float32)
# Every field of a share is a multiple of ALIGN (16) bytes at TP 1, 2 and 4, so a share is exactly 1/tp of
# the bytes and T0's two sides trade room in the same ratio as at TP 1: the twin's free sizes match too.
STATE = StateSpec(num_layers=2, temporal_shape=(4, 2, 4), temporal_dtype=torch.float32, conv_shapes=((8, 4),),
                  conv_dtype=torch.float32, value_axis=2)


def _h(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def kv_pattern(toks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole K and V of ``toks``: [L, T, H, D], token j's values from the hash of ``toks[:j+1]``."""
    hs = torch.tensor([_h(tuple(toks[:j + 1])) % 100003 for j in range(len(toks))], dtype=torch.float32)
    L, H, D = KV.num_layers, KV.kv_heads, KV.head_dim
    grid = torch.arange(L * H * D, dtype=torch.float32).view(L, 1, H, D)
    k = hs.view(1, -1, 1, 1) + grid * 0.125
    return k, -k


def state_pattern(toks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole temporal state [L, H, a, b] and conv window [L, C, K] after ``toks``."""
    h = float(_h(tuple(toks)) % 100003)
    t = torch.arange(STATE.num_layers * 4 * 2 * 4, dtype=torch.float32).view(STATE.num_layers, 4, 2, 4) * 0.5 + h
    c = torch.arange(STATE.num_layers * 8 * 4, dtype=torch.float32).view(STATE.num_layers, 8, 4) - h
    return t, c


class Faults:
    """The seed's faults, each meant for one rank; ``rank`` None: the twin, which suffers all of them."""

    def __init__(self, seed: int, size: int, rank: Optional[int]) -> None:
        self.seed, self.size, self.rank = seed, size, rank
        self.loads = 0
        self.late_calls: collections.Counter = collections.Counter()
        self.prefetches = 0
        self.count: collections.Counter = collections.Counter()

    def mine(self, what: str, n: int, prob: float) -> bool:
        """Whether fault ``what`` number ``n`` happens, and to this rank (the twin: to anyone)."""
        r = random.Random(_h(self.seed, what, n))
        hit, target = r.random() < prob, r.randrange(self.size)
        return hit and (self.rank is None or self.rank == target)

    def install(self, tiers: TieredCache) -> None:
        te = tiers.transfer
        fired = te._fired

        def corrupt(region, slots):
            self.loads += 1
            if self.mine("checksum", self.loads, 0.2):
                region.flip_bit(slots[0], 3, 1)
                self.count["checksum"] += 1

        def late(t):
            if self.mine("late", t.id, 0.3) and self.late_calls[t.id] < 3:
                self.late_calls[t.id] += 1
                self.count["late"] += self.late_calls[t.id] == 1
                return False
            return fired(t)

        te.corrupt_hook = corrupt
        te._fired = late
        tier = tiers.storage
        prefetch = tier.prefetch

        def missing(keys, kind, region, slots, **kw):
            self.prefetches += 1
            if keys and self.mine("storage", self.prefetches, 0.35):
                keys = [bytes(b ^ 0xFF for b in keys[0]), *keys[1:]]  # a key nobody wrote: that page misses
                self.count["storage"] += 1
            return prefetch(keys, kind, region, slots, **kw)

        tier.prefetch = missing


@dataclasses.dataclass
class Rank:
    tiers: TieredCache
    tp: TPGroup
    faults: Faults

    @property
    def tree(self) -> Any:
        return self.tiers.tree


def build(tmp: str, name: str, tp: Optional[TPGroup], faults: Faults, policy: str) -> Rank:
    cfg = CacheConfig(page_size=PS, kv_pages=14, t0_states=3, t1_states=3, host_kv_pages=12, host_states=4,
                      codec="lossless", write_policy="write_through", storage_url=f"file://{tmp}/{name}",
                      prefetch_policy=policy, backend="torch", check_memory=False)
    tiers = TieredCache.build(cfg, kv=KV, state=STATE, device="cpu", model_id="tp-test", tp=tp)
    faults.install(tiers)
    return Rank(tiers, tp or TPGroup.single(), faults)


def _write(r: Rank, ids: torch.Tensor, toks: list[int], start: int, slot: torch.Tensor) -> None:
    """This rank's share of the whole K/V of ``toks[start:]`` at ``ids[start:]``, and of the state after ``toks``."""
    kv = r.tiers.kv
    if len(toks) > start:
        k, v = kv_pattern(toks)
        phys = kv.translate(ids[start:len(toks)])
        kv.k_view_all()[:, phys // PS, phys % PS] = r.tp.split(k[:, start:], 2)
        kv.v_view_all()[:, phys // PS, phys % PS] = r.tp.split(v[:, start:], 2)
    t, c = state_pattern(toks)
    st = r.tiers.states
    row = st.translate(slot.reshape(1))
    st.temporal_view_all()[:, row] = r.tp.split(t, 1)[:, None]
    st.conv_view_all(0)[:, row] = r.tp.split(c, 1)[:, None]


def _check_hit(r: Rank, ids: torch.Tensor, toks: list[int], slot: torch.Tensor) -> None:
    """What a hit serves, the ranks' shares gathered: the whole K/V and state of ``toks``, exactly."""
    kv, st = r.tiers.kv, r.tiers.states
    phys = kv.translate(ids)
    k = r.tp.gather(kv.k_view_all()[:, phys // PS, phys % PS], 2)
    v = r.tp.gather(kv.v_view_all()[:, phys // PS, phys % PS], 2)
    row = st.translate(slot.reshape(1))
    t = r.tp.gather(st.temporal_view_all()[:, row[0]], 1)
    c = r.tp.gather(st.conv_view_all(0)[:, row[0]], 1)
    wk, wv = kv_pattern(toks)
    wt, wc = state_pattern(toks)
    assert torch.equal(k, wk) and torch.equal(v, wv), f"hit KV of {len(toks)} tokens differs from TP 1's"
    assert torch.equal(t, wt) and torch.equal(c, wc), f"hit state after {len(toks)} tokens differs from TP 1's"


def turn(r: Rank, toks: list[int], events) -> str:
    """One request, as the engine serves it: match (cow), load back a host hit, lock, check what the hit
    serves, write the rest, cache it. -> what happened."""
    tiers, tree = r.tiers, r.tree
    req = CacheReq(token_ids=list(toks), kv_indices=torch.empty(0, dtype=torch.int64))
    m = tree.match_prefix(MatchPrefixParams(key=RadixKey(toks[:-1]), cow_mamba=True, req=req))
    prefix, node = m.device_indices, m.last_device_node
    if m.host_hit_length > 0:
        ids, node = tree.init_load_back(InitLoadBackParams(best_match_node=m.best_match_node,
                                                           host_hit_length=m.host_hit_length, req=req))
        if len(ids):
            prefix = torch.cat([prefix, ids])
    tree.inc_lock_ref(node)
    lb = getattr(req, "load_back", None)
    while lb is not None and not lb.done:
        events()  # a late ticket: more steps, each agreed
    slot = req.mamba_pool_idx

    def release(why: str) -> str:
        tree.dec_lock_ref(node)
        if req.mamba_pool_idx is not None:
            tiers.states.free(req.mamba_pool_idx)
        return why

    if lb is not None and not lb.ok:
        return release("load_failed")
    p = len(prefix)
    if p:
        assert slot is not None, "a hit comes with its state"
        _check_hit(r, prefix, toks[:p], slot)
    if slot is None:
        slot = req.mamba_pool_idx = tiers.alloc_states(1)
        if slot is None:
            return release("no_state_room")
    new = tiers.alloc_kv(len(toks) - p)
    if new is None:
        return release("no_kv_room")
    req.kv_indices = torch.cat([prefix, new])
    req.last_node, req.cache_protected_len = node, p
    _write(r, req.kv_indices, toks, p, slot)
    tree.cache_finished_req(req)
    return "hit" if p else "miss"


def run(rank: Optional[int], size: int, tmp: str, seed: int, n_ops: int, policy: str,
        twin: Optional[Rank] = None) -> dict:
    """The sequence on this rank (``rank`` None: the twin alone)."""
    if rank is None:
        me = twin
    else:
        me = build(tmp, f"r{rank}", TPGroup.from_distributed(check_digest=True), Faults(seed, size, rank), policy)
    assert me is not None
    free0 = me.tiers.free_sizes()
    rng = random.Random(seed)
    stems = [[rng.randrange(1, 4) for _ in range(PS * rng.randrange(1, 4))] for _ in range(4)]
    outcome: collections.Counter = collections.Counter()
    hist: list[list[int]] = []

    def compare(tag: str) -> None:
        if rank is None:
            return
        dumps: list = [None] * size
        dist.all_gather_object(dumps, tree_dump(me.tree))
        for r, d in enumerate(dumps):
            diff = [(a, b) for a, b in zip(dumps[0], d) if a != b] or [(len(dumps[0]), len(d))]
            assert d == dumps[0], f"{tag}: rank {r}'s tree differs from rank 0's, first: {diff[:2]}"

    caches = [me] + ([twin] if twin is not None and twin is not me else [])

    def events(c: Rank) -> None:
        c.tree.check_hicache_events()
        if c is me:
            compare("after check_hicache_events")

    def settle(c: Rank) -> None:
        # until nothing is in flight: transfers, fetches (agreed: the same on every rank) and T3 writes
        # (so that a later lookup finds them on every rank, as on the twin, whatever the threads' timing)
        # The exit test reads only agreed state: how many T3 writes a poll happened to finish is this
        # rank's own timing (a test that asked it would step its ranks apart, not the cache).
        tier = c.tiers.storage
        for _ in range(2000):
            for sop in list(tier._pending.values()):
                tier.wait(sop, 30.0)
            events(c)
            for sop in list(tier._pending.values()):
                tier.wait(sop, 30.0)
            if not c.tree.host_tier.ops and not c.tree.t3.fetches:
                return
        raise AssertionError("transfers still in flight after 2000 steps")

    for op in range(n_ops):
        kind = rng.random()
        if kind < 0.8:
            # a conversation's next turn (its history + a page or two), or a new one from a shared stem
            base = hist[rng.randrange(len(hist))] if hist and rng.random() < 0.7 else stems[rng.randrange(len(stems))]
            toks = base + [rng.randrange(1, 4) for _ in range(PS * rng.randrange(1, 3))]
            if len(toks) > 10 * PS:
                toks = toks[:PS * rng.randrange(1, 4)]
            hist.append(toks)
            got = [turn(c, toks, lambda c=c: events(c)) for c in caches]
            assert all(g == got[0] for g in got), f"op {op}: TP 1 served {got[-1]}, TP {size} {got[0]}"
            outcome[got[0]] += 1
        else:
            e = EvictParams(num_tokens=PS * rng.randrange(1, 6), mamba_num=rng.randrange(0, 3))
            for c in caches:
                c.tree.evict(e)
            outcome["evict"] += 1
        for c in caches:
            events(c)
            settle(c)
            c.tiers.check_invariants()
        if len(caches) > 1:
            assert _no_flags(tree_dump(me.tree)) == _no_flags(tree_dump(twin.tree)), f"op {op}: differs from TP 1"
    for c in caches:
        c.tree.evict(EvictParams(num_tokens=10**6, mamba_num=10**6))
        c.tiers.close()
        c.tree.reset()
        assert c.tiers.free_sizes() == free0, "a slot leaked"
    compare("drained")
    agreement = me.tree.agreement
    return {"outcome": dict(outcome), "faults": dict(me.faults.count), "tree": dict(me.tree.stats),
            "agreement": {} if agreement is None else dict(agreement.stats),
            "collectives": me.tp.collectives}


def _no_flags(dump: list) -> list:
    """The dump without ``t1_unverified`` (when a NaN flag is read differs between TP 1 and TP N: a TP rank
    reads flags only where every rank reads them)."""
    out = []
    for row in dump:
        if row[0] == "free":
            out.append(row)
            continue
        payload = tuple(p for p in row[7] if p[0] != "t1_unverified")
        out.append((*row[:7], payload, *row[8:]))
    return out


def main(rank: int, size: int, tmp: str, seed: int, n_ops: int, policy: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=size)
    try:
        twin = build(tmp, "twin", None, Faults(seed, size, None), policy) if rank == 0 else None
        res = run(rank, size, tmp, seed, n_ops, policy, twin)
        if twin is not None:
            res["twin_faults"] = dict(twin.faults.count)
        gathered: list = [None] * size
        dist.all_gather_object(gathered, res)
        if rank == 0:
            import json

            with open(out, "w") as f:
                json.dump(gathered, f)
    finally:
        dist.destroy_process_group()
