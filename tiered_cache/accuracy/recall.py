"""Multi-query associative recall, where the answer lives only in the recurrent state, and the tiny
trained hybrids that solve it.

A sequence (``RecallTask``, 256 tokens by default)::

    | BOS | (k1,v1) (k2,v2) ... (kP,vP) | gap: G filler tokens | kπ1 vπ1 kπ2 vπ2 ... kπP vπP |
      0     1 ...................... P    P+1 ......... P+G     q0 = 1+P+G ......... q0+2P-1

the pairs first, one token each (token ``(k, v)`` of ``num_keys x num_values``), then ``gap`` filler
tokens, then every key once more in a random order as a key token, each followed by its value token;
the model is scored (and trained) on predicting each value at its query key. A pair as one token
keeps the memory task (store P bindings, answer P queries after a long gap) and drops the
previous-token shift a two-token pair needs first, which tiny models learn only after a long plateau
(two-token pairs sat at chance for 700 steps on the H200). Keys, values, pairs and fillers are
disjoint token ranges, so a guess without the pairs is right with probability ``1 / num_values``
(chance).

Why only the state can answer: the attention layers attend over a sliding window of ``window``
tokens (``window_sdpa``, a registered ``transformers`` attention function: SDPA with the keys more
than ``window - 1`` positions behind a query masked out) and ``gap >= window``, so from any query the
pairs are out of every attention layer's reach. The full KV is still cached and moved by the tiers as
for any full-attention layer (the layer kind stays ``full_attention``); only what the model reads
changes. The window is counted in key indices, which are positions for a batch-1 cache from 0 and for
the left-padded batches of ``runner.forward.decode_batch`` (not for the graph decoder's static buffers,
which refuses any attention but SDPA).

Models (``MODELS``): a Qwen3-Next-style gated delta-net + attention hybrid and a Bamba (Mamba2 +
attention) hybrid, hidden 128, 4 layers (3 recurrent, then attention), under 1 M parameters. Their
weights (``weights/<name>.safetensors``, fp32) and a JSON of the model keywords, the task, the training
config, seed and the accuracy reached (``weights/<name>.json``) come from ``tiered_cache.accuracy.train``;
``load`` builds them from the repository, never from a model hub.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch

from tiered_cache import device as dev
from tiered_cache.errors import InvalidArgumentError

WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
ATTN = "recall_window_sdpa"  # the attention implementation name the models are built with
BOS = 1


@dataclass(frozen=True)
class RecallTask:
    """Sizes of the recall task (see the module docstring). ``window``: the attention layers' sliding
    window, at most ``gap`` so no query reaches a pair. Token ids: values from 3, then query keys, then
    the ``num_keys * num_values`` pair tokens, then fillers up to ``vocab``."""

    pairs: int = 12
    gap: int = 219
    window: int = 32
    num_keys: int = 16
    num_values: int = 12
    vocab: int = 256

    def __post_init__(self) -> None:
        if self.window > self.gap:
            raise InvalidArgumentError("window", f"<= gap ({self.gap}): a query must not reach a pair", self.window)
        if not 1 <= self.pairs <= self.num_keys:
            raise InvalidArgumentError("pairs", f"1..{self.num_keys} (distinct keys)", self.pairs)
        if self.filler_start >= self.vocab:
            raise InvalidArgumentError("vocab", f"> {self.filler_start} (room for fillers)", self.vocab)

    @property
    def key_start(self) -> int:
        return 3 + self.num_values

    @property
    def pair_start(self) -> int:
        return self.key_start + self.num_keys

    @property
    def filler_start(self) -> int:
        return self.pair_start + self.num_keys * self.num_values

    @property
    def query_start(self) -> int:
        """q0: the position of the first query key (the prefix before it holds BOS, pairs and gap)."""
        return 1 + self.pairs + self.gap

    @property
    def length(self) -> int:
        return self.query_start + 2 * self.pairs

    @property
    def chance(self) -> float:
        return 1.0 / self.num_values

    def answer_positions(self) -> torch.Tensor:
        """Positions whose next-token logits are scored: the query keys (``q0, q0 + 2, ...``)."""
        return torch.arange(self.query_start, self.length, 2)

    def sample(self, n: int, seed: int, pairs: Optional[int] = None,
               gap: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``n`` sequences -> ``(ids [n, length] int64, answers [n, pairs] int64)``, the same for the same seed;
        ``answers[:, j]`` is the token that should follow the ``j``-th query key. ``pairs`` / ``gap``: fewer
        (training's curriculum), else the task's."""
        g = torch.Generator().manual_seed(seed)
        p = self.pairs if pairs is None else pairs
        keys = torch.argsort(torch.rand(n, self.num_keys, generator=g), dim=1)[:, :p]
        vals = torch.randint(0, self.num_values, (n, p), generator=g)
        fill = torch.randint(self.filler_start, self.vocab, (n, self.gap if gap is None else gap), generator=g)
        order = torch.argsort(torch.rand(n, p, generator=g), dim=1)
        qk, qv = keys.gather(1, order) + self.key_start, vals.gather(1, order) + 3
        ids = torch.cat([torch.full((n, 1), BOS), self.pair_start + keys * self.num_values + vals, fill,
                         torch.stack([qk, qv], 2).reshape(n, -1)], dim=1)
        return ids, qv


