"""The two ways a request reaches `spec_decode`; each yields the model's responses as plain dicts.

- gRPC (`tritonclient.grpc.aio`): every request opens its own bidirectional `ModelStreamInfer` call on
  the client's one channel (HTTP/2 multiplexes them), so cancelling that call cancels exactly that
  request on the server. A decoupled model's responses carry `triton_final_response`.
- HTTP (aiohttp): Triton's generate extension. Requests go to `POST /v2/models/{model}/generate_stream`
  (server-sent events) with `stream` on, also for a single completion: the server notices a closed
  connection only when it writes, and on `/generate` it writes once, at the end, so a timed-out or
  cancelled request would keep its slot until it finished.

A response dict maps response tensor names to a str (`text_output`, `finish_reason`), an int (the
totals) or a list (`output_ids`, `logprobs`, `accepted_per_position`).
"""
from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, AsyncIterator

import aiohttp
import grpc
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE, KeepAliveOptions

from . import errors
from .types import RESPONSE_TENSORS, TOTALS, GenerateRequest

LIST_TENSORS = ("output_ids", "logprobs", "accepted_per_position")


def plain(name: str, value: Any) -> Any:
    """One response field as str / int / list, whatever shape the protocol gave it."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if name in LIST_TENSORS:
        return value if isinstance(value, list) else [value]
    if isinstance(value, list):
        value = value[0]
    if isinstance(value, bytes):
        value = value.decode("utf-8", errors="replace")
    return int(value) if name in TOTALS else value


# tritonclient's channel options, plus a reconnect backoff capped at 2 s (gRPC's default grows to
# 120 s, so a channel that saw the server go down would fail fast long after it is back).
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.keepalive_time_ms", KeepAliveOptions().keepalive_time_ms),
    ("grpc.keepalive_timeout_ms", KeepAliveOptions().keepalive_timeout_ms),
    ("grpc.keepalive_permit_without_calls", KeepAliveOptions().keepalive_permit_without_calls),
    ("grpc.http2.max_pings_without_data", KeepAliveOptions().http2_max_pings_without_data),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


class GrpcTransport:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.client = grpcaio.InferenceServerClient(url, channel_args=CHANNEL_ARGS)

    async def responses(self, request: GenerateRequest, timeout: float | None) -> AsyncIterator[dict[str, Any]]:
        inputs = []
        for name, (datatype, array) in request.arrays().items():
            tensor = grpcclient.InferInput(name, list(array.shape), datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)

        async def one_request() -> AsyncIterator[dict[str, Any]]:
            yield {"model_name": self.model, "inputs": inputs, "request_id": uuid.uuid4().hex}

        call = self.client.stream_infer(one_request(), stream_timeout=timeout)
        try:
            async for result, error in call:
                if error is not None:
                    raise errors.from_message(error.message(), self.url)
                response = result.get_response()
                yield {
                    out.name: plain(out.name, result.as_numpy(out.name))
                    for out in response.outputs
                    if out.name in RESPONSE_TENSORS
                }
                if response.parameters["triton_final_response"].bool_param:
                    return
        except grpc.RpcError as exc:
            raise errors.from_grpc(exc, self.url, timeout) from None
        finally:
            call.cancel()  # no-op once the call has finished; otherwise the server cancels the request

    async def close(self) -> None:
        await self.client.close()


class HttpTransport:
    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.base = url if url.startswith(("http://", "https://")) else f"http://{url}"
        self.session: aiohttp.ClientSession | None = None

    async def responses(self, request: GenerateRequest, timeout: float | None) -> AsyncIterator[dict[str, Any]]:
        if self.session is None:
            self.session = aiohttp.ClientSession()
        address = f"{self.base}/v2/models/{self.model}/generate_stream"
        body = {**request.fields(), "stream": True}
        try:
            async with self.session.post(address, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
                if reply.status != 200:
                    raise errors.from_http(reply.status, error_text(await reply.text()), self.url)
                async for line in reply.content:
                    if line.startswith(b"data:"):
                        yield self.parse(line[len(b"data:"):])
        except aiohttp.ClientConnectorError as exc:
            raise errors.ServerUnreachableError(f"cannot connect to {self.base}: {exc.os_error}", self.url) from None
        except asyncio.TimeoutError:
            raise errors.GenerateTimeoutError(f"request to {self.base} timed out after {timeout}s", self.url) from None
        except aiohttp.ClientError as exc:
            raise errors.UnavailableError(f"HTTP request to {address} failed: {exc}", self.url) from None

    def parse(self, body: str | bytes) -> dict[str, Any]:
        event = json.loads(body)
        if "error" in event:
            raise errors.from_message(str(event["error"]), self.url)
        return {name: plain(name, value) for name, value in event.items() if name in RESPONSE_TENSORS}

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def error_text(body: str) -> str:
    """The `error` field of Triton's JSON error body (an SSE `data:` event on /generate_stream)."""
    body = body.strip()
    try:
        return str(json.loads(body.removeprefix("data:"))["error"])
    except (ValueError, KeyError, TypeError):
        return body
