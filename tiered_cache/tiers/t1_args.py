"""The argument work of a T0 <-> T1 move (``Int8CheckpointPool.store_from_active`` / ``load_to_active``),
kept small on the per-call path: an engine checkpoints one to a few states a step, and the checks once
cost as much host time as the copy of 16 states took on the GPU.

- A T0 ``StateSide``'s views are fixed for its life (they alias its buffer), so they are taken and
  checked once per side (``Layout``): against the spec, against T1's fields and against every kernel's
  shape rules. Before, each call rebuilt the layer byte offsets and re-checked every view.
- Plain views (``ActiveViews`` or a temporal tensor, made by the caller, often anew each call) are taken
  and checked once per memory and geometry (``views_key``: each view's address, dtype, device, shape and
  strides), for the last ``VIEW_LAYOUTS`` such views: their launch plans are bound once too. A cached
  ``Layout`` holds its views, so their memory stays allocated and no other tensor can take their address
  while it is cached: a view with the same key reads and writes the same bytes the same way.
- Ids are checked on the host (range, allocated, distinct: numpy, or plain Python for a short list), virtual
  ids translated on the side's host table; up to ``quant.PACKED`` (16) rows and slots then go to the kernels as
  launch arguments (``quant.pack_ids``: nothing copied), more as one page-locked array in one non-blocking copy
  (``launch.IdRing``): no device sync, and the kernels follow on the stream without a gap.
- Ids given as device tensors are read back once (the checks need their values: a sync).

Every check runs before the first launch: a bad argument raises and nothing is written.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache import device as dev
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, SlotStateError
from tiered_cache.kernels import launch, quant
from tiered_cache.tiers.protocols import StateSide
from tiered_cache.tiers.t1_host import HostMoves, host_moves
from tiered_cache.validate import _INT_TORCH, _PLAIN_INT, int_list


@dataclass(frozen=True)
class ActiveViews:
    """T0-like views indexed by *physical* row, for callers without a ``StateSide`` (tests, adapters).

    ``temporal [L, R, *spec.temporal_shape]`` (None for a conv-only spec) and one ``[L, R, *conv_shape]``
    per conv window.
    """

    temporal: Optional[torch.Tensor]
    convs: tuple[torch.Tensor, ...] = ()


@dataclass(frozen=True)
class Layout:
    """Where a move reads or writes T0 states, checked: ``temporal [L, R, H, a, b]``, its canonical view
    ``state [L, R, H, d_v, d_k]`` (what the int8 kernels take), one view per conv window. A conv-only
    spec has neither temporal view (None)."""

    temporal: Optional[torch.Tensor]
    state: Optional[torch.Tensor]
    convs: tuple[torch.Tensor, ...]
    what: str  # what the ids name, for errors: virtual ids of a side, or physical rows
    host: Optional[HostMoves] = None  # the moves on numpy views, where they apply (CPU: ``t1_host``)
    # the launches of each direction, bound to these views once (``quant.StorePlan`` ...), made on first use
    plans: dict[str, list[Any]] = field(default_factory=dict, init=False, compare=False, repr=False)

    rows: int = field(init=False, compare=False)  # the side's row count (what a physical row id must be below)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", (self.temporal if self.temporal is not None else self.convs[0]).shape[1])


_SIDE_TYPES: dict[type, bool] = {}


def is_state_side(side: Any) -> bool:
    """``isinstance(side, StateSide)``, cached by type: a runtime-checked protocol looks up every member
    on each call (20-40 us of host time on the H200 machine, twice a move, 2026-12-01)."""
    t = type(side)
    hit = _SIDE_TYPES.get(t)
    if hit is None:
        hit = _SIDE_TYPES[t] = isinstance(side, StateSide)
    return hit


def host_ids(name: str, ids: Any, device: torch.device) -> np.ndarray:
    """Ids as an int64 numpy array: host sequences checked by type; a device tensor is read back."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype not in _INT_TORCH:
            raise InvalidTypeError(name, "a 1-D integer tensor", (ids.dtype, tuple(ids.shape)))
        if ids.device != device and ids.device.type != "cpu":
            raise InvalidArgumentError(name, f"a tensor on {device}", ids.device)
        return ids.detach().to("cpu", torch.int64).numpy()
    # a list of plain ints (what an engine passes) is taken as it is; anything else through int_list's checks
    vals = ids if type(ids) is list and set(map(type, ids)) <= _PLAIN_INT else int_list(name, ids)
    try:
        return np.array(vals, dtype=np.int64)
    except OverflowError:
        raise InvalidArgumentError(name, "ids in the int64 range",
                                   [v for v in vals if not -2**63 <= v < 2**63][:16]) from None


