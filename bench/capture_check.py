"""Whether the served decode graphs capture over exported repositories' artifacts, outside Triton.

For each repository (format and sizes from its export manifest) and each of `target` and `mtp`: run
the batch-1 decode call once under `torch.cuda.set_sync_debug_mode("error")` (an op that synchronizes
with the host, which no capture can hold, raises there, named), build `GraphedTarget` / `GraphedMTP`
as the served models do, check every graph against eager, and time the batch-1 call graphed (for
`target`, with greedy verification) and eager. For `target` also the same one-token call padded by a
second, padding token, which replays the verify window's graph instead of the one-token graph that
plain decoding replays.
Each repository runs in a fresh process: a failed capture can leave the CUDA context unusable.

    python -m bench.capture_check --repository DIR [--repository DIR ...] --out capture.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

from .common import environment, step_time
from triton_mtp.export.graphs import load_step
from triton_mtp.export.repository import MANIFEST
from triton_mtp.serving import graphs

REPEATS = 200  # timed calls per step


def _sync_error(step, inputs) -> str | None:
    """The first host synchronization the call makes, or None."""
    if inputs[0].device.type != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            step(*inputs)
        return None
    except RuntimeError as exc:
        return str(exc).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _manifest(repository: Path) -> dict:
    return json.loads((repository / MANIFEST).read_text())


def check(repository: Path, device: torch.device) -> dict:
    """Per model of one repository: the capture's outcome and batch-1 call times."""
    manifest = _manifest(repository)
    fmt, max_slots, max_draft = manifest["format"], manifest["sizes"]["max_slots"], manifest["sizes"]["max_draft_tokens"]
    artifacts = manifest["artifacts"]  # under target/1 and mtp/1, or spec_decode/1 with local hops
    compile = manifest.get("compile_graphs", False)  # as a graphed model loads its steps
    target = load_step(repository / artifacts["target"], fmt, device, compile=compile)
    mtp = load_step(repository / artifacts["mtp_0"], fmt, device, compile=compile)  # every mtp_<i> beside it
    layers = len(mtp.graphs)
    one = torch.ones(1, 1, dtype=torch.long, device=device)  # [1, 1]
    slot = torch.zeros(1, dtype=torch.long, device=device)  # [1]
    _, hidden = target(one, -one, slot)  # [1, 1, H]
    no_drafts = torch.zeros(1, dtype=torch.long, device=device)  # [1]
    padded = torch.cat([one, one], 1), torch.cat([-one, -one], 1)  # [1, 2] each: the second token is padding
    builds = {
        "target": (target, [one, -one, slot],
                   lambda: graphs.target_graphs(target, max_slots, max_draft, device),
                   [one, -one, slot, no_drafts, 0]),
        "mtp": (mtp, [one, torch.zeros_like(hidden), -one, slot],
                lambda: graphs.mtp_graphs(mtp, layers, max_slots, max_draft, hidden.shape[-1], hidden.dtype, device),
                None),
    }
    result = {"format": fmt}
    for name, (runner, inputs, build, graphed_inputs) in builds.items():
        entry = {"host_sync": _sync_error(runner, inputs), "eager_ms": step_time(runner, inputs, device, REPEATS) * 1e3}
        try:
            graphed = build()
            graphed.check_against_eager()
            entry.update(captured=True, graphed_ms=step_time(graphed, graphed_inputs or inputs, device, REPEATS) * 1e3)
            if name == "target" and max_draft:
                entry["graphed_window_ms"] = step_time(graphed, [*padded, slot, no_drafts, 0], device, REPEATS) * 1e3
        except Exception as exc:  # noqa: BLE001 - the outcome is the measurement
            entry.update(captured=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0]}")
        result[name] = entry
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, action="append", required=True)
    parser.add_argument("--out", type=Path, help="result JSON file (not with --one)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--one", action="store_true", help="check the one repository here and print its JSON")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(check(args.repository[0], torch.device(args.device))))
        return
    results = {"environment": environment(), "repositories": {}}
    for repository in args.repository:
        done = subprocess.run([sys.executable, "-m", __spec__.name, "--one", "--repository", str(repository),
                               "--device", args.device], capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        found = json.loads(lines[-1]) if done.returncode == 0 and lines else \
            {"format": _manifest(repository)["format"], "exit": done.returncode, "stderr": done.stderr[-2000:]}
        results["repositories"][str(repository)] = found
        print(json.dumps(found), flush=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
