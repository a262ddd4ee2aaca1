"""Input checks and key parsing of ``HiMambaRadixCache``: every one raises before anything changes."""

from __future__ import annotations

from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import RadixKey


def common_len(node_key: list[int], key: list[int], start: int, end: int, page_size: int) -> int:
    """Tokens of ``node_key`` equal to ``key[start:end]``, rounded down to whole pages.

    List slices compare in C; the galloping step keeps a long partial match off the Python loop.
    """
    n = min(len(node_key), end - start)
    if n == len(node_key) and key[start:start + n] == node_key:
        return n
    i = 0
    while i + 64 <= n and key[start + i:start + i + 64] == node_key[i:i + 64]:
        i += 64
    while i < n and key[start + i] == node_key[i]:
        i += 1
    return i // page_size * page_size


def check_prev_prefix_len(prev: Any, n: int, page_size: int) -> None:
    """``InsertParams.prev_prefix_len``: a whole number of pages inside the key."""
    if not isinstance(prev, int) or isinstance(prev, bool) or not 0 <= prev <= n or prev % page_size:
        raise InvalidArgumentError("prev_prefix_len", f"a multiple of page_size={page_size} in [0, {n}]", prev)


def check_node(cache, node: Any) -> None:
    if not isinstance(node, TreeNode) or node.owner is not cache._token or not node.alive:
        raise InvalidArgumentError("node", "a live node of this cache", node)


def parse_key(key: Any) -> tuple[list[int], Optional[str]]:
    salt = None
    if isinstance(key, RadixKey):
        key, salt = key.token_ids, key.extra_key
        if salt is not None and not isinstance(salt, str):
            raise InvalidArgumentError("key.extra_key", "a str or None", salt)
    if isinstance(key, list):
        return key, salt
    if isinstance(key, torch.Tensor) and key.dim() == 1 and not key.dtype.is_floating_point:
        return key.tolist(), salt
    if isinstance(key, (tuple, range)):
        return list(key), salt
    raise InvalidArgumentError("key", "a RadixKey or a list of token ids", desc(key))


def state_slot(cache, arg: str, slot: Any) -> torch.Tensor:
    if isinstance(slot, int) and not isinstance(slot, bool):
        return torch.tensor([slot], dtype=torch.int64, device=cache.device)
    if (not isinstance(slot, torch.Tensor) or slot.numel() != 1 or slot.dtype not in (torch.int64, torch.int32)
            or slot.device != cache.device):
        raise InvalidArgumentError(arg, f"one T0 state slot id (int64 tensor on {cache.device})", desc(slot))
    return slot.reshape(1)


def check_state_allocated(cache, slot: torch.Tensor) -> None:
    if not 0 < int(slot) < cache.states.capacity or int(cache.states.translate(slot)) < 0:
        raise InvalidArgumentError("mamba_value", "an allocated T0 state slot", int(slot))


def check_callers_kv(cache, v: torch.Tensor) -> None:
    """``v`` (whole pages) must be allocated in T0, distinct, and not already the tree's (a few host syncs)."""
    ps = cache.page_size
    first = v[::ps]
    pages = first // ps
    if ps > 1:
        ok_shape = bool(torch.equal(v.view(-1, ps), first[:, None] + cache._offsets))
        ok_shape = ok_shape and bool((first % ps == 0).all())
    else:
        ok_shape = True
    if not ok_shape:
        raise InvalidArgumentError("value", f"whole KV pages (page*{ps} + 0..{ps - 1})", v[:16].tolist())
    if pages.numel() and (int(pages.min()) < 1 or int(pages.max()) >= cache.kv.capacity):
        raise InvalidArgumentError("value", f"KV ids of pages in [1, {cache.kv.capacity})", v[:16].tolist())
    bad = (cache.kv.translate(first) < 0) | cache._owned[pages]
    if bool(bad.any()) or torch.unique(pages).numel() != pages.numel():
        raise InvalidArgumentError("value", "KV ids the caller owns (allocated, distinct, not cached)",
                                   v[:16].tolist())


def desc(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return f"tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return x

