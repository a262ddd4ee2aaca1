"""The Mamba insert and match take a T0 state slot's physical row where they use it, not where they check it:
between the two, the insert allocates T1 room (which may evict) and the match walks (which may drop NaN states),
and a state side may compact on any free or alloc, moving the caller's row. A side made to compact right there
still gets the caller's state stored, and the request's slot filled, from and into the rows they hold then."""

from __future__ import annotations

import numpy as np
import torch

from tests.support.radix_util import alloc_kv, check_state, insert_fresh, make_cache, match, write_kv, write_state
from tiered_cache.radix import InsertParams, RadixKey

TOKS = [1, 2, 3, 4]


def _row(cache, slot) -> int:
    return int(cache.states.translate_host(np.array([int(slot)], dtype=np.int64))[0])


def _moves_on(cache, below, tenants: list) -> None:
    """Frees ``below`` (a slot at a lower row than the caller's) and compacts the side: the caller's row moves;
    a new slot then takes the row it left, written with another state (in ``tenants``)."""
    cache.states.free(below)
    cache.states.allocator.compact()
    tenant = cache.states.alloc(1)
    write_state(cache, tenant, [7, 7])
    tenants.append(tenant)


def test_insert_stores_the_state_from_the_row_it_holds_after_the_t1_allocation(monkeypatch):
    cache = make_cache(page_size=2)
    below, slot = cache.states.alloc(1), cache.states.alloc(1)
    ids = alloc_kv(cache, 4)
    write_kv(cache, ids, TOKS)
    write_state(cache, slot, TOKS)
    before = _row(cache, slot)
    alloc_ids = cache.ckpt.alloc_ids

    tenants: list = []

    def compacting(n):  # the side compacts while T1 room is made
        _moves_on(cache, below, tenants)
        return alloc_ids(n)

    monkeypatch.setattr(cache.ckpt, "alloc_ids", compacting)
    res = cache.insert(InsertParams(key=RadixKey(TOKS), value=ids, mamba_value=slot))
    monkeypatch.undo()
    assert res.mamba_stored and _row(cache, slot) != before  # the row did move in between
    assert _row(cache, tenants[0]) == before  # and another state lives there now
    check_state(cache, slot, TOKS)  # moved with its data
    cache.states.free(slot)
    req_slot = cache.states.alloc(1)
    req = type("Req", (), {"mamba_pool_idx": req_slot})()
    m = match(cache, TOKS, req=req, cow_mamba=True)
    assert len(m.device_indices) == 4
    check_state(cache, req_slot, TOKS)  # what T1 holds is the caller's state, not the row's new tenant's
    cache.states.free(req_slot)
    cache.states.free(tenants[0])
    cache.check_invariants(request_states=torch.empty(0))


def test_match_loads_into_the_row_the_request_holds_after_the_walk(monkeypatch):
    cache = make_cache(page_size=2)
    insert_fresh(cache, TOKS)
    below, slot = cache.states.alloc(1), cache.states.alloc(1)
    write_state(cache, below, [8, 8])  # not the row insert_fresh's freed slot left the cached state in
    write_state(cache, slot, [9, 9])  # what the request's slot held: the match overwrites it
    before = _row(cache, slot)
    poll, calls, tenants = cache.rule.flags.poll, [], []

    def once():  # the side compacts while the match reads the NaN/inf flags (which may drop states)
        if not calls:
            calls.append(1)
            _moves_on(cache, below, tenants)
        return poll()

    monkeypatch.setattr(cache.rule.flags, "poll", once)
    req = type("Req", (), {"mamba_pool_idx": slot})()
    m = match(cache, TOKS, req=req, cow_mamba=True)
    monkeypatch.undo()
    assert len(m.device_indices) == 4 and calls and _row(cache, slot) != before
    check_state(cache, slot, TOKS)
    check_state(cache, tenants[0], [7, 7])  # the row the request left is not written
    cache.states.free(slot)
    cache.states.free(tenants[0])
    cache.check_invariants(request_states=torch.empty(0))
