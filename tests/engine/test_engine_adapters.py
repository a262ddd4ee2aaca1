"""Model adapters: a sequence run whole equals the same run resumed from the pools.

Split-and-resume (STYLE 13): run ``[0, n)`` whole; run ``[0, s)``, export its KV and state into a real
``UnifiedPool`` (and, for states, through the T1 checkpoint pool), rebuild a fresh cache from the
pool alone and continue ``[s, n)`` with explicit positions: chunked, then token by token, then a second
export/rebuild hop, as a multi-turn engine does. Every test also shows it can fail: the same check on
a corrupted state or KV breaks it.

Tiny fp32 models on the CPU (a few seconds in all); the split points are not page-aligned on purpose.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiered_cache.engine import (  # noqa: E402
    HybridCacheAdapter,
    decode_batch,
    forward_chunk,
    new_cache,
    spec_for,
    tiny_qwen3_next,
    tiny_swa_model,
)
from tiered_cache.engine.models import KV_KINDS, RECURRENT_KINDS, STATE_KINDS, layer_kinds, tiny_family  # noqa: E402
from tiered_cache.errors import InvalidArgumentError  # noqa: E402
from tiered_cache.tiers.checkpoint_pool import Int8CheckpointPool  # noqa: E402
from tiered_cache.tiers.unified_pool import UnifiedPool  # noqa: E402


def _pool(specs, full_slots: int, high_slots: int, device: str = "cpu") -> UnifiedPool:
    """A real T0 for the model: full KV (``full_slots`` pages) + its states or SWA KV (``high_slots``)."""
    high = specs.state if specs.state is not None else specs.swa
    return UnifiedPool(specs.full, high, low_slots=full_slots, high_slots=high_slots, page_size=specs.page_size,
                       device=device)


N, SPLIT, HOP = 56, 21, 43  # sequence length, first resume point, second resume point
DECODE = 4  # tokens run one by one after the chunked continuation (the single-token kernels)
PAGE = 4
# Resumed vs whole, fp32. A resumed run is bit-identical to the same chunks continued on the original
# cache (asserted below), so what is left is the delta rule's own rounding: transformers computes it
# in fp32 whatever the model dtype, in 64-token chunks counted from each call's start, so other split
# points round differently. Measured: plain 2e-7; long-memory (weights x4) 1.35e-5, fp64 weights 6e-6.
ATOL = {False: 1e-5, True: 5e-5}
# int8 state on the long-memory model, max |logit| difference over the continuation. Measured on
# seeds 0..2 (24 tokens after a 32-token prefix): 0.045-0.087, here 0.086; a zeroed state: 3.0-3.6.
INT8_DRIFT_BOUND = 0.25


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (N,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen():
    return tiny_qwen3_next(seed=0, device="cpu")


@pytest.fixture(scope="module")
def swa():
    return tiny_swa_model(seed=0, device="cpu")


def _whole(model, ids):
    logits, _ = forward_chunk(model, new_cache(model), ids, 0)
    return logits


def _in_memory(model, ids):
    """The resumed runs' chunk schedule on one cache that never leaves the model: their reference."""
    cache = new_cache(model)
    forward_chunk(model, cache, ids[:SPLIT], 0)
    return torch.cat([_continue(model, cache, ids, SPLIT, HOP), _continue(model, cache, ids, HOP, N)])


def _continue(model, cache, ids, start, end):
    """Chunk ``[start, end - DECODE)`` then ``DECODE`` single tokens; logits of ``[start, end)``."""
    mid = end - DECODE
    out = [forward_chunk(model, cache, ids[start:mid], start)[0]]
    for p in range(mid, end):
        out.append(forward_chunk(model, cache, ids[p:p + 1], p)[0])
    return torch.cat(out)


