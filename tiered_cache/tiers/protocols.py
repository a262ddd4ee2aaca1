"""What the radix tree, T1 and the T2 moves need of T0: ``T0Pool`` and its sides, ``KVSide`` and
``StateSide``.

T0 is the engine's active memory: the KV pages of cached and running tokens, and the recurrent
states of running requests. ``UnifiedPool``'s sides (``SubPool``) are one implementation; an
engine's own memory pools (SGLang's token-to-KV pool and Mamba pool) can be another, by offering
these few members. Nothing above T0 reaches past them (no ``.allocator``, no pool object)::

    tree   --alloc / free (free_pages) / available_size / translate / live_virtual_ids-->  side
    T1     --translate_host, temporal_view_all / conv_view_all (spec, device)-->  state side
    moves  --physical_rows, rows_bytes, mark_busy / unmark_busy, add_fence-->  side

Ids. Everything above the side holds *virtual* ids; only the side knows physical rows. A KV side
speaks token ids (``page * page_size + offset``, whole pages) in ``alloc``/``free``/``translate``
and page ids in ``physical_rows``, ``live_virtual_ids`` and the busy marks; a state side has
``page_size`` 1, so its token, page and slot ids are one. Id 0 of each side is a reserved sink
that padded writes land in: it is never handed out. ``alloc`` returning ``None`` means no room,
with nothing changed; misuse raises a typed error from ``tiered_cache.errors`` naming the argument.

Views are indexed by *physical* row (``translate`` first) and alias the side's memory, so a model
or a kernel reads and writes slots in place.

The T2 moves copy whole slot envelopes (``rows_bytes``: one uint8 row of ``entry_bytes`` per
physical row, every layer's fields inside) on copy streams, so a side they work on promises two
things: ``free`` refuses an id marked busy (a transfer still reads or writes its row), and before
it moves any row (compaction) it calls every fence registered with ``add_fence`` (the transfer
engine makes compute wait for its copies there).

A KV side whose pages lie in one buffer per layer offers ``layer_rows`` instead (``LayeredKVSide``):
the moves gather each page's fields into an envelope on the device before a D2H copy, and scatter
a landed envelope back into the layers after an H2D copy (the bytes cross HBM once more).

The radix trees take a ``T0Pool``: an object that hands out its sides by name (``side(name)``) and
checks its own invariants. ``UnifiedPool`` is one (its two sides share one buffer); an engine's pools
are another, whose sides may share nothing (then evicting KV frees no state slot).

The protocols are ``runtime_checkable``: ``isinstance`` checks that the members exist, not their
types, so a ``SubPool`` of either kind passes both checks; ``spec``'s type says which kind a side is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Optional, Protocol, runtime_checkable

import numpy as np
import torch

from tiered_cache.specs import KVSpec, StateSpec


@runtime_checkable
class ActiveSide(Protocol):
    """The members every T0 side has, KV or state."""

    @property
    def name(self) -> str:
        """The side's name, used in error messages (``"full"``, ``"mamba"``, ``"swa"``)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the side's memory, its views and the ids ``alloc`` returns live."""
        ...

    @property
    def page_size(self) -> int:
        """Tokens per slot: a KV page's tokens; 1 on a state side."""
        ...

    @property
    def entry_bytes(self) -> int:
        """Bytes of one slot envelope (one page of every layer, or one request's whole state)."""
        ...

    @property
    def capacity(self) -> int:
        """Physical rows of the views, the sink included; every page / slot id is below it."""
        ...

    def alloc(self, n: int) -> Optional[torch.Tensor]:
        """``n`` virtual ids (tokens of whole pages on a KV side) on ``device``, or ``None`` if no room."""
        ...

    def free(self, ids: torch.Tensor) -> None:
        """Return ids from ``alloc``; free, unknown, repeated or busy ids raise before anything changes."""
        ...

    def available_size(self) -> int:
        """What ``alloc`` can return now: tokens on a KV side, slots on a state side."""
        ...

    def translate(self, ids: torch.Tensor) -> torch.Tensor:
        """Virtual token ids -> physical token ids on the device (one gather, CUDA-graph safe)."""
        ...

    def translate_host(self, ids: np.ndarray) -> np.ndarray:
        """``translate`` on the host, without device work; a free id maps to a negative row."""
        ...

    def physical_rows(self, vids: Sequence[int], arg: str = "vids") -> list[int]:
        """Allocated virtual page (slot) ids -> physical rows on the host; the sink, free or unknown
        ids raise ``SlotStateError`` naming ``arg``."""
        ...

    def live_virtual_ids(self) -> list[int]:
        """The allocated virtual page (slot) ids, ascending, the sink left out."""
        ...

    def rows_bytes(self) -> torch.Tensor:
        """``[capacity, entry_bytes]`` uint8 view: one row per slot envelope (what T2 copies)."""
        ...

    def mark_busy(self, ids: Iterable[int]) -> None:
        """Page (slot) ids a transfer in flight reads or writes: ``free`` refuses them until unmarked."""
        ...

    def unmark_busy(self, ids: Iterable[int]) -> None:
        """Undo one ``mark_busy`` of these ids (marks count: two transfers need two unmarks)."""
        ...

    def add_fence(self, fence: Callable[[], None]) -> None:
        """Call ``fence()`` before any row moves (compaction); adding the same fence twice keeps one."""
        ...


