"""CPU target steps called from the main thread and from a second thread, under MKL's threading and one MKL thread.

With local hops the engine's model calls run on the scheduler's thread, not the stub's main thread. On the
torch CPU wheel, MKL's own threading makes small GEMMs (a few tokens against a weight) several times slower
when they come from a second thread, while one MKL thread is as fast from either (and torch's intra-op
threads still split the other ops). So the launcher sets MKL_NUM_THREADS=1 (serving/server.py). Each
setting runs in a fresh interpreter, since MKL reads its thread count once:

    python -m bench.cpu_threads --checkpoint models/tiny-dsv3-mtp [--tokens 1,5 --repeats 50 --out F]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

from triton_mtp.export.checkpoint import load_checkpoint

from .common import environment, step_time, write_result

SETTINGS = {"MKL default": {}, "MKL_NUM_THREADS=1": {"MKL_NUM_THREADS": "1"}}


def measure(checkpoint: str, tokens: list[int], repeats: int) -> dict:
    """ms per target step of each token count, from the main thread, then from a second thread; and the
    MKL_NUM_THREADS this process ran under."""
    device = torch.device("cpu")
    _, target, _ = load_checkpoint(checkpoint, "fp32", device, max_slots=64, max_seq_len=261, progress=False)
    ms: dict[str, float] = {}

    def timed(where: str) -> None:
        for T in tokens:
            inputs = (torch.zeros(1, T, dtype=torch.long),  # token_ids [1, T]
                      torch.arange(100, 100 + T).view(1, T),  # positions [1, T]
                      torch.zeros(1, dtype=torch.long))  # slot_ids [1]
            with torch.no_grad():
                ms[f"{where}, {T} token(s)"] = step_time(target, inputs, device, repeats) * 1e3

    timed("main thread")
    with ThreadPoolExecutor(1) as pool:
        pool.submit(timed, "second thread").result()
    return {"mkl_num_threads": os.environ.get("MKL_NUM_THREADS"), "ms": ms}


def run(args: argparse.Namespace) -> dict:
    results = {"benchmark": "cpu_threads", "checkpoint": args.checkpoint, "tokens": args.tokens,
               "repeats": args.repeats, "torch_threads": torch.get_num_threads(), "environment": environment(),
               "settings": {}}
    for name, extra in SETTINGS.items():
        env = {k: v for k, v in os.environ.items() if k != "MKL_NUM_THREADS"} | extra
        done = subprocess.run([sys.executable, "-m", "bench.cpu_threads", "--checkpoint", args.checkpoint,
                               "--tokens", args.tokens, "--repeats", str(args.repeats), "--measure"],
                              env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{name}: the measuring process failed:\n{done.stderr[-3000:]}")
        results["settings"][name] = json.loads(done.stdout.splitlines()[-1])
        for case, ms in results["settings"][name]["ms"].items():
            print(f"{name}, {case}: {ms:.2f} ms", flush=True)
    if args.out:
        write_result(args.out, results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--tokens", default="1,5", help="comma-separated tokens per step (1: decode, 5: a k=4 verify)")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--measure", action="store_true", help="time under this process's environment, print JSON")
    parser.add_argument("--out", help="result JSON file")
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.checkpoint, [int(t) for t in args.tokens.split(",")], args.repeats)))
    else:
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
