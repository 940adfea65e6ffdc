"""Device time of export/linear.py's decode kernel against F.linear (cuBLAS) per shape and kernel configuration:
each linear shape of the DeepSeek-V2-Lite-shaped step (bench/realistic.py) and of the bundled model, one token
(the calls the kernel takes), over BLOCK_N x BLOCK_K x num_warps (bf16, CUDA graphs of back-to-back calls, so
no host time is counted).

    python -m bench.decode_kernels --out decode_kernels.json
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from triton_mtp.export import fused_moe, linear
from triton_mtp.serving.graphs import CapturedStep

from .common import environment, write_result
from .graph_time import replay_ms

# (name, N, K): V2-Lite's projections, dense MLP and head; the bundled model's.
LINEAR_SHAPES = [("v2-lite q_proj", 3072, 2048), ("v2-lite kv_a", 576, 2048), ("v2-lite o_proj", 2048, 2048),
                 ("v2-lite dense gate/up", 10944, 2048), ("v2-lite dense down", 2048, 10944),
                 ("v2-lite lm_head", 102400, 2048), ("bundled q_b", 192, 128), ("bundled kv_a", 80, 256),
                 ("bundled lm_head", 8192, 256)]
LINEAR_CONFIGS = list(itertools.product((4, 8, 16, 32), (64, 128, 256), (4, 8)))  # BLOCK_N, BLOCK_K, num_warps


def graph_us(call, x: torch.Tensor, calls: int = 20, replays: int = 20) -> float:
    """µs a call of `call(x)`: `calls` of them captured in one CUDA graph, whose replays are timed back to back."""
    graph = CapturedStep(lambda x: tuple(call(x) for _ in range(calls)), [x])
    return replay_ms(graph.replay, replays) * 1e3 / calls


def bench_linear(device: torch.device) -> list[dict]:
    rows = []
    for name, N, K in LINEAR_SHAPES:
        x = torch.randn(1, K, dtype=torch.bfloat16, device=device)  # [1, K]
        weight = torch.randn(N, K, dtype=torch.bfloat16, device=device) * 0.02  # [N, K]
        row = {"shape": name, "N": N, "K": K, "cublas_us": graph_us(lambda x: F.linear(x, weight), x)}
        expected = F.linear(x, weight).float()
        kernel = {}
        for block_n, block_k, warps in LINEAR_CONFIGS:
            linear.BLOCK_N, linear.BLOCK_K, linear.NUM_WARPS = block_n, block_k, warps
            error = (linear.decode_linear(x, weight).float() - expected).abs().max().item()
            kernel[f"{block_n}x{block_k}/{warps}"] = {"us": graph_us(lambda x: linear.decode_linear(x, weight), x),
                                                     "max_abs_error": error}
        best = min(kernel, key=lambda c: kernel[c]["us"])
        row.update(kernel=kernel, best=best, best_us=kernel[best]["us"])
        print(f"linear {name}: cuBLAS {row['cublas_us']:.2f} µs, kernel best {best} {row['best_us']:.2f} µs",
              flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", required=True, help="result JSON file")
    args = parser.parse_args(argv)
    fused_moe.load_kernels()
    result = {"benchmark": "decode_kernels", "environment": environment(), "linear": bench_linear(torch.device("cuda"))}
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
