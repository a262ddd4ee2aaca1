"""The one place that knows CUDA from CPU: streams, events, pinned memory, synchronize, free memory.

On a machine without CUDA, streams and events are no-ops (work runs synchronously on the caller's
thread, so an event is complete as soon as it is recorded) and pinned allocations are ordinary
ones. Everything above this module calls these functions and never asks ``torch.cuda`` itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch

from tiered_cache.errors import InvalidArgumentError, InvalidTypeError

DeviceLike = Union[str, torch.device, None]  # None: the default device (``resolve``)
Device = Union[str, torch.device]  # a device already chosen


def cuda_available() -> bool:
    return torch.cuda.is_available()


def resolve(device: DeviceLike = None) -> torch.device:
    """``None`` or ``"auto"`` -> the GPU when there is one, else the CPU.

    Only ``cpu`` and (where CUDA exists) ``cuda``/``cuda:N`` are devices here: a meta tensor holds no
    bytes to cache and other backends have no streams; a typed error names ``device`` otherwise.
    """
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda", torch.cuda.current_device()) if cuda_available() else torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise InvalidTypeError("device", "a str or torch.device ('cpu', 'cuda', 'cuda:N', 'auto')", device)
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise InvalidArgumentError("device", "'cpu', 'cuda', 'cuda:N' or 'auto'", device) from None
    if dev.type == "cuda":
        if not cuda_available():
            raise InvalidArgumentError("device", "a device that exists (no CUDA here)", str(dev))
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise InvalidArgumentError("device", f"cuda:N with N < {torch.cuda.device_count()}", str(dev))
    elif dev.type != "cpu":
        raise InvalidArgumentError("device", "'cpu', 'cuda' or 'cuda:N'", str(dev))
    return dev


def is_cuda(device: Device) -> bool:
    return torch.device(device).type == "cuda"


class NullEvent:
    """Stands in for ``torch.cuda.Event`` on CPU: work is synchronous, so recording completes it."""

    def record(self, stream: object = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream: object = None) -> None:
        pass


class NullStream:
    """Stands in for ``torch.cuda.Stream`` on CPU."""

    def wait_stream(self, other: object) -> None:
        pass

    def wait_event(self, event: object) -> None:
        pass

    def record_event(self, event: Optional[NullEvent] = None) -> NullEvent:
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def new_stream(device: Device, priority: int = 0):
    """A new stream on ``device`` (a CUDA stream, or a ``NullStream`` on CPU)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.Stream(device=dev, priority=priority)
    return NullStream()


def current_stream(device: Device):
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.current_stream(dev)
    return NullStream()


def new_event(device: Device):
    if torch.device(device).type == "cuda":
        return torch.cuda.Event()
    return NullEvent()


_STREAMS: dict[tuple[int, int], Any] = {}  # (device index, raw handle) -> a torch stream object of that stream


def record_current(event, device: torch.device) -> None:
    """``event.record()`` on ``device``'s current stream (a ``torch.device``; no index: the current device), at a
    fraction of the host time: ``torch.cuda.current_stream`` builds a stream object each call (about 9 us on the
    H200 machine, 2026-12-02, as much as the rest of a T1 store's bookkeeping), so the object is kept per raw
    stream handle, which names one CUDA stream (a handle's object records on that stream whoever made it)."""
    if device.type != "cuda":
        event.record()
        return
    idx = device.index if device.index is not None else torch._C._cuda_getDevice()
    key = (idx, torch._C._cuda_getCurrentRawStream(idx))
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(idx)
    event.record(stream)


@contextlib.contextmanager
def use_stream(stream) -> Iterator[None]:
    """Make ``stream`` current inside the block (no-op for a ``NullStream``)."""
    if isinstance(stream, torch.cuda.Stream):
        with torch.cuda.stream(stream):
            yield
    else:
        yield


def cuda_graph() -> torch.cuda.CUDAGraph:
    """An empty CUDA graph, to capture into with ``graph_capture`` and ``replay`` later (CUDA only)."""
    return torch.cuda.CUDAGraph()


def graph_pool() -> Any:
    """A memory pool handle that several graphs' captures can share (CUDA only)."""
    return torch.cuda.graph_pool_handle()


def graph_capture(graph: torch.cuda.CUDAGraph, pool: Any = None,
                  mode: str = "thread_local") -> contextlib.AbstractContextManager:
    """The block's work on the current device is captured into ``graph``, not run (CUDA only).
    ``mode``: CUDA's capture mode; ``thread_local`` here (torch's default is ``global``), so a potentially
    unsafe call made by another thread meanwhile (a storage worker's, a user's) cannot invalidate it."""
    return torch.cuda.graph(graph, pool=pool, capture_error_mode=mode)


def synchronize(device: DeviceLike = None) -> None:
    dev = resolve(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def pinned_empty(nbytes: int, *, pin: bool = True) -> torch.Tensor:
    """A host ``uint8`` buffer; page-locked when CUDA exists and ``pin`` is set, else ordinary."""
    from tiered_cache.validate import int_arg

    int_arg("nbytes", nbytes, lo=0)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=bool(pin and cuda_available()))


def host_to_device(host: torch.Tensor, device: DeviceLike) -> torch.Tensor:
    """A small host tensor on ``device``, enqueued on the current stream without blocking the caller.

    On a GPU the bytes go through page-locked memory (torch's host allocator keeps the block until the
    copy is done): a copy from pageable memory would block this thread until the copy engine reaches it,
    behind every large host copy already queued. Elsewhere: a plain copy.
    """
    dev = resolve(device)
    if dev.type != "cuda":
        return host.to(dev)
    return host.pin_memory().to(dev, non_blocking=True)


def host_register(t: torch.Tensor) -> int:
    """Page-lock an existing host tensor in place (``cudaHostRegister``), so copies to and from it are
    DMA and kernels can read it through mapped memory; returns the CUDA error code (0: done)."""
    return int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0))


def host_unregister(t: torch.Tensor) -> None:
    """Undo ``host_register`` (the tensor's memory stays; it is pageable again)."""
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def multiprocessor_count(device: DeviceLike) -> int:
    """Streaming multiprocessors of a GPU (programs are launched in multiples of it)."""
    return int(torch.cuda.get_device_properties(resolve(device)).multi_processor_count)


def free_memory(device: DeviceLike) -> int:
    """Bytes that can still be allocated on ``device`` (GPU: ``cudaMemGetInfo``; CPU: MemAvailable)."""
    dev = resolve(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free)
    return host_available_memory()


def host_available_memory() -> int:
    """MemAvailable from /proc/meminfo, or the physical memory size where that file is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_name(device: DeviceLike = None) -> str:
    dev = resolve(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return "cpu"
