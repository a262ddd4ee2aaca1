"""``HiSWARadixCache``: the radix prefix cache of a sliding-window hybrid (full + SWA attention).

The same tree, tiers and API as ``HiMambaRadixCache`` (``facade.py``), over a T0 pool of full KV + SWA
KV (``UnifiedPool(KVSpec, KVSpec(window=W))``) and T2, with the SWA resume rule (``SWARule``): what a
hybrid needs to resume at a position is the SWA KV of the ``W`` tokens before it, so a node's payload
(``SWAPayload``) is its span's SWA KV, and a node whose SWA KV was freed is an *SWA tombstone*
(``payload.swa_tomb``)::

    tokens:   0 ........ p-W ......... p
    node:     [ tomb ][ SWA ][ SWA  ]      a match may end at p only if the SWA KV of
                      |<--- W ---->|       [max(0, p-W), p) is present (device, or host to load)

- A node's SWA KV lives where its full KV lives: on the device with it (``payload.swa_value``), on
  the host with it (``payload.swa_host``), or nowhere (tombstone). Backups, demotion and load back move both.
- ``evict(swa_num_tokens=n)`` frees SWA KV, LRU first: a node with no child on the device whose full
  and SWA KV are on the host is demoted (device pages freed, host copies kept: a later match is a host
  hit); otherwise an internal node becomes an SWA tombstone (its full KV stays, usable by longer
  matches) and a leaf goes whole (a leaf is never a tombstone).
- ``insert`` takes the caller's SWA ids (``InsertParams.swa_value``) as it takes full ids; SWA KV
  before ``swa_evicted_seqlen`` was freed by the caller as it slid out of the window: the span it
  covers is cached as tombstones.
- Locks: a locked path keeps its SWA KV (coarser than SGLang, which protects only the window).
- Matches end at node boundaries (SGLang splits nodes inside a match; here a match never writes).
"""

from __future__ import annotations

from typing import Any, Optional

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.radix import requests as _req
from tiered_cache.radix.facade import RadixCacheFacade
from tiered_cache.radix.host import HostTier, Stream, check_args
from tiered_cache.radix.params import HostTierConfig
from tiered_cache.radix.policy import EvictionPolicy
from tiered_cache.radix.swa_rule import SWARule


class HiSWARadixCache(RadixCacheFacade):
    """Radix prefix cache over a ``UnifiedPool`` of full + SWA KV (T0) and a ``HostMirror`` (T2).

    Args:
        pool: T0; ``pool.side(kv_side)`` full KV pages, ``pool.side(swa_side)`` SWA KV pages (same
            ``page_size``).
        window: tokens of SWA KV needed before a position (default: the SWA side's ``KVSpec.window``).
        host, transfer, host_config: as in ``HiMambaRadixCache``; the host needs a KV region of full
            page envelopes and one of SWA page envelopes (``host_config.kv_region`` / ``swa_region``).
    """

    def __init__(self, pool: Any, *, window: Optional[int] = None, kv_side: str = "full", swa_side: str = "swa",
                 policy: Optional[EvictionPolicy] = None, validate: bool = True, host: Any = None,
                 transfer: Any = None, host_config: Optional[HostTierConfig] = None) -> None:
        self._build_tree(pool, kv_side, policy, validate)
        self.swa = pool.side(swa_side)
        if not self.swa.is_kv or self.swa.page_size != self.page_size:
            raise InvalidArgumentError("swa_side", f"a KV side with page_size={self.page_size}", swa_side)
        w = self.swa.spec.window if window is None else window
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise InvalidArgumentError("window", "an int >= 1 (or a SWA KVSpec with window set)", w)
        self.window = w
        self.checkpoint_unit = self.page_size
        check_args(host, transfer, host_config, None)
        self.rule = rule = SWARule(self.tree, self.swa, w)
        self.tree.bind(rule)
        self.host_tier = HostTier(self.tree, host, transfer, host_config)
        self.swa_region = None
        if host is not None:
            self.swa_region = self.host_tier.region(self.host_tier.conf.swa_region, self.swa.entry_bytes, "swa_host")
            self.host_tier.add_stream(Stream("swa", _payload, "swa_value", "swa_pending", "swa_host",
                                             "swa_host_pending", self.swa, self.swa_region, "swa", "swa_host"))
        self._wire(rule, rule)
        rule.bind(self.host_tier, self.eviction)
        self.reset()

    def supports_mamba(self) -> bool:
        return False

    def swa_evictable_size(self) -> int:
        return sum(len(x.key) for x in self.policy.candidates("swa"))

    def cache_finished_req(self, req: Any, is_insert: bool = True, **kwargs: Any) -> None:
        """A request finished: cache its tokens, free the full and SWA ids it still owns (SWA ids
        before ``req.swa_evicted_seqlen`` it freed itself), release its lock (``requests.py``)."""
        _req.swa_cache_finished_req(self, req, is_insert)

    def cache_unfinished_req(self, req: Any, chunked: bool = False, **kwargs: Any) -> None:
        """A chunk of a prefill is done: cache what it wrote (full + SWA KV), point the request's prefix
        at the tree's ids, move its lock to the new end (as ``HiMambaRadixCache.cache_unfinished_req``).

        Afterwards ``req.kv_indices[:cache_protected_len]`` and ``req.swa_kv_indices[:cache_protected_len]``
        are the tree's (sink ids where the tree holds an SWA tombstone); the request owns the rest, and
        frees its own SWA ids as they slide out of the window (``req.swa_evicted_seqlen``) only at
        positions >= ``cache_protected_len``. The locked path keeps its SWA KV."""
        _req.swa_cache_unfinished_req(self, req, chunked)


def _payload(x: Any) -> Any:
    return x.payload
