"""Deployment files, checked offline: docker compose (GPU and CPU), the Dockerfile, the load-test
scripts against a real server, the Prometheus and Kubernetes configurations.

No Docker engine exists here: Debian's docker-compose 1.29 parses and interpolates the compose
files (`config`), and the rest is checked against the repository itself.
"""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement

from triton_mtp.serving.server import TritonServer, backend_directory, find_tritonserver, free_ports

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_GPU = ROOT / "docker-compose.yml"
COMPOSE_CPU = ROOT / "docker-compose.cpu.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
PERF_ANALYZER_DIR = ROOT / "bench" / "perf_analyzer"
PROFILES = ("loadtest", "monitoring", "scale-out")
POOL_ALIAS = "triton-pool"
# Directories the stack writes into (created by Docker on first use), not inputs that must exist.
OUTPUT_MOUNTS = {ROOT / "runs" / "loadtest"}


def docker_compose() -> str:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (apt-get install -y --no-install-recommends docker-compose)")
    return binary


def compose_config(path: Path, env: dict[str, str] | None = None) -> dict:
    """The file as docker-compose resolves it: interpolated, anchors merged, all profiles on."""
    args = [docker_compose(), "-f", str(path)]
    for profile in PROFILES:
        args += ["--profile", profile]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    environment.update(env or {})
    done = subprocess.run(args + ["config"], capture_output=True, text=True, env=environment, cwd=ROOT)
    assert done.returncode == 0, f"docker-compose config {path.name} failed:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


@pytest.fixture(scope="module")
def gpu_config() -> dict:
    return compose_config(COMPOSE_GPU)


@pytest.fixture(scope="module")
def cpu_config() -> dict:
    return compose_config(COMPOSE_CPU)


def bind_mounts(service: dict) -> list[tuple[Path, str]]:
    """(host path, container path) of a service's bind mounts (named volumes left out)."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("/"):
            mounts.append((Path(source), target))
    return mounts


def dockerfile_copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY in docker/Dockerfile."""
    copies = []
    for line in DOCKERFILE.read_text().splitlines():
        words = line.split()
        if words and words[0] == "COPY":
            copies.append((words[1:-1], words[-1]))
    return copies


