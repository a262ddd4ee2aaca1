"""``TransferEngine``: moves slot bytes between the GPU tiers (T0, T1) and the host mirror (T2).

Every move is submitted as a ``Ticket`` on the engine's own D2H or H2D stream, apart from compute.
Before its copies, the transfer stream waits for the submitting (compute) stream, so it reads what
compute wrote and writes where compute no longer reads. A ticket records one CUDA event at its end
(and one per layer for layer-wise loads: compute waits on layer k's event while layer k+1 is still
in flight). The tree changes where a node lives only when ``poll`` / ``wait`` report the ticket done.

Nothing a pending ticket reads or writes may be freed: its slots are marked busy in their allocators
(host regions, T1, T0 sides) and ``free`` raises ``SlotBusyError`` until the ticket completes. T0
compaction, which would move a busy row, first makes the compute stream wait for such tickets.

Integrity: a checksum of every slot is taken on the GPU before its bytes leave (``kernels/checksum``)
and stored with the host slot when the demote completes; after a promote or load lands, the checksum
of the landed bytes is compared on the GPU. A mismatch marks that item not ``ok`` (and is counted):
the caller drops the entry; it is never served. Layer events of a load fire before the whole-ticket
check, so an engine that overlaps compute with a load must check ``ticket.ok`` before using output.

How scattered slots move (``method``: one DMA copy per row, a staging buffer, or a few-program kernel
on mapped host memory) is ``scatter.py``'s job; the ticket and its events are in ``ticket.py``. On CPU
everything runs synchronously and a ticket is done when ``submit`` returns.
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.config import BACKENDS
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, TransferTimeoutError
from tiered_cache.kernels import use_triton
from tiered_cache.kernels.checksum import row_checksums
from tiered_cache.tiers.host_mirror import HostRegion
from tiered_cache.tiers.slots import id_list
from tiered_cache.transfer.scatter import AUTO_COPY_MIN_BYTES, DEFAULT_METHOD, METHODS, ScatterCopier
from tiered_cache.transfer.ticket import Ticket
from tiered_cache.validate import bool_arg, choice_arg, float_arg, int_arg, str_arg


class TransferEngine:
    """Moves rows of device ``uint8`` row views to and from host regions, many slots per call.

    Args:
        device: the GPU (or CPU).
        max_inflight_bytes: back-pressure: a move waits for older tickets (or returns ``None``
            with ``block=False``) rather than queue more than this; one larger move runs alone.
        room_timeout_s: how long a blocking move waits for room (``TransferTimeoutError`` after).
        method: per direction, ``auto``, ``copy``, ``staging`` or ``kernel`` (default ``DEFAULT_METHOD``).
        staging_bytes: size of the device staging buffer for ``staging``.
        stream_priority: CUDA priority of the transfer streams (0, the default: compute's; negative:
            higher, so the few-program copy kernel for KV pages takes SMs as soon as compute's blocks
            retire). On the H200 the multi-turn workload with T2 ran in 28.1 and 32.9 s at -1 and 29.0 s
            at 0 (2026-11-30): no measured gain, so the default leaves compute first.
    """

    def __init__(self, device: dev.DeviceLike = None, *, max_inflight_bytes: int = 4 << 30,
                 method: Optional[dict[str, str]] = None, staging_bytes: int = 256 << 20,
                 backend: str = "auto", room_timeout_s: float = 60.0, stream_priority: int = 0) -> None:
        self.device = dev.resolve(device)
        # CUDA priorities run from 0 (compute's) to -5 on current GPUs; lower values are clamped by CUDA
        stream_priority = int_arg("stream_priority", stream_priority, lo=-16, hi=0)
        max_inflight_bytes = int_arg("max_inflight_bytes", max_inflight_bytes, lo=1)
        if method is not None and not isinstance(method, dict):
            raise InvalidTypeError("method", f"a dict {{'d2h'|'h2d': one of {METHODS}}}", method)
        self.method = dict(DEFAULT_METHOD, **(method or {}))
        for d, m in self.method.items():
            if d not in ("d2h", "h2d") or not isinstance(m, str) or m not in METHODS:
                raise InvalidArgumentError("method", f"{{'d2h'|'h2d': one of {METHODS}}}", method)
        staging_bytes = int_arg("staging_bytes", staging_bytes, lo=16)
        choice_arg("backend", backend, BACKENDS)
        use_triton(self.device, backend)  # backend allowed on this device
        # NaN would never expire (every comparison with it is false); inf is "wait as long as it takes"
        room_timeout_s = float_arg("room_timeout_s", room_timeout_s, lo=0, lo_open=True, allow_inf=True)
        self.max_inflight_bytes = max_inflight_bytes
        self.room_timeout_s = room_timeout_s  # how long a blocking submit waits for room
        self.backend = backend
        self.copier = ScatterCopier(self.device, self.method, staging_bytes, backend)
        self.streams = {name: dev.new_stream(self.device, stream_priority)
                        for name in ("d2h", "h2d", "cs_d2h", "cs_h2d")}
        self._queues: dict[str, collections.deque[Ticket]] = {"d2h": collections.deque(), "h2d": collections.deque()}
        self._finished: list[Ticket] = []
        self._next_id = 1
        self.inflight_bytes = 0
        self.stats: collections.Counter[str] = collections.Counter()
        # Benchmarks switch this off to measure what checksums cost; with it off nothing is verified.
        self.checksums = True
        self.corrupt_hook: Optional[Callable[[HostRegion, list[int]], None]] = None

    # ------------------------------------------------------------------------------- moves
    def demote(self, rows_view: torch.Tensor, rows: Sequence[int], region: HostRegion, host_slots: Sequence[int],
               *, kind: str = "demote", busy: Sequence[Any] = (), block: bool = True) -> Optional[Ticket]:
        """D2H: device rows ``rows_view[rows]`` -> host ``region`` slots; checksums taken first.

        ``busy``: ``(allocator, ids)`` pairs marked busy until the ticket completes (the device side's
        slots). The host slots are marked busy too.
        """
        self._check_submit(kind, busy, block)
        rows_l, slots = self._check(rows_view, rows, region, host_slots, need_valid=False)
        nbytes = len(rows_l) * region.slot_bytes
        if not self._make_room(nbytes, block):
            return None
        rows_t = self._row_index(rows_l)
        t = self._ticket("d2h", kind, nbytes, slots)
        stream, cs = self.streams["d2h"], self.streams["cs_d2h"]
        cur = dev.current_stream(self.device)
        stream.wait_stream(cur)  # read what compute wrote
        sums = None
        if self.checksums:
            # The checksum and the copy only read the rows: they run side by side on their own streams,
            # and the ticket ends on both events (the next ticket's copies never wait for this checksum).
            cs.wait_stream(cur)
            with dev.use_stream(cs):
                sums = row_checksums(rows_view, rows_t, self.backend, out=self._host_sums(len(rows_l)))
                t.check_event = cs.record_event(dev.new_event(self.device))
        keep: list = []
        with dev.use_stream(stream):
            self.copier.copy_rows("d2h", rows_view, rows_t, rows_l, region, slots, keep=keep)
            t.event = stream.record_event(dev.new_event(self.device))

        def finish(tk: Ticket) -> None:
            if sums is not None:
                region.checksums[slots] = sums.numpy()
            region.valid[slots] = True
            tk.ok = [True] * len(slots)

        self._start(t, finish, [(region.allocator, slots), *busy], [rows_view, rows_t, sums, keep])
        return t

    def load(self, region: HostRegion, host_slots: Sequence[int], rows_view: torch.Tensor, rows: Sequence[int],
             *, kind: str = "load", layer_ranges: Optional[Sequence[tuple[int, int]]] = None,
             busy: Sequence[Any] = (), after: Optional[Callable[[], None]] = None,
             block: bool = True) -> Optional[Ticket]:
        """H2D: host ``region`` slots -> device rows ``rows_view[rows]``, then verify checksums.

        ``layer_ranges``: ``(byte offset, nbytes)`` of each layer inside a slot; when given, each layer
        is copied and recorded as its own event, in order. ``after``: launched on the H2D stream once
        the bytes landed (e.g. a dequantize into a T0 slot), before the ticket's final event.
        """
        self._check_submit(kind, busy, block)
        if after is not None and not callable(after):
            raise InvalidTypeError("after", "a callable or None", after)
        rows_l, slots = self._check(rows_view, rows, region, host_slots, need_valid=True)
        if layer_ranges is not None:
            self._check_layer_ranges(layer_ranges, region.slot_bytes)
        if self.corrupt_hook is not None:
            self.corrupt_hook(region, slots)
        nbytes = len(rows_l) * region.slot_bytes
        if not self._make_room(nbytes, block):
            return None
        rows_t = self._row_index(rows_l)
        expected = region.checksums[slots].copy()  # what left the GPU, compared when the ticket ends
        t = self._ticket("h2d", kind, nbytes, slots)
        stream = self.streams["h2d"]
        stream.wait_stream(dev.current_stream(self.device))  # compute is done with the rows we overwrite
        cs = self.streams["cs_h2d"]
        sums = self._host_sums(len(rows_l)) if self.checksums else None
        keep: list = []
        with dev.use_stream(stream):
            if layer_ranges:
                for off, n in layer_ranges:
                    self.copier.copy_rows("h2d", rows_view, rows_t, rows_l, region, slots, (off, n), keep=keep)
                    t.layer_events.append(stream.record_event(dev.new_event(self.device)))
                if sums is not None:  # after the last layer: one pass over whole rows
                    cs.wait_stream(stream)
                    with dev.use_stream(cs):
                        row_checksums(rows_view, rows_t, self.backend, out=sums)
            else:
                # Checksum group g on the checksum stream while group g+1 is still copying, for rows of
                # AUTO_COPY_MIN_BYTES or more (one DMA copy each, the CPU idle meanwhile): only the last
                # group's checksum then follows the last copy. Many small rows (KV pages) go as one
                # group: each group costs kernel launches, and there the CPU bounds the rate (H200,
                # 2026-12-01: the checksums' launches were their whole cost in sustained KV moves).
                n_rows = len(rows_l)
                groups = 4 if region.slot_bytes >= AUTO_COPY_MIN_BYTES else 1
                step = max(1, -(-n_rows // groups))
                for g0 in range(0, n_rows, step):
                    g1 = min(n_rows, g0 + step)
                    self.copier.copy_rows("h2d", rows_view, rows_t[g0:g1], rows_l[g0:g1], region, slots[g0:g1],
                                    keep=keep)
                    if sums is not None:
                        cs.wait_stream(stream)
                        with dev.use_stream(cs):
                            row_checksums(rows_view, rows_t[g0:g1], self.backend, out=sums[g0:g1])
            if sums is not None:
                t.check_event = cs.record_event(dev.new_event(self.device))
            if after is not None:
                after()  # reads only the landed bytes: it need not wait for their checksum
            t.event = stream.record_event(dev.new_event(self.device))

        def finish(tk: Ticket) -> None:
            # The checksums of the landed bytes were taken on the GPU; an entry is served only if
            # they equal the ones taken as it left.
            tk.ok = (sums.numpy() == expected).tolist() if sums is not None else [True] * len(rows_l)
            bad = tk.ok.count(False)
            if bad:
                self.stats["checksum_failures"] += bad

        self._start(t, finish, [(region.allocator, slots), *busy], [rows_view, rows_t, sums, keep])
        return t

    # ---------------------------------------------------------------------------- tickets
    def poll(self) -> list[Ticket]:
        """Tickets finished since the last call, in submission order per direction."""
        self.poll_into_finished()
        out, self._finished = self._finished, []
        return out

    def wait(self, ticket: Ticket, timeout: Optional[float] = None) -> bool:
        """Block until ``ticket`` is done (``True``) or ``timeout`` seconds pass (``False``)."""
        self._check_ticket(ticket)
        if timeout is not None:
            timeout = float_arg("timeout", timeout, lo=0, allow_inf=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        q = self._queues[ticket.direction]
        while not ticket.done:
            if self._fired(ticket):
                # stream order: everything submitted before it in this direction is done too
                while q and not ticket.done:
                    self._complete(q.popleft())
                break
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(5e-5)
        return True

    def wait_all(self, timeout: Optional[float] = None) -> list[Ticket]:
        if timeout is not None:
            timeout = float_arg("timeout", timeout, lo=0, allow_inf=True)
        for q in list(self._queues.values()):
            if q and not self.wait(q[-1], timeout):
                raise TransferTimeoutError(f"transfers still in flight after {timeout} s")
        return self.poll()

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def pending_tickets(self) -> list[Ticket]:
        return [t for q in self._queues.values() for t in q]

    def fence(self) -> None:
        """Make the current (compute) stream wait for every ticket in flight (used before compaction)."""
        cur = dev.current_stream(self.device)
        for q in self._queues.values():
            for t in q:
                cur.wait_event(t.event)
                if t.check_event is not None:
                    cur.wait_event(t.check_event)

    def _check_ticket(self, ticket: Any) -> None:
        if not isinstance(ticket, Ticket):
            raise InvalidTypeError("ticket", "a Ticket from this engine", type(ticket).__name__)
        # identity, not ==: a Ticket's dataclass equality would compare its events and tensors
        if ticket.direction not in self._queues or (
                not ticket.done and not any(t is ticket for t in self._queues[ticket.direction])):
            raise InvalidArgumentError("ticket", "a Ticket submitted to this engine", ticket.id)

    def _check_submit(self, kind: Any, busy: Any, block: Any) -> None:
        str_arg("kind", kind)
        bool_arg("block", block)
        if not isinstance(busy, (list, tuple)):
            raise InvalidTypeError("busy", "a sequence of (allocator, ids) pairs", busy)
        for pair in busy:
            if (not isinstance(pair, (list, tuple)) or len(pair) != 2 or not hasattr(pair[0], "mark_busy")):
                raise InvalidTypeError("busy", "a sequence of (allocator, ids) pairs", pair)

    @staticmethod
    def _fired(t: Ticket) -> bool:
        """Both of the ticket's events have fired (its copies and its checksums)."""
        return t.event.query() and (t.check_event is None or t.check_event.query())

    def _row_index(self, rows_l: list[int]) -> torch.Tensor:
        """Row ids as the checksum kernel and the staging copies read them, made without touching the
        compute stream: on a GPU a page-locked host tensor (the kernels read it through mapped memory);
        elsewhere a plain CPU tensor."""
        t = torch.tensor(rows_l, dtype=torch.int64)
        return t.pin_memory() if self.device.type == "cuda" else t

    def _host_sums(self, n: int) -> torch.Tensor:
        """Where a ticket's checksums land: host memory the checksum kernel writes through mapped memory
        on a GPU (page-locked), so no tiny copy waits in a copy engine behind the large copies; read
        once the ticket's check event has fired."""
        return torch.empty(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")

    # ----------------------------------------------------------------------------- helpers
    def _check(self, rows_view, rows, region, host_slots, need_valid: bool):
        if not isinstance(region, HostRegion):
            raise InvalidTypeError("region", "a HostRegion", type(region).__name__)
        if not isinstance(rows_view, torch.Tensor):
            raise InvalidTypeError("rows_view", "a [rows, bytes] uint8 tensor", type(rows_view).__name__)
        if (rows_view.dtype != torch.uint8 or rows_view.dim() != 2
                or rows_view.stride(1) != 1):
            raise InvalidArgumentError("rows_view", "a [rows, bytes] uint8 view with unit inner stride",
                                       getattr(rows_view, "shape", type(rows_view)))
        if rows_view.device != self.device:
            raise InvalidArgumentError("rows_view", f"a tensor on {self.device}", rows_view.device)
        if rows_view.shape[1] != region.slot_bytes:
            raise InvalidArgumentError("rows_view", f"rows of {region.slot_bytes} bytes (region {region.name!r})",
                                       rows_view.shape[1])
        rows_l = id_list("rows", rows)
        # destinations must be distinct; a source may be read more than once
        slots = region.allocator.check("host_slots", host_slots, unique=not need_valid)
        if need_valid and len(set(rows_l)) != len(rows_l):
            raise InvalidArgumentError("rows", "distinct destination rows", rows_l[:16])
        if len(rows_l) != len(slots):
            raise InvalidArgumentError("host_slots", f"{len(rows_l)} slots, one per row", len(slots))
        rows_a = np.asarray(rows_l, dtype=np.int64)
        out = (rows_a < 0) | (rows_a >= rows_view.shape[0])
        if out.any():
            raise InvalidArgumentError("rows", f"rows in [0, {rows_view.shape[0]})", rows_a[out][:16].tolist())
        if need_valid:
            missing = [s for s in slots if not region.valid[s]]
            if missing:
                raise InvalidArgumentError("host_slots", "slots whose demote has completed", missing[:16])
        return rows_l, slots

    @staticmethod
    def _check_layer_ranges(layer_ranges: Any, slot_bytes: int) -> None:
        """``(offset, nbytes)`` pairs inside one slot, in order; the kernel path moves int32 words."""
        if not isinstance(layer_ranges, (list, tuple)):
            raise InvalidTypeError("layer_ranges", "a sequence of (offset, nbytes) pairs", layer_ranges)
        for r in layer_ranges:
            if not isinstance(r, (list, tuple)) or len(r) != 2:
                raise InvalidTypeError("layer_ranges", "(offset, nbytes) pairs of ints", r)
            off = int_arg("layer_ranges", r[0], lo=0, hi=slot_bytes - 4)
            n = int_arg("layer_ranges", r[1], lo=4, hi=slot_bytes - off)
            if off % 4 or n % 4:
                raise InvalidArgumentError("layer_ranges", "offsets and sizes that are multiples of 4", r)

    def _ticket(self, direction, kind, nbytes, slots) -> Ticket:
        t = Ticket(id=self._next_id, direction=direction, kind=kind, nbytes=nbytes, host_slots=list(slots))
        self._next_id += 1
        return t

    def _start(self, t: Ticket, finish, busy, keep: list) -> None:
        t._finish = finish
        for alloc, ids in busy:
            ids = list(dict.fromkeys(ids))  # one mark per slot, however often the ticket names it
            alloc.mark_busy(ids)
            t._release.append(functools.partial(alloc.unmark_busy, ids))
        self.inflight_bytes += t.nbytes
        self.stats[f"{t.direction}_bytes"] += t.nbytes
        self.stats[f"{t.kind}_tickets"] += 1
        # On CPU the bytes have moved already, but the ticket (and its busy marks) end only at the next
        # poll or wait, as on the GPU: callers see one behaviour.
        self._queues[t.direction].append(t)
        t._keep = keep  # held until the ticket completes (ticket.py says why)

    def poll_into_finished(self) -> None:
        for q in self._queues.values():
            while q and self._fired(q[0]):
                self._complete(q.popleft())

    def _complete(self, t: Ticket) -> None:
        # The event has fired; waiting on it orders the compute stream after the copy (free on the
        # device) before anyone reads what it wrote: checksums here, the landed slots in the caller.
        cur = dev.current_stream(self.device)
        cur.wait_event(t.event)
        if t.check_event is not None:
            cur.wait_event(t.check_event)
        if t._finish is not None:
            t._finish(t)
        for release in t._release:
            release()
        t._release.clear()
        t._keep = None
        t.done = True
        self.inflight_bytes -= t.nbytes
        self._finished.append(t)

    def _make_room(self, nbytes: int, block: bool) -> bool:
        timeout = self.room_timeout_s
        if self.inflight_bytes + nbytes <= self.max_inflight_bytes or self.inflight_bytes == 0:
            return True
        if not block:
            self.poll_into_finished()
            return self.inflight_bytes + nbytes <= self.max_inflight_bytes or self.inflight_bytes == 0
        deadline = time.monotonic() + timeout
        while self.inflight_bytes + nbytes > self.max_inflight_bytes and self.inflight_bytes:
            oldest = min((q[0] for q in self._queues.values() if q), key=lambda t: t.id)
            if not self.wait(oldest, max(0.0, deadline - time.monotonic())):
                raise TransferTimeoutError(f"no room for {nbytes} bytes within {timeout} s")
        return True
