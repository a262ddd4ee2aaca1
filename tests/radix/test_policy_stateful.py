"""Every eviction policy (and the leaf + branch admission) driven against the tree's invariants (issue 23).

The same random operations as the plain radix machine (inserts, requests started / finished / aborted,
matches, evictions, resets) plus inserts of prefill chunks (``chunked``: admitted only at branch
points), on a real cache (CPU, lossless T1) whose policy is each of ``EVICTION_POLICIES``. The model is
the cached KV (prefix -> ids) and the set of prefixes with a state: inserts with T1 room and matches are
predicted exactly; an eviction is checked by its contract (only unlocked entries go, the counts agree)
and the model adopts what is left, whichever victims the policy chose. After every step:
``check_invariants`` (every node in exactly the candidate sets it belongs to), tree == model, cached KV
and states hold their tokens' patterns; at the end everything is drained and no slot leaked.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from tests.support.radix_util import KV_SPEC, STATE_SPEC, prefix_hashes, state_pattern, write_kv, write_state
from tests.support.stateful import SALTS, TOKENS, CacheMachine, k0, machine_settings, walk
from tiered_cache.config import EVICTION_POLICIES, CacheConfig
from tiered_cache.radix import EvictParams, InsertParams, RadixKey
from tiered_cache.stack import TieredCache


def tree_contents(cache):
    ps = cache.page_size
    kv, states = {}, set()
    for x, salt, pre in walk(cache):
        ids = x.value.tolist()
        for j in range(0, len(x.key), ps):
            kv[(salt, pre + tuple(x.key[:j + ps]))] = tuple(ids[j:j + ps])
        if x.payload.mamba_value is not None:
            states.add((salt, pre + tuple(x.key)))
    return kv, states


class PolicyMachine(CacheMachine):
    policy = "lru"

    @initialize(ps=st.sampled_from([1, 2]))
    def init(self, ps):
        self.ps = ps
        cfg = CacheConfig(page_size=ps, kv_pages=24 // ps, t0_states=3, t1_states=5, codec="lossless",
                          eviction_policy=self.policy, cost_model="marconi-7b", state_admission="leaf_branch",
                          check_memory=False, backend="torch")
        self.cache = TieredCache.build(cfg, kv=KV_SPEC, state=STATE_SPEC, device="cpu").tree
        assert type(self.cache.tree.policy).__name__ != "CountingLRUPolicy" or self.policy == "lru"
        self.free0 = self.free_sets()
        self.kv, self.states = {}, set()
        self.reqs = []

    # ------------------------------------------------------------------ model
    def expect_match(self, toks, salt):
        ps, n = self.ps, len(toks) // self.ps * self.ps
        L = 0
        while L + ps <= n and (salt, tuple(toks[:L + ps])) in self.kv:
            L += ps
        hit = max([p for p in range(ps, L + 1, ps) if (salt, tuple(toks[:p])) in self.states], default=0)
        return L, hit, [i for p in range(ps, hit + 1, ps) for i in self.kv[(salt, tuple(toks[:p]))]]

    def add_kv(self, toks, salt, start, end, ids):
        for p in range(start + self.ps, end + 1, self.ps):
            self.kv[(salt, tuple(toks[:p]))] = tuple(int(i) for i in ids[p - self.ps:p])

    def adopt(self, new=None):
        kv, states = tree_contents(self.cache)
        extra_kv = {k: v for k, v in kv.items() if self.kv.get(k) != v}
        extra_states = states - self.states
        if new is not None:
            toks, salt, ids = new
            for (s, p), page in extra_kv.items():
                assert s == salt and p == tuple(toks[:len(p)]), "an insert added KV of other tokens"
                assert page == tuple(int(i) for i in ids[len(p) - self.ps:len(p)]), "an insert took other ids"
            assert extra_states <= {(salt, tuple(toks))}, "an insert added a state elsewhere"
        else:
            assert not extra_kv, "an eviction changed or invented KV"
            assert not extra_states, "an eviction invented a state"
        for r in self.reqs:
            for p in range(self.ps, r["hit"] + 1, self.ps):
                assert (r["salt"], tuple(r["toks"][:p])) in kv, "a locked prefix was evicted"
            if r["hit"]:
                assert (r["salt"], tuple(r["toks"][:r["hit"]])) in states, "a locked state was evicted"
        self.kv, self.states = kv, states

    def model_insert(self, toks, salt, ids, prev, res, t1_had_room):
        ps, n = self.ps, len(toks)
        aligned = n // ps * ps
        L, _, _ = self.expect_match(toks, salt)
        if not t1_had_room:
            return self.adopt((toks, salt, ids.tolist()))
        if aligned == 0:
            assert (res.prefix_len, res.cached_len) == (0, 0)
            return
        assert res.prefix_len == L, (res, L)
        key = (salt, tuple(toks))
        if aligned == n and key in self.states:
            assert res.mamba_exist and res.cached_len == n and not res.mamba_stored
        elif aligned == n:
            assert res.mamba_stored and res.cached_len == n
            self.add_kv(toks, salt, L, n, ids.tolist())
            self.states.add(key)
        else:
            assert res.cached_len == L and not res.mamba_stored

    def finish(self, req, toks, salt):
        room = self.t1_room(toks, salt)
        L, _, _ = self.expect_match(toks, salt)
        aligned = len(toks) // self.ps * self.ps
        self.cache.cache_finished_req(req)
        if not room:
            self.adopt((toks, salt, req.kv_indices.tolist()))
        elif aligned == len(toks) and aligned:
            self.add_kv(toks, salt, L, aligned, req.kv_indices.tolist())
            self.states.add((salt, tuple(toks)))

    def branch(self, toks, salt):
        """The cached path goes on past ``toks``: some cached page extends it."""
        n = len(toks)
        return any(s == salt and len(p) > n and p[:n] == tuple(toks) for s, p in self.kv)

    # ------------------------------------------------------------------ rules
    @rule(toks=TOKENS, salt=SALTS)
    def chunk_insert(self, toks, salt):
        """A prefill chunk's state: kept at a branch point only (leaf_branch); else nothing new is cached."""
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
        admitted = self.branch(toks, salt)
        room = self.t1_room(toks, salt)
        res = c.insert(InsertParams(key=RadixKey(toks, salt), value=ids[:len(toks)], mamba_value=slot, chunked=True))
        if admitted:
            self.model_insert(toks, salt, ids, 0, res, room)
        else:
            assert not res.mamba_stored
            L, _, _ = self.expect_match(toks, salt)
            assert res.cached_len <= max(L, len(toks) // self.ps * self.ps)
            self.adopt()
        if ids[res.cached_len:].numel():
            c.kv.free(ids[res.cached_len:])
        c.states.free(slot)

    @rule(toks=TOKENS, salt=SALTS, cow=st.booleans())
    def match(self, toks, salt, cow):
        L, hit, ids = self.expect_match(toks, salt)
        m = self.match_checked(toks, salt, cow, L, hit, ids)
        if m is not None:
            assert (m.last_device_node is self.cache.root) == (hit == 0)

    @rule(n=st.integers(0, 6), m=st.integers(0, 3))
    def evict(self, n, m):
        c = self.cache
        before_tok, states_before = len(self.kv) * self.ps, len(self.states)
        r = c.evict(EvictParams(num_tokens=n, mamba_num=m))
        self.adopt()
        assert r.num_tokens_evicted == before_tok - len(self.kv) * self.ps
        assert r.mamba_num_evicted == states_before - len(self.states)
        if r.num_tokens_evicted < n and m == 0:
            assert c.full_evictable_size() == 0
        if r.mamba_num_evicted < m:
            assert c.mamba_evictable_size() == 0

    @rule()
    def reset(self):
        while self.reqs:
            self.abort_request(0)
        self.cache.reset()
        self.kv, self.states = {}, set()

    @invariant()
    def consistent(self):
        c = self.cache
        if c is None:
            return
        self.check_cache([r["req"].mamba_pool_idx for r in self.reqs])
        kv, states = tree_contents(c)
        assert kv == self.kv and states == self.states, "tree and model disagree"
        if kv:
            ids, want = [], []
            for (s, p), page in kv.items():
                ids.extend(page)
                want.extend(float(h) for h in prefix_hashes(p, s)[-self.ps:])
            assert torch.equal(k0(c.kv, ids, self.ps), torch.tensor(want)), "cached KV content changed"
        for x, salt, pre in walk(c):
            if x.payload.mamba_value is not None:
                want_t = state_pattern(list(pre + tuple(x.key)), salt)[0]
                assert torch.equal(c.ckpt.data[:, int(x.payload.mamba_value)], want_t), "cached state content changed"

    def drain(self):
        c = self.cache
        c.evict(EvictParams(num_tokens=10 ** 6, mamba_num=10 ** 6))
        assert c.total_size() == (0, 0) and not c.root.children


def _machine(name: str):
    cls = type(f"PolicyMachine_{name}", (PolicyMachine,), {"policy": name})
    cls.TestCase.settings = machine_settings()
    return cls.TestCase


TestLRU, TestMarconi, TestSegLen, TestTiered = (_machine(n) for n in EVICTION_POLICIES)
