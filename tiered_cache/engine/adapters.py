"""Move one request's KV and recurrent states between a ``transformers`` cache and the pools.

One request per cache: every tensor of a ``DynamicCache`` here has batch size 1 (the engine batches
requests through the pools, not through the model's cache objects). The adapter translates; it
holds no policy: which tokens, slots and positions to move is the caller's decision.

Per kind of layer (``config.layer_types``), the cache layer and the pool side that holds it::

    linear_attention   LinearAttentionLayer       conv_states[0] [1, conv_dim, K]   -> state side conv_view_all(0)
                                                   recurrent_states[0] [1, H, a, b]  -> state side temporal_view_all()
                                                   ([H, d_k, d_v] for a delta rule, [H, head_dim, d_state] Mamba2)
    conv               LinearAttentionLayer       conv_states[0] only (Lfm2's short conv) -> conv_view_all(0) of a
                                                   state side without a temporal state
    full_attention     DynamicLayer               keys/values [1, kv_heads, T, D]   -> full KV side, every token
    sliding_attention  DynamicSlidingWindowLayer  keys/values, only the last ``sliding_window - 1`` tokens
                                                   after a forward (``cumulative_length`` counts all) -> swa KV side
                                                   (all-sliding Mistral: its first layer -> full KV side, every
                                                   token, and a resume gives it the last ``full_window``)
    hybrid             LinearAttentionAnd-        both: its keys/values to the full KV side, its conv window
                       FullAttentionLayer         and state to the state side (FalconH1, Zamba2)
    mlp, moe           DummyLayer                 nothing (NemotronH's MLP / MoE layers)

Token ids are virtual ids of a KV side, one per position: ``token_ids[p]`` holds position ``p``.
A state slot holds the state after a fixed number of tokens; the caller knows which.

Running the model on those caches is ``runner.forward``'s.

Under tensor parallelism (``tp``: a ``parallel.TPGroup``) the pools hold this rank's share of the heads
(``KVSpec.shard`` / ``StateSpec.shard``): a rank writes its contiguous ``1/tp`` of the heads (and of each
conv window's channels) and reads back the whole by gathering every rank's share, so the model, whose
weights this engine does not shard, sees the same K/V and states as at TP 1 (only when the ranks' trees
agree: a rank that resumed from another position would gather garbage or hang).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch

from tiered_cache.device import host_to_device
from tiered_cache.engine.model_specs import ModelSpecs, spec_for
from tiered_cache.engine.models import layer_kinds
from tiered_cache.engine.runner.forward import new_cache
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.parallel.group import TPGroup
from tiered_cache.specs import KVSpec
from tiered_cache.tiers.protocols import ActiveSide, KVSide, StateSide

IdsLike = Union[torch.Tensor, Sequence[int]]


def _ids(name: str, ids: IdsLike, device: Optional[torch.device] = None) -> torch.Tensor:
    """``ids`` as a 1-D int64 tensor on ``device`` (None: where given; a sequence: on the host)."""
    t = ids if isinstance(ids, torch.Tensor) else torch.as_tensor(list(ids), dtype=torch.int64)
    if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError(name, "a 1-D int tensor or sequence of ints", (t.dtype, tuple(t.shape)))
    return t.to(device=t.device if device is None else device, dtype=torch.int64)


def _slot(slot: Union[int, torch.Tensor]) -> torch.Tensor:
    """One virtual slot id as a 1-element int64 tensor, where it was given (an int: on the host, where
    ``_physical`` checks it without a device round trip)."""
    t = slot if isinstance(slot, torch.Tensor) else torch.as_tensor(slot, dtype=torch.int64)
    if t.numel() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise InvalidArgumentError("slot", "one virtual slot id", slot)
    return t.reshape(-1).to(torch.int64)


def _physical(side: ActiveSide, name: str, ids: torch.Tensor) -> torch.Tensor:
    """``side.translate`` that refuses free or unknown ids: they map to -1, which would index the last row.

    Ids on the host are checked and translated on the side's host table and sent to the device
    through page-locked memory: no wait for the device. Ids on the device cost one host sync (the
    check reads the translated ids back)."""
    if ids.device.type == "cpu":
        try:
            rows = side.translate_host(ids.numpy())
        except InvalidArgumentError:
            rows = None
        if rows is None or (rows.size and int(rows.min()) < 0):
            raise InvalidArgumentError(name, f"live virtual ids of side {side.name!r}", ids.tolist())
        return host_to_device(torch.from_numpy(rows), side.device)
    try:
        phys = side.translate(ids)
    except (IndexError, RuntimeError):
        phys = None
    if phys is None or (phys.numel() and int(phys.min()) < 0):
        raise InvalidArgumentError(name, f"live virtual ids of side {side.name!r}", ids.tolist())
    return phys


def _to_store(x: torch.Tensor, spec: KVSpec) -> torch.Tensor:
    x = x.to(spec.dtype)
    return x.view(spec.store_dtype) if spec.store_dtype != spec.dtype else x  # fp8 travels as bytes


def _from_store(x: torch.Tensor, spec: KVSpec) -> torch.Tensor:
    return x.view(spec.dtype) if spec.store_dtype != spec.dtype else x


class HybridCacheAdapter:
    """Moves one request's cache contents to and from T0 sides (``KVSide`` / ``StateSide``), for one model.

    ``specs``: from ``spec_for(model, page_size)`` (computed if omitted). A side is recognised by its
    spec: ``specs.full`` (full-attention layers), ``specs.swa`` (sliding layers), ``specs.state``.
    """

    def __init__(self, model, specs: Optional[ModelSpecs] = None, page_size: int = 16,
                 tp: Optional[TPGroup] = None) -> None:
        self.model = model
        self.specs = specs if specs is not None else spec_for(model, page_size)
        self.tp = TPGroup.single() if tp is None else tp
        n = self.tp.size
        # what the pools' sides hold: the model's specs, sharded by heads under TP
        self.side_specs = tuple(None if x is None else x.shard(n) if n > 1 else x
                                for x in (self.specs.full, self.specs.swa, self.specs.state))
        self.kinds = layer_kinds(model.config)
        self.dtype = next(model.parameters()).dtype

    def new_cache(self):
        return new_cache(self.model)

    # --------------------------------------------------------------------------- states
    def export_state(self, cache, side: StateSide, slot: Union[int, torch.Tensor]) -> None:
        """Write every linear layer's recurrent state and conv window into state slot ``slot`` (virtual)."""
        spec = self._state_side(side)
        layers = [cache.layers[i] for i in self.specs.linear_layers]
        for i, layer in zip(self.specs.linear_layers, layers):
            if not all(layer.has_previous_state.values()):
                raise InvalidArgumentError("cache", f"a state in linear layer {i}", "none (run a chunk first)")
        k = spec.conv_shapes[0][-1]
        # record_past keeps more than the window in conv_states; the last K columns are the state.
        self._write_state(side, spec, slot, "cache", [lay.conv_states[0][..., -k:] for lay in layers],
                          [lay.recurrent_states[0] for lay in layers] if spec.has_temporal else [])

    def export_split_state(self, states, side: StateSide, slot: Union[int, torch.Tensor]) -> None:
        """Write the state a split forward captured (``split_forward.SplitStates``: one conv window and
        one recurrent state per linear layer) into state slot ``slot`` (virtual), as ``export_state``
        writes a cache's."""
        spec = self._state_side(side)
        n = len(self.specs.linear_layers)
        conv, rec = getattr(states, "conv", None), getattr(states, "recurrent", None)
        if not isinstance(conv, list) or not isinstance(rec, list) or len(conv) != n or len(rec) != n \
                or not spec.has_temporal:
            raise InvalidArgumentError("states", f"a SplitStates with {n} conv windows and {n} states",
                                       type(states).__name__)
        self._write_state(side, spec, slot, "states", conv, rec)

    def _write_state(self, side: StateSide, spec, slot, name: str, conv_l: list, rec_l: list) -> None:
        """``rec_l``: empty for a spec without a temporal state (the conv window is all of it)."""
        conv = torch.stack(conv_l)
        rec = torch.stack(rec_l) if spec.has_temporal else None
        want = ((len(rec_l), 1, *spec.temporal_shape) if rec is not None else None,
                (len(conv_l), 1, *spec.conv_shapes[0]))
        got = (None if rec is None else tuple(rec.shape), tuple(conv.shape))
        if got != want:
            raise InvalidArgumentError(name, f"batch 1 states of shapes {want} (the side's spec)", got)
        row = _physical(side, "slot", _slot(slot))
        tp = self.tp  # [L, 1, H, a, b] and [L, 1, C, K]: this rank's heads and channels
        if rec is not None:
            side.temporal_view_all()[:, row] = tp.split(rec, 2).to(side.device, spec.temporal_dtype)
        side.conv_view_all(0)[:, row] = tp.split(conv, 2).to(side.device, spec.conv_dtype)

    def import_state(self, side: StateSide, slot: Union[int, torch.Tensor], cache=None):
        """Load state slot ``slot`` into the linear layers of ``cache`` (a fresh one if None); returns it.

        A layer that already has a state is overwritten in place (its tensors keep their address).
        """
        spec = self._state_side(side)
        cache = self.new_cache() if cache is None else cache
        row = _physical(side, "slot", _slot(slot))
        rec_all = self.tp.gather(side.temporal_view_all()[:, row], 2) if spec.has_temporal else None  # [L, 1, H, a, b]
        conv_all = self.tp.gather(side.conv_view_all(0)[:, row], 2)
        k = spec.conv_shapes[0][-1]
        for j, i in enumerate(self.specs.linear_layers):
            layer = cache.layers[i]
            dev_ = layer.device if layer.device is not None else self.model.device
            conv = conv_all[j].to(dev_, spec.conv_dtype)
            if layer.is_conv_states_initialized[0] and layer.conv_states[0].shape[-1] == k:
                layer.conv_states[0].copy_(conv)
                layer.has_previous_state[0] = True
            else:
                layer.is_conv_states_initialized[0] = False
                layer.has_previous_state[0] = False
                # A fresh layer takes a full window as its prefill: stored as given, marked as a state.
                layer.update_conv_state(conv.clone(), 0, conv_kernel_size=k)
            if rec_all is None:
                continue  # a conv layer: the window is its whole state
            rec = rec_all[j].to(dev_, spec.temporal_dtype)
            if layer.is_recurrent_states_initialized[0]:
                layer.recurrent_states[0].copy_(rec)
            else:
                layer.update_recurrent_state(rec.clone(), 0)
        return cache

    # ------------------------------------------------------------------------------ KV
    def export_kv(self, cache, side: KVSide, token_ids: IdsLike, start: int, end: int) -> tuple[int, int]:
        """Write K/V of positions ``[start, end)`` of the side's layers into its pages.

        Full side: every position must be in the cache. SWA side: only the positions the sliding
        layers still hold are written (the last ``sliding_window - 1`` after a forward, unless past
        recording is on): export a chunk's SWA KV right after it runs. Returns the range written.
        """
        spec, model_layers = self._kv_side(side)
        layers = [cache.layers[i] for i in model_layers]
        held = {self._held(lay) for lay in layers}
        if len(held) != 1:
            raise InvalidArgumentError("cache", "the same tokens in every layer of a kind", held)
        lo, hi = held.pop()
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
            raise InvalidArgumentError("start, end", "ints with 0 <= start <= end", (start, end))
        if end > hi or (spec.window == 0 and start < lo):
            raise InvalidArgumentError("end" if end > hi else "start",
                                       f"a range inside [{lo}, {hi}), held by the cache", (start, end))
        # ids stay where they are given: on the host they are checked without a device round trip
        ids = _ids("token_ids", token_ids)
        if ids.numel() < end:
            raise InvalidArgumentError("token_ids", f">= {end} ids (one per position)", ids.numel())
        start = max(start, lo)
        if start >= end:
            return end, end
        phys = _physical(side, "token_ids", ids[start:end])
        pages, offs = phys // side.page_size, phys % side.page_size
        k = torch.stack([lay.keys[0, :, start - lo: end - lo].transpose(0, 1) for lay in layers])  # [L, T, H, D]
        v = torch.stack([lay.values[0, :, start - lo: end - lo].transpose(0, 1) for lay in layers])
        n = end - start
        want = ((len(layers), n, spec.kv_heads, spec.head_dim), (len(layers), n, spec.kv_heads, spec.v_head_dim))
        if (tuple(k.shape), tuple(v.shape)) != want or layers[0].keys.shape[0] != 1:
            raise InvalidArgumentError("cache", f"batch 1 K/V of shapes {want} (the side's spec)",
                                       (tuple(layers[0].keys.shape), tuple(k.shape), tuple(v.shape)))
        side.k_view_all()[:, pages, offs] = _to_store(self.tp.split(k, 2), spec).to(side.device)
        side.v_view_all()[:, pages, offs] = _to_store(self.tp.split(v, 2), spec).to(side.device)
        return start, end

    def import_kv(self, cache, side: KVSide, token_ids: IdsLike, n_tokens: int) -> None:
        """Fill the side's (empty) layers of ``cache`` with positions ``[0, n_tokens)`` from the pages;
        sliding layers take only the last ``spec.window`` of them (an all-sliding model's full side: its
        ``specs.full_window``, as the layer would hold them after running the prefix) and count all
        ``n_tokens``."""
        spec, model_layers = self._kv_side(side)
        ids = _ids("token_ids", token_ids)
        if not isinstance(n_tokens, int) or not 0 <= n_tokens <= ids.numel():
            raise InvalidArgumentError("n_tokens", f"an int in [0, {ids.numel()}] (len(token_ids))", n_tokens)
        # an all-sliding model's full side is a sliding layer too: it takes its window of the pages' tokens
        window = spec.window or (self.specs.full_window if spec is self.specs.full else 0)
        start = max(0, n_tokens - window) if window else 0
        for i in model_layers:
            if cache.layers[i].get_seq_length() != 0:
                raise InvalidArgumentError("cache", f"an empty layer {i}", cache.layers[i].get_seq_length())
        if n_tokens == 0:
            return
        phys = _physical(side, "token_ids", ids[start:n_tokens])
        pages, offs = phys // side.page_size, phys % side.page_size
        k = _from_store(self.tp.gather(side.k_view_all()[:, pages, offs], 2), spec)  # [L, T, H, D]
        v = _from_store(self.tp.gather(side.v_view_all()[:, pages, offs], 2), spec)
        for j, i in enumerate(model_layers):
            layer = cache.layers[i]
            layer.update(k[j].transpose(0, 1).unsqueeze(0).to(self.model.device, self.dtype),
                         v[j].transpose(0, 1).unsqueeze(0).to(self.model.device, self.dtype))
            if window:
                layer.cumulative_length = n_tokens  # the positions it has seen, not the ones it keeps

    def build_cache(self, kv_side: KVSide, token_ids: IdsLike, state_side: Optional[StateSide] = None,
                    slot: Union[int, torch.Tensor, None] = None, *, swa_side: Optional[KVSide] = None,
                    swa_token_ids: Optional[IdsLike] = None, n_tokens: Optional[int] = None):
        """A fresh cache holding positions ``[0, n_tokens)`` (default ``len(token_ids)``) from the pools.

        ``state_side``/``slot``: the recurrent state after those tokens (models with linear layers).
        ``swa_side``/``swa_token_ids``: the sliding layers' KV (models with sliding layers).
        Continue with ``forward_chunk(model, cache, ids, n_tokens)``.
        """
        n = len(token_ids) if n_tokens is None else n_tokens
        if self.specs.linear_layers and (state_side is None or slot is None):
            raise InvalidArgumentError("state_side, slot", "a state slot (the model has linear layers)", None)
        if self.specs.swa_layers and (swa_side is None or swa_token_ids is None):
            raise InvalidArgumentError("swa_side, swa_token_ids", "SWA pages (the model has sliding layers)", None)
        cache = self.new_cache()
        self.import_kv(cache, kv_side, token_ids, n)
        if swa_side is not None and swa_token_ids is not None and self.specs.swa_layers:
            self.import_kv(cache, swa_side, swa_token_ids, n)
        if state_side is not None and slot is not None and self.specs.linear_layers:
            self.import_state(state_side, slot, cache)
        return cache

    # --------------------------------------------------------------------------- checks
    @staticmethod
    def _held(layer) -> tuple[int, int]:
        """Positions ``[lo, hi)`` a KV layer holds."""
        if layer.keys is None or not layer.is_initialized:
            return 0, 0
        n = layer.keys.shape[-2]
        hi = getattr(layer, "cumulative_length", n) if getattr(layer, "is_sliding", False) else n
        return hi - n, hi

    def _kv_side(self, side: KVSide) -> tuple[KVSpec, tuple[int, ...]]:
        """The model's (whole) spec of ``side``'s layers, and which model layers they are."""
        spec = getattr(side, "spec", None)
        full, swa, _ = self.side_specs
        if spec == full:
            return self.specs.full, self.specs.full_layers
        if swa is not None and spec == swa:
            assert self.specs.swa is not None
            return self.specs.swa, self.specs.swa_layers
        want = [full] + ([swa] if swa is not None else [])
        raise InvalidArgumentError("side", f"a KV side whose spec is one of {want}", spec)

    def _state_side(self, side: StateSide):
        spec = getattr(side, "spec", None)
        want = self.side_specs[2]
        if want is None or spec != want:
            raise InvalidArgumentError("side", f"a state side whose spec is {want}", spec)
        return self.specs.state


__all__ = ["HybridCacheAdapter"]
