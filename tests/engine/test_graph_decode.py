"""The static-buffer decoder (``engine.runner.graph_decode``): on CPU its eager step against one-request
forwards; on the GPU its CUDA-graph replays against the same."""

from __future__ import annotations

import pytest
import torch

from tiered_cache.engine.models import (
    KV_KINDS,
    RECURRENT_KINDS,
    STATE_KINDS,
    layer_kinds,
    tiny_family,
    tiny_qwen3_next,
    tiny_swa_model,
)
from tiered_cache.engine.runner import graph_decode
from tiered_cache.engine.runner.forward import conv_width, forward_chunk, new_cache
from tiered_cache.engine.runner.graph_decode import GraphDecoder, gqa_sdpa
from tiered_cache.errors import InvalidArgumentError

# Measured on the long-memory model (CPU, fp32): <= 3.5e-6 over 5 steps, as decode_batch (summation order).
ATOL = 2e-5


def prefilled(model, lens, device="cpu"):
    caches = []
    for b, n in enumerate(lens):
        c = new_cache(model)
        g = torch.Generator().manual_seed(100 + b)
        forward_chunk(model, c, torch.randint(3, 200, (n,), generator=g).to(device), 0)
        caches.append(c)
    return caches


def run_both(model, gd, lens, steps, device="cpu", poison=False):
    ref, got = prefilled(model, lens, device), prefilled(model, lens, device)
    pos = list(lens)
    worst = 0.0
    for s in range(steps):
        toks = [(7 * s + 11 * b) % 200 + 3 for b in range(len(lens))]
        want = torch.stack([forward_chunk(model, c, torch.tensor([t], device=device), p)[0][-1]
                            for c, t, p in zip(ref, toks, pos)])
        out = gd.step(got, toks, pos)
        assert out.shape == want.shape and torch.isfinite(out).all()
        worst = max(worst, (out - want).abs().max().item())
        if poison and s == 0:  # what the buffers hold beyond each request's positions must not matter
            for kind in ("keys", "values"):
                for t in gd.buf[kind].values():
                    for b, p in enumerate(pos):
                        junk = torch.randn(t[b, :, p + 1:].shape, generator=torch.Generator().manual_seed(9))
                        t[b, :, p + 1:] = junk.to(t) * 100
        pos = [p + 1 for p in pos]
    return ref, got, worst


def assert_same_caches(model, ref, got):
    """Every layer's cache in ``got`` as in ``ref``, chosen by the config's layer kinds as the package chooses
    them (under transformers 5.17 a NemotronH MLP or MoE layer gets an unfilled linear layer object, which a
    ``hasattr`` takes for a state layer): conv windows, recurrent states, keys and values (a hybrid layer both)."""
    kinds = layer_kinds(model.config)
    assert any(k in STATE_KINDS for k in kinds) and any(k in KV_KINDS for k in kinds)
    for a, b in zip(ref, got, strict=True):
        w = conv_width(a, kinds)
        for la, lb, kind in zip(a.layers, b.layers, kinds, strict=True):
            if kind in STATE_KINDS:
                torch.testing.assert_close(lb.conv_states[0][..., -w:], la.conv_states[0][..., -w:], atol=ATOL, rtol=0)
            if kind in RECURRENT_KINDS:
                torch.testing.assert_close(lb.recurrent_states[0], la.recurrent_states[0], atol=ATOL, rtol=0)
            if kind in KV_KINDS:
                assert lb.keys.shape == la.keys.shape
                torch.testing.assert_close(lb.keys, la.keys, atol=ATOL, rtol=0)
                torch.testing.assert_close(lb.values, la.values, atol=ATOL, rtol=0)


