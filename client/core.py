"""Synchronous client of `spec_decode`.

    with Client("localhost:8001") as client:
        print(client.generate("def fib(n):", max_tokens=32).text)
        for item in client.stream("def fib(n):", max_tokens=32):
            ...  # Delta per response, then the Completion

A `Client` runs an `AsyncClient` on its own event-loop thread, so one client is safe to share between
threads: concurrent calls become concurrent requests over one connection (one gRPC stream each).
Leaving a `for` loop over `stream()` early, or the timeout, cancels the request on the server.
"""
from __future__ import annotations

import asyncio
import queue
import threading
from concurrent.futures import Future
from typing import Awaitable, Iterator, Sequence, TypeVar

from .aio import AsyncClient
from .types import Completion, Delta

T = TypeVar("T")
END = object()


class Client:
    """`url` is `host:port` (gRPC port for "grpc", HTTP port for "http"); `timeout` in seconds applies
    to each attempt of a request, None waits forever; `retries` resends a request that found the
    server unavailable before its first response (see `AsyncClient`)."""

    def __init__(
        self,
        url: str | None = None,
        protocol: str = "grpc",
        timeout: float | None = None,
        model: str = "spec_decode",
        retries: int = 0,
        retry_delay: float = 0.5,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="triton-mtp-client", daemon=True)
        self.thread.start()
        try:
            self.aio = self.call(self.make(url, protocol, timeout, model, retries, retry_delay))
        except BaseException:
            self.stop_loop()
            raise
        self.url, self.protocol = self.aio.url, self.aio.protocol

    @staticmethod
    async def make(url: str | None, protocol: str, timeout: float | None, model: str, retries: int,
                   retry_delay: float) -> AsyncClient:
        return AsyncClient(url, protocol, timeout, model, retries, retry_delay)  # built on the loop that uses its channel

    def call(self, coroutine: Awaitable[T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: cancel the request too
            raise

    def generate(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        max_tokens: int = 64,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        num_draft_tokens: int | None = None,
        stop: Sequence[str] | None = None,
        return_logprobs: bool = False,
        timeout: float | None = None,
    ) -> Completion:
        """One completion in one response; see `AsyncClient.generate`."""
        options = dict(locals())
        del options["self"]
        return self.call(self.aio.generate(**options))

    def stream(
        self,
        prompt: str | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        max_tokens: int = 64,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        num_draft_tokens: int | None = None,
        stop: Sequence[str] | None = None,
        return_logprobs: bool = False,
        timeout: float | None = None,
    ) -> Iterator[Delta | Completion]:
        """Yield a `Delta` per streamed response (a decoding step, or `stream_interval` tokens) as it arrives,
        then the `Completion`."""
        options = dict(locals())
        del options["self"]
        stream = self.aio.stream(**options)
        items: queue.Queue = queue.Queue()

        async def pump() -> None:
            try:
                async for item in stream:
                    items.put(item)
                items.put(END)
            except Exception as exc:
                items.put(exc)

        future: Future = asyncio.run_coroutine_threadsafe(pump(), self.loop)
        try:
            while (item := items.get()) is not END:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            future.cancel()

    def close(self) -> None:
        if self.loop.is_running():
            self.call(self.aio.close())
            self.stop_loop()

    def stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
