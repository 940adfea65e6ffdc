"""Scale-out for real: two tritonserver replicas behind Debian's nginx running docker/nginx.conf.

The shipped configuration is rewritten only where a container differs from this host: the pool
alias becomes the two replicas' addresses, the listen ports become free local ports, and the pid,
log and temp paths move into the test's directory. Concurrent streaming requests go through nginx
over gRPC (grpc_pass, HTTP/2) and over HTTP (generate_stream, server-sent events); each must stream
the same tokens and text a replica gives directly, and both replicas' metrics must show that they served some.
"""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from triton_mtp.serving.server import TritonServer, free_ports

NGINX_CONF = Path(__file__).resolve().parent.parent / "docker" / "nginx.conf"
POOL_ALIAS = "triton-pool"
MODEL = "spec_decode"
MAX_TOKENS = 12
PROMPTS = [tuple(range(2 + i, 12 + 3 * i, 1 + i % 3)) for i in range(8)]  # token ids, within any vocabulary >= 64
STREAM_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Balancer:
    grpc_url: str
    http_url: str
    error_log: Path


def nginx_binary() -> str:
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None)
    if binary is None:
        pytest.skip("nginx is not installed (apt-get install -y nginx)")
    return binary


def local_nginx_config(text: str, replicas: list[TritonServer], http_port: int, grpc_port: int, prefix: Path) -> str:
    """docker/nginx.conf pointed at local replicas and ports, with its files under `prefix`."""

    def replace_once(pattern: str, replacement: str, text: str) -> str:
        new, count = re.subn(pattern, replacement, text, flags=re.MULTILINE)
        assert count == 1, f"docker/nginx.conf: expected one match of {pattern!r}, found {count}"
        return new

    for port, field in ((8000, "http_url"), (8001, "grpc_url")):
        servers = "\n".join(f"        server {getattr(r, field)};" for r in replicas)
        text = replace_once(rf"^\s*server {POOL_ALIAS}:{port};$", servers, text)
    text = replace_once(r"listen 8000;", f"listen 127.0.0.1:{http_port};", text)
    text = replace_once(r"listen 8001 http2;", f"listen 127.0.0.1:{grpc_port} http2;", text)
    files = "\n".join(
        f"    {directive} {prefix / name};"
        for directive, name in [
            ("access_log", "access.log"),
            ("client_body_temp_path", "body"),
            ("proxy_temp_path", "proxy"),
            ("fastcgi_temp_path", "fastcgi"),
            ("uwsgi_temp_path", "uwsgi"),
            ("scgi_temp_path", "scgi"),
        ]
    )
    text = replace_once(r"^http \{$", "http {\n" + files, text)
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers must reach the temp paths under a 0700 tmp
    return f"{user}pid {prefix / 'nginx.pid'};\nerror_log {prefix / 'error.log'} info;\n" + text


