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
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton's interpreter runs export/fused_moe.py's kernels on the CPU (tests/test_fused_moe.py).
# Triton reads the setting when it is first imported, so it is made before anything imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton_mtp.serving.server import TritonServer, free_ports  # noqa: E402

SERVER_READY_TIMEOUT_S = 300.0


@pytest.fixture
def decode_kernels(monkeypatch: pytest.MonkeyPatch):
    """export/fused_moe_kernels.py (made under the interpreter) taken on the CPU, as where Triton runs on CUDA: the
    MoE's and the linear layers' decode paths."""
    pytest.importorskip("triton")
    from triton_mtp.export import fused_moe, fused_moe_kernels

    monkeypatch.setattr(fused_moe, "KERNELS", fused_moe_kernels)
    monkeypatch.setattr(fused_moe, "runs_on", lambda device: True)
    return fused_moe_kernels


@pytest.fixture
def record_launches(decode_kernels, monkeypatch: pytest.MonkeyPatch) -> Callable[..., list]:
    """With the decode kernels taken on the CPU: record_launches(name, pick) -> a list to which each launch of the
    kernel `name` appends pick(its arguments), and goes on as before."""
    def record(name: str, pick: Callable[[tuple], object]) -> list:
        calls = []
        launch = getattr(decode_kernels, name)

        class Recorded:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: calls.append(pick(args)) or launch[grid](*args, **kwargs)

        monkeypatch.setattr(decode_kernels, name, Recorded())
        return calls

    return record


@pytest.fixture(scope="session")
def triton_server_for(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., TritonServer]]:
    servers: dict[Path, TritonServer] = {}
    logs = tmp_path_factory.mktemp("server_logs")

    def start(repository: str | os.PathLike, **kwargs: object) -> TritonServer:
        key = Path(repository).resolve()
        if key not in servers:
            grpc_port, http_port, metrics_port = free_ports(3)
            kwargs.setdefault("log_path", logs / f"{len(servers)}-{key.parent.name}-{key.name}.log")
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


@pytest.fixture(scope="session")
def toy_spec_decode_server(triton_server_for, tmp_path_factory: pytest.TempPathFactory) -> TritonServer:
    """A server whose `spec_decode` is tests/models/toy_spec_decode: the public interface, a fake engine."""
    repo = tmp_path_factory.mktemp("toy_spec_decode_repository")
    model = Path(__file__).parent / "models" / "toy_spec_decode"
    shutil.copytree(model, repo / "spec_decode", ignore=shutil.ignore_patterns("__pycache__"))
    return triton_server_for(repo)


def sharpen_for_drafting(checkpoint_dir: Path, scale: float = 0.05) -> None:
    """Rewrite a random checkpoint so its MTP layers predict the target well but not perfectly.

    Shrinking the target's attention / MLP output projections makes it close to a bigram model of
    the (shared) embedding and head; an identity `eh_proj` passes the MTP's token embedding through,
    and the MTP layers keep their full-size attention, so what their caches hold shows in the
    drafts. Drafts are then accepted often and rejected sometimes: both paths get exercised.
    """
    import torch
    from safetensors.torch import load_file, save_file

    from tiny_config import tiny_config

    path = checkpoint_dir / "model.safetensors"
    weights = load_file(path)
    config = tiny_config()
    hidden, target_layers = config["hidden_size"], config["num_hidden_layers"]
    for name, tensor in weights.items():
        in_target = name.startswith("model.layers.") and int(name.split(".")[2]) < target_layers
        if in_target and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = tensor * scale
        elif name.endswith("eh_proj.weight"):
            weights[name] = torch.cat([torch.eye(hidden), tensor[:, hidden:] * scale], dim=1)  # [H, 2H]
    save_file(weights, path, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def drafting_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny two-MTP-layer checkpoint of tests/tiny_config.py, sharpened for drafting."""
    from tiny_config import tiny_config

    from triton_mtp.export.synthetic import write_checkpoint

    path = write_checkpoint(tmp_path_factory.mktemp("drafting_checkpoint"), tiny_config(), seed=0)
    sharpen_for_drafting(path)
    return path


@pytest.fixture(scope="session")
def spec_decode_repository(drafting_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`drafting_checkpoint` exported (TorchScript, CPU), for tests that start their own servers on it."""
    from triton_mtp.export.repository import write_repository

    repo = tmp_path_factory.mktemp("spec_decode_repository")
    write_repository(drafting_checkpoint, repo, max_slots=4, max_draft_tokens=4, progress=False, log=lambda line: None)
    return repo
