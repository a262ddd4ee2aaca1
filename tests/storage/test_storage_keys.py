"""T3 keys: the chain over pages, and zero hits whenever anything that changes the bytes changes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.support.storage_util import FP, fill_slots, make_region, wait_done
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.storage import FileStore, Kind, StorageFingerprint, StorageTier, page_keys

TOKENS = list(range(1000, 1024))  # 6 pages of 4


def test_chain_is_a_prefix_hash():
    keys = page_keys(TOKENS, FP)
    assert len(keys) == 6 and len(set(keys)) == 6 and all(len(k) == 32 for k in keys)
    assert page_keys(TOKENS[:13], FP) == keys[:3]  # a trailing partial page gets no key
    assert page_keys(TOKENS[8:], FP, parent=keys[1]) == keys[2:]  # extend from a node's key
    changed = TOKENS[:9] + [7] + TOKENS[10:]  # a token of page 2 changes
    k2 = page_keys(changed, FP)
    assert k2[:2] == keys[:2] and all(a != b for a, b in zip(k2[2:], keys[2:]))
    assert page_keys(TOKENS[4:8], FP) != keys[1:2]  # the same page after other tokens is another key


def test_salt_isolates_tenants():
    assert page_keys(TOKENS, FP, "tenant-a") != page_keys(TOKENS, FP, "tenant-b")
    assert page_keys(TOKENS, FP, "x") != page_keys(TOKENS, FP)
    with pytest.raises(InvalidArgumentError, match="salt"):
        page_keys(TOKENS, FP, 5)
    with pytest.raises(InvalidTypeError, match="extra_key"):
        page_keys(TOKENS, FP, extra_key=5)


TENANTS = [(None, None), ("", None), (None, ""), ("", ""), ("a", None), (None, "a"), ("a", "a"), ("ab", "c"),
           ("a", "bc"), ("abc", None), (None, "abc"), ("x", None), (b"x", None), (None, b"x"), ("a\0", None),
           ("a", "\0"), ("\x00", ""), ("\x01", None), ("é", None), ("\ud800", None), (b"\xed\xa0\x80", None)]


def test_tenant_pairs_are_unambiguous():
    """Issue 17 item 1: the T3 key binds the tier salt AND the request key, unambiguously. Before, the
    request key was not a field at all (the hook passed it as the salt, so tier salts "A" and "B" shared
    every entry), None and "" seeded alike, and a concatenation like ("ab", "c") / ("a", "bc") could
    collide. Every distinct (salt, extra_key) pair must give distinct keys, and the chain must depend
    on both fields from its first page on."""
    seeds = {}
    for salt, key in TENANTS:
        ks = tuple(page_keys(TOKENS[:8], FP, salt, extra_key=key))
        assert ks not in seeds, f"{(salt, key)} and {seeds[ks]} share T3 keys"
        seeds[ks] = (salt, key)
        assert page_keys(TOKENS[:8], FP, salt, extra_key=key) == list(ks)  # and they are a function of the pair


def test_v2_keys_never_meet_v1_entries():
    """Issue 17 item 1: the key derivation changed, so the seed tag changed with it: entries written under
    the v1 derivation (salt alone, length in 4 bytes) are never read under a v2 key."""
    import hashlib
    for salt in (None, "", "t"):
        s = (salt or "").encode()
        v1 = hashlib.sha256(b"tiered-cache/t3/seed\0" + FP.digest + len(s).to_bytes(4, "little") + s).digest()
        v1_keys = page_keys(TOKENS, FP, parent=v1)  # the v1 chain: the same pages after a v1 seed
        for key in (None, ""):
            assert not set(page_keys(TOKENS, FP, salt, extra_key=key)) & set(v1_keys)


@pytest.mark.parametrize("tokens", [[1.5, 2.5, 3.5, 4.5], [1.0, 2.0, 3.0, 4.0], [True, False, True, False], "abcd",
                                    ["1", "2", "3", "4"], np.array([1.5, 2.5, 3.5, 4.5]),
                                    torch.tensor([1.0, 2.0, 3.0, 4.0]), [[1, 2, 3, 4]], [None] * 4])
def test_non_integer_tokens_are_refused(tokens):
    """Issue 17 item 6: ``page_keys([1.5, 2.5]) == page_keys([1, 2])`` served float tokens an integer
    prefix's entry (numpy truncated them). Token ids are integers only: a typed error naming ``tokens``."""
    with pytest.raises(InvalidTypeError) as ei:
        page_keys(tokens, FP)
    assert ei.value.arg == "tokens"
    assert page_keys(np.array([1, 2, 3, 4]), FP) == page_keys([1, 2, 3, 4], FP) == page_keys(torch.arange(1, 5), FP)