@pytest.mark.parametrize("lens", [[37, 20, 51], [9]], ids=["three", "one"])
def test_static_step_equals_one_request_forwards(qwen_long, lens):
    """Logits, and every cache afterwards (keys, values, conv windows, states), as one-request forwards
    give them; a bucket boundary is crossed (len_bucket 16), and garbage in the buffers beyond each
    request's positions is masked out."""
    gd = GraphDecoder(qwen_long, max_batch=4, len_bucket=16, use_graphs=False)
    ref, got, worst = run_both(qwen_long, gd, lens, steps=6, poison=True)
    assert worst < ATOL, worst
    assert_same_caches(qwen_long, ref, got)
    assert gd.stats["steps"] == 6 and gd.capacity % 16 == 0


def test_static_step_on_a_model_with_layers_that_hold_nothing():
    """NemotronH (Mamba2, attention, MLP and MoE layers): logits and every cache as one-request forwards give
    them, each layer compared by its kind; its MLP and MoE layers hold nothing (transformers 5.17 gives them an
    unfilled linear layer object: compared as state layers by ``hasattr``, their empty states failed the test)."""
    model = tiny_family("nemotron_h", seed=0, long_memory=True, device="cpu")
    kinds = layer_kinds(model.config)
    assert {"mlp", "moe"} <= set(kinds)
    gd = GraphDecoder(model, max_batch=4, len_bucket=16, use_graphs=False)
    ref, got, worst = run_both(model, gd, [13, 30, 6], steps=4, poison=True)
    assert worst < ATOL, worst
    assert_same_caches(model, ref, got)


