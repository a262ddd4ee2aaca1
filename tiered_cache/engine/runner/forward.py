"""Running a ``transformers`` hybrid on one request's cache, or on several requests' at once.

One request per cache: every tensor of a ``DynamicCache`` here has batch size 1 (the engine batches
requests through the pools, not through the model's cache objects). ``forward_chunk`` runs positions
of one request; ``decode_batch`` runs one decode token of several requests in one forward, over a
left-padded batch gathered from their caches, and hands each cache its results back.

Continuing on a restored cache always passes ``position_ids``: some models derive positions from the
cache length otherwise, which a restored cache may not report as the caller means.

transformers versions: tested on 5.25, 5.24 and 5.17 (CPU).
5.24 and 5.17 differ in the cache keyword of ``forward`` (``cache`` in 5.24, where ``past_key_values``
is deprecated; ``past_key_values`` in 5.17: ``cache_kwarg``) and in how Qwen3-Next asks whether a
layer has a state (``Cache.has_previous_state`` in 5.17, the layer's ``has_previous_state`` dict through
``get_conv_state`` in 5.24); filling fresh layers through their own ``update*`` methods, as here, sets
both. Toward 5.25: it gives each linear layer a token counter (``cumulative_length_linear``, grown by
the columns of every conv-state update) that its ``get_seq_length`` reports, and
``Cache.get_seq_length`` asks layer 0, a linear layer in Qwen3-Next: a state restored or gathered here
counts its conv window's columns, not the positions it holds. So the positions are read off the
attention layers (``seen_tokens``) and the counters set to them before every forward
(``sync_linear_lengths``), where the model reads them for its masks. 5.25's short conv also counts each
decode token on the cache (``increase_count``: ``graph_decode``'s static cache answers it) and its
GatedDeltaNet calls the conv through ``causal_conv1d_forward`` (``split_forward`` follows it there).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import Optional

import torch

from tiered_cache.engine.models import KV_KINDS, RECURRENT_KINDS, SLIDING, STATE_KINDS, layer_kinds
from tiered_cache.errors import InvalidArgumentError


def new_cache(model):
    """A fresh ``DynamicCache(config=...)``: one layer object per model layer, of the kind it needs."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_kwarg(model) -> str:
    """``cache`` (5.24+) or ``past_key_values`` (5.17): the name ``forward`` takes the cache under."""
    return _cache_kwarg_of(type(model).forward)


@functools.cache
def _cache_kwarg_of(forward) -> str:  # once per model class, not once per forward
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


