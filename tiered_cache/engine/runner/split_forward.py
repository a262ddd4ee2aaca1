"""One forward that also yields the recurrent state at a position inside it.

The engine caches a request's prefix at page-aligned positions only, and a recurrent state is valid at
one position only. So when a prompt ends off a page boundary, the state at its last aligned position
is the one the next turn resumes from, and the plain way to get it runs the prompt's tail as a second
forward: on a GPU every forward of this model costs about the same time to launch, however few tokens
it runs. ``forward_chunk_split`` runs the whole chunk as one forward and splits only the gated-delta
recurrence at the position, taking the state there, with the conv window (the last ``K`` inputs of the
short convolution) before it. The recurrence runs exactly as two forwards would run it: the first part
from the chunk's initial state to the split, the second from there; attention and the MLPs see the
same tokens at once.

It works by wrapping two functions of the model's modeling module, which its gated-delta layers call
by their module-level names (transformers 5.17 and 5.24 both do): ``torch_chunk_gated_delta_rule``
(flash-linear-attention's kernel where installed) and ``causal_conv1d_fn``. The wrappers act only
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
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from tiered_cache.engine.models import STATE_KINDS, layer_kinds
from tiered_cache.engine.runner.forward import forward_chunk
from tiered_cache.engine.runner.graph_prefill import routed
from tiered_cache.errors import InvalidArgumentError

_NAMES = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")
_ACTIVE: contextvars.ContextVar[Optional[SplitStates]] = contextvars.ContextVar("tiered_cache_split", default=None)


@dataclass
class SplitStates:
    """What one split forward captured, per linear layer in layer order."""

    tokens: int  # tokens in the forward
    offset: int  # the split, counted from the forward's first token
    kernel: int  # conv kernel width: columns of a conv window
    conv: list = field(default_factory=list)  # [1, conv_dim, kernel] each: the window before the split
    recurrent: list = field(default_factory=list)  # [1, H, dk, dv] each: the state after the split


def _linear_layer(model):
    for m in model.modules():
        if type(m).__name__.endswith("GatedDeltaNet"):
            return m
    return None


def _module_of(model):
    layer = _linear_layer(model)
    return None if layer is None else sys.modules.get(type(layer).__module__)


def split_supported(model) -> bool:
    """The model's gated-delta layers call the two functions by their module-level names."""
    layer, mod = _linear_layer(model), _module_of(model)
    if layer is None or mod is None or not all(hasattr(mod, n) for n in _NAMES):
        return False
    return _calls_by_name(type(layer).forward)


@functools.cache
def _calls_by_name(forward) -> bool:
    """Whether ``forward``'s source calls both functions by name (read once per function: reading the
    source tokenizes its whole module, milliseconds that every split forward paid before)."""
    try:
        src = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return all(f"{n}(" in src for n in _NAMES)


def _wrap_chunk_rule(orig):
    def chunk_rule(query, key, value, *args, **kw):
        sp = _ACTIVE.get()
        if sp is None or args or kw.get("cu_seqlens") is not None or query.shape[1] != sp.tokens:
            return routed(orig, query, key, value, *args, **kw)
        r, g, beta = sp.offset, kw["g"], kw["beta"]
        out1, state = routed(orig, query[:, :r], key[:, :r], value[:, :r],
                             **dict(kw, g=g[:, :r], beta=beta[:, :r], output_final_state=True))
        sp.recurrent.append(state)
        out2, last = routed(orig, query[:, r:], key[:, r:], value[:, r:],
                            **dict(kw, g=g[:, r:], beta=beta[:, r:], initial_state=state))
        return torch.cat([out1, out2], dim=1), last

    chunk_rule.__tiered_cache_split__ = orig
    return chunk_rule


def _wrap_conv(orig):
    def conv_fn(hidden_states, *args, **kw):
        sp = _ACTIVE.get()
        if sp is not None and hidden_states.dim() == 3 and hidden_states.shape[-1] >= sp.tokens:
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
def forward_chunk_split(model, cache, input_ids: torch.Tensor, start_pos: int, split_pos: int):
    """``forward_chunk`` over ``[start_pos, start_pos + T)``, also returning the state after ``split_pos``
    tokens (``start_pos < split_pos < start_pos + T``) as a ``SplitStates``: one conv window and one
    recurrent state per linear layer, in layer order. Returns ``(logits [T, vocab], cache, states)``.

    ``states`` is None, with a warning, if the forward did not call the wrapped functions once per
    linear layer as ``split_supported`` expected. The forward itself is sound (the wrappers only split
    the recurrence, as two forwards would): the caller keeps its logits and cache and caches no state
    at the split."""
    if not split_supported(model):
        raise InvalidArgumentError("model", "gated-delta layers that call the module's chunk rule and conv "
                                   "by name (split_supported)", type(model).__name__)
    t = int(input_ids.numel())
    if not isinstance(split_pos, int) or not start_pos < split_pos < start_pos + t:
        raise InvalidArgumentError("split_pos", f"an int in ({start_pos}, {start_pos + t})", split_pos)
    install(model)
    n_linear = sum(k in STATE_KINDS for k in layer_kinds(model.config))
    sp = SplitStates(tokens=t, offset=split_pos - start_pos, kernel=_linear_layer(model).conv_kernel_size)
    token = _ACTIVE.set(sp)
    try:
        logits, cache = forward_chunk(model, cache, input_ids, start_pos)
    finally:
        _ACTIVE.reset(token)
    if len(sp.conv) != n_linear or len(sp.recurrent) != n_linear:
        warnings.warn(f"split forward captured {len(sp.conv)} conv windows and {len(sp.recurrent)} states for "
                      f"{n_linear} linear layers; no state is taken at position {split_pos}", stacklevel=2)
        return logits, cache, None
    return logits, cache, sp


__all__ = ["SplitStates", "forward_chunk_split", "install", "split_supported"]
