"""The moves between tiers, each for many scattered slots per call, built on ``TransferEngine``.

    T1 int8 --demote_states (D2H bytes)--> T2        T2 --promote_states (H2D bytes)--> T1
    T2 --restore_states (H2D + dequantize)--> T0 active slot (through a T1-format scratch slot)
    T0 KV pages --demote_kv (D2H)--> T2              T2 --load_kv (H2D, layer by layer)--> T0

T0 slots are named by *virtual* ids and translated once at submit; compaction of a T0 side waits
for the engine's tickets first (the engine registers a fence), so physical rows stay valid. A T0
side is anything that offers ``tiers.protocols.KVSide`` / ``StateSide`` (``UnifiedPool``'s sides do),
or, for KV, a ``LayeredKVSide`` (one buffer per layer, SGLang's): its pages are gathered into envelopes
on the device for a D2H copy and scattered back after an H2D copy (one more pass over HBM).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from tiered_cache import device as dev
from tiered_cache.errors import InvalidArgumentError, SlotStateError
from tiered_cache.specs import KVSpec
from tiered_cache.tiers.host_mirror import HostRegion
from tiered_cache.tiers.protocols import KVSide, LayeredKVSide, StateSide
from tiered_cache.tiers.slots import id_list
from tiered_cache.transfer.engine import Ticket, TransferEngine
from tiered_cache.validate import bool_arg, instance_arg

_INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _t1_ids(t1, arg: str, ids, unique: bool) -> list[int]:
    return t1.allocator.check(arg, ids, unique=unique)


_UNSET = object()


def _check_parts(engine, region, side=_UNSET, t1=_UNSET, kv: bool = False) -> None:
    """The objects a move works on, checked before any id: a wrong object is a typed error naming
    its argument, not an AttributeError from deep inside."""
    from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool

    instance_arg("engine", engine, TransferEngine, "a TransferEngine")
    instance_arg("region", region, HostRegion, "a HostRegion (HostMirror.region(name))")
    if t1 is not _UNSET:
        instance_arg("t1", t1, Int8CheckpointPool, "an Int8CheckpointPool")
    if side is not _UNSET:
        if not (kv and isinstance(side, LayeredKVSide)):
            instance_arg("side", side, KVSide if kv else StateSide, "a T0 side (tiers.protocols.KVSide or StateSide)")
        if isinstance(side.spec, KVSpec) != kv:
            raise InvalidArgumentError("side", "a KV side" if kv else "a state side", side.name)


def _page_vids(side: KVSide, ids: Sequence[int], arg: str) -> list[int]:
    """KV token ids (whole pages) or, with ``page_size`` 1, slot ids -> virtual page ids."""
    if isinstance(ids, torch.Tensor) and ids.dim() == 1 and ids.dtype in _INT_DTYPES:
        t = ids.to("cpu", torch.int64)
    else:
        lst = id_list(arg, ids)
        if lst and (min(lst) < 0 or max(lst) >= side.capacity * side.page_size):  # no int64 overflow below
            raise SlotStateError(arg, f"token ids in [0, {side.capacity * side.page_size})", lst[:16])
        t = torch.tensor(lst, dtype=torch.int64)
    ps = side.page_size
    # checked with tensor ops: thousands of pages per call (a per-token Python loop cost ~10 ms per
    # 2,048 pages, as long as their copy over PCIe)
    pages = t.view(-1, ps) if t.numel() % ps == 0 else None
    if pages is None or bool(((pages[:, :1] % ps) != 0).any()) or not torch.equal(
            pages, pages[:, :1] + torch.arange(ps, dtype=torch.int64)):
        raise InvalidArgumentError(arg, f"token ids of whole pages (page_size={ps})", t[:16].tolist())
    return (pages[:, 0] // ps).tolist()


def demote_states(engine: TransferEngine, t1, t1_slots, region: HostRegion, host_slots) -> Optional[Ticket]:
    """T1 -> T2: copy the int8 envelopes of ``t1_slots`` byte for byte into ``host_slots``."""
    _check_parts(engine, region, t1=t1)
    slots = _t1_ids(t1, "t1_slots", t1_slots, unique=False)
    return engine.demote(t1.envelopes, slots, region, host_slots, kind="demote_state",
                         busy=[(t1.allocator, slots)])


def promote_states(engine: TransferEngine, region: HostRegion, host_slots, t1, t1_slots) -> Optional[Ticket]:
    """T2 -> T1: copy host envelopes back into ``t1_slots``; ``ticket.ok`` says which arrived intact."""
    _check_parts(engine, region, t1=t1)
    slots = _t1_ids(t1, "t1_slots", t1_slots, unique=True)
    return engine.load(region, host_slots, t1.envelopes, slots, kind="promote_state",
                       busy=[(t1.allocator, slots)])


def restore_states(engine: TransferEngine, region: HostRegion, host_slots, t1, scratch_slots,
                   side: StateSide, active_ids) -> Optional[Ticket]:
    """T2 -> T0: land the envelopes in T1-format ``scratch_slots`` and dequantize them into the T0
    state slots ``active_ids`` (virtual), all on the H2D stream. The host copies stay."""
    _check_parts(engine, region, side=side, t1=t1, kv=False)
    slots = _t1_ids(t1, "scratch_slots", scratch_slots, unique=True)
    active = id_list("active_ids", active_ids)
    if len(active) != len(slots):
        raise InvalidArgumentError("active_ids", f"{len(slots)} ids, one per scratch slot", len(active))
    if len(set(active)) != len(active):  # two loads into one slot: which one it ends up holding is a race
        raise SlotStateError("active_ids", "distinct ids", active[:16])
    side.physical_rows(active, "active_ids")  # typed error for unknown ids before anything moves
    side.add_fence(engine.fence)
    return engine.load(region, host_slots, t1.envelopes, slots, kind="restore_state",
                       after=lambda: t1.load_to_active(slots, side, active),
                       busy=[(t1.allocator, slots), (side, active)])


def demote_kv(engine: TransferEngine, side: KVSide, token_ids, region: HostRegion, host_slots) -> Optional[Ticket]:
    """T0 KV pages (virtual token ids, whole pages) -> T2 host pages, one host slot per page."""
    _check_parts(engine, region, side=side, kv=True)
    vids = _page_vids(side, token_ids, "token_ids")
    rows = side.physical_rows(vids, "token_ids")
    side.add_fence(engine.fence)
    if _layered(side):  # gathered into envelopes on the compute stream, which the copy stream waits for
        stage = torch.zeros(len(rows), side.entry_bytes, dtype=torch.uint8, device=side.device)
        idx = dev.host_to_device(torch.tensor(rows, dtype=torch.int64), side.device)
        for off, view in _fields(side):
            stage[:, off:off + view.shape[1]] = view.index_select(0, idx)
        return engine.demote(stage, list(range(len(rows))), region, host_slots, kind="demote_kv",
                             busy=[(side, vids)])
    return engine.demote(side.rows_bytes(), rows, region, host_slots, kind="demote_kv",
                         busy=[(side, vids)])


def _layered(side) -> bool:
    """Whether ``side``'s pages lie in one buffer per layer (``LayeredKVSide``; no ``rows_bytes``)."""
    return isinstance(side, LayeredKVSide) and not isinstance(side, KVSide)


