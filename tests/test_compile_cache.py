"""torch.compile's cache ships with eager artifacts that are compiled at load (export/compile_cache.py):
a fresh process that merges it compiles nothing, and the served model merges it before loading.

The checkpoint is one dense layer without MTP layers: compiling it on CPU takes about a minute."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_config import tiny_config
from triton_mtp.client import Client
from triton_mtp.export.compile_cache import CACHE_DIR, merge_into_process_cache
from triton_mtp.export.repository import _compiles_at_load, write_repository
from triton_mtp.export.synthetic import write_checkpoint
from triton_mtp.serving.server import TritonServer, free_ports


@pytest.fixture(scope="module")
def compiled_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("compile_cache")
    config = {**tiny_config(), "num_hidden_layers": 1, "num_nextn_predict_layers": 0}
    checkpoint = write_checkpoint(root / "checkpoint", config, seed=0)
    write_repository(checkpoint, root / "repository", fmt="eager", device="cpu", max_slots=2, max_seq_len=32,
                     max_draft_tokens=2, hops="local", progress=False, log=lambda line: None)
    return root / "repository"


def test_the_cache_ships_only_where_the_served_models_compile_at_load():
    decide = lambda fmt="eager", device="cpu", graphs=True, compile_graphs=False, eager_compile=True, tp=1: \
        _compiles_at_load(fmt, device, graphs, compile_graphs, eager_compile, tp)  # noqa: E731
    assert decide() and not decide(eager_compile=False) and not decide(fmt="torchscript")
    assert not decide(device="cuda"), "graphed without --compile-graphs: the load does not compile"
    assert decide(device="cuda", compile_graphs=True, eager_compile=False)
    assert decide(device="cuda", graphs=False)
    assert not decide(tp=2), "tensor-parallel ranks compile their own shards"


LOAD = """
import json, sys
from pathlib import Path
from torch._dynamo.utils import counters
from triton_mtp.export import compile_cache
from triton_mtp.export.graphs import load_step
directory = Path(sys.argv[1])
merged = compile_cache.merge_into_process_cache(directory)
load_step(directory / "target.json", "eager", "cpu", compile=True)  # binds the pool: the warm-up compiles
cache = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}
print(json.dumps({"merged": merged, **cache}))
"""


def test_a_fresh_process_loads_the_compiled_steps_from_the_shipped_cache(compiled_repository, tmp_path):
    target = compiled_repository / "spec_decode" / "1" / "target"
    assert (target / CACHE_DIR).is_dir()
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "fresh")}
    done = subprocess.run([sys.executable, "-c", LOAD, str(target)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["merged"] and counts.get("fxgraph_cache_hit", 0) >= 1 and counts.get("fxgraph_cache_miss", 0) == 0, \
        counts


def test_the_served_model_merges_the_cache_before_it_compiles(compiled_repository, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "server_cache"))  # the server inherits it
    ports = dict(zip(("grpc_port", "http_port", "metrics_port"), free_ports(3)))
    with TritonServer(compiled_repository, **ports, log_path=tmp_path / "server.log") as server:
        with Client(server.grpc_url, timeout=120) as client:
            assert len(client.generate(input_ids=[5, 6, 7], max_tokens=4).ids) == 4
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert "merged the export's torch.compile cache" in log
    assert any((tmp_path / "server_cache" / "fxgraph").iterdir())


def test_merging_adds_missing_entries_and_leaves_present_ones_untouched(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "process"))
    (tmp_path / "process" / "ab").mkdir(parents=True)
    (tmp_path / "process" / "ab" / "kernel.so").write_bytes(b"loaded")  # e.g. mapped by this process
    shipped = tmp_path / "artifacts" / CACHE_DIR
    (shipped / "ab").mkdir(parents=True)
    (shipped / "ab" / "kernel.so").write_bytes(b"same name, other bytes")
    (shipped / "cd").mkdir()
    (shipped / "cd" / "graph").write_bytes(b"new")
    assert merge_into_process_cache(tmp_path / "artifacts")
    assert (tmp_path / "process" / "ab" / "kernel.so").read_bytes() == b"loaded"
    assert (tmp_path / "process" / "cd" / "graph").read_bytes() == b"new"
    assert not merge_into_process_cache(tmp_path / "nothing shipped")
