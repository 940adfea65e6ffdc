"""asyncio client of `spec_decode`.

    async with AsyncClient("localhost:8001") as client:
        completion = await client.generate("def fib(n):", max_tokens=32)
        async for item in client.stream("def fib(n):", max_tokens=32):
            ...  # Delta per response, then the Completion

One client serves any number of concurrent requests (tasks) of its event loop. Cancelling the task,
leaving `async for` early or passing the timeout cancels the request on the server, which frees its
slot.

Retries: a request that fails as unavailable (server down or restarting, model not ready, all slots
busy) before its first response is sent again, `retries` times, waiting `retry_delay` seconds and
doubling up to `MAX_RETRY_DELAY_S`. Once a response has arrived nothing is retried: tokens already
given to the caller would repeat.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Sequence

from . import errors
from .transport import GrpcTransport, HttpTransport
from .types import Completion, CompletionBuilder, Delta, GenerateRequest

PROTOCOLS = {"grpc": GrpcTransport, "http": HttpTransport}
DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}
MAX_RETRY_DELAY_S = 4.0


class AsyncClient:
    """`url` is `host:port` (gRPC port for "grpc", HTTP port for "http"); `timeout` in seconds applies
    to each attempt of a request, None waits forever; `retries` resends a request that found the
    server unavailable before its first response."""

    def __init__(
        self,
        url: str | None = None,
        protocol: str = "grpc",
        timeout: float | None = None,
        model: str = "spec_decode",
        retries: int = 0,
        retry_delay: float = 0.5,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        if retries < 0 or retry_delay < 0:
            raise ValueError(f"retries and retry_delay must be >= 0, got {retries} and {retry_delay}")
        self.url = url or DEFAULT_URLS[protocol]
        self.protocol, self.timeout, self.model = protocol, timeout, model
        self.retries, self.retry_delay = retries, retry_delay
        self.transport = PROTOCOLS[protocol](self.url, model)

    async def responses(self, request: GenerateRequest, timeout: float | None) -> AsyncIterator[dict[str, Any]]:
        """The transport's responses to `request`, retried while the server is unavailable before the first."""
        delay = self.retry_delay
        for attempt in range(self.retries + 1):
            started = False
            responses = self.transport.responses(request, timeout)
            try:
                async for response in responses:
                    started = True
                    yield response
                return
            except errors.UnavailableError:
                if started or attempt == self.retries:
                    raise
            finally:
                await responses.aclose()
            await asyncio.sleep(delay)
            delay = min(2 * delay, MAX_RETRY_DELAY_S)

    async def generate(
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
        """One completion in one response (the model's `stream` off)."""
        request = GenerateRequest(
            prompt=prompt, input_ids=input_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, num_draft_tokens=num_draft_tokens, stop=stop, return_logprobs=return_logprobs,
        )
        builder = CompletionBuilder(self.url)
        async for response in self.responses(request, self.request_timeout(timeout)):
            builder.add(response)
        return builder.build()

    async def stream(
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
    ) -> AsyncIterator[Delta | Completion]:
        """Yield a `Delta` per streamed response (a decoding step, or `stream_interval` tokens) as the server
        sends it, then the `Completion`."""
        request = GenerateRequest(
            prompt=prompt, input_ids=input_ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, seed=seed, num_draft_tokens=num_draft_tokens, stop=stop, return_logprobs=return_logprobs,
            stream=True,
        )
        builder = CompletionBuilder(self.url)
        responses = self.responses(request, self.request_timeout(timeout))
        try:
            async for response in responses:
                delta = builder.add(response)
                if delta.ids or delta.text:
                    yield delta
        finally:
            await responses.aclose()
        yield builder.build()

    def request_timeout(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    async def close(self) -> None:
        await self.transport.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
