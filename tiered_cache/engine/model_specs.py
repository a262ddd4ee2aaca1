"""The pools' specs for a model: which pool layer is which model layer, and what a slot holds.

``spec_for`` derives the ``KVSpec``/``StateSpec`` from one probe token through the model's own
``DynamicCache``: the shapes and dtypes the pools hold are by construction the ones the cache layers
hold, on whichever transformers version is installed (5.17 stores the conv window as
``[conv_dim, kernel]``, as 5.24 does; a future change shows up here, not as silent garbage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tiered_cache.engine.models import FULL, LINEAR, SLIDING, layer_kinds
from tiered_cache.engine.runner.forward import forward_chunk, new_cache
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.specs import KVSpec, StateSpec


@dataclass(frozen=True)
class ModelSpecs:
    """What the pools hold for one model, and which model layer is which pool layer.

    ``full``: KV of the full-attention layers (``full_layers[i]`` is pool layer ``i``).
    ``state``: recurrent state + conv window of the linear layers (``linear_layers``), or None.
    ``swa``: KV of the sliding-window layers (``swa_layers``), ``window`` = tokens a resume needs
    (the layer's ``sliding_window - 1``: a query at ``p`` sees keys ``(p - sliding_window, p]``), or None.
    """

    full: KVSpec
    state: Optional[StateSpec]
    swa: Optional[KVSpec]
    full_layers: tuple[int, ...]
    linear_layers: tuple[int, ...]
    swa_layers: tuple[int, ...]
    page_size: int


@torch.no_grad()
def spec_for(model, page_size: int = 16) -> ModelSpecs:
    """Specs of the pools for ``model``, read from one probe token through its own cache.

    State ``value_axis`` is 2: Qwen3-Next keeps ``[B, H_v, d_k, d_v]``; the int8 scale reduces over d_v.
    """
    if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size < 1:
        raise InvalidArgumentError("page_size", "an int >= 1", page_size)
    kinds = layer_kinds(model.config)
    cache = new_cache(model)
    probe = torch.ones(1, 1, dtype=torch.long, device=model.device)
    forward_chunk(model, cache, probe, 0)
    idx = {k: tuple(i for i, t in enumerate(kinds) if t == k) for k in (LINEAR, FULL, SLIDING)}
    if not idx[FULL]:
        raise InvalidArgumentError("model", "at least one full-attention layer", kinds)

    def kv_spec(layers: tuple[int, ...], window: int) -> KVSpec:
        shapes = {(tuple(cache.layers[i].keys.shape), tuple(cache.layers[i].values.shape),
                   cache.layers[i].keys.dtype) for i in layers}
        if len(shapes) != 1:
            raise InvalidArgumentError("model", "the same K/V shape and dtype in every layer of a kind", shapes)
        (k_shape, v_shape, dtype), = shapes
        return KVSpec(num_layers=len(layers), kv_heads=k_shape[1], head_dim=k_shape[3], dtype=dtype,
                      v_head_dim=v_shape[3], window=window)

    swa = None
    if idx[SLIDING]:
        windows = {int(cache.layers[i].sliding_window) for i in idx[SLIDING]}
        if len(windows) != 1:
            raise InvalidArgumentError("model", "one sliding window for all sliding layers", windows)
        swa = kv_spec(idx[SLIDING], windows.pop() - 1)
    state = None
    if idx[LINEAR]:
        layers = [cache.layers[i] for i in idx[LINEAR]]
        if any(lay.number_of_states != 1 for lay in layers):
            raise InvalidArgumentError("model", "one conv/recurrent state per linear layer",
                                       [lay.number_of_states for lay in layers])
        rec = {(tuple(lay.recurrent_states[0].shape), lay.recurrent_states[0].dtype) for lay in layers}
        conv = {(tuple(lay.conv_states[0].shape), lay.conv_states[0].dtype) for lay in layers}
        if len(rec) != 1 or len(conv) != 1:
            raise InvalidArgumentError("model", "the same state shapes in every linear layer", (rec, conv))
        (r_shape, r_dtype), = rec
        (c_shape, c_dtype), = conv
        state = StateSpec(num_layers=len(layers), temporal_shape=r_shape[1:], temporal_dtype=r_dtype,
                          conv_shapes=(c_shape[1:],), conv_dtype=c_dtype, value_axis=2)
    return ModelSpecs(full=kv_spec(idx[FULL], 0), state=state, swa=swa, full_layers=idx[FULL],
                      linear_layers=idx[LINEAR], swa_layers=idx[SLIDING], page_size=page_size)

