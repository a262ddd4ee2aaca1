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

import os

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support.radix_util import check_kv, make_cache, prefix_hashes, state_pattern, write_kv, write_state
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix import CacheReq, EvictParams, InsertParams, MatchPrefixParams, RadixKey

TOKENS = st.lists(st.integers(1, 3), min_size=0, max_size=7)
SALTS = st.sampled_from([None, None, "t"])


def tree_contents(cache):
    """-> ({(salt, prefix ending a page): ids of that page}, {(salt, prefix)}) read from the nodes."""
    ps = cache.page_size
    kv, states = {}, set()
    stack = [(c, (ck[0] if isinstance(ck, tuple) and isinstance(ck[0], str) else None), ())
             for ck, c in cache.root.children.items()]
    while stack:
        x, salt, pre = stack.pop()
        ids = x.value.tolist()
        for j in range(0, len(x.key), ps):
            kv[(salt, pre + tuple(x.key[:j + ps]))] = tuple(ids[j:j + ps])
        full = pre + tuple(x.key)
        if x.mamba_value is not None:
            states.add((salt, full))
        stack.extend((c, salt, full) for c in x.children.values())
    return kv, states


class RadixMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.reqs = []

    @initialize(ps=st.sampled_from([1, 2]))
    def init(self, ps):
        self.ps = ps
        self.cache = make_cache(page_size=ps, kv_pages=24 // ps, states=3, t1_slots=5, codec="lossless")
        self.free0 = (set(self.cache.kv.allocator._free_vids), set(self.cache.states.allocator._free_vids),
                      self.cache.ckpt.available_size())
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

    def t1_room(self, toks, salt):
        ps = self.ps
        if len(toks) % ps or not toks or (salt, tuple(toks)) in self.states:
            return True
        return self.cache.ckpt.available_size() > 0

    # ------------------------------------------------------------------ rules
    @rule(toks=TOKENS, salt=SALTS)
    def insert(self, toks, salt):
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
        res = c.insert(InsertParams(key=RadixKey(toks, salt), value=ids[:len(toks)], mamba_value=slot))
        self.model_insert(toks, salt, ids, 0, res, room)
        if ids[res.cached_len:].numel():
            c.kv.free(ids[res.cached_len:])
        c.states.free(slot)

    @rule(toks=TOKENS, salt=SALTS, cow=st.booleans())
    def match(self, toks, salt, cow):
        c = self.cache
        L, hit, ids = self.expect_match(toks, salt)
        req = CacheReq(token_ids=toks, kv_indices=torch.empty(0, dtype=torch.int64))
        room = c.states.available_size() > 0
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(toks, salt), cow_mamba=cow, req=req))
        if cow and hit and not room:
            self.adopt()
            if req.mamba_pool_idx is None:
                assert len(m.device_indices) == 0
                return
        assert m.kv_hit_length == L and m.device_indices.tolist() == ids
        assert (m.last_device_node is c.root) == (hit == 0)
        if hit:
            check_kv(c, m.device_indices, toks[:hit], salt)
        if cow and hit:
            got = c.states.temporal_view_all()[:, c.states.translate(req.mamba_pool_idx)[0]]
            assert torch.equal(got, state_pattern(toks[:hit], salt)[0])
            c.states.free(req.mamba_pool_idx)

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
        room = self.t1_room(toks, salt)
        L, _, _ = self.expect_match(toks, salt)
        aligned = len(toks) // self.ps * self.ps
        c.cache_finished_req(req)
        if not room:
            self.adopt((toks, salt, req.kv_indices.tolist()))
        elif aligned == len(toks) and aligned:
            self.add_kv(toks, salt, L, aligned, req.kv_indices.tolist())
            self.states.add((salt, tuple(toks)))
        assert req.last_node is None and req.mamba_pool_idx is None

    @rule(i=st.integers(0, 2))
    @precondition(lambda self: self.reqs)
    def abort_request(self, i):
        r = self.reqs.pop(i % len(self.reqs))
        self.cache.dec_lock_ref(r["req"].last_node)
        self.cache.states.free(r["req"].mamba_pool_idx)
        self.adopt()  # an unlocked tombstone leaf goes with its last lock

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
        before = (tree_contents(c), c.total_size(), c.kv.available_size(), c.ckpt.available_size())
        calls = [
            lambda: c.insert(InsertParams(key=[1, 2], value=torch.tensor([1]))),
            lambda: c.insert(InsertParams(key=[1, 2], value=torch.tensor([1, 2], dtype=torch.int32))),
            lambda: c.dec_lock_ref(make_cache().root),
            lambda: c.evict(EvictParams(mamba_num=-2)),
            lambda: c.insert(InsertParams(key=[3] * self.ps,  # a free page: not the caller's
                                          value=torch.arange(self.ps) + (c.kv.capacity - 1) * self.ps)),
        ]
        try:
            calls[which]()
            raise AssertionError("bad input accepted")
        except InvalidArgumentError:
            pass
        assert (tree_contents(c), c.total_size(), c.kv.available_size(), c.ckpt.available_size()) == before

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        c = self.cache
        if c is None:
            return
        slots = [r["req"].mamba_pool_idx for r in self.reqs]
        c.check_invariants(request_kv=torch.empty(0, dtype=torch.int64),
                           request_states=torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64))
        kv, states = tree_contents(c)
        assert kv == self.kv and states == self.states, "tree and model disagree"
        if kv:  # every cached token's K is its prefix's pattern
            ids, want = [], []
            for (s, p), page in kv.items():
                ids.extend(page)
                want.extend(float(h) for h in prefix_hashes(p, s)[-self.ps:])
            phys = c.kv.translate(torch.tensor(ids))
            got = c.kv.k_view_all()[0, phys // self.ps, phys % self.ps, 0, 0]
            assert torch.equal(got, torch.tensor(want)), "cached KV content changed"
        stack = list(c.root.children.values())
        pre = {id(x): tuple(x.key) for x in stack}
        while stack:
            x = stack.pop()
            if x.mamba_value is not None:
                full = pre[id(x)]
                salt = "t" if (("t", full[:self.ps] if self.ps > 1 else full[0]) in c.root.children
                               and _under_salt(c, x)) else None
                want_t = state_pattern(list(full), salt)[0]
                assert torch.equal(c.ckpt.data[:, int(x.mamba_value)], want_t), "cached state content changed"
            for ch in x.children.values():
                pre[id(ch)] = pre[id(x)] + tuple(ch.key)
                stack.append(ch)

    def teardown(self):
        c = self.cache
        if c is None:
            return
        while self.reqs:
            self.abort_request(0)
        c.evict(EvictParams(num_tokens=10 ** 6, mamba_num=10 ** 6))
        assert c.total_size() == (0, 0) and not c.root.children
        assert (set(c.kv.allocator._free_vids), set(c.states.allocator._free_vids),
                c.ckpt.available_size()) == self.free0, "a slot leaked"
        c.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


def _under_salt(cache, node):
    while node.parent is not cache.root:
        node = node.parent
    return isinstance(node.ck, tuple) and isinstance(node.ck[0], str)


# The floor: >= 200 examples x 100 steps in CI. RADIX_EXAMPLES raises it for a soak run;
# RADIX_NOSHRINK skips the database replay and shrinking (a fast soak).
RadixMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("RADIX_EXAMPLES", 200)), stateful_step_count=100, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=(Phase.explicit, Phase.generate) if os.environ.get("RADIX_NOSHRINK") else tuple(Phase))
TestRadixStateful = RadixMachine.TestCase
