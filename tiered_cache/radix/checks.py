"""Input checks and key parsing of the radix caches: every one raises before anything changes."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.radix.node import TreeNode
from tiered_cache.radix.params import InsertParams, RadixKey, checked_ids
from tiered_cache.tiers.protocols import StateSide
from tiered_cache.validate import _INT_TORCH, is_int


def common_len(node_key: Sequence[int], key: Sequence[int], start: int, end: int, page_size: int) -> int:
    """Tokens of ``node_key`` equal to ``key[start:end]``, rounded down to whole pages; both lists, or both
    int64 arrays (compared in C, without a Python int per token).

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


def insert_args(params: Any, page_size: int, device: Any, ids: tuple[str, ...],
                as_array: bool = False) -> tuple[Any, Any, int, int]:
    """An ``InsertParams``' key, its T0 ids (the fields ``ids``, one per token) and ``prev_prefix_len``,
    checked. -> (token ids: a list, an int64 array with ``as_array``; tenant salt, prev_prefix_len,
    page-aligned key length)."""
    if not isinstance(params, InsertParams):
        raise InvalidTypeError("params", "an InsertParams", type(params).__name__)
    toks, salt = (parse_key_array if as_array else parse_key)(params.key)
    n = len(toks)
    for arg in ids:
        check_value(arg, getattr(params, arg), n, device)
    check_prev_prefix_len(params.prev_prefix_len, n, page_size)
    if params.last_node is not None and type(params.last_node) is not TreeNode:
        raise InvalidTypeError("last_node", "a TreeNode (match_prefix's last_device_node) or None",
                               type(params.last_node).__name__)
    return toks, salt, int(params.prev_prefix_len), n // page_size * page_size


def req_slot(states: StateSide, validate: bool, req: Any) -> tuple[torch.Tensor, Optional[np.ndarray]]:
    """``req.mamba_pool_idx`` (set), checked: a T0 state slot the request holds, and where ``validate`` checked it
    is allocated, its id as a host array [1] (``check_state_allocated``), else None (its row is read where it is
    used: a side may compact before)."""
    slot = state_slot(states, "req.mamba_pool_idx", req.mamba_pool_idx)
    vid = check_state_allocated(states, slot, "req.mamba_pool_idx") if validate else None
    return slot, vid


def check_prev_prefix_len(prev: Any, n: int, page_size: int) -> None:
    """``InsertParams.prev_prefix_len``: a whole number of pages inside the key."""
    if type(prev) is int and 0 <= prev <= n and not prev % page_size:
        return  # the common case, without is_int's isinstance chain
    what = f"a multiple of page_size={page_size} in [0, {n}]"
    if not is_int(prev):
        raise InvalidTypeError("prev_prefix_len", what, prev)
    if not 0 <= int(prev) <= n or int(prev) % page_size:
        raise InvalidArgumentError("prev_prefix_len", what, prev)


def parse_key(key: Any, arg: str = "key") -> tuple[list[int], Optional[str]]:
    """-> (token ids as Python ints, tenant salt). Integers only (``validate.int_list``): a str, float,
    bool, None or nested sequence is an ``InvalidTypeError`` naming ``key`` (``key.token_ids``)."""
    toks, _, salt = _parse(key, arg, True)
    assert toks is not None
    return toks, salt


def parse_key_array(key: Any, arg: str = "key") -> tuple[array, Optional[str]]:
    """``parse_key`` with the ids as an int64 ``array``: a key made of an array (SGLang's ``Req`` holds
    one) is matched without making a Python int per token."""
    _, arr, salt = _parse(key, arg, False)
    return arr, salt


def _parse(key: Any, arg: str, want_list: bool) -> tuple[Optional[list[int]], array, Optional[str]]:
    salt, checked = None, None
    if isinstance(key, RadixKey):
        salt, checked = key.extra_key, key.checked()  # checked when made: not again on every call
        if salt is not None and not isinstance(salt, str):
            raise InvalidTypeError(f"{arg}.extra_key", "a str or None", salt)
        key, arg = key.token_ids, f"{arg}.token_ids"
    if checked is None:
        if key is None or isinstance(key, (str, bytes)):
            raise InvalidTypeError(arg, "a RadixKey or a sequence of int token ids", desc(key))
        checked = [key, *checked_ids(arg, key)]
    _, toks, arr = checked
    if arr is None:
        raise InvalidArgumentError(arg, "token ids in the int64 range",
                                   [t for t in toks if not -2**63 <= t < 2**63][:8])
    if want_list and toks is None:
        toks = checked[1] = arr.tolist()
    return toks, arr, salt


def state_slot(states: StateSide, arg: str, slot: Any) -> torch.Tensor:
    """One slot id of the T0 state side ``states`` (an int or a 1-element integer tensor on its device)
    as a tensor [1]. Slot 0 is the sink: never an active id."""
    if type(slot) is torch.Tensor and slot.dtype is torch.int64 and slot.dim() == 1 and slot.numel() == 1 \
            and same_device(slot, states.device):
        return slot  # the common case (an engine's slot tensor) in one condition, as the checks below pass it
    what = f"one T0 state slot id in [1, {states.capacity}) (an int or an int64 tensor on {states.device})"
    if is_int(slot) and not isinstance(slot, torch.Tensor):
        v = int(slot)
        if not 0 < v < states.capacity:
            raise InvalidArgumentError(arg, what, slot)
        return torch.tensor([v], dtype=torch.int64, device=states.device)
    if not isinstance(slot, torch.Tensor) or slot.dtype not in _INT_TORCH:
        raise InvalidTypeError(arg, what, desc(slot))
    if slot.numel() != 1 or not same_device(slot, states.device):
        raise InvalidArgumentError(arg, what, desc(slot))
    if slot.dtype is torch.int64 and slot.dim() == 1:
        return slot  # already the shape asked for: no view made (a torch call per match and insert)
    return slot.reshape(1) if slot.dtype in (torch.int64, torch.int32) else slot.reshape(1).to(torch.int64)


