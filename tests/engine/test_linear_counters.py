"""transformers 5.25 gives each linear layer a token counter (``cumulative_length_linear``) that its
``get_seq_length`` reports, and ``Cache.get_seq_length`` asks layer 0. ``seen_tokens`` reads the
positions off the attention layers wherever such counters exist, and ``sync_linear_lengths`` sets them;
a stand-in linear layer shows both here (the installed transformers is capped below 5.25)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
from transformers.cache_utils import DynamicLayer  # noqa: E402

from tiered_cache.engine.runner.forward import seen_tokens, sync_linear_lengths  # noqa: E402


class _Linear525:
    """What 5.25's linear layer reports: its counter, grown by the conv window's columns on a restore."""

    def __init__(self, count: int) -> None:
        self.cumulative_length_linear = torch.tensor(count)

    def get_seq_length(self):
        return self.cumulative_length_linear


class _Cache:
    def __init__(self, layers) -> None:
        self.layers = layers

    def get_seq_length(self, layer_idx: int = 0):
        return self.layers[layer_idx].get_seq_length()


def _attention(n: int) -> DynamicLayer:
    lay = DynamicLayer()
    lay.update(torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8))
    return lay


@pytest.mark.parametrize("n", [1, 21, 300])
def test_seen_tokens_reads_the_attention_layers_not_layer_zeros_counter(n):
    cache = _Cache([_Linear525(4), _Linear525(4), _attention(n), _Linear525(4)])
    assert int(cache.get_seq_length()) == 4  # what the model would read: the conv window's columns
    assert seen_tokens(cache) == n
    sync_linear_lengths(cache, n)
    assert int(cache.get_seq_length()) == n
    assert all(int(lay.cumulative_length_linear) == n for lay in cache.layers if isinstance(lay, _Linear525))


def test_a_cache_of_linear_layers_only_tracks_no_length():
    assert seen_tokens(_Cache([_Linear525(4), _Linear525(9)])) is None


def test_caches_without_counters_keep_the_cache_s_own_length():
    cache = _Cache([_attention(7), _attention(7)])
    assert seen_tokens(cache) == 7
    sync_linear_lengths(cache, 3)  # nothing to set
    assert seen_tokens(cache) == 7


def test_store_decoded_counts_the_decoded_token_in_the_counters():
    """After a batched decode step each cache's linear counters equal the positions its attention layers hold
    (the step appended one); a cache without attention layers counts one more."""
    from tiered_cache.engine.models import FULL, LINEAR
    from tiered_cache.engine.runner.forward import store_decoded

    def linear(count):
        lay = _Linear525(count)
        lay.conv_states = {0: torch.randn(1, 6, 4)}
        lay.recurrent_states = {0: torch.randn(1, 2, 3, 3)}
        return lay

    caches = [_Cache([linear(4), _attention(n)]) for n in (5, 9)]
    keys = {1: torch.randn(2, 2, 1, 8)}
    conv = {0: torch.randn(2, 6, 4)}
    rec = {0: torch.randn(2, 2, 3, 3)}
    store_decoded(caches, [LINEAR, FULL], 4, keys, {1: torch.randn(2, 2, 1, 8)}, conv, rec)
    assert [seen_tokens(c) for c in caches] == [6, 10]
    assert [int(c.layers[0].cumulative_length_linear) for c in caches] == [6, 10]
    only = [_Cache([linear(7)])]
    store_decoded(only, [LINEAR], 4, {}, {}, {0: torch.randn(1, 6, 4)}, {0: torch.randn(1, 2, 3, 3)})
    assert int(only[0].layers[0].cumulative_length_linear) == 8