@runtime_checkable
class KVSide(ActiveSide, Protocol):
    """A T0 side of KV pages (full attention, or a sliding window's), ``spec`` a ``KVSpec``."""

    @property
    def spec(self) -> KVSpec: ...

    def free_pages(self, pages: list[int]) -> None:
        """Trusted ``free`` of whole virtual pages (page ids, not token ids) that the caller took from
        ``alloc`` and validated once, when they came to it: each at most once, no check but the busy
        marks. The radix tree frees the pages it owns this way; everything else calls ``free``."""
        ...

    def k_view_all(self) -> torch.Tensor:
        """K of every layer: ``[L, capacity, page_size, kv_heads, head_dim]``."""
        ...

    def v_view_all(self) -> torch.Tensor:
        """V of every layer: ``[L, capacity, page_size, kv_heads, v_head_dim]``."""
        ...


@runtime_checkable
class LayeredKVSide(ActiveSide, Protocol):
    """A KV side whose pages lie in one buffer per layer (an engine's own KV pool, such as SGLang's
    ``MHATokenToKVPool``), so no ``[capacity, entry_bytes]`` row view exists (``rows_bytes`` may raise).
    The T2 moves gather its fields into page envelopes on the device and scatter them back
    (``transfer.moves``); sides with ``rows_bytes`` (``UnifiedPool``'s) keep the direct copy."""

    @property
    def spec(self) -> KVSpec: ...

    def layer_rows(self) -> list[tuple[int, torch.Tensor]]:
        """Each field of the page envelope, in envelope order (K, then V, of each layer): its byte offset
        in the envelope (``spec.field_offsets(page_size)``) and a ``[capacity, nbytes]`` uint8 view of
        its bytes, one row per physical page, aliasing the side's memory."""
        ...


@runtime_checkable
class StateSide(ActiveSide, Protocol):
    """A T0 side of running requests' recurrent states, one slot each, ``spec`` a ``StateSpec``."""

    @property
    def spec(self) -> StateSpec: ...

    def temporal_view_all(self) -> torch.Tensor:
        """Temporal states of every layer: ``[L, capacity, *spec.temporal_shape]``."""
        ...

    def conv_view_all(self, i: int = 0) -> torch.Tensor:
        """Conv window ``i`` of every layer: ``[L, capacity, *spec.conv_shapes[i]]``."""
        ...


@runtime_checkable
class T0Pool(Protocol):
    """T0 as the radix trees take it: its sides by name, and its own invariants."""

    def side(self, name: str) -> ActiveSide:
        """The side called ``name`` (a typed error naming ``name`` for one it does not have)."""
        ...

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's own bookkeeping is inconsistent."""
        ...
