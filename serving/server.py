"""Embedded tritonserver launcher and the `triton-mtp serve` subcommand.

The tritonserver 2.51 binary, its Python backend, one backend stub per Python version and the shared
libraries ship inside the `nvidia-pytriton` wheel:

    site-packages/pytriton/tritonserver/bin/tritonserver
    site-packages/pytriton/tritonserver/backends/python/libtriton_python.so
    site-packages/pytriton/tritonserver/python_backend_stubs/3.X/triton_python_backend_stub
    site-packages/nvidia_pytriton.libs/                      (LD_LIBRARY_PATH)

`TritonServer` lays out a backend directory for the running Python, starts the binary in its own
process group with this interpreter's bin directory first on PATH (so the stub imports this
environment's numpy and torch), waits for readiness and stops the whole group.

Admin surfaces are restricted with tritonserver's `--grpc-restricted-protocol` /
`--http-restricted-api`: a request to a restricted API must carry the admin key in the HTTP header
`admin-key`, or in the gRPC metadata key `triton-grpc-protocol-admin-key` (2.51 prefixes gRPC keys).
Inference, health, metadata, model config and statistics stay open (perf_analyzer and genai-perf
read the last two). gRPC can be served over TLS (`GrpcTls`); tritonserver has no TLS for HTTP.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import random
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

SHM_DEFAULT_BYTE_SIZE = 16 * 2**20  # per model instance; the backend's 1 MiB default is outgrown by logits
SHM_GROWTH_BYTE_SIZE = 16 * 2**20
STOP_GRACE_S = 30.0
LOG_ERROR_LINES = 30
FREE_PORTS_FROM = 20000  # free_ports draws from here up to the ephemeral range

ADMIN_KEY_ENV = "TRITON_MTP_ADMIN_KEY"
ADMIN_HEADER = "admin-key"
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"  # tritonserver 2.51 matches gRPC metadata keys with this prefix
ADMIN_APIS = ("model-repository", "shared-memory", "trace", "logging")
RESTRICTABLE_APIS = ADMIN_APIS + ("statistics", "model-config", "metadata", "health", "inference")
ADMIN_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~-]{16,}")
MODEL_CONTROL_MODES = ("none", "explicit")


class TritonServerError(RuntimeError):
    """The server could not be located, laid out, started or stopped."""


class StopRequested(Exception):
    """SIGINT or SIGTERM reached `triton-mtp serve`."""


@dataclass(frozen=True)
class TritonInstall:
    """Paths of the tritonserver shipped by `nvidia-pytriton`."""

    binary: Path
    python_backend: Path  # backends/python: libtriton_python.so + triton_python_backend_utils.py
    stub: Path  # triton_python_backend_stub for the running Python
    libs: Path  # nvidia_pytriton.libs
    version: str  # nvidia-pytriton version


@dataclass(frozen=True)
class GrpcTls:
    """PEM files for serving gRPC over TLS (`--grpc-use-ssl`)."""

    server_cert: Path
    server_key: Path

    def check(self) -> None:
        for flag, path in (("--grpc-server-cert", self.server_cert), ("--grpc-server-key", self.server_key)):
            if not Path(path).is_file():
                raise TritonServerError(f"{flag} file {path} does not exist")

    def args(self) -> list[str]:
        return [
            "--grpc-use-ssl=true",
            f"--grpc-server-cert={Path(self.server_cert).resolve()}",
            f"--grpc-server-key={Path(self.server_key).resolve()}",
        ]


def check_admin_key(key: str, source: str) -> None:
    """Raise unless `key` is at least 16 characters of `A-Z a-z 0-9 . _ ~ -` (safe in a header)."""
    if not ADMIN_KEY_PATTERN.fullmatch(key):
        raise TritonServerError(f"admin key from {source} must be at least 16 characters of A-Z a-z 0-9 . _ ~ -")


def check_admin_apis(apis: Sequence[str]) -> None:
    unknown = [api for api in apis if api not in RESTRICTABLE_APIS]
    if unknown or not apis:
        raise TritonServerError(f"admin APIs {list(apis)}: each must be one of {', '.join(RESTRICTABLE_APIS)}")


def admin_headers(key: str, protocol: str) -> dict[str, str]:
    """The header carrying `key` for `protocol` ("grpc" or "http"), as tritonclient's `headers=`."""
    if protocol not in ("grpc", "http"):
        raise ValueError(f"protocol must be 'grpc' or 'http', got {protocol!r}")
    return {(GRPC_HEADER_PREFIX if protocol == "grpc" else "") + ADMIN_HEADER: key}


