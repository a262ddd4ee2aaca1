"""One forward that also yields the recurrent states at positions inside it.

The engine caches a request's prefix at page-aligned positions only, and a recurrent state is valid at
one position only. So when a prompt ends off a page boundary, the state at its last aligned position
is the one the next turn resumes from, and the plain way to get it runs the prompt's tail as a second
forward: on a GPU every forward of this model costs about the same time to launch, however few tokens
it runs. ``forward_chunk_split`` runs the whole chunk as one forward and splits only the gated-delta
recurrence at the positions, taking the state at each, with the conv window (the last ``K`` inputs of
the short convolution) before it. The recurrence runs exactly as one forward per part would run it:
the first part from the chunk's initial state to the first split, each next one from there; attention
and the MLPs see the same tokens at once. Several positions matter for the tree's ``block`` admission,
which keeps a state at every block boundary: before, a chunk ran as one forward per block, and on a GPU
a forward of this model costs about its launch time however few tokens it runs.

It works by wrapping two functions of the model's modeling module, which its gated-delta layers call
by their module-level names: ``torch_chunk_gated_delta_rule`` (flash-linear-attention's kernel where
installed) and ``causal_conv1d_fn``. transformers 5.17 and 5.24 call both from the layer's ``forward``;
5.25 calls the conv through the module's ``causal_conv1d_forward`` (which reads and writes the cache and
calls ``causal_conv1d_fn`` by name), and, where the ``kernels`` package is installed, makes each such
function an ``nn.Module`` instance, still called by its module-level name. The wrappers act only
inside ``forward_chunk_split``; elsewhere they pass every call through untouched (the chunk rule's to a
``graph_prefill.GraphChunkRule`` where the engine made one active). ``split_supported``
says whether a model's layers call them so; where they do not, the engine runs two forwards.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from tiered_cache.engine.models import STATE_KINDS, layer_kinds
from tiered_cache.engine.runner.forward import forward_chunk
from tiered_cache.engine.runner.graph_prefill import routed
from tiered_cache.errors import InvalidArgumentError

_NAMES = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")


@dataclass
class SplitStates:
    """What one split forward captured, per linear layer in layer order."""

    tokens: int  # tokens in the forward
    offset: int  # this split, counted from the forward's first token
    kernel: int  # conv kernel width: columns of a conv window
    conv: list = field(default_factory=list)  # [1, conv_dim, kernel] each: the window before the split
    recurrent: list = field(default_factory=list)  # [1, H, dk, dv] each: the state after the split


# the splits of the forward running now, by offset (one SplitStates each); None outside a split forward
_ACTIVE: contextvars.ContextVar[Optional[tuple[SplitStates, ...]]] = contextvars.ContextVar("tiered_cache_split",
                                                                                           default=None)


def _linear_layer(model):
    for m in model.modules():
        if type(m).__name__.endswith("GatedDeltaNet"):
            return m
    return None


def _module_of(model):
    layer = _linear_layer(model)
    return None if layer is None else sys.modules.get(type(layer).__module__)


def split_supported(model) -> bool:
    """The model's gated-delta layers call the two functions by their module-level names (the conv
    either from the layer itself or from the module's ``causal_conv1d_forward``, 5.25)."""
    layer, mod = _linear_layer(model), _module_of(model)
    if layer is None or mod is None or not all(hasattr(mod, n) for n in _NAMES):
        return False
    conv_forward = getattr(mod, "causal_conv1d_forward", None)
    return _calls_by_name(type(layer).forward, None if conv_forward is None else _bare(conv_forward))


@functools.cache
def _calls_by_name(forward, conv_forward) -> bool:
    """Whether ``forward``'s source calls the chunk rule and the conv by name, the conv perhaps through
    ``conv_forward`` (read once per function: reading the source tokenizes its whole module, milliseconds
    that every split forward paid before)."""
    src, rule, conv = _source(forward), f"{_NAMES[0]}(", f"{_NAMES[1]}("
    if src is None or rule not in src:
        return False
    if conv in src:  # 5.17, 5.24
        return True
    inner = _source(conv_forward)
    return "causal_conv1d_forward(" in src and inner is not None and conv in inner


def _source(fn) -> Optional[str]:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def hub_function(fn):
    """The function a modeling module's name stands for. transformers 5.25 with the ``kernels`` package
    installed makes each kernel-routed function an ``nn.Module`` instance, whose class's ``forward`` calls
    the function (its free variable ``func``): that function; ``fn`` itself otherwise (5.17, 5.24, or
    without ``kernels``), or None for a module that calls none."""
    forward = getattr(type(fn), "forward", None)
    if not isinstance(fn, torch.nn.Module) or forward is None:
        return fn
    code = getattr(forward, "__code__", None)
    if code is None or "func" not in code.co_freevars:
        return None
    return forward.__closure__[code.co_freevars.index("func")].cell_contents


