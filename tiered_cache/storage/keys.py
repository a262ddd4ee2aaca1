"""Content-addressed keys of T3 entries: a chained SHA-256 over token pages.

Page ``i``'s key names the whole prefix ``tokens[: (i + 1) * page_size]``, not the page alone: a KV
page (and a state at a page's end) is only valid after exactly the tokens before it. The chain is
seeded with everything that changes the stored bytes and with the tenant, so two configurations or
two tenants never share a key::

    seed   = SHA-256("tiered-cache/t3/seed/v2" | fingerprint digest | field(salt) | field(extra_key))
    field(None) = 0x00;  field(str s) = 0x01 | u64 len | UTF-8(s);  field(bytes b) = 0x02 | u64 len | b
    key[0] = SHA-256(seed     | page 0 tokens as int64 little-endian)
    key[i] = SHA-256(key[i-1] | page i tokens as int64 little-endian)

The fingerprint covers model id, layer range, dtypes, codec, page size, layout version and, through
``from_specs``, the shapes of the specs. A tenant is the pair (the tier's ``salt``, the request's
``extra_key``), the same pair the radix tree keys its root by: each field carries a presence/type byte
and a length, so no two distinct pairs give the same seed bytes (``None`` and ``""`` differ, and so
do ``("ab", "c")`` and ``("a", "bc")``, ``"x"`` and ``b"x"``). Seeds of the v1 derivation (which
mapped ``None`` and ``""`` alike and took no request key) are under another tag, so their entries
are never read under v2 keys. A
value's header also carries the first bytes of the fingerprint digest and the key itself, so a value
written under the wrong key (or by another model) is recognised when read and counted as ``foreign``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Optional, Union

import numpy as np

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.validate import int_arg, int_list

# Bump when the byte layout of any stored envelope changes (specs.py field order, alignment, codec).
# 2: the int8 codes of value-axis-2 states kept in the state's [d_k, d_v] order (were [d_v, d_k]).
LAYOUT_VERSION = 2
KEY_BYTES = 32

Salt = Union[str, bytes, None]


@dataclass(frozen=True)
class StorageFingerprint:
    """Everything that changes the bytes of a stored entry. Equal fingerprints <=> shareable entries.

    ``dtypes``: names of every dtype in an envelope (e.g. ``("kv=bfloat16", "state=float32")``);
    ``layer_range``: ``(first, end)`` of the layers this store holds (pipeline stages keep apart);
    ``extra``: any further ``(name, value)`` pairs, e.g. spec shapes (``from_specs`` fills it).
    """

    model_id: str
    layer_range: tuple[int, int]
    dtypes: tuple[str, ...]
    codec: str
    page_size: int
    layout_version: int = LAYOUT_VERSION
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for arg in ("model_id", "codec"):
            v = getattr(self, arg)
            if not isinstance(v, str):
                raise InvalidTypeError(arg, "a non-empty str", v)
            if not v:
                raise InvalidArgumentError(arg, "a non-empty str", v)
        lr = self.layer_range
        if not isinstance(lr, tuple) or len(lr) != 2 or not all(type(x) is int for x in lr):
            raise InvalidTypeError("layer_range", "a tuple (first, end) of ints with 0 <= first < end", lr)
        if not 0 <= lr[0] < lr[1]:
            raise InvalidArgumentError("layer_range", "a tuple (first, end) of ints with 0 <= first < end", lr)
        if not isinstance(self.dtypes, tuple) or not all(isinstance(d, str) for d in self.dtypes):
            raise InvalidTypeError("dtypes", "a tuple of str", self.dtypes)
        # plain ints (a numpy int would not JSON-encode into the digest)
        object.__setattr__(self, "page_size", int_arg("page_size", self.page_size, lo=1))
        object.__setattr__(self, "layout_version", int_arg("layout_version", self.layout_version, lo=0))
        if not isinstance(self.extra, tuple) or not all(
                isinstance(p, tuple) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in self.extra):
            raise InvalidArgumentError("extra", "a tuple of (str, str) pairs", self.extra)

    @classmethod
    def from_specs(cls, model_id: str, *, kv_spec=None, state_spec=None, codec: str = "int8",
                   page_size: int, layer_range: Optional[tuple[int, int]] = None,
                   layout_version: int = LAYOUT_VERSION) -> StorageFingerprint:
        """The fingerprint of a cache built from ``KVSpec`` / ``StateSpec``: dtypes and shapes from the specs."""
        from tiered_cache.specs import KVSpec, StateSpec

        if kv_spec is not None and not isinstance(kv_spec, KVSpec):
            raise InvalidTypeError("kv_spec", "None or a KVSpec", kv_spec)
        if state_spec is not None and not isinstance(state_spec, StateSpec):
            raise InvalidTypeError("state_spec", "None or a StateSpec", state_spec)
        for arg, v in (("model_id", model_id), ("codec", codec)):
            if not isinstance(v, str):
                raise InvalidTypeError(arg, "a non-empty str", v)
        dtypes: list[str] = []
        extra: list[tuple[str, str]] = []
        n_layers = 0
        if kv_spec is not None:
            dtypes.append(f"kv={str(kv_spec.dtype).removeprefix('torch.')}")
            extra.append(("kv", f"{kv_spec.num_layers}x{kv_spec.kv_heads}x{kv_spec.head_dim}/"
                                f"{kv_spec.v_head_dim} window={kv_spec.window}"))
            n_layers = max(n_layers, kv_spec.num_layers)
        if state_spec is not None:
            dtypes.append(f"state={str(state_spec.temporal_dtype).removeprefix('torch.')}")
            dtypes.append(f"conv={str(state_spec.conv_dtype).removeprefix('torch.')}")
            extra.append(("state", f"{state_spec.num_layers}x{state_spec.temporal_shape} conv={state_spec.conv_shapes}"
                                   f" value_axis={state_spec.value_axis}"))
            n_layers = max(n_layers, state_spec.num_layers)
        if not dtypes:
            raise InvalidArgumentError("kv_spec/state_spec", "at least one spec", None)
        return cls(model_id, layer_range or (0, n_layers), tuple(dtypes), codec, page_size, layout_version,
                   tuple(extra))

    @cached_property
    def digest(self) -> bytes:
        """SHA-256 of a canonical JSON encoding of every field (order-independent, unambiguous)."""
        doc = {"model_id": self.model_id, "layer_range": list(self.layer_range), "dtypes": list(self.dtypes),
               "codec": self.codec, "page_size": self.page_size, "layout_version": self.layout_version,
               "extra": [list(p) for p in self.extra]}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).digest()

    @property
    def tag(self) -> bytes:
        """The 16 bytes of the digest that every stored header carries."""
        return self.digest[:16]


_SEED_TAG = b"tiered-cache/t3/seed/v2\0"


def tenant_field(arg: str, value: Salt) -> bytes:
    """The unambiguous encoding of one tenant field: presence/type byte, u64 length, bytes."""
    if value is None:
        return b"\x00"
    if isinstance(value, str):
        # surrogatepass: every str (even one with lone surrogates) has exactly one encoding
        raw, typ = value.encode("utf-8", "surrogatepass"), b"\x01"
    elif isinstance(value, bytes):
        raw, typ = value, b"\x02"
    else:
        raise InvalidTypeError(arg, "None, str or bytes", value)
    return typ + len(raw).to_bytes(8, "little") + raw


def chain_seed(fingerprint: StorageFingerprint, salt: Salt = None, extra_key: Salt = None) -> bytes:
    """The chain's seed for one fingerprint and one tenant (tier ``salt``, request ``extra_key``)."""
    return hashlib.sha256(_SEED_TAG + fingerprint.digest + tenant_field("salt", salt)
                          + tenant_field("extra_key", extra_key)).digest()