def find_tritonserver() -> TritonInstall:
    """Locate binary, Python backend, stub and libraries inside the installed `nvidia-pytriton`."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonServerError("nvidia-pytriton is not installed: pip install nvidia-pytriton==0.7.0")
    package = Path(next(iter(spec.submodule_search_locations)))
    root = package / "tritonserver"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    install = TritonInstall(
        binary=root / "bin" / "tritonserver",
        python_backend=root / "backends" / "python",
        stub=root / "python_backend_stubs" / python / "triton_python_backend_stub",
        libs=package.parent / "nvidia_pytriton.libs",
        version=importlib.metadata.version("nvidia-pytriton"),
    )
    if not install.stub.is_file():
        raise TritonServerError(f"nvidia-pytriton has no Python backend stub for Python {python}: {install.stub}")
    for path in (install.binary, install.python_backend / "libtriton_python.so", install.libs):
        if not path.exists():
            raise TritonServerError(f"nvidia-pytriton is incomplete, missing {path}")
    return install


def backend_directory(install: TritonInstall, cache_root: Path | None = None) -> Path:
    """A `--backend-directory` whose `python/` holds the backend and this Python's stub.

    Built once under `~/.cache/triton-mtp/backends-<pytriton>-py3.X` and reused; concurrent builders
    each fill a temporary directory and the first rename wins.
    """
    if cache_root is None:
        cache_root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "triton-mtp"
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    target = cache_root / f"backends-{install.version}-py{python}"
    if (target / "python" / "triton_python_backend_stub").is_file():
        return target
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=cache_root))
    try:
        shutil.copytree(install.python_backend, staging / "python", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copy2(install.stub, staging / "python" / "triton_python_backend_stub")
        os.rename(staging, target)
    except OSError:
        if not (target / "python" / "triton_python_backend_stub").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def ephemeral_ports() -> range:
    """The kernel's range for port-0 binds and outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports that are free right now, drawn at random below the ephemeral range.

    A port the kernel hands out (bind to port 0) can be handed out again, to another process's listener
    or outgoing connection, before the server binds it (tritonserver binds after loading its models);
    one below that range is only ever taken by name. All stay bound until all are chosen.
    """
    ephemeral = ephemeral_ports()
    below = range(FREE_PORTS_FROM, max(FREE_PORTS_FROM, ephemeral.start))
    candidates = random.sample(below, min(len(below), 64 * count))
    sockets: list[socket.socket] = []
    try:
        for port in candidates:
            if len(sockets) == count:
                break
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.bind(("", port))
            except OSError:
                sock.close()
                continue
            sockets.append(sock)
        while len(sockets) < count:  # no room below the ephemeral range: whatever the kernel hands out
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    """A TCP port that is free right now."""
    return free_ports(1)[0]


def check_port_free(port: int, name: str) -> None:
    """Raise if something already listens on `port` (the server binds 0.0.0.0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            raise TritonServerError(f"{name} port {port} is already in use ({exc.strerror})") from None


def interpreter_libdir() -> str | None:
    """Directory of this interpreter's libpython, so the stub links it rather than the system's.

    A stub linked to another build of the same Python version (e.g. Debian's libpython under a
    pyenv interpreter) runs that build's frozen `site` module and misses this environment's packages.
    """
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if libdir and soname and (Path(libdir) / soname).is_file():
        return libdir
    return None


def check_repository(repository: Path) -> None:
    """Raise unless `repository` holds at least one model directory with a config.pbtxt."""
    if not repository.is_dir():
        raise TritonServerError(f"model repository {repository} does not exist or is not a directory")
    if not any((model / "config.pbtxt").is_file() for model in repository.iterdir()):
        raise TritonServerError(f"model repository {repository} has no model directory with a config.pbtxt")


class TritonServer:
    """One tritonserver process serving `repository`; a context manager that starts and waits ready.

    `grpc_url` and `http_url` are `host:port` as tritonclient expects; `metrics_url` is the full
    Prometheus address. The server's stdout and stderr go to `log_path`. With `admin_key`, the
    `admin_apis` answer only requests carrying it (`admin_headers`); `grpc_tls` serves gRPC over TLS;
    `model_control_mode="explicit"` loads every model at start and allows load / unload requests.
    """

    def __init__(
        self,
        repository: str | os.PathLike,
        grpc_port: int = 8001,
        http_port: int = 8000,
        metrics_port: int = 8002,
        log_verbose: int = 0,
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike | None = None,
        admin_key: str | None = None,
        admin_apis: Sequence[str] = ADMIN_APIS,
        grpc_tls: GrpcTls | None = None,
        model_control_mode: str = "none",
    ) -> None:
        self.repository = Path(repository).resolve()
        self.ports = {"grpc": grpc_port, "http": http_port, "metrics": metrics_port}
        self.log_verbose = log_verbose
        self.extra_args = tuple(extra_args)
        self.log_path = Path(log_path) if log_path is not None else None
        self.admin_key = admin_key
        self.admin_apis = tuple(admin_apis)
        self.grpc_tls = grpc_tls
        self.model_control_mode = model_control_mode
        self.process: subprocess.Popen | None = None

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.ports['http']}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['metrics']}/metrics"

    def security_args(self) -> list[str]:
        """Restricted-API and TLS flags; validates key, API names, control mode and PEM files."""
        if self.model_control_mode not in MODEL_CONTROL_MODES:
            raise TritonServerError(f"model control mode must be one of {MODEL_CONTROL_MODES}, got {self.model_control_mode!r}")
        args = ["--load-model=*"] if self.model_control_mode == "explicit" else []
        if self.admin_key is not None:
            check_admin_key(self.admin_key, "admin_key")
            check_admin_apis(self.admin_apis)
            restriction = f"{','.join(self.admin_apis)}:{ADMIN_HEADER}={self.admin_key}"
            args += [f"--grpc-restricted-protocol={restriction}", f"--http-restricted-api={restriction}"]
        if self.grpc_tls is not None:
            self.grpc_tls.check()
            args += self.grpc_tls.args()
        return args

    def command(self, install: TritonInstall, backends: Path) -> list[str]:
        return [
            str(install.binary),
            f"--model-repository={self.repository}",
            f"--backend-directory={backends}",
            f"--model-control-mode={self.model_control_mode}",
            *self.security_args(),
            f"--grpc-port={self.ports['grpc']}",
            f"--http-port={self.ports['http']}",
            f"--metrics-port={self.ports['metrics']}",
            f"--log-verbose={self.log_verbose}",
            f"--backend-config=python,shm-default-byte-size={SHM_DEFAULT_BYTE_SIZE}",
            f"--backend-config=python,shm-growth-byte-size={SHM_GROWTH_BYTE_SIZE}",
            f"--exit-timeout-secs={int(STOP_GRACE_S) // 2}",
            *self.extra_args,
        ]

    def environment(self, install: TritonInstall) -> dict[str, str]:
        env = dict(os.environ)
        # With local hops the engine's CPU model calls run on the scheduler's thread, where MKL's own threading
        # made a 5-token verify 2-4x slower than one MKL thread does (bench/cpu_threads.py); torch's intra-op
        # threads still split the other ops. A value set by the caller wins.
        env.setdefault("MKL_NUM_THREADS", "1")
        libs = [str(install.libs), interpreter_libdir(), env.get("LD_LIBRARY_PATH")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, libs))
        env["PATH"] = os.pathsep.join(filter(None, [os.path.dirname(sys.executable), env.get("PATH")]))
        return env

    def start(self) -> None:
        """Check repository and ports, then launch tritonserver in its own process group."""
        if self.process is not None:
            raise TritonServerError("server already started")
        check_repository(self.repository)
        if len(set(self.ports.values())) < len(self.ports):
            raise TritonServerError(f"grpc, http and metrics ports must differ, got {self.ports}")
        for name, port in self.ports.items():
            check_port_free(port, name)
        install = find_tritonserver()
        command = self.command(install, backend_directory(install))
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(install),
                start_new_session=True,
            )

    def log_errors(self, lines: int = LOG_ERROR_LINES) -> str:
        """The server's error lines (glog `E...` and `error:`), or its last lines when it logged none."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, errors="replace") as log:
            text = log.readlines()
        errors = [line for line in text if re.match(r"E\d{4} |error: ", line)]
        return "".join(errors[-lines:] if errors else text[-lines:])

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Poll the readiness endpoint; raise with the server's last log lines if it exits or times out."""
        if self.process is None:
            raise TritonServerError("server not started")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise TritonServerError(
                    f"tritonserver exited with code {code} before becoming ready "
                    f"(repository {self.repository}, log {self.log_path}):\n{self.log_errors()}"
                )
            if self.is_ready():
                return
            time.sleep(0.2)
        raise TritonServerError(
            f"tritonserver not ready after {timeout:.0f}s "
            f"(repository {self.repository}, log {self.log_path}):\n{self.log_errors()}"
        )

    def stop(self, grace: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the process group, SIGKILL it after `grace` seconds; return the server's exit code."""
        if self.process is None:
            return None
        process, self.process = self.process, None
        group = process.pid  # start_new_session: the server leads its own group
        signal_group(group, signal.SIGTERM)
        try:
            code = process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            signal_group(group, signal.SIGKILL)
            code = process.wait()
        signal_group(group, signal.SIGKILL)  # stubs that outlived the server
        return code

    def stub_pid(self, model: str) -> int:
        """The Python backend stub serving `model`, from /proc: in this server's process group, its
        command line naming `model`'s directory of this repository."""
        if self.process is None:
            raise TritonServerError("server not started")
        prefix = f"{self.repository}/{model}/".encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                group = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2])
            except (OSError, IndexError, ValueError):
                continue
            if group == self.process.pid and argv[0].endswith(b"triton_python_backend_stub") and argv[1].startswith(prefix):
                return int(entry.name)
        raise TritonServerError(f"no backend stub of {model} in server {self.process.pid}")

    def __enter__(self) -> "TritonServer":
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def signal_group(group: int, signum: int) -> None:
    try:
        os.killpg(group, signum)
    except ProcessLookupError:
        pass


