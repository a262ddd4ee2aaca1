"""``TieredCache``: the one door to the cache. It builds the tiers from a ``CacheConfig`` and plain specs,
owns them, and hands out T0 room with eviction.

What ``TieredCache.build`` assembles, top to bottom::

    radix tree      HiMambaRadixCache (KV + recurrent states)  |  HiSWARadixCache (full + SWA KV)
    T0  UnifiedPool one device buffer: full KV pages (low side) + state slots or SWA pages (high side)
    T1  Int8CheckpointPool   the tree's states, int8 or lossless      (state models only)
    T2  HostMirror + TransferEngine   pinned host pages and states    (cfg.host_kv_pages > 0)
    T3  StorageTier over storage.open_backend(cfg.storage_url)        (state models, with T2)

An engine asks the stack for T0 room (``alloc_kv`` / ``alloc_states`` / ``alloc_swa``: allocate; when
the side is full, evict from the tree just enough and retry; ``None`` when eviction frees nothing
more) and talks to ``tree`` for everything else (match, insert, locks, load back). The parts are
read-only properties for callers that need them (an engine writes KV into ``kv``'s views).

Counting: T1 counts its own stores and loads (``Int8CheckpointPool.stats``), the transfer engine and T3
theirs; the stack's eviction policy counts its victims per resource, so ``stats()`` gives one dict of
what moved and what was evicted, and nobody needs to subclass a tier to learn it.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Optional, Union

import torch

from tiered_cache import device as dev
from tiered_cache.config import CacheConfig
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.parallel.agree import attach
from tiered_cache.parallel.group import TPGroup
from tiered_cache.radix import HiMambaRadixCache, HiSWARadixCache, HostTierConfig, LRUPolicy
from tiered_cache.radix.params import EvictParams
from tiered_cache.radix.placement import CheckpointPlacement
from tiered_cache.radix.policies import StateAdmission, make_policy, stack_costs
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.storage import StorageFingerprint, StorageTier, open_backend
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool
from tiered_cache.tiers.host_mirror import HostMirror, RegionSpec
from tiered_cache.tiers.unified_pool import SubPool, UnifiedPool
from tiered_cache.transfer.engine import TransferEngine
from tiered_cache.validate import instance_arg, int_arg, str_arg


class CountingLRUPolicy(LRUPolicy):
    """``LRUPolicy`` that counts its victims per resource: ``counts["kv"]`` device KV nodes evicted (demoted
    to T2 or dropped), ``"state"`` T1 states, ``"swa"`` device SWA KV, ``"kv_host"`` / ``"state_host"`` T2
    copies dropped. The tree asks ``pop`` once per victim, so these are the evictions per tier."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def pop(self, resource: str) -> Optional[Any]:
        x = super().pop(resource)
        if x is not None:
            self.counts[resource] += 1
        return x


# CacheConfig.eviction_policy -> the policy class the stack gives the tree (each counts its victims); the
# cost-aware ones come from radix.policies.make_policy.
_POLICIES = {"lru": CountingLRUPolicy}
Tree = Union[HiMambaRadixCache, HiSWARadixCache]