VARIANTS = {
    "model_id": dict(model_id="test/other-model"),
    "layer_range": dict(layer_range=(0, 3)),
    "dtypes": dict(dtypes=("kv=float16", "state=int8")),
    "codec": dict(codec="lossless"),
    "page_size": dict(page_size=2),
    "layout_version": dict(layout_version=FP.layout_version + 1),
    "extra": dict(extra=(("kv", "4x2x64"),)),
}


@pytest.mark.parametrize("change", [*VARIANTS, "salt"])
def test_any_change_to_the_fingerprint_or_salt_gives_zero_hits(tmp_path, change):
    region = make_region(256, 32)
    base = StorageTier(FileStore(str(tmp_path)), FP, salt="t")
    keys = base.keys(TOKENS)
    slots = region.alloc(len(keys))
    fill_slots(region, slots, keys)
    assert all(wait_done(base, base.write(keys, Kind.KV, region, slots)).hits)
    assert all(wait_done(base, base.lookup(keys, Kind.KV)).hits)  # the control: same fingerprint hits

    fp = dataclasses.replace(FP, **VARIANTS[change]) if change != "salt" else FP
    other = StorageTier(FileStore(str(tmp_path)), fp, salt="u" if change == "salt" else "t")
    okeys = other.keys(TOKENS)
    assert not set(okeys) & set(keys)
    assert not any(wait_done(other, other.lookup(okeys, Kind.KV)).hits)
    dst = region.alloc(len(okeys))
    op = wait_done(other, other.prefetch(okeys, Kind.KV, region, dst))
    assert not any(op.hits) and not region.valid[dst].any()
    assert other.stats["absent"] == len(okeys) and other.stats["hit"] == 0
    base.close()
    other.close()


def test_from_specs_follows_every_spec_field():
    kv = KVSpec(num_layers=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    st = StateSpec(num_layers=3, temporal_shape=(4, 32, 32), temporal_dtype=torch.float32, conv_shapes=((64, 3),))
    fp = StorageFingerprint.from_specs("m", kv_spec=kv, state_spec=st, codec="int8", page_size=16)
    assert fp.layer_range == (0, 4) and "kv=bfloat16" in fp.dtypes and "state=float32" in fp.dtypes
    others = [
        StorageFingerprint.from_specs("m", kv_spec=dataclasses.replace(kv, head_dim=128), state_spec=st, page_size=16),
        StorageFingerprint.from_specs("m", kv_spec=dataclasses.replace(kv, dtype=torch.float16), state_spec=st,
                                      page_size=16),
        StorageFingerprint.from_specs("m", kv_spec=kv, state_spec=dataclasses.replace(st, temporal_shape=(4, 32, 16)),
                                      page_size=16),
        StorageFingerprint.from_specs("m", kv_spec=kv, state_spec=st, codec="lossless", page_size=16),
        StorageFingerprint.from_specs("m", kv_spec=kv, state_spec=st, page_size=32),
        StorageFingerprint.from_specs("m", kv_spec=kv, state_spec=st, page_size=16, layer_range=(2, 4)),
    ]
    digests = {fp.digest} | {o.digest for o in others}
    assert len(digests) == 1 + len(others)
    assert StorageFingerprint.from_specs("m", kv_spec=kv, state_spec=st, page_size=16).digest == fp.digest


@pytest.mark.parametrize("field, bad", [
    ("model_id", ""), ("layer_range", (3, 3)), ("layer_range", [0, 4]), ("dtypes", ["kv=bf16"]), ("codec", ""),
    ("page_size", 0), ("layout_version", -1), ("extra", (("a",),)),
])
def test_fingerprint_validates_fields(field, bad):
    with pytest.raises(InvalidArgumentError, match=field):
        dataclasses.replace(FP, **{field: bad})
