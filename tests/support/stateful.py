"""Shared pieces of the radix state machines (``tests/radix/test_radix*_stateful.py``): the strategies, the
settings, a walk of the tree, the K of device pages, and the request rules that every Mamba machine runs
(the host tier's pieces are in ``host_tier.py``).

``CacheMachine`` holds the rules the plain machine (T0 + T1) and the host-tier machine (T0 + T1 + T2)
run alike: insert, start / finish / abort a request. Each machine brings its own model through the hooks
``expect_match`` (what a match must return), ``model_insert`` (check an insert and record it),
``finish`` (hand a finished request to the cache and record it), ``adopt`` (take what the tree holds
after a step it cannot predict exactly, checked against what that step may change) and ``drain`` (empty
every tier at the end, after which every pool must be back to its ``free_sets()`` of the start).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from tests.support.radix_util import check_kv, state_pattern, write_kv, write_state
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix import CacheReq, InsertParams, MatchPrefixParams, RadixKey

TOKENS = st.lists(st.integers(1, 3), min_size=0, max_size=7)
SALTS = st.sampled_from([None, None, "t"])


def machine_settings() -> settings:
    """The issue's floor: >= 200 examples x 100 steps in CI. RADIX_EXAMPLES raises it for a soak run;
    RADIX_NOSHRINK skips the database replay and shrinking (a fast soak)."""
    return settings(
        max_examples=int(os.environ.get("RADIX_EXAMPLES", 200)), stateful_step_count=100, deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        phases=(Phase.explicit, Phase.generate) if os.environ.get("RADIX_NOSHRINK") else tuple(Phase))


def walk(cache) -> Iterator[tuple]:
    """-> ``(node, salt, prefix above the node)`` for every node below the root; the salt is read from the
    child key of the node's top ancestor (a salted key is ``(salt, first page)``)."""
    stack = [(c, (ck[0] if isinstance(ck, tuple) and isinstance(ck[0], str) else None), ())
             for ck, c in cache.root.children.items()]
    while stack:
        x, salt, pre = stack.pop()
        yield x, salt, pre
        stack.extend((c, salt, pre + tuple(x.key)) for c in x.children.values())


