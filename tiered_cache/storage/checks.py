"""Argument checks of the storage tier's API: keys, kinds, payloads (typed errors naming the argument).

Wrong types are ``InvalidTypeError`` (also a ``TypeError``), wrong values ``InvalidArgumentError``;
both are raised before anything is submitted or marked, as everywhere in the package.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.storage.format import Kind
from tiered_cache.storage.keys import KEY_BYTES
from tiered_cache.validate import int_arg, is_int

_KINDS = [k.name for k in Kind]


def kind_arg(arg: str, value: Any) -> Kind:
    """``value`` as a ``Kind``: a ``Kind`` or its int value (not a str, float, bool or None)."""
    if not is_int(value):
        raise InvalidTypeError(arg, f"a Kind ({_KINDS})", value)
    try:
        return Kind(int(value))
    except ValueError:
        raise InvalidArgumentError(arg, f"a Kind ({_KINDS})", value) from None


def key_arg(arg: str, value: Any) -> bytes:
    if not isinstance(value, bytes):
        raise InvalidTypeError(arg, f"a {KEY_BYTES}-byte key from StorageTier.keys", value)
    if len(value) != KEY_BYTES:
        raise InvalidArgumentError(arg, f"a {KEY_BYTES}-byte key from StorageTier.keys", value)
    return value


def key_list(arg: str, keys: Any) -> list[bytes]:
    if not isinstance(keys, (list, tuple)):
        raise InvalidTypeError(arg, f"a list of {KEY_BYTES}-byte keys from StorageTier.keys", keys)
    lst = list(keys)
    bad = [k for k in lst if not isinstance(k, bytes)]
    if bad:
        raise InvalidTypeError(arg, f"a list of {KEY_BYTES}-byte keys from StorageTier.keys", bad[:4])
    if any(len(k) != KEY_BYTES for k in lst):
        raise InvalidArgumentError(arg, f"{KEY_BYTES}-byte keys from StorageTier.keys", lst[:4])
    return lst


def payload_list(arg: str, payloads: Any, n: int) -> list[np.ndarray]:
    """Bytes-like payloads as flat uint8 views (no copy)."""
    if not isinstance(payloads, (list, tuple)):
        raise InvalidTypeError(arg, f"a list of {n} bytes-like values", payloads)
    if len(payloads) != n:
        raise InvalidArgumentError(arg, f"{n} bytes-like values", len(payloads))
    out = []
    for p in payloads:
        try:
            mv = memoryview(p)
            out.append(np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8))
        except (TypeError, ValueError):
            raise InvalidTypeError(arg, "contiguous bytes-like values", p) from None
    return out


def entry_bytes_arg(arg: str, value: Optional[dict]) -> dict[Kind, int]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidTypeError(arg, "None or a dict {Kind: payload bytes}", value)
    return {kind_arg(arg, k): int_arg(arg, v, lo=0) for k, v in value.items()}
