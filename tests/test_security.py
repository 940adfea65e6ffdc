"""Restricted admin APIs, gRPC over TLS and model control mode of `triton-mtp serve`, on a real server."""
from __future__ import annotations

import datetime
import ipaddress
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from tritonclient.utils import InferenceServerException

from triton_mtp.serving.server import ADMIN_KEY_ENV, admin_headers, free_ports

MODELS = Path(__file__).parent / "models"
ADMIN_KEY = "test-admin-key-0123456789"
READY_TIMEOUT_S = 180.0


def write_pem(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def self_signed_pki(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost signed by it: (ca, cert, key)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "triton-mtp test CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP256R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return (
        write_pem(directory / "ca.pem", ca.public_bytes(serialization.Encoding.PEM)),
        write_pem(directory / "server.pem", server.public_bytes(serialization.Encoding.PEM)),
        write_pem(directory / "server.key", key_pem),
    )


@dataclass
class Served:
    """A running `triton-mtp serve` process and the lines it printed, keyed by their first word."""

    process: subprocess.Popen
    printed: dict[str, str]

    def port(self, name: str) -> str:
        return re.search(r"127\.0\.0\.1:(\d+)", self.printed[name]).group(0)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)


def read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)


def start_serve(repository: Path, *flags: str, env: dict[str, str]) -> Served:
    """Run `triton-mtp serve` on free ports and wait for its `admin` line (printed once ready)."""
    grpc_port, http_port, metrics_port = free_ports(3)
    process = subprocess.Popen(
        [sys.executable, "-m", "triton_mtp.cli", "serve", "--repository", str(repository),
         "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", str(metrics_port), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=read_lines, args=(process.stdout, lines), daemon=True).start()
    printed: list[str] = []
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not any(line.startswith("admin ") for line in printed):
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            process.wait()
            pytest.fail("triton-mtp serve did not become ready:\n" + "".join(printed))
        try:
            printed.append(lines.get(timeout=1))
        except queue.Empty:
            pass
    return Served(process, {line.split()[0]: line.strip() for line in printed if line.strip()})


def environment(**changes: str | None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != ADMIN_KEY_ENV}
    env.update({key: value for key, value in changes.items() if value is not None})
    return env


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    return self_signed_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, pki: tuple[Path, Path, Path]) -> Iterator[Served]:
    """`serve` with the key from the environment, gRPC over TLS and explicit model control."""
    repository = tmp_path_factory.mktemp("secured_models")
    shutil.copytree(MODELS / "add_one", repository / "add_one")
    _, cert, key = pki
    served = start_serve(
        repository, "--grpc-use-ssl", "--grpc-server-cert", str(cert), "--grpc-server-key", str(key),
        "--model-control-mode", "explicit", env=environment(**{ADMIN_KEY_ENV: ADMIN_KEY}),
    )
    yield served
    assert served.stop() == 0


def add_one_input(client_module, values: np.ndarray):
    request = client_module.InferInput("INPUT0", list(values.shape), "FP32")
    request.set_data_from_numpy(values)
    return request


def http_add_one(url: str) -> np.ndarray:
    values = np.array([1.0, 2.5], dtype=np.float32)  # [2]
    client = httpclient.InferenceServerClient(url)
    return client.infer("add_one", [add_one_input(httpclient, values)]).as_numpy("OUTPUT0") - values


HTTP_ADMIN_CALLS: dict[str, Callable[[httpclient.InferenceServerClient, dict | None], object]] = {
    "model-repository index": lambda client, headers: client.get_model_repository_index(headers=headers),
    "model load": lambda client, headers: client.load_model("add_one", headers=headers),
    "log settings": lambda client, headers: client.get_log_settings(headers=headers),
    "log update": lambda client, headers: client.update_log_settings({"log_verbose_level": 0}, headers=headers),
    "trace settings": lambda client, headers: client.get_trace_settings(headers=headers),
    "shared-memory status": lambda client, headers: client.get_system_shared_memory_status(headers=headers),
    "shared-memory unregister": lambda client, headers: client.unregister_system_shared_memory(headers=headers),
}


@pytest.mark.parametrize("call", HTTP_ADMIN_CALLS, ids=list(HTTP_ADMIN_CALLS))
def test_http_admin_api_is_refused_without_the_key_and_served_with_it(secured: Served, call: str) -> None:
    client = httpclient.InferenceServerClient(secured.port("http"))
    for headers in (None, {"admin-key": "wrong-key-0123456789"}):
        with pytest.raises(InferenceServerException, match="restricted, expecting header 'admin-key'") as refused:
            HTTP_ADMIN_CALLS[call](client, headers)
        assert refused.value.status() == "403"
    HTTP_ADMIN_CALLS[call](client, admin_headers(ADMIN_KEY, "http"))


