"""Tiny seeded random-weight hybrid models from ``transformers`` configs, and the pool specs they need.

Two families, both built from a config (no download), on the CPU or the GPU:

- ``tiny_qwen3_next``: Qwen3-Next, gated delta-net (linear attention) + full attention; a recurrent
  state ``[H_v, d_k, d_v]`` (fp32) and a conv window ``[conv_dim, kernel]`` per linear layer.
  ``long_memory=True`` makes the state matter (PLATFORM.md): random-init models forget within a few
  tokens, so an all-zero state would pass a naive test.
- ``tiny_swa_model``: Gemma3 text, sliding-window + full attention (layer pattern S,S,F,S,S,F).

``spec_for`` derives the ``KVSpec``/``StateSpec`` for the pools from one probe token through the
model's own ``DynamicCache``: the shapes and dtypes the pools hold are by construction the ones the
cache layers hold, on whichever transformers version is installed (5.17 stores the conv window as
``[conv_dim, kernel]``, as 5.24 does; a future change shows up here, not as silent garbage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from tiered_cache import device as dev
from tiered_cache.errors import InvalidArgumentError
from tiered_cache.specs import KVSpec, StateSpec
from tiered_cache.tiers.unified_pool import UnifiedPool

# Layer kinds, as ``config.layer_types`` names them (both 5.17 and 5.24).
LINEAR, FULL, SLIDING = "linear_attention", "full_attention", "sliding_attention"


def _build(model_cls, config, seed: int, dtype: torch.dtype, device: dev.DeviceLike, attn_implementation: str):
    """Init on the CPU under a private RNG (same weights on every device), then move."""
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(device=dev.resolve(device), dtype=dtype).eval()


def tiny_qwen3_next(seed: int = 0, long_memory: bool = False, dtype: torch.dtype = torch.float32,
                    device: dev.DeviceLike = None, attn_implementation: str = "sdpa", **overrides):
    """A tiny Qwen3-Next causal LM: 8 layers (``linear x3, full`` twice), hidden 64, dense MLPs.

    ``d_k`` (16) differs from ``d_v`` (32) so a mix-up of the state's axes cannot pass unnoticed.
    ``long_memory``: decay ``A = exp(A_log)`` uniform in [0.02, 0.1], ``dt_bias = -2`` and every 2-D
    weight scaled x4 (PLATFORM.md), so the state carries information across many tokens.
    ``overrides`` go to ``Qwen3NextConfig`` (e.g. ``num_experts=4, mlp_only_layers=[]`` for MoE MLPs).
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    pattern = [LINEAR, LINEAR, LINEAR, FULL] * 2
    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(pattern),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=pattern,
        # Dense MLPs: MoE routing adds nothing to what the cache sees and costs CPU time.
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        mlp_only_layers=list(range(len(pattern))),
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kw.update(overrides)
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        kw["layer_types"] = [FULL if i % 4 == 3 else LINEAR for i in range(n)]
        if "mlp_only_layers" not in overrides:
            kw["mlp_only_layers"] = list(range(n))
    model = _build(Qwen3NextForCausalLM, Qwen3NextConfig(**kw), seed, torch.float32, "cpu", attn_implementation)
    if long_memory:
        _make_long_memory(model, seed)
    return model.to(device=dev.resolve(device), dtype=dtype)


def _make_long_memory(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty(p.shape).uniform_(0.02, 0.1, generator=gen)))
            elif name.endswith("dt_bias"):
                p.fill_(-2.0)
            elif p.dim() == 2:
                p.mul_(4.0)


def tiny_swa_model(seed: int = 0, dtype: torch.dtype = torch.float32, device: dev.DeviceLike = None,
                   sliding_window: int = 8, attn_implementation: str = "sdpa", **overrides):
    """A tiny Gemma3 text model: 6 layers (``sliding x2, full`` twice), hidden 64, window 8 tokens.

    Gemma3 rather than gpt-oss: dense (gpt-oss is MoE with attention sinks, slower on CPU) and the
    same config and cache API in 5.17 and 5.24. ``overrides`` go to ``Gemma3TextConfig``.
    """
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    pattern = [SLIDING, SLIDING, FULL] * 2
    kw = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(pattern),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=1024, sliding_window=sliding_window, layer_types=pattern,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kw.update(overrides)
    model = _build(Gemma3ForCausalLM, Gemma3TextConfig(**kw), seed, torch.float32, "cpu", attn_implementation)
    return model.to(device=dev.resolve(device), dtype=dtype)


# ------------------------------------------------------------------------------------------ specs
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

    def make_pool(self, full_slots: int, high_slots: int, device: dev.DeviceLike = None, **kwargs) -> UnifiedPool:
        """A ``UnifiedPool``: full KV (``full_slots`` pages) + states or SWA KV (``high_slots`` states/pages)."""
        high = self.state if self.state is not None else self.swa
        if high is None:
            raise InvalidArgumentError("model", "a hybrid (linear or sliding-window layers)", "full attention only")
        return UnifiedPool(self.full, high, low_slots=full_slots, high_slots=high_slots,
                           page_size=self.page_size, device=device, **kwargs)


def layer_kinds(config) -> tuple[str, ...]:
    """``config.layer_types`` of the decoder, checked to be kinds the adapters move."""
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    kinds = tuple(getattr(cfg, "layer_types", None) or ())
    if len(kinds) != cfg.num_hidden_layers:
        raise InvalidArgumentError("model", "a config with layer_types (one per layer)", kinds)
    bad = sorted(set(kinds) - {LINEAR, FULL, SLIDING})
    if bad:
        raise InvalidArgumentError("model", f"layer types in {(LINEAR, FULL, SLIDING)}", bad)
    return kinds


@torch.no_grad()
def spec_for(model, page_size: int = 16) -> ModelSpecs:
    """Specs of the pools for ``model``, read from one probe token through its own cache.

    State ``value_axis`` is 2: Qwen3-Next keeps ``[B, H_v, d_k, d_v]``; the int8 scale reduces over d_v.
    """
    from tiered_cache.engine.adapters import forward_chunk, new_cache  # adapters import this module

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

