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

How scattered slots move (``method``): ``copy`` issues one ``cudaMemcpyAsync`` per row; ``staging``
gathers device rows into a device staging buffer with one gather kernel and copies each run of
consecutive host slots from it (or the reverse); ``kernel`` launches a few programs that read or write
the mapped pinned host memory directly (``kernels/hostcopy.py``). ``bench_transfer.py`` measures all
three against a contiguous pinned copy; ``DEFAULT_METHOD``'s comment gives the choice. On CPU everything runs
synchronously and a ticket is done when ``submit`` returns.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, TieredCacheError
from tiered_cache.kernels import use_triton
from tiered_cache.kernels.checksum import row_checksums
from tiered_cache.kernels.hostcopy import copy_items
from tiered_cache.tiers.host_mirror import HostRegion
from tiered_cache.tiers.slots import id_list
from tiered_cache.validate import bool_arg, choice_arg, float_arg, int_arg, str_arg

# ``auto`` picks by row size, from bench_transfer.py on the H200 (benchmarks/results/transfer-h200.md):
# rows of AUTO_COPY_MIN_BYTES or more (state envelopes, ~21 MB for Qwen3-Next-80B) go as one DMA copy
# each: they reach ~0.95 of a contiguous pinned copy and use no SMs. Smaller rows (KV pages, ~384 KiB)
# pay a fixed cost per copy call (~14 GB/s per-page copies, ~19 through a staging buffer when host
# slots are scattered), so they go through the few-program mapped-memory kernel.
DEFAULT_METHOD = {"d2h": "auto", "h2d": "auto"}
METHODS = ("auto", "copy", "staging", "kernel")
BACKENDS = ("auto", "triton", "torch")
AUTO_COPY_MIN_BYTES = 2 << 20


class TransferTimeoutError(TieredCacheError, TimeoutError):
    """A wait on a ticket (or for room under the in-flight byte bound) ran out of time."""