def admin_key_for(args: argparse.Namespace) -> tuple[str | None, str]:
    """The admin key `serve` restricts with and where it came from: none, the environment, or generated."""
    if args.unrestricted_admin:
        return None, "unrestricted"
    key = os.environ.get(ADMIN_KEY_ENV)
    if key is None:
        return secrets.token_urlsafe(24), "generated"
    check_admin_key(key, ADMIN_KEY_ENV)
    return key, ADMIN_KEY_ENV


def grpc_tls_for(args: argparse.Namespace) -> GrpcTls | None:
    if not args.grpc_use_ssl:
        if args.grpc_server_cert or args.grpc_server_key:
            raise TritonServerError("--grpc-server-cert / --grpc-server-key need --grpc-use-ssl")
        return None
    for flag, value in (("--grpc-server-cert", args.grpc_server_cert), ("--grpc-server-key", args.grpc_server_key)):
        if not value:
            raise TritonServerError(f"--grpc-use-ssl needs {flag}")
    return GrpcTls(Path(args.grpc_server_cert), Path(args.grpc_server_key))


def print_endpoints(server: TritonServer, key_source: str) -> None:
    tls = " (TLS)" if server.grpc_tls is not None else ""
    print(f"grpc     {server.grpc_url}{tls}", flush=True)
    print(f"http     http://{server.http_url}", flush=True)
    print(f"metrics  {server.metrics_url}", flush=True)
    print(f"log      {server.log_path}", flush=True)
    if server.admin_key is None:
        print("admin    unrestricted: anyone reaching the ports can load models and change logging", flush=True)
        return
    shown = server.admin_key if key_source == "generated" else f"<from {ADMIN_KEY_ENV}>"
    print(
        f"admin    {','.join(server.admin_apis)} need header {ADMIN_HEADER}: {shown} "
        f"(gRPC metadata {GRPC_HEADER_PREFIX}{ADMIN_HEADER})",
        flush=True,
    )


