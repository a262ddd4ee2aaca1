"""Batched decode over static buffers, replayed as CUDA graphs: one launch per step instead of the
thousand-odd kernel launches of an eager forward.

``forward.decode_batch`` runs one eager forward per decode step; for a 24-layer hybrid that forward
is launch-bound (about 10 ms on the H200 whatever the batch: benchmarks/results/README.md). Here the
step runs on buffers whose addresses never change, so on a GPU it is captured once per (batch size,
context bucket) as a CUDA graph and replayed:

- full-attention layers: keys and values ``[max_batch, kv_heads, L, D]``, position ``t`` of request
  ``b`` at index ``t``; the step writes the new token's key and value at its position (``scatter_``
  by a position tensor) and attends through a boolean mask over ``[0, position]``;
- linear-attention layers: conv windows and recurrent states ``[max_batch, ...]``, updated in place
  (Lfm2's conv layers: the windows alone).

Each step gathers the requests' caches into the buffers (one ``_foreach_copy_`` launch), fills ids,
positions and the mask, replays, and hands each cache its new token's key/value and its new state, as
``decode_batch`` does. A buffer row keeps what the step left in it: when the next step puts the same
cache in the same row at the next position (a request decoding on), the row already holds its keys,
values and state, and nothing of it is copied again (``stats["rows_kept"]``). On CPU (or
``use_graphs=False``) the same step runs eagerly, which is what the CPU tests compare with one-request
forwards.

The model sees the buffers through ``_StaticCache``, which answers the cache calls Qwen3-Next makes
while decoding in transformers 5.17 (``has_previous_state``, ``layers[i].conv_states``,
``update_recurrent_state``), 5.24 (``get_conv_state``, ``get_recurrent_state``,
``is_recording_past``) and 5.25 (``increase_count``), and ``update`` for attention. The attention mask
goes in as the ``{"full_attention": mask, "linear_attention": None, "conv": None}`` mapping all three
accept, so no mask is built inside the captured region. SDPA attention only; models with sliding-window
layers are not handled (they decode through ``decode_batch``'s fallback in the engine).

Attention in the step goes through ``gqa_sdpa`` (registered with transformers as ``GQA_ATTENTION`` and
switched on around the step's forward only): each key/value head's query heads are packed into the rows
of one matrix product, so each key and value is read once under the mask. transformers 5.17's ``sdpa``
copies every key and value ``group`` times first whenever a mask is given (``repeat_kv``): at 4
requests of 20K tokens, 8 query heads per key head, that is 1.3 GB written and read per layer per step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Optional

import torch

from tiered_cache import device as dev
from tiered_cache.engine.models import KV_KINDS, RECURRENT_KINDS, SLIDING, STATE_KINDS, layer_kinds
from tiered_cache.engine.runner.forward import cache_kwarg, conv_width, seen_tokens, store_decoded
from tiered_cache.engine.runner.graph_prefill import capture_window, capture_with_retry
from tiered_cache.errors import InvalidArgumentError

GQA_ATTENTION = "tiered_cache_gqa_sdpa"
GQA_CHUNK_BYTES = 64 << 20  # the most of one fp32 copy of keys (or values) gqa_sdpa makes at a time


def gqa_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
             **kwargs) -> tuple[torch.Tensor, None]:
    """Decode attention through transformers' attention-function interface: ``query [b, heads, q, d]``,
    ``key``/``value`` ``[b, kv_heads, t, d]``, a boolean or additive ``attention_mask [b, 1, q, t]`` (or
    None); returns ``([b, q, heads, d], None)``. Query head ``j`` reads key/value head ``j // group``, as
    after ``repeat_kv``, but the ``group`` query heads of a key/value head go in as ``group * q`` rows of
    one matrix product, so the keys and values are read once and never repeated.

    Two batched matrix products and a softmax, in fp32, rather than SDPA: a fused attention kernel spreads
    a decode step over (requests x key/value heads) blocks, 8 at 4 requests of 2 key/value heads, each
    walking 20K keys alone (1.2 ms per layer on the H200, 2026-11-30); the products spread over the whole
    GPU. For decode (few query rows): the scores ``[b, kv_heads, group * q, t]`` are materialized. Keys
    and values of a narrower dtype go to fp32 ``GQA_CHUNK_BYTES`` at a time, so the temporary copies
    stay bounded whatever the batch and context."""
    b, h, q, d = query.shape
    kvh, t, dv = key.shape[1], key.shape[2], value.shape[-1]
    if h % kvh:
        raise InvalidArgumentError("query", f"a multiple of the {kvh} key/value heads", h)
    g, bk = h // kvh, b * kvh
    scale = d ** -0.5 if scaling is None else scaling
    kf, vf = key.reshape(bk, t, d), value.reshape(bk, t, dv)
    step = t if key.dtype == torch.float32 else max(1, GQA_CHUNK_BYTES // (bk * max(d, dv) * 4))
    spans = [(s, min(t, s + step)) for s in range(0, t, step)]
    qp = query.reshape(bk, g * q, d).float()  # heads j = k * g + i: rows (i, q) of head k
    scores = torch.cat([torch.bmm(qp, kf[:, s:e].float().transpose(1, 2)) for s, e in spans], dim=-1) * scale
    if attention_mask is not None:
        m = attention_mask[:, :, None].expand(b, kvh, g, q, t).reshape(bk, g * q, t)
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
    probs = scores.softmax(-1)
    out = torch.bmm(probs[:, :, spans[0][0]:spans[0][1]], vf[:, spans[0][0]:spans[0][1]].float())
    for s, e in spans[1:]:
        out = out + torch.bmm(probs[:, :, s:e], vf[:, s:e].float())
    return out.to(query.dtype).reshape(b, h, q, dv).transpose(1, 2).contiguous(), None


def _register_gqa() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(GQA_ATTENTION, gqa_sdpa)


class _StaticLayer:
    """What 5.17 reads off ``cache.layers[i]`` for a linear layer while decoding."""

    def __init__(self, conv: Optional[torch.Tensor], rec: Optional[torch.Tensor]) -> None:
        self.conv_states = {0: conv}
        self.recurrent_states = {0: rec}
        self.record_past = False
        self.has_previous_state = {0: True}


class _StaticCache:
    """The model's view of the decode buffers for one (batch, bucket) shape."""

    def __init__(self, kinds, keys, values, conv, rec, write_pos: torch.Tensor) -> None:
        self.kinds = kinds
        self.keys, self.values, self.conv, self.rec = keys, values, conv, rec
        self.write_pos = write_pos  # [n] int64: where each row's new token goes
        self.layers = [_StaticLayer(conv.get(i), rec.get(i)) for i in range(len(kinds))]

    # full attention (both versions)
    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        # keys and values index apart: their head sizes differ in some models (Kimi Linear's MLA)
        pos = self.write_pos.view(-1, 1, 1, 1)
        k.scatter_(2, pos.expand(*key_states.shape[:2], 1, key_states.shape[3]), key_states.to(k.dtype))
        v.scatter_(2, pos.expand(*value_states.shape[:2], 1, value_states.shape[3]), value_states.to(v.dtype))
        return k, v

    # linear attention, 5.17 (Qwen3.5 passes state_idx too)
    def has_previous_state(self, layer_idx: Optional[int] = None, state_idx: Optional[int] = None) -> bool:
        return True

    # linear attention, 5.24
    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        return self.conv[layer_idx]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        return self.rec[layer_idx]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_recurrent_state(self, recurrent_states, layer_idx: int, *args, **kwargs):
        self.rec[layer_idx].copy_(recurrent_states)
        return self.rec[layer_idx]

    # linear attention, 5.25: the short conv's decode path counts its token on the layer; the buffers keep
    # no counters (positions are passed), and ``store_decoded`` sets each request cache's after the step
    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        pass

    def update_conv_state(self, *args, **kwargs):  # only prefill calls it; a decode step never does
        raise InvalidArgumentError("input_ids", "one token per request (decode)", "a prefill")

    def get_seq_length(self, layer_idx: int = 0) -> int:  # positions are always passed explicitly
        raise InvalidArgumentError("position_ids", "explicit positions (static decode)", None)