class TieredCache:
    """The tiers of one model's cache and the radix tree over them. Build with ``TieredCache.build``;
    ``close()`` (or a ``with`` block) stops T3's workers and closes its backend."""

    def __init__(self, cfg: CacheConfig, pool: Any, tree: Tree, policy: Any, *,
                 t1: Optional[Int8CheckpointPool], host: Optional[HostMirror], transfer: Optional[TransferEngine],
                 storage: Optional[StorageTier], owns_storage: bool, kv_side: str = "full",
                 state_side: str = "mamba") -> None:
        self._cfg, self._pool, self._tree, self._policy = cfg, pool, tree, policy
        self._t1, self._host, self._transfer, self._storage = t1, host, transfer, storage
        self._owns_storage = owns_storage
        self._kv = pool.side(kv_side)
        self._states = pool.side(state_side) if t1 is not None else None
        self._swa = pool.side("swa") if t1 is None else None
        # UnifiedPool's sides share one buffer (evicting KV makes state room); a given T0's may not.
        self._shared = isinstance(pool, UnifiedPool) or bool(getattr(pool, "sides_share_bytes", False))
        self._closed = False

    @classmethod
    def build(cls, cfg: CacheConfig, *, kv: KVSpec, state: Optional[StateSpec] = None, swa: Optional[KVSpec] = None,
              device: dev.DeviceLike = None, model_id: Optional[str] = None, storage: Optional[StorageTier] = None,
              placement: Optional[CheckpointPlacement] = None, tp: Optional[TPGroup] = None) -> TieredCache:
        """The tiers ``cfg`` asks for, for a model whose full-attention layers hold ``kv`` and whose other
        layers hold either recurrent states (``state``) or sliding-window KV (``swa``, its ``window`` set).

        device: where T0 and T1 live (default: CUDA when there is one). model_id: the model part of the
        T3 fingerprint (needed with ``cfg.storage_url``): entries of another model are never served.
        storage: a ``StorageTier`` the caller built and closes (instead of ``cfg.storage_url``).
        placement: the tree's mid-prefill checkpoint rule (state models; default from checkpoint_unit).
        tp: this rank's ``parallel.TPGroup`` under tensor parallelism: ``kv``, ``state`` and ``swa`` are
        the model's whole specs and the tiers hold this rank's share of the heads (``spec.shard``), as
        many slots as ``cfg`` says (so ``1/tp`` of the bytes), T3 entries under a fingerprint that names
        the rank and the group size, and the tree agrees with the other ranks (``parallel.agree``).
        Bad input raises a typed error naming the argument (or the ``cfg`` field) before anything is built.
        """
        instance_arg("tp", tp, TPGroup, "a parallel.TPGroup", none_ok=True)
        if tp is not None and tp.size > 1:
            kv = instance_arg("kv", kv, KVSpec, "a KVSpec").shard(tp.size)
            state = None if state is None else instance_arg("state", state, StateSpec, "a StateSpec").shard(tp.size)
            swa = None if swa is None else instance_arg("swa", swa, KVSpec, "a KVSpec").shard(tp.size)
        high = _check_build(cfg, kv, state, swa, model_id, storage, placement)
        device = dev.resolve(device)
        mem, backend = cfg.check_memory, cfg.backend
        swa_pages = cfg.kv_pages if cfg.swa_pages is None else cfg.swa_pages
        high_slots = cfg.t0_states if state is not None else swa_pages
        pool = UnifiedPool(kv, high, low_slots=cfg.kv_pages, high_slots=high_slots, page_size=cfg.page_size,
                           device=device, lazy_compaction=cfg.lazy_compaction, backend=backend, check_memory=mem)
        return cls._assemble(cfg, pool, kv, state, device, model_id, storage, placement, "full", "mamba", tp,
                             cfg.kv_pages)

    @classmethod
    def build_on(cls, cfg: CacheConfig, t0: Any, *, kv_side: str = "full", state_side: str = "mamba",
                 model_id: Optional[str] = None, storage: Optional[StorageTier] = None,
                 placement: Optional[CheckpointPlacement] = None, tp: Optional[TPGroup] = None) -> TieredCache:
        """The tiers above a T0 the caller owns (an engine's own pools, ``tiers.protocols.T0Pool``): T1,
        T2 and T3 as ``cfg`` asks, and a ``HiMambaRadixCache`` over ``t0``'s sides ``kv_side`` (full KV)
        and ``state_side`` (recurrent states). Nothing of T0 is built or copied: ``cfg``'s T0 sizes
        (``kv_pages``, ``t0_states``, ``lazy_compaction``) are not read, the specs and the device are the
        sides'. State models only. ``tp``: as for ``build``, but the sides' specs are taken as they are
        (an engine's TP pools hold their rank's share already). Bad input raises a typed error naming
        the argument. An SWA hybrid's T0 names its SWA KV side ``"swa"`` (a ``KVSpec`` with ``window``) and
        passes ``state_side="swa"``: the tree is then a ``HiSWARadixCache`` and there is no T1."""
        from tiered_cache.radix.facade import side_of
        from tiered_cache.tiers.protocols import T0Pool

        instance_arg("cfg", cfg, CacheConfig, "a CacheConfig")
        if not isinstance(t0, T0Pool):
            raise InvalidTypeError("t0", "a T0 pool (tiers.protocols.T0Pool)", type(t0).__name__)
        kv, st = side_of(t0, str_arg("kv_side", kv_side), "kv_side"), side_of(t0, str_arg("state_side", state_side),
                                                                           "state_side")
        if not isinstance(getattr(kv, "spec", None), KVSpec):
            raise InvalidTypeError("kv_side", "the name of a full-KV side (a KVSpec)", kv_side)
        swa = state_side == "swa" and isinstance(getattr(st, "spec", None), KVSpec)
        if not swa and not isinstance(getattr(st, "spec", None), StateSpec):
            raise InvalidTypeError("state_side", "the name of a state side (a StateSpec) or \"swa\"", state_side)
        if kv.page_size != cfg.page_size:
            raise InvalidArgumentError("page_size", f"the KV side's page size {kv.page_size}", cfg.page_size)
        state = None if swa else st.spec
        _check_build(cfg, kv.spec, state, st.spec if swa else None, model_id, storage, placement)
        instance_arg("tp", tp, TPGroup, "a parallel.TPGroup", none_ok=True)
        return cls._assemble(cfg, t0, kv.spec, state, kv.device, model_id, storage, placement, kv_side, state_side,
                             tp, kv.capacity - 1)  # the caller's KV pages, not cfg.kv_pages (not read here)

    @classmethod
    def _assemble(cls, cfg: CacheConfig, pool: Any, kv: KVSpec, state: Optional[StateSpec], device: torch.device,
                  model_id: Optional[str], storage: Optional[StorageTier], placement: Optional[CheckpointPlacement],
                  kv_side: str, state_side: str, tp: Optional[TPGroup], kv_pages: int) -> TieredCache:
        """T1, T2, T3 and the tree over ``pool`` (T0, built or given; ``kv_pages``: its KV budget in pages, what
        a tuned policy models); under ``tp`` the tree agrees."""
        mem, backend = cfg.check_memory, cfg.backend
        t1 = None if state is None else Int8CheckpointPool(state, cfg.t1_states, device=device, codec=cfg.codec,
                                                           check_memory=mem, backend=backend)
        hconf = HostTierConfig(write_policy=cfg.write_policy, write_through_threshold=cfg.write_through_threshold,
                               load_back_threshold=cfg.load_back_threshold, prefetch_policy=cfg.prefetch_policy,
                               prefetch_timeout_s=cfg.prefetch_timeout_s,
                               storage_write_through=cfg.storage_write_through)
        host = transfer = None
        if cfg.host_tier:
            if t1 is not None:
                second = RegionSpec(hconf.state_region, t1.slot_bytes, cfg.host_states)
            else:
                host_swa = cfg.host_kv_pages if cfg.host_swa_pages is None else cfg.host_swa_pages
                second = RegionSpec(hconf.swa_region, pool.side("swa").entry_bytes, host_swa)
            host = HostMirror([RegionSpec(hconf.kv_region, pool.side(kv_side).entry_bytes, cfg.host_kv_pages), second],
                              check_memory=mem)
            transfer = TransferEngine(device, backend=backend)
        policy: Any = _POLICIES[cfg.eviction_policy]() if cfg.eviction_policy in _POLICIES else make_policy(
            cfg.eviction_policy, stack_costs(cfg.cost_model, kv.bytes_per_slot(1), t1.slot_bytes if t1 else 1),
            tiered=cfg.host_tier, budget=(max(1, kv_pages) * cfg.page_size, max(1, cfg.t1_states)), background=True)
        owns_storage = False
        if storage is None and cfg.storage_url is not None and model_id is not None:  # (a URL comes with an id)
            fp = StorageFingerprint.from_specs(model_id, kv_spec=kv, state_spec=state, codec=cfg.codec,
                                               page_size=cfg.page_size)
            if tp is not None and tp.tag() is not None:  # a rank's shard is its own entry: keys name the rank
                fp = dataclasses.replace(fp, extra=(*fp.extra, ("tp", str(tp.tag()))))
            storage, owns_storage = StorageTier(open_backend(cfg.storage_url), fp), True
        tree: Tree
        try:
            if t1 is not None:
                tree = HiMambaRadixCache(pool, t1, checkpoint_unit=cfg.checkpoint_unit, placement=placement,
                                         policy=policy, validate=cfg.validate, host=host, transfer=transfer,
                                         host_config=hconf, storage=storage, kv_side=kv_side, state_side=state_side,
                                         admission=StateAdmission(cfg.state_admission, cfg.admission_block))
            else:
                tree = HiSWARadixCache(pool, policy=policy, validate=cfg.validate, host=host, transfer=transfer,
                                       host_config=hconf, kv_side=kv_side)
        except BaseException:
            if owns_storage and storage is not None:
                storage.close()
            raise
        if tp is not None:
            attach(tree, tp)
        return cls(cfg, pool, tree, policy, t1=t1, host=host, transfer=transfer, storage=storage,
                   owns_storage=owns_storage, kv_side=kv_side, state_side=state_side)

    # ------------------------------------------------------------------------------- the parts
    @property
    def config(self) -> CacheConfig:
        return self._cfg

    @property
    def tree(self) -> Tree:
        """The radix tree (a ``HiSWARadixCache`` for an SWA model): match, insert, locks, load back."""
        return self._tree

    @property
    def pool(self) -> Any:
        """T0: the one device buffer both sides share (a ``UnifiedPool``), or the T0 given to ``build_on``."""
        return self._pool

    @property
    def kv(self) -> Any:
        """T0's full-KV side (ids are virtual token ids, whole pages; a ``SubPool`` of a built T0)."""
        return self._kv

    @property
    def states(self) -> Optional[Any]:
        """T0's state side (running requests' recurrent states); None for an SWA model."""
        return self._states

    @property
    def swa(self) -> Optional[SubPool]:
        """T0's SWA KV side; None for a state model."""
        return self._swa

    @property
    def t1(self) -> Optional[Int8CheckpointPool]:
        """T1, the tree's states; None for an SWA model."""
        return self._t1

    @property
    def host(self) -> Optional[HostMirror]:
        """T2's host mirror; None without a host tier."""
        return self._host

    @property
    def transfer(self) -> Optional[TransferEngine]:
        """The transfer engine moving bytes between the device and T2; None without a host tier."""
        return self._transfer

    @property
    def storage(self) -> Optional[StorageTier]:
        """T3; None without storage (or once closed)."""
        return self._storage

    @property
    def page_size(self) -> int:
        return self._cfg.page_size

    @property
    def checkpoint_unit(self) -> int:
        """Tokens between cached states (a page for an SWA model: every page's SWA KV is its state)."""
        return self._tree.checkpoint_unit

    # ------------------------------------------------------------------------------- T0 room
    def alloc_kv(self, n: int) -> Optional[torch.Tensor]:
        """``n`` T0 full-KV token ids (``n`` a multiple of page_size), evicting cached KV (LRU) for room;
        None when the tree has nothing more to evict (nothing then changed but what was evicted)."""
        return self._alloc_tokens(self._kv, n, "n")

    def alloc_swa(self, n: int) -> Optional[torch.Tensor]:
        """``n`` T0 SWA KV token ids of an SWA model; evicts SWA KV first (internal nodes become SWA
        tombstones), then whole leaves. None when nothing more can be evicted."""
        if self._swa is None:
            raise InvalidArgumentError("alloc_swa", "a cache of an SWA model (this one holds states)", n)
        return self._alloc_tokens(self._swa, n, "n")

    def alloc_states(self, n: int = 1) -> Optional[torch.Tensor]:
        """``n`` T0 state slots of a state model; cached KV pages are evicted for their bytes (the two
        sides share one buffer). None when nothing more can be evicted."""
        if self._states is None:
            raise InvalidArgumentError("alloc_states", "a cache of a state model (this one holds SWA KV)", n)
        n = int_arg("n", n, lo=1)
        side, kv = self._states, self._kv
        slots = side.alloc(n)
        if not self._shared:  # the tree holds no T0 state slot and KV bytes are not state room: nothing to evict
            return slots
        pages = max(1, -(-n * side.entry_bytes // kv.entry_bytes))
        while slots is None:
            if self._tree.evict(EvictParams(num_tokens=pages * self.page_size)).num_tokens_evicted == 0:
                return None
            slots = side.alloc(n)
        return slots

    def _alloc_tokens(self, side: SubPool, n: int, arg: str) -> Optional[torch.Tensor]:
        n = int_arg(arg, n, lo=0)
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=side.device)
        ids = side.alloc(n)
        while ids is None:
            short = max(self.page_size, n - side.available_size())
            if side is self._swa:
                r = self._tree.evict(EvictParams(swa_num_tokens=short))
                if r.swa_num_tokens_evicted == 0 and r.num_tokens_evicted == 0 and \
                        self._tree.evict(EvictParams(num_tokens=short)).num_tokens_evicted == 0:
                    return None
            elif self._tree.evict(EvictParams(num_tokens=short)).num_tokens_evicted == 0:
                return None
            ids = side.alloc(n)
        return ids

    # ------------------------------------------------------------------------------- reports
    def free_sizes(self) -> dict[str, int]:
        """Free room per pool: T0 KV tokens, T0 state slots and T1 slots (or T0 SWA tokens), and each T2
        region's free slots. An idle engine's run must end where it began."""
        out = {"t0_kv": self._kv.available_size()}
        if self._swa is not None:
            out["t0_swa"] = self._swa.available_size()
        if self._states is not None:
            out["t0_states"] = self._states.available_size()
        if self._t1 is not None:
            out["t1"] = self._t1.available_size()
        if self._host is not None:
            out.update({f"t2_{name}": r.available_size() for name, r in self._host.regions.items()})
        return out

    def stats(self) -> dict[str, dict]:
        """One dict of counters: ``tree`` (the tree's own: backups, load backs, T3 hook), ``evictions``
        (victims per resource), ``t1`` (stores/loads and their bytes), ``transfer`` (T2 bytes and
        tickets, checksum failures), ``storage`` (T3 backend ops); the last three only where the tier is."""
        out = {"tree": dict(self._tree.stats), "evictions": dict(self._policy.counts)}
        if self._t1 is not None:
            out["t1"] = dict(self._t1.stats)
        if self._transfer is not None:
            out["transfer"] = dict(self._transfer.stats)
        if self._storage is not None:
            out["storage"] = dict(self._storage.stats)
        return out

    def check_invariants(self, request_kv: Optional[torch.Tensor] = None,
                         request_states: Optional[torch.Tensor] = None) -> None:
        """The tree's invariants over every tier; ``request_kv`` / ``request_states`` (SWA ids for an SWA
        model): what running requests own, so that every slot must be free, cached, a request's or in
        flight. Raises AssertionError."""
        self._tree.check_invariants(request_kv=request_kv, request_states=request_states)

    # ------------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop T3: prefetches in flight are drained (their T2 slots go back), then the workers stop and
        the backend closes, if the stack opened it. Idempotent; the GPU and host tiers hold nothing
        outside the process and go with the object."""
        if self._closed:
            return
        self._closed = True
        if self._storage is not None:
            if self._tree.t3 is not None:
                self._tree.t3.drain()
            if self._owns_storage:
                self._storage.close()
            self._storage = None

    def __enter__(self) -> TieredCache:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_build(cfg: Any, kv: Any, state: Any, swa: Any, model_id: Any, storage: Any,
                 placement: Any) -> Union[StateSpec, KVSpec]:
    """``TieredCache.build``'s arguments, and the config fields whose rule depends on the model's kind.
    Returns the spec of T0's high side (``state`` or ``swa``, exactly one of which is given)."""
    instance_arg("cfg", cfg, CacheConfig, "a CacheConfig")
    instance_arg("kv", kv, KVSpec, "a KVSpec")
    instance_arg("state", state, StateSpec, "a StateSpec", none_ok=True)
    instance_arg("swa", swa, KVSpec, "a KVSpec", none_ok=True)
    instance_arg("storage", storage, StorageTier, "a StorageTier", none_ok=True)
    instance_arg("placement", placement, CheckpointPlacement, "a CheckpointPlacement", none_ok=True)
    if (state is None) == (swa is None):
        raise InvalidArgumentError("state, swa", "exactly one of a StateSpec and an SWA KVSpec", (state, swa))
    if kv.window:
        raise InvalidArgumentError("kv", "a full-attention KVSpec (window=0)", kv.window)
    if swa is not None:
        int_arg("swa.window", swa.window, lo=1)
        for arg, v in (("storage_url", cfg.storage_url), ("storage", storage), ("placement", placement)):
            if v is not None:
                raise InvalidArgumentError(arg, "None for a model without recurrent states", v)
    elif cfg.host_tier and not cfg.host_states:
        raise InvalidArgumentError("host_states", "an int >= 1 with host_kv_pages (T2 holds states too)",
                                   cfg.host_states)
    elif cfg.host_states and not cfg.host_tier:
        raise InvalidArgumentError("host_kv_pages", "an int >= 1 with host_states (both 0: no T2)",
                                   cfg.host_kv_pages)
    if storage is not None and (cfg.storage_url is not None or not cfg.host_tier):
        what = "None with cfg.storage_url" if cfg.storage_url is not None else "None without a host tier"
        raise InvalidArgumentError("storage", what, storage)
    if model_id is not None:
        str_arg("model_id", model_id)
    elif cfg.storage_url is not None:
        raise InvalidArgumentError("model_id", "a str naming the model (T3's fingerprint)", model_id)
    return state if state is not None else swa
