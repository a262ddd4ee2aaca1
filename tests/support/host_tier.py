"""Host-tier (T2) pieces of the radix state machines (``tests/radix/test_radix_host_stateful.py``,
``test_radix_swa_stateful.py``): checksum corruption of host slots, the corrupt entries a load reads,
the K of a host page, and a load back aimed at what lives on the host."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Optional

import torch
from hypothesis import strategies as st

from tiered_cache.kernels.reference import row_checksums_reference
from tiered_cache.radix import CacheReq, InitLoadBackParams, MatchPrefixParams, RadixKey


def corrupt(region, slot: int) -> bool:
    """The slot's bytes no longer match the checksum taken when they were written (a rule flipped a bit)."""
    return int(row_checksums_reference(region.slot(slot)[None], torch.tensor([0]))[0]) != int(region.checksums[slot])


def bad_entries(tickets: Mapping, regions: Mapping) -> list:
    """(region, slot) of the host entries a load reads (``tickets`` by region name) that do not match their
    checksums; ``regions``: the host regions by name."""
    return [(region, s) for name, region in regions.items() if name in tickets
            for s in tickets[name].host_slots if corrupt(region, s)]


def check_host_k(region, slot: int, offsets, ps: int, want: torch.Tensor) -> None:
    """K of every layer of the host page ``slot``: ``want`` (one value a token) + the layer."""
    page = region.slot(slot)
    for layer, (k, _) in enumerate(offsets):
        got = page[k:k + ps * 16].view(torch.float32).view(ps, 4)
        assert torch.equal(got, (want + layer)[:, None].expand(ps, 4)), "host page changed"


class LoadBack(NamedTuple):
    """A load back a rule started: the match it came from, the request's tokens and salt, the request,
    and what ``init_load_back`` returned (the ids being loaded, the node they end at)."""

    match: Any
    toks: list
    salt: Optional[str]
    req: CacheReq
    ids: torch.Tensor
    node: Any


def start_load_back(machine, data, toks, salt, nodes: Mapping, extra: int) -> Optional[LoadBack]:
    """Match ``toks`` and start loading back what the match found on the host; ``None`` when it found
    nothing there. Half the time the tokens are a prefix that lives on the host (random keys rarely do:
    ``nodes`` maps (salt, prefix) to its node), with ``extra`` of ``toks`` after it. The machine adopts
    the tree after the match."""
    c = machine.cache
    on_host = sorted((k for k, x in nodes.items() if x.value is None), key=repr)
    if on_host and data.draw(st.booleans()):
        salt, full = data.draw(st.sampled_from(on_host))
        toks = list(full) + toks[:extra]
    m = c.match_prefix(MatchPrefixParams(key=RadixKey(toks, salt)))
    machine.adopt()
    if not m.host_hit_length:
        return None
    req = CacheReq(token_ids=toks, kv_indices=torch.empty(0, dtype=torch.int64))
    ids, node = c.init_load_back(InitLoadBackParams(m.best_match_node, m.host_hit_length, req=req))
    return LoadBack(m, toks, salt, req, ids, node)
