"""The export's parity check of torch.compile'd eager steps, per dtype and MoE kind.

`triton-mtp export --compile-graphs` (and the eager format on CPU) compiles the steps at load, so the
export's parity check compiles them too and compares them with eager. This runs that check for each
`--cases` entry (dtype:moe) on one checkpoint, with no tolerance, and writes the relative errors:

    python -m bench.compile_parity --checkpoint models/tiny-dsv3-mtp --device cuda \
        --cases bf16:dense,bf16:grouped,fp32:dense --out compile_parity.json
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from .common import environment, write_result
from triton_mtp.export.checkpoint import load_checkpoint
from triton_mtp.export.graphs import check_parity, export_graphs


def run(args: argparse.Namespace) -> dict:
    result = {"benchmark": "compile_parity", "checkpoint": args.checkpoint, "device": args.device,
              "verify_tokens": args.verify_tokens, "environment": environment(), "cases": {}}
    for case in args.cases.split(","):
        dtype, moe = case.split(":")
        torch._dynamo.reset()
        start = time.perf_counter()
        _, target, mtp = load_checkpoint(args.checkpoint, dtype, args.device, max_slots=4, max_seq_len=64,
                                         progress=False, moe=moe)
        with tempfile.TemporaryDirectory() as out:
            artifacts = export_graphs(target, mtp, out, "eager", checkpoint_dir=args.checkpoint, dtype=dtype, moe=moe)
            errors = check_parity(target, mtp, artifacts, "eager", verify_tokens=args.verify_tokens,
                                  tolerance=float("inf"), compile=True, log=lambda line: print(case, line, flush=True))
        result["cases"][case] = {"max_relative_error": errors, "seconds": time.perf_counter() - start}
        write_result(args.out, result)  # what is done so far survives a time limit
        del target, mtp
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", default="bf16:dense,bf16:grouped,fp32:dense", help="comma-separated dtype:moe")
    parser.add_argument("--verify-tokens", type=int, default=5, help="the verify window (max draft tokens + 1)")
    parser.add_argument("--out", required=True, help="result JSON file")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
