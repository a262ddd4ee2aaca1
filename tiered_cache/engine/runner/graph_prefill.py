"""The gated-delta chunk rule of prefill forwards, replayed as CUDA graphs.

A prefill chunk of a few hundred tokens (a turn's new question on a cached history) is bound by kernel
launches on the H200, not by the GPU: flash-linear-attention's ``chunk_gated_delta_rule`` launches
about eight autotuned Triton kernels per call from Python, about 1 ms of CPU per call on that machine
(torch profiler and cProfile, 2026-11-30), and a split forward (``split_forward``) calls it twice per
linear layer. ``GraphChunkRule`` runs each call on static buffers instead, captured once per shape
bucket and replayed: a handful of copies and one graph launch per call.

Shapes: the sequence is padded up to a multiple of ``granule`` tokens (64, one chunk of the kernel) with
tokens that leave the recurrence as it was: zero query, key and value, ``beta = 0`` (no delta update)
and ``g = 0`` (no decay). The state after the padding is then the state after the real tokens, and
each real token's output only reads the tokens before it. transformers' torch rule pads its input the
same way to a multiple of its chunk size, so on that rule a padded call computes exactly what the call
would have. The input buffers are ``max_tokens`` long and shared by every shape (each reads a leading
view), so their memory does not grow with the number of shapes; what a longer call left in a shorter
call's padding is zeroed before the replay.

Only calls of one sequence (batch 1, no ``cu_seqlens``), up to ``max_tokens`` tokens, outside autograd,
are replayed, with ``g``, ``beta`` and ``initial_state`` as tensors and every other keyword a hashable
constant (part of the shape key); every other call runs as it came (``stats["eager"]``). At most
``max_graphs`` shapes are captured (one memory pool shared by all: each call's outputs are copied out
right after its replay). Every capture runs inside ``capture_window`` (what else could make a CUDA call
meanwhile is stopped first: the engine's transfers, Python's garbage collector, other threads); a capture
that fails anyway is retried once (``stats["capture_retries"]``, the error in ``retried_error``), and one
that fails again is reported (``capture_error``, a warning) and the rule runs eagerly from then on: a
fallback, which a benchmark comparing configurations must not hide (``bench_workload`` refuses the
comparison). On CPU (or ``use_graphs=False``)
the same padded static-buffer path runs eagerly, which is what the CPU tests compare with plain calls.

The engine switches it on around its prefill forwards only (``EngineConfig.prefill_graphs``), through
the chunk-rule wrapper ``split_forward`` installs on the model's modeling module.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch

from tiered_cache import device as dev
from tiered_cache.errors import InvalidArgumentError

_TENSOR_ARGS = ("g", "beta", "initial_state")  # copied into static buffers; every other keyword is a constant
_ACTIVE: contextvars.ContextVar[Optional[GraphChunkRule]] = contextvars.ContextVar("tiered_cache_graph_prefill",
                                                                                   default=None)


def capture_with_retry(owner: Any, capture: Callable[[], None], clear: Callable[[], None], what: str) -> bool:
    """Run ``capture`` for a graph owner (``GraphChunkRule``, ``GraphDecoder``): a failed capture (a
    ``RuntimeError``) is retried once (``owner.stats["capture_retries"]``, ``owner.retried_error``); a second
    failure sets ``owner.capture_error``, turns ``owner.use_graphs`` off, calls ``clear`` and warns (``what``
    names the capture and the fallback). False then: the caller runs eagerly, a fallback a benchmark must not
    hide."""
    for attempt in range(2):
        try:
            capture()
            return True
        except RuntimeError as exc:
            err = f"{type(exc).__name__}: {exc}"[:500]
            dev.synchronize(owner.device)
            if attempt == 0:
                owner.stats["capture_retries"] += 1
                owner.retried_error = err
                continue
            owner.capture_error = err
            owner.use_graphs = False
            clear()
            warnings.warn(f"CUDA graph capture {what}: {err}", stacklevel=4)
    return False


@contextlib.contextmanager
def capture_window(device: torch.device, quiesce: Optional[Callable[[], Any]]) -> Iterator[None]:
    """Around a CUDA-graph capture (graph_prefill's and graph_decode's): what else could make a CUDA call
    while it runs is stopped first, since one such call invalidates the capture
    (``cudaErrorStreamCaptureInvalidated``: seen on the H200 in a configuration with a host tier).

    - ``quiesce`` (the engine sets it: its cache's transfers waited for) runs first, so no transfer is in
      flight and none of their completions (event queries, pinned index and checksum buffers freed) is
      left to happen inside the window;
    - Python's garbage collector is off inside: a collection there runs the finalizers of whatever cyclic
      garbage it finds, and those make calls a capture forbids (a freed pinned buffer has the host
      allocator query its events; a dropped host mirror unregisters its pinned memory);
    - the capture itself is ``thread_local`` (``dev.graph_capture``): another thread's calls do not count.
    """
    if quiesce is not None:
        quiesce()
    dev.synchronize(device)
    enabled = gc.isenabled()
    gc.collect()  # now, outside the window, rather than inside it
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def transfers_waited(transfer: Any) -> Optional[Callable[[], None]]:
    """A ``quiesce`` for ``capture_window``: wait until every ticket ``transfer`` (a ``TransferEngine``, or
    None: nothing to wait for) has in flight is done. The finished tickets stay queued for the tree's
    next ``poll``: nothing is consumed here."""
    if transfer is None:
        return None

    def wait() -> None:
        for t in transfer.pending_tickets():
            transfer.wait(t)

    return wait


class _Key(NamedTuple):
    """What a captured shape is keyed on: the rule, the padded length, the inputs' head shapes and
    dtypes, the initial state's shape and dtype (None: no initial state), the constant keywords."""

    orig: Callable
    padded: int
    heads: tuple
    init: Optional[tuple]
    consts: tuple


@dataclass
class _Inputs:
    """Input buffers ``max_tokens`` long (rounded up to the granule), shared by every captured shape of
    the same head shapes and dtypes: each shape reads a leading view of them. Calls run one at a time on
    one stream and copy their inputs in right before their replay, so sharing is safe."""

    bufs: tuple[torch.Tensor, ...]  # query, key, value, g, beta: [1, max_len, ...]
    dirty: int = 0  # every position from here on is zero


@dataclass
class _Entry:
    """One captured shape: leading views of the shared inputs, the call over them, its graph and outputs."""

    inputs: _Inputs
    views: tuple[torch.Tensor, ...]  # [1, padded, ...] each
    init: Optional[torch.Tensor]  # shared by the shapes with this initial-state shape
    run: Callable[[], Any]
    graph: Any = None
    out: Any = None


class GraphChunkRule:
    """``rule(orig, query, key, value, **kw)``: ``orig(query, key, value, **kw)`` (a gated-delta chunk rule
    with fla's signature), through a CUDA graph of its padded shape where the call allows it."""

    def __init__(self, device: dev.DeviceLike = None, *, max_tokens: int = 4096, max_graphs: int = 32,
                 granule: int = 64, use_graphs: Optional[bool] = None) -> None:
        for name, val in (("max_tokens", max_tokens), ("max_graphs", max_graphs), ("granule", granule)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise InvalidArgumentError(name, "an int >= 1", val)
        self.device = dev.resolve(device)
        if use_graphs is not None and not isinstance(use_graphs, bool):
            raise InvalidArgumentError("use_graphs", "a bool or None (None: on a GPU)", use_graphs)
        if use_graphs and self.device.type != "cuda":
            raise InvalidArgumentError("use_graphs", "False on a device without CUDA", use_graphs)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.max_tokens, self.max_graphs, self.granule = max_tokens, max_graphs, granule
        self.entries: dict[_Key, _Entry] = {}
        self._inputs: dict[tuple, _Inputs] = {}
        self._inits: dict[tuple, torch.Tensor] = {}
        self.stats = {"calls": 0, "replays": 0, "captures": 0, "eager": 0, "padded_tokens": 0, "capture_retries": 0}
        self.capture_error: Optional[str] = None  # set when a capture failed twice: the rule then runs eagerly
        self.retried_error: Optional[str] = None  # the last capture error that a retry got past
        self.quiesce: Optional[Callable[[], Any]] = None  # run before every capture (capture_window)
        self._pool: Any = None  # the graphs' shared memory pool (dev.graph_pool), made at the first capture

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Route the chunk-rule calls made inside through this rule (see ``routed``)."""
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    # ------------------------------------------------------------------------------- calls
    def _key(self, orig, q, k, v, args, kw) -> Optional[_Key]:
        """The shape key of a call this rule replays, or None for a call it leaves alone."""
        if args or kw.get("cu_seqlens") is not None or torch.is_grad_enabled():
            return None
        consts = tuple(sorted((n, x) for n, x in kw.items() if n not in _TENSOR_ARGS))
        if any(isinstance(x, torch.Tensor) for _, x in consts):
            return None
        try:
            hash(consts)
        except TypeError:
            return None
        g, beta, init = kw.get("g"), kw.get("beta"), kw.get("initial_state")
        if not all(isinstance(x, torch.Tensor) for x in (q, k, v, g, beta)):
            return None
        t = q.shape[1] if q.dim() == 4 else 0
        if (q.dim() != 4 or q.shape[0] != 1 or not 0 < t <= self.max_tokens or q.device != self.device
                or k.shape[:2] != q.shape[:2] or v.dim() != 4 or v.shape[:2] != q.shape[:2]
                or g.shape != v.shape[:3] or beta.shape != v.shape[:3]):
            return None
        if init is not None and (not isinstance(init, torch.Tensor) or init.shape[0] != 1):
            return None
        heads = (tuple(q.shape[2:]), tuple(k.shape[2:]), tuple(v.shape[2:]), q.dtype, k.dtype, v.dtype, g.dtype,
                 beta.dtype)
        return _Key(orig, -(-t // self.granule) * self.granule, heads,
                    None if init is None else (tuple(init.shape), init.dtype), consts)

    def __call__(self, orig, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kw):
        self.stats["calls"] += 1
        k_ = self._key(orig, query, key, value, args, kw)
        if k_ is None or (k_ not in self.entries and len(self.entries) >= self.max_graphs):
            self.stats["eager"] += 1
            return orig(query, key, value, *args, **kw)
        e = self.entries.get(k_)
        if e is None:
            e = self._build(orig, k_, query, key, value, kw)
            if e is None:
                self.stats["eager"] += 1
                return orig(query, key, value, *args, **kw)
        t, padded, ins = query.shape[1], e.views[0].shape[1], e.inputs
        hi = min(ins.dirty, padded)
        if hi > t:  # what a longer call left in this shape's padding
            torch._foreach_zero_([b[:, t:hi] for b in ins.bufs])
        torch._foreach_copy_([b[:, :t] for b in ins.bufs], [query, key, value, kw["g"], kw["beta"]])
        ins.dirty = ins.dirty if ins.dirty > padded else t
        if e.init is not None:
            e.init.copy_(kw["initial_state"])
        if e.graph is not None:
            e.graph.replay()
            out = e.out
            self.stats["replays"] += 1
        else:
            out = e.run()
        self.stats["padded_tokens"] += padded - t
        o, state = out
        return o[:, :t].clone(), (None if state is None else state.clone())

    # ----------------------------------------------------------------------------- capture
    def _build(self, orig, key: _Key, q, k, v, kw) -> Optional[_Entry]:
        padded, heads, init_sig = key.padded, key.heads, key.init
        ins = self._inputs.get(heads)
        if ins is None:
            longest = -(-self.max_tokens // self.granule) * self.granule
            ins = self._inputs[heads] = _Inputs(tuple(x.new_zeros((1, longest, *x.shape[2:]))
                                                      for x in (q, k, v, kw["g"], kw["beta"])))
        init = None
        if init_sig is not None:
            init = self._inits.get(init_sig)
            if init is None:
                init = self._inits[init_sig] = torch.zeros_like(kw["initial_state"])
        e = _Entry(inputs=ins, views=tuple(b[:, :padded] for b in ins.bufs), init=init, run=lambda: None)
        fixed = dict(key.consts)  # scale, output_final_state, use_qk_l2norm_in_kernel, flags passed along

        def run():
            q_, k_, v_, g_, beta_ = e.views
            return orig(q_, k_, v_, g=g_, beta=beta_, initial_state=e.init, **fixed)

        e.run = run
        if self.use_graphs and not capture_with_retry(self, lambda: self._capture(e), self.entries.clear,
                                                      "of the chunk rule failed twice, running it eagerly"):
            return None
        self.entries[key] = e
        return e

    def _capture(self, e: _Entry) -> None:
        """Warm up on a side stream (autotuning, workspaces), then capture into the shared pool, inside
        ``capture_window``."""
        if self._pool is None:
            self._pool = dev.graph_pool()
        side = dev.new_stream(self.device)
        side.wait_stream(dev.current_stream(self.device))
        with dev.use_stream(side):
            for _ in range(2):
                e.run()
        dev.current_stream(self.device).wait_stream(side)
        graph = dev.cuda_graph()
        with capture_window(self.device, self.quiesce), dev.graph_capture(graph, pool=self._pool):
            out = e.run()
        e.graph, e.out = graph, out
        self.stats["captures"] += 1


def routed(orig, query, key, value, *args, **kw):
    """``orig``'s call, through the ``GraphChunkRule`` made active around it (``GraphChunkRule.active``),
    if any."""
    rule = _ACTIVE.get()
    if rule is None:
        return orig(query, key, value, *args, **kw)
    return rule(orig, query, key, value, *args, **kw)


__all__ = ["GraphChunkRule", "capture_window", "capture_with_retry", "routed", "transfers_waited"]