@dataclass
class Ticket:
    """One submitted move. ``ok[i]`` is whether item ``i`` arrived intact (known once ``done``)."""

    id: int
    direction: str  # "d2h" | "h2d"
    kind: str
    nbytes: int
    host_slots: list[int]
    event: Any = None  # the copy stream's last event (after the copies and any ``after`` work)
    check_event: Any = None  # the checksum stream's (None when checksums are off)
    layer_events: list[Any] = field(default_factory=list)
    done: bool = False
    ok: list[bool] = field(default_factory=list)
    # internal: what finishing does, and the busy marks to release
    _finish: Optional[Callable[[Ticket], None]] = None
    _release: list[Callable[[], None]] = field(default_factory=list)

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait until layer ``layer`` has landed."""
        ev = self.layer_events[layer] if self.layer_events else self.event
        if ev is not None and hasattr(ev, "wait"):
            ev.wait(stream) if stream is not None else ev.wait()


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
        self.kernel_programs = 16  # programs of the mapped-memory copy kernel (few: leave SMs to compute)
        self.kernel_block_words = 2048  # int32 words a program moves per step (power of two)
        self.kernel_warps = 4  # warps per program
        # programs of the staging gather / scatter (device to device: many, to run near HBM speed)
        self.staging_programs = 4 * torch.cuda.get_device_properties(self.device).multi_processor_count \
            if self.device.type == "cuda" else 4
        self.backend = backend
        self.streams = {name: dev.new_stream(self.device, stream_priority)
                        for name in ("d2h", "h2d", "cs_d2h", "cs_h2d")}
        self._queues: dict[str, collections.deque[Ticket]] = {"d2h": collections.deque(), "h2d": collections.deque()}
        self._finished: list[Ticket] = []
        self._next_id = 1
        self.inflight_bytes = 0
        self._staging: dict[str, torch.Tensor] = {}
        self._staging_bytes = staging_bytes
        self.stats = collections.Counter()
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
            self._copy_rows("d2h", rows_view, rows_t, rows_l, region, slots, keep=keep)
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
                    self._copy_rows("h2d", rows_view, rows_t, rows_l, region, slots, (off, n), keep=keep)
                    t.layer_events.append(stream.record_event(dev.new_event(self.device)))
                if sums is not None:  # after the last layer: one pass over whole rows
                    cs.wait_stream(stream)
                    with dev.use_stream(cs):
                        row_checksums(rows_view, rows_t, self.backend, out=sums)
            else:
                # Checksum group g on the checksum stream while group g+1 is still copying.
                n_rows = len(rows_l)
                step = max(1, -(-n_rows // 4))
                for g0 in range(0, n_rows, step):
                    g1 = min(n_rows, g0 + step)
                    self._copy_rows("h2d", rows_view, rows_t[g0:g1], rows_l[g0:g1], region, slots[g0:g1],
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

    def _pick(self, direction: str, row_bytes: int, runs: list, sub: bool) -> str:
        method = self.method[direction]
        if method == "auto":
            if self.device.type != "cuda" or row_bytes >= AUTO_COPY_MIN_BYTES:
                return "copy"
            # Small rows: consecutive host slots go as one DMA copy per run through the staging
            # buffer when runs are long; scattered ones through the few-program kernel.
            run_bytes = row_bytes * sum(k for _, _, k in runs) / max(1, len(runs))
            method = "staging" if run_bytes >= AUTO_COPY_MIN_BYTES and not sub else "kernel"
        if method == "staging" and sub:
            method = "kernel"  # a layer's sub-range of each row has no contiguous staging form
        if method == "kernel" and not use_triton(self.device, self.backend):
            return "copy"  # CPU without the interpreter: the kernel cannot run here
        return method

    def _copy_rows(self, direction, rows_view, rows_t, rows_l, region, slots, sub=None, keep=None):
        """``keep`` collects host tensors a kernel reads after this returns (held until the ticket ends)."""
        off, n = sub if sub is not None else (0, region.slot_bytes)
        runs = region.runs(slots)
        method = self._pick(direction, region.slot_bytes, runs, sub is not None)
        if method == "kernel":
            self._copy_rows_kernel(direction, rows_view, rows_l, region, slots, off, n, keep)
            return
        if method == "staging":
            self._copy_rows_staging(direction, rows_view, rows_t, region, slots, keep)
            return
        for pos, s0, k in runs:
            for j in range(k):  # device rows are scattered: one copy per row
                r = rows_l[pos + j]
                host = region.run_view(s0 + j, 1)[off:off + n]
                devrow = rows_view[r, off:off + n]
                if direction == "d2h":
                    host.copy_(devrow, non_blocking=True)
                else:
                    devrow.copy_(host, non_blocking=True)

    def _copy_rows_staging(self, direction, rows_view, rows_t, region, slots, keep):
        """Gather device rows into a staging buffer (one kernel), then one DMA copy per run of
        consecutive host slots (or the reverse), in groups that fit the buffer."""
        e = region.slot_bytes
        staging = self._get_staging(direction, e)
        per = staging.numel() // e
        for g0 in range(0, len(slots), per):
            g1 = min(len(slots), g0 + per)
            stage = staging[: (g1 - g0) * e].view(g1 - g0, e)
            if direction == "d2h":
                self._stage_rows(rows_view, rows_t[g0:g1], stage, True, keep)
            for pos, s0, k in region.runs(slots[g0:g1]):
                host, dev_part = region.run_view(s0, k), stage[pos:pos + k].reshape(-1)
                if direction == "d2h":
                    host.copy_(dev_part, non_blocking=True)
                else:
                    dev_part.copy_(host, non_blocking=True)
            if direction == "h2d":
                self._stage_rows(rows_view, rows_t[g0:g1], stage, False, keep)

    def _stage_rows(self, rows_view, ids, stage, to_stage: bool, keep) -> None:
        """``stage[i] = rows_view[ids[i]]`` (``to_stage``) or the reverse, on the current (side) stream.
        With Triton: one ``copy_items`` launch over many programs (device to device) that reads the row
        offsets from page-locked host memory, since a host-to-device copy of the ids would queue in the
        H2D copy engine behind the large loads in flight. Without: torch's index ops."""
        e = stage.shape[1]
        if use_triton(self.device, self.backend) and e % 4 == 0:
            rows_w, stage_w = rows_view.view(torch.int32), stage.view(torch.int32)
            r_off = ids.cpu() * rows_w.stride(0)
            s_off = torch.arange(len(ids), dtype=torch.int64) * stage_w.stride(0)
            if self.device.type == "cuda":
                r_off, s_off = r_off.pin_memory(), s_off.pin_memory()
                keep += [r_off, s_off]  # read by the kernel until it ends
            src, dst = ((rows_w, r_off), (stage_w, s_off)) if to_stage else ((stage_w, s_off), (rows_w, r_off))
            copy_items(src[0], src[1], dst[0], dst[1], e // 4, self.staging_programs, 4096, 8)
            return
        idx = ids.to(self.device, non_blocking=True)
        if to_stage:
            torch.index_select(rows_view, 0, idx, out=stage)
        else:
            rows_view.index_copy_(0, idx, stage)

    def _copy_rows_kernel(self, direction, rows_view, rows_l, region, slots, off, n, keep):
        """One few-program launch per host chunk touched (``kernels/hostcopy.py``). The item offsets stay
        in page-locked host memory, read by the kernel through mapped memory: a host-to-device copy of
        them would wait in the H2D copy engine behind the large loads in flight (a demote beside loads)."""
        # Plain dtype views: offsets count int32 words from the view's first byte.
        dev_words = rows_view.view(torch.int32)
        stride_w = dev_words.stride(0)
        rows_a = np.asarray(rows_l, dtype=np.int64)
        chunk, k = np.divmod(np.asarray(slots, dtype=np.int64), region.per_chunk)
        for c in np.unique(chunk).tolist():
            sel = chunk == c
            d_off = rows_a[sel] * stride_w + off // 4
            h_off = (k[sel] * region.slot_bytes + off) // 4
            host_words = region.chunks[c].view(torch.int32)
            d_t, h_t = torch.from_numpy(d_off), torch.from_numpy(h_off)
            if self.device.type == "cuda":
                d_t, h_t = d_t.pin_memory(), h_t.pin_memory()
                keep += [d_t, h_t]  # read by the kernel until it ends: not freed (nor reused) before
            if direction == "d2h":
                copy_items(dev_words, d_t, host_words, h_t, n // 4, self.kernel_programs, self.kernel_block_words,
                           self.kernel_warps)
            else:
                copy_items(host_words, h_t, dev_words, d_t, n // 4, self.kernel_programs, self.kernel_block_words,
                           self.kernel_warps)

    def _get_staging(self, direction: str, row_bytes: int) -> torch.Tensor:
        """The direction's staging buffer (one per direction: D2H and H2D run at the same time)."""
        buf = self._staging.get(direction)
        if buf is None:
            buf = torch.empty(max(self._staging_bytes, row_bytes), dtype=torch.uint8, device=self.device)
            self._staging[direction] = buf
        return buf

    def _ticket(self, direction, kind, nbytes, slots) -> Ticket:
        t = Ticket(id=self._next_id, direction=direction, kind=kind, nbytes=nbytes, host_slots=list(slots))
        self._next_id += 1
        return t

    def _start(self, t: Ticket, finish, busy, keep: list) -> None:
        t._finish = finish
        for alloc, ids in busy:
            ids = list(dict.fromkeys(ids))  # one mark per slot, however often the ticket names it
            alloc.mark_busy(ids)
            t._release.append(lambda a=alloc, i=ids: a.unmark_busy(i))
        self.inflight_bytes += t.nbytes
        self.stats[f"{t.direction}_bytes"] += t.nbytes
        self.stats[f"{t.kind}_tickets"] += 1
        # On CPU the bytes have moved already, but the ticket (and its busy marks) end only at the next
        # poll or wait, as on the GPU: callers see one behaviour.
        self._queues[t.direction].append(t)
        # Hold every tensor the side stream uses until the ticket completes, so the caching allocator
        # cannot hand their memory to the compute stream while the copy still reads or writes it.
        t._keep = keep  # type: ignore[attr-defined]

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
        t._keep = None  # type: ignore[attr-defined]
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