TASK = RecallTask()


def window_sdpa(module, query, key, value, attention_mask, **kwargs):
    """SDPA over the last ``module.config.recall_window`` keys of each query (the query's own included).

    ``query [B, H, Tq, D]`` are the last ``Tq`` of ``key [B, Hkv, Tk, D]``'s positions (a prefill chunk or
    a decode token on a cache from position 0, or a left-padded batch): query ``i`` sits at key index
    ``Tk - Tq + i``. The window is and-ed into the mask transformers built (causal, padding)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tq, tk = query.shape[-2], key.shape[-2]
    qi = torch.arange(tk - tq, tk, device=query.device)[:, None]
    ki = torch.arange(tk, device=query.device)[None, :]
    keep = (ki <= qi) & (ki > qi - module.config.recall_window)
    if attention_mask is None:
        mask = keep[None, None]
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask & keep
    else:
        mask = attention_mask.masked_fill(~keep, float("-inf"))
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)


def register_window_attention() -> None:
    """Make ``ATTN`` a name transformers resolves: the attention function above, and SDPA's mask builder."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN, window_sdpa)
    AttentionMaskInterface.register(ATTN, sdpa_mask)


# name -> (config class, model class, config keywords). Hidden 128, vocab 256, 3 recurrent layers then a
# windowed attention layer; dense MLPs.
_COMMON: dict[str, Any] = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=0,
                               bos_token_id=BOS, eos_token_id=2)
MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # gated delta-net x3 + gated attention (Qwen3-Next's 3:1 pattern); state [H_v 2, d_k 64, d_v 128] per
    # layer: d_v as Qwen3-Next-80B's, so a per-(head, k-channel) int8 scale spans 128 values as there
    "qwen3_next_recall": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        layer_types=["linear_attention"] * 3 + ["full_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=64, linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        mlp_only_layers=[0, 1, 2, 3])),
    # Mamba2 x3 + attention (Bamba); state [heads 4, head_dim (d_v) 64, d_state 64] per layer
    "bamba_recall": ("BambaConfig", "BambaForCausalLM", dict(
        attn_layer_indices=[3], mamba_n_heads=4, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64,
        mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=64)),
}


def build(name: str, seed: int = 0, task: RecallTask = TASK):
    """A freshly initialized model ``name`` (a key of ``MODELS``), seeded, fp32 on the CPU, attending over
    ``task.window`` tokens."""
    if name not in MODELS:
        raise InvalidArgumentError("name", f"one of {sorted(MODELS)}", name)
    import transformers

    register_window_attention()
    cfg_name, model_name, kw = MODELS[name]
    config = getattr(transformers, cfg_name)(**dict(_COMMON, **kw))
    config.recall_window = task.window
    config._attn_implementation = ATTN
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
        _init_for_memory(model)
    return model


