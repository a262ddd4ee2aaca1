"""The admission and eviction options (issue 23) through SGLang's backend config: keys, checked values."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.base_prefix_cache")  # the package imports its backend, which needs it

from tiered_cache.errors import InvalidArgumentError  # noqa: E402
from tiered_cache.integrations.sglang.config import parse_backend_config  # noqa: E402


def test_policy_keys():
    bc = parse_backend_config('{"eviction_policy": "tiered", "state_admission": "block", "admission_block": 512,'
                              ' "cost_model": "marconi-7b"}')
    cfg = bc.cache_config(page_size=16, kv_pages=8, t0_states=2)
    assert (cfg.eviction_policy, cfg.state_admission, cfg.admission_block, cfg.cost_model) == (
        "tiered", "block", 512, "marconi-7b")
    for key, bad in (("state_admission", '"all"'), ("eviction_policy", '"lfu"'), ("cost_model", '"gpt"')):
        with pytest.raises(InvalidArgumentError, match=key):
            parse_backend_config(f'{{"{key}": {bad}}}')