def _check_view(pool, name: str, t: object, inner: tuple[int, ...], dtype: torch.dtype,
                rows: Optional[int] = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise InvalidTypeError(name, "a tensor", type(t).__name__)
    L = pool.spec.num_layers
    want = (L, t.shape[1] if rows is None else rows, *inner) if t.dim() >= 2 else None
    if want is None or tuple(t.shape) != want:
        raise InvalidArgumentError(name, f"shape [L={L}, rows, *{inner}]", tuple(t.shape))
    if t.dtype != dtype:
        raise InvalidArgumentError(name, f"dtype {dtype}", t.dtype)
    if t.device != pool.device:
        raise InvalidArgumentError(name, f"a tensor on {pool.device}", t.device)
    return t


def make_layout(pool, side: Any) -> Layout:
    """``side``'s views checked against ``pool`` for both directions (no ids involved)."""
    spec, n_conv = pool.spec, len(pool.spec.conv_shapes)
    if is_state_side(side):
        if side.spec != spec:
            raise InvalidArgumentError("side", f"a T0 side whose spec is {spec}", side.spec)
        temporal = side.temporal_view_all() if spec.has_temporal else None
        convs = tuple(side.conv_view_all(i) for i in range(n_conv))
        what = "live virtual ids of the T0 side"
    elif isinstance(side, (ActiveViews, torch.Tensor)):
        temporal = side if isinstance(side, torch.Tensor) else side.temporal
        convs = () if isinstance(side, torch.Tensor) else tuple(side.convs)
        what = "physical rows"
    else:
        raise InvalidTypeError("side", "a T0 state side (StateSide), ActiveViews or a temporal tensor",
                               type(side).__name__)
    if spec.has_temporal:
        temporal = _check_view(pool, "side.temporal", temporal, spec.temporal_shape, spec.temporal_dtype)
    elif temporal is not None:
        raise InvalidArgumentError("side.temporal", "None (the spec has no temporal state)", type(temporal).__name__)
    if len(convs) != n_conv:
        raise InvalidArgumentError("side", f"{n_conv} conv views (spec.conv_shapes)", len(convs))
    rows = temporal.shape[1] if temporal is not None else None
    for i, c in enumerate(convs):
        _check_view(pool, f"side.convs[{i}]", c, spec.conv_shapes[i], spec.conv_dtype, rows)
        rows = c.shape[1]
    # every kernel's own rules, once: empty id tensors stand in for the ids (checked per call below)
    e = torch.empty(0, dtype=torch.int64, device=pool.device)
    va = spec.value_axis
    state: Optional[torch.Tensor] = None
    if temporal is None:
        pass  # conv windows only: the copies below
    elif pool.codec == "int8":
        qdata, scale = pool._temporal
        state = quant.validate_quantize_store(temporal, e, qdata, scale, e, va, check_ids=False,
                                              finite=pool.flags.flags)
        quant.validate_dequantize_load(qdata, scale, e, temporal, e, va, check_ids=False)
    else:
        (data,) = pool._temporal
        state = temporal
        quant.validate_copy_rows(temporal, e, data, e, check_ids=False, names=("side", "data"), finite=pool.flags.flags)
        quant.validate_copy_rows(data, e, temporal, e, check_ids=False, names=("data", "side"))
    for c_side, c_t1 in zip(convs, pool.conv):
        quant.validate_copy_rows(c_side, e, c_t1, e, check_ids=False, names=("side", "conv"), finite=pool.flags.flags)
        quant.validate_copy_rows(c_t1, e, c_side, e, check_ids=False, names=("conv", "side"))
    return Layout(temporal, state, convs, what, host_moves(pool, temporal, state, convs))


VIEW_LAYOUTS = 8  # the plain views' layouts a pool keeps, least recently used dropped first


def views_key(side: Any) -> Optional[tuple]:
    """What a ``Layout`` of plain views depends on: each view's address, dtype, device, shape and strides
    (None for an absent temporal view); None where ``side`` is not plain views (``make_layout`` says why)."""
    if isinstance(side, torch.Tensor):
        views: tuple = (side,)
    elif isinstance(side, ActiveViews) and isinstance(side.convs, (tuple, list)):
        views = (side.temporal, *side.convs)
    else:
        return None
    key: list[Optional[tuple]] = []
    for t in views:
        if t is None:
            key.append(None)
        elif isinstance(t, torch.Tensor):
            key.append((t.data_ptr(), t.dtype, t.device, t.shape, t.stride()))
        else:
            return None
    return tuple(key)


class CallArgs:
    """The per-call checks of one pool, with each T0 side's ``Layout`` cached (the side is held, so its
    id is never reused while cached), and those of the last ``VIEW_LAYOUTS`` plain views (``views_key``)."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self._layouts: dict[int, tuple[Any, Layout]] = {}
        self._views: OrderedDict[tuple, Layout] = OrderedDict()
        self._ring = launch.IdRing(pool.device) if pool.device.type == "cuda" else None

    def layout(self, side: Any) -> Layout:
        if is_state_side(side):
            hit = self._layouts.get(id(side))
            if hit is not None and hit[0] is side:
                return hit[1]
            lay = make_layout(self.pool, side)
            self._layouts[id(side)] = (side, lay)
            return lay
        key = views_key(side)
        if key is None:
            return make_layout(self.pool, side)  # raises: not plain views
        kept = self._views.get(key)
        if kept is not None:
            self._views.move_to_end(key)
            return kept
        lay = self._views[key] = make_layout(self.pool, side)  # checked before it is kept
        if len(self._views) > VIEW_LAYOUTS:
            self._views.popitem(last=False)
        return lay

    def slots(self, name: str, ids: Any, unique: bool) -> np.ndarray:
        pool = self.pool
        host = host_ids(name, ids, pool.device)
        n = host.size
        if not n:
            return host
        lo, hi = _bounds(ids, host)
        if lo < 1 or hi > pool.num_slots:
            out = host[(host < 1) | (host > pool.num_slots)]
            raise InvalidArgumentError(name, f"checkpoint slot ids in [1, {pool.num_slots}]", out.tolist())
        allocated = pool.allocator._allocated[host]
        if _COUNT(allocated) != n:
            raise SlotStateError(name, "allocated checkpoint slots", host[~allocated].tolist())
        if unique and _repeats(ids, host):
            raise InvalidArgumentError(name, "distinct destination slots", host.tolist())
        return host

    def rows(self, side: Any, lay: Layout, active_ids: Any, unique: bool) -> np.ndarray:
        host = host_ids("active_ids", active_ids, self.pool.device)
        n = host.size
        if not n:
            return host
        if is_state_side(side):
            if (0 in active_ids) if _few(active_ids) else _COUNT(host) != n:
                raise InvalidArgumentError("active_ids", "active state ids (slot 0 is the sink, never active)",
                                           host.tolist())
            try:
                host = np.asarray(side.translate_host(host), dtype=np.int64)  # a free id maps to -1
            except InvalidArgumentError:
                raise InvalidArgumentError("active_ids", "virtual ids of the T0 side", host.tolist()) from None
            lo, hi = _bounds(None, host)
            if lo < 0 or hi >= lay.rows:  # a free id's row is negative
                raise InvalidArgumentError("active_ids", f"{lay.what} (rows in [0, {lay.rows}))", host.tolist())
            given = None  # the rows are not the ids given
        else:
            lo, hi = _bounds(active_ids, host)
            if lo < 0 or hi >= lay.rows:
                raise InvalidArgumentError("active_ids", f"{lay.what} (rows in [0, {lay.rows}))", host.tolist())
            given = active_ids
        if unique and _repeats(given, host):
            raise InvalidArgumentError("active_ids", "distinct destination states", host.tolist())
        return host

    def to_device(self, rows: np.ndarray, slots: np.ndarray) -> tuple[Any, Any]:
        """Rows and slots for the launches: up to ``quant.PACKED`` of each as kernel arguments (``quant.pack_ids``:
        ``(arguments, None)``, nothing copied); more on the pool's device in one non-blocking copy from
        page-locked memory (``launch.IdRing``: no allocation per call; ``sent`` after the launches). On the
        CPU nothing is sent: the checked arrays themselves (the numpy moves take them; ``ids_tensor`` wraps
        them for a torch launch without a copy)."""
        n = rows.size
        if self._ring is None:
            return rows, slots
        if n <= quant.PACKED:
            packed = quant.pack_ids(rows.tolist(), slots.tolist())
            if packed is not None:
                return packed, None
        if n <= self._ring.width:
            return self._ring.send(rows, slots)
        both = dev.host_to_device(torch.from_numpy(np.concatenate([rows, slots])), self.pool.device)
        return both[:n], both[n:]

    def sent(self, given: Any, lend: bool = False) -> Any:
        """After the launches of a move whose ids ``to_device`` gave as ``given`` (its first value): an event
        recorded after them, or None (the CPU, ids passed as arguments, or ids past the ring's width);
        ``lend``: the caller keeps it (``IdRing.done``)."""
        if self._ring is not None and isinstance(given, torch.Tensor) and given.shape[0] <= self._ring.width:
            return self._ring.done(lend)
        return None


# ndarray.min / .max without their Python wrappers; count_nonzero for .all (a few ids: the wrapper, or the ufunc
# machinery, is most of the cost, ~1 us a call)
_MIN, _MAX, _COUNT = np.minimum.reduce, np.maximum.reduce, np.count_nonzero
_FEW = 16  # ids given as a list of at most this many: Python's min / max / set / in on it beat numpy's ~1 us calls


def _few(given: Any) -> bool:
    """Whether ``given`` (the caller's ids, checked by ``host_ids``) is a short list or tuple of ints."""
    return type(given) in (list, tuple) and len(given) <= _FEW


def _bounds(given: Any, host: np.ndarray) -> tuple[int, int]:
    """The least and greatest of ``host`` (non-empty; ``given`` the caller's ids it was made from, or None)."""
    if _few(given):
        return min(given), max(given)
    if host.size <= _FEW:
        lst = host.tolist()
        return min(lst), max(lst)
    return _MIN(host), _MAX(host)


def _repeats(given: Any, host: np.ndarray) -> bool:
    """Whether ``host`` (``given`` the caller's ids it was made from) repeats an id."""
    if host.size < 2:
        return False
    if host.size <= 64:  # a set of a few ints is cheaper than numpy's sort
        # of the converted ids, never the caller's items: a 0-d tensor hashes by identity, so two of one
        # value would not count as a repeat
        lst = host.tolist()
        return len(set(lst)) != len(lst)
    return bool(np.unique(host).size != host.size)


def ids_tensor(ids: Any) -> torch.Tensor:
    """Ids from ``CallArgs.to_device`` as a tensor (a CPU array is wrapped, not copied; a read-only one, the radix
    tree's kept id of one slot (``radix.checks.one_id``), copied: torch has no read-only tensors)."""
    if isinstance(ids, np.ndarray):
        return torch.from_numpy(ids if ids.flags.writeable else ids.copy())
    return ids


def _plans(pool, lay: Layout, op: str) -> list[Any]:
    """``lay``'s launches of a store or load, bound once: int8, the temporal state and the first conv window
    in one launch; lossless, one copy per field; any further conv window, one copy each. A store flags
    non-finite values in ``pool.flags`` (host memory on a GPU, which the kernels write through its mapping)."""
    plans = lay.plans.get(op)
    if plans is not None:
        return plans
    va, b, store = pool.spec.value_axis, pool.backend, op == "store"
    fin = pool.flags.flags if store else None
    convs = [(c0, c1) if store else (c1, c0) for c0, c1 in zip(lay.convs, pool.conv)]  # (src, dst)
    plans = []
    if lay.temporal is None:
        pass  # conv windows only: one copy each, below
    elif pool.codec == "int8":
        assert lay.state is not None
        qdata, scale = pool._temporal
        conv = convs.pop(0) if convs else None
        plans.append(quant.StorePlan(lay.temporal, lay.state, qdata, scale, va, b, fin, conv) if store
                     else quant.LoadPlan(qdata, scale, lay.temporal, lay.state, va, b, conv))
    else:
        t0, t1 = lay.temporal, pool._temporal[0]
        plans.append(quant.CopyPlan(t0, t1, b, fin) if store else quant.CopyPlan(t1, t0, b, None))
    plans += [quant.CopyPlan(src, dst, b, fin) for src, dst in convs]
    lay.plans[op] = plans
    return plans


def kernels_store(pool, lay: Layout, rows: Any, slots: Any, mark: int, n: int) -> None:
    """The launches of a store of ``n`` states (all checked before; ``_plans``), ``rows`` and ``slots`` as
    ``CallArgs.to_device`` gives them; ``mark``: the store's (``FiniteFlags.arm``)."""
    if lay.host is not None and lay.host.store(rows, slots):
        return  # on the CPU, all finite: numpy did it (a NaN or an inf: the twins below, which flag it)
    if slots is None:  # ids as kernel arguments (``CallArgs.to_device``)
        for plan in _plans(pool, lay, "store"):
            plan.packed(rows, n, mark)
        return
    rows, slots = ids_tensor(rows), ids_tensor(slots)
    for plan in _plans(pool, lay, "store"):
        plan(rows, slots, mark)


def kernels_load(pool, lay: Layout, slots: Any, rows: Any, n: int) -> None:
    """The launches of a load, as ``kernels_store``'s."""
    if lay.host is not None:
        lay.host.load(slots, rows)
        return
    if rows is None:  # ids as kernel arguments (``CallArgs.to_device(slots, rows)``)
        for plan in _plans(pool, lay, "load"):
            plan.packed(slots, n)
        return
    slots, rows = ids_tensor(slots), ids_tensor(rows)
    for plan in _plans(pool, lay, "load"):
        plan(slots, rows)
