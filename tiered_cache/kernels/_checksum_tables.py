"""Constants and keyed tables of the T2 slot checksum (``kernels/checksum.py``, twin in ``reference.py``).

Kept apart from both so the kernel module and the reference share one definition without importing
each other. The tables are part of the checksum's definition: a checksum computed by one process is
compared by another (T3 keeps it in its header across restarts), so they must be the same everywhere.
That is why they come from splitmix64 computed here in numpy ``uint64`` arithmetic (defined wrap-around,
logical shifts) rather than from ``torch.randint``, whose algorithm torch does not promise to keep
across versions or devices.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from tiered_cache import device as tc_device

P = (1 << 31) - 1          # the hash's prime modulus
TILE = 2048                # words a tile: a_j, b_j for j < TILE, s_g for the tile index g
MAX_WORDS = 1 << 26        # longest row: its bit positions t = 32 i + b stay below 2**31
TILES = MAX_WORDS // TILE  # 32768 tile weights s_g
SEED = 0x5EED_C0DE_2024_0017  # fixed: part of the checksum's definition
# In-word bit-position masks: bit k of position b is set exactly for the bits that M_k selects.
MASKS = (0xAAAAAAAA, 0xCCCCCCCC, 0xF0F0F0F0, 0xFF00FF00, 0xFFFF0000)

_lock = threading.Lock()
_host: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
_by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _splitmix64(n: int, seed: int) -> np.ndarray:
    z = (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) + np.uint64(seed)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _build_host() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with np.errstate(over="ignore"):
        z = _splitmix64(2 * TILE + TILES, SEED)
    # 63 random bits mod p: uniform on [0, p) up to a relative bias below 2**-32.
    vals = ((z >> np.uint64(1)) % np.uint64(P)).astype(np.int32)
    t = torch.from_numpy(vals)
    return t[:TILE].clone(), t[TILE: 2 * TILE].clone(), t[2 * TILE:].clone()


def checksum_tables(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, b, s)``: int32 tensors of ``TILE``, ``TILE`` and ``TILES`` values in ``[0, P)`` on ``device``.

    Built once per device and cached (the kernel's launch path only looks them up: no allocation, no
    copy, no host sync after the first call). Never written after they are built.
    """
    global _host
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = tc_device.resolve(dev)  # a tensor's device has its index: this is the rare path
    got = _by_device.get(dev)
    if got is not None:
        return got
    with _lock:
        if dev in _by_device:
            return _by_device[dev]
        if _host is None:
            _host = _build_host()
        if dev.type == "cpu":
            got = _host
        else:
            a, b, s = _host
            got = (a.to(dev), b.to(dev), s.to(dev))
            if dev.type == "cuda":
                # Once per device: a copy from pageable memory may still be landing when the call
                # returns, and the tables are read later from other streams.
                tc_device.synchronize(dev)
        _by_device[dev] = got
        return got
