"""One forward that also takes the recurrent state inside it (``engine.runner.split_forward``), against the
two forwards it replaces: the state at the split (conv window and recurrent state of every linear
layer), the logits of every position and the cache at the end agree to float rounding."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tiered_cache.engine import forward_chunk, new_cache, tiny_qwen3_next  # noqa: E402
from tiered_cache.engine.models import KV_KINDS, RECURRENT_KINDS, layer_kinds, tiny_swa_model  # noqa: E402
from tiered_cache.engine.runner.split_forward import forward_chunk_split, split_supported  # noqa: E402
from tiered_cache.errors import InvalidArgumentError  # noqa: E402

ATOL = 2e-5  # fp32: the same sums over differently shaped GEMMs


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3_next(seed=3, long_memory=True, device="cpu")


def _linear(model, cache):
    """The cache's layers that hold a recurrent state, by the config's layer kinds (the package's rule: under
    transformers 5.17 a NemotronH MLP or MoE layer gets an unfilled linear layer object too)."""
    return [cache.layers[i] for i, kind in enumerate(layer_kinds(model.config)) if kind in RECURRENT_KINDS]


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
    at_split = [(lay.conv_states[0][..., -k:].clone(), lay.recurrent_states[0].clone())
                for lay in _linear(model, two)]
    lb, _ = forward_chunk(model, two, ids[split:end], split)
    logits, _, (st,) = forward_chunk_split(model, one, ids[start:end], start, (split,))
    assert len(st.conv) == len(st.recurrent) == len(at_split) > 0
    for (conv, rec), c, r in zip(at_split, st.conv, st.recurrent):
        _close(c, conv)
        _close(r, rec)
    _close(logits, torch.cat([la, lb]))
    for x, y in zip(_linear(model, one), _linear(model, two)):  # the cache ends where two forwards leave it
        _close(x.conv_states[0][..., -k:], y.conv_states[0][..., -k:])
        _close(x.recurrent_states[0], y.recurrent_states[0])
    for i, kind in enumerate(layer_kinds(model.config)):
        if kind in KV_KINDS:
            _close(one.layers[i].keys, two.layers[i].keys)
    # outside a split forward the wrapped functions pass every call through untouched
    again = new_cache(model)
    if start:
        forward_chunk(model, again, ids[:start], 0)
    plain, _ = forward_chunk(model, again, ids[start:end], start)
    assert torch.equal(plain, forward_chunk(model, _fresh(model, ids, start), ids[start:end], start)[0])


def _a_forward_per_part(model, ids, start, splits, end):
    """What a split forward must equal: one forward per part from ``start`` (after a forward of
    ``[0, start)``). Returns the (conv window, recurrent state) of every linear layer at each split, the
    logits of every position and the cache at the end."""
    k = model.config.linear_conv_kernel_dim
    cache, at, logits, a = _fresh(model, ids, start), [], [], start
    for b in (*splits, end):
        logits.append(forward_chunk(model, cache, ids[a:b], a)[0])
        if b != end:
            at.append([(lay.conv_states[0][..., -k:].clone(), lay.recurrent_states[0].clone())
                       for lay in _linear(model, cache)])
        a = b
    return at, torch.cat(logits), cache


def _fresh(model, ids, start):
    c = new_cache(model)
    if start:
        forward_chunk(model, c, ids[:start], 0)
    return c


@pytest.mark.parametrize("start, splits, end", [(0, (16, 32, 48), 61), (24, (25, 40, 41), 57), (0, (8, 12), 13)],
                         ids=["fresh-blocks", "resumed-uneven", "fresh-last-token"])
def test_a_forward_split_at_several_positions_equals_a_forward_per_part(model, start, splits, end):
    """The tree's ``block`` admission takes a state at every block boundary of a chunk: each state, the
    logits and the cache at the end equal those of one forward per part."""
    ids = _ids(end, seed=start + len(splits))
    k = model.config.linear_conv_kernel_dim
    one = _fresh(model, ids, start)
    want, ref, parts = _a_forward_per_part(model, ids, start, splits, end)
    logits, _, states = forward_chunk_split(model, one, ids[start:end], start, splits)
    assert len(states) == len(splits)
    for st, at, p in zip(states, want, splits, strict=True):
        assert st.offset == p - start and len(st.conv) == len(st.recurrent) == len(at) > 0
        for (conv, rec), c, r in zip(at, st.conv, st.recurrent, strict=True):
            _close(c, conv)
            _close(r, rec)
    _close(logits, ref)
    for x, y in zip(_linear(model, one), _linear(model, parts)):
        _close(x.conv_states[0][..., -k:], y.conv_states[0][..., -k:])
        _close(x.recurrent_states[0], y.recurrent_states[0])


def test_bad_split_is_refused(model):
    ids = _ids(20)
    for bad in ((0,), (20,), (25,), (3.0,), (True,), (5, 5), (9, 4), (), 5, None):
        with pytest.raises(InvalidArgumentError, match="split_pos"):
            forward_chunk_split(model, new_cache(model), ids, 0, bad)
    with pytest.raises(InvalidArgumentError, match="model"):
        forward_chunk_split(tiny_swa_model(seed=0, device="cpu"), None, ids, 0, (5,))


@pytest.mark.gpu
def test_split_forward_equals_a_forward_per_part_on_cuda():
    """On the GPU, split at one position and at several, with whichever gated-delta implementation is
    installed (flash-linear-attention's Triton kernels compute in TF32: a looser bound there; a wrong state
    is off by far more)."""
    from benchmarks.bench_workload import gated_delta_impl

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_qwen3_next(seed=3, long_memory=True, device="cuda")
    tol = 2e-5 if not gated_delta_impl(model).startswith("fla") else 5e-3
    ids = _ids(200).cuda()
    for start, splits, end in ((0, (64,), 150), (64, (192,), 200), (0, (64, 100, 128), 150), (64, (128, 192), 200)):
        at, ref, _ = _a_forward_per_part(model, ids, start, splits, end)
        logits, _, states = forward_chunk_split(model, _fresh(model, ids, start), ids[start:end], start, splits)
        for st, want in zip(states, at, strict=True):
            for (conv, rec), c, r in zip(want, st.conv, st.recurrent, strict=True):
                assert (c - conv).abs().max().item() <= tol * max(1.0, conv.abs().max().item())
                assert (r - rec).abs().max().item() <= tol * max(1.0, rec.abs().max().item())
        assert (logits - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item())


def test_a_forward_that_does_not_call_the_wrapped_functions_as_expected_takes_no_state(model, monkeypatch):
    """If the layers stop calling the wrapped functions once each (a model or transformers change),
    the split forward says so and returns no state; its logits and cache are one forward's (to float
    rounding: the recurrence still ran in two parts)."""
    import tiered_cache.engine.runner.split_forward as sf

    ids = _ids(40)
    monkeypatch.setattr(sf, "layer_kinds", lambda cfg: ["linear_attention"] * 99)  # more than it has
    with pytest.warns(UserWarning, match="no state is taken"):
        logits, cache, st = forward_chunk_split(model, new_cache(model), ids, 0, (17,))
    assert st is None
    want, ref = forward_chunk(model, new_cache(model), ids, 0)
    _close(logits, want)
    for x, y in zip(_linear(model, cache), _linear(model, ref)):
        _close(x.recurrent_states[0], y.recurrent_states[0])


def test_the_split_wrappers_leave_the_gated_delta_implementation_named(model, monkeypatch):
    """``gated_delta_impl`` names the function under the split forward's wrapper. The GPU tests choose by
    it whether exact equality can hold (not under flash-linear-attention's TF32 kernels); once an engine
    had wrapped the module's functions it named the wrapper, and those tests compared fla's output
    exactly (H200, 2026-12-02: the e2e lossless tests failed after any engine test had run)."""
    import tiered_cache.engine.runner.split_forward as sf
    from benchmarks.bench_workload import gated_delta_impl

    mod = sf._module_of(model)
    for name in sf._NAMES:  # the functions as transformers made them, whatever ran before in this process
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, getattr(fn, "__tiered_cache_split__", fn))
    plain = gated_delta_impl(model)
    sf.install(model)
    assert hasattr(mod.torch_chunk_gated_delta_rule, "__tiered_cache_split__")  # the wrapper is in place
    assert gated_delta_impl(model) == plain and "split_forward" not in plain, plain


def _layer_forward_525(self, hidden_states, cache):
    """The calls of transformers 5.25's ``Qwen3NextGatedDeltaNet.forward`` (its source is what is read)."""
    mixed = causal_conv1d_forward(self.conv1d, hidden_states, cache, self.layer_idx)  # noqa: F821
    return torch_chunk_gated_delta_rule(mixed, mixed, mixed)  # noqa: F821


def _conv_forward_525(conv1d, hidden_states, cache, layer_idx):
    return causal_conv1d_fn(hidden_states, conv1d.weight.squeeze(1))  # noqa: F821


def _conv_forward_inline(conv1d, hidden_states, cache, layer_idx):
    return torch.nn.functional.conv1d(hidden_states, conv1d.weight, groups=hidden_states.shape[1])


def test_a_conv_called_through_causal_conv1d_forward_is_followed_there():
    """5.25's layers call the conv through the module's ``causal_conv1d_forward``: the split forward is
    supported where that function calls ``causal_conv1d_fn`` by name (the wrapper sees the conv's inputs),
    and not where it convolves some other way or the module has none (checked under every version)."""
    import tiered_cache.engine.runner.split_forward as sf

    assert sf._calls_by_name(_layer_forward_525, _conv_forward_525)
    assert not sf._calls_by_name(_layer_forward_525, _conv_forward_inline)
    assert not sf._calls_by_name(_layer_forward_525, None)


def test_hub_function_finds_the_function_a_kernels_module_stands_for():
    """With the ``kernels`` package, 5.25 makes a modeling module's kernel-routed function an ``nn.Module``
    instance (``use_kernel_forward_from_hub`` on a function): the source read and the torch function
    restored for tests are the function's under it."""
    kernels = pytest.importorskip("kernels")
    import tiered_cache.engine.runner.split_forward as sf

    def plus_one(x):
        return x + 1

    standing = kernels.use_kernel_forward_from_hub("tiered_cache_test_plus_one")(plus_one)
    assert isinstance(standing, torch.nn.Module)
    assert sf.hub_function(standing) is plus_one and sf._bare(standing) is plus_one
    assert sf.hub_function(plus_one) is plus_one and sf.hub_function(torch.nn.Linear(2, 2)) is None