@torch.no_grad()
def forward_chunk(model, cache, input_ids: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, object]:
    """Run tokens at positions ``[start_pos, start_pos + T)`` on ``cache`` (batch 1), with explicit positions.

    ``input_ids``: ``[T]`` or ``[1, T]``. Returns ``(logits [T, vocab], cache)``; ``cache`` is updated
    in place. Raises if ``start_pos`` disagrees with the tokens the cache holds, or if the cache has
    attention KV but a linear layer has no state (a continuation would silently restart the recurrence).
    """
    ids = input_ids if input_ids.dim() == 2 else input_ids.reshape(1, -1)
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise InvalidArgumentError("input_ids", "a non-empty [T] or [1, T] tensor (batch 1)", tuple(input_ids.shape))
    if not isinstance(start_pos, int) or isinstance(start_pos, bool) or start_pos < 0:
        raise InvalidArgumentError("start_pos", "an int >= 0", start_pos)
    seen = seen_tokens(cache)
    if seen is not None and seen != start_pos:
        raise InvalidArgumentError("start_pos", f"{seen}, the tokens the cache holds", start_pos)
    if start_pos > 0:
        # by the config's layer kinds: 5.17's cache gives an MLP or MoE layer (NemotronH) a linear layer
        # object too, which no forward ever fills
        for i, kind in enumerate(layer_kinds(model.config)):
            if kind in STATE_KINDS and not all(cache.layers[i].has_previous_state.values()):
                raise InvalidArgumentError("cache", f"a state in linear layer {i} to continue from", "none")
    sync_linear_lengths(cache, start_pos)
    ids = ids.to(model.device)
    pos = torch.arange(start_pos, start_pos + ids.shape[1], device=ids.device).unsqueeze(0)
    out = model(input_ids=ids, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[0], cache


@torch.no_grad()
def decode_batch(model, caches: Sequence, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """One decode token for each of several requests, in one forward: ``caches[b]`` (batch 1) holds
    positions ``[0, positions[b])`` and the token at ``positions[b]`` is ``tokens[b]``.

    Returns the logits ``[B, vocab]``; each cache gains its token's KV and its new recurrent state, as
    ``forward_chunk`` would have left it (up to floating-point summation order). The requests' KV is
    gathered into one left-padded batch cache (padding masked out), so a step costs one forward
    instead of ``B``. Models with sliding-window layers are not batched here.
    """
    kinds = layer_kinds(model.config)
    if SLIDING in kinds:
        raise InvalidArgumentError("model", "a model without sliding-window layers (batched decode)", "sliding layers")
    n = len(caches)
    if n == 0 or len(tokens) != n or len(positions) != n:
        raise InvalidArgumentError("tokens, positions", f"one per cache ({n} caches, at least one)",
                                   (len(tokens), len(positions)))
    for b, (c, p) in enumerate(zip(caches, positions)):
        seen = seen_tokens(c)
        if not isinstance(p, int) or p < 1 or (seen is not None and seen != p):
            raise InvalidArgumentError("positions", f"positions[{b}] = {seen}, the tokens cache {b} holds", p)
    dev = model.device
    width = max(positions)
    k_conv = conv_width(caches[0], kinds)
    batch = new_cache(model)
    for i, kind in enumerate(kinds):
        layers = [c.layers[i] for c in caches]
        if kind in KV_KINDS:
            k0, v0 = layers[0].keys, layers[0].values
            keys = k0.new_zeros((n, k0.shape[1], width, k0.shape[3]))
            values = v0.new_zeros((n, v0.shape[1], width, v0.shape[3]))
            for b, (lay, p) in enumerate(zip(layers, positions)):
                keys[b, :, width - p:] = lay.keys[0]
                values[b, :, width - p:] = lay.values[0]
            batch.layers[i].update(keys, values)
        if kind in STATE_KINDS:  # a hybrid layer is both
            for b, lay in enumerate(layers):
                if not all(lay.has_previous_state.values()):
                    raise InvalidArgumentError("caches", f"a state in linear layer {i} of cache {b}", "none")
            conv = torch.cat([lay.conv_states[0][..., -k_conv:] for lay in layers])
            target = batch.layers[i]
            target.is_conv_states_initialized[0] = False
            target.has_previous_state[0] = False
            target.update_conv_state(conv.clone(), 0, conv_kernel_size=k_conv)
            if kind in RECURRENT_KINDS:  # a conv layer (Lfm2) has its window only
                target.update_recurrent_state(torch.cat([lay.recurrent_states[0] for lay in layers]), 0)
    sync_linear_lengths(batch, width)  # every row left-padded to ``width`` positions
    mask = torch.zeros((n, width + 1), dtype=torch.long, device=dev)
    for b, p in enumerate(positions):
        mask[b, width - p:] = 1
    ids = torch.as_tensor(list(tokens), dtype=torch.long, device=dev).view(n, 1)
    pos = torch.as_tensor(list(positions), dtype=torch.long, device=dev).view(n, 1)
    out = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True, **{cache_kwarg(model): batch})
    full = [i for i, k in enumerate(kinds) if k in KV_KINDS]
    linear = [i for i, k in enumerate(kinds) if k in STATE_KINDS]
    store_decoded(caches, kinds, k_conv, {i: batch.layers[i].keys[:, :, -1:] for i in full},
                  {i: batch.layers[i].values[:, :, -1:] for i in full},
                  {i: batch.layers[i].conv_states[0] for i in linear},
                  {i: batch.layers[i].recurrent_states[0] for i in linear if kinds[i] in RECURRENT_KINDS})
    return out.logits[:, -1]


def store_decoded(caches: Sequence, kinds: Sequence[str], k_conv: int, keys: dict, values: dict, conv: dict,
                  rec: dict) -> None:
    """After a batched decode step: hand cache ``b`` row ``b`` of each layer's results. ``keys[i]`` /
    ``values[i]``: ``[n, kv_heads, 1, D]``, the decoded token's (appended); ``conv[i]`` (its last
    ``k_conv`` columns are the window) and ``rec[i]`` (none for a conv layer): the new conv window and
    state (copied in place, in one foreach copy)."""
    dst, src = [], []
    for i, kind in enumerate(kinds):
        for b, c in enumerate(caches):
            lay = c.layers[i]
            if kind in KV_KINDS:
                lay.update(keys[i][b:b + 1], values[i][b:b + 1])
            if kind not in STATE_KINDS:
                continue
            cv = conv[i][b:b + 1, ..., -k_conv:]
            if lay.conv_states[0].shape == cv.shape:
                dst.append(lay.conv_states[0])
                src.append(cv)
            else:
                lay.conv_states[0] = cv.clone()
            if kind in RECURRENT_KINDS:
                dst.append(lay.recurrent_states[0])
                src.append(rec[i][b:b + 1])
    if dst:
        torch._foreach_copy_(dst, src)
    if not caches or not _counts_tokens(caches[0]):
        return  # 5.24 and 5.17: no counters to keep (every decode step passes here: no per-cache scan)
    for c in caches:  # 5.25+: the linear layers' token counters count the decoded token too
        n = seen_tokens(c)
        if n is not None:
            sync_linear_lengths(c, n)
        else:
            for i, kind in enumerate(kinds):
                cnt = getattr(c.layers[i], "cumulative_length_linear", None)
                if kind in STATE_KINDS and isinstance(cnt, torch.Tensor):
                    cnt.add_(1)


def conv_width(cache, kinds: Sequence[str]) -> int:
    """Columns of the conv window the linear layers of ``cache`` keep (0 without linear layers): read off
    the cache's own layers, not a config field (Qwen3-Next calls it ``linear_conv_kernel_dim``, Mamba2
    hybrids ``mamba_d_conv``, others another name). A layer records its kernel width when its conv state
    is first written (``conv_kernel_size``, 5.24); where it does not (5.17), the window is the state's
    last axis, the whole of it unless the layer records its past."""
    widths: set[Optional[int]] = set()
    for i, kind in enumerate(kinds):
        if kind not in STATE_KINDS:
            continue
        lay = cache.layers[i]
        k = getattr(lay, "conv_kernel_size", {}).get(0)
        if k is None and not getattr(lay, "record_past", False) and isinstance(lay.conv_states[0], torch.Tensor):
            k = lay.conv_states[0].shape[-1]
        widths.add(k)
    if None in widths or len(widths) > 1:
        raise InvalidArgumentError("cache", "one conv kernel width in every linear layer (a state in each)", widths)
    width = widths.pop() if widths else 0
    return int(width or 0)


def seen_tokens(cache) -> Optional[int]:
    """The positions ``cache`` holds; None for a cache of linear layers only (it tracks no length)."""
    layers = getattr(cache, "layers", ())
    if _counts_tokens(cache):
        # 5.25+: a linear layer reports its own counter (module docstring); the attention layers (a hybrid
        # layer is one) hold the positions
        from transformers.cache_utils import DynamicLayer

        for lay in layers:
            if isinstance(lay, DynamicLayer):
                return int(lay.get_seq_length())
        return None
    try:
        return int(cache.get_seq_length())
    except ValueError:  # a cache of linear layers only tracks no length
        return None


def _counts_tokens(cache) -> bool:
    """Whether ``cache``'s linear layers keep token counters (transformers 5.25+)."""
    return any(hasattr(lay, "cumulative_length_linear") for lay in getattr(cache, "layers", ()))


def sync_linear_lengths(cache, n: int) -> None:
    """Set the token counter of each linear layer of ``cache`` (transformers 5.25+) to ``n``, the positions
    the cache holds: restoring or gathering a state writes its conv window, which counts its columns."""
    for lay in getattr(cache, "layers", ()):
        c = getattr(lay, "cumulative_length_linear", None)
        if isinstance(c, torch.Tensor):
            c.fill_(n)


__all__ = ["cache_kwarg", "conv_width", "decode_batch", "forward_chunk", "new_cache", "seen_tokens", "store_decoded",
           "sync_linear_lengths"]
