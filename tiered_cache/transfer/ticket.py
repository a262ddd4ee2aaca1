"""``Ticket``: one submitted move of the ``TransferEngine`` and the events that say when it landed.

Who waits for whom::

    compute stream --(wait_stream at submit)--> copy stream: the copies read what compute wrote
    copy stream    --(event)------------------> the ticket is done once it fired (poll / wait)
    checksum stream --(check_event)-----------> the ticket's ``ok`` is known once it fired too
    copy stream    --(layer_events[k])--------> compute waits on layer k (``wait_layer``) while
                                                layer k+1 is still in flight

When the engine completes a ticket it makes the compute stream wait on both events, then records the
result (``ok``) and releases the busy marks of the slots the ticket read or wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class Ticket:
    """One submitted move. ``ok[i]`` is whether item ``i`` arrived intact (known once ``done``)."""

    id: int
    direction: str  # "d2h" | "h2d"
    kind: str
    nbytes: int
    host_slots: list[int]
    event: Any = None  # the copy stream's last event (after the copies and any ``after`` work)
    check_event: Any = None  # the checksum stream's (None when checksums are off)
    layer_events: list[Any] = field(default_factory=list)
    done: bool = False
    ok: list[bool] = field(default_factory=list)
    # internal: what finishing does, the busy marks to release, and the tensors the side streams use
    # (held until the ticket completes, so the caching allocator cannot hand their memory to compute
    # while a copy still reads or writes it)
    _finish: Optional[Callable[[Ticket], None]] = None
    _release: list[Callable[[], None]] = field(default_factory=list)
    _keep: Optional[list[Any]] = None

    def wait_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: the current one) wait until layer ``layer`` has landed."""
        ev = self.layer_events[layer] if self.layer_events else self.event
        if ev is not None and hasattr(ev, "wait"):
            ev.wait(stream) if stream is not None else ev.wait()
