"""``TPGroup``: the tensor-parallel group one rank's cache agrees with, over ``torch.distributed``.

Every rank of a tensor-parallel model holds its heads' share of each KV page and recurrent state and
runs its own copy of the cache. The copies stay identical as long as every decision is made from the
same inputs; what only one rank can observe (a transfer that finished, a checksum that failed, a
storage read that returned) is combined here by one ``all_reduce(MIN)`` over the group, so that a
thing counts as done, intact or found only when it is so on every rank.

A group of one rank (``TPGroup.single()``) never calls ``torch.distributed``: TP 1 costs nothing.
The vote vector is int64 on the host for gloo and on the rank's GPU for NCCL (NCCL reduces device
tensors only); ``collectives`` counts the reductions made, so a test can see there was one per step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError
from tiered_cache.validate import bool_arg, int_arg


class TPGroup:
    """Rank ``rank`` of ``size`` in ``process_group`` (None: the default group). ``device``: where the
    vote vector is reduced (CPU for gloo, the rank's GPU for NCCL). ``check_digest``: the caches built
    for this rank also compare their trees' digests every step (``parallel.agree``; a walk of the
    tree per step, for tests and debugging)."""

    def __init__(self, rank: int, size: int, process_group: Any = None, device: Any = None, *,
                 check_digest: bool = False) -> None:
        self.size = int_arg("size", size, lo=1)
        self.rank = int_arg("rank", rank, lo=0, hi=self.size - 1)
        self.process_group = process_group
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.check_digest = bool_arg("check_digest", check_digest)
        self.collectives = 0

    @classmethod
    def single(cls) -> TPGroup:
        """TP 1: nothing to agree with."""
        return cls(0, 1)

    @classmethod
    def from_distributed(cls, process_group: Any = None, *, check_digest: bool = False) -> TPGroup:
        """This process's rank in ``process_group`` (None: the default group) of an initialized
        ``torch.distributed``; votes go to the current CUDA device under NCCL, stay on the host otherwise."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise InvalidArgumentError("process_group", "an initialized torch.distributed group", process_group)
        rank, size = dist.get_rank(process_group), dist.get_world_size(process_group)
        nccl = dist.get_backend(process_group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        return cls(rank, size, process_group, device, check_digest=check_digest)

    def all_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum of ``values`` over the group's ranks (every rank passes a list of
        the same length, in the same order); a group of one returns them as they are."""
        if not isinstance(values, list):
            raise InvalidTypeError("values", "a list of ints", type(values).__name__)
        if self.size == 1 or not values:
            return values
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.process_group)
        self.collectives += 1
        return t.tolist()

    def gather(self, shard: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``shard`` (same shape on each), concatenated along ``dim`` in rank order."""
        if self.size == 1:
            return shard
        import torch.distributed as dist

        x = shard.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.process_group)
        return torch.cat(parts, dim=dim)

    def split(self, full: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous ``1/size`` of ``full`` along ``dim`` (the heads, or a conv window's
        channels); ``gather`` is its inverse."""
        n = full.shape[dim]
        if n % self.size:
            raise InvalidArgumentError("full", f"a size along dim {dim} divisible by tp={self.size}", n)
        k = n // self.size
        return full.narrow(dim, self.rank * k, k)

    def tag(self) -> Optional[str]:
        """What T3 keys carry of the group: ``"rank/size"`` (None for TP 1: its keys stay as they were)."""
        return None if self.size == 1 else f"{self.rank}/{self.size}"

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"
