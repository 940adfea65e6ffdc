"""Whether the served decode graphs capture over an exported repository's artifacts, outside Triton.

For each TorchScript JIT setting (fusers on or off) and warmup count, in a fresh process each (a failed
capture can leave the CUDA context unusable): build `GraphedTarget` and `GraphedMTP` over the artifacts
as the `target` and `mtp` models do, check every graph against eager, and time a batch-1 decode call
graphed and eager. Results as one JSON file.

    python -m bench.capture_check --repository DIR --out capture.json [--max-slots 64 --max-draft-tokens 4]
"""
from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common import environment, synchronize
from triton_mtp.export.graphs import load_step
from triton_mtp.serving import graphs

VARIANTS = {"fusers on, warmup 2": (True, 2), "fusers on, warmup 5": (True, 5), "fusers off, warmup 3": (False, 3)}


def _call_ms(step, inputs, repeats: int = 200) -> float:
    for _ in range(3):
        step(*inputs)
    synchronize(inputs[0].device)
    start = time.perf_counter()
    for _ in range(repeats):
        step(*inputs)
    synchronize(inputs[0].device)
    return (time.perf_counter() - start) / repeats * 1e3


def check(repository: Path, fusers: bool, warmup: int, max_slots: int, max_draft: int, device: torch.device) -> dict:
    """One variant in this process: per model, the capture's outcome and batch-1 call times."""
    if not fusers:
        graphs.static_torchscript()
    capture = functools.partial(graphs.CapturedStep, warmup=warmup)
    result = {}
    target = load_step(repository / "target" / "1", "torchscript", device)
    mtp = load_step(repository / "mtp" / "1", "torchscript", device)
    layers = len(mtp.graphs)
    one = torch.ones(1, 1, dtype=torch.long, device=device)  # [1, 1]
    _, hidden = target(one, -one, torch.zeros(1, dtype=torch.long, device=device))  # [1, 1, H]
    builds = {
        "target": (target, lambda: graphs.GraphedTarget(target, max_slots, max_draft + 1, device, graph=capture)),
        "mtp": (mtp, lambda: graphs.GraphedMTP(mtp, layers, max_slots, max_draft + layers, hidden.shape[-1],
                                                hidden.dtype, device, graph=capture)),
    }
    for name, (runner, build) in builds.items():
        token_ids = torch.ones(1, 1, dtype=torch.long, device=device)  # [1, 1]
        positions = torch.full((1, 1), -1, dtype=torch.long, device=device)  # [1, 1]
        slot_ids = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        inputs = [token_ids, positions, slot_ids]
        if name == "mtp":
            inputs.insert(1, torch.zeros(1, 1, hidden.shape[-1], dtype=hidden.dtype, device=device))  # [1, 1, H]
        entry = {"eager_ms": _call_ms(runner, inputs)}
        try:
            graphed = build()
            graphed.check_against_eager()
            entry.update(captured=True, graphed_ms=_call_ms(graphed, inputs))
        except Exception as exc:  # noqa: BLE001 - the outcome is the measurement
            entry.update(captured=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        result[name] = entry
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--max-slots", type=int, default=64)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--variant", choices=VARIANTS, help="run one variant here and print its JSON")
    args = parser.parse_args()
    if args.variant:
        fusers, warmup = VARIANTS[args.variant]
        print(json.dumps(check(args.repository, fusers, warmup, args.max_slots, args.max_draft_tokens, torch.device(args.device))))
        return
    results = {"environment": environment(), "variants": {}}
    for variant in VARIANTS:
        done = subprocess.run([sys.executable, "-m", __spec__.name, *sys.argv[1:], "--variant", variant],
                              capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        results["variants"][variant] = json.loads(lines[-1]) if done.returncode == 0 and lines else \
            {"exit": done.returncode, "stderr": done.stderr[-2000:]}
        print(variant, json.dumps(results["variants"][variant]), flush=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
