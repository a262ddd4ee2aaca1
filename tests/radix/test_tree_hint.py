"""An insert's walk started at the request's matched node (``InsertParams.last_node``, issue 22).

The tree takes the hint only where it proves the path still holds (``walks.hinted``: the node alive, a walk
remembered its path for a key the insert's starts with, the same salt, not past the insert's pages); anything
else walks from the root. Two caches driven by the same engine turns, one inserting with the hint and one without,
with other requests' inserts (splits of the matched path), KV and state evictions, host demotions and host drops
between each match and its insert, and hints that are stale, of another request or of a dead node: every result
(or error) and everything observable (tree, sizes, stamps, candidate sets, KV tables, T1 bytes, host pools) is the
same after every step.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.radix_util import alloc_kv, full_snapshot, insert_fresh, make_hi_cache, write_kv, write_state
from tiered_cache.errors import InvalidTypeError, TieredCacheError
from tiered_cache.radix import EvictParams, InsertParams, MatchPrefixParams, RadixKey, walks
from tiered_cache.radix import tree as tree_module

PS = 2


def _build():
    return make_hi_cache(page_size=PS, kv_pages=40, states=6, t1_slots=10, host_pages=40, host_states=10)


def _observed(cache):
    a = cache.kv.allocator
    return full_snapshot(cache), a._v2p.tolist(), sorted(a._free_vids), bytes(cache.ckpt.raw.numpy())


def _insert(cache, toks, salt, m, dup: bool, lock: bool, hint):
    """The insert of a turn whose match was ``m``: KV for the tokens past the hit (``dup``: for all, sent with
    ``prev_prefix_len`` 0), a fresh state, ``last_node`` ``hint``; what the tree did not take is freed. -> the
    result's fields, or the error's type and argument."""
    aligned = len(toks) // PS * PS
    hit = len(m.device_indices)
    prev = 0 if dup else hit
    new = cache.kv.alloc(aligned - prev) if aligned > prev else cache.tree.empty
    slot = cache.states.alloc(1)
    if new is None or slot is None:
        if new is not None and new.numel():
            cache.kv.free(new)
        if slot is not None:
            cache.states.free(slot)
        return "no room"
    value = new if dup else torch.cat([m.device_indices, new])
    write_kv(cache, value[prev:], toks[prev:aligned], salt)
    write_state(cache, slot, toks[:aligned], salt)
    try:
        res = cache.insert(InsertParams(key=RadixKey(toks[:aligned], salt), value=value, mamba_value=slot,
                                        prev_prefix_len=prev, last_node=hint))
        out = (res.prefix_len, res.cached_len, res.mamba_exist, res.mamba_stored, res.last_device_node.id)
        rest = value[max(res.cached_len, prev):]
    except TieredCacheError as e:
        out, rest = (type(e).__name__, getattr(e, "arg", None)), new
    if rest.numel():
        cache.kv.free(rest)
    cache.states.free(slot)
    return out


def _fresh(cache, toks, salt) -> None:
    """Another request's insert of ``toks`` with fresh ids and state (none when T0 has no room: the same on both)."""
    n = -(-len(toks) // PS) * PS
    ids, slot = cache.kv.alloc(n), cache.states.alloc(1)
    if ids is not None and slot is not None:
        write_kv(cache, ids, toks, salt)
        write_state(cache, slot, toks, salt)
        res = cache.insert(InsertParams(key=RadixKey(toks, salt), value=ids[:len(toks)], mamba_value=slot))
        if res.cached_len < n:
            cache.kv.free(ids[res.cached_len:])
    elif ids is not None:
        cache.kv.free(ids)
    if slot is not None:
        cache.states.free(slot)


def _between(cache, rng_state, stems):
    """Other requests' work between a match and its insert (the same on both caches: ``rng_state``)."""
    rng = random.Random(rng_state)
    for _ in range(rng.randrange(0, 4)):
        op = rng.random()
        if op < 0.35:  # another request's insert, cut anywhere: splits the matched path's nodes
            s = rng.choice(stems)
            _fresh(cache, s[:rng.randrange(1, len(s) + 1)], rng.choice([None, "t"]))
        elif op < 0.55:  # demotes (backed up) or drops; all at times: the matched node too, when not locked
            cache.evict(EvictParams(num_tokens=rng.choice([rng.randrange(1, 12), 200])))
        elif op < 0.7:
            cache.evict(EvictParams(mamba_num=rng.randrange(1, 3)))
        elif op < 0.8:
            cache.evict(EvictParams(host_num_tokens=rng.choice([rng.randrange(1, 10), 200]),
                                    host_mamba_num=rng.randrange(0, 3)))
        else:
            cache.check_hicache_events()  # backups finish: host copies appear


@pytest.mark.parametrize("seed", range(8))
def test_hinted_insert_is_the_full_walk(seed, monkeypatch):
    rng = random.Random(seed)
    hinted, plain = _build(), _build()
    used = {"taken": 0, "refused": 0}

    def counting(*a):
        end = walks.hinted(*a)
        used["taken" if end else "refused"] += 1
        return end

    monkeypatch.setattr(tree_module, "hinted", counting)  # the plain cache passes no hint: never asks
    stems = [[rng.randrange(1, 30) for _ in range(rng.randrange(2, 11))] for _ in range(4)]
    last: dict[int, list] = {0: [None], 1: [None]}  # earlier hints of each cache: stale or another request's
    for step in range(60):
        salt = rng.choice([None, None, "t"])
        toks = rng.choice(stems) + [rng.randrange(1, 30) for _ in range(rng.randrange(0, 9))]
        if rng.random() < 0.4:
            stems.append(toks)
        dup, lock, between = rng.random() < 0.4, rng.random() < 0.5, rng.getrandbits(32)
        which = rng.random()
        got = []
        for k, cache in enumerate((hinted, plain)):
            m = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(toks), salt)))
            if lock:
                cache.inc_lock_ref(m.last_device_node)
            _between(cache, between, stems)
            if which < 0.75:
                hint = m.last_device_node  # the request's own match
            else:
                hint = last[k][int(which * 1000) % len(last[k])]  # stale, another request's, or dead
            res = _insert(cache, toks, salt, m, dup, lock, hint if cache is hinted else None)
            if lock:
                cache.dec_lock_ref(m.last_device_node)
            got.append(res)
            if isinstance(res, tuple) and len(res) == 5:
                last[k].append(cache.tree.seen and next(reversed(cache.tree.seen)))
            cache.check_invariants(request_states=torch.empty(0, dtype=torch.int64))
        # node ids differ between the caches; the tree shapes are compared below
        assert [r[:4] if isinstance(r, tuple) and len(r) == 5 else r for r in got[:1]] == \
            [r[:4] if isinstance(r, tuple) and len(r) == 5 else r for r in got[1:]], f"step {step}: results differ"
        assert _observed(hinted) == _observed(plain), f"step {step}: the caches differ"
    assert used["taken"] > 5 and used["refused"] > 0, f"the hint never taken, or never refused: {used}"


