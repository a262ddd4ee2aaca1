"""How the ``TransferEngine`` moves scattered device rows to and from host slots: ``ScatterCopier``.

A move names device rows (T0 pages, T1 envelopes) in any order and host slots that come in runs of
consecutive ids (``HostRegion.runs``). Three ways to move them (``method``):

    copy      one ``cudaMemcpyAsync`` per row: DMA, no SMs, a fixed cost per call
    staging   one gather kernel into a device staging buffer, then one DMA copy per host run (or the
              reverse): few calls, but the bytes cross HBM twice. A sub-range of each row (one layer of
              KV pages) is packed in the buffer and moved by one strided DMA per host run
              (``cudaMemcpy2DAsync``, ``Dma2D``) where ``cuda-bindings`` offers it, else by the kernel
    kernel    a few programs that read or write the mapped pinned host memory directly
              (``kernels/hostcopy.py``): no per-call cost, takes a few SMs from compute
    batch     every row (or run of rows adjacent on both sides) as one entry of one
              ``cudaMemcpyBatchAsync`` call (``batch_dma.py``): DMA, no SMs, one call per move; only
              where ``cuda-bindings`` offers it (``auto`` falls back to ``kernel`` elsewhere)

``bench_transfer.py`` measures all three against a contiguous pinned copy; ``DEFAULT_METHOD``'s comment
gives the choice. Everything here runs on the caller's current stream (the engine's copy stream).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.kernels import use_triton
from tiered_cache.kernels.hostcopy import copy_items
from tiered_cache.tiers.host_mirror import HostRegion
from tiered_cache.transfer.batch_dma import BatchDMA, Dma2D

# ``auto`` picks by row size and direction, from bench_transfer.py on the H200 (benchmarks/results/transfer-h200.md):
# rows of AUTO_COPY_MIN_BYTES or more (state envelopes, ~21 MB for Qwen3-Next-80B) go as one DMA copy
# each: they reach ~0.95 of a contiguous pinned copy and use no SMs. Smaller rows (KV pages, 384 KiB to
# 1.5 MiB) pay a fixed cost per copy call (per-page copies 19-47 GB/s sustained), so: H2D as one
# ``cudaMemcpyBatchAsync`` per move where it exists (45-51 GB/s sustained, the kernel 37-39), D2H through
# the few-program mapped-memory kernel (42-44 GB/s, batched DMA 35-42), and both ways at once the two
# side by side: 73-78 GB/s sustained, where batched DMA both ways reached 47-64 and the kernel both ways
# 45-46 (c381ac4, 2026-12-01). Without batched DMA both directions take the kernel (or the staging
# buffer for long host runs).
DEFAULT_METHOD = {"d2h": "auto", "h2d": "auto"}
METHODS = ("auto", "copy", "staging", "kernel", "batch")
AUTO_COPY_MIN_BYTES = 2 << 20


class ScatterCopier:
    """The three ways to copy scattered rows, with their tunables and staging buffers.

    Args:
        device: the GPU (or CPU) the rows live on.
        method: per direction (``d2h``, ``h2d``), one of ``METHODS`` (checked by the engine).
        staging_bytes: size of each direction's device staging buffer (made on first use).
        backend: ``auto`` | ``triton`` | ``torch`` for the kernels (see ``kernels.use_triton``).
    """

    def __init__(self, device: torch.device, method: dict[str, str], staging_bytes: int, backend: str) -> None:
        self.device = device
        self.method = method
        self.backend = backend
        self.kernel_programs = 16  # programs of the mapped-memory copy kernel (few: leave SMs to compute)
        self.kernel_block_words = 2048  # int32 words a program moves per step (power of two)
        self.kernel_warps = 4  # warps per program
        self.kernel_vector = True  # four words a lane where every range is 16-byte aligned (``copy_items``)
        # programs of the staging gather / scatter (device to device: many, to run near HBM speed)
        self.staging_programs = 4 * dev.multiprocessor_count(device) if device.type == "cuda" else 4
        self._staging: dict[str, torch.Tensor] = {}
        self._staging_bytes = staging_bytes
        self.batch = BatchDMA(device)  # probed on first use; unavailable on CPU and without cuda-bindings
        self.dma2d = Dma2D(device)  # likewise: a layer's sub-range of a host run as one strided DMA

    def pick(self, direction: str, row_bytes: int, runs: list, sub: bool) -> str:
        """The method for one copy call; ``sub``: whether it moves a sub-range (one layer) of each row."""
        method = self.method[direction]
        if method == "auto":
            if self.device.type != "cuda" or row_bytes >= AUTO_COPY_MIN_BYTES:
                return "copy"
            # Small rows: H2D of whole rows by batched DMA where it exists (a layer's sub-range of each
            # row stays on the kernel); without it, consecutive host slots H2D go as one DMA copy per run
            # through the staging buffer when runs are long. D2H always through the few-program kernel:
            # measured on an H100 (transfer-h100.md, 1,024 pages, 2026-12-07), long runs D2H by staging
            # reached 39.3 GB/s against the kernel's 40.6 alone, and both ways beside batched DMA H2D
            # 49.1 against the kernel's 72.0 (the short run before it: 28.4 against 36.0). A layer of a run
            # by one 2D DMA (``staging`` with ``Dma2D``) only when asked: 36.3 against the kernel's 40.4.
            if direction == "h2d" and not sub and self.batch.available:
                return "batch"
            run_bytes = row_bytes * sum(k for _, _, k in runs) / max(1, len(runs))
            long_h2d = direction == "h2d" and run_bytes >= AUTO_COPY_MIN_BYTES and not sub
            method = "staging" if long_h2d else "kernel"
        if method == "batch" and not self.batch.available:
            method = "kernel"  # no cuda-bindings (or no CUDA): the few-program kernel instead
        if method == "staging" and sub and not self.dma2d.available:
            method = "kernel"  # a layer's sub-range of a host run is strided: without 2D DMA, the kernel
        if method == "kernel" and not use_triton(self.device, self.backend):
            return "copy"  # CPU without the interpreter: the kernel cannot run here
        return method

    def copy_rows(self, direction: str, rows_view: torch.Tensor, rows_t: torch.Tensor, rows_l: list[int],
                  region: HostRegion, slots: list[int], sub: Optional[tuple[int, int]] = None,
                  keep: Optional[list] = None) -> None:
        """Copy ``rows_view[rows_l[i]]`` to host slot ``slots[i]`` (``d2h``) or back (``h2d``) on the current
        stream; ``sub``: only the ``(offset, nbytes)`` range of each row. ``keep`` collects host tensors a
        kernel reads after this returns (held until the ticket ends)."""
        off, n = sub if sub is not None else (0, region.slot_bytes)
        runs = region.runs(slots)
        method = self.pick(direction, region.slot_bytes, runs, sub is not None)
        if method == "kernel":
            self._kernel(direction, rows_view, rows_l, region, slots, off, n, keep)
            return
        if method == "staging":
            self._staging_copy(direction, rows_view, rows_t, region, slots, keep, sub)
            return
        if method == "batch":
            self._batch(direction, rows_view, rows_l, region, slots, off, n)
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

    def _staging_copy(self, direction, rows_view, rows_t, region, slots, keep, sub=None):
        """Gather device rows into a staging buffer (one kernel), then one DMA copy per run of
        consecutive host slots (or the reverse), in groups that fit the buffer. With ``sub`` (``(offset,
        nbytes)`` of each row: one layer of KV pages) only that range of each row is packed in the buffer,
        and each run moves as one strided DMA (``Dma2D``): its ranges lie one host slot apart."""
        e = region.slot_bytes
        off, n = sub if sub is not None else (0, e)
        staging = self._get_staging(direction, n)
        per = staging.numel() // n
        stream = dev.current_stream(self.device)
        for g0 in range(0, len(slots), per):
            g1 = min(len(slots), g0 + per)
            stage = staging[: (g1 - g0) * n].view(g1 - g0, n)
            if direction == "d2h":
                self._stage_rows(rows_view, rows_t[g0:g1], stage, True, keep, off)
            for pos, s0, k in region.runs(slots[g0:g1]):
                if sub is not None:
                    host, dst = int(region.slot_addresses([s0])[0]) + off, stage.data_ptr() + pos * n
                    if direction == "d2h":
                        self.dma2d.copy(host, e, dst, n, n, k, "d2h", _raw(stream))
                    else:
                        self.dma2d.copy(dst, n, host, e, n, k, "h2d", _raw(stream))
                    continue
                host, dev_part = region.run_view(s0, k), stage[pos:pos + k].reshape(-1)
                if direction == "d2h":
                    host.copy_(dev_part, non_blocking=True)
                else:
                    dev_part.copy_(host, non_blocking=True)
            if direction == "h2d":
                self._stage_rows(rows_view, rows_t[g0:g1], stage, False, keep, off)

    def _stage_rows(self, rows_view, ids, stage, to_stage: bool, keep, off: int = 0) -> None:
        """``stage[i] = rows_view[ids[i], off:off + w]`` (``to_stage``) or the reverse, ``w`` the stage's
        width, on the current (side) stream. With Triton: one ``copy_items`` launch over many programs
        (device to device) that reads the row offsets from page-locked host memory, since a host-to-device
        copy of the ids would queue in the H2D copy engine behind the large loads in flight. Without:
        torch's index ops."""
        e = stage.shape[1]
        if use_triton(self.device, self.backend) and e % 4 == 0 and off % 4 == 0:
            rows_w, stage_w = rows_view.view(torch.int32), stage.view(torch.int32)
            r_off = ids.cpu() * rows_w.stride(0) + off // 4
            s_off = torch.arange(len(ids), dtype=torch.int64) * stage_w.stride(0)
            if self.device.type == "cuda":
                r_off, s_off = r_off.pin_memory(), s_off.pin_memory()
                keep += [r_off, s_off]  # read by the kernel until it ends
            src, dst = ((rows_w, r_off), (stage_w, s_off)) if to_stage else ((stage_w, s_off), (rows_w, r_off))
            copy_items(src[0], src[1], dst[0], dst[1], e // 4, self.staging_programs, 4096, 8,
                       vector=self.kernel_vector)
            return
        idx = ids.to(self.device, non_blocking=True)
        part = rows_view[:, off:off + e]
        if to_stage:
            torch.index_select(part, 0, idx, out=stage)
        else:
            part.index_copy_(0, idx, stage)

    def _kernel(self, direction, rows_view, rows_l, region, slots, off, n, keep):
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
                           self.kernel_warps, self.kernel_vector)
            else:
                copy_items(host_words, h_t, dev_words, d_t, n // 4, self.kernel_programs, self.kernel_block_words,
                           self.kernel_warps, self.kernel_vector)

    def _batch(self, direction, rows_view, rows_l, region, slots, off, n) -> None:
        """One ``cudaMemcpyBatchAsync`` for all rows on the current stream; rows adjacent on both sides
        merge into one copy. The host chunks belong to the region and the device rows to their side,
        so nothing needs keeping past the call."""
        dev_addr = rows_view.data_ptr() + np.asarray(rows_l, dtype=np.int64) * rows_view.stride(0) + off
        host_addr = region.slot_addresses(slots) + off
        dst, src = (host_addr, dev_addr) if direction == "d2h" else (dev_addr, host_addr)
        self.batch.copy(dst, src, n, dev.current_stream(self.device))

    def _get_staging(self, direction: str, row_bytes: int) -> torch.Tensor:
        """The direction's staging buffer (one per direction: D2H and H2D run at the same time)."""
        buf = self._staging.get(direction)
        if buf is None:
            buf = torch.empty(max(self._staging_bytes, row_bytes), dtype=torch.uint8, device=self.device)
            self._staging[direction] = buf
        return buf


def _raw(stream) -> int:
    """The raw CUDA handle of ``stream`` (0 for the CPU's ``NullStream``: only stand-ins run there)."""
    return int(getattr(stream, "cuda_stream", 0))