def test_inference_health_metadata_config_and_statistics_stay_open(secured: Served) -> None:
    client = httpclient.InferenceServerClient(secured.port("http"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("add_one")
    assert client.get_server_metadata()["name"] == "triton"
    assert client.get_model_metadata("add_one")["inputs"][0]["name"] == "INPUT0"
    assert client.get_model_config("add_one")["name"] == "add_one"
    assert client.get_inference_statistics("add_one")["model_stats"][0]["name"] == "add_one"
    np.testing.assert_array_equal(http_add_one(secured.port("http")), [1.0, 1.0])


def test_grpc_over_tls_serves_inference_openly_and_admin_only_with_the_key(secured: Served, pki) -> None:
    ca, _, _ = pki
    assert secured.printed["grpc"].endswith("(TLS)")
    client = grpcclient.InferenceServerClient(secured.port("grpc"), ssl=True, root_certificates=str(ca))
    values = np.array([3.0], dtype=np.float32)  # [1]
    result = client.infer("add_one", [add_one_input(grpcclient, values)], client_timeout=30)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values + 1)
    with pytest.raises(InferenceServerException, match="expecting header 'triton-grpc-protocol-admin-key'"):
        client.get_log_settings(client_timeout=30)
    with pytest.raises(InferenceServerException, match="restricted"):
        client.get_log_settings(headers=admin_headers(ADMIN_KEY, "http"), client_timeout=30)
    settings = client.get_log_settings(headers=admin_headers(ADMIN_KEY, "grpc"), as_json=True, client_timeout=30)
    assert "log_verbose_level" in settings["settings"]


def test_plaintext_grpc_client_cannot_talk_to_the_tls_port(secured: Served) -> None:
    client = grpcclient.InferenceServerClient(secured.port("grpc"))
    values = np.array([3.0], dtype=np.float32)  # [1]
    with pytest.raises(InferenceServerException):
        client.infer("add_one", [add_one_input(grpcclient, values)], client_timeout=10)


def test_explicit_model_control_needs_the_key_to_unload_and_reload(secured: Served) -> None:
    client = httpclient.InferenceServerClient(secured.port("http"))
    key = admin_headers(ADMIN_KEY, "http")
    with pytest.raises(InferenceServerException, match="restricted"):
        client.unload_model("add_one")
    assert client.is_model_ready("add_one")
    try:
        client.unload_model("add_one", headers=key)
        deadline = time.monotonic() + 60
        while client.is_model_ready("add_one") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not client.is_model_ready("add_one")
        with pytest.raises(InferenceServerException):
            http_add_one(secured.port("http"))
    finally:
        client.load_model("add_one", headers=key)
    assert client.is_model_ready("add_one")
    np.testing.assert_array_equal(http_add_one(secured.port("http")), [1.0, 1.0])


def test_serve_restricts_admin_by_default_with_a_printed_key_and_no_model_control(tmp_path: Path) -> None:
    shutil.copytree(MODELS / "add_one", tmp_path / "add_one")
    served = start_serve(tmp_path, env=environment())
    try:
        key = re.search(r"need header admin-key: (\S+) ", served.printed["admin"]).group(1)
        client = httpclient.InferenceServerClient(served.port("http"))
        with pytest.raises(InferenceServerException, match="restricted"):
            client.get_log_settings()
        assert "log_info" in client.get_log_settings(headers=admin_headers(key, "http"))
        with pytest.raises(InferenceServerException, match="polling is enabled|not allowed"):
            client.load_model("add_one", headers=admin_headers(key, "http"))
        np.testing.assert_array_equal(http_add_one(served.port("http")), [1.0, 1.0])
    finally:
        assert served.stop() == 0


def test_key_from_the_environment_is_not_printed(secured: Served) -> None:
    assert ADMIN_KEY not in secured.printed["admin"]
    assert f"<from {ADMIN_KEY_ENV}>" in secured.printed["admin"]


def run_serve(repository: Path, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "triton_mtp.cli", "serve", "--repository", str(repository), *flags],
        capture_output=True, text=True, timeout=120, env=env,
    )


@pytest.mark.parametrize(
    ("flags", "env_key", "expected"),
    [
        ((), "short", f"admin key from {ADMIN_KEY_ENV} must be at least 16 characters"),
        ((), "has spaces in it, 0123456789", f"admin key from {ADMIN_KEY_ENV} must be"),
        (("--grpc-use-ssl", "--grpc-server-key", "k.pem"), None, "--grpc-use-ssl needs --grpc-server-cert"),
        (("--grpc-server-cert", "c.pem"), None, "--grpc-server-cert / --grpc-server-key need --grpc-use-ssl"),
        (("--grpc-use-ssl", "--grpc-server-cert", "/nowhere/c.pem", "--grpc-server-key", "/nowhere/k.pem"), None,
         "--grpc-server-cert file /nowhere/c.pem does not exist"),
    ],
    ids=["short-key", "bad-characters", "tls-without-cert", "cert-without-tls", "missing-cert-file"],
)
def test_bad_security_settings_fail_with_one_line_naming_them(
    tmp_path: Path, flags: tuple[str, ...], env_key: str | None, expected: str
) -> None:
    shutil.copytree(MODELS / "add_one", tmp_path / "add_one")
    done = run_serve(tmp_path, *flags, env=environment(**{ADMIN_KEY_ENV: env_key}))
    assert done.returncode == 1
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith("triton-mtp serve: error: ") and expected in done.stderr


def test_unknown_admin_api_is_named(tmp_path: Path) -> None:
    done = run_serve(tmp_path, "--admin-apis", "logging,models", env=environment())
    assert done.returncode == 2
    assert "'models'" in done.stderr and "each must be one of" in done.stderr
