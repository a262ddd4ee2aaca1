"""``ModelRunner``: how the engine's forwards run, decided once from its config and what the model allows.

The scheduler decides which tokens of which requests run in a step; the runner runs them:

- a prefill piece on one request's cache (``prefill``), with the gated-delta chunk rule on padded
  static buffers (``prefill_graphs``: ``graph_prefill.GraphChunkRule``) and, where the scheduler asks,
  the state taken at a position inside the piece (``split``: ``split_forward.forward_chunk_split``);
- a decode step of several requests in one forward (``decode``): through the graph decoder's static
  buffers (``decode_graphs``: ``graph_decode.GraphDecoder``) or over a left-padded batch gathered from
  their caches (``decode_batch``: ``forward.decode_batch``).

Models with sliding-window layers decode one request at a time (``batched`` is False): their sliding
layers' caches cannot be gathered into one batch here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Optional

import torch

from tiered_cache.engine.config import EngineConfig
from tiered_cache.engine.model_specs import ModelSpecs
from tiered_cache.engine.runner import split_forward
from tiered_cache.engine.runner.forward import decode_batch, forward_chunk, new_cache
from tiered_cache.engine.runner.graph_decode import GraphDecoder
from tiered_cache.engine.runner.graph_prefill import GraphChunkRule, transfers_waited
from tiered_cache.errors import InvalidArgumentError


class ModelRunner:
    """Runs ``model``'s forwards for an engine configured by ``cfg`` (``specs``: the model's pool specs).

    ``graph_decoder`` / ``prefill_rule``: the static-buffer paths, None where the config leaves them off.
    ``split``: prefill may take a state inside a forward; it turns False for good the first time the
    model does not let it (the scheduler then runs two forwards).
    """

    def __init__(self, model, specs: Optional[ModelSpecs], cfg: EngineConfig) -> None:
        self.model, self.device = model, model.device
        # specs None: the no-cache baseline (no pools); the model's own cache says if it has sliding layers
        sliding = bool(specs.swa_layers) if specs is not None else any(
            getattr(lay, "sliding_window", None) for lay in new_cache(model).layers)
        self.graph_decoder: Optional[GraphDecoder] = None
        if cfg.decode_graphs:
            if sliding:
                raise InvalidArgumentError("decode_graphs", "False for a model with sliding-window layers", True)
            self.graph_decoder = GraphDecoder(model, max_batch=cfg.max_running)
        self.batched = (cfg.decode_batch or self.graph_decoder is not None) and not sliding
        self.prefill_rule: Optional[GraphChunkRule] = None
        if cfg.prefill_graphs:
            if not split_forward.split_supported(model):
                raise InvalidArgumentError("prefill_graphs", "False: this model's layers do not call the chunk "
                                           "rule by name (split_supported)", True)
            split_forward.install(model)
            self.prefill_rule = GraphChunkRule(self.device)
        self.split = False
        if specs is None:  # no cache: nothing is checkpointed, a split forward has nothing to take
            if cfg.split_checkpoints:
                raise InvalidArgumentError("split_checkpoints", "None or False without the cache (use_cache=False "
                                           "caches no state to split a forward for)", True)
            return
        if cfg.split_checkpoints and specs.state is None:
            raise InvalidArgumentError("split_checkpoints", "None or False for a model without recurrent states "
                                       "(a split forward takes a state; there is none to take)", True)
        if cfg.split_checkpoints is not False and specs.state is not None:
            self.split = split_forward.split_supported(model)
            if cfg.split_checkpoints and not self.split:
                raise InvalidArgumentError("split_checkpoints", "None or False: this model's layers do not call "
                                           "the chunk rule and conv by name (split_supported)", True)

    def quiesce_with(self, transfer) -> None:
        """Both graph paths wait for ``transfer``'s tickets (a ``TransferEngine``; None: nothing to wait
        for) before each capture (``graph_prefill.capture_window``)."""
        for path in (self.graph_decoder, self.prefill_rule):
            if path is not None:
                path.quiesce = transfers_waited(transfer)

    def new_cache(self):
        """A fresh model cache for one request."""
        return new_cache(self.model)

    def prefill(self, cache, tokens: Sequence[int], start: int, split_at: Optional[Sequence[int]] = None):
        """Run ``tokens`` at positions ``[start, start + len(tokens))`` on ``cache`` (updated in place).

        Returns ``(logits [T, vocab], states)``: with ``split_at`` (increasing positions inside the
        forward), ``states`` holds the state after each (a ``split_forward.SplitStates`` per position),
        or is None where the model did not let them be taken (a warning said why; ``split`` is then
        off); without it, None."""
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        rule = self.prefill_rule if len(tokens) > 1 else None
        with rule.active() if rule is not None else contextlib.nullcontext():
            if split_at is None:
                return forward_chunk(self.model, cache, ids, start)[0], None
            # through the module, so a test's stand-in for forward_chunk_split is the one called
            logits, _, states = split_forward.forward_chunk_split(self.model, cache, ids, start, split_at)
        if states is None:
            self.split = False
        return logits, states

    def decode_alone(self, n: int) -> bool:
        """Whether a step's ``n`` decode tokens run as one-request forwards: always where decode is not
        batched; a lone token too, unless the graph decoder (whose buffers keep it warm) takes it."""
        return not self.batched or (n == 1 and self.graph_decoder is None)

    def decode(self, caches: Sequence, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """One decode token for each request in one forward, queued on the device (nothing read back):
        ``caches[b]`` holds positions ``[0, positions[b])`` and gains ``tokens[b]``. Returns the logits
        ``[B, vocab]``."""
        if self.graph_decoder is not None:
            return self.graph_decoder.step(caches, tokens, positions)
        return decode_batch(self.model, caches, tokens, positions)

    def stats(self) -> dict:
        """The static-buffer paths' counters, for the engine's report (empty where they are off)."""
        if self.prefill_rule is None:
            return {}
        rule = self.prefill_rule
        return {"graph_prefill": dict(rule.stats, graphs=len(rule.entries), capture_error=rule.capture_error)}