@pytest.mark.parametrize("path", [COMPOSE_GPU, COMPOSE_CPU], ids=["gpu", "cpu"])
def test_compose_file_is_valid(path: Path) -> None:
    args = [docker_compose(), "-f", str(path)] + [a for p in PROFILES for a in ("--profile", p)]
    done = subprocess.run(args + ["config", "-q"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", f"docker-compose warns about {path.name}:\n{done.stderr}"


def test_default_stack_exports_then_serves_the_bundled_model_on_a_gpu(gpu_config: dict) -> None:
    services = gpu_config["services"]
    export, triton = services["export"], services["triton"]
    assert (ROOT / "models" / "tiny-dsv3-mtp", "/checkpoint") in bind_mounts(export)
    assert (ROOT / "models" / "tiny-dsv3-mtp" / "config.json").is_file(), "the default checkpoint is not bundled"
    assert export["environment"]["EXPORT_DEVICE"] == "cuda"
    assert triton["depends_on"] == {"export": {"condition": "service_completed_successfully"}}
    assert "repository:/repository:ro" in triton["volumes"] and "repository:/repository:rw" in export["volumes"]
    assert export["environment"]["EXPORT_FORMAT"] == ""  # the export's default: eager on cuda
    for name in ("triton", "triton-replica"):  # the eager format loads its weights from the checkpoint
        assert (ROOT / "models" / "tiny-dsv3-mtp", "/checkpoint") in bind_mounts(services[name]), name
    assert sorted((p["published"], p["target"]) for p in triton["ports"]) == [(8000, 8000), (8001, 8001), (8002, 8002)]
    assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])
    shm = re.fullmatch(r"(\d+)gb", triton["shm_size"])
    assert shm and int(shm.group(1)) >= 1, f"shm_size {triton['shm_size']} is too small for the Python backend"
    for name in ("export", "triton", "triton-replica"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"], name


def test_variables_reach_the_export_and_the_gpu_reservation() -> None:
    env = {"CHECKPOINT_DIR": "/data/DeepSeek-V3", "NUM_DRAFT_TOKENS": "3", "MAX_SLOTS": "32", "GPU_IDS": "2",
           "TRITON_REPLICAS": "4", "LB_GRPC_PORT": "7001", "HOPS": "local"}
    services = compose_config(COMPOSE_GPU, env)["services"]
    export = services["export"]
    assert (Path("/data/DeepSeek-V3"), "/checkpoint") in bind_mounts(export)
    assert export["environment"]["NUM_DRAFT_TOKENS"] == "3" and export["environment"]["MAX_SLOTS"] == "32"
    assert export["environment"]["HOPS"] == "local"
    assert services["triton"]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == ["2"]
    assert services["triton-replica"]["deploy"]["replicas"] == 4
    assert {"published": 7001, "target": 8001} in services["nginx"]["ports"]


def test_cpu_variant_is_the_gpu_stack_without_gpus(gpu_config: dict, cpu_config: dict) -> None:
    for name, service in cpu_config["services"].items():
        assert "resources" not in service.get("deploy", {}), f"{name} reserves devices in the CPU variant"
    assert cpu_config["services"]["export"]["environment"]["EXPORT_DEVICE"] == "cpu"

    expected = json.loads(json.dumps(gpu_config))
    for service in expected["services"].values():
        service.get("deploy", {}).pop("resources", None)
        if service.get("deploy") == {}:
            del service["deploy"]
    expected["services"]["export"]["environment"]["EXPORT_DEVICE"] = "cpu"
    assert cpu_config == expected


def test_scale_out_and_monitoring_reach_every_replica(gpu_config: dict) -> None:
    services = gpu_config["services"]
    for name in ("triton", "triton-replica"):
        assert POOL_ALIAS in services[name]["networks"]["default"]["aliases"], name
    assert "ports" not in services["triton-replica"], "replicas must not publish host ports (they would collide)"
    nginx_conf = (ROOT / "docker" / "nginx.conf").read_text()
    assert re.findall(r"server\s+([\w.-]+):(\d+);", nginx_conf) == [(POOL_ALIAS, "8000"), (POOL_ALIAS, "8001")]
    assert "grpc_pass grpc://" in nginx_conf and re.search(r"listen\s+8001\s+http2;", nginx_conf)
    assert nginx_conf.count("least_conn;") == 2

    prometheus = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    (job,) = prometheus["scrape_configs"]
    (lookup,) = job["dns_sd_configs"]
    assert lookup["names"] == [POOL_ALIAS] and lookup["port"] == 8002 and lookup["type"] == "A"


def test_every_path_the_stack_uses_exists_in_the_repository(gpu_config: dict) -> None:
    copied_to_path = set()
    for sources, destination in dockerfile_copies():
        for source in sources:
            assert (ROOT / source).exists(), f"docker/Dockerfile copies {source}, which is not in the repository"
            if destination.rstrip("/") == "/usr/local/bin":
                assert os.access(ROOT / source, os.X_OK), f"{source} is not executable"
                copied_to_path.add(Path(source).name)

    for name, service in gpu_config["services"].items():
        if "build" in service:
            context = Path(service["build"]["context"])
            assert (context / service["build"]["dockerfile"]).is_file(), name
        mounts = bind_mounts(service)
        for host, _ in mounts:
            assert host in OUTPUT_MOUNTS or host.exists(), f"{name} mounts {host}, which does not exist"
        command = service.get("command", [])
        if "build" in service:
            assert command[0] in copied_to_path, f"{name} runs {command[0]}, which the Dockerfile does not install"
        for word in (w.split("=", 1)[-1] for w in command):
            for host, target in mounts:
                if word.startswith(target + "/"):
                    path = host / word[len(target) + 1:]
                    assert path.exists(), f"{name} uses {word} = {path}, which does not exist"


def test_dockerfile_installs_every_runtime_dependency_but_torch() -> None:
    """The image keeps its own torch and runs its own tritonserver; all other dependencies are listed."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = {Requirement(r).name for r in project["dependencies"] + project["optional-dependencies"]["onnx"]}
    wanted -= {"torch", "nvidia-pytriton"}
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    listed = set()
    for line in text.splitlines():
        if "pip install" in line and "--no-deps" not in line:
            words = line.split("pip install", 1)[1].split("&&")[0].split()
            listed |= {Requirement(word.strip('"')).name for word in words if not word.startswith("-")}
    missing = wanted - listed
    assert not missing, f"docker/Dockerfile does not install {sorted(missing)}"
    assert re.search(r"FROM \$\{TRITON_IMAGE\}", text) and "tritonserver:24.10-pyt-python-py3" in text


def run_script(name: str, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", str(ROOT / "docker" / name)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout)


def test_export_script_turns_variables_into_export_flags(tmp_path: Path) -> None:
    """With a stand-in `triton-mtp` on PATH that prints its arguments: set variables become flags, unset ones none."""
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "config.json").write_text("{}")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "triton-mtp").write_text('#!/bin/sh\necho "$@"\n')
    (tmp_path / "bin" / "triton-mtp").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", "CHECKPOINT_DIR": str(tmp_path / "checkpoint"),
           "MODEL_REPOSITORY": str(tmp_path / "repository"), "HOPS": "local", "MAX_SLOTS": "16", "EXPORT_FORMAT": "",
           "COMPILE_GRAPHS": "true", "RESPONSE_THREADS": "4",
           "STREAM_INTERVAL": "3"}
    done = run_script("export-repository.sh", env)
    assert done.returncode == 0, done.stderr
    args = done.stdout.split()
    assert args[:1] == ["export"] and "--format" not in args and "--compile-graphs" in args
    assert args[args.index("--response-threads") + 1] == "4" and args[args.index("--stream-interval") + 1] == "3"
    assert args[args.index("--hops") + 1] == "local" and args[args.index("--max-slots") + 1] == "16"


def test_entrypoints_name_the_missing_input(tmp_path: Path) -> None:
    done = run_script("export-repository.sh", {"CHECKPOINT_DIR": str(tmp_path), "MODEL_REPOSITORY": str(tmp_path / "r")})
    assert done.returncode == 1 and done.stderr.strip().count("\n") == 0
    assert f"CHECKPOINT_DIR={tmp_path} has no config.json" in done.stderr
    done = run_script("serve.sh", {"MODEL_REPOSITORY": str(tmp_path)})
    assert done.returncode == 1 and f"MODEL_REPOSITORY={tmp_path} has no spec_decode/config.pbtxt" in done.stderr


def test_container_entrypoints_export_then_serve(drafting_checkpoint: Path, tmp_path: Path) -> None:
    """export-repository.sh and serve.sh as the CPU stack runs them (its export environment, variables
    set as a user would), with the embedded tritonserver on PATH in place of the image's."""
    repository = tmp_path / "repository"
    (repository / "stale").mkdir(parents=True)  # an earlier export's model must not survive
    (repository / "stale" / "config.pbtxt").write_text("backend: \"python\"\n")
    variables = {"MAX_SLOTS": "3", "MAX_DRAFT_TOKENS": "3", "NUM_DRAFT_TOKENS": "1", "REQUEST_TIMEOUT_S": "90"}
    env = compose_config(COMPOSE_CPU, variables)["services"]["export"]["environment"]
    env.update(CHECKPOINT_DIR=str(drafting_checkpoint), MODEL_REPOSITORY=str(repository))
    done = run_script("export-repository.sh", env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in repository.iterdir()) == ["export.json", "mtp", "spec_decode", "target"]
    sizes = json.loads((repository / "export.json").read_text())["sizes"]
    assert (sizes["max_slots"], sizes["max_draft_tokens"], sizes["default_num_draft_tokens"]) == (3, 3, 1)
    assert 'key: "request_timeout_s", value: { string_value: "90.0" }' in (repository / "spec_decode" / "config.pbtxt").read_text()

    install = find_tritonserver()
    http_port, grpc_port, metrics_port = free_ports(3)
    env = TritonServer(repository).environment(install)
    env.update(PATH=f"{install.binary.parent}{os.pathsep}{env['PATH']}", MODEL_REPOSITORY=str(repository))
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen(
        ["sh", str(ROOT / "docker" / "serve.sh"), f"--backend-directory={backend_directory(install)}",
         f"--http-port={http_port}", f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}"],
        env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not ready(http_port):
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        body = json.dumps({"input_ids": [5, 6, 7, 8], "max_tokens": 6}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/models/spec_decode/generate", data=body)
        with urllib.request.urlopen(request, timeout=120) as response:
            result = json.loads(response.read())
        assert result["num_input_tokens"] == 4 and 0 < result["num_output_tokens"] <= 6, result
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


def ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def perf_analyzer() -> str:
    local = ROOT / "build" / "tools" / "bin" / "perf_analyzer"  # where bench/perf_analyzer/install.sh puts it
    binary = str(local) if local.is_file() else shutil.which("perf_analyzer")
    if binary is None:
        pytest.skip("perf_analyzer is not installed (bench/perf_analyzer/install.sh)")
    return binary


def perf_analyzer_environment() -> dict[str, str]:
    """This environment, with the libcudart of a pip-installed nvidia-cuda-runtime-cu12 findable
    (a bare perf_analyzer from the tritonclient wheel needs it even without a GPU)."""
    env = dict(os.environ)
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    if spec is not None and spec.submodule_search_locations:
        lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(lib), env.get("LD_LIBRARY_PATH")]))
    return env