def _bare(fn):
    """A modeling module's function without what wraps it: ours, the ``kernels`` module (``hub_function``)
    and transformers' kernel routing (``__wrapped__``)."""
    fn = hub_function(getattr(fn, "__tiered_cache_split__", fn))
    return inspect.unwrap(fn) if callable(fn) else None


def _wrap_chunk_rule(orig):
    def chunk_rule(query, key, value, *args, **kw):
        sps = _ACTIVE.get()
        if sps is None or args or kw.get("cu_seqlens") is not None or query.shape[1] != sps[0].tokens:
            return routed(orig, query, key, value, *args, **kw)
        g, beta = kw["g"], kw["beta"]
        outs, state, a = [], None, 0
        for sp in sps:  # each part from the last one's state (the first from the chunk's own)
            r, at = sp.offset, {} if a == 0 else {"initial_state": state}
            out, state = routed(orig, query[:, a:r], key[:, a:r], value[:, a:r],
                                **dict(kw, g=g[:, a:r], beta=beta[:, a:r], output_final_state=True, **at))
            sp.recurrent.append(state)
            outs.append(out)
            a = r
        out, last = routed(orig, query[:, a:], key[:, a:], value[:, a:],
                           **dict(kw, g=g[:, a:], beta=beta[:, a:], initial_state=state))
        return torch.cat([*outs, out], dim=1), last

    chunk_rule.__tiered_cache_split__ = orig
    return chunk_rule


def _wrap_conv(orig):
    def conv_fn(hidden_states, *args, **kw):
        sps = _ACTIVE.get()
        if sps is not None and hidden_states.dim() == 3 and hidden_states.shape[-1] >= sps[0].tokens:
            for sp in sps:
                # the inputs end with the forward's tokens (the layer prepends its cached window, if any)
                end = hidden_states.shape[-1] - sp.tokens + sp.offset
                win = hidden_states[..., max(0, end - sp.kernel):end]
                if win.shape[-1] < sp.kernel:  # a fresh sequence: zeros before its first token
                    win = F.pad(win, (sp.kernel - win.shape[-1], 0))
                sp.conv.append(win.clone())
        return orig(hidden_states, *args, **kw)

    conv_fn.__tiered_cache_split__ = orig
    return conv_fn


def install(model) -> None:
    """Wrap the two functions of ``model``'s modeling module (once; idempotent). Outside
    ``forward_chunk_split`` the wrappers pass each call through, to the ``graph_prefill.GraphChunkRule``
    made active around it if any."""
    mod = _module_of(model)
    for name, wrap in zip(_NAMES, (_wrap_chunk_rule, _wrap_conv)):
        fn = getattr(mod, name)
        if not hasattr(fn, "__tiered_cache_split__"):
            setattr(mod, name, wrap(fn))


@torch.no_grad()
def forward_chunk_split(model, cache, input_ids: torch.Tensor, start_pos: int, split_pos: Sequence[int]):
    """``forward_chunk`` over ``[start_pos, start_pos + T)``, also returning the state after each of
    ``split_pos``'s positions (increasing, each with ``start_pos < p < start_pos + T``), one
    ``SplitStates`` per position in their order: one conv window and one recurrent state per linear
    layer, in layer order. Returns ``(logits [T, vocab], cache, states)``.

    ``states`` is None, with a warning, if the forward did not call the wrapped functions once per
    linear layer as ``split_supported`` expected. The forward itself is sound (the wrappers only split
    the recurrence, as one forward per part would): the caller keeps its logits and cache and caches no
    state at the splits."""
    if not split_supported(model):
        raise InvalidArgumentError("model", "gated-delta layers that call the module's chunk rule and conv "
                                   "by name (split_supported)", type(model).__name__)
    t = int(input_ids.numel())
    want = f"a non-empty increasing sequence of ints in ({start_pos}, {start_pos + t})"
    pos = tuple(split_pos) if isinstance(split_pos, (tuple, list)) else None
    if not pos or not all(isinstance(p, int) and not isinstance(p, bool) for p in pos) \
            or not start_pos < pos[0] or not pos[-1] < start_pos + t or any(a >= b for a, b in zip(pos, pos[1:])):
        raise InvalidArgumentError("split_pos", want, split_pos)
    install(model)
    n_linear = sum(k in STATE_KINDS for k in layer_kinds(model.config))
    kernel = _linear_layer(model).conv_kernel_size
    sps = tuple(SplitStates(tokens=t, offset=p - start_pos, kernel=kernel) for p in pos)
    token = _ACTIVE.set(sps)
    try:
        logits, cache = forward_chunk(model, cache, input_ids, start_pos)
    finally:
        _ACTIVE.reset(token)
    if any(len(sp.conv) != n_linear or len(sp.recurrent) != n_linear for sp in sps):
        warnings.warn(f"split forward captured {len(sps[0].conv)} conv windows and {len(sps[0].recurrent)} states "
                      f"for {n_linear} linear layers; no state is taken at positions {list(pos)}", stacklevel=2)
        return logits, cache, None
    return logits, cache, list(sps)


__all__ = ["SplitStates", "forward_chunk_split", "hub_function", "install", "split_supported"]
