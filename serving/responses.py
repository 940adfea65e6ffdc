"""Streamed responses sent by threads of their own, while the engine computes its next step.

In Triton a response is a message from the Python backend's stub to the server that waits for its
reply (the GIL released meanwhile): 0.27 ms each on the H200 host. At 32 streams, sending a step's
responses took 8.5 of the 13.2 ms step (docs/benchmarks.md, run 10). `ResponseThreads` sends them from
N threads. Each request always goes to the same thread, so its responses keep their order. The
scheduler calls `drain()` once per step, after that step's hops, so the sending overlaps one step's
compute and never falls further behind.
"""
from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable

from triton_mtp.serving.requests import GenerationResponse
from triton_mtp.serving.scheduler import ResponseHandle


class ResponseThreads:
    """`threads` sending threads; `close()` sends what is queued, then stops them."""

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"response_threads: must be >= 1 to send from threads, got {threads}")
        self._queues: list[queue.Queue[tuple[Callable, tuple] | None]] = [queue.Queue() for _ in range(threads)]
        self._next = itertools.cycle(self._queues)
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"spec_decode-responses-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]
        for t in self._threads:
            t.start()

    def handle(self, handle: ResponseHandle) -> ResponseHandle:
        """`handle` with its sends queued for one of the threads (its cancellation is still asked directly)."""
        return _Queued(handle, next(self._next))

    def drain(self) -> None:
        """Wait until everything queued so far has been sent."""
        for q in self._queues:
            q.join()

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()

    @staticmethod
    def _run(sends: queue.Queue) -> None:
        while (item := sends.get()) is not None:
            send, args = item
            try:
                send(*args)
            except Exception:  # noqa: BLE001 - the client is gone; the engine notices through cancellation
                pass
            finally:
                sends.task_done()


class _Queued:
    def __init__(self, handle: ResponseHandle, sends: queue.Queue) -> None:
        self._handle, self._sends = handle, sends

    def send(self, response: GenerationResponse, final: bool) -> None:
        self._sends.put((self._handle.send, (response, final)))

    def send_error(self, message: str) -> None:
        self._sends.put((self._handle.send_error, (message,)))

    def is_cancelled(self) -> bool:
        return self._handle.is_cancelled()
