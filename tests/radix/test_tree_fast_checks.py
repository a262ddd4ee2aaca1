"""The insert's fast paths agree with the paths they shortcut (issue 22).

- ``RadixTree.probe`` cuts child keys from an ``array`` key's bytes inline (no ``child_key`` call per
  node); a list key takes ``child_key``. Over random trees with salts, splits and partial pages, both
  give the same path, end node, leading device nodes, last node's start and pending flag (the count and
  the start as the path's nodes say), and the same refusal of a ``prev_prefix_len`` past the device part.
- ``check_value``, ``check_prev_prefix_len`` and ``state_slot`` accept their common case in one
  condition; every other input takes the branches that name what is wrong. Over random valid and
  invalid inputs, the result (or the error's type and argument) is the one the spec below says.
"""

from __future__ import annotations

import random
from array import array

import numpy as np
import pytest
import torch

from tests.support.radix_util import (
    KV_SPEC,
    STATE_SPEC,
    full_snapshot,
    insert_after_match,
    insert_fresh,
    make_cache,
    make_hi_cache,
    match,
)
from tiered_cache.config import CacheConfig
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix import EvictParams
from tiered_cache.radix.checks import check_prev_prefix_len, check_value, state_slot
from tiered_cache.stack import TieredCache

PS = 2


def _nodes(tree):
    stack, out = list(tree.root.children.values()), []
    while stack:
        x = stack.pop()
        out.append(x)
        stack.extend(x.children.values())
    return out


def _outcome(fn, *a):
    try:
        return ("ok", fn(*a))
    except (InvalidArgumentError, InvalidTypeError) as e:
        return (type(e).__name__, e.arg)


