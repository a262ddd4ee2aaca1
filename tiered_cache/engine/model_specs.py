"""The pools' specs for a model: which pool layer is which model layer, and what a slot holds.

``spec_for`` derives the ``KVSpec``/``StateSpec`` from one probe token through the model's own
``DynamicCache``: the shapes and dtypes the pools hold are by construction the ones the cache layers
hold, on whichever transformers version is installed (5.17 stores the conv window as
``[conv_dim, kernel]``, as 5.24 does; a future change shows up here, not as silent garbage).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from tiered_cache.engine.models import CONV, KV_KINDS, SLIDING, STATE_KINDS, layer_kinds
from tiered_cache.engine.runner.forward import forward_chunk, new_cache
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.specs import KVSpec, StateSpec

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpecs:
    """What the pools hold for one model, and which model layer is which pool layer.

    ``full``: KV of the full-attention layers (``full_layers[i]`` is pool layer ``i``).
    ``state``: recurrent state + conv window of the linear layers (``linear_layers``; Lfm2's conv layers:
    the window alone, a ``StateSpec`` with ``temporal_shape=()``), or None.
    ``swa``: KV of the sliding-window layers (``swa_layers``), ``window`` = tokens a resume needs
    (the layer's ``sliding_window - 1``: a query at ``p`` sees keys ``(p - sliding_window, p]``), or None.
    ``full_window``: 0 where the full side's layers attend to every token; for a model with sliding
    windows on every layer (Mistral's ``sliding_window``), the tokens a resume gives its first layer,
    which the full side holds for every token (the tree keys each prefix on full-KV pages; that layer's
    SWA memory saving is not used, and ``spec_for`` logs it), the other layers being the SWA side.
    """

    full: KVSpec
    state: Optional[StateSpec]
    swa: Optional[KVSpec]
    full_layers: tuple[int, ...]
    linear_layers: tuple[int, ...]
    swa_layers: tuple[int, ...]
    page_size: int
    full_window: int = 0


@torch.no_grad()
def spec_for(model, page_size: int = 16) -> ModelSpecs:
    """Specs of the pools for ``model``, read from one probe token through its own cache.

    A hybrid layer (attention and Mamba2 in one) is both a full-attention and a linear layer: its KV
    goes to the full side, its state to the state side. Layers that cache nothing are in no list.
    The state's ``value_axis`` comes from the layer's mixer (``_value_axis``). Conv-only layers (Lfm2)
    give a ``StateSpec`` without a temporal state (its conv window is all their cache holds). A model
    with sliding windows on every layer and no other cache (Mistral's ``sliding_window``) keeps its first
    layer on the full side, every token of it, as the prefix's key (``ModelSpecs.full_window``; a warning
    says so), and the others on the SWA side; with one layer only it is refused.
    """
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise InvalidArgumentError("page_size", "an int >= 1", page_size)
    kinds = layer_kinds(model.config)
    idx = {k: tuple(i for i, t in enumerate(kinds) if t in ks)
           for k, ks in (("linear", STATE_KINDS), ("full", KV_KINDS), ("sliding", (SLIDING,)))}
    keyed = not idx["full"] and not idx["linear"] and len(idx["sliding"]) >= 2
    if keyed:  # every layer sliding: the first is kept as full KV, to key the tree on (ModelSpecs.full_window)
        idx["full"], idx["sliding"] = idx["sliding"][:1], idx["sliding"][1:]
    if not idx["full"]:
        raise InvalidArgumentError("model", "at least one full-attention layer, or two sliding layers and no "
                                   "other cache (the tree keys every cached prefix on full KV)", kinds)
    cache = new_cache(model)
    probe = torch.ones(1, 1, dtype=torch.long, device=model.device)
    forward_chunk(model, cache, probe, 0)

    def kv_spec(layers: tuple[int, ...], window: int) -> KVSpec:
        shapes = {(tuple(cache.layers[i].keys.shape), tuple(cache.layers[i].values.shape),
                   cache.layers[i].keys.dtype) for i in layers}
        if len(shapes) != 1:
            raise InvalidArgumentError("model", "the same K/V shape and dtype in every layer of a kind", shapes)
        (k_shape, v_shape, dtype), = shapes
        return KVSpec(num_layers=len(layers), kv_heads=k_shape[1], head_dim=k_shape[3], dtype=dtype,
                      v_head_dim=v_shape[3], window=window)

    swa, window = None, 0
    if idx["sliding"]:
        windows = {int(cache.layers[i].sliding_window) for i in idx["sliding"] + (idx["full"] if keyed else ())}
        if len(windows) != 1:
            raise InvalidArgumentError("model", "one sliding window for all sliding layers", windows)
        window = windows.pop() - 1
        swa = kv_spec(idx["sliding"], window)
    state = _state_spec(model, cache, kinds, idx["linear"]) if idx["linear"] else None
    full_window = window if keyed else 0
    if keyed:
        _log.warning("%s: sliding windows on every layer; layer %d's KV is kept for every token (the tree's key, "
                     "its SWA memory saving unused; a resume gives it the last %d), layers %s are the SWA side",
                     type(model).__name__, idx["full"][0], full_window, list(idx["sliding"]))
    return ModelSpecs(full=kv_spec(idx["full"], 0), state=state, swa=swa, full_layers=idx["full"],
                      linear_layers=idx["linear"], swa_layers=idx["sliding"], page_size=page_size,
                      full_window=full_window)


def _state_spec(model, cache, kinds: tuple[str, ...], linear: tuple[int, ...]) -> StateSpec:
    """The state of the ``linear`` layers of ``cache`` (after the probe token), one spec for all of them."""
    layers = [cache.layers[i] for i in linear]
    if any(lay.number_of_states != 1 for lay in layers):
        raise InvalidArgumentError("model", "one conv/recurrent state per linear layer",
                                   [lay.number_of_states for lay in layers])
    rec = {None if lay.recurrent_states[0] is None else
           (tuple(lay.recurrent_states[0].shape), lay.recurrent_states[0].dtype) for lay in layers}
    conv = {(tuple(lay.conv_states[0].shape), lay.conv_states[0].dtype) for lay in layers}
    if len(rec) != 1 or len(conv) != 1:
        raise InvalidArgumentError("model", "the same state shapes in every linear layer", (rec, conv))
    (c_shape, c_dtype), = conv
    r = rec.pop()
    conv_only = {kinds[i] for i in linear} == {CONV}
    if (r is None) != conv_only:
        raise InvalidArgumentError("model", "a recurrent state in every linear layer, none in a conv layer",
                                   (r, sorted({kinds[i] for i in linear})))
    if r is None:
        # Lfm2's short conv: the window of its last tokens is all the layer keeps. The window's dtype stands
        # for the absent temporal state's, so the spec (and T3's fingerprint) names no dtype the cache lacks.
        return StateSpec(num_layers=len(layers), temporal_shape=(), temporal_dtype=c_dtype,
                         conv_shapes=(c_shape[1:],), conv_dtype=c_dtype)
    r_shape, r_dtype = r
    if len(r_shape) != 4:
        # Jamba's Mamba1 keeps [B, d_inner, d_state]; and transformers' Mamba1 prefill runs its
        # full-sequence scan (mamba_selective_scan) with no initial state, so every forward of several
        # tokens starts from zero and no cache can resume it: a prompt run in two chunks differs from
        # one run whole (tests/families). Resuming would mean a prefill one token at a time.
        raise InvalidArgumentError("model", "a recurrent state [H, a, b] per linear layer (Mamba2, a delta "
                                   "rule); Mamba1 (Jamba) keeps [d_inner, d_state] and its prefill in this "
                                   "transformers does not resume from a cached state", r_shape[1:])
    return StateSpec(num_layers=len(layers), temporal_shape=r_shape[1:], temporal_dtype=r_dtype,
                     conv_shapes=(c_shape[1:],), conv_dtype=c_dtype,
                     value_axis=_value_axis(model, linear, r_shape[1:]))


def _value_axis(model, layers: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Which axis of the state ``[H, a, b]`` the values run along (the int8 scale reduces over it), read
    from the mixer of each linear layer: a Mamba2 mixer (it has ``ssm_state_size``) keeps
    ``[H, head_dim, d_state]``, its head_dim playing d_v -> 1; a delta rule (gated delta-net, Kimi's KDA)
    keeps ``[H, d_k, d_v]`` -> 2 (its k is summed over axis -2 of the state)."""
    axes: dict[int, set[int]] = {}
    for m in model.modules():
        i = getattr(m, "layer_idx", None)
        if i not in layers:
            continue
        if hasattr(m, "ssm_state_size") and shape[2] == m.ssm_state_size:
            axes.setdefault(i, set()).add(1)
        elif "Delta" in type(m).__name__:
            axes.setdefault(i, set()).add(2)
    found = set().union(*axes.values()) if axes else set()
    if set(axes) != set(layers) or len(found) != 1:
        raise InvalidArgumentError("model", "a Mamba2 mixer or a delta rule in every linear layer (to know the "
                                   "state's value axis)", {i: sorted(axes.get(i, ())) for i in layers})
    return found.pop()
