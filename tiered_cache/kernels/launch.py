"""Cheap Triton launches for the per-call T1 moves: a kernel bound once to the arguments that never change.

``kernel[grid](*args, **meta)`` costs 20-40 us of host time on the H200 machine (2026-12-01): Triton binds
every argument, computes each one's specialization (integer divisibility, pointer alignment), hashes them
into its cache key, checks the kernel's globals and only then calls the compiled launcher. A T1 move of
one to a few states is shorter than that on the GPU, and its arguments are the same on every call but for
the id pointers and the state count: a ``T0`` side's views and T1's buffers never move.

``Bound`` takes the fixed arguments once and the varying ones per call. The first call of each
*specialization class* of the varying values on the current device (``launch_key``: the device, and
``_spec_class`` of each value, what Triton would specialize on) goes through the ordinary launch, which
compiles or finds the kernel; later calls of that class hand the compiled kernel's launcher the stored
argument list with the varying values put in (tensors as their pointers). The class is at least as fine as
Triton's own key, so a compiled kernel is only reused for values it was compiled for, on the device it was
loaded on. The stored list holds the kernel's parameters in signature order, with or without the constexprs
(Triton versions differ: 3.3 and later pass them to the launcher); a launcher given the wrong count raises
``TypeError`` before it launches, and the other list is tried.

Ordinary launches throughout (nothing bound) under the interpreter (``TRITON_INTERPRET=1``: what the CPU
tests run), with ``TIERED_CACHE_ORDINARY_LAUNCHES=1`` (the switch back to Triton's own launches, should a
Triton version's launcher take an argument list and misread it; on the H200 at 5339582 every launch of the
engine's T1 path took the bound path, ``kernels-h200.json``), or where the compiled launcher takes neither
list; and each call made while a launch hook is set (a profiler wants every launch: the hooks are read at
every call, so one set after binding is seen). ``stats`` counts both kinds, so a benchmark can say which ran.
"""

from __future__ import annotations

import collections
import inspect
import os
from collections.abc import Sequence
from typing import Any

import torch

from tiered_cache import device as dev

# "fast": launches through a bound compiled kernel; "ordinary": through ``kernel[grid]``.
stats: collections.Counter[str] = collections.Counter()

_ORDINARY = object()  # a class whose launches stay ordinary (no compiled kernel to bind, or it refused)


def launch_key(device: Any, values: Sequence[Any], plain: Sequence[bool]) -> tuple[list[Any], tuple]:
    """The launcher's values of a call (tensors as their pointers) and the key of its compiled kernel: the
    current device (each has its own compiled kernel, loaded in its context, and its own streams) and each
    value's class (``_spec_class``; written out here, each pointer read once: this runs at every launch)."""
    vals: list[Any] = []
    key: list[Any] = [device]
    for v, p in zip(values, plain):
        if isinstance(v, torch.Tensor):
            ptr = v.data_ptr()
            vals.append(ptr)
            key.append((v.dtype, ptr % 16 == 0))
        else:
            vals.append(v)
            key.append(-2**31 <= v < 2**31 if p else (v == 1, v % 16 == 0, -2**31 <= v < 2**31, v < 2**63))
    return vals, tuple(key)


def _spec_class(v: Any, plain: bool = False) -> Any:
    """What Triton's specialization can depend on, for a varying argument: for an int its range class, 1,
    and divisibility by 16 (``plain``, an int the kernel declares ``do_not_specialize``: its range class
    alone); for a tensor its dtype and 16-byte alignment (the value passed is the pointer). Defined by
    ``launch_key``, which writes it out for every value of a launch."""
    return launch_key(None, (v,), (plain,))[1][1]


_HOOK_HOLDER: Any = None  # where this Triton keeps its launch hooks, found on first use


def _hooks_set() -> bool:
    """Whether a launch hook is set (a profiler's), read at every bound launch: a hook set after a kernel
    was bound still sees every launch. Triton 3.4 and later keep them in ``knobs.runtime``, 3.9 as chains
    of hooks, empty when none is set; earlier ones on ``CompiledKernel``."""
    global _HOOK_HOLDER
    holder = _HOOK_HOLDER
    if holder is None:
        try:
            from triton import knobs
        except ImportError:
            from triton.compiler import CompiledKernel

            holder = CompiledKernel
        else:
            holder = knobs.runtime
        _HOOK_HOLDER = holder
    for name in ("launch_enter_hook", "launch_exit_hook"):
        h = getattr(holder, name, None)
        if h is not None and (not hasattr(h, "calls") or h.calls):
            return True
    return False


