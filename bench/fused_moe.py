"""One grouped MoE layer at decode sizes: the grouped GEMMs against export/fused_moe.py's kernels.

For the V2-Lite shape (hidden 2048, 64 routed experts of 1408, top-6, 2 shared) and the bundled model's
(hidden 256, 8 experts of 48, top-2, 1 shared), and 1 to 64 tokens (a decode step, a k = 3 verify window, batches
of them, where the bundled model's pairs outnumber its experts and the 32 MiB rule of export/fused_moe.py decides):
the layer's time as a replayed CUDA graph with the grouped path and with the kernels at several block
sizes (the shared experts folded into both), with the kernels and the shared experts as their own MLP
(`apart_ms`), the kernels' compiled time (`torch.compile`, as the eager format serves), and the kernels'
error against the grouped path in bf16 and against float32.

    python -m bench.fused_moe --out fused_moe.json
"""
from __future__ import annotations

import argparse
import copy

import torch

from .common import environment, step_time, write_result
from .graphs import wrap_step
from .realistic import v2_lite_config
from triton_mtp.export import fused_moe
from triton_mtp.export.moe import MoE

SHAPES = {
    "v2-lite": {"hidden_size": 2048, "moe_intermediate_size": 1408, "n_routed_experts": 64, "num_experts_per_tok": 6,
                "n_shared_experts": 2, "n_group": 1, "topk_group": 1},
    "tiny": {"hidden_size": 256, "moe_intermediate_size": 48, "n_routed_experts": 8, "num_experts_per_tok": 2,
             "n_shared_experts": 1, "n_group": 2, "topk_group": 1},
}
BLOCKS = ((16, 128), (32, 128), (8, 256), (16, 256), (32, 64))


def moe_layer(shape: dict, device: torch.device, dtype: torch.dtype) -> MoE:
    config = v2_lite_config(2, **shape)
    torch.manual_seed(0)
    moe = MoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    torch.nn.init.normal_(moe.gate.e_score_correction_bias, std=0.01)
    moe = moe.to(device, dtype).eval().requires_grad_(False)
    moe.group_experts()  # after the cast, as a loaded model is grouped: the gate stays float32
    return moe


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    result = {"benchmark": "fused_moe", "environment": environment(), "runs_on": fused_moe.runs_on(device),
              "default_block": [fused_moe.BLOCK_N, fused_moe.BLOCK_K], "shapes": {}}
    for name, shape in SHAPES.items():
        moe = moe_layer(shape, device, torch.bfloat16)
        grouped = copy.deepcopy(moe)
        grouped.fused_decode = False
        reference = copy.deepcopy(grouped).float()
        apart = copy.deepcopy(moe)
        apart.unfold_shared_experts()
        rows = {}
        for tokens in args.tokens:
            x = torch.randn(tokens, 1, shape["hidden_size"], device=device, dtype=torch.bfloat16)  # [N, 1, H]
            with torch.no_grad():
                fused_out, grouped_out, fp32_out = moe(x), grouped(x), reference(x.float())  # [N, 1, H] each
                row = {"error_vs_grouped_bf16": relative_error(fused_out, grouped_out),
                       "error_vs_fp32": relative_error(fused_out, fp32_out),
                       "grouped_error_vs_fp32": relative_error(grouped_out, fp32_out),
                       "grouped_ms": step_time(wrap_step(grouped, "cudagraph", (x,)), (x,), device, args.repeats) * 1e3,
                       "apart_ms": step_time(wrap_step(apart, "cudagraph", (x,)), (x,), device, args.repeats) * 1e3}
            row["kernels_taken"] = tokens <= moe.kernel_tokens()
            try:
                for block_n, block_k in BLOCKS:
                    fused_moe.BLOCK_N, fused_moe.BLOCK_K = block_n, block_k
                    with torch.no_grad():
                        step = wrap_step(moe, "cudagraph", (x,))
                        row[f"fused_ms_{block_n}x{block_k}"] = step_time(step, (x,), device, args.repeats) * 1e3
            finally:
                fused_moe.BLOCK_N, fused_moe.BLOCK_K = result["default_block"]
            if args.compile:
                with torch.no_grad():
                    for label, layer in (("grouped", grouped), ("fused", moe)):
                        step = wrap_step(layer, "reduce-overhead", (x,))
                        row[f"{label}_compiled_ms"] = step_time(step, (x,), device, args.repeats) * 1e3
            rows[tokens] = row
            print(f"fused_moe {name} {tokens} tokens: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
            result["shapes"][name] = rows
            write_result(args.out, result)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="result JSON file")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=[1, 4, 16, 64],
                        help="tokens a call (default 1,4,16,64; `kernels_taken` says where the MoE takes the kernels)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--compile", action="store_true", help="also time both paths under torch.compile")
    run(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
