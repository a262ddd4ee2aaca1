"""The T0 <-> T1 moves of a pool on the CPU, on numpy views of the same buffers: ``_ref_quant``'s math,
bit for bit, without torch's dispatch per op.

On the CPU the torch twins are what runs (the Triton interpreter is for tests), and a move of a few
hundred bytes is ~30 torch calls at 3-6 us each: 100-200 us of host time per store, as much as the
whole radix insert around it (``bench_radix.py``, 2026-12-01). numpy does the same elementwise IEEE
operations (abs, max, the fp32 divisions, round half to even, the casts) at ~1 us a call.

``HostMoves`` is made once per ``Layout`` (views of the T0 side and of T1 never change); ``None``
where this path does not apply: a non-CPU pool, the Triton backend, or a dtype numpy lacks (bf16,
fp8). A move whose states hold a NaN or an inf also takes the torch path (``store`` returns False):
the int8 cast of a NaN is not defined, so only the torch twin says what lands in T1, and the
finiteness flags are marked there. Ids are checked before (``t1_args``); nothing is checked here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache.kernels import _ref_quant, use_triton

_NP: dict[torch.dtype, Any] = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
       torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32,
       torch.int64: np.int64}


_EPS, _QMAX = np.float32(_ref_quant.AMAX_EPS), np.float32(_ref_quant.QMAX)  # made once: a scalar costs a call
_MAX, _ALL = np.maximum.reduce, np.logical_and.reduce  # ndarray.max / .all without their Python wrappers


def _np(t: torch.Tensor) -> np.ndarray:
    return t.numpy()  # a view: CPU tensors share their memory (and strides) with the array


def _ix(ids: np.ndarray) -> Any:
    """One id as a slice (numpy's basic indexing: views, no gather), more as the array."""
    if ids.size == 1:
        i = int(ids[0])
        return slice(i, i + 1)
    return ids


@dataclass(frozen=True)
class HostMoves:
    """numpy views of one ``Layout`` and its pool: ``state [L, R, H, d_v, d_k]`` (canonical) and
    ``temporal [L, R, H, a, b]`` of T0, T1's ``qdata``/``scale`` (int8) or ``data`` (lossless), and
    (T0 view, T1 view) per conv window."""

    int8: bool
    state: np.ndarray
    temporal: np.ndarray
    t1: tuple[np.ndarray, ...]
    convs: tuple[tuple[np.ndarray, np.ndarray], ...]
    dtype: Any  # numpy dtype of the temporal state
    min_scale: Any  # the dtype's scale floor (``_ref_quant.min_scale``), 0 for none

    def store(self, rows: np.ndarray, slots: np.ndarray) -> bool:
        """T0 rows -> T1 slots (slots distinct). False, with nothing written: a value is NaN or inf."""
        rows, slots = _ix(rows), _ix(slots)
        x = self.state[:, rows]
        convs = [(src[:, rows], dst) for src, dst in self.convs]
        if self.int8:
            xf = x if x.dtype == np.float32 else x.astype(np.float32)
            # the scale's amax is NaN or inf exactly when a value is (max propagates NaN): one pass, not two
            amax = _MAX(np.abs(xf), axis=-2, keepdims=True)
            if not _ALL(np.isfinite(amax), axis=None):
                return False
        elif not _ALL(np.isfinite(x), axis=None):
            return False
        for c, _ in convs:
            if c.dtype.kind == "f" and not _ALL(np.isfinite(c), axis=None):
                return False
        if self.int8:
            qdata, scale = self.t1
            s = np.maximum(amax, _EPS)
            s /= _QMAX
            if self.dtype is not np.float32:  # the scale is rounded to the state's dtype, as the twin does
                s = s.astype(self.dtype)
            if self.min_scale:
                s = np.maximum(s, self.min_scale)
            q = xf / (s if s.dtype == np.float32 else s.astype(np.float32))
            np.rint(q, out=q)
            np.minimum(np.maximum(q, -_QMAX, out=q), _QMAX, out=q)
            qdata[:, slots] = q.astype(np.int8)
            scale[:, slots] = s
        else:
            self.t1[0][:, slots] = self.temporal[:, rows]
        for vals, dst in convs:
            dst[:, slots] = vals
        return True

    def load(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """T1 slots -> T0 rows (rows distinct)."""
        slots, rows = _ix(slots), _ix(rows)
        if self.int8:
            qdata, scale = self.t1
            x = qdata[:, slots].astype(np.float32)
            s = scale[:, slots]
            x *= s if s.dtype == np.float32 else s.astype(np.float32)
            self.state[:, rows] = x if self.dtype is np.float32 else x.astype(self.dtype)
        else:
            self.temporal[:, rows] = self.t1[0][:, slots]
        for t0, t1 in self.convs:
            t0[:, rows] = t1[:, slots]


def host_moves(pool: Any, temporal: Optional[torch.Tensor], state: Optional[torch.Tensor],
               convs: tuple[torch.Tensor, ...]) -> Optional[HostMoves]:
    """``HostMoves`` for checked views of a T0 side (``t1_args.make_layout``) and ``pool``, or None where the
    torch or Triton path must run."""
    if pool.device.type != "cpu" or use_triton(pool.device, pool.backend) or temporal is None or state is None:
        return None
    tensors = [temporal, *pool._temporal, *convs, *pool.conv]
    if any(t.dtype not in _NP for t in tensors):
        return None
    dtype = _NP[temporal.dtype]
    floor = _ref_quant.min_scale(temporal.dtype)
    return HostMoves(pool.codec == "int8", _np(state), _np(temporal), tuple(_np(t) for t in pool._temporal),
                     tuple((_np(a), _np(b)) for a, b in zip(convs, pool.conv)), dtype, dtype(floor) if floor else 0)
