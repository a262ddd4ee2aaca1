"""Triton kernels with plain-torch twins in ``tiered_cache.kernels.reference``.

Named ``tiered_cache.kernels``, never a top-level ``kernels``: Hugging Face publishes a package of
that name which ``transformers`` imports when present, and a top-level folder would shadow it.
"""

from __future__ import annotations

import os

import torch


def use_triton(device: torch.device | str, backend: str = "auto") -> bool:
    """Whether to run the Triton kernel (``True``) or its torch twin (``False``).

    ``auto``: Triton on CUDA; on CPU the torch twin, since the Triton interpreter costs milliseconds
    per program instance and exists to test kernels, not to run workloads. ``triton`` on CPU needs
    ``TRITON_INTERPRET=1`` set before the kernels were imported.
    """
    if backend == "torch":
        return False
    if backend == "triton":
        if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            from tiered_cache.errors import InvalidArgumentError

            raise InvalidArgumentError("backend", "'torch' on CPU unless TRITON_INTERPRET=1", backend)
        return True
    if backend != "auto":
        from tiered_cache.errors import InvalidArgumentError

        raise InvalidArgumentError("backend", "'auto', 'triton' or 'torch'", backend)
    return torch.device(device).type == "cuda"
