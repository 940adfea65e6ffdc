"""Shared fixtures.

`triton_server_for(repository)` starts one real tritonserver per model repository per test run, on
free ports, and stops it at the end of the session. A second call with the same path returns the
running server. Build a repository in a session fixture, then ask for its server:

    @pytest.fixture(scope="session")
    def exported_server(triton_server_for, exported_repository):
        server = triton_server_for(exported_repository)
        return server  # server.grpc_url, server.http_url, server.metrics_url, server.log_path

Keyword arguments (`log_verbose`, `extra_args`) are passed to `TritonServer` on the first call.
A server that does not become ready fails the test with its last log lines.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from triton_mtp.serving.server import TritonServer, free_ports

SERVER_READY_TIMEOUT_S = 300.0


@pytest.fixture(scope="session")
def triton_server_for() -> Iterator[Callable[..., TritonServer]]:
    servers: dict[Path, TritonServer] = {}

    def start(repository: str | os.PathLike, **kwargs: object) -> TritonServer:
        key = Path(repository).resolve()
        if key not in servers:
            grpc_port, http_port, metrics_port = free_ports(3)
            server = TritonServer(key, grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port, **kwargs)
            server.start()
            try:
                server.wait_ready(SERVER_READY_TIMEOUT_S)
            except BaseException:
                server.stop()
                raise
            servers[key] = server
        return servers[key]

    yield start
    for server in servers.values():
        server.stop()