def test_loadtest_sweep_completes_against_a_real_server(tmp_path: Path, toy_spec_decode_server: TritonServer) -> None:
    """The loadtest profile's script and input data, against a server with the spec_decode interface."""
    out = tmp_path / "loadtest"
    done = subprocess.run(
        [sys.executable, str(PERF_ANALYZER_DIR / "sweep.py"), f"--url={toy_spec_decode_server.grpc_url}",
         "--draft-tokens=0,2", "--concurrency=1,2", "--max-tokens=6", "--request-count=4",
         f"--perf-analyzer={perf_analyzer()}", f"--out={out}", "--", "--max-trials=3", "--stability-percentage=999"],
        capture_output=True, text=True, timeout=300, env=perf_analyzer_environment(),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with open(out / "summary.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["num_draft_tokens"], r["Concurrency"]) for r in rows] == [("0", "1"), ("0", "2"), ("2", "1"), ("2", "2")]
    assert all(float(r["Inferences/Second"]) > 0 for r in rows)
    inputs = json.loads((out / "inputs_k2.json").read_text())["data"]
    shipped = json.loads((PERF_ANALYZER_DIR / "spec_decode_inputs.json").read_text())["data"]
    assert [e["text_input"] for e in inputs] == [e["text_input"] for e in shipped]
    assert all(e["num_draft_tokens"] == [2] and e["max_tokens"] == [6] for e in inputs)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"data": []}, "'data' must be a non-empty list of requests"),
        ({"data": [{"text_input": ["x"]}]}, "data[0] has no 'max_tokens'"),
    ],
)
def test_sweep_names_the_bad_input_data(tmp_path: Path, data: dict, message: str) -> None:
    inputs = tmp_path / "inputs.json"
    inputs.write_text(json.dumps(data))
    done = subprocess.run(
        [sys.executable, str(PERF_ANALYZER_DIR / "sweep.py"), f"--input-data={inputs}", f"--out={tmp_path / 'out'}",
         f"--perf-analyzer={sys.executable}"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode != 0 and done.stderr.strip() == f"sweep: {inputs}: {message}"