def k0(side, ids, ps: int) -> torch.Tensor:
    """K (layer 0, head 0, element 0) of each token at virtual KV ``ids`` of a T0 side: the pattern the
    test helpers write is the token's prefix hash there."""
    phys = side.translate(torch.tensor(ids))
    return side.k_view_all()[0, phys // ps, phys % ps, 0, 0]


class CacheMachine(RuleBasedStateMachine):
    """Rules shared by the Mamba machines; the model lives in the subclass (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.cache = None
        self.reqs = []

    # ------------------------------------------------------------------ model hooks
    def expect_match(self, toks, salt) -> tuple:
        """-> (KV tokens matched, depth of the usable state, the device ids up to it)."""
        raise NotImplementedError

    def model_insert(self, toks, salt, ids, prev, res, t1_had_room) -> None:
        raise NotImplementedError

    def finish(self, req, toks, salt) -> None:
        """``cache_finished_req(req)`` and what the model makes of it."""
        raise NotImplementedError

    def adopt(self, new=None) -> None:
        raise NotImplementedError

    def drain(self) -> None:
        """At the end, with every request aborted: empty every tier of the cache."""
        raise NotImplementedError

    def free_sets(self) -> tuple:
        """What each pool has free (T0's free KV and state ids, T1's free count): the end equals the start."""
        c = self.cache
        return set(c.kv.allocator._free_vids), set(c.states.allocator._free_vids), c.ckpt.available_size()

    def t1_room(self, toks, salt) -> bool:
        """Whether an insert of ``toks`` finds T1 room for its state (or stores none)."""
        ps = self.ps
        if len(toks) % ps or not toks or (salt, tuple(toks)) in self.states:
            return True
        return self.cache.ckpt.available_size() > 0

    # ------------------------------------------------------------------ checks
    def check_cache(self, request_states) -> None:
        """``check_invariants`` with the T0 state slots that requests hold."""
        empty = torch.empty(0, dtype=torch.int64)
        self.cache.check_invariants(request_kv=empty,
                                    request_states=torch.cat(request_states) if request_states else empty)

    def refused_unchanged(self, call, observe) -> None:
        """``call`` raises a typed error and ``observe()`` is the same after it as before."""
        before = observe()
        try:
            call()
            raise AssertionError("bad input accepted")
        except InvalidArgumentError:
            pass
        assert observe() == before

    def match_checked(self, toks, salt, cow, kv_len, hit, ids):
        """``match_prefix`` (copying the state at the hit with ``cow``) against the model: ``kv_len`` KV
        tokens matched, the device ``ids`` up to the usable state at ``hit``, whose KV and copied state
        hold their tokens' patterns. -> the match, or ``None`` when a copy found no T0 room (the model
        then took what the eviction for room left)."""
        c = self.cache
        req = CacheReq(token_ids=toks, kv_indices=torch.empty(0, dtype=torch.int64))
        room = c.states.available_size() > 0
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(toks, salt), cow_mamba=cow, req=req))
        if cow and hit and not room:
            self.adopt()
            if req.mamba_pool_idx is None:
                assert len(m.device_indices) == 0
                return None
        assert m.kv_hit_length == kv_len and m.device_indices.tolist() == ids
        if hit:
            check_kv(c, m.device_indices, toks[:hit], salt)
        if cow and hit:
            got = c.states.temporal_view_all()[:, c.states.translate(req.mamba_pool_idx)[0]]
            assert torch.equal(got, state_pattern(toks[:hit], salt)[0])
            c.states.free(req.mamba_pool_idx)
        return m

    def teardown(self):
        if self.cache is None:
            return
        while self.reqs:
            self.abort_request(0)
        self.drain()
        assert self.free_sets() == self.free0, "a slot leaked"
        self.check_cache([])

    # ------------------------------------------------------------------ rules
    @rule(toks=TOKENS, salt=SALTS)
    def insert(self, toks, salt):
        self.insert_written(toks, salt, lambda ids, res, room: self.model_insert(toks, salt, ids, 0, res, room))

    def insert_written(self, toks, salt, check, chunked: bool = False) -> None:
        """Insert ``toks`` from fresh pages and a fresh slot holding their patterns (nothing when the
        pools have no room), ``check(ids, result, t1_had_room)`` it, then free what the tree did not take."""
        c = self.cache
        ids = c.kv.alloc(-(-len(toks) // self.ps) * self.ps)
        slot = c.states.alloc(1)
        if ids is None or slot is None:
            for x in (ids, slot):
                if x is not None:
                    (c.kv if x is ids else c.states).free(x)
            return
        write_kv(c, ids, toks, salt)
        write_state(c, slot, toks, salt)
        room = self.t1_room(toks, salt)
        res = c.insert(InsertParams(key=RadixKey(toks, salt), value=ids[:len(toks)], mamba_value=slot,
                                    chunked=chunked))
        check(ids, res, room)
        if ids[res.cached_len:].numel():
            c.kv.free(ids[res.cached_len:])
        c.states.free(slot)

    @rule(toks=TOKENS, salt=SALTS)
    @precondition(lambda self: len(self.reqs) < 3)
    def start_request(self, toks, salt):
        c = self.cache
        req = CacheReq(token_ids=list(toks), kv_indices=torch.empty(0, dtype=torch.int64), extra_key=salt)
        _, hit, ids = self.expect_match(toks, salt)
        room = c.states.available_size() > 0
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(toks, salt), cow_mamba=True, req=req))
        if hit and not room:
            self.adopt()
            _, hit, ids = self.expect_match(toks, salt)
        if req.mamba_pool_idx is None:
            hit, ids = 0, []
            req.mamba_pool_idx = c.states.alloc(1)
            if req.mamba_pool_idx is None:
                return
        assert m.device_indices.tolist() == ids
        c.inc_lock_ref(m.last_device_node)
        req.last_node, req.cache_protected_len = m.last_device_node, hit
        req.kv_indices = m.device_indices
        self.reqs.append({"req": req, "toks": list(toks), "salt": salt, "hit": hit})

    @rule(i=st.integers(0, 2), extra=TOKENS)
    @precondition(lambda self: self.reqs)
    def finish_request(self, i, extra):
        c = self.cache
        r = self.reqs.pop(i % len(self.reqs))
        req, toks, salt, hit = r["req"], r["toks"] + extra, r["salt"], r["hit"]
        own = -(-(len(toks) - hit) // self.ps) * self.ps
        ids = c.kv.alloc(own) if own else torch.empty(0, dtype=torch.int64)
        if ids is None:
            self.reqs.append(r)
            return self.abort_request(len(self.reqs) - 1)
        req.token_ids, req.kv_indices = toks, torch.cat([req.kv_indices, ids])
        write_kv(c, req.kv_indices, toks, salt)  # rewrites the shared prefix with the same pattern
        write_state(c, req.mamba_pool_idx, toks, salt)
        self.finish(req, toks, salt)
        assert req.last_node is None and req.mamba_pool_idx is None

    @rule(i=st.integers(0, 2))
    @precondition(lambda self: self.reqs)
    def abort_request(self, i):
        r = self.reqs.pop(i % len(self.reqs))
        self.cache.dec_lock_ref(r["req"].last_node)
        self.cache.states.free(r["req"].mamba_pool_idx)
        self.adopt()  # an unlocked tombstone leaf goes with its last lock
