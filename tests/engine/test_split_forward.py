"""One forward that also takes the recurrent state inside it (``engine.runner.split_forward``), against the
two forwards it replaces: the state at the split (conv window and recurrent state of every linear
layer), the logits of every position and the cache at the end agree to float rounding."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiered_cache.engine import forward_chunk, new_cache, tiny_qwen3_next  # noqa: E402
from tiered_cache.engine.models import tiny_swa_model  # noqa: E402
from tiered_cache.engine.runner.split_forward import forward_chunk_split, split_supported  # noqa: E402
from tiered_cache.errors import InvalidArgumentError  # noqa: E402

ATOL = 2e-5  # fp32: the same sums over differently shaped GEMMs


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_next(seed=3, long_memory=True, device="cpu")


def _linear(cache):
    return [lay for lay in cache.layers if hasattr(lay, "recurrent_states")]


def _ids(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g)


def _close(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.isfinite(a).all() and (a - b).abs().max().item() <= ATOL, (a - b).abs().max().item()


def test_split_supported_on_qwen3_next_only(model):
    assert split_supported(model)
    assert not split_supported(tiny_swa_model(seed=0, device="cpu"))


@pytest.mark.parametrize("start, split, end", [(0, 2, 40), (0, 37, 53), (24, 28, 61), (24, 56, 57)],
                         ids=["fresh-inside-kernel", "fresh", "resumed-inside-kernel", "resumed-last-token"])
def test_split_forward_equals_two_forwards(model, start, split, end):
    ids = _ids(end)
    k = model.config.linear_conv_kernel_dim
    two, one = new_cache(model), new_cache(model)
    if start:
        forward_chunk(model, two, ids[:start], 0)
        forward_chunk(model, one, ids[:start], 0)
    la, _ = forward_chunk(model, two, ids[start:split], start)
    at_split = [(lay.conv_states[0][..., -k:].clone(), lay.recurrent_states[0].clone()) for lay in _linear(two)]
    lb, _ = forward_chunk(model, two, ids[split:end], split)
    logits, _, st = forward_chunk_split(model, one, ids[start:end], start, split)
    assert len(st.conv) == len(st.recurrent) == len(at_split) > 0
    for (conv, rec), c, r in zip(at_split, st.conv, st.recurrent):
        _close(c, conv)
        _close(r, rec)
    _close(logits, torch.cat([la, lb]))
    for x, y in zip(_linear(one), _linear(two)):  # the cache ends where two forwards leave it
        _close(x.conv_states[0][..., -k:], y.conv_states[0][..., -k:])
        _close(x.recurrent_states[0], y.recurrent_states[0])
    for x, y in zip(one.layers, two.layers):
        if hasattr(x, "keys") and x.keys is not None:
            _close(x.keys, y.keys)
    # outside a split forward the wrapped functions pass every call through untouched
    again = new_cache(model)
    if start:
        forward_chunk(model, again, ids[:start], 0)
    plain, _ = forward_chunk(model, again, ids[start:end], start)
    assert torch.equal(plain, forward_chunk(model, _fresh(model, ids, start), ids[start:end], start)[0])


def _fresh(model, ids, start):
    c = new_cache(model)
    if start:
        forward_chunk(model, c, ids[:start], 0)
    return c


def test_bad_split_is_refused(model):
    ids = _ids(20)
    for bad in (0, 20, 25, 3.0, None):
        with pytest.raises(InvalidArgumentError, match="split_pos"):
            forward_chunk_split(model, new_cache(model), ids, 0, bad)
    with pytest.raises(InvalidArgumentError, match="model"):
        forward_chunk_split(tiny_swa_model(seed=0, device="cpu"), None, ids, 0, 5)


@pytest.mark.gpu
def test_split_forward_equals_two_forwards_on_cuda():
    """On the GPU, with whichever gated-delta implementation is installed (flash-linear-attention's
    Triton kernels compute in TF32: a looser bound there; a wrong state is off by far more)."""
    from benchmarks.bench_workload import gated_delta_impl

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_qwen3_next(seed=3, long_memory=True, device="cuda")
    tol = 2e-5 if not gated_delta_impl(model).startswith("fla") else 5e-3
    ids = _ids(200).cuda()
    k = model.config.linear_conv_kernel_dim
    for start, split, end in ((0, 64, 150), (64, 192, 200)):
        two, one = _fresh(model, ids, start), _fresh(model, ids, start)
        la, _ = forward_chunk(model, two, ids[start:split], start)
        at = [(lay.conv_states[0][..., -k:].clone(), lay.recurrent_states[0].clone()) for lay in _linear(two)]
        lb, _ = forward_chunk(model, two, ids[split:end], split)
        logits, _, st = forward_chunk_split(model, one, ids[start:end], start, split)
        for (conv, rec), c, r in zip(at, st.conv, st.recurrent):
            assert (c - conv).abs().max().item() <= tol * max(1.0, conv.abs().max().item())
            assert (r - rec).abs().max().item() <= tol * max(1.0, rec.abs().max().item())
        ref = torch.cat([la, lb])
        assert (logits - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_a_forward_that_does_not_call_the_wrapped_functions_as_expected_takes_no_state(model, monkeypatch):
    """If the layers stop calling the wrapped functions once each (a model or transformers change),
    the split forward says so and returns no state; its logits and cache are one forward's (to float
    rounding: the recurrence still ran in two parts)."""
    import tiered_cache.engine.runner.split_forward as sf

    ids = _ids(40)
    monkeypatch.setattr(sf, "layer_kinds", lambda cfg: ["linear_attention"] * 99)  # more than it has
    with pytest.warns(UserWarning, match="no state is taken"):
        logits, cache, st = forward_chunk_split(model, new_cache(model), ids, 0, 17)
    assert st is None
    want, ref = forward_chunk(model, new_cache(model), ids, 0)
    _close(logits, want)
    for x, y in zip(_linear(cache), _linear(ref)):
        _close(x.recurrent_states[0], y.recurrent_states[0])