@pytest.mark.parametrize("seed", range(8))
def test_probe_of_an_array_key_is_probe_of_its_list(seed):
    rng = random.Random(seed)
    cache = make_hi_cache(page_size=PS, kv_pages=256, states=4, t1_slots=64, host_pages=256, host_states=64)
    tree = cache.tree
    stems = [[rng.randrange(1, 6) for _ in range(rng.randrange(0, 9))] for _ in range(4)]
    salts = [None, None, "a", "b"]
    for k in range(24):
        toks = rng.choice(stems) + [rng.randrange(1, 6) for _ in range(rng.randrange(1, 11))]
        insert_fresh(cache, toks, rng.choice(salts))
        if k % 6 == 5:  # device KV of backed-up nodes demoted: host-only nodes on the paths
            cache.evict(EvictParams(num_tokens=rng.randrange(2, 12)))
    assert any(x.value is None for x in _nodes(tree)), "no host-only node: the walks' device count is not tested"
    for _ in range(200):
        q = rng.choice(stems) + [rng.randrange(1, 6) for _ in range(rng.randrange(0, 13))]
        salt = rng.choice(salts + ["never"])
        aligned = len(q) // PS * PS
        prev = rng.randrange(0, aligned // PS + 1) * PS
        a = _outcome(tree.probe, array("q", q), salt, aligned, prev)
        b = _outcome(tree.probe, list(q), salt, aligned, prev)
        if a[0] == "ok" and b[0] == "ok":
            (pa, ea, da, na), (pb, eb, db, nb) = a[1], b[1]
            assert [x.id for x in pa] == [x.id for x in pb] and ea is eb and (da, na) == (db, nb), (q, salt)
            dev_n, start, whole = da
            lead = next((k for k, x in enumerate(pa) if x.value is None), len(pa))
            assert dev_n == lead and start == sum(len(x.akey) for x in pa[:-1]), (q, salt)
            ends = start + len(pa[-1].akey) if pa else 0
            assert whole == (not pa or (ends <= aligned and q[start:ends] == pa[-1].key)), (q, salt)
        else:
            assert a == b, (q, salt, prev)
    cache.check_invariants()


class _IntTensor(torch.Tensor):
    """A tensor subclass: not the fast path's exact type, still a valid id tensor for the full checks."""


def _value_cases(rng: random.Random, n: int):
    good = torch.arange(n, dtype=torch.int64)
    return [good, good.to(torch.int32), good.float(), good.reshape(1, -1), torch.arange(n + rng.randrange(1, 3)),
            torch.arange(max(0, n - 1)), good.as_subclass(_IntTensor), list(range(n)), None, np.arange(n),
            torch.zeros(0, dtype=torch.int64)]


def _spec_value(value, n):
    """What ``check_value`` must do, written from its contract."""
    if not isinstance(value, torch.Tensor) or value.dtype != torch.int64:
        return ("InvalidTypeError", "value")
    if value.dim() != 1:
        return ("InvalidArgumentError", "value")
    if value.numel() != n:
        return ("InvalidArgumentError", "key, value")
    return ("ok", None)


@pytest.mark.parametrize("seed", range(6))
def test_check_value_and_prev_prefix_len_fast_paths_follow_the_contract(seed):
    rng = random.Random(seed)
    for _ in range(40):
        n = rng.randrange(0, 12)
        for v in _value_cases(rng, n):
            assert _outcome(check_value, "value", v, n, torch.device("cpu")) == _spec_value(v, n), (type(v), n)
        for prev in [rng.randrange(-3, n + 4), True, False, 2.0, np.int64(rng.randrange(0, n + 1)), None, "2",
                     torch.tensor(rng.randrange(0, n + 1))]:
            got = _outcome(check_prev_prefix_len, prev, n, PS)
            integral = isinstance(prev, (int, np.integer)) and not isinstance(prev, bool) or (
                isinstance(prev, torch.Tensor) and prev.dim() == 0)
            if not integral:
                assert got == ("InvalidTypeError", "prev_prefix_len"), prev
            elif 0 <= int(prev) <= n and int(prev) % PS == 0:
                assert got == ("ok", None), prev
            else:
                assert got == ("InvalidArgumentError", "prev_prefix_len"), prev


@pytest.mark.parametrize("seed", range(6))
def test_state_slot_fast_path_follows_the_contract(seed):
    rng = random.Random(seed)
    cache = make_cache(page_size=PS, states=6)
    states = cache.states
    for _ in range(60):
        v = rng.randrange(-2, states.capacity + 2)
        cases = [torch.tensor([v]), torch.tensor([v], dtype=torch.int32), torch.tensor(v), torch.tensor([[v]]),
                 torch.tensor([v, v]), torch.tensor([float(v)]), v, True, torch.tensor([v]).as_subclass(_IntTensor)]
        for slot in cases:
            got = _outcome(state_slot, states, "mamba_value", slot)
            if isinstance(slot, bool) or (isinstance(slot, torch.Tensor) and slot.dtype.is_floating_point):
                assert got == ("InvalidTypeError", "mamba_value"), slot
            elif isinstance(slot, torch.Tensor) and slot.numel() != 1:
                assert got == ("InvalidArgumentError", "mamba_value"), slot
            elif isinstance(slot, int) and not 0 < v < states.capacity:
                assert got == ("InvalidArgumentError", "mamba_value"), slot
            else:
                out = got[1]
                kept = slot.dtype if isinstance(slot, torch.Tensor) and slot.dtype == torch.int32 else torch.int64
                assert got[0] == "ok" and out.dtype == kept and out.shape == (1,) and int(out) == v, slot
                if isinstance(slot, torch.Tensor) and slot.dtype == torch.int64 and slot.dim() == 1:
                    assert out is slot  # no copy or view made of a slot already in shape


@pytest.mark.parametrize("seed", range(8))
def test_touch_all_is_touch_of_each_in_order(seed):
    """``LRUPolicy.touch_all`` (the walks' batched touch) leaves the stamps and the victim order that
    ``touch`` node by node leaves, with candidates in the sharing resources and outside them."""
    from tiered_cache.radix.policy import RESOURCES, LRUPolicy

    rng = random.Random(seed)
    nodes = [object() for _ in range(30)]
    a, b = LRUPolicy(), LRUPolicy()
    for _ in range(300):
        op, r, x = rng.random(), rng.choice(RESOURCES), rng.choice(nodes)
        if op < 0.3:
            path = rng.sample(nodes, rng.randrange(0, 12))
            a.touch_all(r, path)
            for y in path:
                b.touch(r, y)
        elif op < 0.6:
            a.add(r, x)
            b.add(r, x)
        elif op < 0.75:
            a.discard(r, x)
            b.discard(r, x)
        elif op < 0.8:
            assert a.pop(r) is b.pop(r)
        else:
            a.touch(r, x)
            b.touch(r, x)
        assert all(a.stamp(r, y) == b.stamp(r, y) for y in nodes)
    for r in RESOURCES:
        assert a.candidates(r) == b.candidates(r)
        while (x := a.pop(r)) is not None:
            assert x is b.pop(r)
        assert b.pop(r) is None


def _build():
    cfg = CacheConfig(page_size=PS, kv_pages=48, t0_states=6, t1_states=10, codec="int8", check_memory=False,
                      backend="torch")
    return TieredCache.build(cfg, kv=KV_SPEC, state=STATE_SPEC, device="cpu").tree


def _turn(cache, toks: list[int], dup: bool):
    """An engine turn (match, then ``insert_after_match``; ``dup``: the hit's ids sent again as duplicates).
    -> the insert's result."""
    return insert_after_match(cache, toks, match(cache, toks), cache.states.alloc(1), dup)


def _observed(cache):
    a = cache.kv.allocator
    return full_snapshot(cache), a._v2p.tolist(), sorted(a._free_vids), bytes(cache.ckpt.raw.numpy())


@pytest.mark.parametrize("seed", range(6))
def test_insert_walk_one_duplicate_range_is_the_per_node_walk(seed):
    """``_insert_walk`` takes the nodes ahead of the last one (and the last, matched whole) as one duplicate range
    when ``probe`` says they all hold device KV; forced to step node by node (``lead`` of no device node, the last
    not whole: ``insert_step``), a cache driven by the same engine turns (duplicates sent again, evictions) leaves
    the same tree, sizes, stamps, KV tables and T1 bytes."""
    rng = random.Random(seed)
    fast, stepped = _build(), _build()
    ranges = {"one": 0, "whole": 0}
    walk = fast.rule._insert_walk

    def counting(*a):
        path, lead = a[-2], a[-1]
        ranges["one"] += len(path) > 1 and lead[0] >= len(path) - 1
        ranges["whole"] += bool(path) and lead[2] and lead[0] >= len(path)
        return walk(*a)

    fast.rule._insert_walk = counting
    slow = stepped.rule._insert_walk
    stepped.rule._insert_walk = lambda *a: slow(*a[:-1], (0, 0, False))
    stems = [[rng.randrange(1, 40) for _ in range(rng.randrange(2, 9))] for _ in range(4)]
    for step in range(40):
        toks = rng.choice(stems) + [rng.randrange(1, 40) for _ in range(rng.randrange(0, 9))]
        if rng.random() < 0.4:
            stems.append(toks)
        dup, evict, n = rng.random() < 0.4, rng.random() < 0.25, rng.randrange(1, 12)
        got = []
        for cache in (fast, stepped):
            got.append(_turn(cache, toks, dup))
            if evict:
                got.append(cache.evict(EvictParams(num_tokens=n)).num_tokens_evicted)
            cache.check_invariants(request_states=torch.empty(0, dtype=torch.int64))
        assert got[:len(got) // 2] == got[len(got) // 2:], f"step {step}: results differ"
        assert _observed(fast) == _observed(stepped), f"step {step}: the caches differ"
    assert ranges["one"] > 0 and ranges["whole"] > 0, f"the one-range path never ran (or never whole): {ranges}"


def _count_cases(rng: random.Random):
    good = [0, 1, 7, 10**12, np.int64(3), np.int32(0), torch.tensor(2)]
    bad = [-1, True, False, 1.0, 2.5, "3", None, np.int64(-2), [1], torch.tensor(-1)]
    return [rng.choice(good if rng.random() < 0.8 else bad) for _ in range(5)]


def _by_int_arg(values):
    """The spec: each count through ``int_arg`` (lo 0), in field order: its value, or the first error."""
    from tiered_cache.radix.params import _EVICT_FIELDS
    from tiered_cache.validate import int_arg

    try:
        return [int_arg(n, v, lo=0) for n, v in zip(_EVICT_FIELDS, values, strict=True)]
    except InvalidArgumentError as e:
        return (type(e), e.arg)


@pytest.mark.parametrize("seed", range(6))
def test_evict_params_one_condition_is_int_arg_per_count(seed):
    """``EvictParams`` and ``Eviction.evict`` accept plain ints >= 0 in one condition (``counts_ok``) and take
    ``int_arg`` per count otherwise: over random counts (ints, numpy ints, 0-d tensors, negatives, bools, floats,
    strings, None), the fields (or the error's type and argument) are ``int_arg``'s, at construction and when a
    field was set after it; a refused evict changes nothing."""
    from tiered_cache.radix.params import _EVICT_FIELDS

    rng = random.Random(seed)
    cache = make_cache(page_size=PS)
    insert_fresh(cache, [1, 2, 3, 4])
    for _ in range(200):
        values = _count_cases(rng)
        want = _by_int_arg(values)
        try:
            p = EvictParams(**dict(zip(_EVICT_FIELDS, values, strict=True)))
            got = [getattr(p, n) for n in _EVICT_FIELDS]
            assert [type(v) for v in got] == [int] * 5
        except InvalidArgumentError as e:
            got = (type(e), e.arg)
        assert got == want, (values, got, want)
        p = EvictParams()
        k = rng.randrange(5)
        setattr(p, _EVICT_FIELDS[k], values[k])  # set after construction: evict checks it
        one = _by_int_arg([values[k] if i == k else 0 for i in range(5)])
        before = full_snapshot(cache)
        try:
            cache.evict(p)
            got = None
        except InvalidArgumentError as e:
            got = (type(e), e.arg)
        assert got == (one if isinstance(one, tuple) else None), (values[k], got, one)
        if got is not None:
            assert full_snapshot(cache) == before
        else:  # evict ran on int_arg's plain int, as construction does
            assert type(getattr(p, _EVICT_FIELDS[k])) is int and getattr(p, _EVICT_FIELDS[k]) == one[k]
        insert_fresh(cache, [1, 2, 3, 4])
