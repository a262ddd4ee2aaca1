"""The radix stateful test in SWA mode: HiSWARadixCache over full + SWA KV (T0) and T2, real pools, CPU.

Rules: insert (with a random ``swa_evicted_seqlen``), match, lock / unlock, evict (full and SWA KV),
demote, host eviction, load back, finish-transfer, corrupt-host-entry, reset. The model is read back
from the tree after every step and checked against what the step may change; matches (device part,
host part, window cut-back) are predicted exactly from it. After every step: ``check_invariants`` and
every device and host page (full and SWA) holds its tokens' pattern, except host slots a rule
corrupted; a corrupted entry is never served. Drained at the end to every pool's initial free set.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support.host_tier import bad_entries, check_host_k, corrupt, start_load_back
from tests.support.radix_util import SWA_OFFSET, check_kv, check_swa, insert_swa, make_swa_cache, prefix_hashes
from tests.support.stateful import SALTS, k0, machine_settings, walk
from tiered_cache.radix import EvictParams, MatchPrefixParams, RadixKey

TOKENS = st.lists(st.integers(1, 3), min_size=0, max_size=8)  # one more than the Mamba machines: windows of 3
W = 3


def swa_contents(cache):
    """-> ({(salt, page prefix): (full ids, host slot, SWA ids, SWA host slot, tombstone)}, {(salt, prefix): node})."""
    ps = cache.page_size
    kv, nodes = {}, {}
    for x, salt, pre in walk(cache):
        full = pre + tuple(x.key)
        if x.value is None and x.host_kv is None:
            continue
        ids = None if x.value is None else x.value.tolist()
        sw = None if x.payload.swa_value is None else x.payload.swa_value.tolist()
        for j in range(0, len(x.key), ps):
            kv[(salt, pre + tuple(x.key[:j + ps]))] = (
                None if ids is None else tuple(ids[j:j + ps]), None if x.host_kv is None else x.host_kv[j // ps],
                None if sw is None else tuple(sw[j:j + ps]),
                None if x.payload.swa_host is None else x.payload.swa_host[j // ps],
                x.payload.swa_tomb)
        nodes[(salt, full)] = x
    return kv, nodes


class SWAMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None

    @initialize(ps=st.sampled_from([1, 2]), policy=st.sampled_from(["write_through", "write_back"]))
    def init(self, ps, policy):
        self.ps = ps
        self.cache = c = make_swa_cache(page_size=ps, window=W, full_pages=24 // ps, swa_pages=24 // ps,
                                        host_pages=16 // ps, host_swa_pages=12 // ps, write_policy=policy)
        self.free0 = (set(c.kv.allocator._free_vids), set(c.swa.allocator._free_vids),
                      c.kv_region.available_size(), c.swa_region.available_size())
        self.kv, self.nodes = swa_contents(c)
        self.locks, self.loads = [], []

    # ------------------------------------------------------------------ model
    def expect(self, toks, salt):
        """-> (KV tokens matched in any tier, usable device depth, its ids, best depth)."""
        ps, n = self.ps, len(toks) // self.ps * self.ps
        L = dev = best = run_any = run_dev = 0
        on_dev = True
        while L + ps <= n and (salt, tuple(toks[:L + ps])) in self.kv:
            L += ps
            ids, _, sw, _, tomb = self.kv[(salt, tuple(toks[:L]))]
            run_any = 0 if tomb else run_any + ps
            run_dev = run_dev + ps if sw is not None else 0
            on_dev = on_dev and ids is not None
            if (salt, tuple(toks[:L])) in self.nodes and run_any >= min(W, L):
                best = L
                if on_dev and run_dev >= min(W, L):
                    dev = L
        return L, dev, [i for p in range(ps, dev + 1, ps) for i in self.kv[(salt, tuple(toks[:p]))][0]], best

    def adopt(self, new=None):
        kv, nodes = swa_contents(self.cache)
        for k, (ids, _, _, _, _) in kv.items():
            old = self.kv.get(k)
            if old is not None and old[0] is not None and ids is not None:
                assert ids == old[0], f"device ids changed at {k}"
            if old is None:
                assert new is not None and k[0] == new[1] and k[1] == tuple(new[0][:len(k[1])]), f"KV invented at {k}"
        for _node, toks, salt in self.locks:
            for p in range(self.ps, len(toks) + 1, self.ps):
                k = (salt, tuple(toks[:p]))
                assert k in kv and kv[k][0] is not None, "a locked prefix left the device"
        self.kv, self.nodes = kv, nodes

    # ------------------------------------------------------------------ rules
    @rule(toks=TOKENS, salt=SALTS, ev=st.integers(0, 8))
    def insert(self, toks, salt, ev):
        c = self.cache
        L = 0
        while L + self.ps <= len(toks) and self.kv.get((salt, tuple(toks[:L + self.ps])), (None,))[0] is not None:
            L += self.ps
        res = insert_swa(c, list(toks), salt, evicted=min(ev, len(toks)))
        if res is None:
            return
        if not self.loads:
            assert res.prefix_len == L, (res, L)
        self.adopt((list(toks), salt))
        if res.cached_len:  # what it cached is on the device
            assert self.kv[(salt, tuple(toks[:res.cached_len]))][0] is not None

    @rule(toks=TOKENS, salt=SALTS)
    def match(self, toks, salt):
        c = self.cache
        L, dev, ids, best = self.expect(toks, salt)
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(toks, salt)))
        assert m.kv_hit_length == L and m.device_indices.tolist() == ids, (m, L, dev, ids)
        assert m.host_hit_length == best - dev
        if dev:
            check_kv(c, m.device_indices, toks[:dev], salt)
            check_swa(c, m.swa_device_indices, toks[:dev], salt, start=max(0, dev - W) // self.ps * self.ps)
        self.adopt()

    @rule(toks=TOKENS, salt=SALTS)
    @precondition(lambda self: len(self.locks) < 3)
    def lock(self, toks, salt):
        c = self.cache
        m = c.match_prefix(MatchPrefixParams(key=RadixKey(toks, salt)))
        if m.last_device_node is c.root:
            return
        c.inc_lock_ref(m.last_device_node)
        self.locks.append((m.last_device_node, list(toks[:len(m.device_indices)]), salt))

    @rule(i=st.integers(0, 2))
    @precondition(lambda self: self.locks)
    def unlock(self, i):
        node, _, _ = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)
        self.adopt()

    @rule(n=st.integers(0, 6), s=st.integers(0, 6))
    def evict(self, n, s):
        before = sum(1 for v in self.kv.values() if v[0] is not None) * self.ps
        r = self.cache.evict(EvictParams(num_tokens=n, swa_num_tokens=s))
        self.adopt()
        assert r.num_tokens_evicted == before - sum(1 for v in self.kv.values() if v[0] is not None) * self.ps

    @rule(n=st.integers(1, 8))
    def demote(self, n):
        self.cache.check_hicache_events()
        self.finish_loads()
        self.adopt()
        self.evict(n, 0)

    @rule(n=st.integers(0, 6))
    def evict_host(self, n):
        self.cache.evict(EvictParams(host_num_tokens=n))
        self.adopt()

    @rule(data=st.data(), toks=TOKENS, salt=SALTS)
    @precondition(lambda self: len(self.loads) < 2)
    def load_back(self, data, toks, salt):
        c = self.cache
        lb = start_load_back(self, data, toks, salt, self.nodes, extra=0)
        if lb is None or not len(lb.ids):
            return
        m, toks, salt, req, ids, node = lb
        h = req.load_back
        bad = bad_entries(h.tickets, {"kv": c.kv_region, "swa": c.swa_region})
        depth = len(m.device_indices) + len(ids)
        c.inc_lock_ref(node)  # as an engine does: it holds the prefix until it is done with it
        self.loads.append({"req": req, "node": node, "toks": list(toks[:depth]), "salt": salt, "bad": bad,
                           "all": torch.cat([m.device_indices, ids]), "swa": torch.cat([m.swa_device_indices,
                                                                                          h.swa_indices])})
        self.adopt()

    @rule()
    def finish_transfer(self):
        self.cache.check_hicache_events()
        self.finish_loads()
        self.adopt()

    def finish_loads(self):
        c, left = self.cache, []
        for ld in self.loads:
            h = ld["req"].load_back
            if not h.done:
                left.append(ld)
                continue
            if h.ok:
                assert not ld["bad"], "a load of a corrupted host entry was served"
                check_kv(c, ld["all"], ld["toks"], ld["salt"])
                d = len(ld["toks"])
                check_swa(c, ld["swa"], ld["toks"], ld["salt"], start=max(0, d - W) // self.ps * self.ps)
            else:
                assert ld["bad"], "a load failed without a corrupted entry"
            c.dec_lock_ref(ld["node"])
        self.loads = left

    @rule(data=st.data(), which=st.sampled_from(["kv", "swa"]))
    def corrupt_host_entry(self, data, which):
        c = self.cache
        region = c.kv_region if which == "kv" else c.swa_region
        held = [s for s in region.allocator.allocated_ids() if region.valid[s] and not corrupt(region, s)]
        if held:
            s = data.draw(st.sampled_from(held))
            region.flip_bit(s, data.draw(st.integers(0, region.slot_bytes - 1)), data.draw(st.integers(0, 7)))

    @rule(go=st.integers(0, 4))
    def reset(self, go):
        if go:
            return
        for node, _, _ in self.locks:
            self.cache.dec_lock_ref(node)
        self.locks, self.loads = [], []
        self.cache.reset()
        self.kv, self.nodes = swa_contents(self.cache)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        c = self.cache
        if c is None:
            return
        c.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))
        kv, _ = swa_contents(c)
        assert kv == self.kv, "tree and model disagree"
        ps = self.ps
        k_full, k_swa = c.kv.spec.field_offsets(ps), c.swa.spec.field_offsets(ps)
        for (s, p), (ids, host, sw, swh, _) in kv.items():
            h = torch.tensor([float(v) for v in prefix_hashes(p, s)[-ps:]])
            if ids is not None:
                assert torch.equal(k0(c.kv, ids, ps), h), "cached KV changed"
            if sw is not None:
                assert torch.equal(k0(c.swa, sw, ps), h + SWA_OFFSET), "SWA changed"
            for region, slot, offs, add in ((c.kv_region, host, k_full, 0.0), (c.swa_region, swh, k_swa, SWA_OFFSET)):
                if slot is not None and not corrupt(region, slot):
                    check_host_k(region, slot, offs, ps, h + add)

    def teardown(self):
        c = self.cache
        if c is None:
            return
        for t in list(c.engine.pending_tickets()):
            c.engine.wait(t)
        c.check_hicache_events()
        self.finish_loads()
        for node, _, _ in self.locks:
            c.dec_lock_ref(node)
        for _ in range(3):
            c.evict(EvictParams(num_tokens=10 ** 6, swa_num_tokens=10 ** 6, host_num_tokens=10 ** 6))
        assert not c.root.children and c.total_size()[0] == 0
        assert (set(c.kv.allocator._free_vids), set(c.swa.allocator._free_vids), c.kv_region.available_size(),
                c.swa_region.available_size()) == self.free0, "a slot leaked"
        c.check_invariants(request_kv=torch.empty(0, dtype=torch.int64), request_states=torch.empty(0))


SWAMachine.TestCase.settings = machine_settings()
TestSWAStateful = SWAMachine.TestCase
