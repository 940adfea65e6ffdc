"""GPU time of one replay of the target's decode graphs per batch size, by how the step is built.

The served graphs (serving/graphs.py `GraphedTarget`: the target step and greedy verification, one
token or the verify window) are timed over back-to-back replays with CUDA events, for the step run
eager inside the capture, compiled as the eager format serves it (`compile_step`: dynamic shapes), and
compiled for static shapes; then the standalone loop's `torch.compile(mode="reduce-overhead")` step
(bench/graphs.py `CompiledStep`) called the same way. bf16 on CUDA.

    python -m bench.graph_time --checkpoint models/tiny-dsv3-mtp --out graph_time.json
    python -m bench.graph_time --checkpoint models/tiny-dsv3-mtp --batch 1,32 --builds served --out graph_time.json

`--batch`: the batch sizes timed (each a bucket of the graphs); `--builds`: the builds timed (`BUILDS`' keys,
and "standalone").
"""
from __future__ import annotations

import argparse
import time

import torch

from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.formats.eager import COMPILE_OPTIONS, compile_step
from triton_mtp.serving.graphs import GraphedTarget, target_width
from triton_mtp.serving.workers import verify_window

from .common import environment, write_result
from .graphs import CompiledStep, place_rope

BUILDS = {  # --builds name: (label, build)
    "eager": ("eager", lambda step: step),
    "served": ("compiled, dynamic shapes (served)", compile_step),
    "static": ("compiled, static shapes", lambda step: torch.compile(step, dynamic=False, options=COMPILE_OPTIONS)),
}


def replay_ms(replay, repeats: int) -> float:
    """Mean ms per call of `replay()` over `repeats` back-to-back calls (device time once launches keep up)."""
    for _ in range(10):
        replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda")
    width = target_width(args.max_draft)
    batches = [int(b) for b in args.batch.split(",")]
    builds = args.builds.split(",")
    if unknown := set(builds) - set(BUILDS) - {"standalone"}:
        raise ValueError(f"--builds: unknown {sorted(unknown)}; choose from {sorted(BUILDS) + ['standalone']}")
    _, target, _ = load_checkpoint(args.checkpoint, "bf16", device, max_slots=max(batches),
                                   max_seq_len=args.max_seq_len, progress=False)
    place_rope(target, device)
    results = {"benchmark": "graph_time", "checkpoint": args.checkpoint, "width": width, "repeats": args.repeats,
               "batches": batches, "environment": environment(), "ms": {}}

    def record(name: str, batch: int, tokens: int, ms: float, note: str = "") -> None:
        label = f"{name}, {tokens} token(s)" + (f", batch {batch}" if batch > 1 else "")
        results["ms"][label] = ms
        print(f"{label}: {ms:.3f} ms per replay{note}", flush=True)

    for name, build in (BUILDS[b] for b in builds if b in BUILDS):
        torch._dynamo.reset()
        start = time.perf_counter()
        graphed = GraphedTarget(verify_window(build(target)), max(batches), width, device)
        seconds = time.perf_counter() - start
        for b in batches:
            for key in (1, width):
                record(name, b, key, replay_ms(graphed.graphs[key, b].replay, args.repeats),
                       f" (built in {seconds:.0f} s)")
        del graphed
    if "standalone" in builds:
        torch._dynamo.reset()
        step = CompiledStep(target)
        for b in batches:
            for tokens in (1, width):
                inputs = (torch.zeros(b, tokens, dtype=torch.long, device=device),
                          torch.full((b, tokens), -1, dtype=torch.long, device=device),
                          torch.arange(b, dtype=torch.long, device=device))
                record("reduce-overhead (standalone)", b, tokens, replay_ms(lambda: step(*inputs), args.repeats))
    if args.out:
        write_result(args.out, results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--max-draft", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=261)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--batch", default="1", help="comma-separated batch sizes, each a graph bucket")
    parser.add_argument("--builds", default="eager,served,static,standalone", help="comma-separated builds timed")
    parser.add_argument("--out", help="result JSON file")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
