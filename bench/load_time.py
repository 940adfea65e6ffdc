"""Time for a server to become ready on a repository whose models compile at load, with and without the
torch.compile cache the export ships (export/compile_cache.py). Each server gets an empty inductor
cache of its own, so only the shipped cache can help.

    python -m bench.load_time --checkpoint models/tiny-dsv3-mtp --out bench/results/load_time.json \\
        [--device cuda --dtype bf16 --compile-graphs] [--hops local]

On CPU the eager format compiles at load by default; on CUDA only with --compile-graphs (the decode
graphs capture compiled steps). The export's own time is reported too: its parity check does the compiling.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import environment, write_result
from triton_mtp.export.compile_cache import CACHE_DIR
from triton_mtp.export.repository import write_repository
from triton_mtp.serving.server import TritonServer, free_ports


def ready_seconds(repository: Path, inductor_cache: Path, log_path: Path, timeout_s: float) -> float:
    """Seconds from launching tritonserver to every model ready, with TORCHINDUCTOR_CACHE_DIR empty."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)  # the server's environment is this one's
    ports = dict(zip(("grpc_port", "http_port", "metrics_port"), free_ports(3)))
    server = TritonServer(repository, **ports, log_path=log_path)
    start = time.perf_counter()
    try:
        server.start()
        server.wait_ready(timeout_s)
        return time.perf_counter() - start
    finally:
        server.stop()
        if previous is None:
            del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--hops", default="local", choices=["local", "bls"])
    parser.add_argument("--compile-graphs", action="store_true")
    parser.add_argument("--max-slots", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2, help="servers per repository, alternating")
    parser.add_argument("--ready-timeout", type=float, default=1200.0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="load-time-") as tmp:
        work = Path(tmp)
        shipped, bare = work / "with_cache", work / "without_cache"
        start = time.perf_counter()
        write_repository(args.checkpoint, shipped, fmt="eager", device=args.device, dtype=args.dtype,
                         max_slots=args.max_slots, max_seq_len=args.max_seq_len, hops=args.hops,
                         compile_graphs=args.compile_graphs, progress=False)
        export_s = time.perf_counter() - start
        caches = sorted(shipped.rglob(CACHE_DIR))
        if not caches:
            raise SystemExit("load_time: the export shipped no compile cache: these models do not compile at load")
        shutil.copytree(shipped, bare)
        for cache in bare.rglob(CACHE_DIR):
            shutil.rmtree(cache)
        runs: dict[str, list[float]] = {"with_cache": [], "without_cache": []}
        for i in range(args.repeats):
            for name, repository in (("with_cache", shipped), ("without_cache", bare)):
                seconds = ready_seconds(repository, work / f"inductor_{name}_{i}", work / f"{name}_{i}.log",
                                        args.ready_timeout)
                runs[name].append(seconds)
                print(f"{name} #{i}: ready in {seconds:.1f} s", flush=True)
        shipped_mb = sum(f.stat().st_size for c in caches for f in c.rglob("*") if f.is_file()) / 2**20
    write_result(args.out, {"checkpoint": args.checkpoint, "device": args.device, "dtype": args.dtype,
                            "hops": args.hops, "compile_graphs": args.compile_graphs, "export_s": export_s,
                            "shipped_cache_mb": shipped_mb, "ready_s": runs, "environment": environment()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
