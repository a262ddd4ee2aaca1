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

from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from tests.radix import test_radix_stateful as plain  # the module, not its TestCase: collected once
from tests.support.radix_util import KV_SPEC, STATE_SPEC
from tests.support.stateful import SALTS, TOKENS, machine_settings
from tiered_cache.config import EVICTION_POLICIES, CacheConfig
from tiered_cache.stack import TieredCache


class PolicyMachine(plain.RadixMachine):
    """The plain machine (its model, rules and invariants) over a cache with ``policy`` and leaf + branch
    admission, plus inserts of prefill chunks."""

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

    def branch(self, toks, salt):
        """The cached path goes on past ``toks``: some cached page extends it."""
        n = len(toks)
        return any(s == salt and len(p) > n and p[:n] == tuple(toks) for s, p in self.kv)

    @rule(toks=TOKENS, salt=SALTS)
    def chunk_insert(self, toks, salt):
        """A prefill chunk's state: kept at a branch point only (leaf_branch); else nothing new is cached."""
        admitted = self.branch(toks, salt)

        def check(ids, res, room):
            if admitted:
                self.model_insert(toks, salt, ids, 0, res, room)
                return
            assert not res.mamba_stored
            L, _, _ = self.expect_match(toks, salt)
            assert res.cached_len <= max(L, len(toks) // self.ps * self.ps)
            self.adopt()

        self.insert_written(toks, salt, check, chunked=True)


def _machine(name: str):
    cls = type(f"PolicyMachine_{name}", (PolicyMachine,), {"policy": name})
    cls.TestCase.settings = machine_settings()
    return cls.TestCase


TestLRU, TestMarconi, TestSegLen, TestTiered = (_machine(n) for n in EVICTION_POLICIES)
