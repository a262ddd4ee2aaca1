"""Batched DMA: many scattered ``(dst, src, nbytes)`` copies in one ``cudaMemcpyBatchAsync`` call.

One ``cudaMemcpyAsync`` per KV page costs ~5-7 us of CPU and driver time each (docs/platform.md: one
call per 64 KiB chunk reaches 5 GB/s, 2 MiB 52 GB/s), which caps per-page DMA far below PCIe. CUDA
12.8 added ``cudaMemcpyBatchAsync``: the whole list of copies is one call, the copy engines run them
back to back, no SMs are taken. It is reached through the optional ``cuda-bindings`` package
(``cuda.bindings.runtime``); where it is missing (CPU CI, older CUDA) or fails its one probe copy,
``BatchDMA.available`` is false and the engine picks another method: nothing here is ever required.

Before submission the copies are *coalesced* (``coalesce``): copies adjacent on both sides (consecutive
host slots holding consecutive device rows) become one longer copy, so a node's pages that lie in one
run on both sides go as one DMA transfer. The order of copies inside a batch is not defined, which
``coalesce`` uses: it sorts by destination first.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch

from tiered_cache.errors import InvalidArgumentError


def coalesce(dst: np.ndarray, src: np.ndarray, nbytes: int | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge copies ``dst[i] <- src[i]`` of ``nbytes`` (one size for all, or one per copy) where one copy
    continues the previous one on both sides. Returns ``(dst, src, sizes)`` of the merged copies, sorted
    by destination; the bytes each destination address receives are unchanged."""
    d = np.asarray(dst, dtype=np.int64).reshape(-1)
    s = np.asarray(src, dtype=np.int64).reshape(-1)
    if d.size != s.size:
        raise InvalidArgumentError("src", f"{d.size} addresses, one per dst", s.size)
    n = np.broadcast_to(np.asarray(nbytes, dtype=np.int64), d.shape).copy()
    if (n < 0).any():
        raise InvalidArgumentError("nbytes", "sizes >= 0", n[n < 0][:16].tolist())
    keep = n > 0
    d, s, n = d[keep], s[keep], n[keep]
    if d.size == 0:
        return d, s, n
    order = np.argsort(d, kind="stable")
    d, s, n = d[order], s[order], n[order]
    # a copy starts a new run unless it begins where the previous one ended, on both sides
    starts = np.ones(d.size, dtype=bool)
    starts[1:] = (d[1:] != d[:-1] + n[:-1]) | (s[1:] != s[:-1] + n[:-1])
    first = np.flatnonzero(starts)
    sizes = np.add.reduceat(n, first)
    return d[first], s[first], sizes


def _runtime() -> Optional[Any]:
    """``cuda.bindings.runtime`` when it imports and offers ``cudaMemcpyBatchAsync``, else ``None``."""
    try:
        from cuda.bindings import runtime  # type: ignore[import-not-found]
    except Exception:  # not installed (CPU CI), or a build without CUDA: the engine takes another method
        return None
    return runtime if hasattr(runtime, "cudaMemcpyBatchAsync") else None


