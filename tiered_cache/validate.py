"""Argument checks shared by every public API: integers are integers, numbers are finite and in range,
names are one of the names a setting knows. Each raises a typed error from ``tiered_cache.errors``
naming the argument, and returns the value in its plain Python form.

Why so strict: a string is a sequence of characters (``free("12")`` would free slots 1 and 2), a float
truncates (``free([3.7])`` would free slot 3), ``True`` is an ``int`` to Python, and NaN compares false
with everything (a NaN timeout never expires). Token ids and slot ids are integers and nothing else:
Python ``int`` (not ``bool``), integer numpy scalars or arrays, integer torch tensors.
"""

from __future__ import annotations

import math
import numbers
from array import array
from collections.abc import Iterable
from typing import Any, Optional

import numpy as np
import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError

_INT_TORCH = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16, torch.uint32,
              torch.uint64)


def is_int(value: Any) -> bool:
    """True for a Python int (not a bool) or an integer numpy scalar / 0-d integer tensor."""
    if isinstance(value, bool) or isinstance(value, np.bool_):
        return False
    if isinstance(value, (int, np.integer)):
        return True
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype in _INT_TORCH


def int_arg(arg: str, value: Any, *, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """``value`` as a Python int in ``[lo, hi]`` (either bound optional)."""
    if type(value) is int and (lo is None or value >= lo) and (hi is None or value <= hi):
        return value  # the common case, without is_int's isinstance chain
    if not is_int(value):
        raise InvalidTypeError(arg, _range_text("an int", lo, hi), value)
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise InvalidArgumentError(arg, _range_text("an int", lo, hi), value)
    return v


def float_arg(arg: str, value: Any, *, lo: Optional[float] = None, hi: Optional[float] = None,
              lo_open: bool = False, allow_inf: bool = False) -> float:
    """``value`` (an int or a real, not a bool) as a float: never NaN; infinite only if ``allow_inf``;
    ``>= lo`` (``> lo`` with ``lo_open``) and ``<= hi``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidTypeError(arg, "a real number", value)
    v = float(value)
    bad = math.isnan(v) or (math.isinf(v) and not allow_inf)
    if lo is not None:
        bad = bad or v < lo or (lo_open and v == lo)
    if hi is not None:
        bad = bad or v > hi
    if bad:
        what = "a finite number" if not allow_inf else "a number (not NaN)"
        if lo is not None:
            what += f" {'>' if lo_open else '>='} {lo}"
        if hi is not None:
            what += f" <= {hi}"
        raise InvalidArgumentError(arg, what, value)
    return v


def choice_arg(arg: str, value: Any, choices: Iterable[str]) -> str:
    """``value`` as one of the names in ``choices``."""
    names = tuple(choices)
    if not isinstance(value, str):
        raise InvalidTypeError(arg, f"one of {names}", value)
    if value not in names:
        raise InvalidArgumentError(arg, f"one of {names}", value)
    return value


_PLAIN_INT = {int}


def int_list(arg: str, values: Any) -> list[int]:
    """A 1-D integer sequence as a list of Python ints.

    Taken: lists and tuples of ints (not bools), ``range``, ``array`` of an integer typecode, 1-D integer
    numpy arrays and 1-D integer torch tensors (any device). Refused with ``InvalidTypeError``: strings,
    bytes, floats (even integral ones), bools, None, nested sequences, anything else.
    """
    if isinstance(values, torch.Tensor):
        if values.dim() != 1 or values.dtype not in _INT_TORCH:
            raise InvalidTypeError(arg, "a 1-D integer tensor", (tuple(values.shape), values.dtype))
        return values.tolist()
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise InvalidTypeError(arg, "a 1-D integer array", (values.shape, str(values.dtype)))
        return values.astype(np.int64).tolist() if values.dtype != np.uint64 else [int(v) for v in values]
    if isinstance(values, range):
        return list(values)
    if isinstance(values, array):
        if values.typecode not in "bBhHiIlLqQ":
            raise InvalidTypeError(arg, "an array of an integer typecode", values.typecode)
        return values.tolist()
    if isinstance(values, (list, tuple)):
        out = list(values)
        if set(map(type, out)) <= _PLAIN_INT:  # the common case, checked in C: a prompt is thousands of ids
            return out
        for v in out:
            if type(v) is not int and not is_int(v):
                raise InvalidTypeError(arg, "a sequence of ints (not bools, floats or strings)", v)
        return [int(v) for v in out]
    raise InvalidTypeError(arg, "a list, tuple, range, integer array or integer tensor of ids", values)


def _range_text(what: str, lo: Optional[int], hi: Optional[int]) -> str:
    if lo is not None and hi is not None:
        return f"{what} in [{lo}, {hi}]"
    if lo is not None:
        return f"{what} >= {lo}"
    if hi is not None:
        return f"{what} <= {hi}"
    return what


def bool_arg(arg: str, value: Any) -> bool:
    """``value`` as a bool: ``True``/``False`` (or a numpy bool) only; ``0``, ``"no"`` or ``None`` are refused,
    since a flag given a string (``lazy="false"``) would read as true."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidTypeError(arg, "a bool", value)
    return bool(value)


def str_arg(arg: str, value: Any, *, empty: bool = False) -> str:
    """``value`` as a str (non-empty unless ``empty``)."""
    if not isinstance(value, str):
        raise InvalidTypeError(arg, "a str", value)
    if not value and not empty:
        raise InvalidArgumentError(arg, "a non-empty str", value)
    return value


def index_arg(arg: str, value: Any, size: int) -> int:
    """``value`` as an index in ``[0, size)``: ``InvalidTypeError`` for a non-int, ``OutOfRangeError``
    (also an ``IndexError``) outside the range. Negative indices are refused, not counted from the end."""
    from tiered_cache.errors import OutOfRangeError

    if not is_int(value):
        raise InvalidTypeError(arg, f"an int in [0, {size})", value)
    v = int(value)
    if not 0 <= v < size:
        raise OutOfRangeError(arg, f"an int in [0, {size})", value)
    return v


def instance_arg(arg: str, value: Any, cls: type, what: str, *, none_ok: bool = False) -> Any:
    """``value`` if it is a ``cls`` (or None, with ``none_ok``); else ``InvalidTypeError`` naming ``arg``
    with ``what`` as the expected thing (e.g. ``"a HostMirror"``)."""
    if (value is None and none_ok) or isinstance(value, cls):
        return value
    raise InvalidTypeError(arg, what + (" or None" if none_ok else ""), type(value).__name__)
