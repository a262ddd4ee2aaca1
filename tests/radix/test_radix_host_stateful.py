"""The radix stateful test with the host tier: HiMambaRadixCache over T0, T1 and T2 (real pools, CPU,
lossless T1, tiny host regions so host eviction runs often).

The shared rules (``tests/support/stateful.CacheMachine``: insert, requests), its own match, evict,
reset and bad input, and on top: grow, demote (device and T1 eviction cascading to the host), host
eviction, load back, finish-transfer and corrupt-host-entry. The model is what the tree holds, read
back after every step and checked against what each operation may change: device ids never change
under a prefix except to ids an insert gave or a load returned; nothing is invented; locked prefixes
stay on the device. Matches are predicted exactly from the model (device part, host part, best node).
After every step: ``check_invariants``, and every device page, T1 state, host page and host state
holds the pattern of its tokens, except host slots a rule corrupted. A corrupted entry must be caught
when loaded (the load is not ``ok`` and the entry leaves the tree); an ``ok`` load is checked byte for
byte. Drained at the end: every pool of every tier back to its initial free set.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from tests.support.host_tier import bad_entries, check_host_k, corrupt, start_load_back
from tests.support.radix_util import check_kv, make_hi_cache, prefix_hashes, state_pattern
from tests.support.stateful import SALTS, TOKENS, CacheMachine, k0, machine_settings, walk
from tiered_cache.radix import EvictParams, InitLoadBackParams, InsertParams


def host_regions(c) -> dict:
    return {"kv": c.kv_region, "state": c.state_region}


def hi_contents(cache):
    """-> ({(salt, page prefix): (device ids | None, host slot | None)}, {(salt, prefix): (in T1, in T2)},
    {(salt, prefix): node at that prefix's end}). Dead nodes hold nothing and are left out."""
    ps = cache.page_size
    kv, states, nodes = {}, {}, {}
    for x, salt, pre in walk(cache):
        full = pre + tuple(x.key)
        if x.value is None and x.host_kv is None:
            continue
        ids = None if x.value is None else x.value.tolist()
        for j in range(0, len(x.key), ps):
            kv[(salt, pre + tuple(x.key[:j + ps]))] = (None if ids is None else tuple(ids[j:j + ps]),
                                                       None if x.host_kv is None else x.host_kv[j // ps])
        if x.payload.mamba_value is not None or x.payload.state_host is not None:
            states[(salt, full)] = (x.payload.mamba_value is not None, x.payload.state_host is not None)
        nodes[(salt, full)] = x
    return kv, states, nodes


class HiRadixMachine(CacheMachine):
    @initialize(ps=st.sampled_from([1, 2]), policy=st.sampled_from(["write_through", "write_through", "write_back",
                                                                     "write_through_selective"]))
    def init(self, ps, policy):
        self.ps = ps
        self.cache = make_hi_cache(page_size=ps, kv_pages=24 // ps, states=3, t1_slots=5, codec="lossless",
                                   host_pages=16 // ps, host_states=3, write_policy=policy, write_through_threshold=2)
        c = self.cache
        self.free0 = self.free_sets()
        self.kv, self.states, _ = hi_contents(c)
        self.reqs, self.loads, self.finished = [], [], []
        self.checked = []  # failed loads' handles whose corrupt entries were seen to leave
        apply = c.host_tier.loads.apply_load

        def apply_and_check(op):
            """A failed load drops its corrupt host entries: checked the moment the cache applies it
            (later, a freed slot may hold another entry, which a later rule may corrupt in turn)."""
            apply(op)
            if op.handle is None or op.handle.ok:
                return
            ld = next((x for x in self.loads if x["req"].load_back is op.handle), None)
            bad = ld["bad"] if ld is not None else bad_entries(op.tickets, host_regions(c))  # (in init_load_back)
            _, _, nodes = hi_contents(c)
            owned = {(id(c.kv_region), h) for x in nodes.values() for h in (x.host_kv or [])}
            owned |= {(id(c.state_region), x.payload.state_host) for x in nodes.values()
                      if x.payload.state_host is not None}
            for region, slot in bad:  # the corrupt entry left the tree (or was written again)
                assert (id(region), slot) not in owned or not corrupt(region, slot), "a corrupt entry stayed"
            self.checked.append(op.handle)

        c.host_tier.loads.apply_load = apply_and_check

    # ------------------------------------------------------------------ model
    def expect_match(self, toks, salt):
        return self.expect_full(toks, salt)[:3]

    def expect_full(self, toks, salt):
        """-> (KV tokens matched in any tier, usable device depth, its ids, best depth, state at best in T2 only)."""
        ps, n = self.ps, len(toks) // self.ps * self.ps
        L = dev_l = 0
        on_dev = True
        while L + ps <= n and (salt, tuple(toks[:L + ps])) in self.kv:
            L += ps
            if self.kv[(salt, tuple(toks[:L]))][0] is None:
                on_dev = False
            elif on_dev:
                dev_l = L
        at = [p for p in range(ps, L + 1, ps) if (salt, tuple(toks[:p])) in self.states]
        best = max(at, default=0)
        dev = max([p for p in at if p <= dev_l and self.states[(salt, tuple(toks[:p]))][0]], default=0)
        ids = [i for p in range(ps, dev + 1, ps) for i in self.kv[(salt, tuple(toks[:p]))][0]]
        host_state = best > dev and not self.states[(salt, tuple(toks[:best]))][0]
        return L, dev, ids, best, host_state

    def adopt(self, new=None):
        """Take what the tree holds; check it against what the step may have changed."""
        kv, states, _ = hi_contents(self.cache)
        allowed = set()
        if new is not None:
            toks, salt, ids = new
            for p in range(self.ps, len(toks) + 1, self.ps):
                allowed.add(((salt, tuple(toks[:p])), tuple(int(i) for i in ids[p - self.ps:p])))
        for ld in self.loads + self.finished:
            for p in range(self.ps, len(ld["toks"]) + 1, self.ps):
                allowed.add(((ld["salt"], tuple(ld["toks"][:p])), tuple(ld["all"][p - self.ps:p])))
        for k, (dev, _host) in kv.items():
            old = self.kv.get(k)
            if old is None:
                assert (k, dev) in allowed or dev is None and new is not None, f"KV invented at {k}"
            elif dev is not None and dev != old[0]:
                assert (k, dev) in allowed, f"device ids changed at {k}: {old[0]} -> {dev}"
        for k in states:
            if k not in self.states:
                assert new is not None and k == (new[1], tuple(new[0])), f"a state was invented at {k}"
        for r in self.reqs:
            for p in range(self.ps, r["hit"] + 1, self.ps):
                k = (r["salt"], tuple(r["toks"][:p]))
                assert k in kv and kv[k][0] is not None, "a locked prefix left the device"
            if r["hit"]:
                assert states.get((r["salt"], tuple(r["toks"][:r["hit"]])), (False,))[0], "a locked state left T1"
        self.kv, self.states = kv, states
        self.finished = []

    def model_insert(self, toks, salt, ids, prev, res, t1_had_room):
        L = 0
        while L + self.ps <= len(toks) and self.kv.get((salt, tuple(toks[:L + self.ps])), (None,))[0] is not None:
            L += self.ps
        if t1_had_room and len(toks) >= self.ps and not self.loads:  # (an insert settles loads on its path)
            assert res.prefix_len == L, (res, L)
        self.adopt((toks, salt, ids.tolist()))
        if t1_had_room and toks and len(toks) % self.ps == 0:
            assert (salt, tuple(toks)) in self.states, "an insert with T1 room did not cache its state"

    def finish(self, req, toks, salt):
        self.cache.cache_finished_req(req)
        self.adopt((toks, salt, req.kv_indices.tolist()))

    # ------------------------------------------------------------------ rules (overrides)
    @rule(toks=TOKENS, salt=SALTS, cow=st.booleans())
    def match(self, toks, salt, cow):
        L, dev, ids, best, host_state = self.expect_full(toks, salt)
        m = self.match_checked(toks, salt, cow, L, dev, ids)
        if m is None:
            return
        assert (m.host_hit_length, m.mamba_host_hit_length) == (best - dev, int(host_state)), (m, best, dev)
        self.adopt()  # write_through_selective may have started a backup

    @rule(n=st.integers(0, 6), m=st.integers(0, 3))
    def evict(self, n, m):
        c = self.cache
        dev_before = sum(1 for d, _ in self.kv.values() if d is not None) * self.ps
        t1_before = sum(1 for t1, _ in self.states.values() if t1)
        r = c.evict(EvictParams(num_tokens=n, mamba_num=m))
        self.adopt()
        assert r.num_tokens_evicted == dev_before - sum(1 for d, _ in self.kv.values() if d is not None) * self.ps
        assert r.mamba_num_evicted == t1_before - sum(1 for t1, _ in self.states.values() if t1)
        if r.num_tokens_evicted < n and m == 0:
            assert c.full_evictable_size() == 0 or c.engine.pending
        if r.mamba_num_evicted < m:
            assert c.mamba_evictable_size() == 0 or any(x.tickets for x in hi_contents(c)[2].values())

    @rule(go=st.integers(0, 4))
    def reset(self, go=0):
        if go:  # rarely: a reset empties the tree the other rules need
            return
        while self.reqs:
            self.abort_request(0)
        self.cache.reset()
        for ld in self.loads:
            assert ld["req"].load_back.done  # not ok, unless it had finished before
            self.cache.states.free(ld["req"].mamba_pool_idx)
        self.loads, self.finished = [], []
        self.kv, self.states, _ = hi_contents(self.cache)

    @rule(toks=TOKENS, salt=SALTS)
    @precondition(lambda self: len(self.reqs) < 3)
    def start_request(self, toks, salt):
        super().start_request(toks, salt)
        self.adopt()  # write_through_selective may have started a backup (evicting host entries)

    @rule(which=st.integers(0, 4))
    def bad_input(self, which):
        c = self.cache
        calls = [
            lambda: c.insert(InsertParams(key=[1, 2], value=torch.tensor([1]))),
            lambda: c.init_load_back(InitLoadBackParams(c.root, -1)),
            lambda: c.evict(EvictParams(host_num_tokens=-2)),
            lambda: c.evict(EvictParams(mamba_num=-2)),
            lambda: c.insert(InsertParams(key=[3] * self.ps,  # a free page: not the caller's
                                          value=torch.arange(self.ps) + (c.kv.capacity - 1) * self.ps)),
        ]
        self.refused_unchanged(calls[which], lambda: (hi_contents(c)[:2], c.total_size(), c.kv.available_size(),
                                                      c.ckpt.available_size()))

    @rule(data=st.data(), extra=TOKENS)
    def grow(self, data, extra):
        """Insert a cached prefix (any tier) plus more tokens: revives host-only nodes, splits, deepens."""
        keys = sorted(hi_contents(self.cache)[2], key=repr)
        if not keys:
            return
        salt, full = data.draw(st.sampled_from(keys))
        cut = data.draw(st.integers(0, len(full)))
        self.insert(list(full[:cut]) + extra, salt)

    # ------------------------------------------------------------------ rules (host tier)
    @rule(n=st.integers(0, 6), m=st.integers(0, 2))
    def evict_host(self, n, m):
        r = self.cache.evict(EvictParams(host_num_tokens=n, host_mamba_num=m))
        self.adopt()
        assert r.host_num_tokens_evicted >= min(n, 1) or not self.cache.policy.size("kv_host")

    @rule(n=st.integers(1, 8), m=st.integers(0, 2))
    def demote(self, n, m):
        """Backups land, then device KV and T1 states are evicted: what is backed up moves to T2."""
        self.cache.check_hicache_events()
        self.finish_loads()
        self.adopt()
        self.evict(n, m)

    @rule(data=st.data(), toks=TOKENS, salt=SALTS, lock=st.booleans())
    @precondition(lambda self: len(self.loads) < 2)
    def load_back(self, data, toks, salt, lock):
        c = self.cache
        lb = start_load_back(self, data, toks, salt, hi_contents(c)[2], extra=1)
        if lb is None:
            return
        m, toks, salt, req, ids, node = lb
        if not len(ids):
            assert node is m.last_device_node and getattr(req, "load_back", None) is None
            if req.mamba_pool_idx is not None:
                c.states.free(req.mamba_pool_idx)
            self.adopt()
            return
        depth = len(m.device_indices) + len(ids)
        if lock:
            c.inc_lock_ref(node)
        h = req.load_back
        self.loads.append({"req": req, "toks": list(toks[:depth]), "salt": salt, "node": node if lock else None,
                           "all": torch.cat([m.device_indices, ids]).tolist(),
                           "bad": bad_entries(h.tickets, host_regions(c))})
        self.adopt()

    @rule()
    def finish_transfer(self):
        c = self.cache
        c.check_hicache_events()
        self.finish_loads()
        self.adopt()

    def finish_loads(self):
        c = self.cache
        left = []
        for ld in self.loads:
            h = ld["req"].load_back
            if not h.done:
                left.append(ld)
                continue
            if h.ok:  # served: every byte is what was cached for these tokens
                assert not ld["bad"], "a load of a corrupted host entry was served"
                kv = hi_contents(c)[0]
                held = ld["node"] is not None or all(  # unlocked: only while the tree still holds the pages
                    kv.get((ld["salt"], tuple(ld["toks"][:p])), (None,))[0] == tuple(ld["all"][p - self.ps:p])
                    for p in range(self.ps, len(ld["toks"]) + 1, self.ps))
                if held:
                    check_kv(c, torch.tensor(ld["all"]), ld["toks"], ld["salt"])
                got = c.states.temporal_view_all()[:, c.states.translate(ld["req"].mamba_pool_idx)[0]]
                assert torch.equal(got, state_pattern(ld["toks"], ld["salt"])[0]), "a loaded state differs"
            else:
                assert ld["bad"], "a load failed without a corrupted entry"
                assert any(x is h for x in self.checked), "a failed load was not applied by the cache"
            if ld["node"] is not None:
                c.dec_lock_ref(ld["node"])
            c.states.free(ld["req"].mamba_pool_idx)
            self.finished.append(ld)
        self.loads = left

    @rule(data=st.data(), which=st.sampled_from(["kv", "state"]))
    def corrupt_host_entry(self, data, which):
        c = self.cache
        region = c.kv_region if which == "kv" else c.state_region
        # Entries may be hit again: the 64-bit weighted checksum catches any two flips (a flip undone
        # by a second one on the same bit leaves the entry intact, and corrupt() says so).
        held = [s for s in region.allocator.allocated_ids() if region.valid[s]]
        if not held:
            return
        s = data.draw(st.sampled_from(held))
        region.flip_bit(s, data.draw(st.integers(0, region.slot_bytes - 1)), data.draw(st.integers(0, 7)))

    # ------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        c = self.cache
        if c is None:
            return
        self.check_cache([r["req"].mamba_pool_idx for r in self.reqs] + [ld["req"].mamba_pool_idx for ld in self.loads])
        kv, states, nodes = hi_contents(c)
        assert kv == self.kv and states == self.states, "tree and model disagree"
        ps = self.ps
        dev_ids, want, host_bytes = [], [], []
        for (s, p), (dev, host) in kv.items():
            h = [float(v) for v in prefix_hashes(p, s)[-ps:]]
            if dev is not None:
                dev_ids.extend(dev)
                want.extend(h)
            if host is not None and not corrupt(c.kv_region, host):
                host_bytes.append((host, h))
        if dev_ids:
            assert torch.equal(k0(c.kv, dev_ids, ps), torch.tensor(want)), "cached KV content changed"
        k_off = c.kv.spec.field_offsets(ps)
        for host, h in host_bytes:  # K of every layer of a host page: the prefix pattern + layer
            check_host_k(c.kv_region, host, k_off, ps, torch.tensor(h))
        data = c.ckpt.field("data")
        for (s, full), x in nodes.items():
            if x.payload.mamba_value is None and x.payload.state_host is None:
                continue
            want_t = state_pattern(list(full), s)[0]
            if x.payload.mamba_value is not None:
                assert torch.equal(c.ckpt.data[:, int(x.payload.mamba_value)], want_t), "cached state content changed"
            if x.payload.state_host is not None and not corrupt(c.state_region, x.payload.state_host):
                raw = c.state_region.slot(x.payload.state_host)[data.offset:data.offset + data.nbytes]
                assert torch.equal(raw.view(torch.float32).view(want_t.shape), want_t), "host state changed"

    def free_sets(self):
        c = self.cache
        return super().free_sets() + (c.kv_region.available_size(), c.state_region.available_size())

    def drain(self):
        c = self.cache
        c.check_hicache_events()
        for t in list(c.engine.pending_tickets()):
            c.engine.wait(t)
        c.check_hicache_events()
        self.finish_loads()
        assert not self.loads
        for _ in range(4):
            c.evict(EvictParams(num_tokens=10 ** 6, mamba_num=10 ** 6))
            c.evict(EvictParams(host_num_tokens=10 ** 6, host_mamba_num=10 ** 6))
        assert c.total_size() == (0, 0) and not c.root.children, c.root.children


HiRadixMachine.TestCase.settings = machine_settings()
TestHiRadixStateful = HiRadixMachine.TestCase