def wait_listening(port: int, process: subprocess.Popen, log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"nginx exited with code {process.returncode}:\n{log.read_text()}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    pytest.fail(f"nginx is not listening on {port} after {timeout:.0f}s:\n{log.read_text()}")


@pytest.fixture(scope="module")
def replicas(spec_decode_repository: Path) -> Iterator[list[TritonServer]]:
    servers = [TritonServer(spec_decode_repository, *free_ports(3)) for _ in range(2)]
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(300)
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def balancer(replicas: list[TritonServer], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Balancer]:
    binary = nginx_binary()
    prefix = tmp_path_factory.mktemp("nginx")
    http_port, grpc_port = free_ports(2)
    conf = prefix / "nginx.conf"
    conf.write_text(local_nginx_config(NGINX_CONF.read_text(), replicas, http_port, grpc_port, prefix))
    check = subprocess.run([binary, "-t", "-p", str(prefix), "-c", str(conf)], capture_output=True, text=True)
    assert check.returncode == 0, f"nginx -t rejects docker/nginx.conf:\n{check.stderr}"
    process = subprocess.Popen(
        [binary, "-p", str(prefix), "-c", str(conf), "-g", "daemon off;"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    try:
        for port in (http_port, grpc_port):
            wait_listening(port, process, prefix / "error.log")
        yield Balancer(f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}", prefix / "error.log")
    finally:
        process.terminate()
        process.wait(timeout=30)


Completion = tuple[tuple[int, ...], str, str]  # output ids, text, finish_reason


def stream_over_grpc(url: str, prompt: tuple[int, ...]) -> Completion:
    """Stream one greedy request; return what it streamed once the final response arrives."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        inputs = []
        for name, dtype, value in [
            ("input_ids", "INT32", np.array(prompt, dtype=np.int32)),  # [T]
            ("max_tokens", "INT32", np.array([MAX_TOKENS], dtype=np.int32)),  # [1]
            ("stream", "BOOL", np.array([True])),  # [1]
        ]:
            tensor = grpcclient.InferInput(name, list(value.shape), dtype)
            tensor.set_data_from_numpy(value)
            inputs.append(tensor)
        client.async_stream_infer(MODEL, inputs, enable_empty_final_response=True)
        ids, text, finish = [], "", None
        while True:
            result, error = responses.get(timeout=STREAM_TIMEOUT_S)
            assert error is None, f"prompt {prompt}: {error}"
            if result.as_numpy("output_ids") is not None:
                ids += result.as_numpy("output_ids").tolist()
            if result.as_numpy("text_output") is not None:
                text += b"".join(result.as_numpy("text_output")).decode()
            if result.as_numpy("finish_reason") is not None:
                finish = result.as_numpy("finish_reason")[0].decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                return tuple(ids), text, finish
    finally:
        client.stop_stream()
        client.close()


def stream_over_http(url: str, prompt: tuple[int, ...]) -> Completion:
    """POST /generate_stream; return what its server-sent events carried."""
    body = {"input_ids": list(prompt), "max_tokens": MAX_TOKENS, "stream": True}
    ids, text, finish = [], "", None
    with requests.post(f"http://{url}/v2/models/{MODEL}/generate_stream", json=body, stream=True,
                       timeout=STREAM_TIMEOUT_S) as response:
        assert response.status_code == 200, response.text
        for line in response.iter_lines(decode_unicode=True):
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:"):])
            assert "error" not in event, f"prompt {prompt}: {event['error']}"
            new_ids = event.get("output_ids", [])
            ids += new_ids if isinstance(new_ids, list) else [new_ids]  # a one-element tensor arrives as a number
            text += event.get("text_output", "")
            finish = event.get("finish_reason", finish)
    return tuple(ids), text, finish


def requests_served(server: TritonServer) -> int:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        metrics = response.read().decode()
    match = re.search(rf'^nv_inference_request_success\{{model="{MODEL}",version="1"\}} (\S+)$', metrics, re.MULTILINE)
    return int(float(match.group(1))) if match else 0


@pytest.fixture(scope="module")
def expected(replicas: list[TritonServer]) -> dict[tuple[int, ...], Completion]:
    """What one replica streams for each prompt when asked directly."""
    return {prompt: stream_over_grpc(replicas[0].grpc_url, prompt) for prompt in PROMPTS}


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_concurrent_streams_through_nginx_complete_on_both_replicas(
    transport: str, replicas: list[TritonServer], balancer: Balancer, expected: dict[tuple[int, ...], Completion]
) -> None:
    stream, url = (stream_over_grpc, balancer.grpc_url) if transport == "grpc" else (stream_over_http, balancer.http_url)
    before = [requests_served(r) for r in replicas]
    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        results = dict(zip(PROMPTS, pool.map(lambda prompt: stream(url, prompt), PROMPTS)))

    for prompt in PROMPTS:
        assert results[prompt] == expected[prompt], f"{transport} via nginx, prompt {prompt}"
        output_ids, _, finish = expected[prompt]
        assert output_ids and finish in {"length", "stop"}, expected[prompt]

    deadline = time.monotonic() + 10  # a replica counts a request once its final response is out
    while True:
        served = [requests_served(r) - b for r, b in zip(replicas, before)]
        if sum(served) >= len(PROMPTS) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(served) == len(PROMPTS), f"replicas counted {served} requests, {len(PROMPTS)} were sent"
    assert min(served) > 0, f"nginx sent every request to one replica: {served} ({balancer.error_log})"
