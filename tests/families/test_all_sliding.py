"""An all-sliding Mistral through the adapter: its first layer is the full side (every token's KV in the
pages, the tree's key) and a resume gives it only its last window, exactly what transformers' sliding
layer holds after running the prefix; its other layers are the SWA side, as Gemma3's sliding layers.

Split-and-resume on a real ``UnifiedPool``: run ``[0, s)`` in pieces of at most the window (as the
engine's ``SWAKind`` does, so each piece's KV is still in the cache when it is exported), rebuild a fresh
cache from the pages and continue; compared with the same prefix run on one cache. The full side's ids
before the window are given as -1: a resume that read them would be refused (a sliding layer's ``update``
would drop them anyway: the window is what moves, not what the layer keeps)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from tiered_cache.engine import HybridCacheAdapter, forward_chunk, new_cache, spec_for  # noqa: E402
from tiered_cache.engine.models import tiny_family  # noqa: E402
from tiered_cache.errors import InvalidArgumentError  # noqa: E402
from tiered_cache.tiers.unified_pool import UnifiedPool  # noqa: E402

PAGE, N, SPLIT = 4, 60, 37  # the split is not page-aligned, and more than twice the window (15) in


@pytest.fixture(scope="module")
def mistral():
    return tiny_family("mistral", seed=0, device="cpu")


def _run_in_pieces(model, cache, ids: torch.Tensor, start: int, end: int, window: int, on_piece=None):
    out = []
    for s in range(start, end, window):
        e = min(end, s + window)
        out.append(forward_chunk(model, cache, ids[s:e], s)[0])
        if on_piece is not None:
            on_piece(cache, s, e)
    return torch.cat(out)


@pytest.mark.parametrize("corrupt", [False, True], ids=["exact", "oldest-in-window-corrupted"])
def test_resume_gives_the_full_side_layer_its_last_window_only(mistral, corrupt):
    specs = spec_for(mistral, PAGE)
    w = specs.full_window
    assert (specs.full_layers, specs.swa_layers, w, specs.swa.window) == ((0,), (1, 2), 15, 15)
    ad = HybridCacheAdapter(mistral, specs)
    ids = torch.randint(3, 256, (N,), generator=torch.Generator().manual_seed(0))
    pool = UnifiedPool(specs.full, specs.swa, low_slots=N // PAGE + 2, high_slots=N // PAGE + 2, page_size=PAGE,
                       device="cpu")
    full, swa = pool.side("full"), pool.side("swa")
    tok, stok = full.alloc(N), swa.alloc(N)

    def export(cache, s, e):
        assert ad.export_kv(cache, full, tok, s, e) == (s, e)  # every token of the full side
        ad.export_kv(cache, swa, stok, s, e)

    ref = new_cache(mistral)  # the prefix run on one cache: what transformers' sliding layers hold after it
    _run_in_pieces(mistral, ref, ids, 0, SPLIT, w, export)
    # the positions before the window: a resume must not read them (they are every token's KV, the tree's
    # key): their ids given as -1, which the adapter refuses wherever it translates one
    held = tok.clone()
    held[:SPLIT - w] = -1
    if corrupt:  # the oldest position a resume at SPLIT still attends to, on the full side
        p = full.translate(tok[SPLIT - w: SPLIT - w + 1])
        full.k_view_all()[:, p // PAGE, p % PAGE] += 1.0
    cache = ad.build_cache(full, held, swa_side=swa, swa_token_ids=stok, n_tokens=SPLIT)
    if not corrupt:
        for i in range(3):  # bit for bit what the layer kept, and the positions it has seen
            a, b = cache.layers[i], ref.layers[i]
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), i
            assert a.keys.shape[-2] == w and a.cumulative_length == b.cumulative_length == SPLIT
    got = _run_in_pieces(mistral, cache, ids, SPLIT, N, w)
    want = _run_in_pieces(mistral, ref, ids, SPLIT, N, w)
    assert torch.isfinite(got).all()
    if corrupt:
        assert (got - want).abs().max() > 1e-3  # the window the full side gives is the one the model reads
    else:
        assert torch.equal(got, want)
        whole = forward_chunk(mistral, new_cache(mistral), ids, 0)[0][SPLIT:]
        assert torch.allclose(got, whole, rtol=0, atol=1e-5), (got - whole).abs().max()


def test_without_the_full_window_the_resume_reads_every_token(mistral):
    """The control of the -1 ids above: an adapter whose specs forget ``full_window`` gathers the whole
    prefix for the full side, and a -1 id before the window is refused, where the real specs skip it."""
    specs = spec_for(mistral, PAGE)
    n, w = 20, specs.full_window
    pool = UnifiedPool(specs.full, specs.swa, low_slots=8, high_slots=8, page_size=PAGE, device="cpu")
    full, swa = pool.side("full"), pool.side("swa")
    tok, stok = full.alloc(n), swa.alloc(n)
    ad = HybridCacheAdapter(mistral, specs)
    _run_in_pieces(mistral, new_cache(mistral), torch.arange(3, 3 + n), 0, n, w,
                   lambda c, s, e: (ad.export_kv(c, full, tok, s, e), ad.export_kv(c, swa, stok, s, e)))
    held = tok.clone()
    held[0] = -1
    assert ad.build_cache(full, held, swa_side=swa, swa_token_ids=stok, n_tokens=n).layers[0].keys.shape[-2] == w
    forgetful = HybridCacheAdapter(mistral, dataclasses.replace(specs, full_window=0))
    with pytest.raises(InvalidArgumentError) as err:
        forgetful.build_cache(full, held, swa_side=swa, swa_token_ids=stok, n_tokens=n)
    assert err.value.arg == "token_ids"