def _fields(side) -> list[tuple[int, torch.Tensor]]:
    """``side.layer_rows()``, checked against the envelope: a bad one is a typed error naming ``side``."""
    fields = side.layer_rows()
    offs = [o for kv in side.spec.field_offsets(side.page_size) for o in kv]
    stops = offs[1:] + [side.entry_bytes]
    if [off for off, _ in fields] != offs:
        raise InvalidArgumentError("side", f"layer_rows at the envelope's field offsets {offs[:4]}...",
                                   [off for off, _ in fields][:4])
    device = dev.resolve(side.device)  # a side may say "cuda" for the tensors' "cuda:0"
    for i, ((off, view), stop) in enumerate(zip(fields, stops)):
        if (not isinstance(view, torch.Tensor) or view.dtype != torch.uint8 or view.dim() != 2
                or view.shape[0] != side.capacity or off + view.shape[1] > stop or view.device != device):
            got = (f"{tuple(view.shape)} {view.dtype} on {view.device}" if isinstance(view, torch.Tensor)
                   else type(view).__name__)
            raise InvalidArgumentError("side", f"layer_rows field {i}: a [{side.capacity}, <= {stop - off}] uint8 view "
                                       f"on {device}", got)
    return fields


def kv_layer_ranges(side: KVSide) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each layer's K and V inside one page envelope (they are adjacent)."""
    instance_arg("side", side, KVSide, "a T0 side (tiers.protocols.KVSide)")
    if not isinstance(side.spec, KVSpec):
        raise InvalidArgumentError("side", "a KV side", side.name)
    offs = side.spec.field_offsets(side.page_size)
    starts = [k for k, _ in offs] + [side.entry_bytes]
    return [(starts[i], starts[i + 1] - starts[i]) for i in range(len(offs))]


def load_kv(engine: TransferEngine, region: HostRegion, host_slots, side: KVSide, token_ids,
            layerwise: bool = True) -> Optional[Ticket]:
    """T2 host pages -> T0 KV pages (virtual token ids); with ``layerwise`` one event per layer."""
    _check_parts(engine, region, side=side, kv=True)
    bool_arg("layerwise", layerwise)
    vids = _page_vids(side, token_ids, "token_ids")
    if len(set(vids)) != len(vids):  # destinations: two loads into one page would race
        raise SlotStateError("token_ids", "distinct pages", vids[:16])
    rows = side.physical_rows(vids, "token_ids")
    side.add_fence(engine.fence)
    if _layered(side):
        # Lands in envelopes on the device (checksummed there), then one scatter per field on the H2D
        # stream before the ticket's event: no layer events, so ``wait_layer`` waits for the whole load.
        fields = _fields(side)
        stage = torch.empty(len(rows), side.entry_bytes, dtype=torch.uint8, device=side.device)

        def scatter() -> None:  # on the H2D stream: its index tensor is that stream's allocation, copied
            # from page-locked memory (a pageable copy would block this thread behind the load it follows)
            idx = dev.host_to_device(torch.tensor(rows, dtype=torch.int64), side.device)
            for off, view in fields:
                view.index_copy_(0, idx, stage[:, off:off + view.shape[1]])

        return engine.load(region, host_slots, stage, list(range(len(rows))), kind="load_kv", after=scatter,
                           busy=[(side, vids)])
    return engine.load(region, host_slots, side.rows_bytes(), rows, kind="load_kv",
                       layer_ranges=kv_layer_ranges(side) if layerwise else None,
                       busy=[(side, vids)])