class GraphDecoder:
    """One decode token for each of up to ``max_batch`` requests per ``step``.

    Args:
        model: a hybrid causal LM from ``engine.models`` (full, linear, hybrid and cache-less layers,
            ``attn_implementation="sdpa"``).
        max_batch: most requests per step (the engine's ``max_running``).
        len_bucket: context lengths are rounded up to a multiple of this (one graph per bucket and
            batch size; attention reads the whole bucket, masked).
        use_graphs: capture and replay CUDA graphs (default: on a GPU).
    """

    def __init__(self, model, max_batch: int, len_bucket: int = 4096, use_graphs: Optional[bool] = None) -> None:
        kinds = layer_kinds(model.config)
        if SLIDING in kinds:
            raise InvalidArgumentError("model", "a model without sliding-window layers (static decode)",
                                       "sliding layers")
        impl = getattr(model.config, "_attn_implementation", None)
        if set(KV_KINDS) & set(kinds) and impl != "sdpa":
            raise InvalidArgumentError("model", "attn_implementation 'sdpa' (static decode)", impl)
        for name, v in (("max_batch", max_batch), ("len_bucket", len_bucket)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise InvalidArgumentError(name, "an int >= 1", v)
        _register_gqa()
        self.model, self.kinds = model, kinds
        self._attn_cfg = model.config.get_text_config(decoder=True)
        self.device = model.device
        self.max_batch, self.len_bucket = max_batch, len_bucket
        if use_graphs is not None and not isinstance(use_graphs, bool):
            raise InvalidArgumentError("use_graphs", "a bool or None (None: on a GPU)", use_graphs)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        if self.use_graphs and self.device.type != "cuda":
            raise InvalidArgumentError("use_graphs", "False on a device without CUDA", use_graphs)
        self.k_conv = 0  # conv window columns: read off the first caches the buffers are shaped after
        self.capacity = 0  # tokens the key/value buffers hold per request
        self.buf: dict[str, dict[int, torch.Tensor]] = {}
        self.graphs: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}
        self.stats = {"steps": 0, "captures": 0, "replays": 0, "rows_kept": 0, "capture_retries": 0}
        # per buffer row: (a weak reference to the cache it holds, the position it continues at)
        self._rows: list[Optional[tuple[Any, int]]] = [None] * max_batch
        self.capture_error: Optional[str] = None  # set if a capture failed twice: the decoder then runs eagerly
        self.retried_error: Optional[str] = None  # the last capture error that a retry got past
        self.quiesce: Optional[Any] = None  # a callable run before every capture (graph_prefill.capture_window)

    # ----------------------------------------------------------------------------- buffers
    def _ensure(self, caches: Sequence, need: int) -> None:
        """Buffers shaped after the first cache, holding ``need`` tokens per request (grown by buckets;
        growing drops the captured graphs, which point at the old buffers)."""
        if self.buf and need <= self.capacity:
            return
        cap = -(-need // self.len_bucket) * self.len_bucket
        c0, b = caches[0], self.max_batch
        self.k_conv = conv_width(c0, self.kinds)
        keys, values, conv, rec = {}, {}, {}, {}
        for i, kind in enumerate(self.kinds):
            lay = c0.layers[i]
            if kind in KV_KINDS:
                k, v = lay.keys, lay.values
                keys[i] = k.new_zeros((b, k.shape[1], cap, k.shape[3]))
                values[i] = v.new_zeros((b, v.shape[1], cap, v.shape[3]))
            if kind in STATE_KINDS:  # a hybrid layer has both
                cs = lay.conv_states[0]
                conv[i] = cs.new_zeros((b, cs.shape[1], self.k_conv))
            if kind in RECURRENT_KINDS:  # a conv layer (Lfm2) has its window only
                rs = lay.recurrent_states[0]
                rec[i] = rs.new_zeros((b, *rs.shape[1:]))
        dev = self.device
        self.buf = {"keys": keys, "values": values, "conv": conv, "rec": rec,
                    "ids": {0: torch.zeros((b, 1), dtype=torch.long, device=dev)},
                    "pos": {0: torch.zeros((b, 1), dtype=torch.long, device=dev)},
                    "arange": {0: torch.arange(cap, dtype=torch.long, device=dev)}}
        self.capacity = cap
        self.graphs.clear()
        self._rows = [None] * self.max_batch  # fresh buffers hold no request

    def _run(self, n: int, width: int) -> torch.Tensor:
        """The step on the buffers' first ``n`` rows and ``width`` positions (what a graph captures: the
        mask is computed from the position buffer inside it)."""
        bf = self.buf
        cache = _StaticCache(self.kinds, {i: t[:n, :, :width] for i, t in bf["keys"].items()},
                             {i: t[:n, :, :width] for i, t in bf["values"].items()},
                             {i: t[:n] for i, t in bf["conv"].items()}, {i: t[:n] for i, t in bf["rec"].items()},
                             bf["pos"][0][:n, 0])
        ids, pos = bf["ids"][0][:n], bf["pos"][0][:n]
        # [0, position]: the cached tokens and the new one
        mask = (bf["arange"][0][:width].view(1, width) <= pos).view(n, 1, 1, width)
        cfg, impl = self._attn_cfg, self._attn_cfg._attn_implementation
        cfg._attn_implementation = GQA_ATTENTION  # this forward only (a graph keeps the kernels it ran)
        try:
            out = self.model(input_ids=ids, position_ids=pos, use_cache=True,
                             attention_mask={"full_attention": mask, "linear_attention": None, "conv": None},
                             **{cache_kwarg(self.model): cache})
        finally:
            cfg._attn_implementation = impl
        return out.logits[:, -1]

    # -------------------------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, caches: Sequence, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """As ``forward.decode_batch``: ``caches[b]`` (batch 1) holds positions ``[0, positions[b])``;
        returns the logits ``[n, vocab]`` and each cache gains its token's key/value and new state."""
        n = len(caches)
        if n == 0 or n > self.max_batch or len(tokens) != n or len(positions) != n:
            raise InvalidArgumentError("caches, tokens, positions", f"1 to {self.max_batch} of each, as many",
                                       (n, len(tokens), len(positions)))
        for b, (c, p) in enumerate(zip(caches, positions)):
            seen = seen_tokens(c)
            if not isinstance(p, int) or p < 1 or (seen is not None and seen != p):
                raise InvalidArgumentError("positions", f"positions[{b}] = {seen}, the tokens cache {b} holds", p)
            for i, kind in enumerate(self.kinds):
                if kind in STATE_KINDS and not all(c.layers[i].has_previous_state.values()):
                    raise InvalidArgumentError("caches", f"a state in linear layer {i} of cache {b}", "none")
        self._ensure(caches, max(positions) + 1)
        width = min(self.capacity, -(-(max(positions) + 1) // self.len_bucket) * self.len_bucket)
        self._gather(caches, tokens, positions)
        try:
            logits = self._replay(n, width) if self.use_graphs else None
            if logits is None:
                logits = self._run(n, width)
            self._scatter(caches, n)
        except BaseException:
            self._rows = [None] * self.max_batch  # a step cut short leaves no row to trust
            raise
        for b, (c, p) in enumerate(zip(caches, positions)):
            self._rows[b] = (weakref.ref(c), p + 1)  # the row now holds positions [0, p] and their state
        self.stats["steps"] += 1
        return logits.clone()

    def _gather(self, caches, tokens, positions) -> None:
        bf, n = self.buf, len(caches)
        dst, src = [], []
        copy = []  # rows that do not already hold their request as the last step left it
        for b, (c, p) in enumerate(zip(caches, positions)):
            kept = self._rows[b]
            if kept is not None and kept[0]() is c and kept[1] == p:
                self.stats["rows_kept"] += 1
            else:
                self._rows[b] = None  # overwritten below
                copy.append(b)
        for i, kind in enumerate(self.kinds):
            for b in copy:
                c = caches[b]
                lay = c.layers[i]
                if kind in KV_KINDS:
                    p = positions[b]
                    dst += [bf["keys"][i][b, :, :p], bf["values"][i][b, :, :p]]
                    src += [lay.keys[0], lay.values[0]]
                if kind in STATE_KINDS:
                    dst.append(bf["conv"][i][b])
                    src.append(lay.conv_states[0][0, :, -self.k_conv:])
                if kind in RECURRENT_KINDS:
                    dst.append(bf["rec"][i][b])
                    src.append(lay.recurrent_states[0][0])
        if dst:
            torch._foreach_copy_(dst, src)
        # ids and positions through pinned memory, without blocking (a pageable copy would hold this
        # thread until the copy engine reached it, behind any large load in flight)
        small = dev.host_to_device(torch.tensor([list(tokens), list(positions)], dtype=torch.long), self.device)
        bf["ids"][0][:n, 0].copy_(small[0])
        bf["pos"][0][:n, 0].copy_(small[1])

    def _scatter(self, caches, n: int) -> None:
        bf = self.buf
        rows, pos = torch.arange(n, device=self.device), bf["pos"][0][:n, 0]
        new_k = {i: t[rows, :, pos].unsqueeze(2) for i, t in bf["keys"].items()}  # [n, H, 1, D], a copy
        new_v = {i: t[rows, :, pos].unsqueeze(2) for i, t in bf["values"].items()}
        store_decoded(caches, self.kinds, self.k_conv, new_k, new_v, bf["conv"], bf["rec"])

    def _replay(self, n: int, width: int) -> Optional[torch.Tensor]:
        """Replay the (n, width) graph, capturing it first (a failed capture is retried once,
        ``stats["capture_retries"]``). None if it failed twice: the decoder says so (``capture_error``,
        a warning) and runs eagerly from then on, a fallback a benchmark must not hide; the buffers are
        as gathered, so the eager step still computes the right thing."""
        key = (n, width)
        if key not in self.graphs and not capture_with_retry(self, lambda: self._capture(n, width), self.graphs.clear,
                                                             "failed twice, decoding eagerly"):
            return None
        graph, out = self.graphs[key]
        graph.replay()
        self.stats["replays"] += 1
        return out

    def _capture(self, n: int, width: int) -> None:
        """Warm up on a side stream (kernel selection, autotuning, workspaces), then capture inside
        ``capture_window``. The buffers are put back as gathered whatever happens (warm-up steps write
        into them)."""
        saved = {k: {i: t.clone() for i, t in self.buf[k].items()}
                 for k in ("keys", "values", "conv", "rec", "ids", "pos")}
        try:
            side = dev.new_stream(self.device)
            side.wait_stream(dev.current_stream(self.device))
            with dev.use_stream(side):
                for _ in range(2):
                    self._restore(saved)
                    self._run(n, width)
            dev.current_stream(self.device).wait_stream(side)
            self._restore(saved)
            graph = dev.cuda_graph()
            with capture_window(self.device, self.quiesce), dev.graph_capture(graph):
                out = self._run(n, width)
            self.graphs[(n, width)] = (graph, out)
            self.stats["captures"] += 1
        finally:
            self._restore(saved)

    def _restore(self, saved) -> None:
        for k, d in saved.items():
            for i, t in d.items():
                self.buf[k][i].copy_(t)
