"""Parameter and result types of the prefix-cache interface (after SGLang's ``base_prefix_cache.py``).

An engine written against SGLang's ``BasePrefixCache`` passes the same dataclasses; the fields a
Mamba-style hybrid cache reads are kept, with their SGLang names, plus the few this cache adds
(``InsertResult.cached_len``, ``MatchResult.kv_hit_length``).

Ownership, in one place (see ``HiMambaRadixCache`` for the full contract):

- KV ids passed to ``insert`` in ``value[prev_prefix_len:]`` belong to the caller. The tree frees the
  duplicates ``value[prev_prefix_len:prefix_len]`` and takes ``value[prefix_len:cached_len]``; the
  caller keeps ``value[cached_len:]``.
- ``mamba_value`` is the caller's T0 (active) state slot. The tree never takes it: it stores an int8
  (or lossless) copy in a T1 slot it owns. The caller always keeps its T0 slot.
"""

from __future__ import annotations

import dataclasses
from array import array
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch

from tiered_cache.config import PREFETCH_POLICIES, WRITE_POLICIES
from tiered_cache.errors import InvalidTypeError
from tiered_cache.validate import choice_arg, float_arg, int_arg, int_list


def checked_ids(arg: str, values: Any) -> tuple[Optional[list[int]], Optional[array]]:
    """Token ids ``values`` checked (integers only: ``validate.int_list``'s typed errors) -> (them as a list,
    or None when they came as an integer ``array`` and no list was needed; them as an int64 ``array``, or
    None when one does not fit int64). An array is copied in C: no Python int is made per id."""
    if isinstance(values, array) and values.typecode in "bBhHiIlLqQ":
        try:
            return None, values[:] if values.typecode == "q" else array("q", values)
        except OverflowError:
            return values.tolist(), None
    ids = int_list(arg, values)
    try:
        return ids, array("q", ids)
    except OverflowError:
        return ids, None


