"""Moving a hop's small tensors between host and GPU with one copy each way.

A decode step's payload is a handful of small tensors, and each separate copy between host and GPU waits
for the stream. Each torch call also lets go of the GIL, which at 32 streams the response threads then
hold (served_profile, run 26: the engine thread held the GIL for 38% of its busy time, most of the rest
waiting for it). So tensors travel packed: side by side in one buffer, packed and unpacked on the host
with numpy (no torch call per tensor), and copied once, through page-locked memory that is reused.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import numpy as np
import torch


class PinnedRing:
    """Page-locked host buffers that packed copies between host and GPU take in turn, so that a copy does
    not allocate page-locked memory (about 0.17 ms a call on the H200 host). A buffer is handed out again
    only once the copy that last used it has run (its event); a copy to the host is read (`PendingTarget`)
    long before its buffer comes round again."""

    def __init__(self, size: int = 4) -> None:
        self._buffers: list[tuple[torch.Tensor, np.ndarray] | None] = [None] * size
        self._events: list[torch.cuda.Event | None] = [None] * size
        self._next = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self, nbytes: int, stream: torch.cuda.Stream) -> Iterator[tuple[torch.Tensor, np.ndarray]]:
        """A pinned [nbytes] uint8 buffer, as a tensor and as a numpy array of the same memory, for a copy that
        the caller enqueues on `stream` inside the block."""
        with self._lock:
            i, self._next = self._next, (self._next + 1) % len(self._buffers)
            if self._events[i] is not None:
                self._events[i].synchronize()
            if self._buffers[i] is None or self._buffers[i][1].size < nbytes:
                buffer = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=True)
                self._buffers[i] = buffer, buffer.numpy()
            buffer, array = self._buffers[i]
            yield buffer[:nbytes], array[:nbytes]
            self._events[i] = stream.record_event()


TO_DEVICE, TO_HOST = PinnedRing(), PinnedRing()


def _numpy_dtype(dtype: torch.dtype) -> np.dtype | None:
    """numpy's dtype for a torch dtype, None where numpy has none (bfloat16)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return None


_NUMPY = {dtype: _numpy_dtype(dtype) for dtype in (torch.int64, torch.int32, torch.float32, torch.float64,
                                                    torch.bool, torch.float16, torch.bfloat16, torch.uint8)}


class Packing:
    """Where tensors' bytes go side by side in one uint8 buffer (each at an 8-byte aligned offset)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.metas = [(t.dtype, t.shape) for t in tensors]
        self.sizes = [t.numel() * t.element_size() for t in tensors]
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + -(-size // 8) * 8)
        self.nbytes = self.offsets[-1]

    def pack(self, tensors: list[torch.Tensor], buffer: torch.Tensor, array: np.ndarray | None = None) -> torch.Tensor:
        """`buffer` holding the tensors' bytes. With `array` (`buffer`'s memory as numpy, on the host), host
        tensors whose dtype numpy has are written through numpy: no torch call, so no GIL to win back."""
        for t, offset, size in zip(tensors, self.offsets, self.sizes):
            dtype = _NUMPY.get(t.dtype)
            if array is not None and dtype is not None and t.device.type == "cpu":
                array[offset: offset + size].view(dtype).reshape(t.shape)[...] = t.numpy()
            else:  # any strides: written through the dtype
                buffer[offset: offset + size].view(t.dtype).view(t.shape).copy_(t)
        return buffer

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """The tensors, viewed back in `buffer` (which holds their packed bytes)."""
        return [buffer[offset: offset + size].view(dtype).view(shape)
                for (dtype, shape), offset, size in zip(self.metas, self.offsets, self.sizes)]

    def host_views(self, array: np.ndarray) -> list[torch.Tensor]:
        """The tensors as host tensors over `array` (their packed bytes, on the host; not copied), viewed
        through numpy where it has their dtypes."""
        views = []
        for (dtype, shape), offset, size in zip(self.metas, self.offsets, self.sizes):
            if _NUMPY.get(dtype) is None:
                views.append(torch.from_numpy(array[offset: offset + size]).view(dtype).view(shape))
            else:
                views.append(torch.from_numpy(array[offset: offset + size].view(_NUMPY[dtype]).reshape(shape)))
        return views


def packed_copy(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`tensors` (all on one device) on `device` with a single transfer: their bytes side by side in one
    buffer (`Packing`), copied once, and viewed back as the original dtypes and shapes. The result never
    aliases `tensors`, even on their own device.

    From the host to a GPU the bytes go through pinned memory without the host waiting: the stream runs
    the copy before any kernel launched after it."""
    packing = Packing(tensors)
    source = tensors[0].device
    if source.type == "cpu" and device.type == "cuda":
        with TO_DEVICE.take(packing.nbytes, torch.cuda.current_stream(device)) as (staging, array):
            moved = packing.pack(tensors, staging, array).to(device, non_blocking=True)
    elif source.type == "cpu":
        array = np.empty(packing.nbytes, dtype=np.uint8)
        moved = packing.pack(tensors, torch.from_numpy(array), array).to(device)
    else:
        moved = packing.pack(tensors, torch.empty(packing.nbytes, dtype=torch.uint8, device=source)).to(device)
    return packing.views(moved)


def to_device(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """`tensors` on `device`: those already there as they are, the rest moved with one transfer per source
    device (`packed_copy`)."""
    moving: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.device != device:
            moving.setdefault(t.device, []).append(i)
    moved = list(tensors)
    for index in moving.values():
        for i, t in zip(index, packed_copy([tensors[i] for i in index], device)):
            moved[i] = t
    return moved


class PendingHost:
    """`tensors` (on one device) on their way to the host with one transfer, asynchronous from a GPU: packed
    on their device (a single contiguous tensor needs no packing) and copied into a buffer of the pinned
    ring, which `tensors()` reads once the stream has passed the copy (a CUDA event: later work keeps the
    device busy meanwhile) and copies out before four more such copies."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._packing = Packing(tensors)
        source = tensors[0].device
        if source.type != "cuda":
            self._host, self._event = packed_copy(tensors, torch.device("cpu")), None
            return
        stream = torch.cuda.current_stream(source)
        if len(tensors) == 1 and tensors[0].is_contiguous():
            packed = tensors[0].view(-1).view(torch.uint8)
        else:
            packed = self._packing.pack(tensors, torch.empty(self._packing.nbytes, dtype=torch.uint8, device=source))
        with TO_HOST.take(self._packing.nbytes, stream) as (pinned, self._array):
            pinned[: packed.shape[0]].copy_(packed, non_blocking=True)
        self._event = stream.record_event()

    def tensors(self) -> list[torch.Tensor]:
        """The host tensors, their own (not the ring's); every call returns the same ones."""
        if self._event is not None:
            self._event.synchronize()
            self._host = self._packing.host_views(self._array.copy())  # out of the ring, which later copies reuse
            self._event = None
        return self._host
