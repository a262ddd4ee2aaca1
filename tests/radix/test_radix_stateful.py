"""Random operations on HiMambaRadixCache (real pools, CPU, lossless T1) against a plain Python model.

The model is two dicts: ``kv[(salt, prefix)]`` = the KV id of the prefix's last token, and the set of
``(salt, prefix)`` with a cached state. Operations whose outcome the model predicts exactly (inserts
with T1 room, matches) are checked exactly; evictions are checked by their contract (only unlocked
entries go, counts agree, the tree stays prefix-closed) and the model then adopts what is left.
After every step: ``check_invariants`` with the requests' slots, tree == model, every cached token's
K and every cached state equal the pattern derived from its tokens. At the end everything is drained
and every pool is back to its initial free set.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from tests.support.radix_util import make_cache, prefix_hashes, state_pattern
from tests.support.stateful import SALTS, TOKENS, CacheMachine, k0, machine_settings, walk
from tiered_cache.radix import EvictParams, InsertParams


def tree_contents(cache):
    """-> ({(salt, prefix ending a page): ids of that page}, {(salt, prefix)}) read from the nodes."""
    ps = cache.page_size
    kv, states = {}, set()
    for x, salt, pre in walk(cache):
        ids = x.value.tolist()
        for j in range(0, len(x.key), ps):
            kv[(salt, pre + tuple(x.key[:j + ps]))] = tuple(ids[j:j + ps])
        if x.payload.mamba_value is not None:
            states.add((salt, pre + tuple(x.key)))
    return kv, states


class RadixMachine(CacheMachine):
    @initialize(ps=st.sampled_from([1, 2]))
    def init(self, ps):
        self.ps = ps
        self.cache = make_cache(page_size=ps, kv_pages=24 // ps, states=3, t1_slots=5, codec="lossless")
        self.free0 = self.free_sets()
        self.kv, self.states = {}, set()
        self.reqs = []

    # ------------------------------------------------------------------ model helpers
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
        """Take what the tree holds after an eviction: a subset of the model, locked prefixes kept.

        ``new = (toks, salt, ids)``: an insert that evicted for room may also have added pages of
        ``toks`` with the caller's ``ids`` and the state at ``toks``."""
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
            self.adopt((toks, salt, ids.tolist()))
            return
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

    # ------------------------------------------------------------------ rules
    @rule(toks=TOKENS, salt=SALTS, cow=st.booleans())
    def match(self, toks, salt, cow):
        L, hit, ids = self.expect_match(toks, salt)
        m = self.match_checked(toks, salt, cow, L, hit, ids)
        if m is not None:
            assert (m.last_device_node is self.cache.root) == (hit == 0)

    @rule(n=st.integers(0, 6), m=st.integers(0, 3))
    def evict(self, n, m):
        c = self.cache
        before_tok = len(self.kv) * self.ps
        r = c.evict(EvictParams(num_tokens=n, mamba_num=m))
        states_before = len(self.states)
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

    @rule(which=st.integers(0, 4))
    def bad_input(self, which):
        c = self.cache
        calls = [
            lambda: c.insert(InsertParams(key=[1, 2], value=torch.tensor([1]))),
            lambda: c.insert(InsertParams(key=[1, 2], value=torch.tensor([1, 2], dtype=torch.int32))),
            lambda: c.dec_lock_ref(make_cache().root),
            lambda: c.evict(EvictParams(mamba_num=-2)),
            lambda: c.insert(InsertParams(key=[3] * self.ps,  # a free page: not the caller's
                                          value=torch.arange(self.ps) + (c.kv.capacity - 1) * self.ps)),
        ]
        self.refused_unchanged(calls[which], lambda: (tree_contents(c), c.total_size(), c.kv.available_size(),
                                                      c.ckpt.available_size()))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        c = self.cache
        if c is None:
            return
        self.check_cache([r["req"].mamba_pool_idx for r in self.reqs])
        kv, states = tree_contents(c)
        assert kv == self.kv and states == self.states, "tree and model disagree"
        if kv:  # every cached token's K is its prefix's pattern
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


RadixMachine.TestCase.settings = machine_settings()
TestRadixStateful = RadixMachine.TestCase