def _init_for_memory(model) -> None:
    """Start with slow decay, so a gradient reaches the recall circuit at all.

    transformers' inits forget within tokens: gated delta-net draws ``A`` from [0.01, 16] (decay up to
    e^-20 a token with ``dt_bias`` 1), Bamba sets ``A = 1..H`` and ``dt`` about 1.3 (e^-1.3..-5 a token).
    Across a 127-token gap no trace of a pair survives, the loss sits at ln(num_values) and nothing
    learns (seen: 700 steps at chance). Here: gated delta-net ``A`` log-uniform in [1e-3, 1e-2]
    (e^-0.0013..-0.013 a token); Mamba2 ``A`` in [1, 4] with ``dt`` about 0.01 (``dt_bias`` the inverse
    softplus of 0.01; e^-0.01..-0.04 a token)."""
    with torch.no_grad():
        for mod in model.modules():
            if not hasattr(mod, "A_log") or not hasattr(mod, "dt_bias"):
                continue
            n = mod.A_log.shape[0]
            if hasattr(mod, "ssm_state_size"):  # Mamba2
                mod.A_log.copy_(torch.log(torch.linspace(1.0, 4.0, n)))
                mod.dt_bias.fill_(math.log(math.expm1(0.01)))
            else:  # gated delta-net
                mod.A_log.copy_(torch.linspace(math.log(1e-3), math.log(1e-2), n))


def paths(name: str, root: Optional[str] = None) -> tuple[str, str]:
    root = WEIGHTS_DIR if root is None else root
    return os.path.join(root, f"{name}.safetensors"), os.path.join(root, f"{name}.json")


def save(model, name: str, meta: dict, root: Optional[str] = None) -> None:
    """Weights as safetensors (no pickle) and ``meta`` (training config, seed, accuracy) as JSON."""
    from safetensors.torch import save_file

    wpath, jpath = paths(name, root)
    os.makedirs(os.path.dirname(wpath), exist_ok=True)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}, wpath)
    with open(jpath, "w") as f:
        json.dump(dict(meta, model=name, model_keywords=dict(_COMMON, **MODELS[name][2])), f, indent=1)
        f.write("\n")


def load(name: str, device: dev.DeviceLike = None, dtype: torch.dtype = torch.float32, root: Optional[str] = None):
    """The trained model ``name`` from the repository's weights (every tensor must be there), eval mode."""
    from safetensors.torch import load_file

    wpath, jpath = paths(name, root)
    with open(jpath) as f:
        meta = json.load(f)
    task = RecallTask(**meta["task"])
    model = build(name, seed=0, task=task)
    model.load_state_dict(load_file(wpath), strict=True)
    return model.to(device=dev.resolve(device), dtype=dtype).eval()


def meta_of(name: str, root: Optional[str] = None) -> dict:
    with open(paths(name, root)[1]) as f:
        return json.load(f)


def task_of(name: str, root: Optional[str] = None) -> RecallTask:
    return RecallTask(**meta_of(name, root)["task"])


def task_dict(task: RecallTask) -> dict:
    return asdict(task)


@torch.no_grad()
def recall_accuracy(model, task: RecallTask, ids: torch.Tensor, answers: torch.Tensor,
                    batch: int = 64) -> tuple[int, int]:
    """(correct, scored) over full forwards of ``ids`` (no cache): the argmax at each query key."""
    pos = task.answer_positions().to(model.device)
    correct = 0
    for i in range(0, ids.shape[0], batch):
        logits = model(input_ids=ids[i:i + batch].to(model.device)).logits
        correct += int((logits[:, pos].argmax(-1) == answers[i:i + batch].to(model.device)).sum())
    return correct, answers.numel()


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of ``k`` successes in ``n`` trials."""
    if n <= 0:
        raise InvalidArgumentError("n", "> 0 trials", n)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return max(0.0, c - h), min(1.0, c + h)
