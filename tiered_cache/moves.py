"""The moves between tiers, each for many scattered slots per call, built on ``TransferEngine``.

    T1 int8 --demote_states (D2H bytes)--> T2        T2 --promote_states (H2D bytes)--> T1
    T2 --restore_states (H2D + dequantize)--> T0 active slot (through a T1-format scratch slot)
    T0 KV pages --demote_kv (D2H)--> T2              T2 --load_kv (H2D, layer by layer)--> T0

T0 slots are named by *virtual* ids and translated once at submit; compaction of a T0 side waits
for the engine's tickets first (the engine registers a fence), so physical rows stay valid.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import torch

from tiered_cache.errors import InvalidArgumentError
from tiered_cache.host_mirror import HostRegion
from tiered_cache.slots import id_list
from tiered_cache.transfer import Ticket, TransferEngine
from tiered_cache.unified_pool import SubPool


def _t1_ids(t1, arg: str, ids, unique: bool) -> list[int]:
    return t1.allocator.check(arg, ids, unique=unique)


def _fenced(engine: TransferEngine, side: SubPool) -> None:
    if engine.fence not in side.allocator.fences:
        side.allocator.fences.append(engine.fence)


def _page_vids(side: SubPool, ids: Sequence[int], arg: str) -> list[int]:
    """KV token ids (whole pages) or, with ``page_size`` 1, slot ids -> virtual page ids."""
    if isinstance(ids, torch.Tensor) and ids.dim() == 1 and not ids.dtype.is_floating_point and ids.dtype != torch.bool:
        t = ids.to("cpu", torch.int64)
    else:
        t = torch.tensor(id_list(arg, ids), dtype=torch.int64)
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
    slots = _t1_ids(t1, "t1_slots", t1_slots, unique=False)
    return engine.demote(t1.envelopes, slots, region, host_slots, kind="demote_state",
                         busy=[(t1.allocator, slots)])


def promote_states(engine: TransferEngine, region: HostRegion, host_slots, t1, t1_slots) -> Optional[Ticket]:
    """T2 -> T1: copy host envelopes back into ``t1_slots``; ``ticket.ok`` says which arrived intact."""
    slots = _t1_ids(t1, "t1_slots", t1_slots, unique=True)
    return engine.load(region, host_slots, t1.envelopes, slots, kind="promote_state",
                       busy=[(t1.allocator, slots)])


def restore_states(engine: TransferEngine, region: HostRegion, host_slots, t1, scratch_slots,
                   side: SubPool, active_ids) -> Optional[Ticket]:
    """T2 -> T0: land the envelopes in T1-format ``scratch_slots`` and dequantize them into the T0
    state slots ``active_ids`` (virtual), all on the H2D stream. The host copies stay."""
    slots = _t1_ids(t1, "scratch_slots", scratch_slots, unique=True)
    active = id_list("active_ids", active_ids)
    if len(active) != len(slots):
        raise InvalidArgumentError("active_ids", f"{len(slots)} ids, one per scratch slot", len(active))
    side.allocator.physical_rows(active)  # typed error for unknown ids before anything moves
    _fenced(engine, side)
    return engine.load(region, host_slots, t1.envelopes, slots, kind="restore_state",
                       after=lambda: t1.load_to_active(slots, side, active),
                       busy=[(t1.allocator, slots), (side.allocator, active)])


def demote_kv(engine: TransferEngine, side: SubPool, token_ids, region: HostRegion, host_slots) -> Optional[Ticket]:
    """T0 KV pages (virtual token ids, whole pages) -> T2 host pages, one host slot per page."""
    vids = _page_vids(side, token_ids, "token_ids")
    rows = side.allocator.physical_rows(vids)
    _fenced(engine, side)
    return engine.demote(side.rows_bytes(), rows, region, host_slots, kind="demote_kv",
                         busy=[(side.allocator, vids)])


def kv_layer_ranges(side: SubPool) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` of each layer's K and V inside one page envelope (they are adjacent)."""
    offs = side.spec.field_offsets(side.page_size)
    starts = [k for k, _ in offs] + [side.entry_bytes]
    return [(starts[i], starts[i + 1] - starts[i]) for i in range(len(offs))]


def load_kv(engine: TransferEngine, region: HostRegion, host_slots, side: SubPool, token_ids,
            layerwise: bool = True) -> Optional[Ticket]:
    """T2 host pages -> T0 KV pages (virtual token ids); with ``layerwise`` one event per layer."""
    vids = _page_vids(side, token_ids, "token_ids")
    rows = side.allocator.physical_rows(vids)
    _fenced(engine, side)
    return engine.load(region, host_slots, side.rows_bytes(), rows, kind="load_kv",
                       layer_ranges=kv_layer_ranges(side) if layerwise else None,
                       busy=[(side.allocator, vids)])
