"""GPU time of one replay of the target's decode graphs at batch 1, by how the step is built.

The served graphs (serving/graphs.py `GraphedTarget`: the target step and greedy verification, one
token or the verify window) are timed over back-to-back replays with CUDA events, for the step run
eager inside the capture, compiled as the eager format serves it (`compile_step`: dynamic shapes), and
compiled for static shapes; then the standalone loop's `torch.compile(mode="reduce-overhead")` step
(bench/graphs.py `CompiledStep`) called the same way. bf16 on CUDA.

    python -m bench.graph_time --checkpoint models/tiny-dsv3-mtp --out graph_time.json
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

BUILDS = {
    "eager": lambda step: step,
    "compiled, dynamic shapes (served)": compile_step,
    "compiled, static shapes": lambda step: torch.compile(step, dynamic=False, options=COMPILE_OPTIONS),
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
    _, target, _ = load_checkpoint(args.checkpoint, "bf16", device, max_slots=1, max_seq_len=args.max_seq_len,
                                   progress=False)
    place_rope(target, device)
    results = {"benchmark": "graph_time", "checkpoint": args.checkpoint, "width": width, "repeats": args.repeats,
               "environment": environment(), "ms": {}}
    for name, build in BUILDS.items():
        torch._dynamo.reset()
        start = time.perf_counter()
        graphed = GraphedTarget(verify_window(build(target)), 1, width, device)
        seconds = time.perf_counter() - start
        for key in (1, width):
            ms = replay_ms(graphed.graphs[key, 1].replay, args.repeats)
            results["ms"][f"{name}, {key} token(s)"] = ms
            print(f"{name}, {key} token(s): {ms:.3f} ms per replay (built in {seconds:.0f} s)", flush=True)
        del graphed
    torch._dynamo.reset()
    step = CompiledStep(target)
    for tokens in (1, width):
        inputs = (torch.zeros(1, tokens, dtype=torch.long, device=device),
                  torch.full((1, tokens), -1, dtype=torch.long, device=device),
                  torch.zeros(1, dtype=torch.long, device=device))
        ms = replay_ms(lambda: step(*inputs), args.repeats)
        results["ms"][f"reduce-overhead (standalone), {tokens} token(s)"] = ms
        print(f"reduce-overhead (standalone), {tokens} token(s): {ms:.3f} ms per call", flush=True)
    if args.out:
        write_result(args.out, results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--max-draft", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=261)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--out", help="result JSON file")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