def check_state_allocated(states: StateSide, slot: torch.Tensor, arg: str = "mamba_value") -> np.ndarray:
    """-> the slot's id as a host int64 array [1] (``one_id``'s: read-only), checked: the caller reads its physical
    row with it where it uses it (``states.translate_host``: a side may compact in between), without reading the
    tensor again."""
    v = int(slot)
    if 0 < v < states.capacity:
        vid = one_id(v)
        if states.translate_host(vid)[0] >= 0:  # no launch
            return vid
    raise InvalidArgumentError(arg, "an allocated T0 state slot (slot 0 is the sink)", v)


_ONE: dict[int, np.ndarray] = {}
try:  # np.count_nonzero's C function, without its Python wrapper (a private module: numpy 2's layout)
    from numpy._core.multiarray import count_nonzero as _COUNT
except ImportError:  # numpy < 2, or a later layout: the public wrapper (the same counts, ~1 us slower)
    _COUNT = np.count_nonzero


def one_id(v: int) -> np.ndarray:
    """``np.array([v], dtype=np.int64)``, read-only, made once per id and kept: its dtype discovery is a numpy call
    of 1-5 us in the middle of each match and insert (a T0 state slot's id, a T1 slot's). ``v``: a slot id of a
    pool, checked in range by the caller (one array per slot: bounded by the pools' sizes)."""
    a = _ONE.get(v)
    if a is None:
        a = _ONE[v] = np.array([v], dtype=np.int64)
        a.flags.writeable = False
    return a


def check_callers_kv(tree: Any, v: torch.Tensor, arg: str = "value", lo: int = 0,
                     hi: Optional[int] = None, host: Optional[np.ndarray] = None) -> np.ndarray:
    """``v[lo:hi]`` (whole pages) must be allocated in T0, distinct, and not already the ``RadixTree``'s. One
    host copy of it (a device sync on a GPU; a numpy view on the CPU, sliced there: a torch slice costs
    more), then vectorised numpy over its pages. ``arg``: the caller's name for ``v`` in errors; ``host``:
    ``v.numpy()`` on the CPU, where the caller made it (one torch call less). -> its page ids (checked: the tree
    may free them through the trusted ``free_pages``)."""
    ps = tree.page_size
    if host is None:
        host, lo, hi = (v.numpy(), lo, hi) if v.is_cpu else (v[lo:hi].cpu().numpy(), 0, None)
    toks, first = host[lo:hi], host[lo:hi:ps]  # each page's first id: one view, not a slice of the slice
    pages = first // tree.ps0  # a 0-d operand: numpy's cheaper path for an array than for a Python int
    # whole pages: the ids equal page*ps + 0..ps-1, compared as bytes (one memcmp, no bool array; a step-1
    # slice of a 1-D tensor's view is contiguous)
    if ps > 1 and toks.tobytes() != ((pages * tree.ps0)[:, None] + tree.offsets).tobytes():
        raise InvalidArgumentError(arg, f"whole KV pages (page*{ps} + 0..{ps - 1})", toks[:16].tolist())
    lst = pages.tolist()  # a few dozen pages: Python's min, max and set beat numpy's calls
    if lst and (min(lst) < 1 or max(lst) >= tree.kv.capacity):
        raise InvalidArgumentError(arg, f"KV ids of pages in [1, {tree.kv.capacity})", toks[:16].tolist())
    # count_nonzero's C function (np.count_nonzero is a Python wrapper) and Python's min over the list: ndarray.any()
    # and .min() go through Python wrappers
    if lst and (len(set(lst)) != len(lst) or _COUNT(tree.owned[pages])
                or min(tree.kv.translate_host(first).tolist()) < 0):
        raise InvalidArgumentError(arg, "KV ids the caller owns (allocated, distinct, not cached)", toks[:16].tolist())
    return pages


def check_value(arg: str, value: Any, n: int, device: Any) -> None:
    """``value``: one T0 KV id per token of an ``n``-token key, a 1-D int64 tensor on ``device``."""
    if type(value) is torch.Tensor and value.dtype is torch.int64 and value.dim() == 1 and value.numel() == n \
            and same_device(value, device):
        return  # the common case in one condition; the branches below name what is wrong
    if not isinstance(value, torch.Tensor):
        raise InvalidTypeError(arg, "a 1-D int64 tensor of KV ids", desc(value))
    if value.dtype != torch.int64:
        raise InvalidTypeError(arg, "a 1-D int64 tensor of KV ids", desc(value))
    if value.dim() != 1:
        raise InvalidArgumentError(arg, "a 1-D int64 tensor of KV ids", desc(value))
    if not same_device(value, device):
        raise InvalidArgumentError(arg, f"a tensor on {device}", value.device)
    if value.numel() != n:
        # The two disagree: either may be the wrong one, so the error names both.
        raise InvalidArgumentError(f"key, {arg}", f"one KV id per token ({n} tokens)", f"{value.numel()} ids")


_CPU = torch.device("cpu")


def same_device(t: torch.Tensor, device: torch.device) -> bool:
    """``t.device == device``; for the CPU by ``is_cpu`` (``t.device`` makes a device object: ~1 us a call)."""
    return t.is_cpu if device == _CPU else t.device == device


def desc(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return f"tensor(shape={tuple(x.shape)}, dtype={x.dtype}, device={x.device})"
    return x

