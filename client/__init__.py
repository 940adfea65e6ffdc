"""Client of the `spec_decode` model: sync `Client`, asyncio `AsyncClient`, gRPC (default) or HTTP."""
from .aio import AsyncClient
from .core import Client
from .errors import (
    GenerateTimeoutError,
    InvalidArgumentError,
    ServerError,
    ServerUnreachableError,
    TritonMTPError,
    UnavailableError,
)
from .types import Acceptance, Completion, Delta, Usage

__all__ = [
    "Acceptance",
    "AsyncClient",
    "Client",
    "Completion",
    "Delta",
    "GenerateTimeoutError",
    "InvalidArgumentError",
    "ServerError",
    "ServerUnreachableError",
    "TritonMTPError",
    "UnavailableError",
    "Usage",
]
