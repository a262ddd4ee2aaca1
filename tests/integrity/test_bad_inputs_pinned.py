"""The bugs of issue 17 as filed, one test each (the table in ``test_bad_inputs.py`` covers the rest)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.support.bad_inputs_table import KV, ST
from tiered_cache import HostMirror, MultiEndedAllocator, RegionSpec, TransferEngine, UnifiedPool
from tiered_cache.errors import InvalidArgumentError, InvalidTypeError, MemoryBudgetError, OutOfRangeError


def test_str_ids_are_not_digits():
    """Item 6: ``free("12")`` freed slots 1 and 2 of a host region."""
    r = HostMirror([RegionSpec("a", 64, 4)]).region("a")
    assert r.alloc(3) == [1, 2, 3]
    with pytest.raises(InvalidTypeError) as e:
        r.free("12")
    assert e.value.arg == "ids" and r.available_size() == 1


def test_float_ids_do_not_truncate():
    """Item 6: ``free([3.7])`` freed slot 3; ``free(torch.tensor([2.0]))`` on a pool side likewise."""
    r = HostMirror([RegionSpec("a", 64, 4)]).region("a")
    r.alloc(3)
    with pytest.raises(TypeError):
        r.free([3.7])
    pool = UnifiedPool(KV, ST, low_slots=4, high_slots=2, device="cpu")
    ids = pool.side("mamba").alloc(2)
    with pytest.raises(InvalidTypeError):
        pool.side("mamba").free(ids.float())
    assert r.available_size() == 1 and pool.side("mamba").allocator.num_live == 2


def test_sink_is_no_active_id():
    """Item 6: slot 0 (the sink) passed ``physical_rows`` as an active id, and -1 read the table's end."""
    pool = UnifiedPool(KV, ST, low_slots=4, high_slots=2, device="cpu")
    a = pool.side("mamba").allocator
    a.alloc(1)
    for bad in ([0], [-1]):
        with pytest.raises(InvalidArgumentError):
            a.physical_rows(bad)


def test_huge_allocator_is_a_budget_error():
    """Item 7: ``MultiEndedAllocator(total_bytes=2**63)`` tried to allocate an EiB table (MemoryError)."""
    with pytest.raises(MemoryBudgetError) as e:
        MultiEndedAllocator(name="x", entry_bytes=64, total_bytes=2 ** 63, grows="up")
    assert "total_bytes" in str(e.value)


def test_index_errors_are_typed_index_errors():
    """Item 7: a layer past the end raised a bare IndexError or a ValueError; now one that is both typed
    and an IndexError."""
    pool = UnifiedPool(KV, ST, low_slots=4, high_slots=2, device="cpu")
    with pytest.raises(OutOfRangeError) as e:
        pool.side("full").k_view(KV.num_layers)
    assert isinstance(e.value, IndexError) and e.value.arg == "layer"


@pytest.mark.parametrize("kw, arg", [
    (dict(room_timeout_s=math.nan), "room_timeout_s"), (dict(room_timeout_s=0.0), "room_timeout_s"),
    (dict(backend="bogus"), "backend"), (dict(device="tpu"), "device"), (dict(device="meta"), "device"),
    (dict(staging_bytes=-1), "staging_bytes"),
])
def test_transfer_settings_are_checked(kw, arg):
    """Item 8: ``TransferEngine(room_timeout_s=nan)`` never expired; ``backend="bogus"`` was kept."""
    with pytest.raises(InvalidArgumentError) as e:
        TransferEngine(**kw)
    assert e.value.arg == arg


def test_nan_budget_is_refused():
    """Item 8: ``HostMirror(budget_bytes=nan)`` let any size through (NaN compares false)."""
    with pytest.raises(InvalidArgumentError) as e:
        HostMirror([RegionSpec("a", 64, 4)], budget_bytes=math.nan)
    assert e.value.arg == "budget_bytes"


def test_room_timeout_inf_waits_without_limit():
    """Item 8, the other side: an infinite room timeout is a setting that makes sense and is kept."""
    assert TransferEngine("cpu", room_timeout_s=math.inf).room_timeout_s == math.inf
    assert torch.device("cpu") == TransferEngine("cpu").device