def serve(args: argparse.Namespace) -> int:
    """`triton-mtp serve`: start, wait ready, print the endpoints, block until SIGINT/SIGTERM."""
    try:
        admin_key, key_source = admin_key_for(args)
        grpc_tls = grpc_tls_for(args)
    except TritonServerError as exc:
        print(f"triton-mtp serve: error: {exc}", file=sys.stderr)
        return 1
    server = TritonServer(
        args.repository,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        log_verbose=args.log_verbose,
        admin_key=admin_key,
        admin_apis=args.admin_apis,
        grpc_tls=grpc_tls,
        model_control_mode=args.model_control_mode,
    )

    def request_stop(signum: int, frame: object) -> None:
        raise StopRequested(signal.Signals(signum).name)

    previous = {s: signal.signal(s, request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start()
        server.wait_ready(args.ready_timeout)
        print_endpoints(server, key_source)
        code = server.process.wait()
        raise TritonServerError(f"tritonserver exited with code {code}:\n{server.log_errors()}")
    except StopRequested:
        pass
    except TritonServerError as exc:
        print(f"triton-mtp serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        for signum in previous:
            signal.signal(signum, signal.SIG_IGN)  # a second signal must not abandon the shutdown
        server.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 0


def api_list(text: str) -> tuple[str, ...]:
    apis = tuple(api.strip() for api in text.split(",") if api.strip())
    try:
        check_admin_apis(apis)
    except TritonServerError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return apis


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("serve", help="run tritonserver on a model repository")
    parser.add_argument("--repository", required=True, help="model repository directory")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for readiness")
    security = parser.add_argument_group(
        "security",
        f"admin APIs need the key from ${ADMIN_KEY_ENV} (a new one is generated and printed when unset)",
    )
    security.add_argument("--admin-apis", type=api_list, default=ADMIN_APIS, metavar="API,...",
                          help=f"APIs that need the admin key (default {','.join(ADMIN_APIS)})")
    security.add_argument("--unrestricted-admin", action="store_true", help="serve the admin APIs without a key")
    security.add_argument("--model-control-mode", choices=MODEL_CONTROL_MODES, default="none",
                          help="explicit: load every model at start and accept load / unload requests")
    security.add_argument("--grpc-use-ssl", action="store_true", help="serve gRPC over TLS")
    security.add_argument("--grpc-server-cert", help="PEM server certificate (with --grpc-use-ssl)")
    security.add_argument("--grpc-server-key", help="PEM server private key (with --grpc-use-ssl)")
    parser.set_defaults(func=serve)
