"""Tiny seeded random-weight hybrid models from ``transformers`` configs, and what their layers are.

Built from a config (no download), on the CPU or the GPU:

- ``tiny_qwen3_next``: Qwen3-Next, gated delta-net (linear attention) + full attention; a recurrent
  state ``[H_v, d_k, d_v]`` (fp32) and a conv window ``[conv_dim, kernel]`` per linear layer.
  ``long_memory=True`` makes the state matter (docs/platform.md): random-init models forget within a few
  tokens, so an all-zero state would pass a naive test.
- ``tiny_swa_model``: Gemma3 text, sliding-window + full attention (layer pattern S,S,F,S,S,F).
- ``tiny_family(name)``: the other families of ``FAMILIES`` (Mamba2 hybrids, Kimi Linear, Qwen3.5, OLMo
  hybrid, NemotronH, FalconH1, Zamba2, Lfm2, gpt-oss, Cohere2, Mistral; Jamba, which the tiers refuse),
  for tests/families.

``layer_kinds`` reads which kind each layer is (``model_specs.spec_for`` derives the pools' specs from
them); ``weights_id`` names a model by its weights.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from tiered_cache import device as dev
from tiered_cache.errors import InvalidArgumentError

# Layer kinds, as ``config.layer_types`` names them (both 5.17 and 5.24). HYBRID: attention and a
# Mamba2 mixer in one layer (FalconH1, Zamba2), whose cache layer holds KV and a state; NO_CACHE: a
# layer with an MLP or MoE only (NemotronH), which caches nothing.
LINEAR, FULL, SLIDING, HYBRID = "linear_attention", "full_attention", "sliding_attention", "hybrid"
NO_CACHE = ("mlp", "moe")
CONV = "conv"  # Lfm2's short-conv layers: a conv window and no recurrent state
KV_KINDS, STATE_KINDS = (FULL, HYBRID), (LINEAR, HYBRID, CONV)  # the kinds whose layers hold full KV / a state
RECURRENT_KINDS = (LINEAR, HYBRID)  # the state kinds with a recurrent state beside the conv window


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
    weight scaled x4 (docs/platform.md), so the state carries information across many tokens.
    ``overrides`` go to ``Qwen3NextConfig`` (e.g. ``num_experts=4, mlp_only_layers=[]`` for MoE MLPs).
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    pattern = [LINEAR, LINEAR, LINEAR, FULL] * 2
    kw: dict[str, Any] = dict(
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


def _make_long_memory(model, seed: int, conv_scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("conv1d.weight", "conv.conv.weight")) and conv_scale != 1.0:  # Mamba2's, Lfm2's
                p.mul_(conv_scale)
            elif name.endswith("A_log"):
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
    kw: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(pattern),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=1024, sliding_window=sliding_window, layer_types=pattern,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    kw.update(overrides)
    model = _build(Gemma3ForCausalLM, Gemma3TextConfig(**kw), seed, torch.float32, "cpu", attn_implementation)
    return model.to(device=dev.resolve(device), dtype=dtype)


# ------------------------------------------------------------------------------ more families
# Tiny configs of the other hybrids transformers ships (hidden 64, a few layers), for the per-family
# end-to-end test (tests/families). Each entry: (config class, model class, config keywords).
_COMMON: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2)
# head_dim (16) differs from d_state (8), as Qwen3-Next's d_k from d_v: a mix-up of the state's axes shows
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
               mamba_chunk_size=16)
_GDN = dict(head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Mamba2 + attention, dense MLPs
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(num_hidden_layers=4, attn_layer_indices=[1, 3], **_MAMBA2)),
    # Mamba2 + attention, MoE MLPs
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
                              num_local_experts=4, num_experts_per_tok=2, **_MAMBA2)),
    # Kimi delta attention (d_k = d_v, three conv windows packed as one) + MLA attention, MoE MLPs
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(num_hidden_layers=4, layer_types=[LINEAR, FULL, LINEAR, FULL], linear_attn_config=dict(
                        head_dim=16, num_heads=4, short_conv_kernel_size=4), kv_lora_rank=32, q_lora_rank=None,
                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_local_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                         num_key_value_heads=4)),
    # gated delta-net + gated attention (Qwen3-Next's successor)
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(num_hidden_layers=4, layer_types=[LINEAR, LINEAR, LINEAR, FULL], **_GDN)),
    # gated delta-net + attention
    "olmo_hybrid": ("OlmoHybridConfig", "OlmoHybridForCausalLM",
                    dict(num_hidden_layers=4, layer_types=[LINEAR, LINEAR, LINEAR, FULL], **_GDN)),
    # sliding window + full attention, MoE MLPs with attention sinks (no SDPA in transformers: eager)
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(num_hidden_layers=4, layer_types=[SLIDING, FULL] * 2, sliding_window=8, head_dim=16,
                     num_local_experts=4, num_experts_per_tok=2, rope_parameters={"rope_type": "default",
                                                                                  "rope_theta": 10000.0})),
    # sliding window + full attention (3:1), dense
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM",
                dict(num_hidden_layers=4, layer_types=[SLIDING, SLIDING, SLIDING, FULL], sliding_window=8)),
    # Mamba2, attention, MoE and MLP layers apart (the last two cache nothing)
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict(layers_block_type=["mamba", "moe", "attention", "mlp", "mamba", "attention"],
                        num_hidden_layers=6, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=1,
                        ssm_state_size=8, conv_kernel=4, expand=1, chunk_size=16, n_routed_experts=4,
                        moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)),
    # attention and Mamba2 side by side in every layer
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  dict(num_hidden_layers=3, head_dim=16, mamba_d_ssm=64, **_MAMBA2)),
    # Mamba2 layers, and hybrid layers (a shared attention block + Mamba2)
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM",
               dict(num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], mamba_headdim=16,
                    n_mamba_heads=4, mamba_ngroups=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
                    chunk_size=16)),
    # short-conv layers (a conv window, no recurrent state) + attention
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(num_hidden_layers=4, layer_types=[CONV, FULL, CONV, FULL])),
    # sliding window on every layer (no layer_types): its first layer keyed as full KV (model_specs); a
    # window of 16 covers a 12-token question, so what a resume gives the layers reaches the answer
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=3, sliding_window=16, head_dim=16)),
    # refused (a typed error at Engine construction, tests/families say why): Jamba's Mamba1
    "jamba": ("JambaConfig", "JambaForCausalLM",
              dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   num_experts=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=1)),
}
_EAGER_ONLY = {"gpt_oss"}
# A Mamba2 mixer's conv weights are 3-D (the x4 of the 2-D ones leaves them) and small: x, B and C come
# out of the conv so small that the state hardly moves the logits (zeroed on resume, 12 tokens later:
# 0.11 in Bamba, 0.005 in FalconH1, where no token flipped); scaled x16 they move them by 1.1-1.2 and
# 0.22-0.24, flipping 20-27% and 6-10% of the tokens (measured at 32 and 64 tokens, seed 0)
MAMBA2_CONV_SCALE = 16.0
# Lfm2's short conv keeps a window of 3 tokens and nothing else: zeroed on resume, it moved the logits by
# 0.23 and flipped 4% of 24 tokens; its (3-D) conv weights x4: 0.83 and 21% (seed 0, a prompt split 24+24)
LFM2_CONV_SCALE = 4.0


def tiny_family(name: str, seed: int = 0, long_memory: bool = False, dtype: torch.dtype = torch.float32,
                device: dev.DeviceLike = None, **overrides):
    """A tiny seeded model of family ``name`` (a key of ``FAMILIES``); ``overrides`` go to its config.

    ``long_memory``: the recipe for a state that matters (``_make_long_memory``: Qwen3-Next's, and for a
    Mamba2 mixer its conv weights x ``MAMBA2_CONV_SCALE``, for Lfm2's short conv x ``LFM2_CONV_SCALE``);
    refused for a model without states.
    """
    if name not in FAMILIES:
        raise InvalidArgumentError("name", f"one of {sorted(FAMILIES)}", name)
    import transformers

    cfg_name, model_name, kw = FAMILIES[name]
    kw = dict(_COMMON, **kw)
    kw.update(overrides)
    config = getattr(transformers, cfg_name)(**kw)
    impl = "eager" if name in _EAGER_ONLY else "sdpa"
    model = _build(getattr(transformers, model_name), config, seed, torch.float32, "cpu", impl)
    if any(type(m).__name__.endswith("Experts") for m in model.modules()):
        # transformers' default "grouped_mm" experts fall back, for fp32 weights on CUDA, to a loop over
        # offsets read on the host: a CUDA graph cannot capture that (GraniteMoeHybrid, NemotronH and Kimi
        # Linear decoded eagerly on the H200). "batched_mm" gathers each token's expert weights on the device.
        model.set_experts_implementation("batched_mm")
    if long_memory:
        if not set(STATE_KINDS) & set(getattr(model.config, "layer_types", None) or ()):
            raise InvalidArgumentError("long_memory", "False for a model without recurrent states", name)
        mamba2 = any(hasattr(m, "ssm_state_size") for m in model.modules())
        scale = MAMBA2_CONV_SCALE if mamba2 else LFM2_CONV_SCALE if name == "lfm2" else 1.0
        _make_long_memory(model, seed, conv_scale=scale)
    return model.to(device=dev.resolve(device), dtype=dtype)


def weights_id(model) -> str:
    """The model class and a SHA-256 of its weights: T3's default model id, so another model's (or another
    seed's) entries are never served."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return f"{type(model).__name__}/weights-sha256:{h.hexdigest()[:32]}"


def layer_kinds(config) -> tuple[str, ...]:
    """The decoder's kind per layer, checked to be kinds the adapters move.

    ``config.layer_types`` where the config has them; otherwise as transformers' own cache infers them
    (``cache_utils.get_layer_types_and_kwargs``): every layer sliding when the config sets a
    ``sliding_window`` (Mistral), full otherwise. ``mlp`` / ``moe`` layers hold no cache (``NO_CACHE``);
    ``conv`` layers (Lfm2) a conv window only.
    """
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    n = cfg.num_hidden_layers
    kinds = getattr(cfg, "layer_types", None)
    if kinds is None:
        kinds = [SLIDING if getattr(cfg, "sliding_window", None) is not None else FULL] * n
    kinds = tuple(kinds)
    if len(kinds) != n:
        raise InvalidArgumentError("model", "a config with layer_types (one per layer)", kinds)
    known = (LINEAR, FULL, SLIDING, HYBRID, CONV, *NO_CACHE)
    bad = sorted(set(kinds) - set(known))
    if bad:
        raise InvalidArgumentError("model", f"layer types in {known}", bad)
    return kinds
