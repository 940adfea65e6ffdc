"""Typed exceptions raised by the client, and their mapping from gRPC statuses and HTTP codes.

    TritonMTPError
    ├── ServerError               the server answered with an error (its message is kept verbatim)
    │   ├── InvalidArgumentError  the request was rejected: bad input, a value out of range
    │   └── UnavailableError      the server or the model cannot serve now (down, unknown, not ready)
    │       └── ServerUnreachableError   nothing accepts connections at the URL
    └── GenerateTimeoutError      the request ran past its timeout, the client's or the server's
                                  `request_timeout_s` (also a TimeoutError)

Triton passes on the errors a decoupled model sends for a request without their code: over gRPC as a
bare in-band message, over the HTTP generate extension as status 400 (an internal error included).
Those are `InvalidArgumentError` unless the message says the model is unknown, not ready, busy or
being unloaded.
"""
from __future__ import annotations

import grpc

UNAVAILABLE_MARKERS = ("unknown model", "is not ready", "no available version", "slots are busy", "being unloaded")


class TritonMTPError(Exception):
    """Base of every error this client raises; `url` is the server address it talked to."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.message = message
        self.url = url


class ServerError(TritonMTPError):
    """The server answered with an error; `message` is the server's own text."""


class InvalidArgumentError(ServerError):
    """The server rejected the request's input."""


class UnavailableError(ServerError):
    """The server or the requested model is not available."""


class ServerUnreachableError(UnavailableError):
    """No server accepts connections at `url`."""


class GenerateTimeoutError(TritonMTPError, TimeoutError):
    """The request did not finish within its timeout; the server was told to cancel it."""


def from_message(message: str, url: str) -> TritonMTPError:
    """Classify an error message the server sent in place of a response (no status code)."""
    lowered = message.lower()
    if lowered.startswith("request_timeout_s:"):  # the server's own per-request limit
        return GenerateTimeoutError(message, url)
    if any(marker in lowered for marker in UNAVAILABLE_MARKERS):
        return UnavailableError(message, url)
    return InvalidArgumentError(message, url)


def from_grpc(error: grpc.RpcError, url: str, timeout: float | None) -> TritonMTPError:
    """Map a failed gRPC call to its exception."""
    code, details = error.code(), error.details() or str(error)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return GenerateTimeoutError(f"request to grpc://{url} timed out after {timeout}s", url)
    if code == grpc.StatusCode.UNAVAILABLE:
        if "refused" in details.lower() or "failed to connect" in details.lower():
            return ServerUnreachableError(f"cannot connect to grpc://{url}: {details}", url)
        return UnavailableError(details, url)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return InvalidArgumentError(details, url)
    if code == grpc.StatusCode.NOT_FOUND:
        return UnavailableError(details, url)
    return ServerError(f"{code.name}: {details}", url)


def from_http(status: int, message: str, url: str) -> TritonMTPError:
    """Map an HTTP error status and the server's `{"error": ...}` text to its exception."""
    if status == 400:
        return from_message(message, url)
    if status in (404, 503):
        return UnavailableError(message, url)
    return ServerError(f"HTTP {status}: {message}", url)
