"""T0 against a plain Python model: random alloc / free / bad free / compaction on both sides.

After every step: the tables are inverse, no row holds two ids, free + live = all, the bands are
disjoint, and every live slot still holds the bytes written when it was allocated (a pattern from
its side, virtual id and a version), through whatever compactions happened since.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiered_cache import KVSpec, SlotStateError, StateSpec, UnifiedPool

KV = KVSpec(num_layers=1, kv_heads=1, head_dim=8, dtype=torch.float16)  # 32 B a token
ST = StateSpec(num_layers=2, temporal_shape=(1, 4, 8), temporal_dtype=torch.float32,
               conv_shapes=((4, 3),), conv_dtype=torch.bfloat16)  # 2 * (128 + 32) = 320 B


def pattern(side: int, vid: int, version: int, nbytes: int) -> torch.Tensor:
    return ((torch.arange(nbytes) * 7 + vid * 31 + version * 131 + side * 17) % 251).to(torch.uint8)


class PoolMachine(RuleBasedStateMachine):
    backend = "torch"

    @initialize(page_size=st.sampled_from([1, 8]), lazy=st.booleans(),
                low_slots=st.integers(2, 24), high_slots=st.integers(1, 6))
    def setup(self, page_size, lazy, low_slots, high_slots):
        self.pool = UnifiedPool(KV, ST, low_slots=low_slots, high_slots=high_slots, page_size=page_size,
                                device="cpu", lazy_compaction=lazy, backend=self.backend)
        self.sides = [self.pool.low, self.pool.high]
        self.live = [{}, {}]  # per side: virtual slot id -> version
        self.freed = [set(), set()]
        self.version = 0

    # --------------------------------------------------------------------------- model helpers
    def room(self, s: int) -> int:
        """Slots side ``s`` can get now: its band compacted, the peer's band compacted."""
        me, peer = self.sides[s], self.sides[1 - s]
        free_bytes = self.pool.total_bytes - (len(self.live[1 - s]) + 1) * peer.entry_bytes
        return free_bytes // me.entry_bytes - 1 - len(self.live[s])

    def tables(self):
        return [(a.allocator._v2p.copy(), a.allocator._p2v.copy()) for a in self.sides]

    def assert_unchanged(self, before):
        for (v, p), (v2, p2) in zip(before, self.tables()):
            assert (v == v2).all() and (p == p2).all()

    # ----------------------------------------------------------------------------------- rules
    @rule(s=st.integers(0, 1), k=st.integers(1, 6))
    def alloc(self, s, k):
        side = self.sides[s]
        expect_ok = k <= self.room(s)
        before = self.tables()
        got = side.alloc(k * side.page_size)
        if not expect_ok:
            assert got is None
            self.assert_unchanged(before)
            return
        assert got is not None and got.numel() == k * side.page_size
        vids = (got.view(-1, side.page_size)[:, 0] // side.page_size).tolist()
        assert not set(vids) & set(self.live[s])
        rows = side.allocator.translate_pages(torch.tensor(vids))
        for vid, row in zip(vids, rows.tolist()):
            self.version += 1
            self.live[s][vid] = self.version
            self.freed[s].discard(vid)
            side.rows_bytes()[row] = pattern(s, vid, self.version, side.entry_bytes)

    @rule(s=st.integers(0, 1), data=st.data())
    def free_some(self, s, data):
        if not self.live[s]:
            return
        side = self.sides[s]
        vids = data.draw(st.lists(st.sampled_from(sorted(self.live[s])), min_size=1, max_size=4, unique=True))
        side.free(self.token_ids(side, vids))
        for v in vids:
            del self.live[s][v]
            self.freed[s].add(v)

    @rule(s=st.integers(0, 1), data=st.data())
    def free_a_free_id(self, s, data):
        side = self.sides[s]
        candidates = sorted(self.freed[s]) + [side.capacity - 1 if side.capacity - 1 not in self.live[s] else 0]
        vid = data.draw(st.sampled_from(candidates))
        live = sorted(self.live[s])[:1]
        before = self.tables()
        with pytest.raises(SlotStateError):
            side.free(self.token_ids(side, live + [vid]))  # one good id, one bad: nothing is freed
        self.assert_unchanged(before)

    @precondition(lambda self: any(self.live))
    @rule(s=st.integers(0, 1))
    def free_twice_in_one_call(self, s):
        if not self.live[s]:
            return
        vid = min(self.live[s])
        before = self.tables()
        with pytest.raises(SlotStateError):
            self.sides[s].free(self.token_ids(self.sides[s], [vid, vid]))
        self.assert_unchanged(before)

    @rule(s=st.integers(0, 1), extra=st.integers(1, 50))
    def ask_for_more_than_exists(self, s, extra):
        side = self.sides[s]
        before = self.tables()
        assert side.alloc((self.room(s) + extra) * side.page_size) is None
        self.assert_unchanged(before)

    @rule(s=st.integers(0, 1))
    def compact(self, s):
        self.sides[s].compact()
        assert self.sides[s].allocator.num_holes == 0

    # ------------------------------------------------------------------------------ invariants
    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        for s, side in enumerate(self.sides):
            assert side.allocator.num_live == len(self.live[s])
            assert side.schedulable_available_size() == self.room(s) * side.page_size
            assert side.available_size() <= side.schedulable_available_size()
            if not self.live[s]:
                continue
            vids = sorted(self.live[s])
            rows = side.allocator.translate_pages(torch.tensor(vids)).tolist()
            assert len(set(rows)) == len(rows)
            for vid, row in zip(vids, rows):
                assert torch.equal(side.rows_bytes()[row], pattern(s, vid, self.live[s][vid], side.entry_bytes))

    @staticmethod
    def token_ids(side, vids):
        ps = side.page_size
        return (torch.tensor(vids, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).reshape(-1)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.mark.slow
def test_pool_state_machine():
    PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=100, **SETTINGS)
    PoolMachine.TestCase().runTest()


class TritonPoolMachine(PoolMachine):
    backend = "triton"


def test_pool_state_machine_triton_moves():
    """Same machine with compaction moved by the Triton kernel (interpreter on CPU: fewer runs)."""
    TritonPoolMachine.TestCase.settings = settings(max_examples=12, stateful_step_count=40, **SETTINGS)
    TritonPoolMachine.TestCase().runTest()
