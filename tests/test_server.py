"""The embedded tritonserver launcher and `triton-mtp serve`, against a real server."""
from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from triton_mtp.serving.server import (
    FREE_PORTS_FROM, TritonServer, TritonServerError, ephemeral_ports, find_tritonserver, free_ports,
)

MODELS = Path(__file__).parent / "models"
SERVER_MODELS = ("add_one", "count_stream", "numpy_version")


@pytest.fixture(scope="module")
def server(triton_server_for, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    repository = tmp_path_factory.mktemp("server_models")
    for name in SERVER_MODELS:
        shutil.copytree(MODELS / name, repository / name)
    return triton_server_for(repository)


def stub_pids(repository: Path) -> list[int]:
    """Python backend stubs serving a model under `repository` (from /proc cmdlines)."""
    prefix = str(repository.resolve()).encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(argv) > 1 and argv[0].endswith(b"triton_python_backend_stub") and argv[1].startswith(prefix):
            pids.append(int(entry.name))
    return pids


def add_one_over_http(url: str, values: np.ndarray) -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    request = httpclient.InferInput("INPUT0", list(values.shape), "FP32")
    request.set_data_from_numpy(values)
    return client.infer("add_one", [request]).as_numpy("OUTPUT0")


def add_one_requests_total(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        text = response.read().decode()
    match = re.search(r'^add_one_requests_total\{model="add_one"\} (\S+)$', text, re.MULTILINE)
    assert match, "add_one_requests_total missing from the metrics endpoint"
    return float(match.group(1))


def test_add_one_over_http_and_grpc(server: TritonServer) -> None:
    values = np.array([0.5, -2.0, 41.0], dtype=np.float32)  # [3]
    np.testing.assert_array_equal(add_one_over_http(server.http_url, values), values + 1)

    client = grpcclient.InferenceServerClient(server.grpc_url)
    request = grpcclient.InferInput("INPUT0", [3], "FP32")
    request.set_data_from_numpy(values)
    np.testing.assert_array_equal(client.infer("add_one", [request]).as_numpy("OUTPUT0"), values + 1)


def test_decoupled_model_streams_one_response_per_step_over_grpc(server: TritonServer) -> None:
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        count = grpcclient.InferInput("COUNT", [1], "INT32")
        count.set_data_from_numpy(np.array([5], dtype=np.int32))
        client.async_stream_infer("count_stream", [count], enable_empty_final_response=True)
        indices = []
        while True:
            result, error = results.get(timeout=60)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            indices.append(int(result.as_numpy("INDEX")[0]))
    finally:
        client.stop_stream()
    assert indices == [0, 1, 2, 3, 4]


def test_custom_metric_counts_requests_on_metrics_port(server: TritonServer) -> None:
    add_one_over_http(server.http_url, np.zeros(1, dtype=np.float32))
    before = add_one_requests_total(server.metrics_url)
    for _ in range(3):
        add_one_over_http(server.http_url, np.zeros(2, dtype=np.float32))
    assert add_one_requests_total(server.metrics_url) == before + 3


def test_stub_imports_this_environments_numpy_below_2(server: TritonServer) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    dummy = httpclient.InferInput("DUMMY", [1], "INT32")
    dummy.set_data_from_numpy(np.zeros(1, dtype=np.int32))
    version = client.infer("numpy_version", [dummy]).as_numpy("VERSION")[0].decode()
    assert version == np.__version__
    assert int(version.split(".")[0]) < 2


def test_stubs_get_one_mkl_thread_unless_the_caller_sets_it(server: TritonServer, monkeypatch: pytest.MonkeyPatch) -> None:
    stubs = stub_pids(server.repository)
    assert stubs
    expected = f"MKL_NUM_THREADS={os.environ.get('MKL_NUM_THREADS', '1')}".encode()  # the server got this process's
    for pid in stubs:  # CPU steps on the engine's thread: bench/cpu_threads.py
        assert expected in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    monkeypatch.setenv("MKL_NUM_THREADS", "4")
    assert TritonServer(server.repository).environment(find_tritonserver())["MKL_NUM_THREADS"] == "4"


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    # a port the kernel hands out for port-0 binds and outgoing connections could be taken again before
    # tritonserver binds it, after loading its models
    if ephemeral_ports().start - FREE_PORTS_FROM < 64:
        pytest.skip(f"this host's ephemeral range starts at {ephemeral_ports().start}: free_ports takes kernel-assigned ports")
    ports = free_ports(5)
    assert len(set(ports)) == 5
    assert all(FREE_PORTS_FROM <= port < ephemeral_ports().start for port in ports)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", port))


def test_port_in_use_is_named_before_starting() -> None:
    grpc_port, http_port, metrics_port = free_ports(3)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", metrics_port))
        busy.listen()
        server = TritonServer(MODELS, grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port)
        with pytest.raises(TritonServerError, match=f"metrics port {metrics_port} is already in use"):
            server.start()
    assert server.process is None


def test_missing_stub_for_this_python_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "version_info", types.SimpleNamespace(major=3, minor=99))
    with pytest.raises(TritonServerError, match=r"no Python backend stub for Python 3\.99"):
        find_tritonserver()


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_repository_without_models_is_rejected(tmp_path: Path, make: str) -> None:
    repository = tmp_path / "repo"
    if make == "empty":
        (repository / "add_one" / "1").mkdir(parents=True)
    with pytest.raises(TritonServerError, match=re.escape(str(repository))):
        TritonServer(repository, *free_ports(3)).start()


def test_broken_config_fails_fast_with_the_servers_log(tmp_path: Path) -> None:
    shutil.copytree(MODELS / "add_one", tmp_path / "add_one")
    (tmp_path / "add_one" / "config.pbtxt").write_text('name: "add_one"\nbackend: "python"\ninput [ { name: ')
    server = TritonServer(tmp_path, *free_ports(3))
    server.start()
    try:
        with pytest.raises(TritonServerError, match=r"exited with code [1-9]") as raised:
            server.wait_ready(timeout=120)
    finally:
        server.stop()
    assert "add_one" in str(raised.value)
    assert not stub_pids(tmp_path)


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)