def page_keys(tokens: Sequence[int], fingerprint: StorageFingerprint, salt: Salt = None, *,
              extra_key: Salt = None, parent: Optional[bytes] = None) -> list[bytes]:
    """One 32-byte key per whole page of ``tokens`` (a trailing partial page gets none).

    ``salt``: the tier's tenant salt; ``extra_key``: the request's (``RadixKey.extra_key``).
    ``parent``: the key of the page before ``tokens[0]`` (to extend a chain from a tree node without
    rehashing its ancestors; it already binds the tenant); ``None`` starts from the seed.
    """
    if not isinstance(fingerprint, StorageFingerprint):
        raise InvalidTypeError("fingerprint", "a StorageFingerprint", fingerprint)
    ps = fingerprint.page_size
    # Integers only: np.asarray would truncate 1.5 to 1 and serve an integer prefix's entry.
    toks = int_list("tokens", tokens)
    try:
        arr = np.asarray(toks, dtype=np.int64)
    except OverflowError:
        raise InvalidArgumentError("tokens", "token ids that fit in int64", max(toks, key=abs)) from None
    if parent is not None and not isinstance(parent, bytes):
        raise InvalidTypeError("parent", f"None or a {KEY_BYTES}-byte key", parent)
    if parent is not None and len(parent) != KEY_BYTES:
        raise InvalidArgumentError("parent", f"None or a {KEY_BYTES}-byte key", parent)
    seed = chain_seed(fingerprint, salt, extra_key)  # checks both tenant fields even when parent is given
    raw = arr.astype("<i8").tobytes()
    page = ps * 8
    h = parent if parent is not None else seed
    out = []
    for i in range(len(arr) // ps):
        h = hashlib.sha256(h + raw[i * page:(i + 1) * page]).digest()
        out.append(h)
    return out