class _Probed:
    """A DMA call reached through ``cuda-bindings``: ``available`` is decided once, on first use, by the
    subclass's ``_probe`` (the call is there and one probe copy came back exact); a machine without it
    keeps ``available`` false and never calls into it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._rt: Optional[Any] = None
        self._checked = False
        self._ok = False
        self.error: Optional[str] = None  # why it is unavailable, for benchmarks and logs

    @property
    def available(self) -> bool:
        if not self._checked:
            self._checked = True
            self._ok = self.device.type == "cuda" and self._probe()
        return self._ok

    def _probe(self) -> bool:
        raise NotImplementedError


class BatchDMA(_Probed):
    """Submits coalesced copy lists on a CUDA stream with one ``cudaMemcpyBatchAsync`` each.

    The probe: the runtime API is there and one copy (a device buffer to pinned host memory and back,
    compared byte for byte) came back exact.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._attrs: Optional[list[Any]] = None

    def _probe(self) -> bool:
        rt = _runtime()
        if rt is None:
            self.error = "cuda.bindings.runtime with cudaMemcpyBatchAsync not importable"
            return False
        try:
            attr = rt.cudaMemcpyAttributes()
            attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
            self._rt, self._attrs = rt, [attr]
            src = torch.arange(4096, dtype=torch.int32, device=self.device).view(torch.uint8)
            host = torch.zeros(src.numel(), dtype=torch.uint8, pin_memory=True)
            back = torch.zeros_like(src)
            # a stream of its own: the runtime refuses the legacy default stream (cudaErrorInvalidValue on
            # the H200 image, 2026-12-01); the engine's copies run on its own streams too
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            half = src.numel() // 2  # two copies a batch, each half, the second half first
            self.submit(np.array([host.data_ptr() + half, host.data_ptr()]),
                        np.array([src.data_ptr() + half, src.data_ptr()]), np.array([half, half]), stream)
            self.submit(np.array([back.data_ptr()]), np.array([host.data_ptr()]), np.array([src.numel()]), stream)
            stream.synchronize()
            if not torch.equal(back, src):
                self.error = "cudaMemcpyBatchAsync probe copy came back different"
                return False
        except Exception as exc:  # an old driver, a binding of another signature: another method then
            self.error = f"cudaMemcpyBatchAsync probe failed: {exc!r}"
            self._rt = None
            return False
        return True

    def submit(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: Any) -> None:
        """One batch of already coalesced copies on ``stream`` (a ``torch.cuda.Stream`` other than the
        legacy default stream, which the runtime refuses); raises ``RuntimeError`` naming the CUDA error
        if the runtime refuses it."""
        if dst.size == 0:
            return
        rt = self._rt
        assert rt is not None and self._attrs is not None
        res = rt.cudaMemcpyBatchAsync(dst.tolist(), src.tolist(), sizes.tolist(), int(dst.size), self._attrs, [0], 1,
                                      rt.cudaStream_t(stream.cuda_stream))
        err = res[0] if isinstance(res, tuple) else res
        if err != rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaMemcpyBatchAsync of {dst.size} copies failed: {err}")

    def copy(self, dst: np.ndarray, src: np.ndarray, nbytes: int | np.ndarray, stream: Any) -> int:
        """Coalesce and submit; returns the number of copies submitted."""
        d, s, n = coalesce(dst, src, nbytes)
        self.submit(d, s, n, stream)
        return int(d.size)


class Dma2D(_Probed):
    """Strided DMA: ``height`` rows of ``width`` bytes, ``spitch`` apart at the source and ``dpitch`` apart at
    the destination, as one ``cudaMemcpy2DAsync`` (one copy-engine job, no SMs).

    What it is for: one layer of a run of consecutive host KV slots. A host slot holds a page's layers one
    after the other (``L0 K | L0 V | L1 K | ...``), so one layer of ``k`` consecutive slots is ``k`` ranges
    one slot apart: one 2D copy moves them into (or out of) a compact staging buffer, where a kernel
    scatters them to (or gathers them from) the pages' scattered device rows. Reached through the optional
    ``cuda-bindings`` like ``BatchDMA``; the probe: 2D copies both ways checked byte for byte.
    """

    def _probe(self) -> bool:
        try:
            from cuda.bindings import runtime
        except Exception:
            self.error = "cuda.bindings.runtime not importable"
            return False
        try:
            self._rt = runtime
            host = torch.arange(4 * 64, dtype=torch.int32).view(torch.uint8).pin_memory()  # 4 rows of 256 B
            dst = torch.zeros(4 * 48, dtype=torch.uint8, device=self.device)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            # bytes [16, 64) of each 256-byte row -> rows of 48, packed
            self.copy(dst.data_ptr(), 48, host.data_ptr() + 16, 256, 48, 4, "h2d", stream.cuda_stream)
            back = torch.zeros(4 * 256, dtype=torch.uint8, pin_memory=True)
            self.copy(back.data_ptr() + 16, 256, dst.data_ptr(), 48, 48, 4, "d2h", stream.cuda_stream)
            stream.synchronize()
            want = host.view(4, 256)[:, 16:64]
            if not (torch.equal(dst.cpu().view(4, 48), want) and torch.equal(back.view(4, 256)[:, 16:64], want)):
                self.error = "cudaMemcpy2DAsync probe copy came back different"
                return False
        except Exception as exc:
            self.error = f"cudaMemcpy2DAsync probe failed: {exc!r}"
            self._rt = None
            return False
        return True

    def copy(self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, direction: str,
             stream: int) -> None:
        """One 2D copy on the raw CUDA stream handle ``stream`` (not the legacy default stream); raises
        ``RuntimeError`` naming the CUDA error if the runtime refuses it."""
        if width == 0 or height == 0:
            return
        rt = self._rt
        assert rt is not None
        kind = (rt.cudaMemcpyKind.cudaMemcpyHostToDevice if direction == "h2d"
                else rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)
        res = rt.cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, kind, rt.cudaStream_t(stream))
        err = res[0] if isinstance(res, tuple) else res
        if err != rt.cudaError_t.cudaSuccess:
            raise RuntimeError(f"cudaMemcpy2DAsync of {height} x {width} bytes failed: {err}")
