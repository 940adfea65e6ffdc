"""The compiling part of a compiled model's load, in process: each step's warm-up with an empty inductor cache.

A served model that compiles its steps (the eager format on CPU, `--compile-graphs` on a GPU) warms each step up
when its pool is bound (`EagerGraph.bind_cache`: one call per size class), then its decode graphs capture more
shapes. This times each step's warm-up (the target, then each MTP layer) and counts the compiled variants it made,
then calls every step at the shapes the decode graphs capture (`--served-shapes`) and counts the variants those
added: each is a compile at load that the export's shipped cache does not hold.

    python -m bench.warm_up --checkpoint models/tiny-dsv3-mtp --out warm_up.json [--device cuda --dtype bf16] \\
        [--served-shapes --max-batch 64 --max-draft-tokens 4 --prefill-tokens 256]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

from bench.common import environment, write_result


def served_shapes(max_batch: int, width: int, prefill_tokens: int) -> list[tuple[int, int]]:
    """(batch, tokens) of every graph a step with decode calls of `width` tokens captures."""
    from triton_mtp.serving.graphs import batch_buckets, prompt_buckets

    prompts = [(b, w) for w, buckets in prompt_buckets(max_batch, width, prefill_tokens).items() for b in buckets]
    return [(b, t) for b in batch_buckets(max_batch) for t in sorted({1, width})] + prompts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--moe", choices=["grouped", "dense"], help="default: the export's for the device and dtype")
    parser.add_argument("--max-slots", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--served-shapes", action="store_true")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--max-draft-tokens", type=int, default=4)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="warm-up-inductor-") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # before torch compiles
        return run(args)


def run(args: argparse.Namespace) -> int:
    """Warm each step up, then (with --served-shapes) call it at the captured shapes; writes args.out."""
    import torch
    from torch._dynamo.utils import counters

    from triton_mtp.export.checkpoint import load_checkpoint
    from triton_mtp.export.formats import DTYPES
    from triton_mtp.export.formats.eager import EagerGraph
    from triton_mtp.export.moe import default_moe_kind
    from triton_mtp.serving.graphs import mtp_width, target_width

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    moe = args.moe or default_moe_kind(device, dtype)
    config, target, mtp = load_checkpoint(args.checkpoint, dtype, device, args.max_slots, args.max_seq_len,
                                          progress=False, moe=moe)
    steps = [("target", EagerGraph(target, target, True))]
    if mtp is not None:
        layers = config.num_nextn_predict_layers
        steps += [(f"mtp_{k}", EagerGraph(mtp, mtp.layer_step(k), True)) for k in range(layers)]
    result = {"checkpoint": args.checkpoint, "device": args.device, "dtype": args.dtype, "moe": moe, "steps": {},
              "environment": environment()}
    for name, graph in steps:
        before = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        graph.bind_cache(graph.module.kv_cache)
        result["steps"][name] = {"warm_up_s": time.perf_counter() - start,
                                 "warm_up_variants": counters["stats"]["unique_graphs"] - before}
        print(f"{name}: warm-up {result['steps'][name]['warm_up_s']:.1f} s, "
              f"{result['steps'][name]['warm_up_variants']} compiled variants", flush=True)
    if args.served_shapes:
        for name, graph in steps:
            if name == "target":
                shapes = served_shapes(args.max_batch, target_width(args.max_draft_tokens), args.prefill_tokens)
            else:  # the MTP captures no prompt graphs
                width = mtp_width(args.max_draft_tokens, config.num_nextn_predict_layers)
                shapes = served_shapes(args.max_batch, width, 0)
            before = counters["stats"]["unique_graphs"]
            start = time.perf_counter()
            for B, T in shapes:
                graph.call_padding(B, T, device)
            result["steps"][name].update(served_shapes=len(shapes), served_s=time.perf_counter() - start,
                                         served_variants=counters["stats"]["unique_graphs"] - before)
            print(f"{name}: {len(shapes)} served shapes, {result['steps'][name]['served_variants']} more variants "
                  f"in {result['steps'][name]['served_s']:.1f} s", flush=True)
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
