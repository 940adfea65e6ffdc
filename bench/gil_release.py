"""What one torch call costs the engine's thread while another Python thread runs, against running alone.

A torch call that lets go of the GIL must take it back afterwards, and while another thread runs Python that
waits until the holder lets go: at the switch interval at the latest (`sys.setswitchinterval`; spec_decode
sets 100 us). In the served process that other thread is a response thread building and sending responses
(docs/benchmarks.md, run 29: the engine thread held the GIL in 56% of the samples where any thread held it).
So the engine's decode path counts torch calls, not just the work in them (serving/transfers.py). Calls that
keep the GIL slow down only by the share of the interpreter the other thread takes.

    python -m bench.gil_release [--calls 2000 --switch-interval-us 100 --out gil_release.json]
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import torch

from .common import environment, write_result


def host_calls() -> dict[str, callable]:
    """Calls of the kinds the engine's decode path makes on small host tensors, and Python ones to compare."""
    ids, pinned, array = torch.zeros(64, dtype=torch.int64), torch.zeros(4096, dtype=torch.uint8), np.zeros(64)
    out = torch.zeros(64, dtype=torch.int64)
    return {
        "tensor.view": lambda: ids.view(8, 8),
        "tensor[:n]": lambda: pinned[:512],
        "tensor.view(dtype)": lambda: pinned.view(torch.int64),
        "tensor.copy_": lambda: out.copy_(ids),
        "torch.from_numpy": lambda: torch.from_numpy(array),
        "tensor.numpy": lambda: ids.numpy(),
        "tensor.tolist": lambda: ids.tolist(),
        "torch.tensor(list)": lambda: torch.tensor([1, 2, 3]),
        "numpy slice": lambda: array[:32],
        "python list slice": lambda: [1, 2, 3][:2],
    }


def per_call_us(call, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start) / n * 1e6


def run(args: argparse.Namespace) -> dict:
    sys.setswitchinterval(args.switch_interval_us * 1e-6)
    calls = host_calls()
    alone = {name: per_call_us(call, args.calls) for name, call in calls.items()}
    stop = threading.Event()

    def spin() -> None:  # a thread that runs Python without pause, as a busy response thread does
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    try:
        contended = {name: per_call_us(call, args.calls) for name, call in calls.items()}
    finally:
        stop.set()
        spinner.join()
    result = {"benchmark": "gil_release", "switch_interval_us": args.switch_interval_us, "calls": args.calls,
              "environment": environment(),
              "per_call_us": {name: {"alone": alone[name], "beside_a_python_thread": contended[name],
                                     "ratio": contended[name] / alone[name]} for name in calls}}
    for name, row in result["per_call_us"].items():
        print(f"{name:20s} alone {row['alone']:7.2f} us, beside a Python thread {row['beside_a_python_thread']:7.2f} us "
              f"({row['ratio']:.1f}x)")
    if args.out:
        write_result(args.out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls of each kind per measurement")
    parser.add_argument("--switch-interval-us", type=float, default=100.0, help="sys.setswitchinterval, in us")
    parser.add_argument("--out", help="result JSON file")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