_NAMES: dict[Any, list[str]] = {}


def param_names(kernel: Any) -> list[str]:
    names = _NAMES.get(kernel)
    if names is None:
        names = _NAMES[kernel] = list(inspect.signature(kernel.fn).parameters)
    return names


def _driver_getters() -> tuple[Any, Any]:
    """Triton's current-stream and current-device functions: the stream every ordinary launch goes to."""
    from triton.runtime import driver

    stream, device = driver.active.get_current_stream, driver.active.get_current_device
    if device is torch.cuda.current_device:  # its Python wrapper (lazy init, a check) costs more than the read
        device = torch._C._cuda_getDevice
    return stream, device


def _runs(idx: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """The positions ``idx[j]`` of the varying values in an argument list as runs ``(position, j, length)`` of
    neighbours (value ``j`` at ``position``, ``j + 1`` at ``position + 1`` ...): a run is one slice assignment."""
    runs: list[list[int]] = []
    for j, i in enumerate(idx):
        if runs and runs[-1][0] + runs[-1][2] == i and runs[-1][1] + runs[-1][2] == j:
            runs[-1][2] += 1
        else:
            runs.append([i, j, 1])
    return tuple((i, j, n) for i, j, n in runs)


class _Fast:
    """A compiled kernel and its argument lists (all parameters, and without the constexprs), the varying
    positions as ``_runs``; ``lists`` narrows to the one its launcher took."""

    __slots__ = ("run", "function", "packed", "lists")

    def __init__(self, compiled: Any, lists: list[tuple[list, tuple[tuple[int, int, int], ...]]]) -> None:
        self.run, self.function, self.packed = compiled.run, compiled.function, compiled.packed_metadata
        self.lists = lists


class Bound:
    """``kernel`` with every argument but ``vary`` bound: ``bound(grid, *values)`` launches it with the
    varying arguments (named in ``vary``, in that order) set to ``values`` on the current stream.

    ``args``: the positional arguments (any value at the varying positions: it is never used);
    ``meta``: keyword arguments, constexprs and launch options (``num_warps``) alike; ``plain``: the varying
    ints the kernel declares ``do_not_specialize`` (a per-call counter would otherwise split into classes);
    ``fixed``: leading varying ints, all ``plain``, whose class the caller guarantees never changes (each call
    gives them in one range class: ``quant.pack_ids``' arguments): passed as they are, not keyed each call.
    Compiled kernels are kept per ``launch_key`` (the current device and the other values' classes)."""

    def __init__(self, kernel: Any, args: Sequence[Any], meta: dict[str, Any], vary: Sequence[str],
                 plain: Sequence[str] = (), fixed: int = 0) -> None:
        self.kernel, self.args, self.meta = kernel, list(args), dict(meta)
        self.names = param_names(kernel)
        self.vary = tuple(self.names.index(v) for v in vary)
        # varying ints the kernel does not specialize on (``do_not_specialize``): their class is their range
        self.plain = tuple(v in plain for v in vary)
        if not all(self.plain[:fixed]):
            raise ValueError("fixed varying arguments must be plain")
        self.fixed = fixed
        self._classes: dict[tuple, Any] = {}
        ordinary = os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("TIERED_CACHE_ORDINARY_LAUNCHES") == "1"
        self._off = ordinary or not hasattr(kernel, "warmup")  # no compiled kernel to bind (or asked not to)
        self._stream: Any = None  # the driver's current-stream and current-device getters, on the first call
        self._device: Any = None

    def _filled(self, values: Sequence[Any]) -> list[Any]:
        args = list(self.args)
        for i, v in zip(self.vary, values):
            args[i] = v
        return args

    def _ordinary(self, grid: tuple[int, ...], values: Sequence[Any]) -> Any:
        stats["ordinary"] += 1
        return self.kernel[grid](*self._filled(values), **self.meta)

    def __call__(self, grid: tuple[int, ...], *values: Any) -> None:
        if self._off or _hooks_set():  # a hook wants Triton's own launch (and its metadata), each time
            self._ordinary(grid, values)
            return
        if self._device is None:
            self._stream, self._device = _driver_getters()
        device = self._device()
        f = self.fixed
        if f:  # the fixed values' class is the first call's, whatever they are now
            vals, key = launch_key(device, values[f:], self.plain[f:])
            vals = [*values[:f], *vals]
        else:
            vals, key = launch_key(device, values, self.plain)
        fast = self._classes.get(key)
        if fast is None or fast is _ORDINARY:
            compiled = self._ordinary(grid, values)
            if fast is None:
                self._classes[key] = self._bind(compiled)
            return
        n = len(grid)
        g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
        stream = self._stream(device)
        while True:
            template, runs = fast.lists[0]
            a = template.copy()
            for i, j, n in runs:  # the varying values, a run of neighbouring parameters at a time
                a[i:i + n] = vals[j:j + n]
            try:
                fast.run(g0, g1, g2, stream, fast.function, fast.packed, None, None, None, *a)
            except (TypeError, ValueError):  # raised while parsing the arguments, before any launch
                if len(fast.lists) == 1:  # neither list: ordinary launches from now on (this one too)
                    self._classes[key] = _ORDINARY
                    self._ordinary(grid, values)
                    return
                fast.lists.pop(0)
                continue
            stats["fast"] += 1
            if len(fast.lists) > 1:
                del fast.lists[1:]  # this launcher's list
            return

    def _bind(self, compiled: Any) -> Any:
        """The compiled kernel of one class with its argument lists, or ``_ORDINARY``."""
        if compiled is None or not hasattr(compiled, "run"):
            return _ORDINARY
        sig = inspect.signature(self.kernel.fn).parameters
        full: list[Any] = []
        for pos, name in enumerate(self.names):
            if pos < len(self.args):
                v = self.args[pos]
            elif name in self.meta:
                v = self.meta[name]
            elif sig[name].default is not inspect.Parameter.empty:
                v = sig[name].default
            else:
                return _ORDINARY
            full.append(v.data_ptr() if isinstance(v, torch.Tensor) else v)
        constexpr = [i for i, p in enumerate(self.kernel.params) if p.is_constexpr]
        keep = [i for i in range(len(full)) if i not in constexpr]
        lists = [(full, _runs(self.vary))]
        if constexpr:
            if any(i in constexpr for i in self.vary):
                return _ORDINARY
            lists.append(([full[i] for i in keep], _runs(tuple(keep.index(i) for i in self.vary))))
        return _Fast(compiled, lists)


class _Entry:
    __slots__ = ("host", "host_np", "dev", "event", "lent", "views")

    def __init__(self, width: int, device: torch.device) -> None:
        self.host = dev.pinned_empty(2 * width * 8).view(torch.int64)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(2 * width, dtype=torch.int64, device=device)
        self.event = dev.new_event(device)
        self.lent = False  # the event is a caller's now (``IdRing.done``): the next use takes a fresh one
        self.views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class IdRing:
    """Two id arrays of up to ``width`` ints each (a move's sources and destinations) on the GPU in one
    fixed-size non-blocking copy from page-locked memory, with no allocation per call.

    Each entry is a page-locked host buffer and a device buffer of ``2 * width`` int64: the ids are written
    into the host buffer, the whole buffer is copied, and the views of the first ``n`` of each half are
    returned (cached per ``n``; the halves start 16-byte aligned, as ``Bound``'s classes expect). After
    the launches that read them, ``done`` records the entry's event: the entry is reused once its event
    has fired (its copy landed and its kernels ran, on whatever stream), and while it has not, the ring
    grows by an entry instead of waiting, so a caller running ahead of the GPU never blocks here.
    """

    def __init__(self, device: torch.device, width: int = 256) -> None:
        self.device, self.width = device, width
        self._ring = [_Entry(width, device)]
        self._i = 0

    def send(self, a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``a`` and ``b`` (int64 numpy arrays of one length ``n <= width``) on the device."""
        n, w = a.shape[0], self.width
        e = self._ring[self._i]
        if not e.event.query():  # still read by a move in flight: a new entry in its place
            e = _Entry(w, self.device)
            self._ring.insert(self._i, e)
        e.host_np[:n] = a
        e.host_np[w:w + n] = b
        e.dev.copy_(e.host, non_blocking=True)
        v = e.views.get(n)
        if v is None:
            v = e.views[n] = (e.dev[:n], e.dev[w:w + n])
        return v

    def done(self, lend: bool = False) -> Any:
        """After the launches that read the ids of the last ``send``: records and returns its event. ``lend``:
        the caller keeps the event (a store's flags wait on it, ``FiniteFlags``), and the entry records a fresh
        one at its next use, so a lent event is recorded once: it fires after these launches, never later."""
        e = self._ring[self._i]
        if e.lent:
            e.event = dev.new_event(self.device)
        dev.record_current(e.event, self.device)
        e.lent = lend
        self._i = (self._i + 1) % len(self._ring)
        return e.event
