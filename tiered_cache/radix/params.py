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
from collections.abc import Sequence
from typing import Any, NamedTuple, Optional

import torch


@dataclasses.dataclass
class RadixKey:
    """Token ids under an optional tenant salt (SGLang's ``extra_key``). Different salts share nothing."""

    token_ids: Sequence[int]
    extra_key: Optional[str] = None

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclasses.dataclass
class MatchPrefixParams:
    key: Any  # RadixKey, or a sequence of token ids (no salt)
    # Copy-on-write of the matched state into a T0 slot the request then owns (``req.mamba_pool_idx``).
    cow_mamba: bool = False
    req: Optional[Any] = None


class MatchResult(NamedTuple):
    """Result of ``match_prefix``.

    device_indices: T0 virtual KV ids of the usable prefix, cut back to the deepest node whose state
        is present (a hybrid model can resume only where a state exists).
    last_device_node: that node (the root on a miss); lock it with ``inc_lock_ref``.
    last_host_node / best_match_node: the same node until the host tier exists (issue 6).
    host_hit_length / mamba_host_hit_length: tokens / states to load back from host: 0 for now.
    mamba_branching_seqlen: where the next prefill should export a state (aligned to the checkpoint
        unit) so the longer KV match becomes a hit later; ``None`` when it would not lengthen the hit.
    kv_hit_length: tokens whose KV matched before the cut-back (not in SGLang; for stats and tests).
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


@dataclasses.dataclass
class InsertParams:
    key: Any = None  # RadixKey or a sequence of token ids
    value: Optional[torch.Tensor] = None  # T0 virtual KV ids, one per token of key
    mamba_value: Optional[Any] = None  # the caller's T0 state slot (state at position len(key))
    prev_prefix_len: int = 0  # value[:prev_prefix_len] are already the tree's ids (from a match)
    swa_evicted_seqlen: int = 0  # SWA mode (issue 6); ignored here
    chunked: bool = False
    priority: int = 0


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
    num_tokens: int = 0
    swa_num_tokens: int = 0
    mamba_num: int = 0


@dataclasses.dataclass
class EvictResult:
    num_tokens_evicted: int = 0  # KV tokens freed, including those of leaves a state eviction removed
    swa_num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


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
    best_match_node: Any
    host_hit_length: int
    mem_quota: Optional[int] = None
    req: Optional[Any] = None


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