def test_serve_prints_endpoints_serves_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    repository = tmp_path / "repo"
    shutil.copytree(MODELS / "add_one", repository / "add_one")
    grpc_port, http_port, metrics_port = free_ports(3)
    serve = subprocess.Popen(
        [sys.executable, "-m", "triton_mtp.cli", "serve", "--repository", str(repository),
         "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(metrics_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(serve.stdout, lines), daemon=True).start()
    try:
        printed = []
        deadline = time.monotonic() + 120
        while not any(line.startswith("metrics") for line in printed):
            assert time.monotonic() < deadline and serve.poll() is None, "".join(printed)
            try:
                printed.append(lines.get(timeout=1))
            except queue.Empty:
                pass
        endpoints = dict(line.split(maxsplit=1) for line in printed if line.startswith(("grpc ", "http ", "metrics ")))
        assert endpoints["grpc"].strip() == f"127.0.0.1:{grpc_port}"
        assert endpoints["http"].strip() == f"http://127.0.0.1:{http_port}"
        assert endpoints["metrics"].strip() == f"http://127.0.0.1:{metrics_port}/metrics"

        values = np.arange(4, dtype=np.float32)  # [4]
        np.testing.assert_array_equal(add_one_over_http(f"127.0.0.1:{http_port}", values), values + 1)
        assert stub_pids(repository)

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=60) == 0
    finally:
        if serve.poll() is None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(timeout=60)
    assert not stub_pids(repository)


def test_serve_reports_a_bad_repository_and_exits_1(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    done = subprocess.run(
        [sys.executable, "-m", "triton_mtp.cli", "serve", "--repository", str(missing)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 1
    expected = f"triton-mtp serve: error: model repository {missing} does not exist or is not a directory"
    assert done.stderr.strip() == expected
