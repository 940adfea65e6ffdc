"""Streamed responses sent by threads of their own, while the engine computes its next step.

In Triton a response is a message from the Python backend's stub to the server that waits for its
reply (the GIL released meanwhile): 0.27 ms each on the H200 host. At 32 streams, sending a step's
responses took 8.5 of the 13.2 ms step (docs/benchmarks.md, run 10). `ResponseThreads` sends them from
N threads. Each request always goes to the same thread, so its responses keep their order. The
scheduler calls `drain()` after each target call it reads (once a step; twice in a step that prefills
prompts in a call of their own): it waits for the responses queued before the drain `lag_steps` drains
earlier, so the sending overlaps `lag_steps + 1` steps' compute and never falls further behind than that.

Asking whether a request was cancelled is such a round trip too (7% of the engine thread's time at 32
streams, run 26): each thread also asks for its own requests, every `cancel_check_interval_s`, and the
engine reads the answer the thread last got.
"""
from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from collections.abc import Callable

from triton_mtp.serving.requests import GenerationRequest, GenerationResponse
from triton_mtp.serving.scheduler import ResponseHandle


class ResponseThreads:
    """`threads` sending threads; `close()` sends what is queued, then stops them."""

    def __init__(self, threads: int, cancel_check_interval_s: float = 0.05, lag_steps: int = 0) -> None:
        if threads < 1:
            raise ValueError(f"response_threads: must be >= 1 to send from threads, got {threads}")
        if not cancel_check_interval_s > 0:
            raise ValueError(f"cancel_check_interval_s: must be > 0, got {cancel_check_interval_s}")
        if lag_steps < 0:
            raise ValueError(f"response_lag_steps: must be >= 0, got {lag_steps}")
        self._lag = lag_steps
        self._marks: collections.deque[list[threading.Event]] = collections.deque()  # one per drain: [threads]
        self._queues: list[queue.Queue[tuple[Callable, tuple] | None]] = [queue.Queue() for _ in range(threads)]
        self._handles: list[set[_Queued]] = [set() for _ in range(threads)]  # per thread: requests not finished
        self._lock = threading.Lock()
        self._interval = cancel_check_interval_s
        self._next = itertools.cycle(range(threads))
        self._threads = [threading.Thread(target=self._run, args=(i,), name=f"spec_decode-responses-{i}", daemon=True)
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def handle(self, handle: ResponseHandle) -> ResponseHandle:
        """`handle` with its sends queued for one of the threads, which also asks whether it was cancelled."""
        i = next(self._next)
        queued = _Queued(handle, self._queues[i])
        with self._lock:
            self._handles[i].add(queued)
        return queued

    def submit(self, submit: Callable[[GenerationRequest, ResponseHandle], None], request: GenerationRequest,
               handle: ResponseHandle) -> None:
        """`submit(request, handle(handle))`; a request it refuses (it raises: the caller answers it) is not
        asked about again."""
        queued = self.handle(handle)
        try:
            submit(request, queued)
        except BaseException:
            queued.done = True
            raise

    def drain(self) -> None:
        """Wait until everything queued before the last `lag_steps` drains (with 0: so far) has been sent. With a
        lag, each drain queues a mark behind what is queued, which a thread sets once it reaches it; without,
        the queues are joined (no mark to queue, no idle thread woken each step)."""
        if not self._lag:
            for q in self._queues:
                q.join()
            return
        marks = [threading.Event() for _ in self._queues]
        for q, mark in zip(self._queues, marks):
            q.put((mark.set, ()))
        self._marks.append(marks)
        while len(self._marks) > self._lag:
            for mark in self._marks.popleft():
                mark.wait()

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()

    def _run(self, i: int) -> None:
        sends, asked = self._queues[i], time.monotonic()
        while True:
            try:
                item = sends.get(timeout=self._interval)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                send, args = item
                try:
                    send(*args)
                except Exception:  # noqa: BLE001 - the client is gone; the engine notices through cancellation
                    pass
                finally:
                    sends.task_done()
            if time.monotonic() - asked >= self._interval:
                self._ask_cancelled(i)
                asked = time.monotonic()

    def _ask_cancelled(self, i: int) -> None:
        with self._lock:  # a copy to ask from: `handle()` adds to the set meanwhile
            self._handles[i] = {h for h in self._handles[i] if not h.done}
            live = list(self._handles[i])
        for h in live:
            try:
                h.cancelled = h.cancelled or h.handle.is_cancelled()
            except Exception:  # noqa: BLE001 - asked again next time
                pass


class _Queued:
    def __init__(self, handle: ResponseHandle, sends: queue.Queue) -> None:
        self.handle, self._sends = handle, sends
        self.cancelled = False  # as its sending thread last asked
        self.done = False  # its final response (or error) is queued: no more asking

    def send(self, response: GenerationResponse, final: bool) -> None:
        self.done = self.done or final
        self._sends.put((self.handle.send, (response, final)))

    def send_error(self, message: str) -> None:
        self.done = True
        self._sends.put((self.handle.send_error, (message,)))

    def is_cancelled(self) -> bool:
        return self.cancelled