class Hybrid:
    """One request of a Qwen3-Next-style model over a real UnifiedPool (full KV + states)."""

    def __init__(self, model, poison, codec: str = "", page_size: int = PAGE):
        self.model, self.poison = model, poison
        self.specs = spec_for(model, page_size)
        self.ad = HybridCacheAdapter(model, self.specs)
        self.pool = _pool(self.specs, full_slots=N // page_size + 2, high_slots=4, device="cpu")
        self.full, self.state = self.pool.side("full"), self.pool.side("mamba")
        self.tokens = self.full.alloc(-(-N // page_size) * page_size)
        self.t1 = Int8CheckpointPool(self.specs.state, 2, device="cpu", codec=codec) if codec else None

    def save(self, cache, start: int, end: int) -> torch.Tensor:
        """KV of ``[start, end)`` into the pages, the state into a T0 slot (and T1): returns the slot to
        resume from. The T1 path frees the T0 slot and loads into a fresh one whose row held other data."""
        self.ad.export_kv(cache, self.full, self.tokens, start, end)
        slot = self.state.alloc(1)
        self.ad.export_state(cache, self.state, slot)
        if self.t1 is None:
            return slot
        ckpt = self.t1.alloc(1)
        self.t1.store_from_active(self.state, slot, ckpt)
        temporal = self.state.temporal_view_all()
        temporal[:, self.state.translate(slot)] = self.poison.value(temporal.dtype)  # must not be read again
        self.state.free(slot)
        fresh = self.state.alloc(1)
        self.t1.load_to_active(ckpt, self.state, fresh)
        self.t1.free(ckpt)
        return fresh

    def resume(self, slot, n_tokens: int):
        return self.ad.build_cache(self.full, self.tokens, self.state, slot, n_tokens=n_tokens)

    def zero(self, slot) -> None:
        row = self.state.translate(slot)
        self.state.temporal_view_all()[:, row] = 0
        self.state.conv_view_all(0)[:, row] = 0

    def split_run(self, ids, corrupt: bool = False) -> torch.Tensor:
        """Logits of ``[SPLIT, N)`` resumed twice from the pool (at SPLIT and HOP)."""
        cache = new_cache(self.model)
        forward_chunk(self.model, cache, ids[:SPLIT], 0)
        slot = self.save(cache, 0, SPLIT)
        if corrupt:
            self.zero(slot)
        cache = self.resume(slot, SPLIT)
        first = _continue(self.model, cache, ids, SPLIT, HOP)
        slot2 = self.save(cache, SPLIT, HOP)  # only the new tokens' KV: the first ones are in the pages
        second = _continue(self.model, self.resume(slot2, HOP), ids, HOP, N)
        return torch.cat([first, second])


# ------------------------------------------------------------------------------------- specs
def test_spec_for_reads_the_cache_layers(qwen, swa):
    s = spec_for(qwen, PAGE)
    assert s.linear_layers == (0, 1, 2, 4, 5, 6) and s.full_layers == (3, 7) and s.swa is None
    # transformers' Qwen3-Next state is [H_v, d_k, d_v]: the value axis (the int8 scale's) is 2.
    assert s.state.temporal_shape == (4, 16, 32) and s.state.value_axis == 2 and s.state.d_v == 32
    assert s.state.conv_shapes == ((2 * 2 * 16 + 4 * 32, 4),)  # [conv_dim, kernel] in 5.17 and 5.24
    assert s.state.temporal_dtype == torch.float32
    assert (s.full.num_layers, s.full.kv_heads, s.full.head_dim, s.full.window) == (2, 2, 16, 0)
    w = spec_for(swa, PAGE)
    assert w.full_layers == (2, 5) and w.swa_layers == (0, 1, 3, 4) and w.state is None
    assert w.swa.window == 7  # sliding_window 8: a query sees itself and the 7 before it


# --------------------------------------------------------------------------- split and resume
@pytest.mark.parametrize("long_memory", [False, True], ids=["plain", "long-memory"])
@pytest.mark.parametrize("codec", ["", "lossless"], ids=["T0", "T0-T1-T0"])
def test_qwen3_next_split_resume_equals_whole(poison, qwen, qwen_long, long_memory, codec):
    model = qwen_long if long_memory else qwen
    ids = _ids()
    whole = _whole(model, ids)[SPLIT:]
    got = Hybrid(model, poison, codec).split_run(ids)
    assert got.shape == whole.shape
    assert torch.equal(got, _in_memory(model, ids))  # the pool (and T1) moved every byte unchanged
    assert torch.allclose(got, whole, rtol=0, atol=ATOL[long_memory]), (got - whole).abs().max()
    # The check can fail: resuming from a zeroed state moves the logits far past the tolerance.
    broken = Hybrid(model, poison, codec).split_run(ids, corrupt=True)
    assert (broken - whole).abs().max() > 1000 * ATOL[long_memory]


def test_qwen3_next_int8_long_memory_drift_is_bounded(poison, qwen_long):
    ids = _ids()
    whole = _whole(qwen_long, ids)[SPLIT:]
    got = Hybrid(qwen_long, poison, "int8").split_run(ids)
    drift = (got - whole).abs().max().item()
    top1 = (got.argmax(-1) == whole.argmax(-1)).float().mean().item()
    zeroed = (Hybrid(qwen_long, poison, "int8").split_run(ids, corrupt=True) - whole).abs().max().item()
    print(f"int8 drift {drift:.4f} (bound {INT8_DRIFT_BOUND}), top-1 {top1:.3f}, zeroed state {zeroed:.3f}")
    # Top-1 is kept except at near-ties: where the whole run's own top-2 margin is under twice the
    # drift, a flip is rounding, not a lost state (here 1 of 35, margin 0.0019).
    top2 = whole.topk(2, dim=-1).values
    flipped = got.argmax(-1) != whole.argmax(-1)
    assert (top2[flipped, 0] - top2[flipped, 1] < 2 * drift).all()
    assert top1 >= 0.95
    assert 0 < drift <= INT8_DRIFT_BOUND  # 0 would mean the int8 path was not taken
    assert zeroed > INT8_DRIFT_BOUND  # the bound is tight enough to catch a lost state


def test_page_size_one_and_state_overwrite_in_place(poison, qwen):
    """page_size 1, and import_state into a cache whose linear layers already hold a (wrong) state."""
    ids = _ids(1)
    whole = _whole(qwen, ids)[SPLIT:]
    h = Hybrid(qwen, poison, page_size=1)
    cache = new_cache(qwen)
    forward_chunk(qwen, cache, ids[:SPLIT], 0)
    slot = h.save(cache, 0, SPLIT)
    stale = new_cache(qwen)
    forward_chunk(qwen, stale, ids[SPLIT:2 * SPLIT], 0)  # every layer initialised, with other data
    for i in h.specs.full_layers:  # empty KV layers (5.17's reset zeroes them rather than dropping them)
        stale.layers[i] = type(stale.layers[i])()
    cache = h.ad.build_cache(h.full, h.tokens, h.state, slot, n_tokens=SPLIT)
    h.ad.import_state(h.state, slot, stale)
    h.ad.import_kv(stale, h.full, h.tokens, SPLIT)
    assert torch.allclose(_continue(qwen, stale, ids, SPLIT, N), whole, rtol=0, atol=ATOL[False])
    assert torch.allclose(_continue(qwen, cache, ids, SPLIT, N), whole, rtol=0, atol=ATOL[False])


def test_swa_split_resume_equals_whole(swa):
    """Gemma3 pattern (S, S, F) x2: full KV of every token; SWA KV only of the last window before a resume."""
    ids = _ids()
    whole = _whole(swa, ids)[SPLIT:]
    specs = spec_for(swa, PAGE)
    ad = HybridCacheAdapter(swa, specs)
    window = specs.swa.window

    def run(corrupt_oldest: bool) -> torch.Tensor:
        pool = _pool(specs, full_slots=N // PAGE + 2, high_slots=N // PAGE + 2, device="cpu")
        full, side = pool.side("full"), pool.side("swa")
        tok, stok = full.alloc(N), side.alloc(N)
        cache = new_cache(swa)
        forward_chunk(swa, cache, ids[:SPLIT], 0)
        assert ad.export_kv(cache, full, tok, 0, SPLIT) == (0, SPLIT)
        # The sliding layers hold only the last `window` positions: only those reach the pages.
        assert ad.export_kv(cache, side, stok, 0, SPLIT) == (SPLIT - window, SPLIT)
        if corrupt_oldest:  # the oldest position a resume at SPLIT still attends to
            p = side.translate(stok[SPLIT - window: SPLIT - window + 1])
            side.k_view_all()[:, p // PAGE, p % PAGE] += 1.0
        cache = ad.build_cache(full, tok, swa_side=side, swa_token_ids=stok, n_tokens=SPLIT)
        first = _continue(swa, cache, ids, SPLIT, HOP)
        ad.export_kv(cache, full, tok, SPLIT, HOP)
        assert ad.export_kv(cache, side, stok, SPLIT, HOP) == (HOP - window, HOP)
        cache = ad.build_cache(full, tok, swa_side=side, swa_token_ids=stok, n_tokens=HOP)
        return torch.cat([first, _continue(swa, cache, ids, HOP, N)])

    got = run(False)
    assert torch.allclose(got, whole, rtol=0, atol=ATOL[False]), (got - whole).abs().max()
    assert (run(True) - whole).abs().max() > 1000 * ATOL[False]  # the window is not over-generous


@pytest.mark.parametrize("family", ["qwen3_next", "swa"])
def test_bf16_resume_is_bit_identical_to_in_memory(family):
    """bf16 model: KV and conv windows travel as bf16, the recurrent state as fp32 (what the cache
    holds); a resumed run equals the same chunks on the original cache bit for bit."""
    build = tiny_qwen3_next if family == "qwen3_next" else tiny_swa_model
    model = build(seed=0, dtype=torch.bfloat16, device="cpu")
    specs = spec_for(model, PAGE)
    assert specs.full.dtype == torch.bfloat16
    if specs.state is not None:
        assert (specs.state.temporal_dtype, specs.state.conv_dtype) == (torch.float32, torch.bfloat16)
    ad = HybridCacheAdapter(model, specs)
    ids, end = _ids(2), SPLIT + 2 * DECODE
    cache = new_cache(model)
    forward_chunk(model, cache, ids[:SPLIT], 0)
    pool = _pool(specs, full_slots=N // PAGE + 2, high_slots=N // PAGE + 2, device="cpu")
    full, high = pool.sides
    tok, high_ids = full.alloc(N), high.alloc(N if specs.swa is not None else 1)
    ad.export_kv(cache, full, tok, 0, SPLIT)
    if specs.swa is not None:
        ad.export_kv(cache, high, high_ids, 0, SPLIT)
        resumed = ad.build_cache(full, tok, swa_side=high, swa_token_ids=high_ids, n_tokens=SPLIT)
    else:
        ad.export_state(cache, high, high_ids)
        resumed = ad.build_cache(full, tok, high, high_ids, n_tokens=SPLIT)
    assert torch.equal(_continue(model, resumed, ids, SPLIT, end), _continue(model, cache, ids, SPLIT, end))


# ------------------------------------------------------------------------------------- misuse
def test_misuse_is_refused_before_anything_changes(poison, qwen):
    h = Hybrid(qwen, poison)
    ids = _ids()
    cache = new_cache(qwen)
    with pytest.raises(InvalidArgumentError, match="linear layer 0"):
        h.ad.export_state(cache, h.state, h.state.alloc(1))  # no state yet
    forward_chunk(qwen, cache, ids[:SPLIT], 0)
    with pytest.raises(InvalidArgumentError, match="start_pos"):
        forward_chunk(qwen, cache, ids[SPLIT:], SPLIT - 1)
    with pytest.raises(InvalidArgumentError, match="end"):
        h.ad.export_kv(cache, h.full, h.tokens, 0, SPLIT + 1)
    with pytest.raises(InvalidArgumentError, match="side"):
        h.ad.export_kv(cache, h.state, h.tokens, 0, SPLIT)
    before = h.pool.raw.clone()
    slot = h.state.alloc(1)
    h.state.free(slot)
    with pytest.raises(InvalidArgumentError, match="slot"):
        h.ad.export_state(cache, h.state, slot)  # freed: translate maps it to -1
    assert torch.equal(h.pool.raw, before)
    # KV ids given on the host are checked on the allocator's host table: a freed page's id (it would
    # translate to a negative row) and an id past the table are refused, and no page is written
    freed = h.full.alloc(PAGE)
    h.full.free(freed)
    for bad in (torch.cat([h.tokens[:SPLIT - 1], freed[:1]]), [10 ** 9] * SPLIT, h.tokens[:SPLIT].tolist()[:-1] + [-1]):
        with pytest.raises(InvalidArgumentError, match="token_ids"):
            h.ad.export_kv(cache, h.full, bad, 0, SPLIT)
    assert torch.equal(h.pool.raw, before)
    with pytest.raises(InvalidArgumentError, match="state_side"):
        h.ad.build_cache(h.full, h.tokens, n_tokens=SPLIT)
    kv_only = new_cache(qwen)
    h.ad.export_kv(cache, h.full, h.tokens, 0, SPLIT)
    h.ad.import_kv(kv_only, h.full, h.tokens, SPLIT)
    with pytest.raises(InvalidArgumentError, match="linear layer"):
        forward_chunk(qwen, kv_only, ids[SPLIT:], SPLIT)  # would silently restart the recurrence


# ------------------------------------------------------------------------------ batched decode
# Batched vs one at a time, fp32: the same math over a left-padded batch (padding masked out), summed
# in another order. Measured on the long-memory model: <= 4.1e-6 over 4 steps.
BATCH_ATOL = 5e-5


@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_decode_batch_equals_one_at_a_time(qwen_long, family):
    """Three requests of different lengths decode 4 tokens together: each step's logits, and the
    KV, conv windows and recurrent states left in each cache, match decoding each alone. Each layer is
    compared by its kind, as the package picks them: NemotronH's MLP and MoE layers hold nothing (transformers
    5.17 gives them an unfilled linear layer object, which a ``hasattr`` took for a state layer)."""
    m = qwen_long if family == "qwen3_next" else tiny_family(family, seed=0, long_memory=True, device="cpu")
    lens = [5, 17, 9]
    prompts = [_ids(s)[:n] for s, n in zip((1, 2, 3), lens)]
    alone, together = [], []
    for p in prompts:
        for out in (alone, together):
            c = new_cache(m)
            forward_chunk(m, c, p, 0)
            out.append(c)
    toks = [int(t) for t in torch.randint(3, 256, (3,), generator=torch.Generator().manual_seed(9))]
    for _ in range(4):
        ref = [forward_chunk(m, c, torch.tensor([t]), n)[0][-1] for c, t, n in zip(alone, toks, lens)]
        got = decode_batch(m, together, toks, lens)
        assert got.shape == (3, m.config.vocab_size)
        for r, g in zip(ref, got):
            assert (r - g).abs().max().item() < BATCH_ATOL
            assert int(r.argmax()) == int(g.argmax())
        toks = [int(r.argmax()) for r in ref]
        lens = [n + 1 for n in lens]
    kinds = layer_kinds(m.config)
    assert any(k in STATE_KINDS for k in kinds) and any(k in KV_KINDS for k in kinds)
    for a, b in zip(alone, together):
        assert b.get_seq_length() == a.get_seq_length()
        for la, lb, kind in zip(a.layers, b.layers, kinds, strict=True):
            if kind in STATE_KINDS:
                assert torch.allclose(la.conv_states[0][..., -lb.conv_states[0].shape[-1]:], lb.conv_states[0],
                                      atol=BATCH_ATOL)
            if kind in RECURRENT_KINDS:
                assert torch.allclose(la.recurrent_states[0], lb.recurrent_states[0], atol=BATCH_ATOL)
            if kind in KV_KINDS:
                assert torch.allclose(la.keys, lb.keys, atol=BATCH_ATOL)
                assert torch.allclose(la.values, lb.values, atol=BATCH_ATOL)


def test_decode_batch_refuses_bad_input(qwen, swa):
    c = new_cache(qwen)
    forward_chunk(qwen, c, _ids()[:6], 0)
    seen = c.get_seq_length()
    with pytest.raises(InvalidArgumentError, match="positions"):
        decode_batch(qwen, [c], [5], [7])  # the cache holds 6 tokens
    with pytest.raises(InvalidArgumentError, match="tokens, positions"):
        decode_batch(qwen, [c], [5, 6], [6])
    with pytest.raises(InvalidArgumentError, match="tokens, positions"):
        decode_batch(qwen, [], [], [])
    assert c.get_seq_length() == seen  # nothing changed
    s = new_cache(swa)
    forward_chunk(swa, s, _ids()[:6], 0)
    with pytest.raises(InvalidArgumentError, match="model"):
        decode_batch(swa, [s], [5], [6])
