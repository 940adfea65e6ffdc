"""Where a served step's time goes: py-spy samples of `spec_decode`'s stub while it decodes `--streams` streams.

Serves `--repository` with an embedded tritonserver and, for each k asked for, warms up, then keeps the
streams busy while py-spy records the stub three times: every thread with idle frames (`--idle`: where each
thread waits), only the thread holding the GIL (`--gil`), and native frames (`--native`: time inside
the C++ of the stub and torch). Writes the raw profiles (folded stacks), each thread's share of the
samples and its top frames (`summary.json`), and the stream's tokens/s and step phases over the window.

    python -m bench.served_profile --checkpoint DIR --repository REPO --out DIR [--py-spy PATH] [-k 0,3] [--streams 32]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .common import environment, held_out_prompts, write_result
from .triton_bench import run_level, server_counters, step_phases_ms

MODES = {"idle": ["--idle"], "gil": ["--gil"], "native": ["--native"]}


def top_frames(raw: Path, count: int = 25) -> dict:
    """Per thread: its samples, and the frames with the most samples inclusive (on the stack) and self
    (innermost), from py-spy's folded stacks ("thread;frame;frame N")."""
    threads: dict[str, dict] = {}
    for line in raw.read_text().splitlines():
        stack, n = line.rsplit(" ", 1)
        thread, *frames = stack.split(";")
        name = thread.split(": ", 1)[-1]
        entry = threads.setdefault(name, {"samples": 0, "inclusive": collections.Counter(), "self": collections.Counter()})
        entry["samples"] += int(n)
        for frame in set(frames):
            entry["inclusive"][frame] += int(n)
        if frames:
            entry["self"][frames[-1]] += int(n)
    return {name: {"samples": e["samples"], "inclusive": e["inclusive"].most_common(count),
                   "self": e["self"].most_common(count)}
            for name, e in sorted(threads.items(), key=lambda item: -item[1]["samples"])}


def profile(py_spy: str, pid: int, seconds: float, rate: int, out: Path, name: str) -> dict:
    """One py-spy recording per mode, as out/{name}-{mode}.txt; the summary of each."""
    summary = {}
    for mode, flags in MODES.items():
        raw = out / f"{name}-{mode}.txt"
        done = subprocess.run([py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
                               "--threads", "--format", "raw", "--output", str(raw), *flags],
                              capture_output=True, text=True, timeout=seconds + 60)
        summary[mode] = top_frames(raw) if done.returncode == 0 and raw.exists() else {"error": done.stderr[-2000:]}
    return summary


def measure(server, pid: int, prompts: list[list[int]], k: int, args: argparse.Namespace, out: Path) -> dict:
    """Warm up k, then profile the stub while `args.streams` streams decode with k: tokens/s, step phases,
    summaries."""
    n = args.streams
    run_level(server.grpc_url, server.metrics_url, prompts, n, 2 * n, args.max_tokens, k)
    stop = threading.Event()
    tokens: list[int] = []

    def load() -> None:  # n streams, a request each at a time, until the recordings end
        while not stop.is_set():
            level = run_level(server.grpc_url, server.metrics_url, prompts, n, n, args.max_tokens, k)
            tokens.append(level["output_tokens"])

    before = server_counters(server.metrics_url)
    start = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        streaming = pool.submit(load)
        try:
            summary = profile(args.py_spy, pid, args.seconds, args.rate, out, f"k{k}" + (f"-c{n}" if n > 1 else ""))
        finally:
            stop.set()
        streaming.result()  # a failed stream fails the measurement: a profile of an idle stub is no result
    wall = time.perf_counter() - start
    after = server_counters(server.metrics_url)
    return {"tokens_per_s": sum(tokens) / wall, "step_ms": step_phases_ms(before, after), "wall_s": wall,
            "steps": after["spec_decode_steps", "spec_decode"] - before["spec_decode_steps", "spec_decode"],
            "profiles": summary}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--repository", required=True)
    parser.add_argument("--out", required=True, help="results directory")
    parser.add_argument("--py-spy", default="py-spy")
    parser.add_argument("-k", "--draft-tokens", default="0", help="comma-separated k, each profiled in turn")
    parser.add_argument("--streams", type=int, default=1, help="concurrent streams while recording")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each recording")
    parser.add_argument("--rate", type=int, default=2000, help="samples per second")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from triton_mtp.serving.server import TritonServer, free_ports

    prompts = held_out_prompts(args.checkpoint, args.prompts, args.prompt_tokens)
    grpc_port, http_port, metrics_port = free_ports(3)
    with contextlib.ExitStack() as stack:
        server = TritonServer(args.repository, grpc_port, http_port, metrics_port, log_path=out / "server.log")
        server.start()
        stack.callback(server.stop, 5.0)
        server.wait_ready(900)
        pid = server.stub_pid("spec_decode")
        result = {"benchmark": "served_profile", "environment": environment(), "streams": args.streams, "by_k": {}}
        for k in [int(k) for k in args.draft_tokens.split(",")]:
            result["by_k"][str(k)] = level = measure(server, pid, prompts, k, args, out)
            phases = ", ".join(f"{phase} {ms:.3f}" for phase, ms in level["step_ms"].items())
            print(f"served profile k={k}, {args.streams} streams: {level['tokens_per_s']:.1f} tokens/s, "
                  f"ms per step: {phases}", flush=True)
            write_result(out / "summary.json", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