def test_a_hint_not_a_node_is_refused_and_nothing_changes():
    cache = _build()
    insert_fresh(cache, [1, 2, 3, 4])
    before = _observed(cache)
    ids = alloc_kv(cache, 6)
    slot = cache.states.alloc(1)
    with pytest.raises(InvalidTypeError) as e:
        cache.insert(InsertParams(key=RadixKey([1, 2, 3, 4, 5, 6]), value=ids, mamba_value=slot, last_node="n1"))
    assert e.value.arg == "last_node"
    cache.kv.free(ids)
    cache.states.free(slot)
    assert _observed(cache) == before


def test_the_hint_is_taken_only_for_the_key_it_was_remembered_for():
    """A match's node proves the path to its end for a key that starts with the matched tokens, under the match's
    salt and within the insert's pages; not for another key, tenant or a shorter insert, nor once the tree is
    reset."""
    cache = _build()
    insert_fresh(cache, [1, 2, 3, 4])
    insert_fresh(cache, [1, 2, 3, 4, 5, 6])
    m = cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2, 3, 4, 5, 6, 7, 8])))
    kb = RadixKey([1, 2, 3, 4, 5, 6, 7, 8]).checked()[2].tobytes()
    assert walks.hinted(cache.tree, m.last_device_node, kb, None, 8) == 6
    assert walks.hinted(cache.tree, m.last_device_node, kb, "t", 8) == 0  # another tenant's key
    assert walks.hinted(cache.tree, m.last_device_node, kb, None, 4) == 0  # past the insert's pages
    other = RadixKey([1, 2, 3, 4, 5, 9, 7, 8]).checked()[2].tobytes()
    assert walks.hinted(cache.tree, m.last_device_node, other, None, 8) == 0  # its path is not this key's
    node = m.last_device_node
    cache.reset()
    assert walks.hinted(cache.tree, node, kb, None, 8) == 0  # a node of the tree before the reset


def test_at_most_hints_paths_are_kept_the_first_going_first(monkeypatch):
    cache = _build()
    monkeypatch.setattr(walks, "HINTS", 3)
    ends = []
    for t in range(5):
        res, _ = insert_fresh(cache, [40 + t, 1, 2, 3])
        ends.append(res.last_device_node)
    assert list(cache.tree.seen) == ends[2:]
    kb = RadixKey([40, 1, 2, 3]).checked()[2].tobytes()
    assert walks.hinted(cache.tree, ends[0], kb, None, 4) == 0  # forgotten: its insert walks from the root
    kb = RadixKey([44, 1, 2, 3]).checked()[2].tobytes()
    assert walks.hinted(cache.tree, ends[4], kb, None, 4) == 4


def test_hints_forget_removed_nodes_and_hold_at_most_hint_bytes(monkeypatch):
    """A node the tree unlinks leaves ``tree.seen`` at once (no hint keeps a dead node or its key alive), and
    the keys the hints hold stay under ``HINT_BYTES`` (the first remembered going first), ``nbytes`` counting
    exactly the bytes held."""
    cache = _build()
    monkeypatch.setattr(walks, "HINT_BYTES", 3 * 8 * 6)  # three 6-token keys' bytes
    ends = []
    for t in range(5):
        res, _ = insert_fresh(cache, [50 + t, 1, 2, 3, 4, 5])
        ends.append(res.last_device_node)
    seen = cache.tree.seen
    assert list(seen) == ends[2:] and seen.nbytes == sum(len(v[1]) for v in seen.values()) == 3 * 8 * 6
    for _ in range(3):  # device KV to the host, then the host's too: the leaves are unlinked
        cache.evict(EvictParams(num_tokens=200, mamba_num=6))
        cache.evict(EvictParams(host_num_tokens=200, host_mamba_num=10))
    gone = [x for x in ends if not x.alive]
    assert gone and not any(x in seen for x in gone)
    assert seen.nbytes == sum(len(v[1]) for v in seen.values())
    cache.reset()
    assert not cache.tree.seen and cache.tree.seen.nbytes == 0