def _bool(arg: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise InvalidTypeError(arg, "a bool", v)


def _salt(arg: str, v: Any) -> None:
    if v is not None and not isinstance(v, str):
        raise InvalidTypeError(arg, "a str or None", v)


@dataclasses.dataclass
class RadixKey:
    """Token ids under an optional tenant salt (SGLang's ``extra_key``). Different salts share nothing.

    The ids are checked (integers only, ``validate.int_list``) and copied once, when the key is made;
    the cache reads that copy, so a long prompt is not checked again on every call. Assign a new
    ``token_ids`` to change the key (it is then checked again when read); changing the given list in
    place afterwards does not change the key."""

    token_ids: Sequence[int]
    extra_key: Optional[str] = None
    _checked: list = dataclasses.field(init=False, repr=False, compare=False)  # [of, list or None, array or None]

    def __post_init__(self) -> None:
        if self.token_ids is None or isinstance(self.token_ids, (str, bytes)):
            raise InvalidTypeError("token_ids", "a sequence of int token ids", self.token_ids)
        self._checked = [self.token_ids, *checked_ids("token_ids", self.token_ids)]
        _salt("extra_key", self.extra_key)

    def checked(self) -> Optional[list]:
        """The ids as checked when the key was made: [token_ids then, a list or None, an int64 array or None
        (not in range)], or None when ``token_ids`` was reassigned since. The cache keeps a list it makes
        in slot 1."""
        return self._checked if self.token_ids is self._checked[0] else None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass
class MatchPrefixParams:
    key: Any  # RadixKey, or a sequence of token ids (no salt)
    # Copy-on-write of the matched state into a T0 slot the request then owns (``req.mamba_pool_idx``).
    cow_mamba: bool = False
    req: Optional[Any] = None

    def __post_init__(self) -> None:
        _bool("cow_mamba", self.cow_mamba)


class MatchResult(NamedTuple):
    """Result of ``match_prefix``.

    device_indices: T0 virtual KV ids of the prefix usable from the device alone: KV on the device
        and cut back to the deepest node whose state is in T1 (SWA mode: whose window's SWA KV is on
        the device). A hybrid model can resume only there.
    last_device_node: that node (the root on a miss); lock it with ``inc_lock_ref``.
    best_match_node: the deepest node the prefix can resume at from any tier: the anchor to pass to
        ``init_load_back``. The same as ``last_device_node`` when the host adds nothing.
    last_host_node: the deepest node up to ``best_match_node`` whose KV has a host copy (root if none).
    host_hit_length: tokens from ``last_device_node`` to ``best_match_node`` (what ``init_load_back``
        returns ids for; those whose KV is still on the device are returned without a copy).
    mamba_host_hit_length: 1 when the state at ``best_match_node`` must come from T2, else 0.
    swa_host_hit_length: SWA mode: SWA tokens among them to load from T2.
    swa_device_indices: SWA mode: the SWA ids of ``device_indices`` (not in SGLang, which maps full
        ids to SWA ids in its allocator; here the two sides allocate apart).
    mamba_branching_seqlen: where the next prefill should export a state (aligned to the checkpoint
        unit) so the longer KV match becomes a hit later; ``None`` when it would not lengthen the hit.
    kv_hit_length: tokens whose KV matched in any tier before the cut-back (not in SGLang; for stats).
    """

    device_indices: torch.Tensor
    last_device_node: Any
    last_host_node: Any
    best_match_node: Any
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    swa_branching_seqlen: Optional[int] = None
    mamba_host_hit_length: int = 0
    mamba_branching_seqlen: Optional[int] = None
    cache_protected_len: Optional[int] = None
    kv_hit_length: int = 0
    swa_device_indices: Optional[torch.Tensor] = None  # SWA mode: SWA ids beside device_indices (sink ids
    # for tokens of SWA tombstones, which are outside every window the match needs)


@dataclasses.dataclass
class InsertParams:
    key: Any = None  # RadixKey or a sequence of token ids
    value: Optional[torch.Tensor] = None  # T0 virtual KV ids, one per token of key
    mamba_value: Optional[Any] = None  # the caller's T0 state slot (state at position len(key))
    prev_prefix_len: int = 0  # value[:prev_prefix_len] are already the tree's ids (from a match)
    # SWA mode: the caller's SWA KV ids, one per token of key; those before swa_evicted_seqlen were
    # freed by the caller already (slid out of the window) and are ignored: that span is tombstoned.
    swa_value: Optional[torch.Tensor] = None
    swa_evicted_seqlen: int = 0
    chunked: bool = False
    priority: int = 0
    # The node this key's request holds from its match (``MatchResult.last_device_node``, SGLang's
    # ``req.last_node``) or its last insert, or None: the Mamba tree starts its walk there when it proves the path
    # still holds the key's first tokens (``walks.hinted``), else at the root: a node evicted since, split, of
    # another salt or another tree is no error, only no hint (the walk from the root is always right); anything
    # but a TreeNode is a typed error. Not in SGLang.
    last_node: Optional[Any] = None

    def __post_init__(self) -> None:
        for arg in ("prev_prefix_len", "swa_evicted_seqlen"):
            setattr(self, arg, int_arg(arg, getattr(self, arg), lo=0))
        _bool("chunked", self.chunked)
        self.priority = int_arg("priority", self.priority)


@dataclasses.dataclass
class InsertResult:
    """prefix_len: tokens of the key already cached before this insert (their duplicates freed).
    cached_len: tokens of the key cached after it; the tree took ``value[prefix_len:cached_len]``.
    mamba_exist: the end node already had a state, so none was stored (the caller keeps its slot,
    as it always does here). mamba_stored: a T1 copy of the caller's state was stored.
    last_device_node: the node ending at ``cached_len`` (the root when 0)."""

    prefix_len: int
    cached_len: int = 0
    mamba_exist: bool = False
    mamba_stored: bool = False
    last_device_node: Any = None


@dataclasses.dataclass
class EvictParams:
    num_tokens: int = 0  # T0 KV tokens (demoted to T2 when backed up, else dropped)
    swa_num_tokens: int = 0  # T0 SWA KV tokens (SWA mode: tombstoned)
    mamba_num: int = 0  # T1 states (demoted to T2 when it has room, else dropped)
    host_num_tokens: int = 0  # T2 KV tokens (dropped; not in SGLang)
    host_mamba_num: int = 0  # T2 states (dropped; not in SGLang)

    def __post_init__(self) -> None:
        if counts_ok(self):
            return  # the common case in one condition: int_arg would return each as it is
        for name in _EVICT_FIELDS:
            setattr(self, name, int_arg(name, getattr(self, name), lo=0))


def counts_ok(p: EvictParams) -> bool:
    """Every count of ``p`` a plain int >= 0 (``int_arg``'s answer for each, without its calls): ``__post_init__``
    and ``Eviction.evict`` (a field may be set after construction) take the typed errors' path otherwise."""
    a, b, c, d, e = p.num_tokens, p.swa_num_tokens, p.mamba_num, p.host_num_tokens, p.host_mamba_num
    return (type(a) is int and type(b) is int and type(c) is int and type(d) is int and type(e) is int
            and a >= 0 and b >= 0 and c >= 0 and d >= 0 and e >= 0)


_EVICT_FIELDS = tuple(f.name for f in dataclasses.fields(EvictParams))


@dataclasses.dataclass
class EvictResult:
    num_tokens_evicted: int = 0  # T0 KV tokens freed, including those of leaves a state eviction removed
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0  # T1 states freed (demoted or dropped)
    host_num_tokens_evicted: int = 0
    host_mamba_num_evicted: int = 0


@dataclasses.dataclass
class DecLockRefParams:
    node_id: Optional[int] = None


@dataclasses.dataclass
class IncLockRefResult:
    delta: int = 0  # change in full_evictable_size (<= 0)
    node_id: Optional[int] = None

    def to_dec_params(self) -> DecLockRefParams:
        return DecLockRefParams(node_id=self.node_id)


@dataclasses.dataclass
class DecLockRefResult:
    delta: int = 0  # change in full_evictable_size (>= 0)


@dataclasses.dataclass
class InitLoadBackParams:
    """``best_match_node`` / ``host_hit_length`` from ``match_prefix``. ``mem_quota``: most T0 tokens the
    load may take. ``req``: receives the T0 state slot (``req.mamba_pool_idx``, allocated when None)
    and the load's handle (``req.load_back``); needed whenever a state must be loaded."""

    best_match_node: Any
    host_hit_length: int
    mem_quota: Optional[int] = None
    req: Optional[Any] = None

    def __post_init__(self) -> None:
        self.host_hit_length = int_arg("host_hit_length", self.host_hit_length, lo=0)
        if self.mem_quota is not None:
            self.mem_quota = int_arg("mem_quota", self.mem_quota, lo=0)


@dataclasses.dataclass(frozen=True)
class HostTierConfig:
    """How the tree uses T2.

    write_policy: when KV is copied to host: ``write_through`` (when cached), ``write_through_selective``
        (once a node was matched ``write_through_threshold`` times), ``write_back`` (when evicted).
    load_back_threshold: a host hit whose state is already on the device (T1) and whose host KV is
        shorter than this many tokens is not loaded (recomputing it is cheaper than the round trip).
    kv_region / state_region / swa_region: names of the ``HostMirror`` regions.
    storage_write_through: with T3, KV copied to T2 and states cached go to T3 at once (False: only
        what eviction demotes to T2). prefetch_policy: a match that misses T2 fetches from T3
        ``best_effort`` (in the background; a later match hits), ``wait_complete`` (the match waits,
        bounded) or ``timeout`` (waits up to ``prefetch_timeout_s``, then goes on in the background).
    """

    write_policy: str = "write_through"
    write_through_threshold: int = 2
    load_back_threshold: int = 0
    kv_region: str = "full"
    state_region: str = "state"
    swa_region: str = "swa"
    storage_write_through: bool = True
    prefetch_policy: str = "best_effort"
    prefetch_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        choice_arg("write_policy", self.write_policy, WRITE_POLICIES)
        for arg in ("write_through_threshold", "load_back_threshold"):
            int_arg(arg, getattr(self, arg), lo=0)
        for arg in ("kv_region", "state_region", "swa_region"):
            if not isinstance(getattr(self, arg), str):
                raise InvalidTypeError(arg, "a region name (str)", getattr(self, arg))
        _bool("storage_write_through", self.storage_write_through)
        choice_arg("prefetch_policy", self.prefetch_policy, PREFETCH_POLICIES)
        float_arg("prefetch_timeout_s", self.prefetch_timeout_s, lo=0.0, lo_open=True)


@dataclasses.dataclass
class CacheReq:
    """The request fields ``cache_finished_req`` / ``cache_unfinished_req`` and a ``cow_mamba`` match use.

    SGLang reads these from ``Req`` plus its ``req_to_token_pool`` row; here the row is
    ``kv_indices``. Any object with these attributes works.

    token_ids: the tokens whose KV the request has written (committed tokens, or ``fill_ids``).
    kv_indices: the request's T0 virtual KV ids, whole pages, covering at least ``token_ids``.
        ``kv_indices[:cache_protected_len]`` are the tree's (from a match); the rest are the request's.
    mamba_pool_idx: the request's T0 state slot (a 1-element LongTensor), or None; its state is the
        one at position ``len(token_ids)``.
    last_node: the node the request holds locked (from ``match_prefix`` + ``inc_lock_ref``), or None.
    extra_key: tenant salt.
    """

    token_ids: list[int]
    kv_indices: torch.Tensor
    mamba_pool_idx: Optional[torch.Tensor] = None
    last_node: Any = None
    cache_protected_len: int = 0
    prefix_indices: Optional[torch.Tensor] = None
    extra_key: Optional[str] = None

    def __post_init__(self) -> None:
        if self.token_ids is None or isinstance(self.token_ids, (str, bytes)):
            raise InvalidTypeError("token_ids", "a sequence of int token ids", self.token_ids)
        int_list("token_ids", self.token_ids)
        if not isinstance(self.kv_indices, torch.Tensor):
            raise InvalidTypeError("kv_indices", "a 1-D int64 tensor of KV ids", type(self.kv_indices).__name__)
        self.cache_protected_len = int_arg("cache_protected_len", self.cache_protected_len, lo=0)
        _salt("extra_key", self.extra_key)
