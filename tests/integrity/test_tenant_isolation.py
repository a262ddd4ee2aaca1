"""Tenant isolation through the radix cache with T3 (issue 17 item 1, security).

A tenant is the pair (the tier's ``salt``, the request's ``RadixKey.extra_key``). Before the fix the
storage hook keyed T3 by the request key alone (tier salts "A" and "B" shared every entry: 12 of 12
tokens served across tenants), and ``extra_key`` ``None`` and ``""`` gave the same T3 keys while the
tree kept them apart. For each pair of distinct tenants, over a real file store and a real
``redis-server``: tenant A caches a prefix (KV pages and a state reach T3 by write-through), then a
fresh cache of tenant B matches the same tokens and must get nothing from T3; B caching them writes
entries of its own, disjoint from A's. A fresh cache of tenant A itself is the control (it hits T3),
so a test here can fail. The T0/T1/T2 part: in A's own cache, a match of A's tokens under B's
request key is empty (the tree salts its root by the request key).
"""

from __future__ import annotations

import uuid

import pytest

from tests.support import storage_util
from tests.support.radix_util import insert_fresh
from tests.support.storage_util import FP, make_t3_cache, settle, stored_names
from tiered_cache.radix import MatchPrefixParams, RadixKey
from tiered_cache.storage import FileStore, RedisStore, StorageTier

redis_server = storage_util.redis_server  # the fixture, used through request.getfixturevalue
TOKS = list(range(500, 512))  # 3 pages of 4

# (tier salt, request key) of tenant A, then of tenant B: every way two tenants may differ
PAIRS = {
    "tier_salts_differ": (("A", None), ("B", None)),
    "tier_salts_differ_same_key": (("A", "u"), ("B", "u")),
    "tier_salt_none_vs_empty": ((None, None), ("", None)),
    "request_key_none_vs_empty": (("S", None), ("S", "")),
    "request_keys_differ": (("S", "x"), ("S", "y")),
    "concatenations_meet": (("ab", "c"), ("a", "bc")),
    "salt_and_key_swapped": ((None, "A"), ("A", None)),
}


@pytest.fixture(params=["file", "redis"])
def open_store(request, tmp_path):
    """A factory of backends over one store (each tier gets its own client, as processes would)."""
    made = []
    if request.param == "file":
        def factory():
            made.append(FileStore(str(tmp_path / "t3")))
            return made[-1]
    else:
        srv = request.getfixturevalue("redis_server")
        prefix = f"ti{uuid.uuid4().hex[:8]}:"

        def factory():
            made.append(RedisStore("127.0.0.1", srv.port, prefix=prefix, chunk_bytes=4096))
            return made[-1]
    yield factory
    for b in made:
        b.close()


def match(cache, key):
    return cache.match_prefix(MatchPrefixParams(key=RadixKey(TOKS, key)))


def assert_empty(res, cache):
    assert res.device_indices.numel() == 0 and res.host_hit_length == 0 and res.mamba_host_hit_length == 0
    assert res.best_match_node is cache.root and res.kv_hit_length == 0


@pytest.mark.parametrize("pair", list(PAIRS))
def test_two_tenants_share_no_t3_entry(open_store, pair):
    (salt_a, key_a), (salt_b, key_b) = PAIRS[pair]
    tier_a = StorageTier(open_store(), FP, salt=salt_a)
    cache_a = make_t3_cache(tier_a)
    insert_fresh(cache_a, TOKS, key_a)
    settle(cache_a)
    a_names = stored_names(tier_a.backend)
    n_a = tier_a.stats["written"]
    assert n_a == 4 and len(a_names) == 4, (tier_a.stats, a_names)  # 3 KV pages and the state at the end

    if key_b != key_a:  # T0/T1/T2: the tree keeps request keys apart (same tier salt in one cache)
        assert_empty(match(cache_a, key_b), cache_a)
        assert cache_a.stats["t3_hits"] == 0

    tier_b = StorageTier(open_store(), FP, salt=salt_b)
    cache_b = make_t3_cache(tier_b)
    assert_empty(match(cache_b, key_b), cache_b)  # nothing of A's reaches B, from any tier
    settle(cache_b)
    assert cache_b.stats["t3_hits"] == 0 and tier_b.stats["hit"] == 0 and tier_b.stats["lookup_hit"] == 0
    insert_fresh(cache_b, TOKS, key_b)
    settle(cache_b)
    b_names = stored_names(tier_b.backend) - a_names
    assert tier_b.stats["written"] == n_a and tier_b.stats["write_skipped"] == 0, tier_b.stats
    assert len(b_names) == n_a and not b_names & a_names and stored_names(tier_b.backend) == a_names | b_names

    # The control: a fresh cache of tenant A itself finds A's prefix in T3 (so the checks above can fail).
    tier_c = StorageTier(open_store(), FP, salt=salt_a)
    cache_c = make_t3_cache(tier_c)
    res = match(cache_c, key_a)
    assert res.host_hit_length == len(TOKS) and cache_c.stats["t3_hits"] == 1, (res, cache_c.stats)
    for t in (tier_a, tier_b, tier_c):
        t.close()
