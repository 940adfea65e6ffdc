"""Moving a hop's small tensors between host and GPU with one copy each way.

A decode step's payload is a handful of small tensors, and each separate copy between host and GPU waits
for the stream. Each torch call also lets go of the GIL, which at 32 streams the response threads then
hold (served_profile, run 26: the engine thread held the GIL for 38% of its busy time, most of the rest
waiting for it). So tensors travel packed: side by side in one buffer, packed and unpacked on the host
with numpy (no torch call per tensor), and copied once, through page-locked memory that is reused.
"""
from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import numpy as np
import torch


class StreamOrder:
    """Which copies between host and GPU the host knows have run, without an event each.

    Every copy through a `PinnedRing` takes a ticket, in the order the copies are enqueued (from one thread),
    and so does every event the host later waits on (`PendingHost`). Once the host has waited on an event,
    every copy on its stream with a smaller ticket has run: its pinned buffer can be handed out again. An
    event of its own per copy would cost two torch calls more per copy, and each torch call lets go of the
    GIL, which at 32 streams the response threads then hold (`PinnedRing`)."""

    def __init__(self) -> None:
        self._issued = 0
        self._seen: dict[tuple[int, int], int] = {}  # per stream (device, handle): the largest ticket known to have run

    def ticket(self) -> int:
        self._issued += 1
        return self._issued

    def ran(self, stream: torch.cuda.Stream, ticket: int) -> None:
        """The host has seen `stream` run the work enqueued before `ticket` was taken (it waited on an event)."""
        key = stream.device_index, stream.cuda_stream  # (each device's default stream has handle 0)
        if ticket > self._seen.get(key, 0):
            self._seen[key] = ticket

    def has_run(self, stream: torch.cuda.Stream, ticket: int) -> bool:
        return ticket <= self._seen.get((stream.device_index, stream.cuda_stream), 0)

    def wait(self, stream: torch.cuda.Stream, ticket: int) -> None:
        """Until the copy that took `ticket` on `stream` has run (where the host has not seen it yet: the stream's
        work so far)."""
        if not self.has_run(stream, ticket):
            stream.synchronize()
            self.ran(stream, self._issued)


STREAM_ORDER = StreamOrder()


class PinnedSlot:
    """One page-locked buffer of a `PinnedRing`, as a uint8 tensor and as a numpy array of the same memory, with
    typed views of its first bytes made once each (a view is a torch call)."""

    def __init__(self, nbytes: int) -> None:
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.array = self.tensor.numpy()
        self._views: dict[tuple[torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self.used: tuple[torch.cuda.Stream, int] | None = None  # the stream and ticket of the copy that last used it

    MAX_VIEWS = 256  # a bound: the decode loop's shapes are a few per batch bucket

    def view(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """Its first bytes as a tensor of `dtype` and `shape`, for the decode loop's fixed shapes (a payload of any
        size takes `tensor[:nbytes]`)."""
        key = (dtype, tuple(shape))
        view = self._views.get(key)
        if view is None:
            if len(self._views) >= self.MAX_VIEWS:
                self._views.clear()
            nbytes = math.prod(shape) * dtype.itemsize
            view = self._views[key] = self.tensor[:nbytes].view(dtype).view(shape)
        return view


class PinnedRing:
    """Page-locked host buffers that packed copies between host and GPU take in turn, so that a copy does
    not allocate page-locked memory (about 0.17 ms a call on the H200 host). A buffer is handed out again
    only once the copy that last used it has run (`StreamOrder`: in a decode loop the host has waited on a
    later call's result by then); a copy to the host is read (`PendingTarget`) long before its buffer comes
    round again."""

    def __init__(self, size: int = 4) -> None:
        self._slots: list[PinnedSlot | None] = [None] * size
        self._next = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self, nbytes: int, stream: torch.cuda.Stream) -> Iterator[PinnedSlot]:
        """A slot of at least `nbytes` for a copy that the caller enqueues on `stream` inside the block."""
        with self._lock:
            i, self._next = self._next, (self._next + 1) % len(self._slots)
            slot = self._slots[i]
            if slot is not None and slot.used is not None:
                STREAM_ORDER.wait(*slot.used)
            if slot is None or slot.array.size < nbytes:
                slot = self._slots[i] = PinnedSlot(max(nbytes, 4096))
            yield slot
            slot.used = stream, STREAM_ORDER.ticket()


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

    def host_views(self, array: np.ndarray) -> list[np.ndarray | torch.Tensor]:
        """The tensors over `array` (their packed bytes, on the host; not copied): numpy arrays where numpy has
        their dtypes (no torch call), else host tensors."""
        views = []
        for (dtype, shape), offset, size in zip(self.metas, self.offsets, self.sizes):
            if _NUMPY.get(dtype) is None:
                views.append(torch.from_numpy(array[offset: offset + size]).view(dtype).view(shape))
            else:
                views.append(array[offset: offset + size].view(_NUMPY[dtype]).reshape(shape))
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
        with TO_DEVICE.take(packing.nbytes, torch.cuda.current_stream(device)) as slot:
            staging = slot.tensor[: packing.nbytes]
            moved = packing.pack(tensors, staging, slot.array[: packing.nbytes]).to(device, non_blocking=True)
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
    on their device (a single tensor is copied as it is) into a buffer of the pinned ring, which
    `arrays()` reads once the stream has passed the copy (a CUDA event: later work keeps the device busy
    meanwhile) and copies out before four more such copies."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self._packing = Packing(tensors)
        source = tensors[0].device
        if source.type != "cuda":  # packed into a buffer of its own, read as from the ring
            array = np.empty(self._packing.nbytes, dtype=np.uint8)
            self._packing.pack(tensors, torch.from_numpy(array), array)
            self._host, self._event = self._packing.host_views(array), None
            return
        self._stream = torch.cuda.current_stream(source)
        nbytes = self._packing.nbytes
        with TO_HOST.take(nbytes, self._stream) as slot:
            if len(tensors) == 1:  # one copy into its dtype's view of the slot
                slot.view(tensors[0].dtype, tensors[0].shape).copy_(tensors[0], non_blocking=True)
            else:
                packed = self._packing.pack(tensors, torch.empty(nbytes, dtype=torch.uint8, device=source))
                slot.tensor[:nbytes].copy_(packed, non_blocking=True)
            self._array = slot.array[:nbytes]
        self._event, self._ticket = self._stream.record_event(), STREAM_ORDER.ticket()

    def arrays(self) -> list[np.ndarray | torch.Tensor]:
        """The tensors on the host, their own (not the ring's): numpy arrays where numpy has their dtypes, else
        host tensors; every call returns the same ones."""
        if self._event is not None:
            self._event.synchronize()
            STREAM_ORDER.ran(self._stream, self._ticket)
            self._host = self._packing.host_views(self._array.copy())  # out of the ring, which later copies reuse
            self._event = None
        return self._host