def _gqa_reference(q, k, v, mask, scale):
    """Plain attention with each key/value head repeated for its query heads (what repeat_kv does)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return (s.softmax(-1) @ v.double()).transpose(1, 2)


@pytest.mark.parametrize("q_len", [1, 3])
def test_gqa_sdpa_equals_repeated_heads_under_a_mask(poison, q_len):
    """Packed query heads read each key/value head once; the result is attention with the heads repeated,
    under a per-request mask (positions past each request's length masked, garbage there). The output
    starts NaN-poisoned."""
    g = torch.Generator().manual_seed(1)
    b, h, kvh, t, d = 3, 8, 2, 40, 16
    q, k, v = (torch.randn(s, generator=g) for s in ((b, h, q_len, d), (b, kvh, t, d), (b, kvh, t, d)))
    lens = torch.tensor([40, 17, 5])
    last = lens.view(b, 1, 1, 1) - q_len + torch.arange(q_len).view(1, 1, -1, 1)  # each query row's position
    mask = torch.arange(t).view(1, 1, 1, t) <= last
    k[1, :, 17:] = 1e4  # garbage at masked positions never reaches the output
    v[1, :, 17:] = 1e4
    out = poison((b, q_len, h, d))
    module = torch.nn.Module().eval()
    out[:], w = gqa_sdpa(module, q, k, v, mask, scaling=d ** -0.5)
    ref = _gqa_reference(q, k, v, mask, d ** -0.5)
    assert w is None and torch.allclose(out.double(), ref, atol=1e-5), (out.double() - ref).abs().max()
    with pytest.raises(InvalidArgumentError, match="query"):
        gqa_sdpa(module, q[:, :7], k, v, mask)


def test_gqa_sdpa_in_chunks_of_bf16_keys_equals_one_pass(monkeypatch):
    """bf16 keys and values go to fp32 a chunk at a time: the same attention as in one pass (to fp32
    summation order), and as fp64 attention over the same bf16 values."""
    g = torch.Generator().manual_seed(2)
    b, h, kvh, t, d = 2, 4, 2, 50, 8
    q, k, v = (torch.randn(s, generator=g).to(torch.bfloat16) for s in ((b, h, 1, d), (b, kvh, t, d), (b, kvh, t, d)))
    mask = (torch.arange(t).view(1, 1, 1, t) <= torch.tensor([49, 20]).view(b, 1, 1, 1))
    module = torch.nn.Module().eval()
    whole = gqa_sdpa(module, q, k, v, mask)[0]
    monkeypatch.setattr(graph_decode, "GQA_CHUNK_BYTES", b * kvh * d * 4 * 7)  # 7 keys a chunk: 8 chunks
    bmm, calls = torch.bmm, []
    monkeypatch.setattr(torch, "bmm", lambda *a: calls.append(1) or bmm(*a))
    chunked = gqa_sdpa(module, q, k, v, mask)[0]
    monkeypatch.setattr(torch, "bmm", bmm)
    assert len(calls) == 2 * 8  # scores and values, chunk by chunk
    ref = _gqa_reference(q, k, v, mask, d ** -0.5)
    assert chunked.dtype == torch.bfloat16 and torch.isfinite(chunked).all()
    assert torch.allclose(chunked.float(), whole.float(), atol=1e-2, rtol=0)  # bf16 rounding of the output
    assert torch.allclose(chunked.double(), ref, atol=2e-2)


def test_the_step_attends_through_gqa_sdpa_and_leaves_the_model_as_it_was(qwen_long, monkeypatch):
    calls = []
    monkeypatch.setattr(graph_decode, "gqa_sdpa", lambda *a, **kw: calls.append(1) or gqa_sdpa(*a, **kw))
    graph_decode._register_gqa()
    gd = GraphDecoder(qwen_long, max_batch=2, len_bucket=16, use_graphs=False)
    run_both(qwen_long, gd, [12, 30], steps=2, poison=False)
    full = sum(1 for lay in qwen_long.model.layers if hasattr(lay, "self_attn"))
    assert len(calls) == 2 * full > 0
    assert qwen_long.config._attn_implementation == "sdpa"
    monkeypatch.undo()
    graph_decode._register_gqa()


def _poison_rows(gd, rows):
    g = torch.Generator().manual_seed(5)
    for kind in ("keys", "values", "conv", "rec"):
        for t in gd.buf[kind].values():
            for b in rows:
                t[b] = (torch.randn(t[b].shape, generator=g) * 100).to(t)


def test_rows_are_kept_across_steps_and_recopied_when_the_batch_changes(qwen_long):
    """A request decoding on in the same row is not copied again (its keys, values and state are in
    the row as the last step left them); a request in another row, or a new one, is: rows poisoned
    before such a step must not leak into it. Logits and caches as one-request forwards give them."""
    gd = GraphDecoder(qwen_long, max_batch=4, len_bucket=16, use_graphs=False)
    lens = [20, 20, 12, 7]  # 0 and 1 at the same positions: rows are told apart by cache, not position
    ref, got = prefilled(qwen_long, lens), prefilled(qwen_long, lens)
    pos = list(lens)
    # batches by request index; the rows a step must copy (all others keep their request)
    plan = [([0, 1, 2], None), ([0, 1, 2], []), ([1, 0, 2], [0, 1]), ([2], [0]), ([3, 2], [0, 1]), ([3, 2], [])]
    kept = 0
    for s, (batch, recopied) in enumerate(plan):
        if recopied:
            _poison_rows(gd, recopied)
        toks = [(5 * s + 3 * r) % 200 + 3 for r in batch]
        want = torch.stack([forward_chunk(qwen_long, ref[r], torch.tensor([t]), pos[r])[0][-1]
                            for r, t in zip(batch, toks)])
        out = gd.step([got[r] for r in batch], toks, [pos[r] for r in batch])
        assert (out - want).abs().max().item() < ATOL, (s, (out - want).abs().max().item())
        if recopied is not None:
            kept += len(batch) - len(recopied)
        assert gd.stats["rows_kept"] == kept, (s, gd.stats)
        for r in batch:
            pos[r] += 1
    assert kept == 6  # 3 + 1 + 0 + 0 + 2
    assert_same_caches(qwen_long, ref, got)


def test_a_failed_capture_falls_back_to_eager_steps(qwen_long, monkeypatch):
    """If a graph cannot be captured the decoder says so (warning, ``capture_error``) and its steps
    stay right, eagerly, from then on."""
    gd = GraphDecoder(qwen_long, max_batch=4, len_bucket=16, use_graphs=False)
    gd.use_graphs = True  # as on a GPU, where the capture is what fails here

    def fail(n, width):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(gd, "_capture", fail)
    with pytest.warns(UserWarning, match="capture failed"):
        ref, got, worst = run_both(qwen_long, gd, [12, 30], steps=3)
    assert worst < ATOL and not gd.use_graphs and "not permitted" in gd.capture_error
    assert gd.stats["replays"] == 0 and gd.stats["steps"] == 3
    assert_same_caches(qwen_long, ref, got)


def test_the_static_view_answers_every_version_s_state_question():
    """The decode buffers' cache view answers what each transformers version asks of a linear layer while
    decoding: 5.17's ``has_previous_state(layer_idx)``, Qwen3.5's ``has_previous_state(layer_idx,
    state_idx=0)`` (its GPU test failed on the H200's 5.17 for want of it) and 5.24's getters."""
    conv, rec = {0: torch.randn(1, 4, 3)}, {0: torch.randn(1, 2, 4, 4)}
    view = graph_decode._StaticCache(("linear_attention",), {}, {}, conv, rec, torch.zeros(1, dtype=torch.long))
    assert view.has_previous_state(0) and view.has_previous_state(0, state_idx=0) and view.has_previous_state()
    assert view.get_conv_state(0) is conv[0] and view.get_recurrent_state(0, state_idx=0) is rec[0]
    assert view.layers[0].has_previous_state == {0: True} and view.layers[0].recurrent_states[0] is rec[0]


def test_bad_input_names_the_argument(qwen_long):
    gd = GraphDecoder(qwen_long, max_batch=2, len_bucket=16, use_graphs=False)
    caches = prefilled(qwen_long, [5, 6, 7])
    with pytest.raises(InvalidArgumentError, match="caches"):
        gd.step(caches, [3, 3, 3], [5, 6, 7])  # more than max_batch
    with pytest.raises(InvalidArgumentError, match="positions"):
        gd.step(caches[:2], [3, 3], [5, 5])  # cache 1 holds 6 tokens
    with pytest.raises(InvalidArgumentError, match="positions"):
        gd.step([new_cache(qwen_long)], [3], [1])  # a fresh cache: nothing to continue from
    assert gd.stats["steps"] == 0
    with pytest.raises(InvalidArgumentError, match="model"):
        GraphDecoder(tiny_swa_model(seed=0, device="cpu"), max_batch=2)
    with pytest.raises(InvalidArgumentError, match="model"):
        GraphDecoder(tiny_qwen3_next(seed=0, device="cpu", attn_implementation="eager"), max_batch=2)
    with pytest.raises(InvalidArgumentError, match="max_batch"):
        GraphDecoder(qwen_long, max_batch=0)
    with pytest.raises(InvalidArgumentError, match="use_graphs"):
        GraphDecoder(qwen_long, max_batch=2, use_graphs=True)  # no CUDA here
    with pytest.raises(InvalidArgumentError, match="use_graphs"):
        GraphDecoder(qwen_long, max_batch=2, use_graphs="yes")


@pytest.mark.gpu
def test_graph_replays_equal_one_request_forwards_on_cuda():
    """CUDA graphs: one capture per (batch size, bucket), replays that match one-request forwards
    (fp32, transformers' torch gated delta), and the eager static step gives the same."""
    model = tiny_qwen3_next(seed=0, long_memory=True, device="cuda")
    gd = GraphDecoder(model, max_batch=4, len_bucket=16)
    assert gd.use_graphs
    ref, got, worst = run_both(model, gd, [37, 20, 51], steps=6, device="cuda", poison=True)
    assert worst < 1e-4, worst
    assert_same_caches(model, ref, got)
    # 6 steps reach at most 57 tokens: all in the 64-token bucket, one capture for batch 3
    assert gd.stats["replays"] == 6 and gd.stats["captures"] == 1
    eager = GraphDecoder(model, max_batch=4, len_bucket=16, use_graphs=False)
    _, got_e, worst_e = run_both(model, eager, [37, 20, 51], steps=3, device="cuda")
    assert worst_e < 1e-4
