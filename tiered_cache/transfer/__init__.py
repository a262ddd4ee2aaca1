"""Moving bytes between the tiers: the transfer engine and the moves built on it.

    engine.py   TransferEngine: tickets on their own D2H / H2D streams, checksummed on the GPU
    ticket.py   Ticket: one submitted move and the events that say when it landed
    scatter.py  ScatterCopier: scattered device rows to and from host slots (copy, staging, kernel, batch)
    batch_dma.py  BatchDMA: many copies in one cudaMemcpyBatchAsync call, where cuda-bindings has it
    moves.py    the moves between T0, T1 and T2 for many scattered slots per call
"""

from __future__ import annotations

from tiered_cache.transfer.engine import Ticket, TransferEngine

__all__ = ["Ticket", "TransferEngine"]
