"""RadixTree on its own terms (CPU): the one child-key encoding, its inverse, and the walks built on it."""

from __future__ import annotations

from array import array

import pytest

from tests.support.radix_util import insert_fresh, insert_swa, make_cache, make_swa_cache, node_at
from tiered_cache.radix import MatchPrefixParams, RadixKey


@pytest.mark.parametrize("ps", [1, 2])
def test_child_key_is_the_first_page_salted_at_the_root_only(ps):
    tree = make_cache(page_size=ps).tree
    toks = [5, 6, 7, 8]
    first = array("q", [5, 6][:ps]).tobytes()  # the first page's int64 ids as bytes
    assert tree.child_key(toks, 0, True, None) == first
    assert tree.child_key(toks, 0, True, "t") == ("t", first)
    assert tree.child_key(toks, 0, False, "t") == first  # below the root the path already carries the tenant
    second = array("q", [6] if ps == 1 else [7, 8]).tobytes()
    assert tree.child_key(toks, ps, False, None) == second
    assert tree.key_salt(tree.child_key(toks, 0, True, "t")) == "t"
    assert tree.key_salt(tree.child_key(toks, 0, True, None)) is None
    assert tree.key_salt(tree.child_key(toks, 0, True, "")) == ""  # "" is a tenant, not None
    kb = array("q", toks).tobytes()  # the walks cut the same keys from a whole key's bytes
    assert all(tree.child_key(kb, i, r, t) == tree.child_key(toks, i, r, t)
               for i in range(0, 4, ps) for r in (True, False) for t in (None, "t"))
    assert tree.child_key(array("q", toks), 0, True, "t") == tree.child_key(toks, 0, True, "t")


@pytest.mark.parametrize("ps", [1, 2])
def test_nodes_are_filed_under_child_key_and_paths_read_back(ps):
    cache = make_cache(page_size=ps)
    tree = cache.tree
    insert_fresh(cache, [1, 2, 3, 4], salt="a")
    insert_fresh(cache, [1, 2, 9, 9], salt="a")  # splits [1, 2, 3, 4] after [1, 2]
    insert_fresh(cache, [1, 2, 3, 4])
    top = tree.child(tree.root, [1, 2], 0, "a")
    assert top is not None and top.key == [1, 2] and top.ck == ("a", array("q", [1, 2][:ps]).tobytes())
    leaf = tree.child(top, [1, 2, 9, 9], 2, "a")
    assert leaf.key == [9, 9] and tree.path_tokens(leaf) == ([1, 2, 9, 9], "a")
    plain = node_at(cache, [1, 2, 3, 4])
    assert plain is not top and tree.path_tokens(plain) == ([1, 2, 3, 4], None)
    assert tree.path_values(leaf).tolist() == top.value.tolist() + leaf.value.tolist()
    cache.check_invariants()


def test_both_kinds_share_the_tree_and_differ_in_the_payload():
    m, s = make_cache(page_size=2), make_swa_cache(page_size=2, window=2, host=False)
    assert type(m.tree) is type(s.tree) and m.supports_mamba() and not s.supports_mamba()
    insert_fresh(m, [1, 2])
    insert_swa(s, [1, 2])
    for cache in (m, s):
        x = node_at(cache, [1, 2])
        assert x.payload.resumable and not x.is_tombstone
        assert cache.match_prefix(MatchPrefixParams(key=RadixKey([1, 2]))).best_match_node is x
    assert node_at(m, [1, 2]).payload.mamba_value is not None and node_at(s, [1, 2]).payload.swa_value is not None
