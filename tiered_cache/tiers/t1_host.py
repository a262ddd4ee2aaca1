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

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache.kernels import _ref_quant, use_triton

_NP: dict[torch.dtype, Any] = {torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64,
       torch.int8: np.int8, torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32,
       torch.int64: np.int64}


_EPS, _QMAX = np.float32(_ref_quant.AMAX_EPS), np.float32(_ref_quant.QMAX)  # made once: a scalar costs a call
_QMIN = -_QMAX
_MAX, _ADD = np.maximum.reduce, np.add.reduce  # ndarray.max / .sum without their Python wrappers
try:  # the ufunc np.clip calls after its Python checks: one call for the clamp instead of a maximum and a minimum
    from numpy._core.umath import clip as _CLIP  # type: ignore[attr-defined]
except ImportError:  # numpy < 2
    from numpy.core.umath import clip as _CLIP  # type: ignore[no-redef]
_FEW = 64  # values summed as Python floats (``tolist``: one call) rather than by a numpy reduction (~1-2 us)


def _finite(a: np.ndarray) -> bool:
    """Whether no value of the float array ``a`` is NaN or +-inf, by one sum in double precision: a NaN or an inf
    makes it NaN or inf, and finite float16 / float32 values cannot overflow it (fewer than 2^900 of them). A
    float64 ``a`` whose sum overflows reads as non-finite: the caller then takes the torch path, right too."""
    if a.size <= _FEW:
        return math.isfinite(sum(a.ravel().tolist()))
    return math.isfinite(_ADD(a, axis=None, dtype=np.float64))


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
    # T0 row -> its views (state, temporal, each conv window's), made on first use: a row's window of the fixed T0
    # views never changes (compaction moves the data, not the views), and a view costs a numpy call (~1 us, several
    # in the middle of an insert); bounded by T0's rows
    _rows: dict = field(default_factory=dict, compare=False, repr=False)

    def row_views(self, rows: Any) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """(state, temporal, conv views) of T0 ``rows`` (``_ix``'s: one row's slice is looked up, not indexed; an
        array of rows: gathered copies, to read)."""
        if type(rows) is slice:
            got = self._rows.get(rows.start)
            if got is None:
                got = self._rows[rows.start] = (self.state[:, rows], self.temporal[:, rows],
                                                [t0[:, rows] for t0, _ in self.convs])
            return got
        return self.state[:, rows], self.temporal[:, rows], [t0[:, rows] for t0, _ in self.convs]

    def store(self, rows: np.ndarray, slots: np.ndarray) -> bool:
        """T0 rows -> T1 slots (slots distinct). False, with nothing written: a value is NaN or inf."""
        rows, slots = _ix(rows), _ix(slots)
        x, temporal, srcs = self.row_views(rows)
        if self.int8:
            xf = x if x.dtype == np.float32 else x.astype(np.float32)
            # the scale's amax is NaN or inf exactly when a value is (max propagates NaN): one pass, not two
            amax = _MAX(np.abs(xf), axis=-2, keepdims=True)
            if not _finite(amax):
                return False
        elif not _finite(x):
            return False
        convs = [(src, dst) for src, (_, dst) in zip(srcs, self.convs)]
        for c, _ in convs:
            if c.dtype.kind == "f" and not _finite(c):
                return False
        if self.int8:
            qdata, scale = self.t1
            s = np.maximum(amax, _EPS, out=amax)
            s /= _QMAX
            if self.dtype is not np.float32:  # the scale is rounded to the state's dtype, as the twin does
                s = s.astype(self.dtype)
            if self.min_scale:
                s = np.maximum(s, self.min_scale)
            q = xf / (s if s.dtype == np.float32 else s.astype(np.float32))
            # clamped before it is rounded: the bounds are whole numbers, so rint(clamp(q)) == clamp(rint(q))
            _CLIP(q, _QMIN, _QMAX, out=q)
            if type(slots) is slice:  # one slot: its T1 view, rounded and cast to int8 in the one call
                np.rint(q, out=qdata[:, slots], casting="unsafe")
            else:  # a gather's destination is no view: rounded here, cast by the assignment (the same C cast)
                qdata[:, slots] = np.rint(q, out=q)
            scale[:, slots] = s
        else:
            self.t1[0][:, slots] = temporal
        for vals, dst in convs:
            dst[:, slots] = vals
        return True

    def load(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """T1 slots -> T0 rows (rows distinct)."""
        slots, rows = _ix(slots), _ix(rows)
        if self.int8:
            qdata, scale = self.t1
            s = scale[:, slots]
            if type(rows) is slice and self.dtype is np.float32:  # one row: int8 * fp32 straight into its T0 view
                np.multiply(qdata[:, slots], s, out=self.row_views(rows)[0])  # (int8 -> fp32 is exact)
            else:
                x = qdata[:, slots].astype(np.float32)
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
